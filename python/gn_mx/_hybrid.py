"""Keyed CachedOps for hybridized blocks whose traced graph depends on more than the inputs.

A hybridized HybridBlock (MXNet 1.9) traces ``hybrid_forward`` once into a graph and a CachedOp and
reuses them for every later call. Two decisions of gn_mx's blocks are made at trace time from state
that can change between calls, so one cache per block is not enough:

* the mode: ``DecorrelatedBatchNorm`` picks ``gn_dbn`` (batch statistics) or ``gn_dbn_inference``
  (running statistics) from ``autograd.is_training()``, since lib_api gives library ops no
  ``is_train`` flag;
* which parameters accumulate: lib_api passes library ops no ``req`` either, so their backward
  overwrites the gradient buffer; a parameter with ``grad_req='add'`` must reach the op through a
  built-in ``identity`` (which honours 'add'), and the blocks add it only for such parameters
  (``nn.accumulating_params``). ``collect_params().setattr('grad_req', 'add')`` after the first
  call must change the graph.

This module keys the cache of every HybridBlock (parents included, so a plain HybridSequential
holding a gn_mx block is covered) by ``(training mode, which parameters accumulate)``:

* while a block traces (``_get_graph``), the gn_mx blocks inside report what their graph depends
  on: ``note_mode_dependent()``, ``note_grad_req_dependent(params)``. Nested traces pass their
  reports up, so the block that owns the CachedOp learns them;
* the block records those dependencies and the key its graph was traced under;
* each call (``_call_cached_op``) computes the key now; on a change of mode it parks the active
  cache under its key and restores the cache of the new key, or traces it on first use, so
  switching back and forth costs a dict lookup, not a rebuild. A change of the accumulating
  parameters drops every cache instead (see ``_activate``): they were built for gradient buffers
  the grad_req change replaced;
* ``export`` writes the inference graph (building it if the block only ran in training);
* ``_clear_cached_op`` (hybridize(), cast(), new children) drops every key's cache.

Blocks whose graphs depend on neither pay one dict lookup per call. MXNet's private names (the
wrapped methods, the cache attributes) are reached only through ``_compat``.
"""
import json
import threading

from mxnet import autograd
from mxnet import ndarray as nd

from . import _compat, _np

_tls = threading.local()
_STATE = "_gnmx_keyed_cache"  # per-block _Keyed, in the block's __dict__


def is_add(param):
    """Whether ``param`` accumulates its gradient (grad_req 'add')."""
    return param is not None and param.grad_req == "add"


class _Trace:
    """What one symbolic trace depends on, reported by the blocks it traced."""
    __slots__ = ("mode", "params", "input_shapes")

    def __init__(self, input_shapes):
        self.mode = False
        self.params = []
        self.input_shapes = input_shapes

    def merge(self, inner):
        self.mode = self.mode or inner.mode
        self.params.extend(inner.params)


class _Keyed:
    """A block's dependencies, the key of its active cache and the parked caches of other keys."""
    __slots__ = ("mode", "params", "key", "parked", "inputs")

    def __init__(self, mode, params):
        self.mode = mode
        self.params = params
        self.key = None
        self.parked = {}
        self.inputs = None  # (in_format, dtypes, NumPy-interface?) of the traced inputs

    def key_now(self, training=None):
        """The key for the current state (``training``: the mode to use, default the current)."""
        if not self.mode:
            training = None
        elif training is None:
            training = autograd.is_training()
        return (training, tuple([p.grad_req == "add" for p in self.params]))


def note_mode_dependent():
    """Called by a block's hybrid_forward traced with F=mx.sym whose graph depends on
    ``autograd.is_training()``."""
    trace = getattr(_tls, "trace", None)
    if trace is not None:
        trace.mode = True


def note_grad_req_dependent(params):
    """Called by a symbolic trace that chose identity-or-not from these Parameters' grad_req."""
    trace = getattr(_tls, "trace", None)
    if trace is not None:
        trace.params.extend(p for p in params if p is not None)


def is_mode_keyed(block):
    """Whether ``block``'s cache is keyed by the training mode (its last trace reported it)."""
    state = block.__dict__.get(_STATE)
    return state is not None and state.mode


def traced_shape(sym):
    """The shape of symbol `sym` traced inside the current outermost `_get_graph`, inferred from the
    shapes of the concrete arrays that call was given: a tuple (unknown dims 0 or -1), or None when
    not even the rank is known."""
    trace = getattr(_tls, "trace", None)
    shapes = trace.input_shapes if trace is not None else None
    if not shapes:
        return None
    known = {k: v for k, v in shapes.items() if k in set(sym.list_arguments())}
    try:
        _, out_shapes, _ = sym.infer_shape_partial(**known)
    except Exception:  # noqa: BLE001  (an upstream op that cannot infer yet: unknown)
        return None
    if not out_shapes or not out_shapes[0]:
        return None
    return tuple(int(d) for d in out_shapes[0])


def traced_channels(sym):
    """Dimension 1 of symbol `sym` traced inside the current outermost `_get_graph` (0 when
    unknown; see traced_shape). Lets a block whose op attributes depend on C
    (DecorrelatedBatchNorm(group_size=...)) be traced before deferred initialization knows C."""
    shape = traced_shape(sym)
    if shape is None or len(shape) < 2:
        return 0
    return max(shape[1], 0)


def _input_shapes(args):
    """{input variable name: shape} as HybridBlock._get_graph names the inputs of a trace."""
    flat = [a for a in _compat.flatten(list(args), "input")[0] if a is not None]
    names = ["data"] if len(flat) == 1 else [f"data{i}" for i in range(len(flat))]
    return {n: a.shape for n, a in zip(names, flat) if isinstance(a, nd.NDArray)}


def _record(blk, trace, training, args):
    """After `blk` traced its graph: remember what it depends on and the key it was traced under."""
    state = blk.__dict__.get(_STATE)
    if not (trace.mode or trace.params):
        blk.__dict__.pop(_STATE, None)
        return
    params = tuple(dict.fromkeys(trace.params))  # unique, in trace order
    if state is None or state.mode != trace.mode or state.params != params:
        state = _Keyed(trace.mode, params)  # new dependencies: other keys' caches do not apply
        blk.__dict__[_STATE] = state
    state.key = state.key_now(training)
    flat = _compat.flatten(list(args), "input")[0]
    state.inputs = (_compat.hybrid_cache(blk).in_format, [getattr(a, "dtype", None) for a in flat],
                    any(_np.is_np(a) for a in flat))


def _activate(blk, state, key):
    """Make the cache of `key` active (an empty one, traced on the next build, if it has none)."""
    if key == state.key:
        return
    if key[1] == state.key[1]:
        state.parked[state.key] = _compat.hybrid_cache(blk)
    else:
        # NB: a grad_req change re-allocates the parameters' gradient buffers (Parameter's
        # grad_req setter), and a static_alloc CachedOp built before it, restored after a
        # 'write' -> 'add' -> 'write' round trip, computed zero gradients (seen in
        # test_grad_req_switch_after_hybridize_retraces[static]): such caches are dropped, not
        # parked, whatever their mode.
        state.parked.clear()
    saved = state.parked.pop(key, None)
    _compat.set_hybrid_cache(blk, saved if saved is not None and saved.op is not None else None)
    state.key = key


def _fence_aux(blk, out):
    """static_alloc workaround. A static CachedOp pushes each library op with its inputs as read
    dependencies only, so the in-place running-statistics update of gn_dbn is invisible to the
    engine: a later read (save_parameters, export, .asnumpy()) could copy the value from before
    the update (observed; non-static CachedOps and imperative calls are fine). Re-writing each aux
    state with an op that depends on the block's output (which exists only after gn_dbn ran)
    orders every later reader after the update. Costs two tiny ops per aux state and call."""
    leaf = out
    while isinstance(leaf, (list, tuple)):
        leaf = leaf[0]
    leaf = _np.to_legacy(leaf)  # NumPy-interface outputs: a zero-copy legacy view
    if not isinstance(leaf, nd.NDArray):
        return
    cache = _compat.hybrid_cache(blk)
    key = id(cache.op)
    cached = blk.__dict__.get("_gnmx_aux")
    if cached is None or cached[0] != key:
        names = set(cache.graph[1].list_auxiliary_states())
        params = [p for is_arg, p in cache.op_args if not is_arg and p.name in names]
        cached = (key, params)
        blk.__dict__["_gnmx_aux"] = cached
    if not cached[1]:
        return
    with autograd.pause():  # not part of the graph; in-place writes are fine outside record
        dep = nd.zeros_like(nd.slice_axis(leaf.reshape((-1,)), axis=0, begin=0, end=1))
        for p in cached[1]:
            d = _np.to_legacy(p.data(leaf.context))
            nd.broadcast_add(d, dep.astype(d.dtype, copy=False).reshape((1,) * d.ndim), out=d)


def _placeholders(fmt, dtypes, np_kind=False):
    """Inputs with the structure `fmt` (from gluon's _flatten): 0 = an array, -1 = None; arrays
    get the recorded input dtypes (they matter for the dtype inference of the trace) and the
    recorded array kind (NumPy-interface arrays trace np symbols)."""
    if isinstance(fmt, int):
        dtype = next(dtypes, None)
        return None if fmt == -1 else _np.like(nd.zeros((1,), dtype=dtype or "float32"), np_kind)
    return [_placeholders(f, dtypes, np_kind) for f in fmt]


# The wrappers of HybridBlock's methods (installed by _compat.wrap_hybrid_block).

def _get_graph(orig):
    def get_graph(self, *args):
        if _compat.hybrid_cache(self).graph:
            return orig(self, *args)
        outer = getattr(_tls, "trace", None)
        # The outermost trace's inputs are the graph's variables (for traced_channels).
        trace = _Trace(outer.input_shapes if outer is not None else _input_shapes(args))
        training = autograd.is_training()
        _tls.trace = trace
        try:
            res = orig(self, *args)
        finally:
            _tls.trace = outer
        if outer is not None:
            outer.merge(trace)
        _record(self, trace, training, args)
        return res
    return get_graph


def _has_gn_layer(block):
    """Whether `block` or a block below it is a gn_mx layer (class attribute _gnmx_layer), or its
    traced graph (an imported SymbolBlock's included) holds a gn_mx op."""
    if getattr(type(block), "_gnmx_layer", False):
        return True
    graph = _compat.hybrid_cache(block).graph
    if graph and any(n["op"].startswith("gn_")
                     for n in json.loads(graph[1].tojson())["nodes"]):
        return True
    return any(_has_gn_layer(c) for c in _compat.children(block))


def _check_empty_np_batch(blk, args):
    """A hybridized graph runs the ops on whatever it is given, and the ops reject zero-size data
    (MXNet then returned a shape-() result and raised only at the next synchronization). Under
    the NumPy interface an empty batch is a legal array: refuse it here, at the call, when the
    graph holds gn_mx layers (a gn_mx block called directly returns an empty output instead)."""
    for a in args:
        if _np.is_np(a) and isinstance(a, nd.NDArray) and 0 in a.shape and _has_gn_layer(blk):
            raise ValueError(
                f"{type(blk).__name__} '{blk.name}': input of shape {a.shape} is empty; the "
                f"gn_mx layers inside this hybridized block need at least one sample (skip the "
                f"call for an empty batch, or call those layers un-hybridized: they then return "
                f"an empty output)")


def _call_cached_op(orig):
    def call_cached_op(self, *args):
        _check_empty_np_batch(self, args)
        state = self.__dict__.get(_STATE)
        training = None  # asked of autograd (a C call) only for mode-keyed blocks, once
        if state is not None:
            if state.mode:
                training = autograd.is_training()
            _activate(self, state, state.key_now(training))
        out = orig(self, *args)
        # Looked up again: the first call traces the graph and only then knows its dependencies.
        state = self.__dict__.get(_STATE)
        if state is not None and state.mode:
            if training is None:
                training = autograd.is_training()
            if training and _compat.static_alloc(self):
                _fence_aux(self, out)
        return out
    return call_cached_op


def _clear_cached_op(orig):
    def clear_cached_op(self):
        self.__dict__.pop(_STATE, None)
        return orig(self)
    return clear_cached_op


def _export(orig):
    def export(self, path, epoch=0, remove_amp_cast=True):
        state = self.__dict__.get(_STATE)
        if state is not None and state.mode:
            # NB: with static_alloc, a running-statistics update of the training CachedOp can
            # still be in flight when export copies the parameters (seen as stale aux values in
            # the .params file); wait for it.
            nd.waitall()
            _activate(self, state, (False, state.key[1]))
            if _compat.hybrid_cache(self).op is None:
                # Only training ran so far: trace and build the inference graph now. The graph
                # needs just the input structure, so placeholders stand in for the inputs.
                fmt, dtypes, np_kind = state.inputs
                with autograd.predict_mode():
                    _compat.build_hybrid_cache(self, *_placeholders(fmt, iter(dtypes), np_kind))
        return orig(self, path, epoch=epoch, remove_amp_cast=remove_amp_cast)
    return export


_compat.wrap_hybrid_block(_get_graph=_get_graph, _call_cached_op=_call_cached_op,
                          _clear_cached_op=_clear_cached_op, export=_export)
