"""GPU harness tests for the Decorrelated BN CUDA kernels vs a float64 torch reference.

Same guards as test_gpu_kernels.py: skipped without torch + a CUDA device. The reference whitens
each group with torch.linalg.eigh in float64 on the already-rounded inputs; the backward reference
is autograd through it. Eigenvectors are compared through W = U diag(l^-1/2) U^T (sign-free).
"""
import pytest

from gpu_common import DEV, DTYPES, gnh, ids, rel_err  # skips the module without torch / a device
import torch

TOL = {torch.float16: 3e-2, torch.float32: 2e-3, torch.float64: 1e-8}

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
    N, C = x.shape[:2]
    return x.reshape(N, G, C // G, -1).permute(1, 2, 0, 3).reshape(G, C // G, -1)


def from_groups(X, shape):
    N, C = shape[:2]
    G, D, _ = X.shape
    return X.reshape(G, D, N, -1).permute(2, 0, 1, 3).reshape(shape)


def ref_dbn(x, G, eps):
    X = to_groups(x, G)
    m = X.shape[-1]
    mu = X.mean(-1, keepdim=True)
    Xc = X - mu
    D = X.shape[1]
    sigma = Xc @ Xc.transpose(1, 2) / m + eps * torch.eye(D, dtype=x.dtype, device=x.device)
    l, U = torch.linalg.eigh(sigma)
    l = l.clamp_min(eps)
    W = U @ torch.diag_embed(l.rsqrt()) @ U.transpose(1, 2)
    return from_groups(W @ Xc, x.shape), mu.reshape(-1), l, W


def make(shape, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    C = shape[1]
    # well-conditioned correlated channels: I + R / (2 sqrt(C)) has singular values in ~[0.5, 1.5]
    mix = (torch.randn(C, C, generator=g, dtype=torch.float64) * (0.5 / C ** 0.5)
           + torch.eye(C, dtype=torch.float64))
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    shift = torch.randn(C, generator=g, dtype=torch.float64).reshape((1, C) + (1,) * (len(shape) - 2))
    x = torch.einsum("dc,nc...->nd...", mix, x) + shift
    return x.contiguous().to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", CASES, ids=ids)
def test_dbn_forward(shape, G, dtype):
    eps, mom = 1e-5, 0.9
    x = make(shape, dtype)
    C, D = shape[1], shape[1] // G
    acc = gnh.ACC[dtype]
    rm = torch.randn(C, dtype=acc, device=DEV)
    rp = torch.randn(G, D, D, dtype=acc, device=DEV)
    rm0, rp0 = rm.clone(), rp.clone()
    y, mean, U, l = gnh.dbn_fwd(x, G, rm, rp, eps, mom)
    gnh.sync()
    ry, rmu, rl, rW = ref_dbn(x.double(), G, eps)
    tol = TOL[dtype]
    assert y.dtype == dtype
    assert rel_err(y, ry) < tol, rel_err(y, ry)
    assert rel_err(mean, rmu) < tol
    assert rel_err(l, rl) < tol
    W = U.double() @ torch.diag_embed(l.double().rsqrt()) @ U.double().transpose(1, 2)
    assert rel_err(W, rW) < tol
    assert rel_err(rm, mom * rm0.double() + (1 - mom) * rmu) < tol
    assert rel_err(rp, mom * rp0.double() + (1 - mom) * rW) < tol
    # whitened output: covariance ~ I
    Y = to_groups(y.double(), G)
    Yc = Y - Y.mean(-1, keepdim=True)
    cov = Yc @ Yc.transpose(1, 2) / Y.shape[-1]
    lim = 5e-2 if dtype == torch.float16 else 1e-2
    assert (cov - torch.eye(D, dtype=cov.dtype, device=DEV)).abs().max() < lim


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", CASES, ids=ids)
def test_dbn_backward(shape, G, dtype):
    eps = 1e-5
    x = make(shape, dtype)
    g = torch.Generator(device="cpu").manual_seed(3)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    y, mean, U, l = gnh.dbn_fwd(x, G, eps=eps)
    dx = gnh.dbn_bwd(dy, x, mean, U, l, G)
    gnh.sync()
    xd = x.detach().to(torch.float64, copy=True).requires_grad_(True)
    ry, _, _, _ = ref_dbn(xd, G, eps)
    (ry * dy.double()).sum().backward()
    assert dx.dtype == dtype
    e = rel_err(dx, xd.grad)
    assert e < TOL[dtype] * (3 if dtype == torch.float16 else 1), e


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("stat_acc", [True, False], ids=["stat_acc", "stat_data"])
@pytest.mark.parametrize("shape,G", CASES[:5], ids=ids)
def test_dbn_inference(shape, G, dtype, stat_acc):
    x = make(shape, dtype)
    C, D = shape[1], shape[1] // G
    sdt = gnh.ACC[dtype] if stat_acc else dtype
    rm = torch.randn(C, dtype=torch.float64).to(sdt).to(DEV)
    rp = torch.randn(G, D, D, dtype=torch.float64).to(sdt).to(DEV)
    y = gnh.dbn_inference(x, rm, rp, G)
    g = torch.Generator(device="cpu").manual_seed(5)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    dx = gnh.dbn_inference(dy, rm, rp, G, backward=True)
    gnh.sync()
    P = rp.double()
    X = to_groups(x.double(), G) - rm.double().reshape(G, D, 1)
    assert rel_err(y, from_groups(P @ X, shape)) < TOL[dtype]
    assert rel_err(dx, from_groups(P.transpose(1, 2) @ to_groups(dy.double(), G), shape)) < TOL[dtype]


def test_dbn_nonfinite_input_gives_nan_not_crash():
    x = make((8, 8, 4), torch.float32)
    x[0, 0, 0] = float("nan")
    y, mean, U, l = gnh.dbn_fwd(x, 2)
    gnh.sync()
    assert torch.isnan(y[:, :4]).all() and torch.isfinite(y[:, 4:]).all()
