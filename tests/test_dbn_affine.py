"""The per-channel affine fused into gn_dbn / gn_dbn_inference (attribute affine=True).

Against the float64 references of tests/reference.py (y = gamma * dbn + beta, dx = the DBN
backward of gamma * dy, dgamma = sum(dy * xhat), dbeta = sum(dy)), against the unfused graph
(gn_dbn + gn_channel_affine, which old exported models hold), and against finite differences.
Old exports (no ``affine`` attribute, gn_channel_affine after the op) still load and run.
"""
import json

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import gn_mx  # noqa: F401
from conftest import DTYPES, GRAD_TOL, dbn_data, reload_outputs, tol
from reference import dbn_bwd_ref, dbn_inference_ref, dbn_ref, numeric_grad

EPS = 1e-3
SHAPES = {0: (48, 8), 1: (6, 8, 7), 2: (3, 8, 4, 3), 3: (2, 8, 3, 2, 3)}


def _stats(C, G, dtype):
    return (mx.nd.zeros((C,), dtype=dtype),
            mx.nd.array(np.tile(np.eye(C // G), (G, 1, 1)), dtype=dtype))


def _params(C, pdtype):
    gamma = (0.5 + np.random.rand(C)).astype(pdtype)
    gamma[1] = 0.0  # a dead channel: its output is beta, its gradient still flows to gamma
    beta = np.random.randn(C).astype(pdtype)
    return gamma, beta


def _channel(v, ndim):
    return np.asarray(v, np.float64).reshape((1, -1) + (1,) * (ndim - 2))


def _train(x, gamma, beta, dy, G, dtype, pdtype, fused):
    """One gn_dbn training call and its backward: (y, dx, dgamma, dbeta, running proj, mean)."""
    C = x.shape[1]
    rm, rp = _stats(C, G, np.float32 if dtype == np.float16 else dtype)
    xs = mx.nd.array(x, dtype=dtype)
    g = mx.nd.array(gamma, dtype=pdtype)
    b = mx.nd.array(beta, dtype=pdtype)
    for a in (xs, g, b):
        a.attach_grad()
    with autograd.record():
        if fused:
            y = mx.nd.gn_dbn(xs, g, b, rm, rp, num_groups=G, eps=EPS, affine=True)[0]
        else:
            y = mx.nd.gn_channel_affine(mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=EPS)[0], g, b)
    y.backward(mx.nd.array(dy, dtype=dtype))
    return (y.asnumpy(), xs.grad.asnumpy(), g.grad.asnumpy(), b.grad.asnumpy(), rp.asnumpy(),
            rm.asnumpy())


def _param_dtypes():
    return [(np.float16, np.float32), (np.float16, np.float16), (np.float32, np.float32),
            (np.float64, np.float64)]


@pytest.mark.parametrize("dtype,pdtype", _param_dtypes(),
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
@pytest.mark.parametrize("G", [1, 2])
def test_fused_training_vs_reference(dtype, pdtype, rank, G):
    shape = SHAPES[rank]
    x = dbn_data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    gamma, beta = _params(shape[1], pdtype)
    y, dx, dg, db, rp, _ = _train(x, gamma, beta, dy, G, dtype, pdtype, fused=True)
    assert y.dtype == dtype and dx.dtype == dtype and dg.dtype == pdtype and db.dtype == pdtype

    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    g64, b64 = _channel(gamma, x.ndim), _channel(beta, x.ndim)
    xhat, _, W = dbn_ref(x64, G, EPS)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(y, g64 * xhat + b64, rtol=rtol, atol=atol * 10)
    axes = tuple(i for i in range(x.ndim) if i != 1)
    grtol, gatol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(dx, dbn_bwd_ref(x64, g64 * dy64, G, EPS), rtol=grtol,
                               atol=gatol * 5)
    m = x.size // x.shape[1]
    np.testing.assert_allclose(dg, (dy64 * xhat).sum(axis=axes), rtol=grtol, atol=gatol * m)
    np.testing.assert_allclose(db, dy64.sum(axis=axes), rtol=grtol, atol=gatol * m)
    # the running projection is the whitening's alone (gamma does not leak into it)
    np.testing.assert_allclose(rp, 0.9 * np.eye(shape[1] // G) + 0.1 * W, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype,pdtype", _param_dtypes(), ids=lambda d: np.dtype(d).name)
def test_fused_equals_unfused(dtype, pdtype):
    """The fused op against the graph old exports hold (gn_dbn + gn_channel_affine)."""
    shape = (5, 8, 6, 4)
    x = dbn_data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    gamma, beta = _params(8, pdtype)
    fused = _train(x, gamma, beta, dy, 2, dtype, pdtype, True)
    unfused = _train(x, gamma, beta, dy, 2, dtype, pdtype, False)
    rtol, atol = tol(dtype, GRAD_TOL)
    for name, a, b in zip(("y", "dx", "dgamma", "dbeta", "running_proj", "running_mean"),
                          fused, unfused):
        scale = max(1.0, float(np.abs(b.astype(np.float64)).max()))
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=rtol,
                                   atol=atol * scale, err_msg=name)
    # float64: the same to rounding
    if dtype == np.float64:
        np.testing.assert_allclose(fused[0], unfused[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(fused[1], unfused[1], rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("rank", [0, 2])
def test_fused_training_finite_differences(rank):
    shape = {0: (12, 4), 2: (2, 4, 3, 2)}[rank]
    G = 2
    x = dbn_data(shape, np.float64)
    dy = np.random.randn(*shape)
    gamma, beta = _params(shape[1], np.float64)
    C = shape[1]

    def f(xv, gv, bv):
        rm, rp = _stats(C, G, np.float64)
        y = mx.nd.gn_dbn(mx.nd.array(xv, dtype=np.float64), mx.nd.array(gv, dtype=np.float64),
                         mx.nd.array(bv, dtype=np.float64), rm, rp, num_groups=G, eps=EPS,
                         affine=True)[0]
        return float((y.asnumpy() * dy).sum())

    _, dx, dg, db, _, _ = _train(x, gamma, beta, dy, G, np.float64, np.float64, True)
    np.testing.assert_allclose(dx, numeric_grad(lambda z: f(z, gamma, beta), x), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(dg, numeric_grad(lambda z: f(x, z, beta), gamma), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(db, numeric_grad(lambda z: f(x, gamma, z), beta), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype,pdtype", _param_dtypes(), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank", [0, 2])
def test_fused_inference_vs_reference(dtype, pdtype, rank):
    shape = SHAPES[rank]
    C, G = shape[1], 2
    D = C // G
    sdt = np.float32 if dtype == np.float16 else dtype
    x = dbn_data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    gamma, beta = _params(C, pdtype)
    rmean = (0.3 * np.random.randn(C)).astype(sdt)
    A = np.random.randn(G, D, D) * 0.3
    rproj = (np.eye(D) + A @ A.transpose(0, 2, 1)).astype(sdt)
    xs = mx.nd.array(x, dtype=dtype)
    g = mx.nd.array(gamma, dtype=pdtype)
    b = mx.nd.array(beta, dtype=pdtype)
    for a in (xs, g, b):
        a.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn_inference(xs, g, b, mx.nd.array(rmean, dtype=sdt),
                                   mx.nd.array(rproj, dtype=sdt), num_groups=G, affine=True)
    y.backward(mx.nd.array(dy, dtype=dtype))
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    g64, b64 = _channel(gamma, x.ndim), _channel(beta, x.ndim)
    xhat = dbn_inference_ref(x64, rmean, rproj, G)
    rtol, atol = tol(dtype)
    scale = float(np.abs(xhat).max())
    np.testing.assert_allclose(y.asnumpy(), g64 * xhat + b64, rtol=rtol, atol=atol * scale)
    # dx = P^T (gamma dy), per group
    ref_dx = dbn_inference_ref(g64 * dy64, np.zeros(C), rproj.transpose(0, 2, 1), G)
    grtol, gatol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), ref_dx, rtol=grtol, atol=gatol * scale)
    axes = tuple(i for i in range(x.ndim) if i != 1)
    m = x.size // C
    np.testing.assert_allclose(g.grad.asnumpy(), (dy64 * xhat).sum(axis=axes), rtol=grtol,
                               atol=gatol * m * scale)
    np.testing.assert_allclose(b.grad.asnumpy(), dy64.sum(axis=axes), rtol=grtol, atol=gatol * m)


def test_block_uses_the_fused_op_and_matches_reference():
    """DecorrelatedBatchNorm's graph: one gn_dbn / gn_dbn_inference with affine, no
    gn_channel_affine; outputs as the reference with the block's gamma/beta."""
    net = gn_mx.nn.DecorrelatedBatchNorm(num_groups=2, epsilon=EPS, in_channels=8)
    net.initialize()
    net.gamma.set_data(mx.nd.array(0.5 + np.random.rand(8)))
    net.beta.set_data(mx.nd.array(np.random.randn(8)))
    net.hybridize()
    x = dbn_data((6, 8, 3, 3), np.float32)
    with autograd.record():
        y = net(mx.nd.array(x))
    xhat, _, _ = dbn_ref(x.astype(np.float64), 2, EPS)
    g, b = _channel(net.gamma.data().asnumpy(), 4), _channel(net.beta.data().asnumpy(), 4)
    np.testing.assert_allclose(y.asnumpy(), g * xhat + b, rtol=1e-4, atol=1e-4)
    ops = [n["op"] for n in json.loads(net(mx.sym.var("data")).tojson())["nodes"]]
    assert "gn_channel_affine" not in ops and ops.count("gn_dbn_inference") == 1


def test_old_export_loads_and_matches(tmp_path):
    """A model exported with the op graph used before the fused affine (gn_dbn_inference without
    the affine attribute, then gn_channel_affine) loads in a fresh process and gives the output of
    today's block with the same parameters, bit for bit at float64."""
    C, G = 8, 2
    D = C // G
    data = mx.sym.var("data")
    gamma, beta = mx.sym.var("dbn0_gamma"), mx.sym.var("dbn0_beta")
    rm, rp = mx.sym.var("dbn0_running_mean"), mx.sym.var("dbn0_running_projection")
    old = mx.sym.gn_channel_affine(
        mx.sym.gn_dbn_inference(data, rm, rp, num_groups=G, name="dbn0_whiten"), gamma, beta,
        name="dbn0")
    sym_file = str(tmp_path / "old-symbol.json")
    old.save(sym_file)
    nodes = json.loads(open(sym_file).read())["nodes"]
    assert all("affine" not in n.get("attrs", {}) for n in nodes)
    A = np.random.randn(G, D, D) * 0.3
    params = {"arg:dbn0_gamma": mx.nd.array(0.5 + np.random.rand(C), dtype=np.float64),
              "arg:dbn0_beta": mx.nd.array(np.random.randn(C), dtype=np.float64),
              "aux:dbn0_running_mean": mx.nd.array(np.random.randn(C), dtype=np.float64),
              "aux:dbn0_running_projection": mx.nd.array(np.eye(D) + A @ A.transpose(0, 2, 1),
                                                         dtype=np.float64)}
    mx.nd.save(str(tmp_path / "old-0000.params"), params)
    x = np.random.randn(4, C, 5).astype(np.float64)
    y_old = reload_outputs(str(tmp_path / "old"), [x], after_load="net.cast('float64')")[0]
    ref = (_channel(params["arg:dbn0_gamma"].asnumpy(), 3)
           * dbn_inference_ref(x, params["aux:dbn0_running_mean"].asnumpy(),
                               params["aux:dbn0_running_projection"].asnumpy(), G)
           + _channel(params["arg:dbn0_beta"].asnumpy(), 3))
    np.testing.assert_allclose(y_old, ref, rtol=1e-12, atol=1e-12)
    net = gn_mx.nn.DecorrelatedBatchNorm(num_groups=G, in_channels=C, prefix="dbn0_")
    net.initialize()
    net.cast("float64")
    for k, v in params.items():
        getattr(net, k.split("dbn0_")[1]).set_data(v)
    np.testing.assert_allclose(net(mx.nd.array(x, dtype=np.float64)).asnumpy(), y_old,
                               rtol=1e-13, atol=1e-13)


def test_affine_attribute_errors():
    x = mx.nd.ones((4, 4))
    rm, rp = _stats(4, 1, np.float32)
    g, b = mx.nd.ones((4,)), mx.nd.zeros((4,))
    with pytest.raises(mx.base.MXNetError, match="attribute affine must be True or False"):
        mx.nd.gn_dbn(x, g, b, rm, rp, affine="maybe")[0].wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="gamma must have shape"):
        mx.nd.gn_dbn(x, mx.nd.ones((3,)), b, rm, rp, affine=True)[0].wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="beta dtype must equal the data dtype"):
        mx.nd.gn_dbn_inference(x, g, b.astype("float64"), rm, rp, affine=True).wait_to_read()
