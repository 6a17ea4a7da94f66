"""gn_moments (per-group mean and variance) against float64 numpy references and finite
differences."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from conftest import DTYPES, GRAD_TOL, rounded as _rounded, tol
from reference import moments_bwd_ref, moments_ref, numeric_grad

SPATIAL = [(), (5,), (3, 4), (2, 3, 2)]
C = 8
GROUPS = [1, 4, C]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spatial", SPATIAL, ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("G", GROUPS)
def test_moments(ctx, dtype, spatial, G):
    shape = (3, C) + spatial
    x, x64 = _rounded(np.random.randn(*shape) * 3 - 2, dtype)
    xs = mx.nd.array(x, ctx=ctx, dtype=dtype)
    xs.attach_grad()
    with autograd.record():
        mean, var = mx.nd.gn_moments(xs, num_groups=G)
    acc = np.float64 if dtype == np.float64 else np.float32
    assert mean.dtype == acc and var.dtype == acc and mean.shape == (3, G)
    rm, rv = moments_ref(x64, G)
    # The statistics are outputs in the accumulation dtype (float32 for fp16 data too), so their
    # tolerance is the accumulator's, not the data dtype's.
    t = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(mean.asnumpy(), rm, rtol=t, atol=t)
    np.testing.assert_allclose(var.asnumpy(), rv, rtol=t, atol=t)

    dmean, dvar = np.random.randn(3, G), np.random.randn(3, G)
    autograd.backward([mean, var], [mx.nd.array(dmean, ctx=ctx, dtype=acc),
                                    mx.nd.array(dvar, ctx=ctx, dtype=acc)])
    rdx = moments_bwd_ref(x64, G, dmean.astype(acc), dvar.astype(acc))
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), rdx, rtol=rtol, atol=atol * np.abs(rdx).max())


def test_moments_gradient_matches_finite_differences(ctx):
    x = np.random.randn(2, 4, 3)
    dmean, dvar = np.random.randn(2, 2), np.random.randn(2, 2)

    def loss(x_):
        m, v = mx.nd.gn_moments(mx.nd.array(x_, ctx=ctx, dtype=np.float64), num_groups=2)
        return float((m.asnumpy() * dmean).sum() + (v.asnumpy() * dvar).sum())

    # float64 central differences: truncation/rounding error ~1e-8 relative
    np.testing.assert_allclose(moments_bwd_ref(x, 2, dmean, dvar), numeric_grad(loss, x),
                               rtol=1e-6, atol=1e-8)
