"""eps reaches the math in every dtype and on every CPU path: data whose variance is of the order of
eps, so dropping (or mis-scaling) eps moves the result far outside the tolerance. Each test first
checks on the float64 references that eps matters by a wide margin (a test that cannot fail is a
defect), then compares the op with the reference that uses eps.

Paths of gn_group_norm's CPU kernel (src/operator/kernels/group_norm_cpu.cc): spatial size
S >= kSmallS (16) the streamed primitives, S < 16 the buffered path, groups of <= 4 elements the
exact float64 recomputation (forward and backward). The cooperative schedule (threads sharing
groups) is tested in test_cooperative_schedule.py, which needs its own process.
"""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from conftest import DTYPES, GRAD_TOL, dbn_data, rounded, tol
from reference import dbn_bwd_ref, dbn_ref, group_norm_bwd_ref, group_norm_ref

CPU = mx.cpu()
# shape, num_groups: the three paths of the kernel
PATHS = {
    "streamed": ((2, 4, 32), 2),    # S = 32
    "buffered": ((2, 8, 3), 4),     # S = 3 < kSmallS
    "exact": ((3, 4), 2),           # groups of M = 2 elements
}


def _assert_eps_matters(with_eps, without_eps, margin):
    """The references with and without eps differ by more than `margin` (relative to their size)."""
    diff = np.abs(with_eps - without_eps).max()
    assert diff > margin * np.abs(with_eps).max(), (diff, margin)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_group_norm_eps_matters(ctx, dtype, path, eps):
    """Variance ~ eps: rstd with eps is ~0.7x rstd without. Forward, and backward with gradients
    into out, mean and rstd (the rstd gradient carries eps through d rstd / d var)."""
    shape, G = PATHS[path]
    C = shape[1]
    x, x64 = rounded(np.random.randn(*shape) * np.sqrt(eps), dtype)
    gamma, g64 = rounded(np.random.rand(C) + 0.5, dtype)
    beta, b64 = rounded(np.random.randn(C), dtype)
    dy, dy64 = rounded(np.random.randn(*shape), dtype)
    N = shape[0]
    dmean, drstd = np.random.randn(N, G), np.random.randn(N, G) * eps  # d rstd ~ 1/sqrt(eps)^3

    ref, rmean, rrstd = group_norm_ref(x64, g64, b64, G, eps)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, g64, dy64, G, eps, dmean=dmean, drstd=drstd)
    ref0, _, rrstd0 = group_norm_ref(x64, g64, b64, G, 0.0)
    rdx0, rdg0, _ = group_norm_bwd_ref(x64, g64, dy64, G, 0.0, dmean=dmean, drstd=drstd)
    _assert_eps_matters(ref - b64.reshape((1, C) + (1,) * (len(shape) - 2)),
                        ref0 - b64.reshape((1, C) + (1,) * (len(shape) - 2)), 0.1)
    _assert_eps_matters(rrstd, rrstd0, 0.1)
    _assert_eps_matters(rdx, rdx0, 0.1)

    acc = np.float64 if dtype == np.float64 else np.float32
    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=dtype) for a in (x, gamma, beta))
    for a in (xs, gs, bs):
        a.attach_grad()
    with autograd.record():
        out, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps)
    autograd.backward([out, mean, rstd],
                      [mx.nd.array(dy, ctx=ctx, dtype=dtype), mx.nd.array(dmean, ctx=ctx, dtype=acc),
                       mx.nd.array(drstd, ctx=ctx, dtype=acc)])
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=rtol, atol=atol * np.abs(ref).max())
    stat_tol = 1e-10 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(rstd.asnumpy(), rrstd, rtol=stat_tol)
    np.testing.assert_allclose(mean.asnumpy(), rmean, rtol=stat_tol, atol=stat_tol * np.sqrt(eps))
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), rdx, rtol=rtol, atol=atol * np.abs(rdx).max())
    np.testing.assert_allclose(gs.grad.asnumpy(), rdg, rtol=rtol, atol=atol * np.abs(rdg).max())
    np.testing.assert_allclose(bs.grad.asnumpy(), rdb, rtol=rtol, atol=atol * np.abs(rdb).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_constant_groups_every_dtype(ctx, dtype, path):
    """A constant group has var = 0: rstd = 1/sqrt(eps) exactly as the formula says, out = beta,
    and the backward of the reference formula (x - mean = 0), in every dtype and on every path."""
    shape, G = PATHS[path]
    C, N, eps = shape[1], shape[0], 1e-3
    x = np.full(shape, 7.0, dtype)
    beta, b64 = rounded(np.random.randn(C), dtype)
    gamma, g64 = rounded(np.random.rand(C) + 0.5, dtype)
    dy, dy64 = rounded(np.random.randn(*shape), dtype)
    dmean = np.random.randn(N, G)
    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=dtype) for a in (x, gamma, beta))
    xs.attach_grad()
    acc = np.float64 if dtype == np.float64 else np.float32
    with autograd.record():
        out, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps)
    autograd.backward([out, mean], [mx.nd.array(dy, ctx=ctx, dtype=dtype),
                                    mx.nd.array(dmean, ctx=ctx, dtype=acc)])
    np.testing.assert_allclose(rstd.asnumpy(), 1 / np.sqrt(eps), rtol=1e-6)
    np.testing.assert_allclose(mean.asnumpy(), 7.0, rtol=1e-7)
    np.testing.assert_allclose(out.asnumpy(), np.broadcast_to(
        b64.reshape((1, C) + (1,) * (len(shape) - 2)), shape), *tol(dtype))
    rdx, _, _ = group_norm_bwd_ref(x.astype(np.float64), g64, dy64, G, eps, dmean=dmean)
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), rdx, rtol=rtol, atol=atol * np.abs(rdx).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_dbn_eps_matters(dtype):
    """gn_dbn with covariance eigenvalues ~ eps: forward, the running projection's update and the
    backward all follow Sigma + eps I, in every dtype (float16 data: statistics in float32)."""
    eps, G, shape = 1e-3, 2, (16, 6, 5)
    x, x64 = rounded(dbn_data(shape, np.float64, offset=0.0) * np.sqrt(eps), dtype)
    dy, dy64 = rounded(np.random.randn(*shape), dtype)
    ref, _, W = dbn_ref(x64, G, eps)
    ref0, _, W0 = dbn_ref(x64, G, 1e-12)
    rdx = dbn_bwd_ref(x64, dy64, G, eps)
    _assert_eps_matters(ref, ref0, 0.1)
    _assert_eps_matters(rdx, dbn_bwd_ref(x64, dy64, G, 1e-12), 0.1)

    D = shape[1] // G
    rm = mx.nd.zeros((shape[1],), dtype=dtype)
    rp = mx.nd.array(np.tile(np.eye(D), (G, 1, 1)), dtype=dtype)
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=eps, momentum=0.0)[0]
    y.backward(mx.nd.array(dy, dtype=dtype))
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(y.asnumpy(), ref, rtol=rtol, atol=atol)
    # momentum 0: the running projection is the batch's Sigma^{-1/2} (entries ~ 1/sqrt(eps))
    np.testing.assert_allclose(rp.asnumpy(), W, rtol=rtol, atol=atol * np.abs(W).max())
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), rdx, rtol=rtol, atol=atol * np.abs(rdx).max())
