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


def _F(x):
    return mx.sym if isinstance(x, mx.sym.Symbol) else mx.nd


def _both_kinds(fn):
    """Runs `fn` on legacy views of its array arguments; returns the kind of the first one."""
    @functools.wraps(fn)
    def wrapper(data, *args, **kwargs):
        np_kind = _np.is_np(data)
        out = fn(_np.to_legacy(data), *(_np.to_legacy(a) for a in args),
                 **{k: _np.to_legacy(v) for k, v in kwargs.items()})
        return _np.like(out, np_kind)
    return wrapper


@_both_kinds
def moments(data, num_groups=1):
    """Group-wise mean and population variance.

    data: (N, C, *spatial), float16/32/64, C % num_groups == 0.
    Returns (mean, var), each (N, num_groups), float32 for float16/float32 data, float64 for float64.
    """
    out = _F(data).gn_moments(data, num_groups=num_groups)
    return out[0], out[1]


@_both_kinds
def group_norm(data, gamma, beta, num_groups=1, eps=1e-5, return_stats=False, act_type=None):
    """Group normalization with per-channel affine (Wu & He, 2018), optionally fused with an
    activation.

    data: (N, C, *spatial); gamma, beta: (C,), same dtype as data or float32 with float16 data.
    act_type: None/'none', 'relu' or 'silu' (x * sigmoid(x), MXNet's swish with beta=1), applied
    after the affine inside the op (attribute ``act_type``; left out of the symbol when None).
    Returns out (data's dtype); with return_stats=True also mean and rstd, (N, num_groups): the
    normalization statistics (before the activation).
    """
    act = _act_type(act_type)
    kw = {} if act == "none" else {"act_type": act}
    out = _F(data).gn_group_norm(data, gamma, beta, num_groups=num_groups, eps=eps, **kw)
    return (out[0], out[1], out[2]) if return_stats else out[0]


@_both_kinds
def dbn(data, running_mean, running_projection, num_groups=1, eps=1e-5, momentum=0.9,
        return_stats=False):
    """Decorrelated BN, training mode (op ``gn_dbn``): per-group ZCA whitening with batch stats.

    data: (N, C, *spatial), float16/32/64; running_mean: (C,); running_projection:
    (num_groups, C/num_groups, C/num_groups), dtype of data (or float32 with float16 data).
    The running statistics are updated in place: r = momentum*r + (1-momentum)*batch_value.
    Returns out (data's dtype); with return_stats=True also the backward-only outputs mean (C,),
    eigvec (G, D, D) (columns are eigenvectors of Sigma) and eigval (G, D), in the accumulation dtype.
    """
    out = _F(data).gn_dbn(data, running_mean, running_projection, num_groups=num_groups, eps=eps,
                          momentum=momentum)
    return (out[0], out[1], out[2], out[3]) if return_stats else out[0]


@_both_kinds
def dbn_inference(data, running_mean, running_projection, num_groups=1):
    """Decorrelated BN, inference mode (op ``gn_dbn_inference``): out_g = P_g (x_g - m_g)."""
    return _F(data).gn_dbn_inference(data, running_mean, running_projection,
                                     num_groups=num_groups)
