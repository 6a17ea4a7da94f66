"""GPU harness tests for the Decorrelated BN CUDA kernels vs a float64 numpy reference.

numpy-driven like test_gpu_kernels.py (GPU, emulator or GPGPU-Sim). The reference whitens each
group with numpy.linalg.eigh in float64 on the already-rounded inputs; the backward reference is
tests/reference.py's dbn_bwd_ref (the textbook eigendecomposition backward, 1/(l_i - l_j) terms,
independent of the kernels' Daleckii-Krein form). Eigenvectors are compared through
W = U diag(l^-1/2) U^T (sign-free). IterNorm (whitening="iternorm") against the paper's Newton
iterations in float64, its backward against central differences of that reference.
"""
import re

import numpy as np
import pytest

from gpu_common import ACC, DTYPES, hnp, ids, rel_err, rng  # skips without g++ (emulator)
from reference import dbn_bwd_ref, numeric_grad

TOL = {np.float16: 3e-2, np.float32: 2e-3, np.float64: 1e-8}

CASES = [  # (shape, G): D = C/G from 1 to 96, 0-2 spatial dims, odd D
    ((64, 8), 2),
    ((16, 6, 3), 6),
    ((4, 15, 7), 3),
    ((8, 16, 4, 4), 4),
    ((4, 32, 8, 8), 1),
    ((2, 64, 16, 16), 2),
    ((8, 96, 8, 8), 1),
]


def to_groups(x, G):
    """(N, C, *spatial) -> (G, D, N * S) float64."""
    x = np.asarray(x, np.float64)
    N, C = x.shape[:2]
    return x.reshape(N, G, C // G, -1).transpose(1, 2, 0, 3).reshape(G, C // G, -1)


def from_groups(X, shape):
    N, C = shape[:2]
    G, D, _ = X.shape
    return X.reshape(G, D, N, -1).transpose(2, 0, 1, 3).reshape(shape)


def eye(G, D):
    return np.broadcast_to(np.eye(D), (G, D, D))


def ref_dbn(x, G, eps):
    """float64 ZCA: (y, mean (C,), eigenvalues (G, D) ascending, W (G, D, D))."""
    X = to_groups(x, G)
    m = X.shape[-1]
    mu = X.mean(-1, keepdims=True)
    Xc = X - mu
    D = X.shape[1]
    sigma = Xc @ Xc.transpose(0, 2, 1) / m + eps * np.eye(D)
    lam, U = np.linalg.eigh(sigma)
    lam = np.maximum(lam, eps)
    W = U @ (lam[:, :, None] ** -0.5 * U.transpose(0, 2, 1))
    return from_groups(W @ Xc, x.shape), mu.reshape(-1), lam, W


def whitening(U, lam):
    """W = U diag(l^-1/2) U^T from the kernels' eigenpairs, in float64."""
    U, lam = np.asarray(U, np.float64), np.asarray(lam, np.float64)
    return U @ (lam[:, :, None] ** -0.5 * U.transpose(0, 2, 1))


def make(shape, dtype, seed=0):
    r = rng(seed)
    C = shape[1]
    # well-conditioned correlated channels: I + R / (2 sqrt(C)) has singular values in ~[0.5, 1.5]
    mix = r.standard_normal((C, C)) * (0.5 / C ** 0.5) + np.eye(C)
    x = r.standard_normal(shape)
    shift = r.standard_normal(C).reshape((1, C) + (1,) * (len(shape) - 2))
    x = np.einsum("dc,nc...->nd...", mix, x) + shift
    return np.ascontiguousarray(x).astype(dtype)


def whitened_cov(y, G):
    Y = to_groups(y, G)
    Yc = Y - Y.mean(-1, keepdims=True)
    return Yc @ Yc.transpose(0, 2, 1) / Y.shape[-1]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", CASES, ids=ids)
def test_dbn_forward(shape, G, dtype):
    eps, mom = 1e-5, 0.9
    x = make(shape, dtype)
    C, D = shape[1], shape[1] // G
    acc = ACC(dtype)
    r = rng(1)
    rm = r.standard_normal(C).astype(acc)
    rp = r.standard_normal((G, D, D)).astype(acc)
    rm0, rp0 = rm.copy(), rp.copy()
    y, mean, U, lam = hnp.dbn_fwd(x, G, rm, rp, eps, mom)
    ry, rmu, rl, rW = ref_dbn(x, G, eps)
    tol = TOL[dtype]
    assert y.dtype == dtype
    assert rel_err(y, ry) < tol, rel_err(y, ry)
    assert rel_err(mean, rmu) < tol
    assert rel_err(lam, rl) < tol
    assert rel_err(whitening(U, lam), rW) < tol
    assert rel_err(rm, mom * rm0.astype(np.float64) + (1 - mom) * rmu) < tol
    assert rel_err(rp, mom * rp0.astype(np.float64) + (1 - mom) * rW) < tol
    # whitened output: covariance ~ I
    lim = 5e-2 if dtype == np.float16 else 1e-2
    assert np.abs(whitened_cov(y, G) - eye(G, D)).max() < lim


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", CASES, ids=ids)
def test_dbn_backward(shape, G, dtype):
    eps = 1e-5
    x = make(shape, dtype)
    dy = rng(3).standard_normal(shape).astype(dtype)
    _, mean, U, lam = hnp.dbn_fwd(x, G, eps=eps)
    dx = hnp.dbn_bwd(dy, x, mean, U, lam, G)
    assert dx.dtype == dtype
    e = rel_err(dx, dbn_bwd_ref(x, dy, G, eps))
    assert e < TOL[dtype] * (3 if dtype == np.float16 else 1), e


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
def test_dbn_split_plan(dtype, tmp_path, monkeypatch):
    """(4096, 52), G = 1: on any device (4 to 80+ SMs) the plan chunks the channel sums
    (mean_finalize_kernel) and sums the gram kernel's column splits first (gram_reduce_kernel), in
    the forward and the backward; D = 52 keeps the shared-memory eigensolver on a V100 (the
    simulator's). The emulator's launch log shows both kernels ran; tests/test_gpgpusim.py checks
    the same on the simulator."""
    log = tmp_path / "launches.txt"
    monkeypatch.setenv("GNMX_EMU_LAUNCH_LOG", str(log))
    test_dbn_forward((4096, 52), 1, dtype)
    test_dbn_backward((4096, 52), 1, dtype)
    if hnp.emulated():
        names = {re.match(r"\w+", line.split()[4]).group(0)
                 for line in log.read_text().splitlines()}
        assert {"mean_finalize_kernel", "gram_reduce_kernel"} <= names, sorted(names)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("stat_acc", [True, False], ids=["stat_acc", "stat_data"])
@pytest.mark.parametrize("shape,G", CASES[:5], ids=ids)
def test_dbn_inference(shape, G, dtype, stat_acc):
    x = make(shape, dtype)
    C, D = shape[1], shape[1] // G
    sdt = ACC(dtype) if stat_acc else dtype
    r = rng(5)
    rm = r.standard_normal(C).astype(sdt)
    rp = r.standard_normal((G, D, D)).astype(sdt)
    y = hnp.dbn_inference(x, rm, rp, G)
    dy = r.standard_normal(shape).astype(dtype)
    dx = hnp.dbn_inference(dy, rm, rp, G, backward=True)
    P = rp.astype(np.float64)
    X = to_groups(x, G) - rm.astype(np.float64).reshape(G, D, 1)
    assert rel_err(y, from_groups(P @ X, shape)) < TOL[dtype]
    assert rel_err(dx, from_groups(P.transpose(0, 2, 1) @ to_groups(dy, G), shape)) < TOL[dtype]


@pytest.mark.parametrize("dtype,pdtype", [(np.float32, np.float32), (np.float16, np.float32),
                                          (np.float64, np.float64)], ids=ids)
@pytest.mark.parametrize("shape,G", [((16, 6, 3), 2), ((300, 8), 1)], ids=ids)
def test_dbn_inference_fused_affine(shape, G, dtype, pdtype):
    """The inference op with the fused affine (affine_grad_kernel for dgamma / dbeta) against
    float64: y = gamma P (x - r_mean) + beta, dx = P^T (gamma dy), dgamma = sum(dy P (x - r_mean)),
    dbeta = sum(dy). (300, 8): the gram partials over several chunks of N."""
    x = make(shape, dtype, seed=11)
    C, D = shape[1], shape[1] // G
    r = rng(12)
    sdt = ACC(dtype)
    rm = r.standard_normal(C).astype(sdt)
    rp = (np.eye(D) + 0.3 * r.standard_normal((G, D, D))).astype(sdt)
    gamma = (r.random(C) + 0.5).astype(pdtype)
    beta = r.standard_normal(C).astype(pdtype)
    dy = r.standard_normal(shape).astype(dtype)
    y, dx, dgamma, dbeta = hnp.dbn_inference_affine(x, rm, rp, gamma, beta, G, dy=dy)
    P = rp.astype(np.float64)
    g64 = gamma.astype(np.float64).reshape(G, D, 1)
    xhat = P @ (to_groups(x, G) - rm.astype(np.float64).reshape(G, D, 1))
    Dy = to_groups(dy, G)
    tol = TOL[dtype]
    assert rel_err(y, from_groups(g64 * xhat + beta.astype(np.float64).reshape(G, D, 1),
                                  shape)) < tol
    assert rel_err(dx, from_groups(P.transpose(0, 2, 1) @ (g64 * Dy), shape)) < tol
    assert rel_err(dgamma, (Dy * xhat).sum(-1).reshape(-1)) < tol
    assert rel_err(dbeta, Dy.sum(-1).reshape(-1)) < tol


def test_dbn_nonfinite_input_gives_nan_not_crash():
    x = make((8, 8, 4), np.float32)
    x[0, 0, 0] = np.nan
    y, _, _, _ = hnp.dbn_fwd(x, 2)
    assert np.isnan(y[:, :4]).all() and np.isfinite(y[:, 4:]).all()


def test_dbn_forward_after_nonfinite_launch():
    """A launch whose every group is non-finite leaves nothing behind: the next launch's finite
    groups come out right. The eigensolver loads Sigma with __syncthreads_and(finite); GPGPU-Sim's
    timing mode kept that reduction between uses of a barrier slot until simulator fix 10
    (tests/gpu/sim/gpgpusim-fixes.patch): every later group read 0 there and came out NaN.
    128 groups (one block each) cover every SM of the simulated V100's 80."""
    shape, G, eps = (8, 256, 2), 128, 1e-5
    bad = np.full(shape, np.nan, np.float32)
    assert np.isnan(hnp.dbn_fwd(bad, G)[0]).all()
    x = make(shape, np.float32)
    y, _, _, lam = hnp.dbn_fwd(x, G, eps=eps)
    ry, _, rl, _ = ref_dbn(x, G, eps)
    assert np.isfinite(y).all(), f"{np.isnan(y).any(axis=(0, 2)).sum()} channels NaN"
    assert rel_err(y, ry) < TOL[np.float32] and rel_err(lam, rl) < TOL[np.float32]


# -------------------------------------------------------------------------------------------------
# Fused affine (y = gamma W (x - mu) + beta) and IterNorm


@pytest.mark.parametrize("dtype,pdtype", [(np.float32, np.float32), (np.float16, np.float32),
                                          (np.float64, np.float64)], ids=ids)
def test_dbn_fused_affine(dtype, pdtype):
    shape, G, eps = (8, 12, 5), 3, 1e-5
    x = make(shape, dtype, seed=4)
    r = rng(6)
    gamma = (r.random(12) + 0.5).astype(pdtype)
    beta = r.standard_normal(12).astype(pdtype)
    dy = r.standard_normal(shape).astype(dtype)
    y, mean, U, lam = hnp.dbn_fwd(x, G, eps=eps, gamma=gamma, beta=beta)
    xhat, _, _, _ = ref_dbn(x, G, eps)
    b = (1, 12, 1)
    g64, b64 = gamma.astype(np.float64).reshape(b), beta.astype(np.float64).reshape(b)
    tol = TOL[dtype]
    assert rel_err(y, g64 * xhat + b64) < tol
    dx, dgamma, dbeta = hnp.dbn_bwd(dy, x, mean, U, lam, G, gamma=gamma)
    dy64 = dy.astype(np.float64)
    assert dgamma.dtype == pdtype and dbeta.dtype == pdtype
    assert rel_err(dgamma, (dy64 * xhat).sum((0, 2))) < tol
    assert rel_err(dbeta, dy64.sum((0, 2))) < tol
    e = rel_err(dx, dbn_bwd_ref(x, dy64 * g64, G, eps))
    assert e < tol * (3 if dtype == np.float16 else 1), e


def iternorm_ref(x, G, eps, T):
    """The paper's forward in float64: (y, W (G, D, D), Sigma (G, D, D))."""
    X = to_groups(x, G)
    D, m = X.shape[1], X.shape[2]
    Xc = X - X.mean(-1, keepdims=True)
    S = Xc @ Xc.transpose(0, 2, 1) / m + eps * np.eye(D)
    tr = np.trace(S, axis1=1, axis2=2)[:, None, None]
    Sn, P = S / tr, eye(G, D).copy()
    for _ in range(T):
        P = 1.5 * P - 0.5 * P @ P @ P @ Sn
    W = P / np.sqrt(tr)
    return from_groups(W @ Xc, x.shape), W, S


ITER_TOL = {np.float32: 1e-4, np.float64: 1e-9}


ITER_CASES = [((24, 6), 2, 5), ((6, 8, 7), 2, 3), ((4, 16, 3, 2), 1, 7)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
@pytest.mark.parametrize("shape,G,T", ITER_CASES, ids=ids)
def test_iternorm_forward(shape, G, T, dtype):
    eps, mom = 1e-3, 0.9
    x = make(shape, dtype, seed=8)
    C, D = shape[1], shape[1] // G
    acc = ACC(dtype)
    rm, rp = np.zeros(C, acc), np.zeros((G, D, D), acc)
    y, mean, Sigma, diag = hnp.dbn_fwd(x, G, rm, rp, eps, mom, whitening="iternorm", iterations=T)
    ry, rW, rS = iternorm_ref(x, G, eps, T)
    tol = ITER_TOL[dtype]
    assert rel_err(y, ry) < tol, rel_err(y, ry)
    assert rel_err(Sigma, rS) < tol  # saved for the backward: Sigma (eps included) and its diagonal
    assert rel_err(diag, np.diagonal(rS, axis1=1, axis2=2)) < tol
    assert rel_err(rp, (1 - mom) * rW) < tol  # running_proj averages W
    assert rel_err(rm, (1 - mom) * to_groups(x, G).mean(-1).reshape(-1)) < tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
@pytest.mark.parametrize("shape,G,T", ITER_CASES, ids=ids)
def test_iternorm_backward(shape, G, T, dtype):
    eps = 1e-3
    x = make(shape, dtype, seed=8)
    _, mean, Sigma, diag = hnp.dbn_fwd(x, G, eps=eps, whitening="iternorm", iterations=T)
    dy = rng(9).standard_normal(shape).astype(dtype)
    dx = hnp.dbn_bwd(dy, x, mean, Sigma, diag, G, whitening="iternorm", iterations=T)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    ref = numeric_grad(lambda z: float((iternorm_ref(z, G, eps, T)[0] * dy64).sum()), x64, h=1e-5)
    e = rel_err(dx, ref)
    assert e < (1e-3 if dtype == np.float32 else 1e-6), e  # central differences: ~1e-9 + rounding
