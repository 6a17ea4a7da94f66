"""Functional wrappers over the gn_mx ops. Each works on NDArrays and on Symbols.

The raw ops are also available as ``mx.nd.gn_*`` / ``mx.sym.gn_*`` once ``gn_mx`` is imported.
"""
import mxnet as mx

from . import _library

_library.load()


def _F(x):
    return mx.sym if isinstance(x, mx.sym.Symbol) else mx.nd


def moments(data, num_groups=1):
    """Group-wise mean and population variance.

    data: (N, C, *spatial), float16/32/64, C % num_groups == 0.
    Returns (mean, var), each (N, num_groups), float32 for float16/float32 data, float64 for float64.
    """
    out = _F(data).gn_moments(data, num_groups=num_groups)
    return out[0], out[1]


def group_norm(data, gamma, beta, num_groups=1, eps=1e-5, return_stats=False):
    """Group normalization with per-channel affine (Wu & He, 2018).

    data: (N, C, *spatial); gamma, beta: (C,), same dtype as data or float32 with float16 data.
    Returns out (data's dtype); with return_stats=True also mean and rstd, (N, num_groups).
    """
    out = _F(data).gn_group_norm(data, gamma, beta, num_groups=num_groups, eps=eps)
    return (out[0], out[1], out[2]) if return_stats else out[0]
