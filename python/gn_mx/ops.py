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
