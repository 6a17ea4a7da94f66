"""Gluon blocks. They hold parameters and choose ops; all math is in the native ops."""
import functools

from mxnet import autograd as _autograd
from mxnet import initializer as _initializer
from mxnet.gluon import HybridBlock
from mxnet.ndarray import NDArray

from . import _hybrid, _np
from ._validate import (DBN_MAX_GROUP_SIZE_CPU, act_type, axis_attr, channel_axis, check_channels,
                        check_data_shape,
                        check_dbn_numbers, check_float_dtype, check_group_size, check_groups, check_nonempty,
                        check_whitening, dbn_grouping)


__all__ = ["GroupNorm", "DecorrelatedBatchNorm", "GroupIdentity", "numpy_interface"]


def _affine_params(block, in_channels, center, scale, beta_initializer, gamma_initializer):
    """The per-channel (C,) gamma/beta of a norm block; fixed (grad_req null) when switched off."""
    gamma = block.params.get("gamma", grad_req="write" if scale else "null",
                             shape=(in_channels,), init=gamma_initializer,
                             allow_deferred_init=True, differentiable=scale)
    beta = block.params.get("beta", grad_req="write" if center else "null",
                            shape=(in_channels,), init=beta_initializer,
                            allow_deferred_init=True, differentiable=center)
    return gamma, beta


def _known_channels(block):
    """The layer's C once known (in_channels, or deferred initialization done), else 0."""
    shape = block.gamma.shape
    return max(int(shape[0]), 0) if shape else 0


def checked_forward(block, x, args, axis=1, **rules):
    """A gn_mx block's forward: the shape rules of ``rules`` (``_validate.check_channels``) checked
    on the input with the layer's name in the message, before Gluon's deferred initialization or a
    graph can bury the op's error; then ``HybridBlock.forward``. (Internal: not in ``__all__``.)

    Empty batches: a legacy NDArray gets a ValueError; a NumPy-interface array (``npx.set_np()``,
    NumPy shape semantics) gets an empty output of the input's shape and dtype (no samples in, no
    samples out; nothing is computed, no running statistics change). In a symbolic trace (the
    block inside a hybridized parent) only C is known, from the trace's concrete inputs.
    ``axis``: the channel axis (1, or the last axis for channels-last layers)."""
    if isinstance(x, NDArray):
        shape = x.shape
        key = (shape, x.dtype)
        if key == block.__dict__.get("_gnmx_ok_input"):  # checked before: one tuple compare
            return HybridBlock.forward(block, x, *args)
        who = f"{type(block).__name__} '{block.name}'"
        check_float_dtype(who, x.dtype)
        if 0 in shape and _np.is_np(x) and len(shape) >= 2:
            if shape[channel_axis(who, axis, shape)]:
                check_data_shape(who, shape, axis, channels=_known_channels(block), **rules)
            return x.copy()
        check_nonempty(who, x)
        check_data_shape(who, shape, axis, channels=_known_channels(block), **rules)
        block.__dict__["_gnmx_ok_input"] = key
    else:
        who = f"{type(block).__name__} '{block.name}'"
        shape = _hybrid.traced_shape(_np.to_legacy(x))
        if shape is not None and len(shape) == 1 and shape[0] > 0:  # a known rank-1 input
            check_data_shape(who, shape, axis, channels=_known_channels(block), **rules)
        C = max(shape[channel_axis(who, axis, shape)], 0) \
            if shape is not None and len(shape) >= 2 else 0
        if C:
            check_channels(who, C, None, channels=_known_channels(block), **rules)
    return HybridBlock.forward(block, x, *args)


def _check_gamma_dtype(block, dtype):
    """The op's dtype rule for gamma (the data's dtype, or float32 with float16 data), checked
    with the layer's name and the fix in the message."""
    import numpy as np
    p = block.gamma
    key = (p.dtype, dtype)
    if p.dtype is None or key == block.__dict__.get("_gnmx_ok_dtypes"):  # one tuple compare
        return
    have, want = np.dtype(p.dtype).name, np.dtype(dtype).name
    if want not in ("float16", "float32", "float64"):
        return  # checked_forward's dtype rule names that
    if have != want and not (want == "float16" and have == "float32"):
        raise ValueError(f"{type(block).__name__} '{block.name}': the input is {want} but gamma "
                         f"is {have}: cast the layer (or the whole net) to the data's dtype, "
                         f"net.cast('{want}'), or the data to the layer's, x.astype('{have}')")
    block.__dict__["_gnmx_ok_dtypes"] = key


def numpy_interface(hybrid_forward):
    """Decorator: a ``hybrid_forward`` written against the legacy ops also takes and returns the
    NumPy interface's arrays (``npx.set_np()``).

    Imperative ``mx.np.ndarray`` and traced np symbols are viewed as legacy NDArrays/Symbols without
    copying (``as_nd_ndarray``), and the outputs are given back as the kind of the input ``x``
    (``as_np_ndarray``). Legacy inputs pass through untouched. Useful for custom blocks that call
    the ``gn_*`` ops (legacy operators, like all of MXNet 1.9's library ops) directly.

    Parameters
    ----------
    hybrid_forward : callable
        ``hybrid_forward(self, F, x, *args, **params)`` of a ``HybridBlock``.

    Returns
    -------
    callable
        The wrapped method (same name and docstring).

    Examples
    --------
    >>> class Moments(mx.gluon.HybridBlock):
    ...     @gn_mx.nn.numpy_interface
    ...     def hybrid_forward(self, F, x):
    ...         return F.gn_moments(x, num_groups=1)[1]
    >>> mx.npx.set_np()
    >>> v = Moments()(mx.np.array([[[1., 3.]]]))
    >>> mx.npx.reset_np()
    >>> type(v).__name__, v.shape
    ('ndarray', (1, 1))
    """
    @functools.wraps(hybrid_forward)
    def wrapper(self, F, x, *args, **params):
        np_kind = _np.is_np(x)
        if np_kind or any(_np.is_np(v) for v in params.values()):
            x = _np.to_legacy(x)
            args = tuple(_np.to_legacy(a) for a in args)
            params = {k: _np.to_legacy(v) for k, v in params.items()}
        return _np.like(hybrid_forward(self, F, x, *args, **params), np_kind)
    return wrapper


def accumulating_params(F, *params, block=None):
    """Route parameters through `identity` where grad_req='add' needs it (internal: not in
    ``__all__``).

    MXNet's lib_api passes no `req` to library ops: their backward always overwrites the gradient
    buffer it is given. A built-in identity between the parameter and the op receives the library's
    gradient in a temporary and honours 'add' itself, at the cost of one more op per parameter and
    call. With ``block`` given, only parameters whose ``grad_req`` is 'add' (``block.gamma``,
    ``block.beta``, in the order of ``params``) get the identity; the choice is made when the graph
    is traced and re-made when a grad_req changes later (``_hybrid``). Without ``block`` every
    parameter gets it (the old, always-correct behaviour).
    """
    if block is None:
        return tuple(F.identity(p) for p in params)
    owners = (block.gamma, block.beta)[:len(params)]
    if not isinstance(params[0], NDArray):
        _hybrid.note_grad_req_dependent(owners)
    return tuple(F.identity(p) if _hybrid.is_add(o) else p for p, o in zip(params, owners))


class GroupNorm(HybridBlock):
    """Group Normalization (Wu & He, 2018) with the paper's per-channel affine.

    For data (N, C, *spatial) with any number of spatial dims (including none), channels are split
    into ``num_groups`` groups; each (sample, group) is normalized by its own mean and variance, then
    ``out = gamma[c] * xhat + beta[c]``. Unlike MXNet 1.x's built-in ``GroupNorm`` (gamma/beta of shape
    ``(num_groups,)``), gamma and beta here have shape ``(C,)``, as in PyTorch and TensorFlow.

    float16 data is reduced in float32 straight from float16 memory; gamma/beta may be float32 with
    float16 data (multi-precision).

    Inputs: ``x`` of shape (N, C, *spatial), or (N, *spatial, C) with ``axis=-1``, float16,
    float32 or float64 (legacy ``mx.nd`` or, under ``npx.set_np()``, ``mx.np``). Output: the same
    shape, dtype and kind. An empty NumPy-interface batch (N = 0) gives an empty output of the
    input's shape.

    Parameters
    ----------
    num_groups : int, default 32
        Number of channel groups G; C must be divisible by it.
    epsilon : float, default 1e-5
        Added to the variance (a finite number >= 0).
    center : bool, default True
        Learn ``beta``; if False it stays at its initial value (zeros).
    scale : bool, default True
        Learn ``gamma``; if False it stays at its initial value (ones).
    beta_initializer : str or Initializer, default 'zeros'
        Initializer of ``beta``, shape (C,).
    gamma_initializer : str or Initializer, default 'ones'
        Initializer of ``gamma``, shape (C,).
    in_channels : int, default 0
        Number of channels; 0 infers it from the first input (deferred initialization).
    activation : {None, 'relu', 'silu'}, default None
        Apply the activation inside the op (``gn_group_norm``'s ``act_type``): saves the separate
        activation layer's read and write of the tensor in forward and in backward. 'silu' is
        x * sigmoid(x) (``gluon.nn.Swish()``, 'swish' is accepted as a synonym).
    axis : int, default 1
        The channel axis: 1 (channels first, NCW/NCHW/NCDHW) or the last axis (-1, or ndim - 1:
        channels last, NWC/NHWC/NDHWC, as after ``Conv2D(layout='NHWC')``; normalized in place,
        without transposes). Written into the graph (op attribute ``axis``) only when not 1.
    **kwargs
        Passed to ``HybridBlock`` (``prefix``, ``params``).

    Raises
    ------
    ValueError
        At construction: a bad ``num_groups``, ``epsilon``, ``in_channels``, ``activation`` or
        ``axis``. At the first call (with the layer's name, also under deferred initialization):
        C not divisible by ``num_groups``, an input with fewer than 2 dims or with C other than
        ``in_channels``, an ``axis`` that is neither 1 nor the input's last axis, an empty legacy
        NDArray.

    Examples
    --------
    >>> norm = gn_mx.GroupNorm(num_groups=2)
    >>> norm.initialize()
    >>> y = norm(mx.nd.random.normal(shape=(2, 4, 8, 8)))
    >>> y.shape, norm.gamma.shape
    ((2, 4, 8, 8), (4,))
    >>> norm2 = gn_mx.GroupNorm(num_groups=3)
    >>> norm2.initialize()
    >>> norm2(mx.nd.ones((2, 4, 3)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: GroupNorm '...': channels (C=4) must be divisible by num_groups (3)...
    >>> nhwc = gn_mx.GroupNorm(num_groups=2, axis=-1)
    >>> nhwc.initialize()
    >>> nhwc(mx.nd.random.normal(shape=(2, 8, 8, 4))).shape, nhwc.gamma.shape
    ((2, 8, 8, 4), (4,))
    """

    def __init__(self, num_groups=32, epsilon=1e-5, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones", in_channels=0,
                 activation=None, axis=1, **kwargs):
        super().__init__(**kwargs)
        check_groups("GroupNorm", num_groups, epsilon, in_channels)
        self._axis_kw = axis_attr("GroupNorm", axis)
        self._axis = int(axis)
        self._act = act_type(activation)
        self._num_groups = int(num_groups)
        self._epsilon = float(epsilon)
        self._center = bool(center)
        self._scale = bool(scale)
        self._in_channels = int(in_channels)
        with self.name_scope():
            self.gamma, self.beta = _affine_params(self, in_channels, center, scale,
                                                   beta_initializer, gamma_initializer)

    _gnmx_layer = True  # _hybrid: a hybridized parent refuses empty NumPy-interface batches

    def forward(self, x, *args):
        """Checks ``x``'s shape and dtype against gamma's (layer name in the message), then
        ``HybridBlock.forward``."""
        if isinstance(x, NDArray):
            _check_gamma_dtype(self, x.dtype)
        return checked_forward(self, x, args, self._axis, num_groups=self._num_groups)

    @numpy_interface
    def hybrid_forward(self, F, x, gamma, beta):
        """``gn_group_norm(x, gamma, beta)``'s output (``F``: ``mx.nd`` or ``mx.sym``)."""
        gamma, beta = accumulating_params(F, gamma, beta, block=self)
        kw = {} if self._act == "none" else {"act_type": self._act}
        kw.update(self._axis_kw)
        return F.gn_group_norm(x, gamma, beta, num_groups=self._num_groups, eps=self._epsilon,
                               **kw)[0]

    def __repr__(self):
        c = self.gamma.shape[0] if self.gamma.shape else 0
        act = "" if self._act == "none" else f", activation={self._act!r}"
        act += f", axis={self._axis}" if self._axis != 1 else ""
        return (f"{self.__class__.__name__}(num_groups={self._num_groups}, eps={self._epsilon}, "
                f"center={self._center}, scale={self._scale}, in_channels={c or None}{act})")


# ---------------------------------------------------------------------------------------------
# Decorrelated Batch Normalization


@_initializer.register
class GroupIdentity(_initializer.Initializer):
    """Initializes a (G, D, D) array to G identity matrices (DBN's running_projection).

    Registered with MXNet's initializer registry (``mx.init.create('groupidentity')``). Takes
    the keyword arguments of ``mx.init.Initializer``.

    Raises
    ------
    ValueError
        When initializing an array whose shape is not (G, D, D).

    Examples
    --------
    >>> a = mx.nd.zeros((2, 3, 3))
    >>> gn_mx.nn.GroupIdentity()(mx.init.InitDesc('p'), a)
    >>> a[1].asnumpy()
    array([[1., 0., 0.],
           [0., 1., 0.],
           [0., 0., 1.]], dtype=float32)
    """

    def _init_weight(self, _, arr):
        if len(arr.shape) != 3 or arr.shape[1] != arr.shape[2]:
            raise ValueError(f"GroupIdentity needs a (G, D, D) shape, got {arr.shape}")
        arr[:] = 0
        for d in range(arr.shape[1]):
            arr[:, d, d] = 1

    _init_default = _init_weight


class DecorrelatedBatchNorm(HybridBlock):
    """Decorrelated Batch Normalization (Huang et al., CVPR 2018): per-group ZCA whitening, or
    IterNorm's Newton-iteration whitening (``whitening='iternorm'``).

    For data (N, C, *spatial) (any number of spatial dims, including none), channels are split into
    ``num_groups`` groups of D = C/num_groups. In training, each group is whitened with its batch
    statistics over the m = N*prod(spatial) samples,
    ``xhat_g = Sigma_g^{-1/2} (x_g - mu_g)``, ``Sigma_g = cov_g + epsilon*I``,
    and ``running_mean`` / ``running_projection`` are updated in place with
    ``r = momentum*r + (1-momentum)*batch_value`` (the projection's batch value is Sigma_g^{-1/2}).
    Otherwise ``xhat_g = P_g (x_g - running_mean_g)``. Then ``out = gamma[c]*xhat + beta[c]``.

    The mode follows ``autograd.is_training()`` (``autograd.record()`` trains, plain calls and
    ``autograd.predict_mode()`` infer), imperatively and hybridized: a hybridized block (or any
    hybridized parent containing it) keeps one CachedOp per mode, and ``export`` writes the
    inference graph. num_groups=C (D=1) is BatchNorm without the variance bias correction.

    Parameters
    ----------
    num_groups : int, optional
        Number of channel groups; C must be divisible by it. 16 when neither ``num_groups`` nor
        ``group_size`` is given.
    epsilon : float, default 1e-5
        Added to the covariance diagonal (> 0; keeps near-singular batches finite).
    momentum : float, default 0.9
        Running statistics decay, in [0, 1].
    center : bool, default True
        Learn ``beta``; if False it stays at its initial value.
    scale : bool, default True
        Learn ``gamma``; if False it stays at its initial value.
    beta_initializer : str or Initializer, default 'zeros'
        Initializer of ``beta``, shape (C,).
    gamma_initializer : str or Initializer, default 'ones'
        Initializer of ``gamma``, shape (C,).
    in_channels : int, default 0
        Number of channels; 0 infers it from the first input (deferred initialization).
    group_size : int, optional
        Channels per group (D) instead of ``num_groups`` (give one of them, not both); the number of
        groups is then C/group_size, known once C is (deferred ``in_channels`` works). The DBN paper
        recommends fixing the group size (16) rather than the number of groups.
    use_global_stats : bool, default False
        If True, the running statistics are used in training as well (``gn_dbn_inference``,
        gradients ``dx = P^T dy``) and are never updated, as with BatchNorm's switch of that name
        (fine-tuning with frozen normalization statistics).
    whitening : {'zca', 'iternorm'}, default 'zca'
        How training computes the whitening matrix: 'zca' is Sigma^{-1/2} by eigendecomposition;
        'iternorm' (Huang et al., CVPR 2019) runs ``iterations`` Newton steps on the
        trace-normalized covariance, ``P <- 1.5 P - 0.5 P^3 Sigma/tr(Sigma)`` from ``P = I``, and
        uses ``W = P / sqrt(tr(Sigma))`` (matrix products only; an approximation of Sigma^{-1/2}
        that whitens less as the covariance is worse conditioned, see docs/dbn.md). Both keep the
        running whitening matrix as ``running_projection``: inference and export are the same.
        CPU only for 'iternorm' so far.
    iterations : int, default 5
        IterNorm's number of iterations T, in [1, 10] (the paper's iteration amplifies rounding
        errors from ~12 iterations on ill-conditioned covariances; docs/dbn.md).
    **kwargs
        Passed to ``HybridBlock`` (``prefix``, ``params``).

    Raises
    ------
    ValueError
        At construction: both ``num_groups`` and ``group_size``, a bad ``epsilon``, ``momentum``,
        ``whitening`` or ``iterations``. At the first call (with the layer's name, also under
        deferred initialization): C not divisible by the grouping, a group larger than 4096
        channels, an input with fewer than 2 dims or with C other than ``in_channels``.

    Examples
    --------
    >>> dbn = gn_mx.DecorrelatedBatchNorm(group_size=2)
    >>> dbn.initialize()
    >>> x = mx.nd.random.normal(shape=(32, 4))
    >>> with mx.autograd.record():  # training: batch statistics, running statistics updated
    ...     y = dbn(x)
    >>> y.shape, dbn.running_projection.shape
    ((32, 4), (2, 2, 2))
    >>> dbn(x).shape  # inference: running statistics
    (32, 4)
    """

    def __init__(self, num_groups=None, epsilon=1e-5, momentum=0.9, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones", in_channels=0,
                 group_size=None, use_global_stats=False, whitening="zca", iterations=5,
                 **kwargs):
        super().__init__(**kwargs)
        check_whitening("DecorrelatedBatchNorm", whitening, iterations)
        self._whitening = whitening
        self._iterations = int(iterations)
        num_groups, group_size = dbn_grouping(num_groups, group_size, epsilon, in_channels)
        self._group_size = group_size
        self._use_global_stats = bool(use_global_stats)
        check_dbn_numbers("DecorrelatedBatchNorm", epsilon, momentum)
        self._num_groups = num_groups  # None with group_size and deferred in_channels
        self._epsilon = float(epsilon)
        self._momentum = float(momentum)
        self._center = bool(center)
        self._scale = bool(scale)
        D = group_size or in_channels // num_groups
        with self.name_scope():
            self.gamma, self.beta = _affine_params(self, in_channels, center, scale,
                                                   beta_initializer, gamma_initializer)
            self.running_mean = self.params.get("running_mean", grad_req="null",
                                                shape=(in_channels,), init="zeros",
                                                allow_deferred_init=True, differentiable=False)
            self.running_projection = self.params.get(
                "running_projection", grad_req="null", shape=(num_groups or 0, D, D),
                init=GroupIdentity(), allow_deferred_init=True, differentiable=False)

    _gnmx_layer = True

    def forward(self, x, *args):
        """Checks ``x``'s shape (layer name in the message), then ``HybridBlock.forward``."""
        if self._group_size is not None:
            rules = {"group_size": self._group_size}
        else:
            rules = {"num_groups": self._num_groups}
        return checked_forward(self, x, args, max_group_size=DBN_MAX_GROUP_SIZE_CPU, **rules)

    @numpy_interface
    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_projection):
        """``gn_dbn`` (training) or ``gn_dbn_inference`` with the fused affine."""
        if not isinstance(x, NDArray) and not self._use_global_stats:
            _hybrid.note_mode_dependent()
        num_groups = self._groups_of(x)
        # The per-channel affine is fused into the op (affine=True: inputs data, gamma, beta,
        # running_mean, running_projection; float32 gamma/beta with float16 data; gamma/beta sized
        # from data for deferred init). Graphs exported before it apply gn_channel_affine to the
        # op's output instead, which still loads and runs.
        gamma, beta = accumulating_params(F, gamma, beta, block=self)
        if _autograd.is_training() and not self._use_global_stats:
            kw = ({} if self._whitening == "zca" else
                  {"whitening": self._whitening, "iterations": self._iterations})
            return F.gn_dbn(x, gamma, beta, running_mean, running_projection,
                            num_groups=num_groups, eps=self._epsilon, momentum=self._momentum,
                            affine=True, **kw)[0]
        return F.gn_dbn_inference(x, gamma, beta, running_mean, running_projection,
                                  num_groups=num_groups, affine=True)

    def _groups_of(self, x):
        """The number of groups for input x (with group_size: C/group_size, C from the parameters,
        the array, or a shape inference of the traced input)."""
        if self._group_size is None or self._num_groups:
            return self._num_groups
        C = max(self.running_mean.shape[0], 0) if self.running_mean.shape else 0
        if not C and isinstance(x, NDArray):
            C = x.shape[1] if x.ndim >= 2 else 0
        if not C and not isinstance(x, NDArray):
            C = _hybrid.traced_channels(x)
        if not C:
            raise ValueError(f"{self.name}: cannot infer the number of channels for "
                             f"group_size={self._group_size}; give in_channels")
        check_group_size(self.name, C, self._group_size)
        return C // self._group_size

    def __repr__(self):
        c = self.gamma.shape[0] if self.gamma.shape else 0
        c = max(c, 0)
        groups = (f"group_size={self._group_size}" if self._group_size
                  else f"num_groups={self._num_groups}")
        wh = ("" if self._whitening == "zca" else
              f", whitening='iternorm', iterations={self._iterations}")
        return (f"{self.__class__.__name__}({groups}, eps={self._epsilon}, "
                f"momentum={self._momentum}, center={self._center}, scale={self._scale}, "
                f"use_global_stats={self._use_global_stats}{wh}, in_channels={c or None})")

