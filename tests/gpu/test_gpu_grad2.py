"""The double-backward CUDA kernels (group_norm_grad2_cuda.cu) vs central differences.

group_norm_grad2.h: the kernels compute the vector-Jacobian product of the first-order backward
f(dy, dmean_o, drstd_o, x, gamma, beta, mean, rstd) = (dx, dgamma, dbeta), mean/rstd taken as given
inputs. The reference is that first-order backward written out in float64 numpy (the textbook xhat
form at the given statistics) and differentiated by central differences, input by input: nothing of
the kernels' closed forms is reused. gn_moments' double backward likewise. numpy-driven (GPU,
emulator or GPGPU-Sim).
"""
import numpy as np
import pytest

from gpu_common import hnp, ids, rel_err, rng  # skips without g++ (emulator)
from reference import act_grad_ref, numeric_grad


def first_order(G, act, dy, dmean_o, drstd_o, x, gamma, beta, mean, rstd):
    """float64 (dx, dgamma, dbeta) of the first-order backward at the given mean / rstd."""
    N, C = x.shape[:2]
    b = (1, C) + (1,) * (x.ndim - 2)
    red = (0,) + tuple(range(2, x.ndim))
    xg = x.reshape(N, G, -1)
    m = xg.shape[2]
    u = xg - mean[..., None]
    xhat = (u * rstd[..., None]).reshape(x.shape)
    z = xhat * gamma.reshape(b) + beta.reshape(b)
    g = dy * act_grad_ref(z, act)
    dbeta = g.sum(red)
    dgamma = (g * xhat).sum(red)
    gg = (g * gamma.reshape(b)).reshape(N, G, -1)  # dL/dxhat
    A = (gg * u).sum(-1)
    B = gg.sum(-1)
    r = rstd
    dx = (r[..., None] * gg - ((A + drstd_o) * r ** 3 / m)[..., None] * u
          + ((dmean_o - B * r) / m)[..., None])
    return dx.reshape(x.shape), dgamma, dbeta


def grad2_reference(G, act, inputs, gdx, gdgamma, gdbeta, h):
    """Central differences of L = <gdx, dx> + <gdgamma, dgamma> + <gdbeta, dbeta> per input."""
    ins = {k: np.asarray(v, np.float64) for k, v in inputs.items()}
    out = {}
    for name in hnp.GRAD2_IN:
        def L(v, name=name):
            args = dict(ins, **{name: v})
            dx, dg, db = first_order(G, act, *[args[k] for k in hnp.GRAD2_IN])
            return float((dx * gdx).sum() + (dg * gdgamma).sum() + (db * gdbeta).sum())
        out["d" + name] = numeric_grad(L, ins[name], h)
    return out


# (shape, G): groups of 10-48 elements (above gn_exact_group's 4, where mean/rstd are recomputed
# from x), 1 and 2 spatial dims, G = 1 and G = C
@pytest.mark.parametrize("act", [None, "relu", "silu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
@pytest.mark.parametrize("shape,G", [((2, 6, 5), 3), ((3, 4, 3, 4), 1), ((2, 3, 16), 3)], ids=ids)
def test_group_norm_grad2(shape, G, dtype, act):
    N, C = shape[:2]
    r = rng(21)
    x = (r.standard_normal(shape) * 2 + 0.5).astype(dtype)
    gamma, beta = (r.random(C) + 0.5).astype(dtype), r.standard_normal(C).astype(dtype)
    eps = 1e-3
    _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G, eps)
    acc = mean.dtype
    inputs = {"dy": r.standard_normal(shape).astype(dtype),
              "dmean_o": r.standard_normal((N, G)).astype(acc),
              "drstd_o": r.standard_normal((N, G)).astype(acc),
              "x": x, "gamma": gamma, "beta": beta, "mean": mean, "rstd": rstd}
    gdx = r.standard_normal(shape).astype(dtype)
    gdgamma, gdbeta = r.standard_normal(C).astype(dtype), r.standard_normal(C).astype(dtype)
    got = hnp.group_norm_grad2(G, inputs, gdx, gdgamma, gdbeta, act=act)
    ref = grad2_reference(G, act, inputs, gdx.astype(np.float64), gdgamma.astype(np.float64),
                          gdbeta.astype(np.float64), 1e-6)
    ref_out = {"ddy": ref["ddy"], "ddmean_o": ref["ddmean_o"], "ddrstd_o": ref["ddrstd_o"],
               "dx": ref["dx"], "dgamma": ref["dgamma"], "dbeta": ref["dbeta"],
               "dmean": ref["dmean"], "drstd": ref["drstd"]}
    tol = 2e-6 if dtype == np.float64 else 2e-3
    for k in hnp.GRAD2_OUT:
        e = rel_err(got[k], ref_out[k])
        assert e < tol, f"{k}: error {e}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
@pytest.mark.parametrize("shape,G", [((2, 6, 5), 3), ((3, 8, 33), 2)], ids=ids)
def test_moments_grad2(shape, G, dtype):
    N = shape[0]
    r = rng(22)
    x = r.standard_normal(shape).astype(dtype)
    mean, _ = hnp.moments(x, G)
    acc = mean.dtype
    dmean_o = r.standard_normal((N, G)).astype(acc)
    dvar_o = r.standard_normal((N, G)).astype(acc)
    gdx = r.standard_normal(shape).astype(dtype)
    ddm, ddv, dx, dmean = hnp.moments_grad2(dmean_o, dvar_o, x, mean, G, gdx)
    ins = [np.asarray(v, np.float64) for v in (dmean_o, dvar_o, x, mean)]
    g64 = gdx.astype(np.float64)
    m = x[0].size // G

    def L(i):
        def f(v):
            a = list(ins)
            a[i] = v
            dm, dv, xx, mu = a
            xg = xx.reshape(N, G, -1)
            d = dm[..., None] / m + 2 * dv[..., None] * (xg - mu[..., None]) / m
            return float((d.reshape(shape) * g64).sum())
        return numeric_grad(f, ins[i], 1e-6)

    tol = 1e-7 if dtype == np.float64 else 1e-4
    for got, i, name in ((ddm, 0, "ddmean_o"), (ddv, 1, "ddvar_o"), (dx, 2, "dx"), (dmean, 3, "dmean")):
        e = rel_err(got, L(i))
        assert e < tol, f"{name}: error {e}"
