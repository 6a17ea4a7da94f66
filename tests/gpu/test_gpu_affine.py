"""GPU harness tests for the per-channel affine CUDA kernels (gn_channel_affine) vs float64 numpy.
numpy-driven like test_gpu_kernels.py (GPU, emulator or GPGPU-Sim)."""
import numpy as np
import pytest

from gpu_common import hnp, ids, rel_err, rng  # skips without g++ (emulator)

TOL = {np.float16: 1e-2, np.float32: 1e-5, np.float64: 1e-12}
PAIRS = [(np.float16, np.float16), (np.float32, np.float32), (np.float64, np.float64),
         (np.float16, np.float32)]
SHAPES = [(5, 7), (2, 6, 9), (3, 4, 5, 6), (2, 3, 2, 3, 4), (2, 64, 33, 33)]


@pytest.mark.parametrize("dtype,pdtype", PAIRS, ids=ids)
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_affine(shape, dtype, pdtype):
    r = rng(0)
    C = shape[1]
    x = r.standard_normal(shape).astype(dtype)
    dy = r.standard_normal(shape).astype(dtype)
    gamma = r.standard_normal(C).astype(pdtype)
    beta = r.standard_normal(C).astype(pdtype)
    y = hnp.affine_fwd(x, gamma, beta)
    dx, dgamma, dbeta = hnp.affine_bwd(dy, x, gamma)
    bshape = (1, C) + (1,) * (len(shape) - 2)
    xd, dyd = x.astype(np.float64), dy.astype(np.float64)
    gd, bd = gamma.astype(np.float64).reshape(bshape), beta.astype(np.float64).reshape(bshape)
    red = (0,) + tuple(range(2, len(shape)))
    tol = TOL[dtype]
    assert y.dtype == dtype and dx.dtype == dtype and dgamma.dtype == pdtype
    assert rel_err(y, xd * gd + bd) < tol
    assert rel_err(dx, dyd * gd) < tol
    assert rel_err(dgamma, (dyd * xd).sum(red)) < tol
    assert rel_err(dbeta, dyd.sum(red)) < tol
