"""Symbol-API helpers: build gn_mx layers in ``mx.sym`` graphs (``mx.mod.Module``, symbolic model code).

The raw ops (``mx.sym.gn_group_norm`` ...) need their parameter inputs passed explicitly. These helpers
create them as named variables, the way ``mx.sym.BatchNorm`` / ``mx.sym.GroupNorm`` do:

* ``group_norm(data, num_groups, ...)`` -> variables ``{name}_gamma``, ``{name}_beta`` (arguments);
* ``decorrelated_batch_norm(data, ...)`` -> ``{name}_gamma``, ``{name}_beta`` (arguments) and
  ``{name}_running_mean``, ``{name}_running_projection`` (auxiliary states: ``gn_dbn`` and
  ``gn_dbn_inference`` declare them mutable, so ``Module`` keeps them in ``aux_params`` and
  initializes them through the variables' ``__init__`` attributes: zeros and identities).

The names match gn_mx's Gluon blocks (``{prefix}gamma`` ... with ``name=prefix[:-1]``), so parameters
saved from a Gluon net load into a symbol built with the same names and vice versa.

Shapes: with ``in_channels`` the variables get explicit shapes, so ``Module.bind`` (which knows only
the data shape) can infer everything. Without it the shapes come from the ops' shape inference.

Train vs predict: library ops receive no ``is_train`` flag, and ``Module.forward(is_train=False)``
cannot switch DBN to its running statistics. Build one symbol per mode, with the same names:
``training=True`` (``gn_dbn``: batch statistics, running statistics updated in every forward,
including ``Module.score`` / ``fit(eval_data=...)`` on that module) for ``Module.fit``, and
``training=False`` (``gn_dbn_inference``) for prediction, binding the trained
``arg_params``/``aux_params``; or convert a training symbol with :func:`inference_symbol`.
"""
import json

import mxnet as mx

from . import _compat, _np
from ._validate import axis_attr, check_dbn_numbers, check_groups, check_whitening, dbn_grouping
from .nn import GroupIdentity

from .ws import ws_convolution  # Weight Standardization (gn_mx/ws.py)

__all__ = ["group_norm", "decorrelated_batch_norm", "inference_symbol", "ws_convolution"]


def _auto_name(name, hint):
    return _compat.current_name_manager().get(name, hint)


def _param(given, name, shape, init=None):
    if given is not None:
        return _np.to_legacy(given)
    # stype: Module's simple_bind leaves the storage type of aux states undefined, which library
    # ops reject ("input tensors are not dense for custom operator"); state it explicitly.
    return mx.sym.var(name, shape=shape, init=init, stype="default")


def _init(initializer):
    if initializer is None:
        return None
    return mx.init.create(initializer) if isinstance(initializer, str) else initializer


def group_norm(data, num_groups, eps=1e-5, name=None, gamma=None, beta=None, in_channels=0,
               gamma_initializer=None, beta_initializer=None, axis=1):
    """GroupNorm with per-channel affine: ``gn_group_norm(data, {name}_gamma, {name}_beta)[0]``.

    Parameters
    ----------
    data : Symbol, shape (N, C, *spatial)
        Legacy or NumPy-interface symbol; the result has the same kind.
    num_groups : int
        Number of channel groups; C must be divisible by it.
    eps : float, default 1e-5
        Added to the variance (>= 0).
    name : str, optional
        The node's name and the prefix of its variables (default: MXNet's name manager,
        ``groupnorm0``, ...).
    gamma : Symbol, optional
        An existing symbol to use instead of creating the variable ``{name}_gamma``.
    beta : Symbol, optional
        An existing symbol to use instead of creating the variable ``{name}_beta``.
    in_channels : int, default 0
        C, to give gamma/beta the explicit shape (C,) (0: left to shape inference).
    gamma_initializer : str or Initializer, optional
        Stored on the variable (``Module.init_params`` honours it); by default ``Module``'s
        initializer handles the ``_gamma`` suffix (ones), as for ``mx.sym.BatchNorm``.
    beta_initializer : str or Initializer, optional
        The same for ``{name}_beta`` (default zeros by its suffix).
    axis : int, default 1
        The channel axis: 1 (data (N, C, *spatial)) or the last axis (-1: channels-last data
        (N, *spatial, C)). 1 leaves the attribute out of the graph.

    Returns
    -------
    Symbol
        The normalized output, shape of data.

    Raises
    ------
    ValueError
        A bad ``num_groups``, ``eps`` or ``in_channels`` (not divisible by num_groups).

    Examples
    --------
    >>> y = gn_mx.sym.group_norm(mx.sym.var('data'), num_groups=2, name='gn0')
    >>> y.list_arguments()
    ['data', 'gn0_gamma', 'gn0_beta']
    >>> y.infer_shape(data=(2, 4, 5))[1]
    [(2, 4, 5)]
    """
    check_groups("gn_mx.sym.group_norm", num_groups, eps, in_channels)
    kw = axis_attr("gn_mx.sym.group_norm", axis)
    np_kind = _np.is_np(data)
    name = _auto_name(name, "groupnorm")
    shape = (in_channels,) if in_channels else None
    g = _param(gamma, f"{name}_gamma", shape, _init(gamma_initializer))
    b = _param(beta, f"{name}_beta", shape, _init(beta_initializer))
    out = mx.sym.gn_group_norm(_np.to_legacy(data), g, b, num_groups=int(num_groups),
                               eps=float(eps), name=name, **kw)[0]
    return _np.like(out, np_kind)


def decorrelated_batch_norm(data, num_groups=None, group_size=None, eps=1e-5, momentum=0.9,
                            training=True, name=None, in_channels=0, gamma=None, beta=None,
                            running_mean=None, running_projection=None, use_global_stats=False,
                            whitening="zca", iterations=5):
    """Decorrelated BN: whitening and the per-channel affine in one op (``gn_dbn`` if ``training``
    else ``gn_dbn_inference``, both with ``affine=True``; the same graph as the Gluon block).

    Parameters
    ----------
    data : Symbol, shape (N, C, *spatial)
        Legacy or NumPy-interface symbol; the result has the same kind.
    num_groups : int, optional
        Number of channel groups (give at most one of num_groups and group_size; neither: 16).
    group_size : int, optional
        Channels per group D instead; needs ``in_channels`` here (a symbol has no channel count to
        divide).
    eps : float, default 1e-5
        Added to the covariance diagonal (> 0).
    momentum : float, default 0.9
        Running statistics decay, in [0, 1].
    training : bool, default True
        True for the symbol given to ``Module.fit`` (batch statistics; the aux states
        ``{name}_running_mean`` (C,) / ``{name}_running_projection`` (G, D, D) are updated in
        place in every forward), False for prediction (running statistics). Build both with the
        same ``name`` (or use :func:`inference_symbol`) so they share arguments and aux states.
    name : str, optional
        The node's name and the prefix of its variables.
    in_channels : int, default 0
        C, to give the variables explicit shapes (0: left to shape inference).
    gamma : Symbol, optional
        An existing symbol instead of the variable ``{name}_gamma`` (C,).
    beta : Symbol, optional
        An existing symbol instead of the variable ``{name}_beta`` (C,).
    running_mean : Symbol, optional
        An existing symbol instead of the aux variable ``{name}_running_mean`` (C,).
    running_projection : Symbol, optional
        An existing symbol instead of the aux variable ``{name}_running_projection`` (G, D, D).
    use_global_stats : bool, default False
        Running statistics in both modes (as BatchNorm's switch).
    whitening : {'zca', 'iternorm'}, default 'zca'
        The training whitening (see ``DecorrelatedBatchNorm``); prediction is the same for both.
    iterations : int, default 5
        IterNorm's number of iterations, in [1, 10].

    Returns
    -------
    Symbol
        The normalized output, shape of data.

    Raises
    ------
    ValueError
        Both num_groups and group_size, group_size without in_channels, a bad eps, momentum,
        whitening or iterations.

    Examples
    --------
    >>> y = gn_mx.sym.decorrelated_batch_norm(mx.sym.var('data'), num_groups=2, in_channels=4,
    ...                                       name='dbn0')
    >>> y.list_auxiliary_states()
    ['dbn0_running_mean', 'dbn0_running_projection']
    >>> y.infer_shape(data=(8, 4))[2]
    [(4,), (2, 2, 2)]
    """
    check_whitening("gn_mx.sym.decorrelated_batch_norm", whitening, iterations)
    num_groups, group_size = dbn_grouping(num_groups, group_size, eps, in_channels)
    check_dbn_numbers("gn_mx.sym.decorrelated_batch_norm", eps, momentum, eps_name="eps")
    if num_groups is None:
        raise ValueError("gn_mx.sym.decorrelated_batch_norm: group_size needs in_channels in the "
                         "Symbol API")
    np_kind = _np.is_np(data)
    name = _auto_name(name, "decorrelatedbatchnorm")
    C = in_channels
    D = C // num_groups if C else 0
    g = _param(gamma, f"{name}_gamma", (C,) if C else None)
    b = _param(beta, f"{name}_beta", (C,) if C else None)
    rm = _param(running_mean, f"{name}_running_mean", (C,) if C else None, mx.init.Zero())
    rp = _param(running_projection, f"{name}_running_projection",
                (num_groups, D, D) if C else None, GroupIdentity())
    x = _np.to_legacy(data)
    if training and not use_global_stats:
        kw = {} if whitening == "zca" else {"whitening": whitening, "iterations": int(iterations)}
        out = mx.sym.gn_dbn(x, g, b, rm, rp, num_groups=num_groups, eps=float(eps),
                            momentum=float(momentum), affine=True, name=name, **kw)[0]
    else:
        out = mx.sym.gn_dbn_inference(x, g, b, rm, rp, num_groups=num_groups, affine=True,
                                      name=name)
    return _np.like(out, np_kind)


def inference_symbol(symbol):
    """The prediction graph of a training symbol: every ``gn_dbn`` becomes ``gn_dbn_inference``
    with the same inputs (arguments and aux states keep their names), nothing else changes.

    Also for symbols exported from Gluon (``mx.sym.load``) that are to be bound with
    ``mx.mod.Module``: the DBN aux-state variables get an explicit dense storage type, without
    which ``simple_bind`` rejects library ops ("input tensors are not dense").

    Parameters
    ----------
    symbol : Symbol
        Legacy or NumPy-interface symbol; the result has the same kind.

    Returns
    -------
    Symbol
        The converted graph.

    Raises
    ------
    ValueError
        The graph uses or outputs one of gn_dbn's backward-only outputs (mean, eigvec, eigval),
        which gn_dbn_inference does not have.

    Examples
    --------
    >>> train = gn_mx.sym.decorrelated_batch_norm(mx.sym.var('data'), num_groups=2, name='dbn0')
    >>> pred = gn_mx.sym.inference_symbol(train)
    >>> import json
    >>> [n['op'] for n in json.loads(pred.tojson())['nodes'] if n['op'] != 'null']
    ['gn_dbn_inference']
    >>> pred.list_auxiliary_states() == train.list_auxiliary_states()
    True
    """
    np_kind = _np.is_np(symbol)
    graph = json.loads(_np.to_legacy(symbol).tojson())
    nodes = graph["nodes"]
    changed = set()
    for i, node in enumerate(nodes):
        if node["op"] == "gn_dbn":
            node["op"] = "gn_dbn_inference"
            attrs = node.get("attrs", {})
            node["attrs"] = {k: v for k, v in attrs.items()
                             if k not in ("eps", "momentum", "whitening", "iterations")}
            changed.add(i)
        if node["op"] == "gn_dbn_inference":
            # every input after data: (gamma, beta with affine,) running_mean, running_projection
            for src, _, *_ in node["inputs"][1:]:
                if nodes[src]["op"] == "null":
                    nodes[src].setdefault("attrs", {}).setdefault("__storage_type__", "0")
    for node in graph["nodes"]:
        for entry in node.get("inputs", []):
            if entry[0] in changed and entry[1] != 0:
                raise ValueError("inference_symbol: the graph uses a backward-only output of gn_dbn")
    for entry in graph.get("heads", []):
        if entry[0] in changed and entry[1] != 0:
            raise ValueError("inference_symbol: the graph outputs a backward-only output of gn_dbn")
    return _np.like(mx.sym.load_json(json.dumps(graph)), np_kind)
