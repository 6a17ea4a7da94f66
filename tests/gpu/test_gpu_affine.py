"""GPU harness tests for the per-channel affine CUDA kernels (gn_channel_affine) vs float64 torch.
Same guards as test_gpu_kernels.py."""
import pytest

from gpu_common import DEV, gnh, ids, rel_err  # skips the module without torch / a device
import torch

TOL = {torch.float16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}
PAIRS = [(torch.float16, torch.float16), (torch.float32, torch.float32),
         (torch.float64, torch.float64), (torch.float16, torch.float32)]
SHAPES = [(5, 7), (2, 6, 9), (3, 4, 5, 6), (2, 3, 2, 3, 4), (2, 64, 33, 33)]


@pytest.mark.parametrize("dtype,pdtype", PAIRS, ids=ids)
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_affine(shape, dtype, pdtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    C = shape[1]
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    gamma = torch.randn(C, generator=g, dtype=torch.float64).to(pdtype).to(DEV)
    beta = torch.randn(C, generator=g, dtype=torch.float64).to(pdtype).to(DEV)
    y = gnh.affine_fwd(x, gamma, beta)
    dx, dgamma, dbeta = gnh.affine_bwd(dy, x, gamma)
    gnh.sync()
    bshape = (1, C) + (1,) * (len(shape) - 2)
    xd, dyd = x.double(), dy.double()
    gd, bd = gamma.double().reshape(bshape), beta.double().reshape(bshape)
    red = [0] + list(range(2, len(shape)))
    tol = TOL[dtype]
    assert y.dtype == dtype and dx.dtype == dtype and dgamma.dtype == pdtype
    assert rel_err(y, xd * gd + bd) < tol
    assert rel_err(dx, dyd * gd) < tol
    assert rel_err(dgamma, (dyd * xd).sum(red)) < tol
    assert rel_err(dbeta, dyd.sum(red)) < tol
