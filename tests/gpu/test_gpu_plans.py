"""GroupNorm / gn_moments CUDA launch plans (group_norm_cuda.cu's plan_team) and the peeled
16-byte vector paths, against float64 references.

Every plan and every boundary between plans, per dtype: a thread per group (group bytes <= 64), a
warp per group (<= 4 KiB), a block per group (above; split across blocks when the groups are few),
with one-element groups, 2-4 element groups (recomputed in float64), fp32 groups whose statistics
overflow (recomputed) and NaN groups inside a many-groups-per-block plan, odd S and odd group
lengths (vectors that straddle channels, misaligned groups), buffers misaligned by the same or by
different offsets, activations and gradients into mean/rstd. numpy + ctypes only (harness_np), so
the CPU CI runs it under the emulator; there the launch log (GNMX_EMU_LAUNCH_LOG) also checks that
each case got the plan it is meant to test.
"""
import math
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import harness_np  # noqa: E402
from reference import group_norm_bwd_ref, group_norm_ref, moments_bwd_ref, moments_ref  # noqa: E402
from tolerances import GRAD_TOL, tol  # noqa: E402

if harness_np.emulated() and shutil.which("g++") is None:
    pytest.skip("the CUDA emulator needs g++", allow_module_level=True)

BLOCK, WARP = 256, 32
THREAD_MAX_BYTES, WARP_MAX_BYTES = 64, 4096  # group_norm_cuda.cu: kThreadMaxBytes, kWarpMaxBytes
RESIDENT_MAX_BYTES = 32768  # kResidentVecs (8) 16-byte vectors per lane of the block team
RESIDENT_BWD_VECS = 4       # kResidentBwdVecs: 16-byte vectors per lane in the one-pass backward
DTYPES = [np.float16, np.float32, np.float64]


def team(L, dtype):
    """The plan group_norm_cuda.cu's plan_team picks (threads per group)."""
    b = L * np.dtype(dtype).itemsize
    return 1 if b <= THREAD_MAX_BYTES else WARP if b <= WARP_MAX_BYTES else BLOCK


def forward_launches(L, dtype):
    """Launches of the forward with aligned buffers: group_norm_cuda.cu's plan_resident (one
    kernel, the group in registers: whole 16-byte vectors, <= 32 KiB) or statistics + apply."""
    s = np.dtype(dtype).itemsize
    return 1 if L % (16 // s) == 0 and L * s <= RESIDENT_MAX_BYTES else 2


def backward_resident(L, S, dtype):
    """Whether the backward (aligned buffers) is the one-pass kernel (plan_resident_bwd): vectors
    inside a channel, at most RESIDENT_BWD_VECS per lane of the group's team."""
    s = np.dtype(dtype).itemsize
    V = 16 // s
    return S % V == 0 and L // V <= team(L, dtype) * RESIDENT_BWD_VECS


def expect_backward(grids, N, G, L, S, dtype):
    """The backward's first launch (after the forward's): the one-pass kernel's grid when
    backward_resident says so (alone for one sample: it writes dgamma/dbeta itself), else the row
    sums' (another grid, unless the two coincide)."""
    if grids is None:
        return
    NG = N * G
    tm = team(L, dtype)
    one_pass = (math.ceil(NG / (BLOCK // tm)), 1, 1, BLOCK)
    got = grids[forward_launches(L, dtype)]
    if backward_resident(L, S, dtype):
        assert got == one_pass, (grids, NG, L, S)
        params = (0,) if N == 1 else (1, 2)  # dgamma/dbeta: bwd_param_kernel [+ finalize]
        assert len(grids) - forward_launches(L, dtype) - 1 in params, grids
    else:
        assert len(grids) - forward_launches(L, dtype) in (3, 4), grids  # row sums, dx, params


def boundary_cases(dtype):
    """(N, G, D, S) per plan boundary of `dtype`: group lengths L = D*S at 1, 3, the largest
    thread-per-group length, one past it, the largest warp-per-group length, one past it."""
    s = np.dtype(dtype).itemsize
    t, w = THREAD_MAX_BYTES // s, WARP_MAX_BYTES // s
    return [
        (300, 8, 1, 1),        # one-element groups ((N, C) data, G = C): 2400 groups, 10 blocks
        (40, 7, 3, 1),         # 3-element groups: all recomputed in float64, in a thread plan
        (70, 4, t // 4, 4),    # largest thread group: 280 groups, 2 blocks, the last one partial
        (9, 2, 1, t + 1),      # warp plan, odd length: misaligned groups, odd S (warp rows)
        (3, 3, w // 8, 8),     # largest warp group, 9 groups: 2 blocks
        (2, 2, 1, w + 1),      # block plan, odd S (fp16: rows of > 2048 elements, block rows)
        (5, 3, 8, 3),          # one-pass forward, vectors across channels (S % V != 0)
        (1, 2, 16, 130),       # one-pass forward with the block, vectors across channels
        (1, 2, 1, RESIDENT_MAX_BYTES // s),           # largest one-pass group (block)
        (1, 2, 1, (RESIDENT_MAX_BYTES + 16) // s),    # one vector more: statistics + apply, split
        (4, 3, 2, 1024 // s),  # largest one-pass backward with a warp (2 KiB)
        (1, 2, 4, 4096 // s),  # largest one-pass backward with the block (16 KiB)
        (1, 2, 1, 16400 // s),  # one vector more: row sums + dx (forward: one pass)
    ]


PLAN_CASES = [(d, c) for d in DTYPES for c in boundary_cases(d)]


def case_id(v):
    if isinstance(v, type):
        return np.dtype(v).name
    if isinstance(v, tuple):
        return "N{}G{}D{}S{}".format(*v)
    return str(v)


@pytest.fixture(scope="module")
def lib():
    return harness_np.load()


@pytest.fixture
def launches(tmp_path, monkeypatch):
    """The grids (x, y, z, threads) the emulator launches from now on (None on a GPU)."""
    if not harness_np.emulated():
        return lambda: None
    log = tmp_path / "launches.txt"
    monkeypatch.setenv("GNMX_EMU_LAUNCH_LOG", str(log))

    def read():
        if not log.exists():
            return []
        rows = [tuple(int(v) for v in line.split()[:4]) for line in log.read_text().splitlines()]
        log.unlink()
        return rows
    return read


def data(N, G, D, S, dtype, seed, offset=0.0):
    rng = np.random.RandomState(seed)
    C = G * D
    x = (rng.randn(N, C, S) * 2 + offset).astype(dtype)
    gamma = (rng.rand(C) + 0.5).astype(dtype)
    beta = rng.randn(C).astype(dtype)
    dy = rng.randn(N, C, S).astype(dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean = rng.randn(N, G).astype(acc)
    drstd = (rng.randn(N, G) * 0.1).astype(acc)
    return x, gamma, beta, dy, dmean, drstd


def check_group_norm(run, x, gamma, beta, dy, dmean, drstd, G, act, dtype, eps=1e-5):
    r = run.group_norm(x, gamma, beta, G, eps, act=act, dy=dy, dmean=dmean, drstd=drstd)
    ref, rmean, rrstd = group_norm_ref(x, gamma, beta, G, eps, act=act)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(r["y"], ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(r["mean"], rmean, rtol=rtol, atol=atol)
    np.testing.assert_allclose(r["rstd"], rrstd, rtol=rtol)
    rdx, rdg, rdb = group_norm_bwd_ref(x, gamma, dy, G, eps, dmean, drstd, act=act, beta=beta)
    grtol, gatol = tol(dtype, GRAD_TOL)
    for k, v in (("dx", rdx), ("dgamma", rdg), ("dbeta", rdb)):
        scale = max(1.0, np.abs(v).max())
        np.testing.assert_allclose(r[k], v, rtol=grtol, atol=gatol * scale, err_msg=k)
    return r


def check_moments(run, x, G, dmean, dvar, dtype):
    m = run.moments(x, G, dmean=dmean, dvar=dvar)
    rm, rv = moments_ref(x, G)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(m["mean"], rm, rtol=rtol, atol=atol)
    np.testing.assert_allclose(m["var"], rv, rtol=rtol, atol=atol * max(1.0, np.abs(rv).max()))
    rdx = moments_bwd_ref(x, G, dmean, dvar)
    grtol, gatol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(m["dx"], rdx, rtol=grtol, atol=gatol * max(1.0, np.abs(rdx).max()))


def expect_plan(grids, NG, L, dtype, n):
    """The first n launches are kernels over groups with the plan of (L, dtype)."""
    if grids is None:
        return
    assert len(grids) >= n, grids
    tm = team(L, dtype)
    for gx, gy, _, threads in grids[:n]:
        assert threads == BLOCK
        if tm == BLOCK:
            assert gx == NG, (grids, NG)
        else:
            assert (gx, gy) == (math.ceil(NG / (BLOCK // tm)), 1), (grids, NG, tm)


@pytest.mark.parametrize("dtype,case", PLAN_CASES, ids=case_id)
def test_plan_boundaries(lib, launches, dtype, case):
    N, G, D, S = case
    L = D * S
    act = [None, "relu", "silu"][(L + G) % 3]
    x, gamma, beta, dy, dmean, drstd = data(N, G, D, S, dtype, seed=L)
    run = harness_np.Runner()
    launches()
    check_group_norm(run, x, gamma, beta, dy, dmean, drstd, G, act, dtype)
    grids = launches()
    expect_plan(grids, N * G, L, dtype, forward_launches(L, dtype))
    expect_backward(grids, N, G, L, S, dtype)
    check_moments(run, x, G, dmean, drstd, dtype)
    expect_plan(launches(), N * G, L, dtype, 1)


# Misaligned buffers: "same" offsets every data buffer by one element (vectors after a peeled head),
# "mixed" only x (vector stores, x loaded element by element), "outs" the outputs by 3 elements and
# dy by 1 (every buffer at its own offset).
OFFSETS = {"same": {"x": 1, "y": 1, "dy": 1, "dx": 1}, "mixed": {"x": 1},
           "outs": {"y": 3, "dy": 1, "dx": 3}}


def misaligned_cases():
    out = []
    for d in DTYPES:
        s = np.dtype(d).itemsize
        for shape in ((50, 2, 2, THREAD_MAX_BYTES // s // 2),  # thread plan, S a multiple of V
                      (4, 4, 5, 7),                             # warp plan, odd S, odd L
                      (1, 2, 4, 2 * WARP_MAX_BYTES // s)):     # block plan, split groups
            out += [(d, shape, k) for k in OFFSETS]
    return out


@pytest.mark.parametrize("dtype,case,offsets", misaligned_cases(), ids=case_id)
def test_misaligned(lib, dtype, case, offsets):
    N, G, D, S = case
    x, gamma, beta, dy, dmean, drstd = data(N, G, D, S, dtype, seed=3 + S)
    run = harness_np.Runner(OFFSETS[offsets])
    act = {"same": "silu", "mixed": None, "outs": "relu"}[offsets]
    check_group_norm(run, x, gamma, beta, dy, dmean, drstd, G, act, dtype)
    check_moments(run, x, G, dmean, drstd, dtype)


@pytest.mark.parametrize("L", [8, 100], ids=["thread", "warp"])
@pytest.mark.parametrize("act", [None, "relu"])
def test_recomputed_groups_in_shared_blocks(lib, launches, L, act):
    """fp32 groups at |x| ~ 3e38 (statistics overflow: recomputed in float64) and a NaN group next
    to ordinary ones in the same block: each group gets its own path."""
    N, G, S = 6, 8, L // 4
    D = 4
    rng = np.random.RandomState(L)
    x = rng.randn(N, G * D, S)
    huge = [(0, 1), (3, 5), (5, 7)]
    for n, g in huge:
        x[n, g * D:(g + 1) * D] = x[n, g * D:(g + 1) * D] * 1e38 + 2e38
    x = np.clip(x, -3.3e38, 3.3e38).astype(np.float32)
    gamma = (rng.rand(G * D) + 0.5).astype(np.float32)
    beta = rng.randn(G * D).astype(np.float32)
    dy = rng.randn(N, G * D, S).astype(np.float32)
    run = harness_np.Runner()
    launches()
    r = run.group_norm(x, gamma, beta, G, 1e-5, act=act, dy=dy)
    expect_plan(launches(), N * G, L, np.float32, forward_launches(L, np.float32))
    ref, rmean, rrstd = group_norm_ref(x, gamma, beta, G, 1e-5, act=act)
    np.testing.assert_allclose(r["y"], ref, *tol(np.float32))
    np.testing.assert_allclose(r["mean"], rmean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["rstd"], rrstd, rtol=1e-4)
    rdx, rdg, rdb = group_norm_bwd_ref(x, gamma, dy, G, 1e-5, act=act, beta=beta)
    dxn, rdxn = r["dx"].astype(np.float64).reshape(N, G, -1), rdx.reshape(N, G, -1)
    for n in range(N):
        for g in range(G):
            s = np.abs(rdxn[n, g]).max()
            np.testing.assert_allclose(dxn[n, g], rdxn[n, g], rtol=1e-3, atol=1e-3 * s + 1e-44)
    np.testing.assert_allclose(r["dbeta"], rdb, rtol=1e-4, atol=1e-4 * np.abs(rdb).max())
    # a NaN in one group of the block stays there
    ref = group_norm_ref(x, gamma, beta, G, 1e-5)[0].reshape(N, G, -1)
    x[2, 3 * D, 0] = np.nan
    r = run.group_norm(x, gamma, beta, G, 1e-5, dy=dy)
    bad = np.zeros((N, G), bool)
    bad[2, 3] = True
    yg, dxg = r["y"].reshape(N, G, -1), r["dx"].reshape(N, G, -1)
    assert np.isnan(yg[bad]).all()
    assert np.isfinite(yg[~bad]).all() and np.isfinite(dxg[~bad]).all()
    np.testing.assert_allclose(yg[~bad], ref[~bad], *tol(np.float32))
