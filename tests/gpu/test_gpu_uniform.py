"""Team-wide decisions are taken on bitwise team-uniform values.

The statistics kernels decide per group, from a warp-merged Welford state, whether to recompute the
group in float64 (gn_exact_group / gn_exact_moments: a path with full-mask shuffles). Chan's merge
is not bitwise symmetric (mean_a + delta n_b / n rounds differently from mean_b - delta n_a / n),
so the xor butterfly that merged op(own, partner) on every lane left lanes with different last
bits; a decision near a threshold could then split the warp (some lanes in exact_stats' shuffles,
the others returned: undefined behaviour on a GPU). cuda_common.cuh's warp_reduce now computes
op(lower lane, upper lane) on both lanes of a pair, and GN_ASSERT_UNIFORM marks every decision.

Under the emulator the assertion fails the launch when the lanes' values differ in any bit, even
where the decision happens to agree; these cases drive the warp-team statistics kernel (groups of
65 B - 4 KiB), the split-group merge (moments_finalize_kernel, the apply kernel's merge) and inputs
that sit on the rstd = 1e-12 threshold and split a warp's decision with the old butterfly. With the old butterfly every one of them fails
(tests/gpu/README.md, "Team-uniform decisions"). On a GPU they check the results.
"""
import os
import shutil
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/
import harness_np  # noqa: E402

if harness_np.emulated() and shutil.which("g++") is None:
    pytest.skip("the CUDA emulator needs g++", allow_module_level=True)

from reference import group_norm_ref, moments_ref  # noqa: E402
from test_gpu_plans import check_group_norm, check_moments, data  # noqa: E402

WARP_MAX_BYTES = 4096  # group_norm_cuda.cu's kWarpMaxBytes


@pytest.fixture(scope="module")
def run():
    harness_np.load()
    return harness_np.Runner()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_warp_team_statistics(run, dtype, offset):
    # 3 channels x 50 positions (fp16: 300 B, fp32: 600 B, fp64: 1200 B): a warp per group, lanes
    # with 1-5 16-byte vectors each and scalar tails, so their Welford states all differ
    x, gamma, beta, dy, dmean, drstd = data(4, 2, 3, 50, dtype, seed=11, offset=offset)
    check_group_norm(run, x, gamma, beta, dy, dmean, drstd, 2, None, dtype)
    check_moments(run, x, 2, dmean, drstd, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_split_group_merge(run, dtype):
    # one long group: split across blocks, whose partial states one warp merges (gn_moments:
    # moments_finalize_kernel; GroupNorm: the apply kernel's warp_merge_partials)
    x, gamma, beta, dy, dmean, drstd = data(1, 1, 2, 24000, dtype, seed=5, offset=300.0)
    check_moments(run, x, 1, dmean, drstd, dtype)
    check_group_norm(run, x, gamma, beta, dy, dmean, drstd, 1, "silu", dtype)


def threshold_groups(n, L, seed):
    """n float32 groups of L values with the same float64 variance 0.5e24 (standard deviation
    7.07e11), whose lanes' Welford states differ in their last bits: rstd ~ 1.41e-12, near the
    gn_exact_group threshold rstd < 1e-12 that eps ~ 0.5e24 crosses."""
    rng = np.random.RandomState(seed)
    z = rng.randn(n, L)
    z = (z - z.mean(1, keepdims=True)) / z.std(1, keepdims=True)
    return (z * np.sqrt(0.5e24)).astype(np.float32)[:, None, :]


def test_exact_threshold_splits_no_warp(run):
    # 64 warp-plan groups (L = 96 fp32: 384 B) and the float32 eps values around the one that puts
    # rstd on 1e-12. With the old butterfly, eps = 5.0000004295e23 and 5.0000007898e23 split a
    # warp (lanes 64..79 and 80..95 of block 0 decide differently: the exact path's full-mask
    # shuffles with half the lanes gone), found by this sweep under the emulator (no FMA).
    x = threshold_groups(64, 96, seed=96)
    var = x.astype(np.float64).reshape(64, -1).var(1)
    thr = np.float64(np.float32(1e-12))
    centre = 1.0 / thr ** 2 - var.mean()
    eps = [np.float32(5.0000004295301095e+23), np.float32(5.0000007898180797e+23)]
    e, hi = np.float32(centre * (1 - 1e-6)), np.float32(centre * (1 + 1e-6))
    while e <= hi:
        eps.append(e)
        e = np.nextafter(e, np.float32(np.inf))
    gamma, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    for ep in eps:
        r = run.group_norm(x, gamma, beta, 1, float(ep))
        y, rmean, rrstd = group_norm_ref(x, gamma, beta, 1, float(ep))
        np.testing.assert_allclose(r["mean"], rmean, rtol=1e-5, atol=1e-5 * 7.1e11 * 0.1)
        np.testing.assert_allclose(r["rstd"], rrstd, rtol=1e-5, err_msg=f"eps={ep!r}")
        np.testing.assert_allclose(r["y"], y, rtol=1e-4, atol=1e-5)
