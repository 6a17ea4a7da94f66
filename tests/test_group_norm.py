"""gn_group_norm (op level, with the fused act_type) against float64 numpy references and
finite differences; gn_moments is tested in test_moments.py."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from conftest import DTYPES, GRAD_TOL, rounded as _rounded, run_python, tol
from reference import act_ref, group_norm_bwd_ref, group_norm_ref, numeric_grad

SPATIAL = [(), (5,), (3, 4), (2, 3, 2)]
C = 8
GROUPS = [1, 4, C]


def _run_gn(x, gamma, beta, G, eps, ctx, dy=None, dmean=None, drstd=None, act=None):
    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=a.dtype) for a in (x, gamma, beta))
    for a in (xs, gs, bs):
        a.attach_grad()
    kw = {} if act is None else {"act_type": act}
    with autograd.record():
        out, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps, **kw)
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
    np.testing.assert_allclose(out.asnumpy(), ref_out, *tol(np.float16))
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy64, 4, 1e-5)
    np.testing.assert_allclose(dx.asnumpy(), rdx, *tol(np.float16, GRAD_TOL))
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
    # fp16's output tolerance for both dtypes: a float32 mean near 1000 is rounded to its ulp
    # (~6e-5), an absolute error every output inherits, beyond float32's atol of 1e-5
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_element_groups_with_eps_zero(ctx, dtype):
    """One-element groups are constant in x (x - mean = 0 for every x), so even with eps = 0
    (rstd = inf) the output is exactly beta and dx = 0 - unlike larger constant groups above."""
    x = np.random.RandomState(5).randn(4, 3).astype(dtype)
    g, b = np.array([1.5, -2.0, 0.5], dtype), np.array([0.25, -1.0, 3.0], dtype)
    out, mean, rstd, *_ = _run_gn(x, g, b, 3, 0.0, ctx)
    np.testing.assert_array_equal(out.asnumpy(), np.broadcast_to(b, x.shape))
    assert np.isinf(rstd.asnumpy()).all()
    ref, _, _ = group_norm_ref(x, g, b, 3, 0.0)
    np.testing.assert_array_equal(ref, np.broadcast_to(b.astype(np.float64), x.shape))
    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=dtype) for a in (x, g, b))
    for a in (xs, gs, bs):
        a.attach_grad()
    dy = np.random.RandomState(6).randn(*x.shape).astype(dtype)
    with autograd.record():
        y = mx.nd.gn_group_norm(xs, gs, bs, num_groups=3, eps=0.0)[0]
    y.backward(mx.nd.array(dy, ctx=ctx, dtype=dtype))
    dx, dg, db = group_norm_bwd_ref(x, g, dy, 3, 0.0)
    np.testing.assert_array_equal(xs.grad.asnumpy(), 0)
    np.testing.assert_array_equal(dx, 0)
    np.testing.assert_array_equal(gs.grad.asnumpy(), 0)
    np.testing.assert_allclose(bs.grad.asnumpy(), dy.astype(np.float64).sum(0), rtol=tol(dtype)[0])
    np.testing.assert_allclose(db, dy.astype(np.float64).sum(0))


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
    np.testing.assert_allclose(ours.asnumpy(), theirs.asnumpy(), *tol(np.float32))


def test_default_attributes(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = np.random.randn(2, 4, 3).astype(np.float32)
        out = mx.nd.gn_group_norm(mx.nd.array(x), mx.nd.ones(4), mx.nd.zeros(4))[0]
        ref, _, _ = group_norm_ref(x, np.ones(4), np.zeros(4), 1, 1e-5)
        np.testing.assert_allclose(out.asnumpy(), ref, *tol(np.float32))


# ------------------------------------------------------------------------------------------
# gn_mx.ops functional wrappers (group_norm and moments)


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


# ------------------------------------------------------------------------------------------
# Fused activation (act_type)

ACTS = ["relu", "silu"]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spatial", [(), (3, 4), (20,), (2, 3, 2)], ids=lambda s: f"{len(s)}d")
def test_fused_activation_matches_reference(ctx, act, dtype, spatial):
    """out = act(GroupNorm(x)), mean/rstd the normalization statistics; backward (incl. gradients
    into mean/rstd) through the recomputed pre-activation. Spatial 20 takes the vector loops."""
    shape, G = (3, 8) + spatial, 4
    x, x64 = _rounded(np.random.randn(*shape) * 2 + 0.5, dtype)
    gamma, g64 = _rounded(np.random.randn(8), dtype)
    beta, b64 = _rounded(np.random.randn(8), dtype)
    dy, dy64 = _rounded(np.random.randn(*shape), dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean, drstd = np.random.randn(3, G).astype(acc), np.random.randn(3, G).astype(acc)
    eps = 1e-5
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, G, eps, ctx, dy=dy, dmean=dmean,
                                                 drstd=drstd, act=act)
    ref_out, ref_mean, ref_rstd = group_norm_ref(x64, g64, b64, G, eps, act=act)
    assert out.dtype == dtype and mean.dtype == acc
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(out.asnumpy(), ref_out, rtol=rtol, atol=atol)
    stat_tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(mean.asnumpy(), ref_mean, rtol=stat_tol, atol=stat_tol)
    np.testing.assert_allclose(rstd.asnumpy(), ref_rstd, rtol=stat_tol, atol=stat_tol)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, g64, dy64, G, eps, dmean, drstd, act=act, beta=b64)
    if act == "relu" and dtype == np.float16:
        # z within fp16 rounding of 0 may fall on either side of relu's kink: skip those elements'
        # channels from the exact comparison (the op computes z in fp32 from the same inputs).
        z, _, _ = group_norm_ref(x64, g64, b64, G, eps)
        assert np.abs(z).min() > 1e-3, "test data hit relu's kink; reseed"
    rtol, atol = tol(dtype, GRAD_TOL)
    scale = max(1.0, np.abs(rdx).max())
    np.testing.assert_allclose(dx.asnumpy(), rdx, rtol=rtol, atol=atol * scale)
    np.testing.assert_allclose(dgamma.asnumpy(), rdg, rtol=rtol, atol=atol * np.abs(rdg).max())
    np.testing.assert_allclose(dbeta.asnumpy(), rdb, rtol=rtol, atol=atol * np.abs(rdb).max())


@pytest.mark.parametrize("act", ACTS)
def test_fused_activation_fp16_data_fp32_params(ctx, act):
    shape = (2, 8, 6, 6)
    x, x64 = _rounded(np.random.randn(*shape), np.float16)
    gamma = np.random.randn(8).astype(np.float32)
    beta = np.random.randn(8).astype(np.float32)
    dy, dy64 = _rounded(np.random.randn(*shape), np.float16)
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, 4, 1e-5, ctx, dy=dy, act=act)
    assert out.dtype == np.float16 and dgamma.dtype == np.float32
    ref_out, _, _ = group_norm_ref(x64, gamma, beta, 4, 1e-5, act=act)
    np.testing.assert_allclose(out.asnumpy(), ref_out, *tol(np.float16))
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy64, 4, 1e-5, act=act, beta=beta)
    np.testing.assert_allclose(dx.asnumpy(), rdx, *tol(np.float16, GRAD_TOL))
    np.testing.assert_allclose(dgamma.asnumpy(), rdg, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dbeta.asnumpy(), rdb, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("act", ACTS)
def test_fused_activation_reference_matches_finite_differences(act):
    rng = np.random.RandomState(1)
    shape, G, eps = (2, 6, 3), 3, 1e-3
    x, gamma, beta = rng.randn(*shape), rng.randn(6), rng.randn(6)
    dy, dmean, drstd = rng.randn(*shape), rng.randn(2, G), rng.randn(2, G)

    def loss(x_, g_=gamma, b_=beta):
        out, mean, rstd = group_norm_ref(x_, g_, b_, G, eps, act=act)
        return (out * dy).sum() + (mean * dmean).sum() + (rstd * drstd).sum()

    dx, dg, db = group_norm_bwd_ref(x, gamma, dy, G, eps, dmean, drstd, act=act, beta=beta)
    np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dg, numeric_grad(lambda g_: loss(x, g_=g_), gamma), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(db, numeric_grad(lambda b_: loss(x, b_=b_), beta), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("spatial", [(), (4,), (17,)], ids=lambda s: f"S{s[0] if s else 1}")
def test_fused_activation_op_matches_finite_differences(ctx, act, spatial):
    """The float64 op with act_type (all three inputs, gradients into mean/rstd) vs FD."""
    shape, G, eps = (2, 6) + spatial, 3, 1e-3
    x, gamma, beta = np.random.randn(*shape), np.random.randn(6), np.random.randn(6)
    dy, dmean, drstd = np.random.randn(*shape), np.random.randn(2, G), np.random.randn(2, G)

    def loss(x_, g_=gamma, b_=beta):
        out, mean, rstd = mx.nd.gn_group_norm(
            *(mx.nd.array(a, ctx=ctx, dtype=np.float64) for a in (x_, g_, b_)),
            num_groups=G, eps=eps, act_type=act)
        return float((out.asnumpy() * dy).sum() + (mean.asnumpy() * dmean).sum()
                     + (rstd.asnumpy() * drstd).sum())

    if act == "relu":  # finite differences across relu's kink are meaningless
        z, _, _ = group_norm_ref(x, gamma, beta, G, eps)
        assert np.abs(z).min() > 1e-4
    _, _, _, dx, dg, db = _run_gn(x, gamma, beta, G, eps, ctx, dy=dy, dmean=dmean, drstd=drstd,
                                  act=act)
    np.testing.assert_allclose(dx.asnumpy(), numeric_grad(loss, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dg.asnumpy(), numeric_grad(lambda g_: loss(x, g_=g_), gamma),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db.asnumpy(), numeric_grad(lambda b_: loss(x, b_=b_), beta),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ACTS)
def test_fused_activation_equals_composed_mxnet_ops(ctx, act):
    """The fused op against gn_group_norm followed by MXNet's own relu / x*sigmoid(x), values and
    gradients, on a shape large enough for threads and several groups."""
    shape, G = (2, 32, 24, 24), 8
    x = mx.nd.array(np.random.randn(*shape), ctx=ctx)
    g = mx.nd.array(np.random.rand(32) + 0.5, ctx=ctx)
    b = mx.nd.array(np.random.randn(32), ctx=ctx)
    dy = mx.nd.array(np.random.randn(*shape), ctx=ctx)
    res = []
    for fused in (True, False):
        for a in (x, g, b):
            a.attach_grad()
        with autograd.record():
            if fused:
                y = mx.nd.gn_group_norm(x, g, b, num_groups=G, act_type=act)[0]
            else:
                z = mx.nd.gn_group_norm(x, g, b, num_groups=G)[0]
                y = mx.nd.relu(z) if act == "relu" else z * mx.nd.sigmoid(z)
        y.backward(dy)
        res.append([a.asnumpy() for a in (y, x.grad, g.grad, b.grad)])
    for u, v in zip(*res):
        np.testing.assert_allclose(u, v, *tol(np.float32))


def test_act_type_attribute_validation(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x, g, b = mx.nd.ones((2, 4, 3)), mx.nd.ones(4), mx.nd.zeros(4)
        with pytest.raises(mx.base.MXNetError, match="act_type must be one of"):
            mx.nd.gn_group_norm(x, g, b, num_groups=2, act_type="tanh")[0].wait_to_read()
        y = mx.nd.gn_group_norm(x, g, b, num_groups=2, act_type="none")[0]
        np.testing.assert_array_equal(y.asnumpy(),
                                      mx.nd.gn_group_norm(x, g, b, num_groups=2)[0].asnumpy())
        import gn_mx
        with pytest.raises(ValueError, match="activation must be"):
            gn_mx.ops.group_norm(x, g, b, num_groups=2, act_type="gelu")
        y = gn_mx.ops.group_norm(mx.nd.array(np.random.randn(2, 4, 3)), g, b, num_groups=2,
                                 act_type="silu")
        assert y.shape == (2, 4, 3)


# ------------------------------------------------------------------------------------------
# Degenerate and extreme groups

@pytest.mark.parametrize("act", [None, "relu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("offset", [0.0, -300.0, 3e4])
def test_single_element_groups_are_exact(ctx, dtype, offset, act):
    """num_groups = C on (N, C) data: x - mean = 0, so out = act(beta) exactly and dx = 0 exactly
    (torch gives beta exactly; a rounded mean times rstd = 1/sqrt(eps) does not)."""
    x = (np.random.randn(3, 6) + offset).astype(dtype)
    gamma = np.random.randn(6).astype(dtype)
    beta = np.random.randn(6).astype(dtype)
    dy = np.random.randn(3, 6).astype(dtype)
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, 6, 1e-5, ctx, dy=dy, act=act)
    expect = np.broadcast_to(act_ref(beta.astype(np.float64), act).astype(dtype), (3, 6))
    if act == "silu":  # exact up to the rounding of exp in silu(beta) itself
        np.testing.assert_allclose(out.asnumpy(), expect, rtol=4 * np.finfo(dtype).eps, atol=0)
    else:
        np.testing.assert_array_equal(out.asnumpy(), expect)
    np.testing.assert_array_equal(dx.asnumpy(), np.zeros((3, 6), dtype))
    np.testing.assert_array_equal(dgamma.asnumpy(), np.zeros(6, dtype))
    np.testing.assert_array_equal(mean.asnumpy(), x.astype(mean.dtype))
    _, _, rdb = group_norm_bwd_ref(x, gamma, dy, 6, 1e-5, act=act, beta=beta)
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(dbeta.asnumpy(), rdb, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("M", [2, 3])
def test_tiny_groups_with_large_offsets(ctx, dtype, M):
    """Groups of 2-3 elements at |mean| >> spread: within float32 (fp16: float16) rounding of the
    float64 reference computed on the rounded input."""
    G = 4
    spread = {np.float16: 0.5, np.float32: 1e-3, np.float64: 1e-9}[dtype]
    x = (300.0 + spread * np.random.randn(5, G * M)).astype(dtype)
    # The reference works on x - 300 (exact in float64 for these values; the normalization is
    # shift-invariant): numpy's own float64 mean of values near 300 is off by ~ulp(300).
    x64 = x.astype(np.float64) - 300.0
    gamma, beta = np.random.randn(G * M).astype(dtype), np.random.randn(G * M).astype(dtype)
    dy = np.random.randn(5, G * M).astype(dtype)
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, G, 1e-5, ctx, dy=dy)
    ref, rmean, rrstd = group_norm_ref(x64, gamma, beta, G, 1e-5)
    np.testing.assert_allclose(mean.asnumpy(), rmean + 300.0, rtol=4 * np.finfo(mean.dtype).eps)
    # float32 / float16 rounding of the result (a few ulp), nothing amplified by rstd:
    ulp = {np.float16: 2e-3, np.float32: 4e-7, np.float64: 1e-12}[dtype]
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=4 * ulp, atol=4 * ulp * scale)
    np.testing.assert_allclose(rstd.asnumpy(), rrstd, rtol=4 * max(ulp, 6e-8))
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy, G, 1e-5)
    gscale = np.abs(rdx).max()
    np.testing.assert_allclose(dx.asnumpy(), rdx, rtol=16 * ulp, atol=16 * ulp * gscale)
    np.testing.assert_allclose(dgamma.asnumpy(), rdg, rtol=16 * ulp, atol=16 * ulp * np.abs(rdg).max())


@pytest.mark.parametrize("spatial", [(), (64,), (64, 64)], ids=lambda s: f"{len(s)}d")
def test_float32_near_overflow_is_normalized(ctx, spatial):
    """|x| ~ 3e38: fp32 sums of x and x^2 overflow (var = inf, rstd = 0 would output beta); those
    groups are recomputed in float64, so out is the normalized value and backward is finite.
    The last group stays ordinary (the common path)."""
    shape, G = (2, 4) + spatial, 2
    x = np.random.randn(*shape)
    x[:, :2] = x[:, :2] * 1e38 + 2e38 * np.sign(x[:, :2])
    x = np.clip(x, -3.3e38, 3.3e38).astype(np.float32)
    assert np.isfinite(x).all()
    x64 = x.astype(np.float64)
    gamma = np.random.randn(4).astype(np.float32)
    beta = np.random.randn(4).astype(np.float32)
    dy = np.random.randn(*shape).astype(np.float32)
    out, mean, rstd, dx, dgamma, dbeta = _run_gn(x, gamma, beta, G, 1e-5, ctx, dy=dy)
    ref, rmean, rrstd = group_norm_ref(x64, gamma, beta, G, 1e-5)
    np.testing.assert_allclose(out.asnumpy(), ref, *tol(np.float32))
    np.testing.assert_allclose(mean.asnumpy(), rmean, rtol=1e-5)
    np.testing.assert_allclose(rstd.asnumpy(), rrstd, rtol=1e-4)  # fp32 subnormal rstd (~3e-39)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy, G, 1e-5)
    np.testing.assert_allclose(dgamma.asnumpy(), rdg, rtol=1e-4, atol=1e-4 * np.abs(rdg).max())
    np.testing.assert_allclose(dbeta.asnumpy(), rdb, rtol=1e-4, atol=1e-4 * np.abs(rdb).max())
    # dx of the huge groups is ~1e-38 (fp32 subnormal range): compare relative to each group.
    dxn = dx.asnumpy().astype(np.float64).reshape(2, G, -1)
    rdxn = rdx.reshape(2, G, -1)
    for n in range(2):
        for g in range(G):
            s = np.abs(rdxn[n, g]).max()
            np.testing.assert_allclose(dxn[n, g], rdxn[n, g], rtol=1e-3, atol=1e-3 * s + 1e-44)


def test_threads_sharing_groups_with_activation_and_overflow():
    """Two OpenMP threads on fewer groups than threads (the cooperative path: each thread takes a
    slice of every group), with a fused activation, and a group that overflows fp32 statistics
    (recomputed by one thread while the other skips it) between ordinary ones."""
    p = run_python("""
        import os, sys
        os.environ['OMP_NUM_THREADS'] = '2'  # before libgomp loads
        import numpy as np, mxnet as mx
        from mxnet import autograd
        sys.path.insert(0, 'tests')
        import gn_mx
        from reference import group_norm_ref, group_norm_bwd_ref
        rng = np.random.RandomState(0)
        for act, big in (('silu', False), ('relu', True), (None, True)):
            x = rng.randn(1, 6, 64, 64)
            if big:
                x[:, 2:4] = x[:, 2:4] * 1e37 + 1e38
            x = x.astype(np.float32)
            g, b = rng.randn(6).astype(np.float32), rng.randn(6).astype(np.float32)
            dy = rng.randn(*x.shape).astype(np.float32)
            xs, gs, bs = mx.nd.array(x), mx.nd.array(g), mx.nd.array(b)
            for a in (xs, gs, bs):
                a.attach_grad()
            kw = {} if act is None else {'act_type': act}
            with autograd.record():
                y = mx.nd.gn_group_norm(xs, gs, bs, num_groups=3, **kw)[0]
            y.backward(mx.nd.array(dy))
            x64 = x.astype(np.float64)
            ref, _, _ = group_norm_ref(x64, g, b, 3, 1e-5, act=act)
            rdx, rdg, rdb = group_norm_bwd_ref(x64, g, dy, 3, 1e-5, act=act, beta=b)
            np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(gs.grad.asnumpy(), rdg, rtol=1e-3, atol=1e-3 * abs(rdg).max())
            np.testing.assert_allclose(bs.grad.asnumpy(), rdb, rtol=1e-3, atol=1e-3 * abs(rdb).max())
            d, r = xs.grad.asnumpy().reshape(3, -1), rdx.reshape(3, -1)
            for k in range(3):
                np.testing.assert_allclose(d[k], r[k], rtol=1e-3, atol=1e-3 * abs(r[k]).max() + 1e-44)
        print('OK')
    """)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr[-3000:]
