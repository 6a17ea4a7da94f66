"""Weight Standardization (Qiao et al., 2019): convolutions whose weight is standardized per output
channel on every forward, by the op ``gn_weight_standardize`` (docs/guide/weight_standardization.md).

For a convolution weight ``w`` of shape (O, I/groups, *kernel) (any layout: O comes first in
MXNet's OIHW, OHWI, ... weights), each output channel's row of ``F = prod(shape[1:])`` fan-in
values is standardized to mean 0 and (biased) variance 1, optionally scaled by a learnable gain::

    w_hat[o, f] = gain[o] * (w[o, f] - mean_o) / sqrt(var_o + ws_eps)

and the convolution runs with ``w_hat``. Gradients flow through the standardization. The op is
GroupNorm's kernel on the weight seen as (1, O, F) data in O groups with gamma = gain, beta = 0.

- :class:`WSConv1D`, :class:`WSConv2D`, :class:`WSConv3D`: ``gluon.nn.Conv*D`` with the
  standardization in front (same arguments, plus ``ws_eps``, ``use_gain``, ``gain_initializer``);
- :func:`weight_standardize`: the functional op (NDArray/Symbol, legacy or NumPy interface);
- :func:`standardize_convs`: swap the ``Conv*D`` layers of a block tree for the WS versions
  before training (a change of model, not an exact conversion);
- ``gn_mx.sym.ws_convolution``: the symbolic layer for ``mx.mod.Module`` code.
"""
import math

import mxnet as mx
from mxnet.gluon import nn as _gnn
from mxnet.ndarray import NDArray

from . import _blocktree, _compat, _hybrid, _np, _symblock
from .ops import _both_kinds

__all__ = ["WSConv1D", "WSConv2D", "WSConv3D", "weight_standardize", "standardize_convs",
           "ws_convolution", "DEFAULT_WS_EPS"]

#: Default ``ws_eps``, added to each row's variance: timm's ``StdConv2d`` value. A Kaiming-scaled
#: 3x3x256 row has variance ~ 2/2304 ~ 9e-4, so 1e-6 shifts the scale by < 0.1%; constant rows
#: (variance 0) give exact zeros whatever eps is (> 0 keeps rstd finite).
DEFAULT_WS_EPS = 1e-6


def _check_eps(who, eps):
    try:
        value = float(eps)
    except (TypeError, ValueError):
        value = float("nan")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{who}: ws_eps must be a finite number >= 0; got {eps!r}")
    return value


@_both_kinds
def weight_standardize(weight, gain, eps=DEFAULT_WS_EPS, return_stats=False):
    """Weight Standardization of a weight per output channel (op ``gn_weight_standardize``).

    ``out[o, f] = gain[o] * (w[o, f] - mean[o]) * rstd[o]`` with the mean and population variance
    of each row ``w[o, :]`` (all dims after the first, flattened) and ``rstd = 1/sqrt(var + eps)``.

    Parameters
    ----------
    weight : NDArray or Symbol, shape (O, *fan_in dims)
        float16, float32 or float64, at least 2 dims. Legacy or NumPy interface; the results are
        of the same kind.
    gain : NDArray or Symbol, shape (O,)
        Per-output-channel scale: weight's dtype, or float32 with a float16 weight (ones for
        plain Weight Standardization).
    eps : float, default DEFAULT_WS_EPS (1e-6)
        Added to each row's variance (>= 0).
    return_stats : bool, default False
        Also return each row's ``mean`` and ``rstd``.

    Returns
    -------
    out : NDArray or Symbol, shape of weight
        weight's dtype.
    mean, rstd : NDArray or Symbol, shape (O,)
        Only with ``return_stats=True``: float32 for float16/float32 weights, float64 for float64.

    Raises
    ------
    MXNetError
        A weight with fewer than 2 dims or an empty one, gain not of shape (O,), a dtype mismatch,
        a bad ``eps``.

    Examples
    --------
    >>> w = mx.nd.array([[[1., 3.]], [[2., 2.]]])  # O=2 rows of fan-in 2; the second is constant
    >>> gn_mx.ws.weight_standardize(w, mx.nd.ones(2)).asnumpy().round(3)
    array([[[-1.,  1.]],
    <BLANKLINE>
           [[ 0.,  0.]]], dtype=float32)
    """
    F = mx.sym if isinstance(weight, mx.sym.Symbol) else mx.nd
    out = F.gn_weight_standardize(weight, gain, eps=eps)
    return (out[0], out[1], out[2]) if return_stats else out[0]


# ---------------------------------------------------------------------------------------------
# Blocks


class _WSMixin:
    """The standardization in front of gluon's ``_Conv.hybrid_forward`` (rank-independent part)."""

    def _ws_setup(self, channels, ws_eps, use_gain, gain_initializer):
        self._ws_eps = _check_eps(type(self).__name__, ws_eps)
        self._use_gain = bool(use_gain)
        with self.name_scope():
            # A fixed (grad_req 'null') ones vector without use_gain, like GroupNorm's gamma with
            # scale=False: the op always takes a gain, and the parameter names stay the same.
            self.gain = self.params.get("gain", shape=(int(channels),), init=gain_initializer,
                                        grad_req="write" if use_gain else "null",
                                        differentiable=self._use_gain, allow_deferred_init=True)

    def forward(self, x, *args):
        """Completes a deferred weight shape from ``x``, then ``HybridBlock.forward``.

        Parameters
        ----------
        x : NDArray or Symbol
            Input in the layer's ``layout``.
        *args
            Passed on.

        Returns
        -------
        NDArray or Symbol
            The layer's output.
        """
        shape = self.weight.shape
        if shape is not None and any(d <= 0 for d in shape):
            # lib_api's shape inference runs forward only (inputs -> outputs), so MXNet cannot
            # infer the raw weight's in-channel dim back through gn_weight_standardize from the
            # Convolution as it does for a plain Conv*D: take C from the input (a concrete array,
            # or the shape a hybridized parent's trace knows) before the graph needs it.
            if isinstance(x, NDArray):
                xs = x.shape
            else:
                xs = _hybrid.traced_shape(_np.to_legacy(x))
            C = xs[self._kwargs["layout"].find("C")] if xs else 0
            if C > 0:
                per_group = C // self._kwargs["num_group"]
                self.weight.shape = tuple(per_group if d <= 0 else d for d in shape)
        return super().forward(x, *args)

    def hybrid_forward(self, F, x, weight, gain, bias=None):
        """The convolution of ``x`` with the standardized ``weight`` (then ``bias``, activation).

        Parameters
        ----------
        F : module
            ``mx.nd`` or ``mx.sym``.
        x : NDArray or Symbol
            Input in the layer's ``layout``.
        weight : NDArray or Symbol
            The raw (master) weight, shape (O, I/groups, *kernel) in the weight layout.
        gain : NDArray or Symbol, shape (O,)
            Per-output-channel gain (fixed ones without ``use_gain``).
        bias : NDArray or Symbol, optional
            Bias, shape (O,).

        Returns
        -------
        NDArray or Symbol
            ``Conv*D``'s output.
        """
        np_kind = _np.is_np(weight)
        w, g = _np.to_legacy(weight), _np.to_legacy(gain)
        # lib_api gives library ops no `req`: a parameter that accumulates its gradient (grad_req
        # 'add', e.g. gradient accumulation over micro-batches) reaches the op through identity.
        owners = (self.weight, self.gain)
        if not isinstance(w, NDArray):
            _hybrid.note_grad_req_dependent(owners)
        w, g = (F.identity(p) if _hybrid.is_add(o) else p for p, o in zip((w, g), owners))
        w_hat = F.gn_weight_standardize(w, g, eps=self._ws_eps, name="ws")[0]
        return super().hybrid_forward(F, x, _np.like(w_hat, np_kind), bias)

    def __repr__(self):
        gain = ", use_gain=True" if self._use_gain else ""
        return super().__repr__()[:-1] + f", ws_eps={self._ws_eps}{gain})"


_PARAMS_DOC = """
    Parameters
    ----------
    channels : int
        Number of output channels O.
    kernel_size : int or tuple of {n} ints
        Convolution window.
    strides : int or tuple of {n} ints, default 1
        Strides.
    padding : int or tuple of {n} ints, default 0
        Zero padding on both sides.
    dilation : int or tuple of {n} ints, default 1
        Dilation.
    groups : int, default 1
        Grouped convolution (each output channel's fan-in is (I/groups) * prod(kernel)).
    layout : str, default '{layout}'
        Data layout, as ``gluon.nn.Conv{n}D`` (the weight's first dim is O in every layout).
    activation : str, optional
        Activation applied to the output (``mx.nd.Activation`` act_type).
    use_bias : bool, default True
        Add a bias after the convolution.
    weight_initializer : str or Initializer, optional
        Initializer of the raw weight (its scale does not matter after standardization; its
        per-row spread of values does).
    bias_initializer : str or Initializer, default 'zeros'
        Initializer of the bias.
    in_channels : int, default 0
        Number of input channels; 0 infers it at the first call.
    ws_eps : float, default DEFAULT_WS_EPS (1e-6)
        Added to each output channel's weight variance (finite, >= 0).
    use_gain : bool, default False
        Learn a per-output-channel gain (Big Transfer / NF-Nets style); otherwise ``gain`` is a
        fixed vector of ones (grad_req 'null').
    gain_initializer : str or Initializer, default 'ones'
        Initializer of ``gain``, shape (O,).
    **kwargs
        ``prefix``, ``params`` (``HybridBlock``).
"""


def _ws_conv_class(base, n, layout, example_shape):
    def __init__(self, channels, kernel_size, strides=1, padding=0, dilation=1, groups=1,
                 layout=layout, activation=None, use_bias=True, weight_initializer=None,
                 bias_initializer="zeros", in_channels=0, ws_eps=DEFAULT_WS_EPS, use_gain=False,
                 gain_initializer="ones", **kwargs):
        base.__init__(self, channels, kernel_size, strides=strides, padding=padding,
                      dilation=dilation, groups=groups, layout=layout, activation=activation,
                      use_bias=use_bias, weight_initializer=weight_initializer,
                      bias_initializer=bias_initializer, in_channels=in_channels, **kwargs)
        self._ws_setup(channels, ws_eps, use_gain, gain_initializer)

    name = f"WSConv{n}D"
    doc = (f"""{n}-D convolution with Weight Standardization: ``gluon.nn.Conv{n}D`` whose weight is
    standardized per output channel (mean 0, variance 1 over its fan-in, times an optional gain)
    by ``gn_weight_standardize`` on every forward; gradients flow through the standardization.

    Parameters (``weight``, ``bias``) and their names are ``Conv{n}D``'s, plus ``gain`` (O,).
    Hybridizes and exports: the exported symbol holds the standardization, so a deployed model
    needs only ``import gn_mx``. Under AMP the standardization runs in float32 on the master
    weight and the convolution receives the cast result (``gn_mx.amp``).
""" + _PARAMS_DOC.format(n=n, layout=layout) + f"""
    Raises
    ------
    ValueError
        A bad ``ws_eps``. Shape errors come from the ops (MXNetError), as with ``Conv{n}D``.

    Examples
    --------
    >>> conv = gn_mx.{name}(8, kernel_size=3, padding=1)
    >>> conv.initialize()
    >>> y = conv(mx.nd.random.normal(shape={example_shape}))
    >>> y.shape[:2], conv.gain.shape
    ((2, 8), (8,))
    >>> w_hat = gn_mx.ws.weight_standardize(conv.weight.data(), conv.gain.data())
    >>> abs(float(w_hat[0].mean().asscalar())) < 1e-6
    True
    """)
    return type(name, (_WSMixin, base), {"__init__": __init__, "__doc__": doc,
                                         "__module__": __name__, "__qualname__": name})


WSConv1D = _ws_conv_class(_gnn.Conv1D, 1, "NCW", (2, 4, 10))
WSConv2D = _ws_conv_class(_gnn.Conv2D, 2, "NCHW", (2, 4, 6, 6))
WSConv3D = _ws_conv_class(_gnn.Conv3D, 3, "NCDHW", (2, 4, 3, 4, 4))

_WS_OF = {_gnn.Conv1D: WSConv1D, _gnn.Conv2D: WSConv2D, _gnn.Conv3D: WSConv3D}


# ---------------------------------------------------------------------------------------------
# Swapping the convolutions of an existing block tree


def _ws_replacement(conv, ws_eps, use_gain, gain_initializer):
    """The WSConv*D equivalent of plain ``conv``, sharing its Parameters (same names and
    initializers; values too, if already initialized) and prefix."""
    kw = conv._kwargs
    act = conv.act._act_type if conv.act is not None else None
    new = _WS_OF[type(conv)](
        kw["num_filter"], kw["kernel"], strides=kw["stride"], padding=kw["pad"],
        dilation=kw["dilate"], groups=kw["num_group"], layout=kw["layout"], activation=act,
        use_bias=not kw["no_bias"], weight_initializer=conv.weight.init,
        bias_initializer=conv.bias.init if conv.bias is not None else "zeros",
        in_channels=conv._in_channels, ws_eps=ws_eps, use_gain=use_gain,
        gain_initializer=gain_initializer, prefix=conv.prefix, params=conv.params)
    if conv.act is not None:  # keep the activation block (and its prefix) itself
        new.act = conv.act
    return new


def standardize_convs(block, ws_eps=DEFAULT_WS_EPS, use_gain=False, gain_initializer="ones",
                      include=None):
    """Replace every ``gluon.nn.Conv1D/2D/3D`` in ``block``'s tree by its :class:`WSConv1D` /
    ``2D`` / ``3D`` equivalent, in place, **before training**.

    The new layers keep the old ones' prefixes and share their ``weight`` / ``bias`` Parameters
    (same names, shapes, initializers, and values if already initialized), so ``collect_params()``
    names are unchanged apart from one new ``{prefix}gain`` per layer (``load_parameters`` of an
    older checkpoint then needs ``allow_missing=True``; gain initializes to ones).

    This is a **change of model, not a conversion**: a network trained with plain convolutions
    computes something else once its weights are standardized (the per-row scale and offset of
    each filter are discarded), so train (or fine-tune) after swapping. Weight Standardization
    is meant to be followed by a normalization layer (GroupNorm, BatchNorm). Transposed
    convolutions, ``Dense`` and layers that are already WS are left alone; a hybridized
    ``block`` is re-traced at its next call. Inside a ``gluon.SymbolBlock`` (``imports``, GluonCV's
    SSD / FPN backbones) each ``Convolution`` node's weight gets a ``gn_weight_standardize`` node
    and a new ``gain`` Parameter (docs/guide/weight_standardization.md).

    Parameters
    ----------
    block : gluon.Block
        The root of the tree (itself replaced only if it is not a plain Conv*D: a bare
        convolution cannot be swapped in place; wrap it, or build a :class:`WSConv2D` directly).
    ws_eps : float, default DEFAULT_WS_EPS (1e-6)
        ``ws_eps`` of every new layer.
    use_gain : bool, default False
        Give every new layer a learnable per-output-channel gain.
    gain_initializer : str or Initializer, default 'ones'
        Initializer of the gains.
    include : callable, optional
        ``include(path, conv) -> bool`` chooses the layers to swap (``path``: the dotted child
        names from ``block``, e.g. ``'features.0'``; for a node of a SymbolBlock ``'path:node'``
        and ``conv`` the node's JSON dict); default: all.

    Returns
    -------
    list of str
        The paths of the swapped layers, in tree order, then the standardized SymbolBlock nodes.

    Raises
    ------
    ValueError
        A bad ``ws_eps``, or ``block`` itself a plain ``Conv*D``.

    Examples
    --------
    >>> net = mx.gluon.nn.HybridSequential(prefix='net_')
    >>> with net.name_scope():
    ...     net.add(mx.gluon.nn.Conv2D(8, 3, in_channels=3), gn_mx.GroupNorm(num_groups=4),
    ...             mx.gluon.nn.Conv2D(8, 3, use_bias=False))
    >>> gn_mx.ws.standardize_convs(net)
    ['0', '2']
    >>> type(net[0]).__name__, sorted(net.collect_params())
    ('WSConv2D', ['net_conv0_bias', 'net_conv0_gain', 'net_conv0_weight', 'net_conv1_gain', \
'net_conv1_weight', 'net_groupnorm0_beta', 'net_groupnorm0_gamma'])
    """
    ws_eps = _check_eps("gn_mx.ws.standardize_convs", ws_eps)
    _blocktree.refuse_root("gn_mx.ws.standardize_convs", block, lambda b: type(b) in _WS_OF,
                           f"gn_mx.WS{type(block).__name__}")
    targets = [(parent, key, child, where) for parent, key, child, where in _blocktree.walk(block)
               if type(child) in _WS_OF and (include is None or include(where, child))]
    in_graphs = [(sb, _symblock.ws_plan(sb, path, include))
                 for path, sb in _symblock.symbol_blocks(block)]
    for parent, key, child, _ in targets:
        _blocktree.replace_child(parent, key, child,
                                 _ws_replacement(child, ws_eps, use_gain, gain_initializer))
    for sb, found in in_graphs:
        if found:
            _symblock.ws_apply(sb, found, ws_eps, use_gain, gain_initializer)
    if targets or any(found for _, found in in_graphs):
        _blocktree.clear_hybrid_caches(block)
    return [where for _, _, _, where in targets] + [w for _, found in in_graphs for w, _ in found]


# ---------------------------------------------------------------------------------------------
# Symbol API (re-exported as gn_mx.sym.ws_convolution)


def ws_convolution(data, num_filter, kernel, stride=None, dilate=None, pad=None, num_group=1,
                   no_bias=False, layout=None, ws_eps=DEFAULT_WS_EPS, name=None, weight=None,
                   gain=None, bias=None, in_channels=0, dtype="float32"):
    """Weight-standardized ``Convolution`` for symbolic code (``mx.mod.Module``):
    ``Convolution(data, gn_weight_standardize({name}_weight, {name}_gain)[0], {name}_bias)``.

    The variables are named as ``mx.sym.Convolution`` names its own and as :class:`WSConv2D`'s
    Parameters are with ``prefix=name + '_'`` (``{name}_weight``, ``{name}_bias``) plus
    ``{name}_gain``, which carries an ``init`` of ones (``Module.init_params`` honours it; MXNet's
    initializers know no ``_gain`` suffix). A fixed gain: leave it out of training with
    ``Module(..., fixed_param_names=[name + '_gain'])``.

    Parameters
    ----------
    data : Symbol
        Input, legacy or NumPy-interface (the result has the same kind), layout NC*.
    num_filter : int
        Output channels O.
    kernel : tuple of int
        Convolution window (its length sets the spatial rank).
    stride, dilate, pad : tuple of int, optional
        As ``mx.sym.Convolution``.
    num_group : int, default 1
        Grouped convolution.
    no_bias : bool, default False
        Leave out the bias.
    layout : str, optional
        As ``mx.sym.Convolution``.
    ws_eps : float, default DEFAULT_WS_EPS (1e-6)
        Added to each output channel's weight variance.
    name : str, optional
        The convolution's name and its variables' prefix (default: MXNet's name manager,
        ``convolution0``, ...).
    weight, gain, bias : Symbol, optional
        Existing symbols instead of the variables ``{name}_weight`` / ``_gain`` / ``_bias``.
    in_channels : int, default 0
        Input channels C: the weight variable gets the shape (O, C/num_group, *kernel) (NC*
        layouts). Required unless ``weight`` is given: library ops infer shapes and dtypes only
        from their inputs, so MXNet cannot infer the raw weight back from the Convolution.
    dtype : str, default 'float32'
        dtype of the created weight variable (same reason).

    Returns
    -------
    Symbol
        The convolution's output.

    Raises
    ------
    ValueError
        A bad ``ws_eps``; no ``in_channels`` and no ``weight``.

    Examples
    --------
    >>> y = gn_mx.sym.ws_convolution(mx.sym.var('data'), 8, (3, 3), pad=(1, 1), name='c0',
    ...                              in_channels=4)
    >>> y.list_arguments()
    ['data', 'c0_weight', 'c0_gain', 'c0_bias']
    >>> y.infer_shape(data=(2, 4, 5, 5))[0]
    [(2, 4, 5, 5), (8, 4, 3, 3), (8,), (8,)]
    """
    ws_eps = _check_eps("gn_mx.sym.ws_convolution", ws_eps)
    np_kind = _np.is_np(data)
    name = _compat.current_name_manager().get(name, "convolution")
    kernel = tuple(kernel)
    if weight is None and not in_channels:
        raise ValueError(f"gn_mx.sym.ws_convolution '{name}': in_channels is required to create "
                         f"the weight variable (MXNet cannot infer it back through "
                         f"gn_weight_standardize); or pass weight=")
    w = (_np.to_legacy(weight) if weight is not None else
         mx.sym.var(f"{name}_weight", shape=(num_filter, in_channels // num_group) + kernel,
                    dtype=dtype))
    g = (_np.to_legacy(gain) if gain is not None
         else mx.sym.var(f"{name}_gain", shape=(num_filter,), init=mx.init.One()))
    w_hat = mx.sym.gn_weight_standardize(w, g, eps=ws_eps, name=f"{name}_ws")[0]
    kw = {"kernel": kernel, "num_filter": num_filter, "num_group": num_group, "no_bias": no_bias}
    for key, value in (("stride", stride), ("dilate", dilate), ("pad", pad), ("layout", layout)):
        if value is not None:
            kw[key] = value
    args = [_np.to_legacy(data), w_hat]
    if not no_bias:
        args.append(_np.to_legacy(bias) if bias is not None else mx.sym.var(f"{name}_bias"))
    return _np.like(mx.sym.Convolution(*args, name=name, **kw), np_kind)
