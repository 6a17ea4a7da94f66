"""Every private MXNet name gn_mx relies on, in one place, checked once at import.

gn_mx replaces these MXNet internals (they have no public hook):

* four methods of ``gluon.HybridBlock`` (``_get_graph``, ``_call_cached_op``, ``_clear_cached_op``,
  ``export``), wrapped by ``_hybrid.py`` (CachedOps keyed by training mode and accumulating
  parameters) through :func:`wrap_hybrid_block`;
* ``mxnet.symbol.register._symbol_creator``, wrapped by ``_symbolic.py`` (shape placeholders for
  shapeless parameter variables; it also wraps the public ``mx.sym.load`` / ``load_json``);
* AMP's wrapper closures around ``mx.nd`` / ``mx.sym`` op functions, rebuilt by ``amp.py`` after
  ``mx.library.load`` regenerated the functions.

and reads or calls these:

* HybridBlock's cache attributes (:func:`hybrid_cache`, :func:`set_hybrid_cache`, :func:`static_alloc`)
  and ``_build_cache`` (``_hybrid.py``); ``mxnet.gluon.block._flatten`` (:data:`flatten`);
* AMP's state, op lists and ``_wrap_symbol_functions`` (``amp.py``);
* ``Symbol._set_attr`` and ``mxnet.base._LIB.NNGetOpHandle`` (:func:`op_handle`, ``_symbolic.py``);
* ``mxnet.base._OP_NAME_PREFIX_LIST`` (``amp.py``);
* a Trainer's kvstore creation and initial broadcast, ``Block._children`` (``parallel.py``);
* the current ``NameManager`` (``sym.py``);
* a HybridBlock's hybridize() state and ``_clear_cached_op`` (:func:`copy_hybridize_state`,
  :func:`clear_cached_op`, ``_convert.py``).

All were written against MXNet 1.9.1. :func:`check` verifies at ``import gn_mx`` that each name
still exists with the expected kind, so a different MXNet fails at import with a message naming
what is missing, never later with an AttributeError deep inside a training step. Modules that use
the names reach them through here.
"""
import collections
import ctypes
import types

from ._library import _import_mxnet

# Imported through _import_mxnet first: without MXNet 1.9 that raises the install hint, where the
# imports below would fail with a bare ModuleNotFoundError / AttributeError.
mx = _import_mxnet()

from mxnet import base as _base  # noqa: E402
from mxnet.contrib.amp import amp as amp_module  # noqa: E402
from mxnet.contrib.amp import lists as amp_lists  # noqa: E402
from mxnet.gluon import block as gluon_block  # noqa: E402
from mxnet.symbol import register as symbol_register  # noqa: E402

#: The MXNet release these internals were read from (and tested with).
TESTED_MXNET = "1.9.1"

#: HybridBlock methods _hybrid.py wraps (called with the same signatures as in 1.9.1).
HYBRID_WRAPPED = ("_get_graph", "_call_cached_op", "_clear_cached_op", "export")
#: Every HybridBlock method gn_mx relies on: the wrapped ones and ``_build_cache`` (called).
HYBRID_METHODS = HYBRID_WRAPPED + ("_build_cache",)
#: One traced graph and its CachedOp: the HybridBlock instance attributes that hold them (set in
#: __init__ / _clear_cached_op / _build_cache), in HybridCache's field order.
HybridCache = collections.namedtuple("HybridCache", "graph op op_args in_format out_format")
_CACHE_FIELDS = HybridCache("_cached_graph", "_cached_op", "_cached_op_args", "_in_format",
                            "_out_format")
#: All HybridBlock instance attributes gn_mx reads: the cache and the hybridize() flags.
HYBRID_CACHE_ATTRS = tuple(_CACHE_FIELDS) + ("_flags",)
#: AMP module functions / state used by amp.py.
AMP_NAMES = ("_amp_initialized", "_wrap_symbol_functions", "list_widest_type_cast",
             "list_lp16_ops", "list_fp32_ops", "list_conditional_fp32_ops", "bfloat16")
AMP_LIST_NAMES = ("FP16_FUNCS", "FP32_FUNCS", "FP16_FP32_FUNCS")

#: gluon.Trainer internals used by parallel.py (kvstore creation and the initial broadcast).
TRAINER_METHODS = ("_init_kvstore", "_init_params")
TRAINER_ATTRS = ("_kv_initialized", "_kvstore", "_params", "_update_on_kvstore",
                 "_params_to_init")

#: Symbol internals used by _symbolic.py (rank placeholders for shapeless parameter variables):
#: the creator every generated mx.sym.* function calls, attribute setting, the C API handle.
SYMBOL_NAMES = ("mxnet.symbol.register._symbol_creator", "Symbol._set_attr", "mxnet.base._LIB")

#: The prefixes of op submodules (``mx.nd.contrib``...) that mx.library.load regenerates.
OP_NAME_PREFIXES = _base._OP_NAME_PREFIX_LIST if hasattr(_base, "_OP_NAME_PREFIX_LIST") else None
#: gluon's structure flattener (used to record input formats).
flatten = getattr(gluon_block, "_flatten", None)


class IncompatibleMXNet(ImportError):
    pass


def _missing():
    missing = []
    HB = gluon_block.HybridBlock
    missing += [f"HybridBlock.{m}" for m in HYBRID_METHODS if not callable(getattr(HB, m, None))]
    try:
        probe = HB()
        missing += [f"HybridBlock().{a}" for a in HYBRID_CACHE_ATTRS if not hasattr(probe, a)]
    except Exception as e:  # a constructor that needs arguments is itself a change
        missing.append(f"HybridBlock() ({e})")
    missing += [f"mxnet.contrib.amp.amp.{n}" for n in AMP_NAMES if not hasattr(amp_module, n)]
    fp16 = getattr(amp_lists, "symbol_fp16", None)
    if fp16 is None:
        missing.append("mxnet.contrib.amp.lists.symbol_fp16")
    else:
        missing += [f"mxnet.contrib.amp.lists.symbol_fp16.{n}" for n in AMP_LIST_NAMES
                    if not isinstance(getattr(fp16, n, None), list)]
    T = mx.gluon.Trainer
    missing += [f"Trainer.{m}" for m in TRAINER_METHODS if not callable(getattr(T, m, None))]
    # Instance attributes, read from the names Trainer's own methods use (no Trainer is built).
    assigned = set()
    for m in ("__init__",) + TRAINER_METHODS:
        code = getattr(getattr(T, m, None), "__code__", None)
        if code is not None:
            assigned.update(code.co_names)
    missing += [f"Trainer().{a}" for a in TRAINER_ATTRS if a not in assigned]
    if not hasattr(mx.gluon.Block(), "_children"):
        missing.append("Block()._children")
    if not hasattr(getattr(mx.name, "NameManager", None), "_current"):
        missing.append("mxnet.name.NameManager._current")
    if not callable(getattr(symbol_register, "_symbol_creator", None)):
        missing.append("mxnet.symbol.register._symbol_creator")
    if not callable(getattr(mx.sym.Symbol, "_set_attr", None)):
        missing.append("Symbol._set_attr")
    if not hasattr(getattr(_base, "_LIB", None), "NNGetOpHandle"):
        missing.append("mxnet.base._LIB.NNGetOpHandle")
    if not isinstance(OP_NAME_PREFIXES, (list, tuple)):
        missing.append("mxnet.base._OP_NAME_PREFIX_LIST")
    if not isinstance(flatten, types.FunctionType):
        missing.append("mxnet.gluon.block._flatten")
    return missing


def check():
    """Raise IncompatibleMXNet naming every missing internal; returns the MXNet version."""
    version = getattr(mx, "__version__", "?")
    missing = _missing()
    if missing:
        raise IncompatibleMXNet(
            f"gn_mx relies on internals of MXNet {TESTED_MXNET}, and mxnet {version} lacks: "
            + ", ".join(missing) + f". Install mxnet=={TESTED_MXNET} (or mxnet-cu112=={TESTED_MXNET}) "
            "with 'numpy<1.24'.")
    return version


def wrap_hybrid_block(**wrappers):
    """Replace HybridBlock methods (names in HYBRID_WRAPPED) by ``wrappers[name](original)``, once
    per process (a reloaded gn_mx module does not wrap twice)."""
    HB = gluon_block.HybridBlock
    if getattr(HB, "_gnmx_wrapped", False):
        return
    for name, wrap in wrappers.items():
        if name not in HYBRID_WRAPPED:
            raise ValueError(f"gn_mx: {name} is not a HybridBlock method listed in HYBRID_WRAPPED")
        setattr(HB, name, wrap(getattr(HB, name)))
    HB._gnmx_wrapped = True


def hybrid_cache(block):
    """A HybridBlock's traced graph and CachedOp (HybridCache; empty fields before the first trace)."""
    return HybridCache(*(getattr(block, a) for a in _CACHE_FIELDS))


def set_hybrid_cache(block, cache):
    """Make ``cache`` (from hybrid_cache; None: an empty one, traced on the next call) the block's
    active graph and CachedOp."""
    if cache is None:
        cache = HybridCache(graph=(), op=None, op_args=[], in_format=None, out_format=None)
    for a, v in zip(_CACHE_FIELDS, cache):
        object.__setattr__(block, a, v)


def build_hybrid_cache(block, *args):
    """Trace the block for inputs like ``args`` and build its CachedOp without running it."""
    block._build_cache(*args)


def copy_hybridize_state(src, dst):
    """Give ``dst`` the hybridize() state of ``src`` (active flag and flags such as static_alloc)."""
    dst._active, dst._flags = getattr(src, "_active", False), list(getattr(src, "_flags", []))


def clear_cached_op(block):
    """Drop the block's traced graph and CachedOp (the next call traces again)."""
    block._clear_cached_op()


def static_alloc(block):
    """Whether the block was hybridized with static_alloc=True."""
    return any(k == "static_alloc" and v for k, v in block._flags)


def op_handle(name):
    """The NNVM op handle (an int, 0 when no such op) of op ``name``."""
    h = _base.OpHandle()
    _base.check_call(_base._LIB.NNGetOpHandle(_base.c_str(name), ctypes.byref(h)))
    return h.value or 0


def children(block):
    """A Block's direct children (Block._children, an OrderedDict name -> Block)."""
    return list(block._children.values())


def trainer_kvstore(trainer, init_params=False):
    """``trainer``'s kvstore (None for a single device), created now if the Trainer has not yet;
    with ``init_params`` also the initial broadcast of parameter values the Trainer otherwise
    does lazily in its first step."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if init_params and trainer._params_to_init:
        trainer._init_params()
    return trainer._kvstore


def trainer_info(trainer):
    """(number of parameters, updates on the kvstore?) of a gluon Trainer."""
    return len(trainer._params), bool(trainer._update_on_kvstore)


def current_name_manager():
    """The thread's current mx.name.NameManager (created like mx.sym.var does on first use)."""
    NM = mx.name.NameManager
    if not hasattr(NM._current, "value"):
        NM._current.value = NM()
    return NM._current.value


def amp_fp16_lists():
    return amp_lists.symbol_fp16


def amp_bf16_lists():
    """AMP's bfloat16 op lists, or None (they are optional: MXNet 1.9 builds without bf16)."""
    return getattr(amp_lists, "symbol_bf16", None)


check()
