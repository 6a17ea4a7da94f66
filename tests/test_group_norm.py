"""gn_group_norm and gn_moments against float64 numpy references and finite differences."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from conftest import DTYPES, GRAD_TOL, tol
from reference import (group_norm_bwd_ref, group_norm_ref, moments_bwd_ref, moments_ref,
                       numeric_grad)

SPATIAL = [(), (5,), (3, 4), (2, 3, 2)]
C = 8
GROUPS = [1, 4, C]


def _rounded(a, dtype):
    """The array as the op sees it (rounded to dtype) and as float64 for the reference."""
    r = np.asarray(a).astype(dtype)
    return r, r.astype(np.float64)


def _run_gn(x, gamma, beta, G, eps, ctx, dy=None, dmean=None, drstd=None):
    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=a.dtype) for a in (x, gamma, beta))
    for a in (xs, gs, bs):
        a.attach_grad()
    with autograd.record():
        out, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps)
    if dy is not None:
        heads = [out]
        grads = [mx.nd.array(dy, ctx=ctx, dtype=dy.dtype)]
        if dmean is not None:
            heads += [mean, rstd]
            grads += [mx.nd.array(dmean, ctx=ctx, dtype=mean.dtype),
                      mx.nd.array(drstd, ctx=ctx, dtype=rstd.dtype)]
        autograd.backward(heads, grads)
    return out, mean, rstd, xs.grad, gs.grad, bs.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spatial", SPATIAL, ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("G", GROUPS)
def test_forward_backward_matches_reference(ctx, dtype, spatial, G):
    shape = (3, C) + spatial
    x, x64 = _rounded(np.random.randn(*shape) * 2 + 0.5, dtype)
    gamma, g64 = _rounded(np.random.randn(C), dtype)
    beta, b64 = _rounded(np.random.randn(C), dtype)
    dy, dy64 = _rounded(np.random.randn(*shape), dtype)
    eps = 1e-5
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, G, eps, ctx, dy=dy)

    ref_out, ref_mean, ref_rstd = group_norm_ref(x64, g64, b64, G, eps)
    acc = np.float64 if dtype == np.float64 else np.float32
    assert out.dtype == dtype and out.shape == shape
    assert mean.dtype == acc and rstd.dtype == acc and mean.shape == (3, G)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(out.asnumpy(), ref_out, rtol=rtol, atol=atol)
    stat_tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(mean.asnumpy(), ref_mean, rtol=stat_tol, atol=stat_tol)
    np.testing.assert_allclose(rstd.asnumpy(), ref_rstd, rtol=stat_tol, atol=stat_tol)

    rdx, rdg, rdb = group_norm_bwd_ref(x64, g64, dy64, G, eps)
    rtol, atol = tol(dtype, GRAD_TOL)
    # dx sums terms of size rstd*|gamma*dy| that cancel exactly for 1-element groups (G = C, no
    # spatial dims: rstd = 1/sqrt(eps)); rounding error scales with those terms, not with dx.
    scale = max(1.0, np.abs(rdx).max(), ref_rstd.max() * np.abs(g64).max() * np.abs(dy64).max())
    np.testing.assert_allclose(dx.asnumpy(), rdx, rtol=rtol, atol=atol * scale)
    np.testing.assert_allclose(dgamma.asnumpy(), rdg, rtol=rtol, atol=atol * np.abs(rdg).max())
    np.testing.assert_allclose(dbeta.asnumpy(), rdb, rtol=rtol, atol=atol * np.abs(rdb).max())


def test_fp16_data_with_fp32_params(ctx):
    shape = (2, 8, 6, 6)
    x, x64 = _rounded(np.random.randn(*shape), np.float16)
    gamma = np.random.randn(8).astype(np.float32)
    beta = np.random.randn(8).astype(np.float32)
    dy, dy64 = _rounded(np.random.randn(*shape), np.float16)
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, 4, 1e-5, ctx, dy=dy)
    assert out.dtype == np.float16 and dgamma.dtype == np.float32 and mean.dtype == np.float32
    ref_out, _, _ = group_norm_ref(x64, gamma, beta, 4, 1e-5)
    np.testing.assert_allclose(out.asnumpy(), ref_out, rtol=5e-3, atol=5e-3)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy64, 4, 1e-5)
    np.testing.assert_allclose(dx.asnumpy(), rdx, rtol=2e-2, atol=2e-2)
    # dgamma/dbeta are reduced in fp32 and stored in fp32: much tighter than fp16 storage.
    np.testing.assert_allclose(dgamma.asnumpy(), rdg, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dbeta.asnumpy(), rdb, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
def test_large_offset_is_stable(ctx, dtype):
    """x = 1000 + unit noise: E[x^2]-E[x]^2 would lose every digit in fp32."""
    shape = (2, 16, 32, 32)
    x, x64 = _rounded(1000 + np.random.randn(*shape), dtype)
    ones, zeros = np.ones(16, dtype), np.zeros(16, dtype)
    out, mean, rstd, *_ = _run_gn(x, ones, zeros, 4, 1e-5, ctx)
    ref_out, ref_mean, ref_rstd = group_norm_ref(x64, ones, zeros, 4, 1e-5)
    np.testing.assert_allclose(rstd.asnumpy(), ref_rstd, rtol=1e-4)
    np.testing.assert_allclose(out.asnumpy(), ref_out, rtol=5e-3, atol=5e-3)
    o = out.asnumpy().astype(np.float64).reshape(2, 4, -1)
    np.testing.assert_allclose(o.mean(axis=2), 0, atol=1e-3)
    np.testing.assert_allclose(o.var(axis=2), 1, atol=5e-3)


def test_fp16_large_groups_where_builtin_fails(ctx):
    """Groups of 64k fp16 elements: fp16 accumulation would overflow; fp32 accumulation does not."""
    shape = (2, 64, 64, 64)      # 8 groups of 16*4096 = 65536 elements
    x, x64 = _rounded(np.random.randn(*shape) * 3 + 5, np.float16)
    gamma, g64 = _rounded(np.random.rand(64) + 0.5, np.float16)
    beta, b64 = _rounded(np.random.randn(64), np.float16)
    out, mean, rstd, *_ = _run_gn(x, gamma, beta, 4, 1e-5, ctx)
    ref_out, ref_mean, ref_rstd = group_norm_ref(x64, g64, b64, 4, 1e-5)
    assert np.isfinite(out.asnumpy()).all()
    np.testing.assert_allclose(mean.asnumpy(), ref_mean, rtol=1e-5)
    np.testing.assert_allclose(rstd.asnumpy(), ref_rstd, rtol=1e-5)
    np.testing.assert_allclose(out.asnumpy(), ref_out, rtol=5e-3, atol=1e-2)


def test_constant_group_is_finite(ctx):
    x = np.full((2, 4, 3, 3), 7.0, np.float32)
    out, mean, rstd, *_ = _run_gn(x, np.ones(4, np.float32), np.full(4, 0.5, np.float32), 2, 1e-5, ctx)
    np.testing.assert_allclose(out.asnumpy(), 0.5, atol=1e-6)
    np.testing.assert_allclose(rstd.asnumpy(), 1 / np.sqrt(1e-5), rtol=1e-5)
    # eps = 0 with a constant group is 0 * inf: the reference formula gives nan, so does the op.
    out0, *_ = _run_gn(x, np.ones(4, np.float32), np.zeros(4, np.float32), 2, 0.0, ctx)
    assert np.isnan(out0.asnumpy()).all()


def test_backward_reference_matches_finite_differences():
    """The numpy backward reference itself, including gradients into mean and rstd."""
    rng = np.random.RandomState(0)
    shape, G, eps = (2, 6, 3), 3, 1e-3
    x = rng.randn(*shape)
    gamma, beta = rng.randn(6), rng.randn(6)
    dy, dmean, drstd = rng.randn(*shape), rng.randn(2, G), rng.randn(2, G)

    def loss(x_, g_=gamma, b_=beta):
        out, mean, rstd = group_norm_ref(x_, g_, b_, G, eps)
        return (out * dy).sum() + (mean * dmean).sum() + (rstd * drstd).sum()

    dx, dg, db = group_norm_bwd_ref(x, gamma, dy, G, eps, dmean, drstd)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dg, numeric_grad(lambda g_: loss(x, g_=g_), gamma), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(db, numeric_grad(lambda b_: loss(x, b_=b_), beta), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spatial", [(), (4,), (2, 3)], ids=lambda s: f"{len(s)}d")
def test_op_gradients_match_finite_differences(ctx, spatial):
    """The float64 op itself (all three inputs, and gradients flowing into mean/rstd) vs FD."""
    shape, G, eps = (2, 6) + spatial, 3, 1e-3
    x, gamma, beta = np.random.randn(*shape), np.random.randn(6), np.random.randn(6)
    dy, dmean, drstd = np.random.randn(*shape), np.random.randn(2, G), np.random.randn(2, G)

    def loss(x_, g_=gamma, b_=beta):
        out, mean, rstd = mx.nd.gn_group_norm(mx.nd.array(x_, ctx=ctx, dtype=np.float64),
                                              mx.nd.array(g_, ctx=ctx, dtype=np.float64),
                                              mx.nd.array(b_, ctx=ctx, dtype=np.float64),
                                              num_groups=G, eps=eps)
        return float((out.asnumpy() * dy).sum() + (mean.asnumpy() * dmean).sum()
                     + (rstd.asnumpy() * drstd).sum())

    _, _, _, dx, dg, db = _run_gn(x, gamma, beta, G, eps, ctx, dy=dy, dmean=dmean, drstd=drstd)
    np.testing.assert_allclose(dx.asnumpy(), numeric_grad(loss, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dg.asnumpy(), numeric_grad(lambda g_: loss(x, g_=g_), gamma),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db.asnumpy(), numeric_grad(lambda b_: loss(x, b_=b_), beta),
                               rtol=1e-5, atol=1e-6)


def test_matches_builtin_groupnorm_with_groupwise_affine(ctx):
    """mx.nd.GroupNorm has per-group gamma/beta; with per-channel params constant within each
    group the two ops must agree."""
    G, shape = 4, (2, 8, 5, 5)
    x = np.random.randn(*shape).astype(np.float32)
    gg, bg = np.random.randn(G).astype(np.float32), np.random.randn(G).astype(np.float32)
    gamma, beta = np.repeat(gg, 8 // G), np.repeat(bg, 8 // G)
    ours = mx.nd.gn_group_norm(mx.nd.array(x, ctx=ctx), mx.nd.array(gamma, ctx=ctx),
                               mx.nd.array(beta, ctx=ctx), num_groups=G, eps=1e-5)[0]
    theirs = mx.nd.GroupNorm(mx.nd.array(x, ctx=ctx), mx.nd.array(gg, ctx=ctx),
                             mx.nd.array(bg, ctx=ctx), num_groups=G, eps=1e-5)
    np.testing.assert_allclose(ours.asnumpy(), theirs.asnumpy(), rtol=1e-4, atol=1e-5)


def test_default_attributes():
    x = np.random.randn(2, 4, 3).astype(np.float32)
    out = mx.nd.gn_group_norm(mx.nd.array(x), mx.nd.ones(4), mx.nd.zeros(4))[0]
    ref, _, _ = group_norm_ref(x, np.ones(4), np.zeros(4), 1, 1e-5)
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------
# gn_moments

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

    np.testing.assert_allclose(moments_bwd_ref(x, 2, dmean, dvar), numeric_grad(loss, x),
                               rtol=1e-6, atol=1e-8)


def test_moments_large_offset_fp16(ctx):
    x, x64 = _rounded(1000 + np.random.randn(2, 8, 64, 64), np.float16)
    mean, var = mx.nd.gn_moments(mx.nd.array(x, ctx=ctx, dtype=np.float16), num_groups=2)
    rm, rv = moments_ref(x64, 2)
    np.testing.assert_allclose(mean.asnumpy(), rm, rtol=1e-6)
    np.testing.assert_allclose(var.asnumpy(), rv, rtol=1e-4)


def test_functional_wrappers(ctx):
    import gn_mx
    x = mx.nd.array(np.random.randn(2, 4, 3), ctx=ctx)
    m, v = gn_mx.ops.moments(x, num_groups=2)
    out, mean, rstd = gn_mx.ops.group_norm(x, mx.nd.ones(4, ctx=ctx), mx.nd.zeros(4, ctx=ctx),
                                           num_groups=2, return_stats=True)
    np.testing.assert_allclose(mean.asnumpy(), m.asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(rstd.asnumpy(), 1 / np.sqrt(v.asnumpy() + 1e-5), rtol=1e-5)
    s = gn_mx.ops.group_norm(mx.sym.var("x"), mx.sym.var("g"), mx.sym.var("b"), num_groups=2)
    assert s.list_outputs() == [s.name + "_output0"] or len(s.list_outputs()) == 1
