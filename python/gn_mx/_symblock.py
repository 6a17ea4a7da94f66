"""``replace_norm`` and ``standardize_convs`` inside ``gluon.SymbolBlock``s: the BatchNorm nodes of
a SymbolBlock's graph become ``gn_group_norm`` nodes (docs/guide/replace_norm.md, "Inside
SymbolBlocks"); its Convolution nodes get their weight through ``gn_weight_standardize``
(docs/guide/weight_standardization.md).

A SymbolBlock (``SymbolBlock.imports`` of an exported model, GluonCV's ``FeatureExpander`` /
``FPNFeatureExpander`` backbones) holds a graph, not child blocks, so the block walk cannot see its
norm layers. Here its graph is rewritten: each BatchNorm node (``BatchNorm``,
``_contrib_SyncBatchNorm``, ``_contrib_BatchNormWithReLU``) on the channel axis 1 or -1
(channels last: the node gets ``axis=-1``) becomes a ``gn_group_norm`` node with the same name,
input, gamma and beta (the same Parameter objects: same names, shape (C,), values kept with
``copy_affine``, else ones / zeros); the running mean and variance leave the graph and the
block's parameters. The group rule is ``replace_norm``'s; a node that cannot be rewritten is
reported with the reason.
"""
import copy
import json

import mxnet as mx
from mxnet import gluon

from . import _blocktree, _compat, _convert

#: The BatchNorm ops of a graph (the ``batch_norm`` kind of ``replace_norm``).
BATCH_NORM_OPS = ("BatchNorm", "_contrib_SyncBatchNorm", "_contrib_BatchNormWithReLU")
#: Graph ops of the other kinds, reported as left when included.
_OTHER_OPS = {"InstanceNorm": "instance_norm", "LayerNorm": "layer_norm"}
#: norm_kwargs a graph node can take (GroupNorm's keywords that are node attributes).
_NODE_KWARGS = ("epsilon", "activation")


def symbol_blocks(root):
    """``[(path, SymbolBlock)]`` of ``root`` and its descendants (path '' for root itself)."""
    found = [("", root)] + [(p, c) for _, _, c, p in _blocktree.walk(root)]
    return [(p, b) for p, b in found if isinstance(b, gluon.SymbolBlock)]


def _graph(sb):
    """A SymbolBlock's output Symbol (its graph is kept as the traced one: inputs, outputs)."""
    return _compat.hybrid_cache(sb).graph[1]


def _where(path, name):
    return f"{path}:{name}" if path else name


def _attr_true(node, key, default):
    return str(_convert._attr(node, key, default)).lower() in ("true", "1")


def _channels(sb, nodes, node):
    """C of a norm node: its gamma Parameter's shape, else the producer of its input, else 0."""
    p = sb.params._params.get(nodes[node["inputs"][1][0]]["name"])
    if p is not None and p.shape and p.shape[0] > 0:
        return int(p.shape[0])
    return _convert._channels_from_producer(nodes, node["inputs"][0]) or 0


def _node_plan(sb, nodes, node, group_of, norm_name, norm_kwargs):
    """(plan tuple for _convert._rewrite_graph, None, None), (None, reason to leave, None) or
    (None, None, error for the up-front ValueError) for one BatchNorm node; ``group_of(C)``:
    replace_norm's group rule (a ValueError when it cannot divide C)."""
    axis = int(_convert._attr(node, "axis", "1"))
    if norm_name != "GroupNorm":
        return None, (f"{node['op']} node: inside a SymbolBlock only GroupNorm replaces "
                      f"BatchNorm ({norm_name} is not supported there)"), None
    if axis not in (1, -1):
        return None, (f"{node['op']}(axis={axis}) node: gn_group_norm takes the channel axis 1 or "
                      "-1 (the last); a graph does not tell whether axis "
                      f"{axis} is its input's last (replace it in the Gluon net before exporting, "
                      "or export it with axis=-1)"), None
    if _attr_true(node, "output_mean_var", "False"):
        return None, (f"{node['op']}(output_mean_var=True) node: its mean/var outputs have no "
                      "gn_group_norm equivalent"), None
    other = sorted(k for k in norm_kwargs if k not in _NODE_KWARGS)
    if other:
        return None, (f"norm_kwargs {other} have no gn_group_norm node attribute (only "
                      f"{list(_NODE_KWARGS)} apply inside a SymbolBlock)"), None
    if any(nodes[e[0]]["op"] != "null" for e in node["inputs"][1:3]):
        return None, f"{node['op']} node: gamma/beta are not parameters of the graph", None
    c = _channels(sb, nodes, node)
    if not c:
        return None, (f"{node['op']} node: the channel count is unknown (initialize the block "
                      "or run one batch first)"), None
    try:
        groups = group_of(c)
    except ValueError as e:
        return None, None, str(e)
    eps = float(norm_kwargs.get("epsilon", _convert._attr(node, "eps", "0.001")))
    act = norm_kwargs.get("activation") or (
        "relu" if node["op"] == "_contrib_BatchNormWithReLU" else None)
    return (groups, eps, None, act, c), None, None


def plan(sb, path, group_of, norm_name, include, norm_kwargs):
    """One SymbolBlock's rewrite, decided before anything changes: (plans, left, errors) with
    plans {node id: plan} (the graph is read again by :func:`apply`), left [(where, reason)] and
    errors [the message of a node whose C the grouping cannot divide]."""
    nodes = json.loads(_graph(sb).tojson())["nodes"]
    plans, left, errors = {}, [], []
    for i, node in enumerate(nodes):
        if node["op"] in _OTHER_OPS and _OTHER_OPS[node["op"]] in include:
            left.append((_where(path, node["name"]), f"{node['op']} node: inside a SymbolBlock "
                         "replace_norm rewrites BatchNorm nodes only"))
        if node["op"] not in BATCH_NORM_OPS or "batch_norm" not in include:
            continue
        p, reason, error = _node_plan(sb, nodes, node, group_of, norm_name, norm_kwargs)
        if p is not None:
            plans[i] = p
        elif reason:
            left.append((_where(path, node["name"]), reason))
        else:
            errors.append(f"'{_where(path, node['name'])}' ({node['op']} node): {error}")
    return plans, left, errors


def _statistics_nodes(nodes, plans):
    """The running-mean / running-variance variables used only by the planned nodes."""
    consumers = _convert._consumers(nodes)
    stats = {e[0] for i in plans for e in nodes[i]["inputs"][3:5]}
    return {v for v in stats if nodes[v]["op"] == "null"
            and all(j in plans for j, _ in consumers[v])}


def apply(sb, path, plans, copy_affine, report):
    """Rewrites SymbolBlock ``sb`` by ``plans`` (from :func:`plan`): its graph, its parameters
    (running statistics removed; gamma/beta reset unless ``copy_affine``; a fixed gamma set to
    ones) and its traced caches; appends ``(where, what)`` to ``report.replaced``."""
    g = json.loads(_graph(sb).tojson())
    nodes = g["nodes"]
    dropped = _statistics_nodes(nodes, plans)
    rewritten = _convert._rewrite_graph(g, plans, dropped, _convert.ConversionReport())
    last = {nodes[i]["name"] for i in plans if int(_convert._attr(nodes[i], "axis", "1")) == -1}
    for n in rewritten["nodes"]:
        if n["op"] == "gn_group_norm" and n["name"] in last:
            n["attrs"]["axis"] = "-1"  # channels last (GroupNorm(axis=-1)'s attribute)
    new_out = mx.sym.load_json(json.dumps(rewritten))
    params = sb.params._params
    for i in plans:
        node = nodes[i]
        gamma, beta = (params.get(nodes[e[0]]["name"]) for e in node["inputs"][1:3])
        fixed = _attr_true(node, "fix_gamma", "True")
        for p, one, reset in ((gamma, True, fixed or not copy_affine),
                              (beta, False, not copy_affine)):
            if p is not None and reset and _blocktree.param_state(p) == "init":
                p.set_data((mx.nd.ones if one else mx.nd.zeros)(p.shape, dtype=p.dtype))
        if fixed and gamma is not None:
            gamma.grad_req = "null"
    for v in dropped:
        params.pop(nodes[v]["name"], None)
    sb._reg_params = {k: v for k, v in sb._reg_params.items() if v.name in params}
    cache = _compat.hybrid_cache(sb)  # a SymbolBlock's graph is its "traced" graph
    _compat.set_hybrid_cache(sb, cache._replace(graph=(cache.graph[0], new_out)))
    _blocktree.clear_hybrid_caches(sb)
    for i, (groups, eps, _, act, c) in plans.items():
        what = f"{nodes[i]['op']}(C={c}) node -> gn_group_norm(num_groups={groups}, eps={eps}" + \
            (f", act_type='{act}'" if act else "") + (", axis=-1)" if nodes[i]["name"] in last
                                                       else ")")
        report.replaced.append((_where(path, nodes[i]["name"]), what))


# ---- standardize_convs inside SymbolBlocks -----------------------------------------------------

def _gain_name(weight_name):
    """The gain Parameter of a standardized weight: ``<prefix>gain`` as a WSConv*D names it."""
    base = weight_name[:-len("weight")] if weight_name.endswith("weight") else weight_name + "_"
    return base + "gain"


def ws_plan(sb, path, include):
    """``[(where, conv node id)]``: the Convolution nodes of SymbolBlock ``sb`` whose weight is a
    variable of the graph (a weight already standardized is the output of an op: left alone), and
    that ``include(where, node)`` accepts (``node``: the node's JSON dict)."""
    nodes = json.loads(_graph(sb).tojson())["nodes"]
    found = []
    for i, node in enumerate(nodes):
        if node["op"] != "Convolution" or nodes[node["inputs"][1][0]]["op"] != "null":
            continue
        where = _where(path, node["name"])
        if include is None or include(where, node):
            found.append((where, i))
    return found


def _ws_graph(g, convs, ws_eps):
    """The symbol JSON with one gn_weight_standardize(weight, gain) node (and its gain variable)
    in front of the weight of each Convolution node in ``convs``; convolutions sharing a weight
    share its standardization. Returns (graph, {weight node id: gain name})."""
    nodes = g["nodes"]
    new_nodes, remap, ws_of, gains = [], {}, {}, {}
    for i, node in enumerate(nodes):
        out = copy.deepcopy(node)
        out["inputs"] = [[remap[e[0]], e[1], 0] for e in node["inputs"]]
        if i in convs:
            w = node["inputs"][1][0]
            if w not in ws_of:
                gains[w] = _gain_name(nodes[w]["name"])
                new_nodes.append({"op": "null", "name": gains[w], "inputs": [], "attrs": {
                    "__shape__": f"({_convert._attr(node, 'num_filter', '0')},)"}})
                new_nodes.append({"op": "gn_weight_standardize", "name": nodes[w]["name"] + "_ws",
                                  "attrs": {"eps": repr(ws_eps)},
                                  "inputs": [[remap[w], 0, 0], [len(new_nodes) - 1, 0, 0]]})
                ws_of[w] = len(new_nodes) - 1
            out["inputs"][1] = [ws_of[w], 0, 0]
        remap[i] = len(new_nodes)
        new_nodes.append(out)
    return {"nodes": new_nodes,
            "arg_nodes": [k for k, n in enumerate(new_nodes) if n["op"] == "null"],
            "heads": [[remap[h[0]], h[1], 0] for h in g["heads"]],
            "attrs": g.get("attrs", {})}, gains


def ws_apply(sb, found, ws_eps, use_gain, gain_initializer):
    """Standardizes the weights of the Convolution nodes ``found`` (from :func:`ws_plan`) of
    SymbolBlock ``sb``: its graph, one new ``gain`` Parameter per weight (shape (O,), trained only
    with ``use_gain``; initialized where the weight is) and its traced caches."""
    g = json.loads(_graph(sb).tojson())
    new_g, gains = _ws_graph(g, {i for _, i in found}, ws_eps)
    params = sb.params._params
    for w, name in gains.items():
        weight = params.get(g["nodes"][w]["name"])
        num_filter = next(int(_convert._attr(n, "num_filter", "0")) for n in g["nodes"]
                          if n["op"] == "Convolution" and n["inputs"][1][0] == w)
        gain = gluon.Parameter(name, shape=(num_filter,), init=gain_initializer,
                               grad_req="write" if use_gain else "null",
                               dtype=weight.dtype if weight is not None else "float32")
        params[name] = gain
        if weight is not None and _blocktree.param_state(weight) == "init":
            gain.initialize(ctx=weight.list_ctx())
        elif weight is not None and _blocktree.param_state(weight) == "deferred":
            gain.initialize(ctx=weight._deferred_init[1])
    cache = _compat.hybrid_cache(sb)
    _compat.set_hybrid_cache(sb, cache._replace(
        graph=(cache.graph[0], mx.sym.load_json(json.dumps(new_g)))))
    _blocktree.clear_hybrid_caches(sb)
