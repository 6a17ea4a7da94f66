"""gn_mx and MXNet's AMP (``mxnet.contrib.amp``), float16 and bfloat16.

``import gn_mx`` calls :func:`install`, which

1. puts the gn_mx ops into AMP's op lists, so ``amp.init()``, ``amp.convert_symbol`` and
   ``amp.convert_hybrid_block`` know them (the converters reject op names in none of the lists):

   ===================================== ============================ ==========================
   op                                    float16 AMP                  bfloat16 AMP
   ===================================== ============================ ==========================
   ``gn_group_norm``, ``gn_moments``     ``FP16_FUNCS``: fp16 data,   ``FP32_FUNCS`` (MXNet 1.9's
                                         fp32 accumulation and stats  ``lib_api`` has no bf16)
   ``gn_dbn``, ``gn_dbn_inference``      ``FP32_FUNCS``               ``FP32_FUNCS``
   ``gn_weight_standardize`` (WSConv)    ``FP32_FUNCS``               ``FP32_FUNCS``
   ``gn_channel_affine`` (old DBN)       ``FP16_FP32_FUNCS``: no cast ``FP32_FUNCS``
   ``gn_sync_sum``, ``gn_dbn_whiten``,   ``FP16_FP32_FUNCS``: no cast ``FP32_FUNCS``
   ``gn_dbn_local_sums``,
   ``gn_dbn_local_cov`` (SyncDBN
   training, float64 statistics)
   ``gn_dbn_apply`` (SyncDBN training)   ``FP16_FP32_FUNCS``: no cast ``FP32_FUNCS``
   ===================================== ============================ ==========================

   NB: DBN whitens with ``Sigma^{-1/2}`` from an eigendecomposition. Its conditioning is the
   covariance's (up to 1/eps); fp16's 10-bit mantissa and 65504 range would turn small eigenvalues
   into noise or inf, and the projection is an aux state updated in place, so DBN stays fp32 (the
   running statistics are never cast, which also keeps their in-place update visible).
   Weight Standardization (``gn_mx.WSConv*D``) standardizes the float32 master weight with float32
   statistics; AMP then casts only its output for the float16 convolution.

2. keeps ``amp.init()`` working in both import orders. ``mx.library.load`` regenerates every op
   function in ``mx.nd`` / ``mx.sym`` and their submodules, which silently drops the wrappers an
   earlier ``amp.init()`` installed (for *all* ops, not only ours). :func:`install` snapshots those
   wrappers before the library is loaded, rebuilds each one around the regenerated function after,
   and wraps the gn_mx ops the way ``amp.init()`` would have. When ``amp.init()`` runs after
   ``import gn_mx`` it finds our ops in its lists and wraps them itself.

MXNet 1.9.1 on CPU (found by experiment; see docs/amp_and_small_batch.md):

- no float16 Convolution / FullyConnected / dot ("FP16 gemm on cpu not implemented"): use
  :func:`cpu_init_kwargs` / :func:`cpu_convert_kwargs`, which move the gemm ops to the fp32 list;
- AMP's imperative (non-hybridized) casts skip float16 -> float32 on CPU, so an fp16 activation
  reaches an fp32-only op uncast: hybridize the net before the first forward;
- ``amp_multicast`` fails on CPU with float16 inputs, so widest-type ops (``broadcast_*``, ``+``)
  that see an fp16 input break there. gn_mx therefore applies every affine natively:
  ``GroupNorm`` inside ``gn_group_norm``, ``DecorrelatedBatchNorm`` inside ``gn_dbn`` /
  ``gn_dbn_inference`` (``affine=True``; graphs exported before that apply ``gn_channel_affine``).
"""
import threading
import types

import numpy as np

from . import _compat  # the friendly "needs MXNet 1.9.1" errors come first
from ._compat import amp_module as _amp, mx

__all__ = ["LP16_OPS", "FP32_OPS", "EITHER_OPS", "CPU_FP32_GEMM_OPS", "install", "register", "registered_ops",
           "cpu_op_lists", "cpu_init_kwargs", "cpu_convert_kwargs"]

#: Ops that run in float16 under float16 AMP (fp32 accumulation and statistics inside the op).
LP16_OPS = ("gn_group_norm", "gn_moments")
#: Ops that AMP always runs in float32 (eigendecomposition, in-place running statistics; the
#: standardization of a float32 master weight).
FP32_OPS = ("gn_dbn", "gn_dbn_inference", "gn_weight_standardize")
#: Ops that run in whatever precision reaches them (AMP inserts no casts): DecorrelatedBatchNorm's
#: fused affine takes float16 or float32 data, with float32 (master) gamma/beta for either.
#: Synchronized DBN's training ops: its statistics are float64 whatever the data's dtype, and
#: gn_dbn_local_sums / gn_dbn_local_cov / gn_dbn_apply take float16 / float32 / float64 data.
EITHER_OPS = ("gn_channel_affine", "gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply",
              "gn_dbn_local_sums", "gn_dbn_local_cov")
#: MXNet 1.9.1 has no CPU float16 gemm: AMP on CPU must run these in float32. (``dot`` and
#: ``batch_dot`` are widest-type ops, which the converters refuse in any other list: they stay
#: float32 as long as no float16 tensor reaches them.)
CPU_FP32_GEMM_OPS = ("Convolution", "Deconvolution", "FullyConnected", "RNN")

_lock = threading.Lock()


def _available(name):
    # amp.init() raises AttributeError on a listed name that mx.nd / mx.sym lack, so only ops the
    # loaded library registered are listed (a library built from an older tree may lack some).
    return hasattr(mx.nd, name) and hasattr(mx.sym, name)


def registered_ops():
    """The gn_mx ops that are loaded and hence put in AMP's lists.

    Returns
    -------
    lp16_ops, fp32_ops : tuple of str
        The loaded ops of :data:`LP16_OPS` and of :data:`FP32_OPS`.

    Examples
    --------
    >>> gn_mx.amp.registered_ops()
    (('gn_group_norm', 'gn_moments'), ('gn_dbn', 'gn_dbn_inference', 'gn_weight_standardize'))
    """
    return (tuple(n for n in LP16_OPS if _available(n)),
            tuple(n for n in FP32_OPS if _available(n)))


def _add(lst, names):
    for n in names:
        if n not in lst:
            lst.append(n)


def register():
    """Put the loaded gn_mx ops into AMP's float16 and bfloat16 op lists (idempotent).

    The lists are module-level and shared by ``amp.init``, ``amp.convert_symbol``,
    ``amp.convert_model`` and ``amp.convert_hybrid_block``. ``import gn_mx`` calls it.

    Returns
    -------
    lp16_ops, fp32_ops : tuple of str
        :func:`registered_ops`.

    Examples
    --------
    >>> from mxnet.contrib.amp.lists import symbol_fp16
    >>> lp16, fp32 = gn_mx.amp.register()
    >>> 'gn_group_norm' in symbol_fp16.FP16_FUNCS and 'gn_dbn' in symbol_fp16.FP32_FUNCS
    True
    """
    lp16, fp32 = registered_ops()
    fp16_lists = _compat.amp_fp16_lists()
    with _lock:
        _add(fp16_lists.FP16_FUNCS, lp16)
        _add(fp16_lists.FP32_FUNCS, fp32)
        either = tuple(n for n in EITHER_OPS if _available(n))
        _add(fp16_lists.FP16_FP32_FUNCS, either)
        bf16_lists = _compat.amp_bf16_lists()
        if bf16_lists is not None:
            _add(bf16_lists.FP32_FUNCS, lp16 + fp32 + either)
    return lp16, fp32


# ------------------------------------------------------------------------------------------------
# Surviving mx.library.load after amp.init()

def _is_amp_wrapper(fn):
    return (isinstance(fn, types.FunctionType) and fn.__globals__ is _amp.__dict__
            and "f" in fn.__code__.co_freevars)


def _op_modules():
    """Every module object that mx.library.load regenerates and amp.init() writes wrappers into."""
    mods = []
    for root in (mx.ndarray, mx.symbol):
        mods += [root, root.op, root._internal]
        for prefix in _compat.OP_NAME_PREFIXES:
            sub = getattr(root, prefix[1:-1], None)
            if isinstance(sub, types.ModuleType):
                mods.append(sub)
    unique = []
    for m in mods:
        if all(m is not u for u in unique):
            unique.append(m)
    return unique


def _snapshot():
    """[(module, name, wrapper)] for every AMP wrapper currently installed."""
    snap = []
    for mod in _op_modules():
        for name, fn in list(vars(mod).items()):
            if _is_amp_wrapper(fn):
                snap.append((mod, name, fn))
    return snap


def _cell_value(fn, var):
    return fn.__closure__[fn.__code__.co_freevars.index(var)].cell_contents


def _rebuild(wrapper, base_fn):
    """The same AMP wrapper (same code, same closure values) around ``base_fn``.

    A function wrapped twice (e.g. an op in the fp32 list and the widest-type list, or a loss
    output) is rebuilt layer by layer.
    """
    inner = _cell_value(wrapper, "f")
    new_inner = _rebuild(inner, base_fn) if _is_amp_wrapper(inner) else base_fn
    cells = tuple(types.CellType(new_inner) if var == "f" else cell
                  for var, cell in zip(wrapper.__code__.co_freevars, wrapper.__closure__))
    new = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__,
                             wrapper.__defaults__, cells)
    new.__dict__.update(wrapper.__dict__)
    new.__module__ = wrapper.__module__
    new.__doc__ = wrapper.__doc__
    new.__kwdefaults__ = wrapper.__kwdefaults__
    return new


def _target_dtype(snap):
    """The low-precision dtype amp.init() was called with, read from its wrappers' closures."""
    for _, _, fn in snap:
        while _is_amp_wrapper(fn):
            if "target_dtype" in fn.__code__.co_freevars:
                t = _cell_value(fn, "target_dtype")
                if t is not np.float32 and t != np.dtype(np.float32):
                    return t
            fn = _cell_value(fn, "f")
    return np.dtype(np.float16)


def _restore(snap):
    for mod, name, old in snap:
        fresh = getattr(mod, name, None)
        if fresh is None or _is_amp_wrapper(fresh):
            continue  # not regenerated (or already wrapped again): nothing was lost
        setattr(mod, name, _rebuild(old, fresh))


def _wrap_our_ops(target_dtype):
    """Wrap the gn_mx ops as amp.init(target_dtype) would (their names were not in its lists)."""
    is_bf16 = target_dtype == _amp.bfloat16
    lp16, fp32 = registered_ops()
    if is_bf16:  # bf16 AMP: every gn_mx op is in FP32_FUNCS (see register)
        either = tuple(n for n in EITHER_OPS if _available(n))
        lp16, fp32 = (), lp16 + fp32 + either
    lp16 = [n for n in lp16 if not _is_amp_wrapper(getattr(mx.nd, n))]
    fp32 = [n for n in fp32 if not _is_amp_wrapper(getattr(mx.nd, n))]
    if not lp16 and not fp32:
        return
    # _wrap_symbol_functions always re-wraps the whole widest-type list as well; those wrappers
    # were restored from the snapshot already, so hand it an empty one for this call.
    saved = _amp.list_widest_type_cast
    _amp.list_widest_type_cast = lambda _dtype: []
    try:
        for module in (mx.symbol, mx.ndarray):
            _amp._wrap_symbol_functions(module, target_dtype, target_precision_ops=lp16,
                                        conditional_fp32_ops=[], fp32_ops=fp32)
    finally:
        _amp.list_widest_type_cast = saved


def install(load_library):
    """Load the op library via ``load_library()`` without losing AMP state, then register.

    Called once by ``gn_mx/__init__.py``; safe to call again (loading is idempotent).

    Parameters
    ----------
    load_library : callable
        Loads the op library (``mx.library.load``) and returns something (gn_mx passes its
        loader, which returns the library's path).

    Returns
    -------
    object
        What ``load_library()`` returned.

    Examples
    --------
    >>> gn_mx.amp.install(lambda: 'loaded')
    'loaded'
    """
    with _lock:
        snap = _snapshot() if _amp._amp_initialized else []
        try:
            result = load_library()
        finally:
            if snap:
                _restore(snap)
    register()
    if _amp._amp_initialized:
        with _lock:
            _wrap_our_ops(_target_dtype(snap))
    return result


# ------------------------------------------------------------------------------------------------
# Op lists for AMP on CPU

def cpu_op_lists(target_dtype="float16"):
    """``(target_dtype_ops, fp32_ops, conditional_fp32_ops)`` for float16 AMP on an MXNet 1.9.1 CPU.

    The defaults (gn_mx ops included) with :data:`CPU_FP32_GEMM_OPS` moved to the fp32 list: MXNet
    1.9.1 has no float16 gemm on CPU. On a GPU use the defaults (plain ``amp.init()``).

    Parameters
    ----------
    target_dtype : str, default 'float16'
        Only 'float16' (bfloat16 AMP's defaults already run the gemm ops in a CPU-supported way).

    Returns
    -------
    target_dtype_ops, fp32_ops : list of str
        Op names.
    conditional_fp32_ops : list of tuple
        ``(op, attribute, values)`` entries, as AMP's lists have them.

    Raises
    ------
    ValueError
        ``target_dtype`` other than float16.

    Examples
    --------
    >>> lp16, fp32, cond = gn_mx.amp.cpu_op_lists()
    >>> 'Convolution' in fp32 and 'Convolution' not in lp16 and 'gn_group_norm' in lp16
    True
    """
    if target_dtype not in ("float16", np.float16):
        raise ValueError(f"gn_mx.amp.cpu_op_lists: only float16 needs CPU lists; got {target_dtype!r}")
    register()
    gemm = set(CPU_FP32_GEMM_OPS)
    lp16 = [n for n in _amp.list_lp16_ops(target_dtype) if n not in gemm]
    fp32 = list(_amp.list_fp32_ops(target_dtype))
    _add(fp32, CPU_FP32_GEMM_OPS)
    cond = [c for c in _amp.list_conditional_fp32_ops(target_dtype) if c[0] not in gemm]
    return lp16, fp32, cond


def cpu_init_kwargs():
    """Keyword arguments for ``amp.init(**gn_mx.amp.cpu_init_kwargs())`` on CPU (float16).

    Returns
    -------
    dict
        ``target_dtype``, ``target_precision_ops``, ``fp32_ops``, ``conditional_fp32_ops``
        (:func:`cpu_op_lists`).

    Examples
    --------
    >>> sorted(gn_mx.amp.cpu_init_kwargs())
    ['conditional_fp32_ops', 'fp32_ops', 'target_dtype', 'target_precision_ops']
    """
    lp16, fp32, cond = cpu_op_lists()
    return {"target_dtype": "float16", "target_precision_ops": lp16, "fp32_ops": fp32,
            "conditional_fp32_ops": cond}


def cpu_convert_kwargs():
    """Keyword arguments for ``amp.convert_hybrid_block`` / ``amp.convert_symbol`` on CPU (float16).

    Returns
    -------
    dict
        ``target_dtype``, ``target_dtype_ops``, ``fp32_ops``, ``conditional_fp32_ops``
        (:func:`cpu_op_lists`).

    Examples
    --------
    >>> sorted(gn_mx.amp.cpu_convert_kwargs())
    ['conditional_fp32_ops', 'fp32_ops', 'target_dtype', 'target_dtype_ops']
    """
    lp16, fp32, cond = cpu_op_lists()
    return {"target_dtype": "float16", "target_dtype_ops": lp16, "fp32_ops": fp32,
            "conditional_fp32_ops": cond}
