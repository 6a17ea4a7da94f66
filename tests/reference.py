"""Independent float64 numpy references for the gn_mx ops (forward and backward).

Written from the papers' math, not from the kernels: the GroupNorm backward here is the textbook
xhat form, the kernels use a centred-sum form.
"""
import numpy as np


def _groups(x, G):
    x = np.asarray(x, dtype=np.float64)
    N, C = x.shape[:2]
    return x.reshape(N, G, -1)


def moments_ref(x, G):
    xg = _groups(x, G)
    return xg.mean(axis=2), xg.var(axis=2)


def group_norm_ref(x, gamma, beta, G, eps):
    """Returns out (float64, x's shape), mean (N, G), rstd (N, G)."""
    x = np.asarray(x, dtype=np.float64)
    N, C = x.shape[:2]
    xg = _groups(x, G)
    mean = xg.mean(axis=2)
    var = xg.var(axis=2)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)
    bshape = (1, C) + (1,) * (x.ndim - 2)
    out = xhat * np.asarray(gamma, np.float64).reshape(bshape) + np.asarray(beta, np.float64).reshape(bshape)
    return out, mean, rstd


def group_norm_bwd_ref(x, gamma, dy, G, eps, dmean=None, drstd=None):
    """Gradients (dx, dgamma, dbeta) of sum(out*dy) + sum(mean*dmean) + sum(rstd*drstd)."""
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    N, C = x.shape[:2]
    bshape = (1, C) + (1,) * (x.ndim - 2)
    g = np.asarray(gamma, np.float64).reshape(bshape)
    xg = _groups(x, G)
    m = xg.shape[2]
    mean = xg.mean(axis=2, keepdims=True)
    var = xg.var(axis=2, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (xg - mean) * rstd
    red = (0,) + tuple(range(2, x.ndim))
    dbeta = dy.sum(axis=red)
    dgamma = (dy * xhat.reshape(x.shape)).sum(axis=red)
    dxhat = (dy * g).reshape(N, G, -1)
    dx = rstd / m * (m * dxhat - dxhat.sum(axis=2, keepdims=True)
                     - xhat * (dxhat * xhat).sum(axis=2, keepdims=True))
    if dmean is not None:
        dx = dx + np.asarray(dmean, np.float64)[..., None] / m
    if drstd is not None:
        # d rstd / d x = -rstd^3 (x - mean) / m
        dx = dx - np.asarray(drstd, np.float64)[..., None] * rstd ** 3 * (xg - mean) / m
    return dx.reshape(x.shape), dgamma, dbeta


def moments_bwd_ref(x, G, dmean, dvar):
    xg = _groups(x, G)
    m = xg.shape[2]
    mean = xg.mean(axis=2, keepdims=True)
    dx = np.asarray(dmean, np.float64)[..., None] / m + \
        np.asarray(dvar, np.float64)[..., None] * 2.0 * (xg - mean) / m
    return dx.reshape(np.shape(x))


def numeric_grad(f, x, h=1e-6):
    """Central differences of the scalar function f at float64 array x."""
    x = np.array(x, dtype=np.float64)
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + h
        fp = f(x)
        x[i] = old - h
        fm = f(x)
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g
