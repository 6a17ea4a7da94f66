"""Exact conversion of MXNet's own normalization layers to gn_mx (docs/convert.md).

``convert(block)`` rewrites a Gluon block tree in place; ``convert_symbol(sym, arg_params,
aux_params)`` rewrites an exported model; ``python -m gn_mx.convert in-prefix epoch out-prefix``
does the latter on files. Only exact mappings are made:

- ``gluon.nn.GroupNorm`` (MXNet 1.x: gamma/beta per *group*, shape (G,)) -> ``gn_mx.GroupNorm`` with
  per-channel gamma/beta (C,) = the group's value repeated over its C/G channels;
- ``gluon.nn.InstanceNorm(axis=1)`` -> ``gn_mx.GroupNorm(num_groups=C)`` (same gamma/beta), and
  ``InstanceNorm`` over the last axis (``axis=-1``, or ``axis=ndim-1`` with ``sample=``: NWC/NHWC
  data) -> ``gn_mx.GroupNorm(num_groups=C, axis=-1)``;
- GluonCV's composed ``GroupNorm`` (a BatchNorm over a (1, N*G, -1) reshape, then a per-channel
  affine; recognized by structure, gluoncv is not imported) -> ``gn_mx.GroupNorm`` (same gamma/beta);
- ``gluon.nn.LayerNorm`` over the channel axis of 2-D (N, C) input -> ``gn_mx.GroupNorm(num_groups=1)``
  (only with ``sample=``: the input rank decides whether it is a GroupNorm at all).

Anything else that looks like a norm layer (a channel axis that is neither 1 nor the last, a
LayerNorm over other axes or of unknown input rank, e.g. ``LayerNorm(axis=-1)`` on (N, T, C), which
normalizes each position alone and is no GroupNorm, a GluonCV GroupNorm with ``axis`` other than 1,
whose BatchNorm then normalizes along another axis of its (1, N*G, -1) view, a symbol GroupNorm whose
channel count cannot be inferred, ...) is left in place, listed in the report with the reason, and
named in a ``UserWarning`` (one per conversion). Nothing is approximated.
"""
import copy
import json
import warnings

import mxnet as mx
from mxnet import gluon

from . import _blocktree, _compat

__all__ = ["convert", "convert_symbol", "ConversionReport"]


class ConversionReport:
    """What a conversion did (``convert``'s ``gn_mx_report``, ``convert_symbol``'s ``report``).

    Attributes
    ----------
    replaced : list of (str, str)
        ``(path, what)`` of every layer or node replaced.
    fused : list of (str, str)
        ``(path, activation)`` of every activation fused into the norm before it.
    left : list of (str, str)
        ``(path, reason)`` of every norm-like layer left in place.

    Examples
    --------
    >>> r = gn_mx.convert(mx.gluon.nn.InstanceNorm(in_channels=4)).gn_mx_report
    >>> len(r.replaced), r.fused, r.left
    (1, [], [])
    """

    def __init__(self):
        self.replaced = []
        self.fused = []
        self.left = []

    def __repr__(self):
        lines = [f"gn_mx conversion: {len(self.replaced)} replaced, {len(self.fused)} fused, "
                 f"{len(self.left)} left in place"]
        lines += [f"  replaced {p}: {w}" for p, w in self.replaced]
        lines += [f"  fused    {p}: {w}" for p, w in self.fused]
        lines += [f"  left     {p}: {w}" for p, w in self.left]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Gluon blocks

class _Fused(gluon.HybridBlock):
    """Stands where an activation was fused into the preceding norm (keeps Sequential indices):
    an identity that prints as what it is, e.g. ``_Fused(relu: applied by the GroupNorm in slot
    '1')``."""

    def __init__(self, activation, norm_key, **kwargs):
        super().__init__(**kwargs)
        self.activation = activation
        self.norm_key = norm_key

    def hybrid_forward(self, F, x):
        return x

    def __repr__(self):
        return (f"{type(self).__name__}({self.activation}: applied by the GroupNorm in slot "
                f"{self.norm_key!r})")


def _is_gluoncv_group_norm(b):
    # gluoncv.nn.GroupNorm: attributes ngroups, scale, _kwargs of a BatchNorm (fix_gamma, eps,
    # axis), params gamma/beta (C,); hybrid_forward = BatchNorm over x.reshape(1, N*G, -1) in train
    # mode, then y * gamma + beta (y + beta when scale is False).
    kw = getattr(b, "_kwargs", None)
    return (isinstance(b, gluon.HybridBlock) and type(b).__name__ == "GroupNorm"
            and hasattr(b, "ngroups") and hasattr(b, "scale") and isinstance(kw, dict)
            and "fix_gamma" in kw and "eps" in kw and hasattr(b, "gamma") and hasattr(b, "beta"))


def _act_of(b):
    """'relu' / 'silu' when block b is an activation gn_group_norm can fuse, else None."""
    if isinstance(b, gluon.nn.Activation) and b._act_type == "relu":
        return "relu"
    if isinstance(b, gluon.nn.Swish) and float(b._beta) == 1.0:
        return "silu"
    return None


def _plan(b, ndim):
    """(kind, num_groups or None, eps, reason): how block b maps onto gn_mx.GroupNorm.
    kind None means not a norm layer; reason set means a norm layer that stays."""
    nn = gluon.nn
    if isinstance(b, nn.GroupNorm):
        return "mx_group_norm", int(b._num_groups), float(b._epsilon), None
    if isinstance(b, nn.InstanceNorm):
        if _instance_norm_axis(b, ndim) is None:
            unknown = ndim is None and b._axis not in (0, 1, -1)
            return "instance_norm", None, None, (
                f"InstanceNorm(axis={b._axis}): gn_mx.GroupNorm takes the channels on axis 1 or on "
                "the last axis; " + ("the input rank is unknown (pass sample= to convert)" if unknown
                                     else f"axis {b._axis} of {ndim}-D input is neither"))
        return "instance_norm", None, float(b._epsilon), None
    if isinstance(b, nn.LayerNorm):
        axis = b._axis
        if ndim is None:
            return "layer_norm", None, None, (
                "LayerNorm: exactly a GroupNorm(num_groups=1) only for 2-D (N, C) input; the input "
                "rank is unknown (pass sample= to convert)")
        if ndim != 2 or axis not in (1, -1):
            return "layer_norm", None, None, (
                f"LayerNorm(axis={axis}) on {ndim}-D input normalizes one axis, not a GroupNorm "
                "(only axis 1 of 2-D input is)")
        return "layer_norm", 1, float(b._epsilon), None
    if _is_gluoncv_group_norm(b):
        axis = b._kwargs.get("axis", 1)
        if axis != 1:
            return "gluoncv_group_norm", None, None, (f"GluonCV GroupNorm(axis={axis}): its "
                                                      "BatchNorm then normalizes another axis")
        return "gluoncv_group_norm", int(b.ngroups), float(b._kwargs["eps"]), None
    return None, None, None, None


def _instance_norm_axis(b, ndim):
    """gn_mx.GroupNorm's axis for InstanceNorm b: 1, -1 (its axis is the input's last), or None
    (neither, or not known without the input rank ``ndim``)."""
    axis = b._axis
    if axis == 1 or axis == -1:
        return axis
    if ndim is None:
        return None
    a = axis + ndim if axis < 0 else axis
    return 1 if a == 1 else -1 if a == ndim - 1 and a > 1 else None


def _norm_axis(b):
    """The axis whose size is C for a norm layer (the sample hook's channel count)."""
    return b._axis if isinstance(b, gluon.nn.InstanceNorm) else 1


def _new_block(old, kind, num_groups, eps, act):
    """A gn_mx.GroupNorm carrying old's values (same parameter names: old's prefix)."""
    from .nn import GroupNorm
    g_old, b_old = old.gamma, old.beta
    state = _blocktree.param_state(g_old)
    known = getattr(old, "_gn_mx_channels", None)  # from a sample forward (convert(sample=...))
    shape_c = int(g_old.shape[0]) if g_old.shape and int(g_old.shape[0]) > 0 else 0
    c = known or (0 if kind == "mx_group_norm" else shape_c)
    gamma_v = g_old.data(g_old.list_ctx()[0]) if state == "init" else None
    beta_v = b_old.data(b_old.list_ctx()[0]) if state == "init" else None
    if kind == "mx_group_norm" and state == "init":
        # per-group (G,) -> per-channel (C,): MXNet's GroupNorm parameters do not record C
        if not c:
            return None, ("MXNet GroupNorm: the channel count is unknown (its gamma is per group); "
                          "pass sample= to convert")
        if c % num_groups:
            return None, f"MXNet GroupNorm: C={c} is not divisible by num_groups={num_groups}"
        gamma_v = gamma_v.repeat(c // num_groups)
        beta_v = beta_v.repeat(c // num_groups)
    if kind == "gluoncv_group_norm" and not old.scale and gamma_v is not None:
        gamma_v = gamma_v.ones_like()  # its forward ignores gamma: y + beta
    axis = 1
    if kind == "instance_norm":
        if not c:
            return None, ("InstanceNorm: the channel count is unknown (parameters not initialized; "
                          "pass sample= to convert)")
        num_groups = c
        axis = _instance_norm_axis(old, getattr(old, "_gn_mx_ndim", None))
    scale = g_old.grad_req != "null" and not (kind == "gluoncv_group_norm" and not old.scale)
    center = b_old.grad_req != "null"
    new = GroupNorm(num_groups=num_groups, epsilon=eps, center=center, scale=scale,
                    gamma_initializer=g_old.init or "ones", beta_initializer=b_old.init or "zeros",
                    in_channels=c or 0, activation=act, axis=axis, prefix=old.prefix)
    for p_new, p_old in ((new.gamma, g_old), (new.beta, b_old)):
        p_new.lr_mult, p_new.wd_mult = p_old.lr_mult, p_old.wd_mult
        if p_old.dtype is not None:
            p_new.dtype = p_old.dtype
    if state == "init":
        ctx = g_old.list_ctx()
        new.initialize(ctx=ctx)
        new.gamma.set_data(gamma_v.astype(g_old.dtype))
        new.beta.set_data(beta_v.astype(b_old.dtype))
    elif state == "deferred":
        new.initialize(ctx=g_old._deferred_init[1])
    _compat.copy_hybridize_state(old, new)
    return new, None


def _record_input_ranks(block, sample):
    """Runs sample through block (un-hybridized for the call) and records every norm layer's input
    rank (LayerNorm's mapping) and channel count (MXNet GroupNorm's per-group parameters)."""
    tree = _blocktree.blocks(block)
    active = [(b, getattr(b, "_active", None)) for b in tree]
    handles = []

    def hook(b, args):
        x = args[0]
        b._gn_mx_ndim = len(x.shape)
        if len(x.shape) >= 2:
            try:
                b._gn_mx_channels = int(x.shape[_norm_axis(b)])
            except IndexError:  # an axis the input does not have: _plan reports it
                pass

    for b in tree:
        if _plan(b, 0)[0] is not None:
            handles.append(b.register_forward_pre_hook(hook))
    try:
        for b, a in active:
            if a is not None:
                b._active = False
        with mx.autograd.predict_mode():
            block(sample)
    finally:
        for b, a in active:
            if a is not None:
                b._active = a
        for h in handles:
            h.detach()


def convert(block, fuse_activation=False, sample=None, verbose=False):
    """Replace MXNet's GroupNorm / InstanceNorm, GluonCV's GroupNorm and (with ``sample``) exact
    LayerNorms in ``block``'s tree by ``gn_mx.GroupNorm`` blocks carrying the same values.

    Parameters
    ----------
    block : gluon.Block
        Converted in place (initialized or not, hybridized or not). Create Trainers after converting:
        a Trainer made before holds the replaced Parameter objects.
    fuse_activation : bool
        Inside (Hybrid)Sequential containers, a converted norm directly followed by
        ``nn.Activation('relu')`` or ``nn.Swish()`` (beta=1) becomes one ``GroupNorm(activation=...)``;
        the activation's slot holds an identity block (indices stay valid).
    sample : NDArray, optional
        An input batch: run once (predict mode) to learn each layer's input shape. Needed for an
        initialized MXNet GroupNorm that never ran a forward (its per-group gamma does not record C)
        and for LayerNorm (exact only on 2-D input).
    verbose : bool
        Print the report.

    Returns
    -------
    gluon.Block
        The converted block (``block`` itself, unless ``block`` is itself a norm layer); its
        ``gn_mx_report`` attribute is a :class:`ConversionReport`.

    Examples
    --------
    >>> net = mx.gluon.nn.HybridSequential()
    >>> net.add(mx.gluon.nn.Conv2D(4, 3, in_channels=3), mx.gluon.nn.GroupNorm(num_groups=2),
    ...         mx.gluon.nn.Activation('relu'))
    >>> net.initialize()
    >>> x = mx.nd.random.normal(shape=(1, 3, 6, 6))
    >>> y = net(x)
    >>> net = gn_mx.convert(net, fuse_activation=True, sample=x)  # sample: C of the GroupNorm
    >>> net[1]
    GroupNorm(num_groups=2, eps=1e-05, center=True, scale=True, in_channels=4, activation='relu')
    >>> bool(np.allclose(net(x).asnumpy(), y.asnumpy(), atol=1e-5))
    True
    """
    report = ConversionReport()
    if sample is not None:
        _record_input_ranks(block, sample)
    root = _blocktree.root_holder(
        block, lambda b: _plan(b, getattr(b, "_gn_mx_ndim", None))[0] is not None)
    targets = []
    for parent, key, child, path in _blocktree.walk(root):
        kind, groups, eps, reason = _plan(child, getattr(child, "_gn_mx_ndim", None))
        if kind is None:
            continue
        if reason:
            report.left.append((path, reason))
            continue
        targets.append((parent, key, child, path, kind, groups, eps))
    for parent, key, child, path, kind, groups, eps in targets:
        act, act_key = None, None
        if fuse_activation and isinstance(parent, (gluon.nn.HybridSequential, gluon.nn.Sequential)):
            keys = list(parent._children.keys())
            i = keys.index(key)
            if i + 1 < len(keys):
                act = _act_of(parent._children[keys[i + 1]])
                act_key = keys[i + 1] if act else None
        new, reason = _new_block(child, kind, groups, eps, act)
        if new is None:
            report.left.append((path, reason))
            continue
        _blocktree.replace_child(parent, key, child, new)
        what = f"{type(child).__name__} ({kind}) -> {new!r}"
        report.replaced.append((path, what))
        if act_key is not None:
            nxt = parent._children[act_key]
            _blocktree.replace_child(parent, act_key, nxt, _Fused(act, key, prefix=nxt.prefix))
            report.fused.append((path, act))
    _blocktree.clear_hybrid_caches(root)
    for b in _blocktree.blocks(root):
        for attr in ("_gn_mx_ndim", "_gn_mx_channels"):  # this call's sample only
            b.__dict__.pop(attr, None)
    result = _blocktree.unwrap(root, block)
    result.gn_mx_report = report
    _warn_left("gn_mx.convert", report)
    if verbose:
        print(report)
    return result


def _warn_left(who, report):
    """One UserWarning naming every norm layer a conversion left in place, with its reason (the
    report has them too; a warning keeps them from going unnoticed)."""
    if report.left:
        items = "; ".join(f"{p}: {r}" for p, r in report.left)
        warnings.warn(f"{who}: {len(report.left)} normalization layer(s) left in place "
                      f"(not converted to gn_mx): {items}", UserWarning, stacklevel=3)


# ------------------------------------------------------------------------------------------------
# Exported symbols

def _attr(node, key, default):
    return node.get("attrs", {}).get(key, default)


def _channels_from_shapes(sym, arg_params, aux_params, data_shapes):
    """{internal output name: channel count} from shape inference (partial is fine)."""
    internals = sym.get_internals()
    shapes = {k: v.shape for k, v in arg_params.items()}
    shapes.update({k: v.shape for k, v in aux_params.items()})
    shapes.update(data_shapes or {})
    names = set(internals.list_arguments()) | set(internals.list_auxiliary_states())
    try:
        _, out_shapes, _ = internals.infer_shape_partial(
            **{k: v for k, v in shapes.items() if k in names})
    except mx.base.MXNetError:
        return {}
    result = {}
    for name, s in zip(internals.list_outputs(), out_shapes or []):
        if s is not None and len(s) >= 2 and s[1] > 0:
            result[name] = int(s[1])
    return result


# Ops whose output has the channel count of their first input (followed when looking for the
# layer that sets a norm's channel count).
_SAME_CHANNELS = {"Activation", "relu", "sigmoid", "tanh", "LeakyReLU", "BatchNorm", "Dropout",
                  "elemwise_add", "elemwise_sub", "elemwise_mul", "_Plus", "_plus", "_add",
                  "broadcast_add", "_copy", "identity", "clip", "_plus_scalar", "_minus_scalar",
                  "_mul_scalar", "_div_scalar", "Pooling", "GroupNorm", "InstanceNorm",
                  "gn_group_norm", "Cast", "amp_cast"}


def _channels_from_producer(nodes, entry):
    """C of a node's output entry, read from the Convolution/Deconvolution (num_filter) or
    FullyConnected (num_hidden) that produces it, through channel-preserving ops; None if unknown."""
    seen = 0
    while seen < 1000:
        seen += 1
        node = nodes[entry[0]]
        op = node["op"]
        if op in ("Convolution", "Deconvolution") and "num_filter" in node.get("attrs", {}):
            return int(node["attrs"]["num_filter"])
        if op == "FullyConnected" and "num_hidden" in node.get("attrs", {}):
            flatten = str(_attr(node, "flatten", "True")).lower() in ("true", "1")
            return int(node["attrs"]["num_hidden"]) if flatten else None
        if op not in _SAME_CHANNELS or not node["inputs"]:
            return None
        entry = node["inputs"][0]
    return None


def _entry_name(nodes, entry):
    node = nodes[entry[0]]
    if node["op"] == "null":
        return node["name"]
    return f"{node['name']}_output" if _num_outputs(node) == 1 else \
        f"{node['name']}_output{entry[1]}"


def _num_outputs(node):
    """Outputs of a node (when the JSON has no node_row_ptr): a one-node graph of its op."""
    op = node["op"]
    if op == "null":
        return 1
    k = len(node["inputs"])
    try:
        return len(mx.sym.load_json(json.dumps({
            "nodes": [{"op": "null", "name": f"in{i}", "inputs": []} for i in range(k)] +
                     [{"op": op, "name": node["name"], "attrs": node.get("attrs", {}),
                       "inputs": [[i, 0, 0] for i in range(k)]}],
            "arg_nodes": list(range(k)), "heads": [[k, 0, 0]],
            "attrs": {"mxnet_version": ["int", 10901]}})).list_outputs())
    except mx.base.MXNetError:
        return 1


def _swish_after(nodes, consumers, heads, i):
    """(mul node, [nodes to drop]) when norm node i's only use is x * sigmoid(x) (gluon.nn.Swish
    with beta = 1 exports as _mul_scalar(x, 1) -> sigmoid -> elemwise_mul(x, .)), else None."""
    ids = {j for j, _ in consumers[i]}
    if len(consumers[i]) != 2 or len(ids) != 2 or (i, 0) in heads:
        return None
    muls = [j for j in ids if nodes[j]["op"] in ("elemwise_mul", "broadcast_mul", "_mul", "_Mul")]
    if len(muls) != 1:
        return None
    m = muls[0]
    first = (ids - {m}).pop()
    chain, s = [first], first
    if nodes[first]["op"] == "_mul_scalar":
        if float(_attr(nodes[first], "scalar", "nan")) != 1.0 or len(consumers[first]) != 1:
            return None
        s = consumers[first][0][0]
        chain.append(s)
    is_sigmoid = nodes[s]["op"] == "sigmoid" or (
        nodes[s]["op"] == "Activation" and _attr(nodes[s], "act_type", "") == "sigmoid")
    if not is_sigmoid or len(consumers[s]) != 1 or consumers[s][0][0] != m \
            or any((k, 0) in heads for k in chain):
        return None
    if sorted(tuple(e[:2]) for e in nodes[m]["inputs"]) != sorted([(i, 0), (s, 0)]):
        return None
    return m, chain


def convert_symbol(sym, arg_params, aux_params, fuse_activation=False, data_shapes=None,
                   report=None):
    """Rewrite the ``GroupNorm`` / ``InstanceNorm`` nodes of an exported symbol into ``gn_group_norm``.

    Returns ``(sym, arg_params, aux_params)`` (new dicts; the inputs are not modified). MXNet
    GroupNorm's per-group gamma/beta (G,) become per-channel (C,) (same names); C comes from shape
    inference when ``data_shapes`` {input name: shape} is given, else from the Convolution /
    Deconvolution (num_filter) or FullyConnected (num_hidden) that feeds the norm through
    channel-preserving ops (activations, BatchNorm, additions, pooling, ...). With
    ``fuse_activation`` a norm whose only consumer is ``Activation(act_type='relu')`` / ``relu``, or
    whose only use is a swish ``x * sigmoid(x)`` (gluon.nn.Swish(beta=1)), becomes one
    ``gn_group_norm(act_type='relu' | 'silu')`` node (named as the activation / the product). Nodes that cannot be mapped
    exactly stay, with the reason in ``report`` (a :class:`ConversionReport`, when given) and in
    one ``UserWarning``. Gluon's ``InstanceNorm(axis=-1)`` exports as swapaxes around the op: its
    node is converted as channels first, the swapaxes stay.

    Parameters
    ----------
    sym : Symbol
        The model's graph (``mx.model.load_checkpoint``'s first value).
    arg_params : dict of str to NDArray
        Its arguments (parameters).
    aux_params : dict of str to NDArray
        Its auxiliary states (may be empty or None).
    fuse_activation : bool, default False
        Fuse a following relu / swish into the converted node.
    data_shapes : dict of str to tuple, optional
        Input shapes, for channel counts that cannot be found from the parameters alone.
    report : ConversionReport, optional
        Filled with what was done and what was left.

    Returns
    -------
    sym, arg_params, aux_params
        The converted symbol and new parameter dicts.

    Examples
    --------
    >>> x = mx.sym.var('data')
    >>> s = mx.sym.GroupNorm(mx.sym.Convolution(x, num_filter=4, kernel=(3, 3), name='c'),
    ...                      num_groups=2, name='gn')
    >>> args = {'c_weight': mx.nd.ones((4, 3, 3, 3)), 'c_bias': mx.nd.zeros(4),
    ...         'gn_gamma': mx.nd.array([1., 2.]), 'gn_beta': mx.nd.zeros(2)}
    >>> s2, args2, aux2 = gn_mx.convert_symbol(s, args, {})
    >>> args2['gn_gamma'].asnumpy()
    array([1., 1., 2., 2.], dtype=float32)
    """
    report = report if report is not None else ConversionReport()
    g = json.loads(sym.tojson())
    nodes = g["nodes"]
    arg_params = dict(arg_params)
    aux_params = dict(aux_params or {})
    plans, dropped = _plan_symbol(sym, g, arg_params, aux_params, fuse_activation, data_shapes,
                                  report)
    _per_channel_params(nodes, plans, arg_params)
    new_sym = mx.sym.load_json(json.dumps(_rewrite_graph(g, plans, dropped, report)))
    _warn_left("gn_mx.convert_symbol", report)
    return new_sym, arg_params, aux_params


def _consumers(nodes):
    """[[(consumer node id, input slot)] per node] of a symbol's node list."""
    consumers = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for e in node["inputs"]:
            consumers[e[0]].append((i, e[1]))
    return consumers


def _plan_symbol(sym, g, arg_params, aux_params, fuse_activation, data_shapes, report):
    """convert_symbol's decisions: ({norm node id: (num_groups, eps, fused activation node id or
    None, act, C)}, {the _mul_scalar / sigmoid nodes of a fused swish}); what stays goes into
    ``report.left`` with the reason."""
    nodes = g["nodes"]
    channels = None
    consumers = _consumers(nodes)
    heads = {tuple(h[:2]) for h in g["heads"]}
    plans, dropped = {}, set()
    for i, node in enumerate(nodes):
        if node["op"] not in ("GroupNorm", "InstanceNorm"):
            continue
        name = node["name"]
        if str(_attr(node, "output_mean_var", "False")).lower() in ("true", "1"):
            report.left.append((name, f"{node['op']}(output_mean_var=True): its mean/std outputs "
                                      "have no gn_group_norm equivalent"))
            continue
        gamma = nodes[node["inputs"][1][0]]
        beta = nodes[node["inputs"][2][0]]
        if gamma["op"] != "null" or beta["op"] != "null" or gamma["name"] not in arg_params \
                or beta["name"] not in arg_params:
            report.left.append((name, "gamma/beta are not parameters of the model"))
            continue
        if node["op"] == "InstanceNorm":
            c = int(arg_params[gamma["name"]].shape[0])
            groups, eps = c, float(_attr(node, "eps", "0.001"))
        else:
            groups, eps = int(_attr(node, "num_groups", "1")), float(_attr(node, "eps", "1e-05"))
            c = None
            if data_shapes:
                if channels is None:
                    channels = _channels_from_shapes(sym, arg_params, aux_params, data_shapes)
                c = channels.get(_entry_name(nodes, node["inputs"][0]))
            if c is None:
                c = _channels_from_producer(nodes, node["inputs"][0])
            if c is None:
                report.left.append((name, "GroupNorm: the channel count of its input is unknown "
                                          "(pass data_shapes / --data-shape)"))
                continue
            if c % groups:
                report.left.append((name, f"GroupNorm: C={c} not divisible by num_groups={groups}"))
                continue
        fused, act = None, None
        outs = consumers[i]
        if fuse_activation and len(outs) == 1 and (i, 0) not in heads:
            j = outs[0][0]
            if (nodes[j]["op"] == "Activation" and _attr(nodes[j], "act_type", "") == "relu") \
                    or nodes[j]["op"] == "relu":
                fused, act = j, "relu"
        if fuse_activation and fused is None:
            sw = _swish_after(nodes, consumers, heads, i)
            if sw is not None:
                (fused, chain), act = sw, "silu"
                dropped.update(chain)
        plans[i] = (groups, eps, fused, act, c)
    return plans, dropped


def _per_channel_params(nodes, plans, arg_params):
    """MXNet GroupNorm's per-group gamma / beta (G,) repeated to per-channel (C,) in arg_params
    (same names), and their variables' ``__shape__``."""
    done = set()
    for i, (groups, _, _, _, c) in plans.items():
        node = nodes[i]
        if node["op"] != "GroupNorm":
            continue
        for k in (1, 2):
            var = nodes[node["inputs"][k][0]]
            if var["name"] in done:
                continue
            done.add(var["name"])
            arg_params[var["name"]] = arg_params[var["name"]].repeat(c // groups)
            if "__shape__" in var.get("attrs", {}):
                var["attrs"]["__shape__"] = str((c,))


def _rewrite_graph(g, plans, dropped, report):
    """The symbol JSON with each planned norm as a gn_group_norm node on the norm's first three
    inputs (data, gamma, beta; a BatchNorm's running statistics are not passed on), a fused one at
    its activation's position, named as it, and the ``dropped`` nodes left out; fills
    ``report.replaced`` / ``report.fused``."""
    nodes = g["nodes"]
    row_ptr = g.get("node_row_ptr")
    if row_ptr and len(row_ptr) == len(nodes) + 1:
        n_out = [row_ptr[i + 1] - row_ptr[i] for i in range(len(nodes))]
    else:
        n_out = [_num_outputs(n) for n in nodes]
    new_nodes, new_nout, remap = [], [], {}
    fused_into = {f: i for i, (_, _, f, _, _) in plans.items() if f is not None}
    for i, node in enumerate(nodes):
        if (i in plans and plans[i][2] is not None) or i in dropped:
            continue  # a fused norm is emitted at its activation's position
        src = fused_into.get(i)
        if src is not None or i in plans:
            norm = nodes[src if src is not None else i]
            groups, eps, _, act, _ = plans[src if src is not None else i]
            attrs = {"num_groups": str(groups), "eps": repr(eps)}
            if act:
                attrs["act_type"] = act
            out = {"op": "gn_group_norm", "name": node["name"], "attrs": attrs,
                   "inputs": [list(remap[tuple(e[:2])]) + [0] for e in norm["inputs"][:3]]}
            remap[(i, 0)] = (len(new_nodes), 0)
            new_nodes.append(out)
            new_nout.append(3)  # out, mean, rstd
            what = f"{norm['op']} -> gn_group_norm(num_groups={groups}, eps={eps}" + \
                (f", act_type='{act}')" if act else ")")
            report.replaced.append((norm["name"], what))
            if act:
                report.fused.append((norm["name"], act))
            continue
        out = copy.deepcopy(node)
        out["inputs"] = [list(remap[tuple(e[:2])]) + [e[2] if len(e) > 2 else 0]
                         for e in node["inputs"]]
        for k in range(n_out[i]):
            remap[(i, k)] = (len(new_nodes), k)
        new_nodes.append(out)
        new_nout.append(n_out[i])
    result = {"nodes": new_nodes,
              "arg_nodes": [k for k, n in enumerate(new_nodes) if n["op"] == "null"],
              "heads": [list(remap[tuple(h[:2])]) + [0] for h in g["heads"]],
              "attrs": g.get("attrs", {})}
    result["node_row_ptr"] = [0]
    for k in new_nout:
        result["node_row_ptr"].append(result["node_row_ptr"][-1] + k)
    return result
