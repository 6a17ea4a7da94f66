"""Decorrelated BN CPU kernel paths that depend on the group size D (see dbn_cpu.cc / dbn_small_cpu.h):

- eigensolver: cyclic Jacobi for D <= 8, Householder + implicit QL (dbn_small::eigh_ql) above;
- float panel kernels: the apply kernel works in blocks of 6 rows of the output (remainders
  1..5) and the gram kernel in 4 x 3 blocks, so D mod 6, mod 4 and mod 3 all matter;
- fp64 D x D steps (W, the backward's Daleckii-Krein matrices) by register-blocked products;
- threads: for tensors > 4 MB whole groups per thread when the groups divide evenly over the
  team, else chunk-parallel passes in blocks of groups; smaller tensors chunk-parallel;
- float32 with AVX2 writes the apply products straight into y / dx when spatial % 16 == 0
  ("direct"), else through a panel and a scatter: both layouts are covered.

Each case: forward, backward and the running projection against the float64 references of
tests/reference.py on the rounded inputs, in fp16 / fp32 / fp64; gradients of the QL path also
against finite differences, including repeated eigenvalues.
"""
import numpy as np
import pytest

import mxnet as mx

from conftest import GRAD_TOL, dbn_fd_check, dbn_train_step, tol
from reference import _dbn_group_matrix, dbn_bwd_ref, dbn_ref

EPS = 1e-5
MOM = 0.9


def _data(shape, dtype, offset=0.5, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(*shape)
    x[:, 1:] += 0.6 * x[:, :-1]
    return (x + offset).astype(dtype)


def _run(x, dy, G, dtype):
    return dbn_train_step(x, dy, G, dtype, eps=EPS, momentum=MOM)


# D = 8: last Jacobi size; 9, 16, 33: QL. 11, 13, 14: apply-kernel row remainders 5, 1, 2.
# Spatial (7, 3): panel + scatter; (4, 4) and (4, 12): direct output (S = 16, 48).
CASES = [(8, "float32", (7, 3)), (9, "float32", (7, 3)), (11, "float32", (7, 3)),
         (13, "float32", (7, 3)), (14, "float32", (7, 3)), (16, "float32", (7, 3)),
         (33, "float32", (7, 3)), (8, "float64", (7, 3)), (9, "float64", (7, 3)),
         (16, "float64", (7, 3)), (9, "float16", (7, 3)), (16, "float16", (7, 3)),
         (11, "float32", (4, 4)), (16, "float32", (4, 12)), (16, "float16", (4, 4))]


@pytest.mark.parametrize("D,dtype,spatial", CASES,
                         ids=[f"D{d}-{t}-S{s[0] * s[1]}" for d, t, s in CASES])
def test_group_size_paths_vs_reference(D, dtype, spatial):
    dtype = np.dtype(dtype).type
    G = 2
    shape = (6, G * D) + spatial  # m = 6 S > D: full-rank covariance, several odd tails
    x = _data(shape, dtype, seed=D)
    dy = np.random.RandomState(D + 1).randn(*shape).astype(dtype)
    y, dx, rp = _run(x, dy, G, dtype)
    ref, _, W = dbn_ref(x, G, EPS)
    # fp16 outputs carry fp16 rounding of whitened values whose size grows ~ sqrt(D).
    rt, at = tol(dtype)
    np.testing.assert_allclose(y, ref, rtol=rt, atol=at * (4 if dtype == np.float16 else 1))
    rdx = dbn_bwd_ref(x, dy, G, EPS)
    grt, gat = tol(dtype, GRAD_TOL)
    scale = np.abs(rdx).max()
    np.testing.assert_allclose(dx, rdx, rtol=grt, atol=gat * max(1.0, scale) * (5 if dtype == np.float16 else 1))
    rp_ref = MOM * np.eye(D) + (1 - MOM) * W
    np.testing.assert_allclose(rp, rp_ref, rtol=1e-3 if dtype == np.float16 else 1e-5,
                               atol=1e-3 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("D", [10, 17])
def test_ql_path_gradient_finite_differences(D):
    x = _data((5, D, 5), np.float64, seed=D)  # m = 25 > D: well-conditioned
    dbn_fd_check(x, 1, dy=np.random.RandomState(7).randn(*x.shape))


def test_ql_path_repeated_eigenvalues():
    """Columns 2 [Q, -Q] for an orthogonal 12 x 12 Q: centred, Sigma = I / 3 + eps exactly, every
    eigenvalue repeated 12 times (QL must still return an orthonormal basis). Output is the
    centred data scaled; the gradient needs no 1/(l_i - l_j)."""
    Q, _ = np.linalg.qr(np.random.RandomState(3).randn(12, 12))
    cols = np.hstack([Q, -Q]) * 2.0
    x = cols.T.reshape(24, 12, 1) + 5.0  # (N = 24, C = 12, S = 1), one group of 12
    rm = mx.nd.zeros((12,), dtype=np.float64)
    rp = mx.nd.array(np.eye(12)[None], dtype=np.float64)
    y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float64), rm, rp, num_groups=1)[0].asnumpy()
    Xg = _dbn_group_matrix(x, 1, 0)
    Xc = Xg - Xg.mean(axis=1, keepdims=True)
    c = (Xc @ Xc.T / Xc.shape[1])[0, 0]
    np.testing.assert_allclose(Xc @ Xc.T / Xc.shape[1], c * np.eye(12), atol=1e-12)
    np.testing.assert_allclose(_dbn_group_matrix(y, 1, 0), Xc / np.sqrt(c + EPS), rtol=1e-10,
                               atol=1e-10)
    dbn_fd_check(x, 1, dy=np.random.RandomState(4).randn(*x.shape))


@pytest.mark.parametrize("scale", [1e-3, 1e4])
def test_ql_path_data_scale(scale):
    """The QL solver scales Sigma by a power of two internally; results track the reference
    whatever the data's magnitude (eps fixed, so whitening of tiny data is eps-dominated)."""
    x = _data((8, 24, 6), np.float64, seed=11) * scale
    dy = np.random.RandomState(12).randn(*x.shape)
    y, dx, _ = _run(x, dy, 1, np.float64)
    np.testing.assert_allclose(y, dbn_ref(x, 1, EPS)[0], rtol=1e-8, atol=1e-9)
    rdx = dbn_bwd_ref(x, dy, 1, EPS)
    np.testing.assert_allclose(dx, rdx, rtol=1e-7, atol=1e-8 * np.abs(rdx).max())


_BLOCK_CODE = """
import sys; sys.path.insert(0, {tests!r})
import numpy as np, mxnet as mx
import gn_mx
from conftest import dbn_train_step
from reference import dbn_ref, dbn_bwd_ref
# > 4 MB of input. G = 3 with 2 threads: the groups do
# not split evenly, so the passes run chunk-parallel in blocks of groups (2 + 1); with 1 thread,
# and G = 4 with 2 threads, each thread runs whole groups.
for dtype, tol, G in ((np.float64, 1e-9, 3), (np.float32, 2e-4, 3), (np.float32, 2e-4, 4)):
    rng = np.random.RandomState(5)
    C = 60 if G == 3 else 64
    shape, D = (20, C, 32, 32), C // G
    x = (rng.randn(*shape) + 0.3).astype(dtype)
    dy = rng.randn(*shape).astype(dtype)
    y, dx, rp = dbn_train_step(x, dy, G)
    ref, mean, W = dbn_ref(x, G, 1e-5)
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol)
    rdx = dbn_bwd_ref(x, dy, G, 1e-5)
    np.testing.assert_allclose(dx, rdx, rtol=10 * tol, atol=10 * tol * np.abs(rdx).max())
    np.testing.assert_allclose(rp, 0.9 * np.eye(D) + 0.1 * W, rtol=1e-5, atol=1e-6)
print("BLOCKS_OK")
"""


@pytest.mark.parametrize("env", [{}, {"MXNET_ENGINE_TYPE": "NaiveEngine", "OMP_NUM_THREADS": "2"}],
                         ids=["engine", "naive_two_threads"])
def test_group_blocks_large_tensor(env):
    """Large tensors: per-thread whole groups, or chunk-parallel passes in blocks of groups."""
    import os
    import subprocess
    import sys
    from conftest import ROOT
    code = _BLOCK_CODE.format(tests=os.path.join(ROOT, "tests"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, **env))
    assert p.returncode == 0 and "BLOCKS_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
