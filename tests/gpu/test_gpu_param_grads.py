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

import numpy as np
import pytest

from gpu_common import EMU, hnp, ids, randn, rel_err  # skips without g++ (emulator)
from reference import group_norm_bwd_ref

TOL = {np.float16: 1.5e-2, np.float32: 1e-4, np.float64: 1e-9}
PAIRS = [(np.float32, np.float32), (np.float64, np.float64), (np.float16, np.float32),
         (np.float16, np.float16)]


# -------------------------------------------------------------------------------------------------
# GroupNorm


def gn_check(x, gamma, beta, G, eps=1e-5, seed=7):
    """(dx, dgamma, dbeta) of sum(y * dy) against tests/reference.py's float64 backward (whose
    variance is numpy's two-pass var: exact enough for groups with a large common offset)."""
    dtype = x.dtype.type
    dy = randn(x.shape, dtype, seed)
    _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G, eps)
    dx, dgamma, dbeta = hnp.group_norm_bwd(dy, x, mean, rstd, gamma, G, beta=beta, eps=eps)
    rdx, rdg, rdb = group_norm_bwd_ref(x, gamma, dy, G, eps)
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
    gamma = (np.abs(randn(C, np.float64, 1)) + 0.5).astype(pdtype)
    beta = randn(C, pdtype, 2)
    gn_check(x, gamma, beta, G)


@pytest.mark.parametrize("pdtype", [np.float32], ids=ids)
def test_gn_param_grads_exact_groups_among_ordinary(pdtype):
    """float32 groups of spread ~1e13 (var > 1e24, rstd < 1e-12: recomputed in float64, their row
    sums already hold sum g xhat) next to ordinary groups, over several n chunks: a stage 1 that
    scaled those rows by rstd again would lose their share of dgamma entirely."""
    N, C, S, G = 100, 32, 2, 4
    x = randn((N, C, S), np.float64, 0)
    n = np.arange(N).reshape(N, 1, 1)
    grp = (np.arange(C) // (C // G)).reshape(1, C, 1)
    pick = (n + grp) % 3 == 0
    x = np.where(pick, x * 1e13, x).astype(np.float32)
    gamma = (np.abs(randn(C, np.float64, 1)) + 0.5).astype(pdtype)
    beta = randn(C, pdtype, 2)
    _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G)
    assert (rstd < 1e-12).any() and (rstd > 0.1).any()  # both kinds of groups are there
    gn_check(x, gamma, beta, G)


# -------------------------------------------------------------------------------------------------
# Per-channel affine


def affine_check(x, gamma, beta, use_workspace=True, seed=7, offset=0):
    dtype = x.dtype.type
    dy = randn(x.shape, dtype, seed)
    y = hnp.affine_fwd(x, gamma, beta, offset=offset)
    dx, dgamma, dbeta = hnp.affine_bwd(dy, x, gamma, use_workspace=use_workspace, offset=offset)
    C = x.shape[1]
    bshape = (1, C) + (1,) * (x.ndim - 2)
    red = (0,) + tuple(range(2, x.ndim))
    xd, dyd = x.astype(np.float64), dy.astype(np.float64)
    gd, bd = gamma.astype(np.float64).reshape(bshape), beta.astype(np.float64).reshape(bshape)
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
    x = randn(shape, np.float32, 0)
    gamma, beta = randn(shape[1], np.float32, 1), randn(shape[1], np.float32, 2)
    a = affine_check(x, gamma, beta, use_workspace=True)
    b = affine_check(x, gamma, beta, use_workspace=False)
    assert a[0].tobytes() == b[0].tobytes()  # dx is elementwise
    assert rel_err(a[1], b[1]) < 1e-5 and rel_err(a[2], b[2]) < 1e-5


@pytest.mark.parametrize("shape", [(301, 41), (130, 5, 7), (90, 3, 40)], ids=ids)
def test_affine_misaligned(shape):
    """Buffers one element past an aligned start: the scalar paths of both the tile and the rows
    kernels."""
    x = randn(shape, np.float16, 0)
    gamma, beta = randn(shape[1], np.float32, 1), randn(shape[1], np.float32, 2)
    affine_check(x, gamma, beta, offset=1)


# -------------------------------------------------------------------------------------------------
# Determinism: run to run, and for any SM count

_DET_SCRIPT = r"""
import hashlib, sys
sys.path.insert(0, sys.argv[1])
from gpu_common import hnp, randn
import numpy as np
h = hashlib.sha256()
x, dy = randn((150, 40), np.float16, 0), randn((150, 40), np.float16, 1)
gamma, beta = np.abs(randn(40, np.float32, 2)) + 0.5, randn(40, np.float32, 3)
_, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, 4)
for t in hnp.group_norm_bwd(dy, x, mean, rstd, gamma, 4):
    h.update(t.tobytes())
for shape in [(1001, 40), (200, 6, 33)]:
    x, dy = randn(shape, np.float32, 4), randn(shape, np.float32, 5)
    for t in hnp.affine_bwd(dy, x, randn(shape[1], np.float32, 6)):
        h.update(t.tobytes())
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
    x, dy = randn((150, 40), np.float32, 0), randn((150, 40), np.float32, 1)
    gamma, beta = np.abs(randn(40, np.float32, 2)) + 0.5, randn(40, np.float32, 3)
    _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, 4)
    a = hnp.group_norm_bwd(dy, x, mean, rstd, gamma, 4)
    b = hnp.group_norm_bwd(dy, x, mean, rstd, gamma, 4)
    c = hnp.affine_bwd(dy, x, gamma)
    d = hnp.affine_bwd(dy, x, gamma)
    for u, v in zip(a + c, b + d):
        assert u.tobytes() == v.tobytes()


@pytest.mark.skipif(not EMU, reason="the SM count is the emulator's GNMX_EMU_SMS")
def test_param_grads_independent_of_sm_count():
    """S = 1 GroupNorm (no split rows) and the affine: the same bits on 1 and on 132 SMs."""
    assert _digest({"GNMX_EMU_SMS": "1"}) == _digest({"GNMX_EMU_SMS": "132"})
