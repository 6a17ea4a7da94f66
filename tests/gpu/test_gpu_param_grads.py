"""GPU harness tests: the parameter gradients reduced in parallel over N (param_reduce.cuh).

GroupNorm's dgamma/dbeta (bwd_param_kernel + param_finalize_kernel) and the per-channel affine's
backward (affine_bwd_tile_kernel for short rows, affine_bwd_rows_kernel for long ones) on shapes
that reach every branch of their plans: N split into several chunks (N not a multiple of the chunk),
N = 1, C not a multiple of the channel tile, S = 1 and short/long rows, vectors that straddle two
channels, unaligned pointers, no workspace; fp16 data with fp32 parameters; exactly recomputed
GroupNorm groups among ordinary ones. Against float64 references; results bitwise equal from run to
run and for any SM count (the chunking depends on the shape only).
"""
import os
import subprocess
import sys

import pytest

from gpu_common import DEV, gnh, ids, rel_err  # skips the module without torch / a device
import torch

TOL = {torch.float16: 1.5e-2, torch.float32: 1e-4, torch.float64: 1e-9}
PAIRS = [(torch.float32, torch.float32), (torch.float64, torch.float64),
         (torch.float16, torch.float32), (torch.float16, torch.float16)]


def randn(shape, dtype, seed, scale=1.0, offset=0.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype).to(DEV)


# -------------------------------------------------------------------------------------------------
# GroupNorm


def gn_ref(x, gamma, beta, G, eps, dy):
    """float64 (dx, dgamma, dbeta) of sum(y * dy) on the rounded inputs."""
    xd = x.detach().double().requires_grad_(True)
    gd = gamma.detach().double().requires_grad_(True)
    bd = beta.detach().double().requires_grad_(True)
    N, C = x.shape[:2]
    xr = xd.reshape(N, G, -1)
    mean = xr.mean(-1, keepdim=True)
    # centred on the first element: float64 variance of values with a large common offset
    xc = xr - xr[..., :1]
    var = ((xc - xc.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
    xh = ((xr - mean) / torch.sqrt(var + eps)).reshape(N, C, -1)
    y = xh * gd[None, :, None] + bd[None, :, None]
    (y.reshape(x.shape) * dy.double()).sum().backward()
    return xd.grad, gd.grad, bd.grad


def gn_check(x, gamma, beta, G, eps=1e-5, seed=7):
    dtype = x.dtype
    dy = randn(x.shape, dtype, seed)
    _, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, G, eps)
    dx, dgamma, dbeta = gnh.group_norm_bwd(dy, x, mean, rstd, gamma, G, beta=beta, eps=eps)
    gnh.sync()
    rdx, rdg, rdb = gn_ref(x, gamma, beta, G, eps, dy)
    tol = TOL[dtype]
    assert dgamma.dtype == gamma.dtype and dbeta.dtype == gamma.dtype
    assert rel_err(dgamma, rdg) < tol, f"dgamma error {rel_err(dgamma, rdg)}"
    assert rel_err(dbeta, rdb) < tol, f"dbeta error {rel_err(dbeta, rdb)}"
    assert rel_err(dx, rdx) < tol, f"dx error {rel_err(dx, rdx)}"
    return dx, dgamma, dbeta


GN_SHAPES = [  # (shape, G): n chunks of 64 rows (param_reduce.cuh's kParamMinRows)
    ((150, 40), 4),        # S = 1, 3 chunks of 50 rows, C not a multiple of the 32-channel tile
    ((70, 8), 4),          # two-element groups: every group exactly recomputed; 2 chunks (35)
    ((130, 33, 4), 3),     # 3 chunks (44, 44, 42 rows), 2 channel tiles (32 + 1)
    ((1, 70, 3), 7),       # N = 1: one chunk, dgamma written by stage 1
    ((64, 16, 5), 4),      # exactly one chunk of kParamMinRows
]


@pytest.mark.parametrize("dtype,pdtype", PAIRS, ids=ids)
@pytest.mark.parametrize("shape,G", GN_SHAPES, ids=ids)
def test_gn_param_grads(shape, G, dtype, pdtype):
    C = shape[1]
    x = randn(shape, dtype, 0, 2.0)
    gamma = (randn(C, torch.float64, 1).abs() + 0.5).to(pdtype)
    beta = randn(C, pdtype, 2)
    gn_check(x, gamma, beta, G)


@pytest.mark.parametrize("pdtype", [torch.float32], ids=ids)
def test_gn_param_grads_exact_groups_among_ordinary(pdtype):
    """float32 groups of spread ~1e13 (var > 1e24, rstd < 1e-12: recomputed in float64, their row
    sums already hold sum g xhat) next to ordinary groups, over several n chunks: a stage 1 that
    scaled those rows by rstd again would lose their share of dgamma entirely."""
    N, C, S, G = 100, 32, 2, 4
    x = randn((N, C, S), torch.float64, 0)
    n = torch.arange(N).reshape(N, 1, 1)
    grp = (torch.arange(C) // (C // G)).reshape(1, C, 1)
    pick = ((n + grp) % 3 == 0).to(DEV)
    x = torch.where(pick, x * 1e13, x).to(torch.float32)
    gamma = (randn(C, torch.float64, 1).abs() + 0.5).to(pdtype)
    beta = randn(C, pdtype, 2)
    _, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, G)
    gnh.sync()
    assert (rstd < 1e-12).any() and (rstd > 0.1).any()  # both kinds of groups are there
    gn_check(x, gamma, beta, G)


# -------------------------------------------------------------------------------------------------
# Per-channel affine


def affine_check(x, gamma, beta, use_workspace=True, seed=7):
    dtype = x.dtype
    dy = randn(x.shape, dtype, seed)
    y = gnh.affine_fwd(x, gamma, beta)
    dx, dgamma, dbeta = gnh.affine_bwd(dy, x, gamma, use_workspace=use_workspace)
    gnh.sync()
    C = x.shape[1]
    bshape = (1, C) + (1,) * (x.dim() - 2)
    red = [0] + list(range(2, x.dim()))
    xd, dyd = x.double(), dy.double()
    gd, bd = gamma.double().reshape(bshape), beta.double().reshape(bshape)
    tol = TOL[dtype]
    assert rel_err(y, xd * gd + bd) < tol
    assert rel_err(dx, dyd * gd) < tol
    assert rel_err(dgamma, (dyd * xd).sum(red)) < tol, f"dgamma {rel_err(dgamma, (dyd * xd).sum(red))}"
    assert rel_err(dbeta, dyd.sum(red)) < tol
    return dx, dgamma, dbeta


AFFINE_SHAPES = [
    (1001, 40),            # S = 1: one tile of 40 channels, 8 chunks (126 rows, last 119)
    (300, 1030),           # S = 1: C not a multiple of the tile (1024 + 6, or 256-channel tiles)
    (260, 1028),           # S = 1: last tile of 4 channels (vector path for fp32)
    (700, 8, 3),           # S = 3: fp16 vectors straddle channels
    (500, 10, 3),          # S = 3: scalar path (C*S not a multiple of the vector width)
    (300, 12, 2, 2),       # S = 4: 32 row lanes
    (200, 6, 33),          # long rows, scalar path, 4 chunks
    (600, 3, 64),          # long rows, vectors, chunks
    (1, 50),               # N = 1
    (1, 3, 100),           # N = 1, long rows
]


@pytest.mark.parametrize("dtype,pdtype", PAIRS, ids=ids)
@pytest.mark.parametrize("shape", AFFINE_SHAPES, ids=ids)
def test_affine_param_grads(shape, dtype, pdtype):
    C = shape[1]
    x = randn(shape, dtype, 0)
    gamma = randn(C, pdtype, 1)
    beta = randn(C, pdtype, 2)
    affine_check(x, gamma, beta)


@pytest.mark.parametrize("shape", [(1001, 40), (200, 6, 33)], ids=ids)
def test_affine_without_workspace(shape):
    """Without a workspace every block takes all N rows: same sums to rounding."""
    x = randn(shape, torch.float32, 0)
    gamma, beta = randn(shape[1], torch.float32, 1), randn(shape[1], torch.float32, 2)
    a = affine_check(x, gamma, beta, use_workspace=True)
    b = affine_check(x, gamma, beta, use_workspace=False)
    assert torch.equal(a[0], b[0])  # dx is elementwise
    assert rel_err(a[1], b[1]) < 1e-5 and rel_err(a[2], b[2]) < 1e-5


@pytest.mark.parametrize("shape", [(301, 41), (130, 5, 7), (90, 3, 40)], ids=ids)
def test_affine_misaligned(shape):
    """Views one element into a buffer: the scalar paths of both the tile and the rows kernels."""
    dtype = torch.float16
    n = 1
    for d in shape:
        n *= d
    buf = torch.empty(2 * n + 2, dtype=dtype, device=DEV)
    x = buf[1:n + 1].view(shape)
    x.copy_(randn(shape, dtype, 0))
    gamma, beta = randn(shape[1], torch.float32, 1), randn(shape[1], torch.float32, 2)
    affine_check(x, gamma, beta)


# -------------------------------------------------------------------------------------------------
# Determinism: run to run, and for any SM count

_DET_SCRIPT = r"""
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import torch, gnh
def randn(shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(gnh.DEVICE)
h = hashlib.sha256()
x, dy = randn((150, 40), torch.float16, 0), randn((150, 40), torch.float16, 1)
gamma, beta = randn(40, torch.float32, 2).abs() + 0.5, randn(40, torch.float32, 3)
_, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, 4)
for t in gnh.group_norm_bwd(dy, x, mean, rstd, gamma, 4):
    h.update(t.cpu().numpy().tobytes())
for shape in [(1001, 40), (200, 6, 33)]:
    x, dy = randn(shape, torch.float32, 4), randn(shape, torch.float32, 5)
    for t in gnh.affine_bwd(dy, x, randn(shape[1], torch.float32, 6)):
        h.update(t.cpu().numpy().tobytes())
gnh.sync()
print(h.hexdigest())
"""


def _digest(env_extra):
    env = dict(os.environ, **env_extra)
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _DET_SCRIPT, here], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1]


def test_param_grads_deterministic():
    x, dy = randn((150, 40), torch.float32, 0), randn((150, 40), torch.float32, 1)
    gamma, beta = randn(40, torch.float32, 2).abs() + 0.5, randn(40, torch.float32, 3)
    _, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, 4)
    a = [t.clone() for t in gnh.group_norm_bwd(dy, x, mean, rstd, gamma, 4)]
    b = gnh.group_norm_bwd(dy, x, mean, rstd, gamma, 4)
    c = [t.clone() for t in gnh.affine_bwd(dy, x, gamma)]
    d = gnh.affine_bwd(dy, x, gamma)
    gnh.sync()
    for u, v in zip(a + c, list(b) + list(d)):
        assert torch.equal(u, v)


@pytest.mark.skipif(not gnh.EMU, reason="the SM count is the emulator's GNMX_EMU_SMS")
def test_param_grads_independent_of_sm_count():
    """S = 1 GroupNorm (no split rows) and the affine: the same bits on 1 and on 132 SMs."""
    assert _digest({"GNMX_EMU_SMS": "1"}) == _digest({"GNMX_EMU_SMS": "132"})
