"""gn_channel_affine (DecorrelatedBatchNorm's fused per-channel affine) vs numpy and FD."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

from conftest import DTYPES, GRAD_TOL, tol
from reference import numeric_grad


def _ref(x, gamma, beta):
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    return x * gamma.reshape(bshape) + beta.reshape(bshape)


# (data, param) dtype pairs: same dtype, plus float32 master params with float16 data.
PAIRS = [(d, d) for d in DTYPES] + [(np.float16, np.float32)]


@pytest.mark.parametrize("dtype, pdtype", PAIRS,
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("spatial", [(), (5,), (3, 4), (2, 3, 2)], ids=lambda s: f"{len(s)}d")
def test_affine_forward_backward(ctx, dtype, pdtype, spatial):
    shape = (3, 6) + spatial
    x = np.random.randn(*shape).astype(dtype)
    g, b = np.random.randn(6).astype(pdtype), np.random.randn(6).astype(pdtype)
    dy = np.random.randn(*shape).astype(dtype)
    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=a.dtype) for a in (x, g, b))
    for a in (xs, gs, bs):
        a.attach_grad()
    with autograd.record():
        y = mx.nd.gn_channel_affine(xs, gs, bs)
    y.backward(mx.nd.array(dy, ctx=ctx, dtype=dtype))
    x64, g64, b64, dy64 = (a.astype(np.float64) for a in (x, g, b, dy))
    rtol, atol = tol(dtype)
    assert y.dtype == dtype and gs.grad.dtype == pdtype
    np.testing.assert_allclose(y.asnumpy(), _ref(x64, g64, b64), rtol=rtol, atol=atol * 4)
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), _ref(dy64, g64, 0 * b64), rtol=rtol, atol=atol)
    red = (0,) + tuple(range(2, x.ndim))
    np.testing.assert_allclose(gs.grad.asnumpy(), (dy64 * x64).sum(axis=red), rtol=rtol,
                               atol=atol * 10)
    np.testing.assert_allclose(bs.grad.asnumpy(), dy64.sum(axis=red), rtol=rtol, atol=atol * 10)


def test_affine_gradients_match_finite_differences(ctx):
    x, g, b = np.random.randn(2, 3, 4), np.random.randn(3), np.random.randn(3)
    w = np.random.randn(2, 3, 4)

    def loss(x_, g_=g, b_=b):
        y = mx.nd.gn_channel_affine(*(mx.nd.array(a, ctx=ctx, dtype=np.float64) for a in (x_, g_, b_)))
        return float((y.asnumpy() * w).sum())

    xs, gs, bs = (mx.nd.array(a, ctx=ctx, dtype=np.float64) for a in (x, g, b))
    for a in (xs, gs, bs):
        a.attach_grad()
    with autograd.record():
        y = mx.nd.gn_channel_affine(xs, gs, bs)
    y.backward(mx.nd.array(w, ctx=ctx, dtype=np.float64))
    # float64 op against float64 central differences, whose own error is ~1e-9
    np.testing.assert_allclose(xs.grad.asnumpy(), numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gs.grad.asnumpy(), numeric_grad(lambda g_: loss(x, g_=g_), g),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(bs.grad.asnumpy(), numeric_grad(lambda b_: loss(x, b_=b_), b),
                               rtol=1e-6, atol=1e-8)


def test_affine_infers_param_shapes_for_deferred_init():
    sym = mx.sym.gn_channel_affine(mx.sym.var("data"), mx.sym.var("g"), mx.sym.var("b"))
    args, outs, _ = sym.infer_shape(data=(2, 5, 3, 3))
    assert dict(zip(sym.list_arguments(), args)) == {"data": (2, 5, 3, 3), "g": (5,), "b": (5,)}
    assert outs == [(2, 5, 3, 3)]
