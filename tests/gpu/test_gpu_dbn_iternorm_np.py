"""The CUDA IterNorm (iternorm_kernel's launches, float32 or float64 iterations by
dbn_iternorm_fp32) against a float64 numpy reference, driven by numpy through harness_np (on a GPU,
or on the CPU emulator: no torch, no MXNet).

The reference is the paper's algorithm (P <- 1.5 P - 0.5 P^3 Sigma_N, W = P_T / sqrt(tr)) and its
backward written out; the backward reference is itself checked against central differences here.
Tolerances are those of the analysis (docs/numerics.md "IterNorm", as in
tests/test_dbn_iternorm_precision.py): float32 iterations (T <= 5) (720 + D + 2) 2^-24 plus output
rounding; float64 iterations on well-conditioned data (D + 2) 2^-24 plus rounding; float64 data
float64 rounding growth. D = 136 crosses the 64-wide tiles and the 128-long k-blocks.
"""
import ctypes

import numpy as np
import pytest

import harness_np as H

c_i64, c_int, c_vp, c_dbl, c_size, c_str = (ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_double, ctypes.c_size_t, ctypes.c_char_p)
_SIGS = {
    "gnh_dbn_it_workspace": (c_size, [c_int, c_int] + [c_i64] * 4 + [c_int]),
    "gnh_dbn_it_fwd": (c_str, [c_int] + [c_vp] * 6 + [c_i64] * 4 + [c_dbl, c_int, c_vp]),
    "gnh_dbn_it_bwd": (c_str, [c_int] + [c_vp] * 7 + [c_i64] * 4 + [c_int, c_vp]),
}
EPS = 1e-5
U32, U16, U64 = 2.0 ** -24, 2.0 ** -11, 2.0 ** -52


def growth_bound(T):
    """The analysis' bound on the iteration's rounding error growth (docs/numerics.md "IterNorm",
    tests/test_dbn_iternorm_precision.py): ~720 at T = 5."""
    g = [max(1.5, (2.25 ** k + 1.5 ** k + 1) / 2 - 1.5) for k in range(T)]
    return sum(float(np.prod(g[j + 1:T])) for j in range(T))


GROWTH_T5 = growth_bound(5)


def lib():
    h = H.load()
    for name, (res, args) in _SIGS.items():
        fn = getattr(h, name)
        fn.restype, fn.argtypes = res, args
    return h


def cuda_iternorm(x, dy, G, T):
    """(y, dx) of the CUDA forward and backward, x / dy of shape (N, C) in their dtype."""
    h = lib()
    code = H.DTYPE_CODE[x.dtype]
    acc = np.float64 if x.dtype == np.float64 else np.float32
    N, C = x.shape
    D = C // G
    dims = (N, C, G, 1)
    with H._Dev() as d:
        px, pdy = d.put(x), d.put(dy)
        y, dx = d.empty(x.shape, x.dtype), d.empty(x.shape, x.dtype)
        mean, ev, el = d.empty((C,), acc), d.empty((G, D, D), acc), d.empty((G, D), acc)
        ws = d.alloc(h.gnh_dbn_it_workspace(1, code, *dims, T))
        H._check(h.gnh_dbn_it_fwd(code, px, y[0], mean[0], ev[0], el[0], ws, *dims, EPS, T, None))
        wsb = d.alloc(h.gnh_dbn_it_workspace(0, code, *dims, T))
        H._check(h.gnh_dbn_it_bwd(code, pdy, px, mean[0], ev[0], el[0], dx[0], wsb, *dims, T,
                                  None))
        H._check(h.gnh_synchronize())
        return d.get(y).astype(np.float64), d.get(dx).astype(np.float64)


def ref_fwd_bwd(x, dy, G, T):
    """float64 reference: y and dx of the paper's iteration, backward written out (paper's eqs.)."""
    N, C = x.shape
    D = C // G
    y, dx = np.empty_like(x), np.empty_like(x)
    for g in range(G):
        X, dY = x[:, g * D:(g + 1) * D].T, dy[:, g * D:(g + 1) * D].T
        Xc = X - X.mean(1, keepdims=True)
        S = Xc @ Xc.T / N + EPS * np.eye(D)
        tr = np.trace(S)
        Sn, P, Ps = S / tr, np.eye(D), []
        for _ in range(T):
            Ps.append(P)
            P = 1.5 * P - 0.5 * P @ P @ P @ Sn
        W = P / np.sqrt(tr)
        y[:, g * D:(g + 1) * D] = (W @ Xc).T
        GW = dY @ Xc.T
        G_ = GW / np.sqrt(tr)
        dtr = -0.5 * tr ** -1.5 * np.sum(GW * P)
        dSn = np.zeros((D, D))
        for M in reversed(Ps):
            M2 = M @ M
            dSn -= 0.5 * (M2 @ M).T @ G_
            G_ = 1.5 * G_ - 0.5 * (G_ @ (M2 @ Sn).T + M2.T @ G_ @ Sn.T + M.T @ G_ @ (M @ Sn).T)
        dS = dSn / tr + (dtr - np.sum(dSn * S) / tr ** 2) * np.eye(D)
        B = (dS + dS.T) / N
        dx[:, g * D:(g + 1) * D] = (W @ (dY - dY.mean(1, keepdims=True)) + B @ Xc).T
    return y, dx


def make(kind, D, G, N, rng):
    cols = []
    for _ in range(G):
        if kind == "well":
            X = rng.standard_normal((D, N))
            X[1:] += 0.6 * X[:-1]
        elif kind == "rankdef":
            X = rng.standard_normal((D, D // 4)) @ rng.standard_normal((D // 4, N))
        else:
            Q, _ = np.linalg.qr(rng.standard_normal((D, D)))
            X = Q @ (30 * np.logspace(0, -3, D)[:, None] * rng.standard_normal((D, N)))
        cols.append(X + 0.5)
    return np.concatenate(cols).T.copy()


def rel(a, ref):
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    x, dy = make("well", 4, 2, 12, rng), rng.standard_normal((12, 8))
    _, dx = ref_fwd_bwd(x, dy, 2, 3)
    fd = np.zeros_like(x)
    h = 1e-6
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        fd[i] = (np.sum(ref_fwd_bwd(xp, dy, 2, 3)[0] * dy)
                 - np.sum(ref_fwd_bwd(xm, dy, 2, 3)[0] * dy)) / (2 * h)
    np.testing.assert_allclose(dx, fd, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,T,kind,D,G", [
    (np.float32, 5, "well", 16, 2), (np.float32, 5, "rankdef", 16, 2),
    (np.float32, 5, "spread", 16, 1), (np.float32, 3, "spread", 136, 1),
    (np.float16, 5, "spread", 16, 2), (np.float32, 7, "well", 16, 2),
    (np.float64, 5, "spread", 16, 1), (np.float64, 3, "well", 136, 1),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_cuda_iternorm_vs_float64(dtype, T, kind, D, G):
    rng = np.random.default_rng(D + T)
    N = 2 * D + 32
    x = make(kind, D, G, N, rng).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, dx = cuda_iternorm(x, dy, G, T)
    yr, dxr = ref_fwd_bwd(x.astype(np.float64), dy.astype(np.float64), G, T)
    if dtype == np.float64:
        by = bdx = GROWTH_T5 * U64 * D
    else:
        out = U16 if dtype == np.float16 else U32
        growth = GROWTH_T5 if T <= 5 else 0  # float32 iterations only up to T = 5
        by = (growth + D + 2) * U32 + out
        bdx = (growth + 2 * D + 2) * U32 + 2 * out
    assert rel(y, yr) <= by, (rel(y, yr), by)
    assert rel(dx, dxr) <= bdx, (rel(dx, dxr), bdx)


@pytest.mark.parametrize("dtype,T,D,G", [
    (np.float32, 3, 136, 2),   # 3 x 3 tiles: 6 pair owners forward, 9 tile owners backward
    (np.float64, 2, 130, 1),   # a one-column edge tile; float64 iterations
    (np.float32, 2, 64, 3),    # one tile: the split launches one block per group anyway
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_tile_split_is_bitwise_one_block(dtype, T, D, G, monkeypatch):
    """The product stages spread a group's output tiles over gridDim.y blocks (dbn_iternorm_cuda.cuh);
    every entry is summed as by the one block per group, so y and dx are bitwise equal."""
    rng = np.random.default_rng(D + G)
    N = D + 24
    x = make("well", D, G, N, rng).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    monkeypatch.setenv("GNMX_DBN_CUDA_ITER_SPLIT", "0")
    y1, dx1 = cuda_iternorm(x, dy, G, T)
    monkeypatch.setenv("GNMX_DBN_CUDA_ITER_SPLIT", "1")
    y2, dx2 = cuda_iternorm(x, dy, G, T)
    assert np.isfinite(y1).all() and np.isfinite(dx1).all()
    assert np.array_equal(y1, y2) and np.array_equal(dx1, dx2)
    yr, dxr = ref_fwd_bwd(x.astype(np.float64), dy.astype(np.float64), G, T)
    assert rel(y2, yr) < 1e-3 and rel(dx2, dxr) < 1e-3  # and both are IterNorm's (tight: above)


def test_invalid_split_is_an_error(monkeypatch):
    monkeypatch.setenv("GNMX_DBN_CUDA_ITER_SPLIT", "yes")
    rng = np.random.default_rng(0)
    x = make("well", 8, 1, 24, rng).astype(np.float32)
    with pytest.raises(RuntimeError, match="GNMX_DBN_CUDA_ITER_SPLIT must be 0 or 1"):
        cuda_iternorm(x, x, 1, 2)
