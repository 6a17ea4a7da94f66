"""Put gn_mx normalization layers in the place of a net's BatchNorm layers, for training
(docs/guide/replace_norm.md).

``replace_norm(block, norm=GroupNorm, ...)`` swaps every ``gluon.nn.BatchNorm`` (and, on request,
``InstanceNorm`` / ``LayerNorm``) of a Gluon block tree for a ``gn_mx.GroupNorm`` or a
``gn_mx.DecorrelatedBatchNorm``: a change of the model, for training from scratch or fine-tuning,
unlike ``gn_mx.convert`` (exact conversion of layers that already are GroupNorms). It works where a
constructor has no ``norm_layer`` argument (``mxnet.gluon.model_zoo.vision``), before or after
``initialize()``, hybridized or not.

Each new layer takes the old one's slot and prefix (so its parameters have the old names), its
epsilon, ``center`` / ``scale``, initializers, dtype, ``lr_mult`` / ``wd_mult`` and (for DBN)
momentum and ``use_global_stats``; with values present, gamma/beta are copied (``copy_affine``).
BatchNorm's running statistics have no counterpart and are dropped. The channel count C comes from
the layer's parameters (``in_channels`` or an earlier forward), from a ``sample=`` batch (a shape
inference; nothing runs), or is left to the new layer's deferred initialization. Inside a
``gluon.SymbolBlock`` (which has a graph, not child layers) the BatchNorm nodes of the graph are
rewritten instead (``_symblock.py``).
"""
import json

import mxnet as mx
from mxnet import gluon

from . import _blocktree, _compat, _convert, _symblock
from ._blocktree import param_state as _param_state
from .nn import DecorrelatedBatchNorm, GroupNorm
from .sync import SyncDecorrelatedBatchNorm

__all__ = ["replace_norm", "ReplacementReport"]

#: The kinds of layer ``replace_norm`` can replace (its ``include`` argument).
KINDS = ("batch_norm", "instance_norm", "layer_norm")

_BATCH_NORM = getattr(gluon.nn.basic_layers, "_BatchNorm", gluon.nn.BatchNorm)  # + BatchNormReLU
_DEFAULT_GROUPING = {GroupNorm: ("num_groups", 32), DecorrelatedBatchNorm: ("group_size", 16)}


class ReplacementReport:
    """What :func:`replace_norm` did (the returned block's ``gn_mx_report``).

    Attributes
    ----------
    replaced : list of (str, str)
        ``(path, what)`` of every layer replaced: the old layer and the new one.
    left : list of (str, str)
        ``(path, reason)`` of every layer of an included kind left in place.

    Examples
    --------
    >>> net = mx.gluon.nn.HybridSequential()
    >>> net.add(mx.gluon.nn.Conv2D(8, 3), mx.gluon.nn.BatchNorm(in_channels=8))
    >>> print(gn_mx.replace_norm(net, num_groups=4).gn_mx_report)
    gn_mx.replace_norm: 1 replaced, 0 left in place
      replaced 1: BatchNorm(C=8) -> GroupNorm(num_groups=4, eps=1e-05, center=True, scale=True, in_channels=8)
    """

    def __init__(self):
        self.replaced = []
        self.left = []

    def __repr__(self):
        lines = [f"gn_mx.replace_norm: {len(self.replaced)} replaced, {len(self.left)} left in "
                 "place"]
        lines += [f"  replaced {p}: {w}" for p, w in self.replaced]
        lines += [f"  left     {p}: {w}" for p, w in self.left]
        return "\n".join(lines)


def _kind(b):
    """'batch_norm' / 'instance_norm' / 'layer_norm' for MXNet's layers of that kind, else None."""
    if isinstance(b, _BATCH_NORM):
        return "batch_norm"
    if isinstance(b, gluon.nn.InstanceNorm):
        return "instance_norm"
    if isinstance(b, gluon.nn.LayerNorm):
        return "layer_norm"
    return None


def _traced_inputs(block, layers):
    """{id(layer): its input Symbol} from tracing HybridBlock ``block`` on one input variable
    'data' (nothing runs). The trace caches each Parameter's variable; they are put back as they
    were, so a later swap (WSConv2D shares Parameters) makes its own."""
    seen = {}
    handles = [b.register_forward_pre_hook(lambda b, args: seen.setdefault(id(b), args[0]))
               for b in layers]
    params = list(block.collect_params().values())
    cached_vars = [p._var for p in params]
    try:
        block(mx.sym.var("data"))
    finally:
        for h in handles:
            h.detach()
        for p, v in zip(params, cached_vars):
            p._var = v
    return seen


def _input_shapes(block, sample_shape, layers):
    """{id(layer): the shape of its input} for an input of ``sample_shape``: a shape inference of
    the traced graph for a HybridBlock (nothing is computed; works before initialize()), else one
    forward in predict mode (the block must be initialized)."""
    if isinstance(block, gluon.HybridBlock):
        seen = _traced_inputs(block, layers)
        if not seen:
            return {}
        ids = list(seen)
        _, shapes, _ = mx.sym.Group([seen[i] for i in ids]).infer_shape_partial(
            data=tuple(sample_shape))
        return {i: tuple(s) for i, s in zip(ids, shapes or []) if s}
    if any(_param_state(p) == "none" for p in block.collect_params().values()):
        raise ValueError("replace_norm: sample= on a non-hybrid Block runs one forward, which "
                         "needs an initialized block: call initialize() first")
    seen = {}
    handles = [b.register_forward_pre_hook(lambda b, args: seen.setdefault(id(b), args[0]))
               for b in layers]
    active = [(b, b._active) for b in _blocktree.blocks(block) if isinstance(b, gluon.HybridBlock)]
    try:
        for b, _ in active:
            b._active = False
        with mx.autograd.predict_mode():
            block(mx.nd.zeros(tuple(sample_shape)))
    finally:
        for b, a in active:
            b._active = a
        for h in handles:
            h.detach()
    return {i: tuple(x.shape) for i, x in seen.items()}


def _graph_channels(block, layers):
    """{id(layer): C} read from the traced graph of a HybridBlock without any input shape: the
    Convolution / FullyConnected that feeds each layer through channel-preserving ops
    (``_convert._channels_from_producer``). Layers it cannot tell are left out; {} for a plain
    Block or a block that cannot be traced on one input."""
    if not isinstance(block, gluon.HybridBlock):
        return {}
    try:
        seen = _traced_inputs(block, layers)
    except Exception:  # noqa: BLE001 (several inputs, a Block inside, ...: nothing known)
        return {}
    found = {}
    for i, sym in seen.items():
        g = json.loads(sym.tojson())
        c = _convert._channels_from_producer(g["nodes"], g["heads"][0])
        if c:
            found[i] = c
    return found


def _divisors(c):
    return [d for d in range(1, c + 1) if c % d == 0]


def _old_axis(b, kind):
    return b._kwargs.get("axis", 1) if kind == "batch_norm" else b._axis  # SyncBatchNorm: no axis


def _gn_axis(axis, ndim):
    """GroupNorm's axis for a BatchNorm / InstanceNorm normalizing per channel on ``axis``: 1
    (channels first), -1 (the input's last axis: channels last, GroupNorm(axis=-1)), or None
    (neither, or an axis other than 1 / -1 of an input of unknown rank ``ndim``)."""
    if axis in (1, -1):
        return axis
    if ndim is None:
        return None
    a = axis + ndim if axis < 0 else axis
    return 1 if a == 1 else -1 if a == ndim - 1 and a > 1 else None


def _axis_rule(b, kind, ndim, norm):
    """(GroupNorm's axis, None) for layer b, or (None, the reason it stays): a BatchNorm or
    InstanceNorm on axis 1 or on its input's last axis (channels last) becomes a GroupNorm on that
    axis (DBN: axis 1 only); a LayerNorm is a GroupNorm only over the channels of (N, C) input."""
    axis, name = _old_axis(b, kind), type(b).__name__
    unknown = " (of unknown input rank: pass sample=)" if ndim is None else ""
    if kind == "layer_norm":
        if axis == 1 or (axis == -1 and ndim == 2):
            return 1, None
        return None, (f"{name}(axis={axis}){unknown}: a LayerNorm is a GroupNorm only over the "
                      "channel axis 1 of (N, C) input "
                      "(elsewhere it normalizes each position alone)")
    gn_axis = _gn_axis(axis, ndim)
    if gn_axis is None:
        return None, (f"{name}(axis={axis}){unknown}: gn_mx normalizes the channel axis 1 or the "
                      "last axis ((N, C, *spatial) or (N, *spatial, C) data)")
    if gn_axis != 1 and norm is not GroupNorm:
        return None, (f"{name}(axis={axis}): {norm.__name__} normalizes the channel axis 1 only "
                      "(GroupNorm takes the last axis: norm=gn_mx.GroupNorm)")
    return gn_axis, None


def _channels(b, shape, axis=1):
    """C of layer b: its parameters' shape, else its input's on ``axis`` (from sample=), else 0
    (unknown)."""
    s = b.gamma.shape
    if s and s[0] > 0:
        return int(s[0])
    if shape is not None and len(shape) >= 2 and shape[axis] > 0:
        return int(shape[axis])
    return 0


def _grouping(c, rule, value, norm, fit_groups):
    """The new layer's grouping keywords for C=c (0: unknown); a ValueError when the rule cannot
    divide c (with the valid values), or fitted with ``fit_groups``."""
    if c and c % value:
        if rule == "num_groups" and fit_groups:
            return {"num_groups": max(d for d in _divisors(c) if d <= value)}
        hint = (f" (num_groups that divide it: {', '.join(map(str, _divisors(c)))}; or "
                f"fit_groups=True: the largest of them <= {value} for each such layer)"
                if rule == "num_groups" else "")
        raise ValueError(f"C={c} is not divisible by {rule}={value}{hint}")
    if rule == "num_groups":
        return {"num_groups": value}
    if norm is DecorrelatedBatchNorm:
        return {"group_size": value}  # DBN finds C/group_size itself when C is deferred
    if not c:
        raise ValueError(f"the channel count is unknown, so group_size={value} gives no "
                         "num_groups: pass sample= (an input batch), in_channels to the layer, or "
                         "run one batch before replacing")
    return {"num_groups": c // value}


def _plan(b, kind, shape, norm, rule, value, graph_c=0, fit_groups=False):
    """(C, new layer's grouping keywords, None) for layer b, or (C, None, reason to leave it),
    or raises ValueError for a C the grouping rule cannot divide. C is the layer's own or its
    sample input's (0: deferred); ``graph_c``, read from the traced graph, decides the grouping
    when C is not known otherwise."""
    axis, reason = _axis_rule(b, kind, len(shape) if shape is not None else None, norm)
    if reason:
        return 0, None, reason
    if kind == "batch_norm" and b.fuse_relu and norm is not GroupNorm:
        return 0, None, (f"{type(b).__name__} has a fused ReLU, {norm.__name__} has none "
                         "(replace it with GroupNorm, or use BatchNorm + Activation)")
    c = _channels(b, shape, axis)
    grouping = _grouping(c or graph_c, rule, value, norm, fit_groups)
    return c, dict(grouping, **({"axis": -1} if axis == -1 else {})), None


def _new_layer(old, kind, norm, c, grouping, copy_affine, norm_kwargs):
    """The gn_mx layer for old's slot (old's prefix: the same parameter names)."""
    g_old, b_old = old.gamma, old.beta
    kw = dict(grouping)
    kw["epsilon"] = old._kwargs["eps"]
    kw["scale"] = bool(getattr(g_old, "_differentiable", g_old.grad_req != "null"))
    kw["center"] = bool(getattr(b_old, "_differentiable", b_old.grad_req != "null"))
    kw["gamma_initializer"] = g_old.init or "ones"
    kw["beta_initializer"] = b_old.init or "zeros"
    if norm is DecorrelatedBatchNorm and kind == "batch_norm":
        kw["momentum"] = old._kwargs["momentum"]
        kw["use_global_stats"] = bool(old._kwargs["use_global_stats"])
    if kind == "batch_norm" and old.fuse_relu:
        kw["activation"] = "relu"
    if norm is DecorrelatedBatchNorm and old._kwargs.get("ndev") is not None:
        norm, kw["num_devices"] = SyncDecorrelatedBatchNorm, old._kwargs["ndev"]  # SyncBatchNorm
    kw.update(norm_kwargs)
    new = norm(in_channels=c, prefix=old.prefix, **kw)
    for p_new, p_old in ((new.gamma, g_old), (new.beta, b_old)):
        p_new.lr_mult, p_new.wd_mult = p_old.lr_mult, p_old.wd_mult
        if p_old.grad_req == "null":
            p_new.grad_req = "null"
    if g_old.dtype is not None:
        new.cast(g_old.dtype)  # (BatchNorm keeps float32 parameters in a float16 net)
    state = _param_state(g_old)
    if state == "init":
        ctx = g_old.list_ctx()
        new.initialize(ctx=ctx)
        if copy_affine:
            new.gamma.set_data(g_old.data(ctx[0]).astype(new.gamma.dtype))
            new.beta.set_data(b_old.data(ctx[0]).astype(new.beta.dtype))
    elif state == "deferred":
        new.initialize(ctx=g_old._deferred_init[1])
    _compat.copy_hybridize_state(old, new)
    return new


def _plan_layers(found, shapes, graph_c, norm, rule, value, fit_groups):
    """replace_norm's decision for each layer found: (todo, left, errors) with todo
    [(parent, key, child, path, kind, C, grouping)], left [(path, reason)] and errors [one line
    per layer the grouping cannot divide, naming it]."""
    todo, left, errors = [], [], []
    for parent, key, child, path, kind in found:
        try:
            c, grouping, reason = _plan(child, kind, shapes.get(id(child)), norm, rule, value,
                                        graph_c.get(id(child), 0), fit_groups)
        except ValueError as e:
            errors.append(f"'{path}' ({type(child).__name__} '{child.name}'): {e}")
            continue
        if reason:
            left.append((path, reason))
        else:
            todo.append((parent, key, child, path, kind, c, grouping))
    return todo, left, errors


def _checked_arguments(norm, num_groups, group_size, include, norm_kwargs):
    """replace_norm's arguments checked before any change: (grouping rule, its value, include as a
    tuple of kinds); a clear TypeError / ValueError otherwise."""
    if norm not in _DEFAULT_GROUPING:
        raise TypeError(f"replace_norm: norm must be gn_mx.GroupNorm or "
                        f"gn_mx.DecorrelatedBatchNorm, got {norm!r}")
    if num_groups is not None and group_size is not None:
        raise ValueError("replace_norm: give num_groups or group_size, not both")
    rule, value = _DEFAULT_GROUPING[norm]
    if num_groups is not None:
        rule, value = "num_groups", num_groups
    elif group_size is not None:
        rule, value = "group_size", group_size
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"replace_norm: {rule} must be a positive int, got {value!r}")
    fixed = sorted(k for k in norm_kwargs if k in ("in_channels", "prefix", "params"))
    if fixed:
        raise TypeError(f"replace_norm: {', '.join(fixed)} come(s) from the replaced layer, not "
                        "from norm_kwargs")
    include = (include,) if isinstance(include, str) else tuple(include)
    unknown = [k for k in include if k not in KINDS]
    if unknown:
        raise ValueError(f"replace_norm: unknown kind(s) {unknown} in include; known: {KINDS}")
    return rule, value, include


def _plan_symbol_blocks(root, norm, rule, value, fit_groups, include, norm_kwargs):
    """The replacement plans of every SymbolBlock under ``root``: ([(block, path, plans)], the
    layers left in place, the errors)."""
    sym_plans, left, errors = [], [], []
    for path, sb in _symblock.symbol_blocks(root):
        plans, sb_left, sb_errors = _symblock.plan(
            sb, path, lambda c: _grouping(c, rule, value, norm, fit_groups)["num_groups"],
            norm.__name__, include, norm_kwargs)
        sym_plans.append((sb, path, plans))
        left += sb_left
        errors += sb_errors
    return sym_plans, left, errors


def _replace_planned(todo, graph_c, norm, rule, value, copy_affine, norm_kwargs, report):
    """Swaps each planned Gluon layer for its new norm layer and records it in ``report``."""
    for parent, key, child, path, kind, c, grouping in todo:
        new = _new_layer(child, kind, norm, c, grouping, copy_affine, norm_kwargs)
        _blocktree.replace_child(parent, key, child, new)
        fitted = (f" (fitted: num_groups={value} does not divide C="
                  f"{c or graph_c.get(id(child))})" if grouping.get("num_groups", value) != value
                  and rule == "num_groups" else "")
        report.replaced.append((path, f"{type(child).__name__}(C={c or '?'}) -> {new!r}{fitted}"))


def replace_norm(block, norm=GroupNorm, num_groups=None, group_size=None,
                 include=("batch_norm",), sample=None, copy_affine=True, verbose=False,
                 fit_groups=False, **norm_kwargs):
    """Replace every BatchNorm (and, with ``include``, InstanceNorm / LayerNorm) in ``block``'s tree
    by a ``gn_mx.GroupNorm`` or ``gn_mx.DecorrelatedBatchNorm``, in place.

    A change of the model, for training from scratch or fine-tuning (``gn_mx.convert`` is the exact
    conversion of layers that already are GroupNorms). Inside a ``gluon.SymbolBlock`` (e.g.
    ``SymbolBlock.imports``, GluonCV's FeatureExpander) the BatchNorm nodes of its graph become
    ``gn_group_norm`` nodes on the same gamma/beta (GroupNorm only; reported as
    ``'path:node name'``). Every layer of an included kind is replaced
    or listed in the report with the reason it stays (a normalized axis other than 1, a
    ``BatchNormReLU`` for DBN); a channel count that the grouping cannot divide is a ValueError
    naming every such layer, raised before anything is changed.

    Parameters
    ----------
    block : gluon.Block
        Changed in place, initialized or not, hybridized or not. Create Trainers after replacing (a
        Trainer made before holds the old Parameter objects).
    norm : type, default gn_mx.GroupNorm
        ``gn_mx.GroupNorm`` or ``gn_mx.DecorrelatedBatchNorm``.
    num_groups : int, optional
        A fixed number of groups G for every layer.
    group_size : int, optional
        A fixed number of channels per group (G = C / group_size per layer). Give ``num_groups`` or
        ``group_size``, not both. Neither: ``num_groups=32`` for GroupNorm (the GroupNorm paper's
        G) and ``group_size=16`` for DecorrelatedBatchNorm (the DBN paper's advice); note that the
        DecorrelatedBatchNorm class itself defaults to 16 *groups*.
    include : sequence of str, default ('batch_norm',)
        The kinds to replace, of ``'batch_norm'`` (``nn.BatchNorm``, ``BatchNormReLU``,
        ``contrib.nn.SyncBatchNorm``), ``'instance_norm'``, ``'layer_norm'`` (only over the channel
        axis: ``axis=1``, or the last axis of 2-D input as told by ``sample``). A BatchNorm or
        InstanceNorm on its input's last axis becomes ``GroupNorm(axis=-1)`` (channels last).
    sample : NDArray or tuple, optional
        An input batch (or its shape) of a single-input block: the channel count and rank of
        every layer's input are inferred from it (a shape inference of the traced graph for a
        HybridBlock; one predict-mode forward, which needs an initialized block, for a plain
        Block). Without it, a HybridBlock's channel counts are read from its traced graph (the
        convolution or dense layer feeding each norm layer) for the group rule; ``sample`` is
        needed where that cannot tell (``group_size`` with GroupNorm on a plain Block, a layer
        fed through a concatenation, ...).
    copy_affine : bool, default True
        When the old layer's gamma/beta have values, start the new ones from them (fine-tuning);
        False starts from the initializers (ones, zeros), as training from scratch does.
    verbose : bool, default False
        Print the report.
    fit_groups : bool, default False
        For a layer whose C the ``num_groups`` rule cannot divide (C < 32 with the default, e.g.
        MobileNet 0.25's C = 8), use the largest divisor of C that is at most ``num_groups``
        (reported per layer as fitted) instead of raising. Needs C at replacement time (the
        layer's, ``sample=``'s, or the traced graph's).
    **norm_kwargs
        More keywords for every new layer (e.g. ``epsilon``, ``activation='relu'`` for GroupNorm,
        ``whitening='iternorm'`` for DBN); they win over the values taken from the old layer.

    Returns
    -------
    gluon.Block
        ``block`` (or the new layer, when ``block`` is itself a norm layer); its ``gn_mx_report``
        attribute is a :class:`ReplacementReport`.

    Raises
    ------
    ValueError
        A channel count not divisible by the grouping (every such layer is named), ``group_size``
        with GroupNorm and unknown channel counts, both or a bad ``num_groups`` / ``group_size``,
        an unknown kind in ``include``.
    TypeError
        ``norm`` is not GroupNorm or DecorrelatedBatchNorm.

    Examples
    --------
    >>> from mxnet.gluon.model_zoo import vision
    >>> net = vision.resnet18_v1(classes=10)
    >>> net = gn_mx.replace_norm(net, num_groups=32)
    >>> print(str(net.gn_mx_report).splitlines()[0])
    gn_mx.replace_norm: 20 replaced, 0 left in place
    >>> net.features[1]
    GroupNorm(num_groups=32, eps=1e-05, center=True, scale=True, in_channels=None)
    """
    rule, value, include = _checked_arguments(norm, num_groups, group_size, include, norm_kwargs)

    root = _blocktree.root_holder(block, lambda b: _kind(b) is not None)
    found = [(parent, key, child, path, _kind(child))
             for parent, key, child, path in _blocktree.walk(root)]
    found = [f for f in found if f[4] in include]
    shapes = {}
    if sample is not None and found:
        shape = sample if isinstance(sample, tuple) else sample.shape
        shapes = _input_shapes(block, shape, [f[2] for f in found])

    graph_c = {}
    if sample is None and any(not _channels(f[2], None) for f in found):
        graph_c = _graph_channels(block, [f[2] for f in found])
    report = ReplacementReport()
    todo, report.left, errors = _plan_layers(found, shapes, graph_c, norm, rule, value, fit_groups)
    sym_plans, sym_left, sym_errors = _plan_symbol_blocks(root, norm, rule, value, fit_groups,
                                                          include, norm_kwargs)
    report.left += sym_left
    errors += sym_errors
    if errors:
        raise ValueError(f"replace_norm({norm.__name__}, {rule}={value}): "
                         f"{len(errors)} layer(s) cannot be replaced:\n  " + "\n  ".join(errors))
    _replace_planned(todo, graph_c, norm, rule, value, copy_affine, norm_kwargs, report)
    for sb, path, plans in sym_plans:
        if plans:
            _symblock.apply(sb, path, plans, copy_affine, report)
    _blocktree.clear_hybrid_caches(root)
    result = _blocktree.unwrap(root, block)
    result.gn_mx_report = report
    if verbose:
        print(report)
    return result
