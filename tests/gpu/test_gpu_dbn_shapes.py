"""DBN CUDA data-side kernels on the shapes their launch plans branch on (issue 23).

The gram kernel tiles the D x D output (tiles of 16, 32 or 64 rows, chosen by D and by how many
blocks fill the GPU), splits the columns j = n*S + s into chunks, and gathers panels in an order
that depends on S (channel-contiguous for S = 1, runs along s for larger S); the apply kernel
tiles D x columns; the channel sums split the columns too. These cases hit each branch: S = 1
with N not a multiple of any panel, odd D and D not a multiple of the tile, power-of-two and odd
S, many column chunks, G = 1 with D = 256 / 512 (backward and inference: their D x D solver is
cheap under the emulator), fp16 / fp32 / fp64, each against float64 references. Same guards as
test_gpu_dbn.py (numpy-driven: GPU, emulator or GPGPU-Sim).
"""
import numpy as np
import pytest

from gpu_common import ACC, DTYPES, hnp, ids, rel_err, rng  # skips without g++ (emulator)
from test_gpu_dbn import TOL, from_groups, make, ref_dbn, to_groups, whitening  # noqa: E402

FWD_CASES = [  # (shape, G)
    ((37, 24), 1),         # S = 1, N = 37: no panel multiple; D = 24 (tile 32)
    ((45, 63), 3),         # S = 1, odd D = 21
    ((3, 36, 5), 2),       # S = 5: runs of 4, panels across samples
    ((2, 16, 8, 4), 2),    # S = 32: runs along s
    ((5, 96, 4), 1),       # S = 4 (whole samples per panel), D = 96: two 64-tiles, one partial
    ((3, 80, 7, 3), 1),    # S = 21, D = 80
    ((64, 32, 33), 2),     # m = 2112: many column chunks in every kernel
    ((16, 64, 64), 1),     # G = 1, D = 64, m = 1024: large split partials, gram_reduce_kernel
    ((32, 64, 40), 8),     # G = 8 with several chunks (the small kernels sum the splits)
    ((80, 72), 1),         # S = 1, D = 72: a full and a partial 64-tile
]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", FWD_CASES, ids=ids)
def test_dbn_forward_shapes(shape, G, dtype):
    eps = 1e-5
    x = make(shape, dtype, seed=7)
    y, mean, U, lam = hnp.dbn_fwd(x, G, eps=eps)
    ry, rmu, rl, rW = ref_dbn(x, G, eps)
    tol = TOL[dtype]
    assert rel_err(mean, rmu) < tol
    assert rel_err(lam, rl) < tol, rel_err(lam, rl)
    W = whitening(U, lam)
    assert rel_err(W, rW) < tol * 5, rel_err(W, rW)
    assert rel_err(y, ry) < tol * 5, rel_err(y, ry)
    if dtype == np.float32:  # deterministic: the same plan sums in the same order
        y2, mean2, _, _ = hnp.dbn_fwd(x, G, eps=eps)
        assert y.tobytes() == y2.tobytes() and mean.tobytes() == mean2.tobytes()


def ref_bwd_given(dy, x, mean, U, l, G):
    """dX from dbn.h's formulas for given mean, U, l (float64): W (dY - mean dY) + (2/m) G_S Xc."""
    X = to_groups(x, G)
    dY = to_groups(dy, G)
    m = X.shape[-1]
    Xc = X - np.asarray(mean, np.float64).reshape(G, -1, 1)
    U, lam = np.asarray(U, np.float64), np.asarray(l, np.float64)
    r = np.sqrt(lam)
    Ut = U.transpose(0, 2, 1)
    W = U @ (1 / r[:, :, None] * Ut)
    GW = dY @ Xc.transpose(0, 2, 1)
    Gs = (GW + GW.transpose(0, 2, 1)) / 2
    K = -1 / (r[:, :, None] * r[:, None, :] * (r[:, :, None] + r[:, None, :]))
    GS = U @ (K * (Ut @ Gs @ U)) @ Ut
    dX = W @ (dY - dY.mean(-1, keepdims=True)) + (2.0 / m) * GS @ Xc
    return from_groups(dX, x.shape)


BWD_CASES = [  # (shape, G): eigenpairs given, so no eigensolver runs
    ((37, 24), 1),
    ((45, 63), 3),
    ((3, 36, 5), 2),
    ((64, 32, 33), 2),
    ((16, 64, 64), 1),
    ((32, 64, 40), 8),
    ((70, 256), 1),        # S = 1, N = 70
]
# G = 1 at the largest D, one dtype each (the emulated D x D products of the small kernel dominate)
BWD_LARGE = [((3, 512, 2, 3), 1, np.float32)]


@pytest.mark.parametrize("shape,G,dtype",
                         [(s, g, d) for s, g in BWD_CASES for d in DTYPES] + BWD_LARGE, ids=ids)
def test_dbn_backward_shapes(shape, G, dtype):
    C = shape[1]
    D = C // G
    acc = ACC(dtype)
    r = rng(11)
    x = make(shape, dtype, seed=9)
    dy = r.standard_normal(shape).astype(dtype)
    Q, _ = np.linalg.qr(r.standard_normal((G, D, D)))
    lam = r.random((G, D)) * 1.5 + 0.5
    mean = to_groups(x, G).mean(-1).reshape(-1)
    U = np.ascontiguousarray(Q).astype(acc)
    lam, mean = lam.astype(acc), mean.astype(acc)
    dx = hnp.dbn_bwd(dy, x, mean, U, lam, G)
    ref = ref_bwd_given(dy, x, mean, U, lam, G)
    e = rel_err(dx, ref)
    assert e < TOL[dtype] * (3 if dtype == np.float16 else 1), e
    if dtype == np.float32 and D < 512:
        dx2 = hnp.dbn_bwd(dy, x, mean, U, lam, G)
        assert dx.tobytes() == dx2.tobytes()


INF_CASES = [((70, 512), 1), ((37, 24), 1), ((3, 36, 5), 2), ((2, 64, 3, 11), 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", INF_CASES, ids=ids)
def test_dbn_inference_shapes(shape, G, dtype):
    C = shape[1]
    D = C // G
    acc = ACC(dtype)
    r = rng(13)
    x = make(shape, dtype, seed=3)
    rm = r.standard_normal(C).astype(acc)
    rp = (r.standard_normal((G, D, D)) / D ** 0.5).astype(acc)
    dy = r.standard_normal(shape).astype(dtype)
    y = hnp.dbn_inference(x, rm, rp, G)
    dx = hnp.dbn_inference(dy, rm, rp, G, backward=True)
    P = rp.astype(np.float64)
    X = to_groups(x, G) - rm.astype(np.float64).reshape(G, D, 1)
    assert rel_err(y, from_groups(P @ X, shape)) < TOL[dtype]
    ref_dx = from_groups(P.transpose(0, 2, 1) @ to_groups(dy, G), shape)
    assert rel_err(dx, ref_dx) < TOL[dtype]
