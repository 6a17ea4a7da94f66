"""Mode-keyed CachedOps for hybridized blocks that contain train/inference-dependent gn_mx ops.

MXNet's lib_api gives library ops no ``is_train`` flag, so ``DecorrelatedBatchNorm`` chooses between
``gn_dbn`` (batch statistics) and ``gn_dbn_inference`` (running statistics) in ``hybrid_forward``
from ``autograd.is_training()``. Imperatively that is exact. Hybridized, MXNet 1.9 traces
``hybrid_forward`` once per ``hybridize()`` into a CachedOp and reuses it in both modes: the block,
or any hybridized parent that contains it, would silently keep the mode of its first call.

This module fixes that for every HybridBlock, parents included, without user action:
  * a symbolic trace of a mode-dependent block calls ``note_modal_trace()``;
  * the ``_get_graph`` of the hybridized block that owns the trace (the outermost one) records that
    its graph is mode-dependent and which mode it was traced in;
  * its ``_call_cached_op`` compares the current ``autograd.is_training()`` with the mode of the
    active cache; on a mismatch it parks the active cache (graph, CachedOp, argument map, formats)
    under its mode and restores the other mode's cache, tracing it on first use. Each mode keeps
    its own CachedOp, so switching back and forth costs a dict lookup, not a rebuild;
  * ``export`` always writes the inference graph (building it if the block only ran in training);
  * ``_clear_cached_op`` (hybridize(), new children) drops both caches.
Blocks whose graphs contain no mode-dependent gn_mx op are untouched (one attribute lookup).
"""
import collections
import threading

from mxnet import autograd

from . import _compat, _np

_tls = threading.local()
# One mode's cache: the HybridBlock attributes (MXNet 1.9.1 private names, checked by _compat)
# that together make up a traced graph and its CachedOp.
_Cache = collections.namedtuple("_Cache", "graph op op_args in_format out_format")
_CACHE_ATTRS = _Cache("_cached_graph", "_cached_op", "_cached_op_args", "_in_format",
                      "_out_format")
_EMPTY = _Cache(graph=(), op=None, op_args=[], in_format=None, out_format=None)
_MODES = "_gnmx_modes"


def note_modal_trace():
    """Called by a block's hybrid_forward when it is traced with F=mx.sym and is mode-dependent."""
    _tls.count = getattr(_tls, "count", 0) + 1


def traced_channels(sym):
    """Dimension 1 of symbol `sym` traced inside the current outermost `_get_graph`, inferred from
    the shapes of the concrete arrays that call was given (0 when unknown). Lets a block whose op
    attributes depend on C (DecorrelatedBatchNorm(group_size=...)) be traced before deferred
    initialization knows C."""
    shapes = getattr(_tls, "input_shapes", None)
    if not shapes:
        return 0
    known = {k: v for k, v in shapes.items() if k in set(sym.list_arguments())}
    try:
        _, out_shapes, _ = sym.infer_shape_partial(**known)
    except Exception:  # noqa: BLE001  (an upstream op that cannot infer yet: unknown)
        return 0
    if not out_shapes or not out_shapes[0] or len(out_shapes[0]) < 2:
        return 0
    return max(int(out_shapes[0][1]), 0)


def _input_shapes(args):
    """{input variable name: shape} as HybridBlock._get_graph names the inputs of a trace."""
    from mxnet import ndarray as nd
    flat = [a for a in _compat.flatten(list(args), "input")[0] if a is not None]
    names = ["data"] if len(flat) == 1 else [f"data{i}" for i in range(len(flat))]
    return {n: a.shape for n, a in zip(names, flat) if isinstance(a, nd.NDArray)}


def _park(blk):
    return _Cache(*(getattr(blk, a) for a in _CACHE_ATTRS))


def _restore(blk, saved):
    for a, v in zip(_CACHE_ATTRS, saved):
        object.__setattr__(blk, a, v)


def _reset(blk):
    _restore(blk, _EMPTY)


def _switch(blk, training):
    """Make the cache of mode `training` active on a mode-dependent block."""
    modes = blk.__dict__.get(_MODES)
    if modes is None or modes["current"] == training:
        return
    modes[modes["current"]] = _park(blk)
    saved = modes.pop(training, None)
    if saved is not None and saved.op is not None:
        _restore(blk, saved)
    else:
        _reset(blk)  # traced on the next call (or by export) under the new mode
    modes["current"] = training


def _fence_aux(blk, out):
    """static_alloc workaround. A static CachedOp pushes each library op with its inputs as read
    dependencies only, so the in-place running-statistics update of gn_dbn is invisible to the
    engine: a later read (save_parameters, export, .asnumpy()) could copy the value from before
    the update (observed; non-static CachedOps and imperative calls are fine). Re-writing each aux
    state with an op that depends on the block's output (which exists only after gn_dbn ran)
    orders every later reader after the update. Costs two tiny ops per aux state and call."""
    from mxnet import ndarray as nd
    leaf = out
    while isinstance(leaf, (list, tuple)):
        leaf = leaf[0]
    leaf = _np.to_legacy(leaf)  # NumPy-interface outputs: a zero-copy legacy view
    if not isinstance(leaf, nd.NDArray):
        return
    key = id(blk._cached_op)
    cached = blk.__dict__.get("_gnmx_aux")
    if cached is None or cached[0] != key:
        names = set(blk._cached_graph[1].list_auxiliary_states())
        params = [p for is_arg, p in blk._cached_op_args if not is_arg and p.name in names]
        cached = (key, params)
        blk.__dict__["_gnmx_aux"] = cached
    if not cached[1]:
        return
    with autograd.pause():  # not part of the graph; in-place writes are fine outside record
        dep = nd.zeros_like(nd.slice_axis(leaf.reshape((-1,)), axis=0, begin=0, end=1))
        for p in cached[1]:
            d = _np.to_legacy(p.data(leaf.context))
            nd.broadcast_add(d, dep.astype(d.dtype, copy=False).reshape((1,) * d.ndim), out=d)


def _install():
    HB = _compat.gluon_block.HybridBlock
    if getattr(HB, "_gnmx_modal_installed", False):
        return
    orig_get_graph = HB._get_graph
    orig_call_cached_op = HB._call_cached_op
    orig_clear = HB._clear_cached_op
    orig_export = HB.export

    def _get_graph(self, *args):
        if self._cached_graph:
            return orig_get_graph(self, *args)
        outer = getattr(_tls, "count", 0)
        outer_shapes = getattr(_tls, "input_shapes", None)
        training = autograd.is_training()
        _tls.count = 0
        if outer_shapes is None:  # the outermost trace: its inputs are the graph's variables
            _tls.input_shapes = _input_shapes(args)
        try:
            res = orig_get_graph(self, *args)
            traced = _tls.count
        finally:
            _tls.count = outer + getattr(_tls, "count", 0)
            _tls.input_shapes = outer_shapes
        if traced:
            modes = self.__dict__.get(_MODES)
            if modes is None:
                object.__setattr__(self, _MODES, {"current": training})
            else:
                modes["current"] = training
            flat = _compat.flatten(list(args), "input")[0]
            self.__dict__[_MODES]["dtypes"] = [getattr(a, "dtype", None) for a in flat]
            self.__dict__[_MODES]["np"] = any(_np.is_np(a) for a in flat)
        return res

    def _call_cached_op(self, *args):
        training = autograd.is_training()
        if _MODES in self.__dict__:
            _switch(self, training)
        out = orig_call_cached_op(self, *args)
        # Checked after the call too: the first call traces the graph and only then knows
        # whether it is mode-dependent.
        if (training and _MODES in self.__dict__
                and any(k == "static_alloc" and v for k, v in self._flags)):
            _fence_aux(self, out)
        return out

    def _clear_cached_op(self):
        self.__dict__.pop(_MODES, None)
        return orig_clear(self)

    def export(self, path, epoch=0, remove_amp_cast=True):
        modes = self.__dict__.get(_MODES)
        if modes is not None:
            # NB: with static_alloc, a running-statistics update of the training CachedOp can
            # still be in flight when export copies the parameters (seen as stale aux values in
            # the .params file); wait for it.
            from mxnet import ndarray as nd
            nd.waitall()
            _switch(self, False)
            if self._cached_op is None:
                # Only training ran so far: trace and build the inference graph now. The graph
                # needs just the input structure, so placeholders stand in for the inputs.
                placeholders = _placeholders(modes[True].in_format, iter(modes.get("dtypes", [])),
                                             modes.get("np", False))
                with autograd.predict_mode():
                    self._build_cache(*placeholders)
                modes["current"] = False
        return orig_export(self, path, epoch=epoch, remove_amp_cast=remove_amp_cast)

    HB._get_graph = _get_graph
    HB._call_cached_op = _call_cached_op
    HB._clear_cached_op = _clear_cached_op
    HB.export = export
    HB._gnmx_modal_installed = True


def _placeholders(fmt, dtypes, np_kind=False):
    """Inputs with the structure `fmt` (from gluon's _flatten): 0 = an array, -1 = None; arrays
    get the recorded input dtypes (they matter for the dtype inference of the trace) and the
    recorded array kind (NumPy-interface arrays trace np symbols)."""
    from mxnet import ndarray as nd
    if isinstance(fmt, int):
        dtype = next(dtypes, None)
        return None if fmt == -1 else _np.like(nd.zeros((1,), dtype=dtype or "float32"), np_kind)
    return [_placeholders(f, dtypes, np_kind) for f in fmt]


_install()
