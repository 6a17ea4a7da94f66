"""Symbolic shape inference with parameter variables of unknown shape.

MXNet 1.9.1 cannot call an external-library op's shape inference when some inputs have an unknown
number of dimensions and others do not: its FInferShape glue (``c_api.cc``, ``registerOperators``)
sizes one buffer as the sum of the inputs' ``ndim``, and an unknown shape counts as ``ndim = -1``.
``gn_group_norm(data (4, 6), gamma ?, beta ?)`` gets a buffer of 2 - 1 - 1 = 0 entries and MXNet
writes data's 2 dims into it (SIGSEGV); 3-D data overflows the heap. This happens inside
libmxnet before any gn_mx code runs, so the op library cannot guard it.

gn_mx therefore gives every parameter / running-statistics *variable* that carries no shape a
placeholder shape of known rank and unknown dims (``__shape__ = (-1,)``; ``(-1, -1, -1)`` for
``running_projection``), like Gluon does for deferred parameters. The op's inferShape then fills the
real shape in from ``data``, as MXNet's own GroupNorm/BatchNorm do, and the ``ndim`` sum is right.
Applied when an ``mx.sym.gn_*`` symbol is created and by ``mx.sym.load`` / ``mx.sym.load_json`` (JSON saved
without gn_mx). Not covered: a parameter that is the output of another op of unknown rank, and
shape inference with ``data`` itself of unknown rank (MXNet's buffer is then one entry short per
unknown input whatever gn_mx does; the inference still completes).
"""
import functools
import json

import mxnet as mx
import mxnet.symbol as msym
from mxnet.symbol import symbol as msymsym

from . import _compat  # the private names (symbol creator, op handles) are checked there

# op -> rank of each input whose shape the op infers from data (None: data itself).
PARAM_RANKS = {
    "gn_group_norm": (None, 1, 1),
    "gn_channel_affine": (None, 1, 1),
    "gn_dbn": (None, 1, 3),
    "gn_dbn_inference": (None, 1, 3),
    "gn_weight_standardize": (None, 1),  # the weight is the "data"; gain (O,) from it
    "gn_dbn_apply": (None, 1, 1, 1, 3),  # gamma, beta, mean (C,); W (G, D, D)
    "gn_dbn_whiten": (None, 1, 1, 3),  # cov (G, D, D) is the "data"; mean, running stats from it
    "gn_dbn_local_cov": (None, 2),  # tot (G, D + 1) from data
}
_SHAPE_KEY = "__shape__"


def _placeholder(rank):
    return str((-1,) * rank)


def _fill_children(sym, op):
    children = sym.get_children()
    if children is None:
        return
    for i, rank in enumerate(PARAM_RANKS[op]):
        if rank is None or i >= len(children):
            continue
        child = children[i]
        if child.get_children() is not None or child.attr(_SHAPE_KEY) is not None:
            continue  # not a variable, or its shape (or Gluon's deferred placeholder) is set
        child._set_attr(**{_SHAPE_KEY: _placeholder(rank)})


def _op_handles():
    handles = {_compat.op_handle(op): op for op in PARAM_RANKS}
    handles.pop(0, None)  # ops the loaded library lacks
    return handles


def _wrap_creator(creator, handles):
    """mxnet.symbol.register._symbol_creator, which every generated mx.sym.* function calls.

    Hooking it (rather than replacing mx.sym.gn_* themselves) leaves the function objects that AMP
    and others wrap untouched, and survives the regeneration of mx.sym.* by mx.library.load.
    """
    if getattr(creator, "_gn_mx_placeholders", False):
        return creator

    @functools.wraps(creator)
    def symbol_creator(handle, *args, **kwargs):
        out = creator(handle, *args, **kwargs)
        op = handles.get(handle)
        if op is not None:
            for s in out if isinstance(out, list) else [out]:
                try:
                    _fill_children(s, op)
                except mx.base.MXNetError:
                    pass
        return out

    symbol_creator._gn_mx_placeholders = True
    return symbol_creator


def fill_json(text):
    """The symbol JSON `text` with placeholders for shapeless parameter variables of gn_* ops."""
    if "gn_" not in text:
        return text
    graph = json.loads(text)
    nodes = graph.get("nodes", [])
    changed = False
    for node in nodes:
        ranks = PARAM_RANKS.get(node.get("op"))
        if not ranks:
            continue
        for i, entry in enumerate(node.get("inputs", [])):
            if i >= len(ranks) or ranks[i] is None:
                continue
            src = nodes[entry[0]]
            if src.get("op") != "null":
                continue
            key = "attr" if "attr" in src and "attrs" not in src else "attrs"  # pre-1.0 JSON
            attrs = src.setdefault(key, {})
            if _SHAPE_KEY in attrs:
                continue
            attrs[_SHAPE_KEY] = _placeholder(ranks[i])
            changed = True
    return json.dumps(graph) if changed else text


def _wrap_load_json(fn):
    if getattr(fn, "_gn_mx_placeholders", False):
        return fn

    @functools.wraps(fn)
    def load_json(json_str):
        return fn(fill_json(json_str))

    load_json._gn_mx_placeholders = True
    return load_json


def _wrap_load(fn, load_json):
    if getattr(fn, "_gn_mx_placeholders", False):
        return fn

    @functools.wraps(fn)
    def load(fname):
        if isinstance(fname, str) and "://" not in fname:
            with open(fname) as f:
                return load_json(f.read())
        return fn(fname)

    load._gn_mx_placeholders = True
    return load


def install():
    """Hook symbol creation and mx.sym.load / load_json (idempotent; after the library is loaded)."""
    register = _compat.symbol_register
    register._symbol_creator = _wrap_creator(register._symbol_creator, _op_handles())
    load_json = _wrap_load_json(msymsym.load_json)
    load = _wrap_load(msymsym.load, load_json)
    for mod in (msym, msymsym):
        mod.load_json = load_json
        mod.load = load
