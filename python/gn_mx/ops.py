"""Functional wrappers over the gn_mx ops. Each works on NDArrays and on Symbols, legacy or of the
NumPy interface (``mx.np.ndarray``, np symbols), and returns the kind of ``data``: NumPy-interface
inputs are viewed as legacy arrays without copying and the outputs converted back the same way.

The raw ops are also available as ``mx.nd.gn_*`` / ``mx.sym.gn_*`` once ``gn_mx`` is imported
(legacy arrays only, like all of MXNet 1.9's legacy operators).
"""
import functools

import mxnet as mx

from . import _np
from ._validate import act_type as _act_type
from ._validate import axis_attr as _axis_attr

__all__ = ["moments", "group_norm", "dbn", "dbn_inference"]


def _F(x):
    return mx.sym if isinstance(x, mx.sym.Symbol) else mx.nd


#: The wrappers whose only output has data's shape: an empty NumPy-interface batch gives an empty
#: output (the ops themselves reject zero-size data).
_SAME_SHAPE_OUT = {"group_norm": 4, "dbn_inference": None}  # name -> position of return_stats


def _empty_np_batch(fn, data, args, kwargs):
    """For zero-size NumPy-interface data (``npx.set_np()``): an empty output of data's shape where
    the result is just that (an empty batch of group_norm / dbn_inference without statistics),
    else a ValueError at the call (statistics of no samples do not exist). None for other data."""
    if not (_np.is_np(data) and isinstance(data, mx.nd.NDArray)) or 0 not in data.shape:
        return None
    name = fn.__name__
    pos = _SAME_SHAPE_OUT.get(name, -1)
    stats = pos is not None and (kwargs.get("return_stats") or (0 <= pos < len(args) and args[pos]))
    if pos != -1 and not stats and data.ndim >= 2 and data.shape[0] == 0 and 0 not in data.shape[1:]:
        return data.copy()
    raise ValueError(f"gn_mx.ops.{name}: data of shape {data.shape} is empty; the op needs at "
                     f"least one element per (sample, group) (an empty batch, N = 0, works with "
                     f"group_norm and dbn_inference without return_stats, and with the blocks)")


def _both_kinds(fn):
    """Runs `fn` on legacy views of its array arguments; returns the kind of the first one."""
    @functools.wraps(fn)
    def wrapper(data, *args, **kwargs):
        np_kind = _np.is_np(data)
        if np_kind:
            empty = _empty_np_batch(fn, data, args, kwargs)
            if empty is not None:
                return empty
        out = fn(_np.to_legacy(data), *(_np.to_legacy(a) for a in args),
                 **{k: _np.to_legacy(v) for k, v in kwargs.items()})
        return _np.like(out, np_kind)
    return wrapper


@_both_kinds
def moments(data, num_groups=1, axis=1):
    """Group-wise mean and population variance (op ``gn_moments``).

    Parameters
    ----------
    data : NDArray or Symbol, shape (N, C, *spatial)
        float16, float32 or float64; any number of spatial dims (including none). Legacy
        (``mx.nd`` / ``mx.sym``) or NumPy interface (``mx.np``); the results are of the same kind.
    num_groups : int, default 1
        Number of channel groups G; C must be divisible by it.
    axis : int, default 1
        The channel axis: 1 (data (N, C, *spatial)) or the last axis (-1: channels-last data
        (N, *spatial, C), read in place).

    Returns
    -------
    mean, var : NDArray or Symbol, shape (N, num_groups)
        Mean and population variance (divided by the group's element count) of each (sample,
        group); float32 for float16/float32 data, float64 for float64 data.

    Raises
    ------
    MXNetError
        C not divisible by ``num_groups``, fewer than 2 dims, an empty group, a non-float dtype.
    ValueError
        Zero-size NumPy-interface data (statistics of no elements do not exist).

    Examples
    --------
    >>> mean, var = gn_mx.ops.moments(mx.nd.array([[[1., 3.], [5., 7.]]]), num_groups=1)
    >>> mean.asnumpy(), var.asnumpy()
    (array([[4.]], dtype=float32), array([[5.]], dtype=float32))
    """
    out = _F(data).gn_moments(data, num_groups=num_groups, **_axis_attr("gn_mx.ops.moments", axis))
    return out[0], out[1]


@_both_kinds
def group_norm(data, gamma, beta, num_groups=1, eps=1e-5, return_stats=False, act_type=None,
               axis=1):
    """Group normalization with per-channel affine (Wu & He, 2018), optionally fused with an
    activation (op ``gn_group_norm``).

    ``out = gamma[c] * (x - mean[n, g]) * rstd[n, g] + beta[c]`` with the mean and population
    variance of each (sample, group) and ``rstd = 1 / sqrt(var + eps)``.

    Parameters
    ----------
    data : NDArray or Symbol, shape (N, C, *spatial)
        float16, float32 or float64; any number of spatial dims (including none). Legacy or NumPy
        interface; the results are of the same kind.
    gamma, beta : NDArray or Symbol, shape (C,)
        Per-channel scale and shift: data's dtype, or float32 with float16 data.
    num_groups : int, default 1
        Number of channel groups G; C must be divisible by it.
    eps : float, default 1e-5
        Added to the variance (>= 0).
    return_stats : bool, default False
        Also return the statistics ``mean`` and ``rstd``.
    act_type : {None, 'none', 'relu', 'silu'}, default None
        Activation applied after the affine inside the op ('silu' is x * sigmoid(x), MXNet's swish
        with beta=1; 'swish' is accepted as a synonym). None/'none' leaves the attribute out of the
        symbol.
    axis : int, default 1
        The channel axis: 1 (data (N, C, *spatial)) or the last axis (-1: channels-last data
        (N, *spatial, C) such as NHWC, normalized in place without a transpose). 1 leaves the
        attribute out of the symbol.

    Returns
    -------
    out : NDArray or Symbol, shape of data
        data's dtype.
    mean, rstd : NDArray or Symbol, shape (N, num_groups)
        Only with ``return_stats=True``: the normalization statistics (before the activation),
        float32 for float16/float32 data, float64 for float64 data.

    Raises
    ------
    MXNetError
        C not divisible by ``num_groups``, gamma/beta not of shape (C,), a dtype mismatch, a bad
        ``eps``.
    ValueError
        An unknown ``act_type``; zero-size NumPy-interface data with ``return_stats`` or with
        an empty spatial size.

    Examples
    --------
    >>> x = mx.nd.array([[[1., 3.], [5., 7.]]])  # N=1, C=2, one spatial dim of 2
    >>> out = gn_mx.ops.group_norm(x, mx.nd.ones(2), mx.nd.zeros(2), num_groups=2)
    >>> out.asnumpy().round(3)
    array([[[-1.,  1.],
            [-1.,  1.]]], dtype=float32)
    >>> gn_mx.ops.group_norm(x, mx.nd.ones(2), mx.nd.zeros(2), act_type='relu').shape
    (1, 2, 2)
    """
    act = _act_type(act_type)
    kw = {} if act == "none" else {"act_type": act}
    kw.update(_axis_attr("gn_mx.ops.group_norm", axis))
    out = _F(data).gn_group_norm(data, gamma, beta, num_groups=num_groups, eps=eps, **kw)
    return (out[0], out[1], out[2]) if return_stats else out[0]


@_both_kinds
def dbn(data, running_mean, running_projection, num_groups=1, eps=1e-5, momentum=0.9,
        return_stats=False):
    """Decorrelated BN, training mode (op ``gn_dbn``): per-group ZCA whitening with batch
    statistics.

    Each group of D = C/num_groups channels is whitened with its batch covariance over the
    N*prod(spatial) samples: ``out_g = Sigma_g^{-1/2} (x_g - mu_g)``, ``Sigma_g = cov_g + eps*I``.

    Parameters
    ----------
    data : NDArray or Symbol, shape (N, C, *spatial)
        float16, float32 or float64. Legacy or NumPy interface; the results are of the same kind.
    running_mean : NDArray or Symbol, shape (C,)
        Updated in place: ``r = momentum*r + (1-momentum)*batch_mean``.
    running_projection : NDArray or Symbol, shape (num_groups, D, D)
        Updated in place the same way with the batch's Sigma^{-1/2}. data's dtype (or float32 with
        float16 data), like running_mean.
    num_groups : int, default 1
        Number of channel groups; C must be divisible by it (D <= 4096 on the CPU).
    eps : float, default 1e-5
        Added to the covariance diagonal (> 0).
    momentum : float, default 0.9
        Running statistics decay, in [0, 1].
    return_stats : bool, default False
        Also return the backward-only outputs.

    Returns
    -------
    out : NDArray or Symbol, shape of data
        data's dtype.
    mean, eigvec, eigval : NDArray or Symbol
        Only with ``return_stats=True``: the batch mean (C,), the eigenvectors (G, D, D) (columns)
        and eigenvalues (G, D) of Sigma, in the accumulation dtype (float32, float64 for float64
        data).

    Raises
    ------
    MXNetError
        C not divisible by ``num_groups``, a group larger than the limit, running statistics of the
        wrong shape or dtype, a bad ``eps``/``momentum``.
    ValueError
        Zero-size NumPy-interface data (batch statistics of no samples do not exist).

    Examples
    --------
    >>> x = mx.nd.random.normal(shape=(16, 4))
    >>> rm, rp = mx.nd.zeros(4), mx.nd.array([[[1., 0.], [0., 1.]]] * 2)
    >>> out = gn_mx.ops.dbn(x, rm, rp, num_groups=2)
    >>> cov = np.cov(out.asnumpy()[:, :2].T, bias=True)
    >>> bool(np.allclose(cov, np.eye(2), atol=1e-2))
    True
    """
    out = _F(data).gn_dbn(data, running_mean, running_projection, num_groups=num_groups, eps=eps,
                          momentum=momentum)
    return (out[0], out[1], out[2], out[3]) if return_stats else out[0]


@_both_kinds
def dbn_inference(data, running_mean, running_projection, num_groups=1):
    """Decorrelated BN, inference mode (op ``gn_dbn_inference``): ``out_g = P_g (x_g - m_g)``.

    Parameters
    ----------
    data : NDArray or Symbol, shape (N, C, *spatial)
        float16, float32 or float64. Legacy or NumPy interface; the result is of the same kind.
    running_mean : NDArray or Symbol, shape (C,)
        The means m subtracted per channel.
    running_projection : NDArray or Symbol, shape (num_groups, D, D)
        The whitening matrices P_g, D = C/num_groups; data's dtype (or float32 with float16 data).
    num_groups : int, default 1
        Number of channel groups; C must be divisible by it.

    Returns
    -------
    NDArray or Symbol, shape of data
        data's dtype.

    Raises
    ------
    MXNetError
        C not divisible by ``num_groups``, statistics of the wrong shape or dtype.
    ValueError
        Zero-size NumPy-interface data other than an empty batch (N = 0).

    Examples
    --------
    >>> x = mx.nd.array([[1., 2., 3., 4.]])
    >>> P = mx.nd.array([[[2., 0.], [0., 2.]]] * 2)
    >>> gn_mx.ops.dbn_inference(x, mx.nd.ones(4), P, num_groups=2).asnumpy()
    array([[0., 2., 4., 6.]], dtype=float32)
    """
    return _F(data).gn_dbn_inference(data, running_mean, running_projection,
                                     num_groups=num_groups)
