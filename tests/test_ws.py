"""Weight Standardization: gn_weight_standardize and gn_mx.WSConv1D/2D/3D against float64 numpy
references (standardize, then convolve; gradients through the standardization by central
differences), degenerate fan-ins, hybridize / export / reload, the NumPy interface, the Module
API, grad_req='add', the conv-swapping helper, bad inputs."""
import json
import os

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import check_bad_inputs, export_and_reload, rounded, run_python
from reference import group_norm_bwd_ref, numeric_grad
from tolerances import DTYPES, GRAD_TOL, tol


# -------------------------------------------------------------------------------------------------
# float64 references

def ws_ref(w, gain, eps):
    """Each output channel's row (all dims after the first) to mean 0 and biased variance 1."""
    w = np.asarray(w, np.float64)
    r = w.reshape(w.shape[0], -1)
    m = r.mean(1, keepdims=True)
    v = ((r - m) ** 2).mean(1, keepdims=True)
    return ((r - m) / np.sqrt(v + eps) * np.asarray(gain, np.float64)[:, None]).reshape(w.shape)


def conv_ref(x, w, b, stride, pad, dilate, groups):
    """Cross-correlation of (N, C, *spatial) x with (O, C/groups, *k) w, as mx Convolution."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    nd = x.ndim - 2
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    N, C = x.shape[:2]
    O, k = w.shape[0], w.shape[2:]
    out_sp = [(xp.shape[2 + i] - dilate[i] * (k[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
    out = np.zeros((N, O, *out_sp))
    cg, og = C // groups, O // groups
    for g in range(groups):
        xs, wg = xp[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og]
        for kk in np.ndindex(*k):
            sl = tuple(slice(kk[i] * dilate[i], kk[i] * dilate[i] + stride[i] * (out_sp[i] - 1) + 1,
                             stride[i]) for i in range(nd))
            patch = xs[(slice(None), slice(None)) + sl]
            out[:, g * og:(g + 1) * og] += np.einsum("nc...,oc->no...", patch,
                                                     wg[(slice(None), slice(None)) + kk])
    if b is not None:
        out += np.asarray(b, np.float64).reshape((1, O) + (1,) * nd)
    return out


# (rank, in C, O, kernel, stride, pad, dilate, groups, N, spatial)
CONFIGS = [
    (1, 4, 6, (3,), (1,), (1,), (1,), 1, 2, (9,)),
    (1, 4, 4, (2,), (2,), (0,), (2,), 2, 2, (10,)),
    (2, 3, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, 2, (5, 6)),
    (2, 4, 6, (3, 2), (2, 1), (1, 0), (1, 2), 2, 1, (7, 6)),
    (2, 4, 4, (3, 3), (1, 1), (1, 1), (1, 1), 4, 2, (5, 5)),  # depthwise: fan-in = 9
    (3, 2, 4, (2, 2, 2), (1, 1, 1), (0, 1, 0), (1, 1, 1), 1, 2, (3, 4, 3)),
]
CLASSES = {1: gn_mx.WSConv1D, 2: gn_mx.WSConv2D, 3: gn_mx.WSConv3D}


def _layer(cfg, dtype, use_gain=True, use_bias=True, eps=1e-5):
    rank, C, O, k, s, p, d, g, N, sp = cfg
    layer = CLASSES[rank](O, k, strides=s, padding=p, dilation=d, groups=g, use_bias=use_bias,
                          in_channels=C, ws_eps=eps, use_gain=use_gain)
    layer.initialize()
    layer.cast(dtype)
    rng = np.random.RandomState(3)
    layer.weight.set_data(mx.nd.array(rng.randn(*layer.weight.shape) * 0.3 + 0.1, dtype=dtype))
    layer.gain.set_data(mx.nd.array(rng.rand(O) + 0.5, dtype=dtype))
    if use_bias:
        layer.bias.set_data(mx.nd.array(rng.randn(O), dtype=dtype))
    x = rng.randn(N, C, *sp).astype(dtype)
    return layer, x


# -------------------------------------------------------------------------------------------------
# The op on its own, every dtype (fp16 included: CPU has no fp16 convolution, the op has fp16)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 3, 3), (6, 2, 5), (3, 1, 2, 2, 2), (8, 1, 1, 1)])
def test_op_forward_backward(ctx, dtype, shape):
    rng = np.random.RandomState(0)
    w, w64 = rounded(rng.randn(*shape) * 0.05 + 0.02, dtype)
    gdt = np.float32 if dtype == np.float16 else dtype  # fp16 weight with fp32 gain: multi-precision
    g, g64 = rounded(rng.rand(shape[0]) + 0.5, gdt)
    dy, dy64 = rounded(rng.randn(*shape), dtype)
    eps = 1e-5
    W, G = mx.nd.array(w, ctx=ctx, dtype=dtype), mx.nd.array(g, ctx=ctx, dtype=gdt)
    W.attach_grad()
    G.attach_grad()
    with autograd.record():
        out, mean, rstd = gn_mx.ws.weight_standardize(W, G, eps=eps, return_stats=True)
    out.backward(mx.nd.array(dy, ctx=ctx, dtype=dtype))
    assert out.dtype == dtype and out.shape == shape and mean.shape == (shape[0],)
    np.testing.assert_allclose(out.asnumpy().astype(np.float64), ws_ref(w64, g64, eps), *tol(dtype))
    r = w64.reshape(shape[0], -1)
    np.testing.assert_allclose(mean.asnumpy(), r.mean(1), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(rstd.asnumpy(), 1 / np.sqrt(r.var(1) + eps), rtol=2e-5)
    # gradients: float64 central differences of sum(ws(w) * dy) (to 1e-6: their own truncation
    # and rounding), and GroupNorm's analytic float64 gradient on the (1, O, F) view (dtype tol.)
    O = shape[0]
    dw = numeric_grad(lambda v: (ws_ref(v, g64, eps) * dy64).sum(), w64)
    dg = numeric_grad(lambda v: (ws_ref(w64, v, eps) * dy64).sum(), g64)
    adw, adg, _ = group_norm_bwd_ref(w64.reshape(1, O, -1), g64, dy64.reshape(1, O, -1), O, eps)
    rtol, atol = tol(dtype, GRAD_TOL)
    scale = max(np.abs(dw).max(), 1.0)  # dw is O(rstd) ~ 20 here: compare relative to its size
    for want, (r, a) in ((adw.reshape(shape), (rtol, atol)), (dw, (max(rtol, 1e-6), max(atol, 1e-6)))):
        np.testing.assert_allclose(W.grad.asnumpy() / scale, want / scale, rtol=r, atol=a)
    np.testing.assert_allclose(G.grad.asnumpy(), adg, rtol=rtol, atol=atol * np.abs(dg).max())
    np.testing.assert_allclose(G.grad.asnumpy(), dg, rtol=max(rtol, 1e-6),
                               atol=max(atol, 1e-6) * np.abs(dg).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_degenerate_rows(ctx, dtype):
    """Fan-in 1 (a 1x1 conv with one input channel) and constant rows: var = 0, eps decides. No
    NaN anywhere. Fan-in-1 rows standardize to exactly 0 with a zero weight gradient; a longer
    constant row to 0 up to its mean's rounding in the accumulation dtype times rstd =
    1/sqrt(eps) (a few ulp of the value, x 1000 at eps = 1e-6), with the finite
    (I - 1/F) rstd gain dy weight gradient of the float64 formula; the other rows are unaffected."""
    rng = np.random.RandomState(1)
    w1 = rng.randn(6, 1, 1, 1).astype(dtype)
    wc = (rng.randn(5, 2, 3, 3) * 0.1).astype(dtype)
    wc[1] = 0.37
    wc[3] = -3.0
    eps = 1e-6
    ulp = np.finfo(np.float64 if dtype == np.float64 else np.float32).eps
    for w, const in ((w1, [0, 1, 2, 3, 4, 5]), (wc, [1, 3])):
        g64 = (rng.rand(w.shape[0]) + 0.5).astype(dtype).astype(np.float64)
        dy = rng.randn(*w.shape).astype(dtype)
        W = mx.nd.array(w, ctx=ctx, dtype=dtype)
        G = mx.nd.array(g64, ctx=ctx, dtype=dtype)
        W.attach_grad()
        G.attach_grad()
        with autograd.record():
            out = gn_mx.ws.weight_standardize(W, G, eps=eps)
        out.backward(mx.nd.array(dy, ctx=ctx, dtype=dtype))
        o, dw, dg = out.asnumpy(), W.grad.asnumpy(), G.grad.asnumpy()
        assert np.isfinite(o).all() and np.isfinite(dw).all() and np.isfinite(dg).all()
        w64, dy64 = w.astype(np.float64), dy.astype(np.float64)
        if w is w1:
            assert (o == 0).all() and (dg == 0).all(), (o, dg)
        for c in const:  # within 16 ulp of the value, times rstd and gain
            bound = 16 * ulp * np.abs(w64[c]).max() / np.sqrt(eps) * g64[c]
            assert np.abs(o[c]).max() <= bound, (c, np.abs(o[c]).max(), bound)
        others = [i for i in range(w.shape[0]) if i not in const]
        np.testing.assert_allclose(o[others], ws_ref(w64, g64, eps)[others], *tol(dtype))
        O = w.shape[0]  # the analytic float64 gradient (a finite difference of a -3e4 row would
        # lose its digits to the offset): GroupNorm's, on the (1, O, F) view in O groups
        want = group_norm_bwd_ref(w64.reshape(1, O, -1), g64, dy64.reshape(1, O, -1), O,
                                  eps)[0].reshape(w.shape)
        for c in const:  # dgain = sum(dy * xhat): at most the rows' residues times |dy|
            bound = 16 * ulp * np.abs(w64[c]).max() / np.sqrt(eps) * np.abs(dy64[c]).sum()
            assert abs(float(dg[c])) <= bound, (c, dg[c], bound)
        if w is w1:
            np.testing.assert_array_equal(dw, 0)
        rtol, atol = tol(dtype, GRAD_TOL)
        m = max(np.abs(want).max(), 1.0)
        np.testing.assert_allclose(dw / m, want / m, rtol=rtol, atol=atol)


# -------------------------------------------------------------------------------------------------
# The blocks: forward and backward against standardize-then-convolve (float64 FD)

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}d-g{c[7]}-k{'x'.join(map(str, c[3]))}")
@pytest.mark.parametrize("hybridize", [False, True])
def test_block_forward_backward(dtype, cfg, hybridize):
    rank, C, O, k, s, p, d, g, N, sp = cfg
    eps = 1e-5
    layer, x = _layer(cfg, dtype, eps=eps)
    if hybridize:
        layer.hybridize()
    w64 = layer.weight.data().asnumpy().astype(np.float64)
    g64 = layer.gain.data().asnumpy().astype(np.float64)
    b64 = layer.bias.data().asnumpy().astype(np.float64)
    x64 = x.astype(np.float64)
    X = mx.nd.array(x, dtype=dtype)
    X.attach_grad()
    with autograd.record():
        y = layer(X)
    ref = conv_ref(x64, ws_ref(w64, g64, eps), b64, s, p, d, g)
    assert y.shape == ref.shape and y.dtype == dtype
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(y.asnumpy(), ref, rtol=rtol, atol=atol * 30)
    dy = np.random.RandomState(4).randn(*ref.shape)
    y.backward(mx.nd.array(dy, dtype=dtype))

    def loss(w=w64, gn=g64, xx=x64):
        return (conv_ref(xx, ws_ref(w, gn, eps), b64, s, p, d, g) * dy).sum()
    h = 1e-6 if dtype == np.float64 else 1e-5
    rtol, atol = tol(dtype, GRAD_TOL)
    for got, want in ((layer.weight.grad(), numeric_grad(lambda v: loss(w=v), w64, h)),
                      (layer.gain.grad(), numeric_grad(lambda v: loss(gn=v), g64, h)),
                      (X.grad, numeric_grad(lambda v: loss(xx=v), x64, h))):
        m = max(np.abs(want).max(), 1e-3)
        # float32: the op's rounding; float64: the differences' own (h^2 truncation, cancellation)
        np.testing.assert_allclose(got.asnumpy() / m, want / m, rtol=max(rtol * 10, 1e-6),
                                   atol=max(atol * 10, 1e-7))
    np.testing.assert_allclose(layer.bias.grad().asnumpy(),
                               dy.sum(axis=(0,) + tuple(range(2, dy.ndim))), rtol=1e-5)


def test_fixed_gain_and_no_bias():
    """use_gain=False: gain is a fixed ones vector that gets no gradient (grad_req 'null')."""
    layer = gn_mx.WSConv2D(4, 3, use_bias=False, in_channels=2)
    layer.initialize()
    assert layer.gain.grad_req == "null" and layer.bias is None
    np.testing.assert_array_equal(layer.gain.data().asnumpy(), np.ones(4))
    x = mx.nd.random.normal(shape=(1, 2, 5, 5))
    with autograd.record():
        y = layer(x)
    y.backward()
    w = layer.weight.data().asnumpy()
    ref = conv_ref(x.asnumpy(), ws_ref(w, np.ones(4), 1e-6), None, (1, 1), (0, 0), (1, 1), 1)
    np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-4, atol=1e-4)
    assert "WSConv2D(2 -> 4, kernel_size=(3, 3), stride=(1, 1), bias=False, ws_eps=1e-06)" == repr(layer)


def test_degenerate_fan_in_block():
    """1x1 convolution with one input channel: every row is one value, the standardized weight
    is 0 and the output is the bias, with finite (zero) weight gradients."""
    layer = gn_mx.WSConv2D(3, 1, in_channels=1, use_gain=True)
    layer.initialize()
    layer.bias.set_data(mx.nd.array([1.0, -2.0, 0.5]))
    x = mx.nd.random.normal(shape=(2, 1, 4, 4))
    with autograd.record():
        y = layer(x)
    y.backward()
    np.testing.assert_array_equal(y.asnumpy(), np.broadcast_to(
        np.array([1.0, -2.0, 0.5], np.float32).reshape(1, 3, 1, 1), (2, 3, 4, 4)))
    np.testing.assert_array_equal(layer.weight.grad().asnumpy(), 0)
    np.testing.assert_array_equal(layer.gain.grad().asnumpy(), 0)


def test_trains_and_standardization_is_live():
    """An SGD step changes the raw weight; the effective weight stays standardized each forward
    (the rows of the next forward's weight have mean 0, variance 1)."""
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.WSConv2D(8, 3, padding=1, in_channels=3), gn_mx.GroupNorm(num_groups=4),
            gluon.nn.Activation("relu"), gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(2))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5})
    x, lab = mx.nd.random.normal(shape=(4, 3, 6, 6)), mx.nd.array([0, 1, 0, 1])
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    w0 = net[0].weight.data().asnumpy().copy()
    losses = []
    for _ in range(5):
        with autograd.record():
            loss = loss_fn(net(x), lab)
        loss.backward()
        trainer.step(4)
        losses.append(float(loss.mean().asscalar()))
    assert not np.allclose(net[0].weight.data().asnumpy(), w0)
    assert losses[-1] < losses[0]
    # The trained layer's forward convolves with the standardized weight: the same layer as a plain
    # convolution with a float64 numpy standardization of its raw weight (rows mean 0, variance 1,
    # times gain), and not with the raw weight itself.
    w = net[0].weight.data().asnumpy().astype(np.float64).reshape(8, -1)
    w_hat = (w - w.mean(1, keepdims=True)) / np.sqrt(w.var(1, keepdims=True) + 1e-6)
    w_hat *= net[0].gain.data().asnumpy().astype(np.float64)[:, None]
    conv = lambda wt: mx.nd.Convolution(x, mx.nd.array(wt.reshape(8, 3, 3, 3)), net[0].bias.data(),
                                        kernel=(3, 3), pad=(1, 1), num_filter=8).asnumpy()
    y = net[0](x).asnumpy()
    np.testing.assert_allclose(y, conv(w_hat), rtol=1e-4, atol=1e-4)
    assert np.abs(y - conv(w)).max() > 1e-2  # the raw weight gives another output


def test_grad_req_add_accumulates():
    layer, x = _layer(CONFIGS[2], np.float64)
    X = mx.nd.array(x, dtype=np.float64)

    def grads():
        with autograd.record():
            y = layer(X)
        y.backward()
        return layer.weight.grad().asnumpy().copy(), layer.gain.grad().asnumpy().copy()
    for hybrid in (False, True):
        layer.collect_params().setattr("grad_req", "write")
        if hybrid:
            layer.hybridize()
        w1, g1 = grads()
        layer.collect_params().setattr("grad_req", "add")
        layer.collect_params().zero_grad()
        grads()
        w2, g2 = grads()
        np.testing.assert_allclose(w2, 2 * w1, rtol=1e-10)
        np.testing.assert_allclose(g2, 2 * g1, rtol=1e-10)


def test_numpy_interface():
    """A WSConv2D built under npx.set_np() (as any Gluon layer there) takes and returns mx.np
    arrays, imperative and hybridized, with the legacy layer's values."""
    layer, x = _layer(CONFIGS[2], np.float32)
    ref = layer(mx.nd.array(x)).asnumpy()
    values = {n: p.data().asnumpy() for n, p in layer._collect_params_with_prefix().items()}
    rank, C, O, k, s_, p_, d, g, N, sp = CONFIGS[2]
    mx.npx.set_np()
    try:
        for hybrid in (False, True):
            np_layer = gn_mx.WSConv2D(O, k, strides=s_, padding=p_, dilation=d, groups=g,
                                      in_channels=C, ws_eps=1e-5, use_gain=True)
            np_layer.initialize()
            for n, p in np_layer._collect_params_with_prefix().items():
                p.set_data(mx.np.array(values[n]))
            if hybrid:
                np_layer.hybridize()
            y = np_layer(mx.np.array(x))
            assert isinstance(y, mx.np.ndarray)
            np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-5, atol=1e-5)
    finally:
        mx.npx.reset_np()


def test_symbol_holds_the_standardization(tmp_path):
    layer, x = _layer(CONFIGS[2], np.float32)
    prefix = export_and_reload(layer, [x], tmp_path)
    nodes = json.load(open(prefix + "-symbol.json"))["nodes"]
    ops = [n["op"] for n in nodes if n["op"] != "null"]
    assert ops == ["gn_weight_standardize", "Convolution"], ops


def test_module_api_matches_gluon():
    """gn_mx.sym.ws_convolution in mx.mod.Module: same output as the Gluon block with the same
    parameters, and a training step runs (gain initialized to ones by its variable's init)."""
    layer, x = _layer(CONFIGS[3], np.float32, use_gain=True)
    rank, C, O, k, s, p, d, g, N, sp = CONFIGS[3]
    ref = layer(mx.nd.array(x)).asnumpy()
    data = mx.sym.var("data")
    y = gn_mx.sym.ws_convolution(data, O, k, stride=s, pad=p, dilate=d, num_group=g, name="c0",
                                 ws_eps=1e-5, in_channels=C)
    assert y.list_arguments() == ["data", "c0_weight", "c0_gain", "c0_bias"]
    mod = mx.mod.Module(y, data_names=["data"], label_names=None)
    mod.bind(data_shapes=[("data", x.shape)])
    mod.init_params(mx.init.Xavier())
    assert (mod.get_params()[0]["c0_gain"].asnumpy() == 1).all()
    mod.set_params({"c0_weight": layer.weight.data(), "c0_gain": layer.gain.data(),
                    "c0_bias": layer.bias.data()}, {})
    mod.forward(mx.io.DataBatch([mx.nd.array(x)]), is_train=False)
    np.testing.assert_allclose(mod.get_outputs()[0].asnumpy(), ref, rtol=1e-5, atol=1e-5)
    mod.bind(data_shapes=[("data", x.shape)], for_training=True, force_rebind=True)
    mod.init_optimizer(optimizer="sgd", optimizer_params={"learning_rate": 0.1})
    mod.forward(mx.io.DataBatch([mx.nd.array(x)]), is_train=True)
    mod.backward([mx.nd.ones(ref.shape)])
    mod.update()
    assert np.isfinite(mod.get_params()[0]["c0_weight"].asnumpy()).all()


# -------------------------------------------------------------------------------------------------
# Swapping the convolutions of an existing net

def test_standardize_convs_keeps_names_and_initializers():
    from mxnet.gluon.model_zoo import vision
    net = vision.resnet18_v1(classes=10)
    names = sorted(net.collect_params().keys())
    inits = {n: p.init for n, p in net.collect_params().items()}
    n_convs = sum(1 for n in names if n.endswith("weight") and "conv" in n)
    swapped = gn_mx.standardize_convs(net, use_gain=True)
    assert len(swapped) == n_convs == 20
    params = net.collect_params()
    assert sorted(n for n in params.keys() if not n.endswith("_gain")) == names
    assert sum(n.endswith("_gain") for n in params.keys()) == n_convs
    for n, p in params.items():
        if n in inits:
            assert p.init is inits[n]
    assert type(net.features[0]).__name__ == "WSConv2D"
    net.initialize()
    net.hybridize()
    y = net(mx.nd.random.normal(shape=(1, 3, 32, 32)))
    assert y.shape == (1, 10) and np.isfinite(y.asnumpy()).all()


def test_standardize_convs_include_and_existing_values():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, in_channels=2, activation="relu"),
            gluon.nn.Conv2D(4, 1, in_channels=4), gluon.nn.Conv2DTranspose(2, 2, in_channels=4))
    net.initialize()
    net.hybridize()
    x = mx.nd.random.normal(shape=(1, 2, 6, 6))
    before = net(x).asnumpy()
    w = net[0].weight.data().asnumpy().copy()
    assert gn_mx.standardize_convs(net, include=lambda path, conv: path == "0") == ["0"]
    assert type(net[0]).__name__ == "WSConv2D" and type(net[1]) is gluon.nn.Conv2D
    np.testing.assert_array_equal(net[0].weight.data().asnumpy(), w)  # the same Parameter
    net[0].gain.initialize()
    y = net[0](x).asnumpy()  # the new graph: relu(conv(x, ws(w)) + b)
    ref = np.maximum(conv_ref(x.asnumpy(), ws_ref(w, np.ones(4), 1e-6),
                              net[0].bias.data().asnumpy(), (1, 1), (0, 0), (1, 1), 1), 0)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    after = net(x).asnumpy()  # the hybridized parent re-traced with the new layer
    np.testing.assert_allclose(after, net[2](net[1](mx.nd.array(y))).asnumpy(), rtol=1e-5,
                               atol=1e-5)
    assert after.shape == before.shape and not np.allclose(after, before)
    with pytest.raises(ValueError, match="root block"):
        gn_mx.standardize_convs(gluon.nn.Conv2D(2, 1))


# -------------------------------------------------------------------------------------------------
# Bad inputs

def test_bad_inputs():
    with pytest.raises(ValueError, match="ws_eps"):
        gn_mx.WSConv2D(4, 3, ws_eps=-1)
    with pytest.raises(ValueError, match="ws_eps"):
        gn_mx.standardize_convs(gluon.nn.HybridSequential(), ws_eps=float("nan"))
    prelude = "import mxnet as mx, numpy as np, gn_mx\n"
    cases = {
        "rank1": ("mx.nd.gn_weight_standardize(mx.nd.ones(4), mx.nd.ones(4))",
                  "weight must have at least 2 dims"),
        "gain_shape": ("mx.nd.gn_weight_standardize(mx.nd.ones((4, 3)), mx.nd.ones(3))",
                       "gain must have shape (4,)"),
        "gain_dtype": ("mx.nd.gn_weight_standardize(mx.nd.ones((4, 3)), "
                       "mx.nd.ones(4, dtype='float64'))", "gain dtype must equal"),
        "int": ("mx.nd.gn_weight_standardize(mx.nd.ones((4, 3), dtype='int32'), mx.nd.ones(4))",
                "weight must be float16, float32 or float64"),
        "eps": ("mx.nd.gn_weight_standardize(mx.nd.ones((4, 3)), mx.nd.ones(4), eps=-1)",
                "eps must be a finite number >= 0"),
        "attr": ("mx.nd.gn_weight_standardize(mx.nd.ones((4, 3)), mx.nd.ones(4), num_groups=2)",
                 "num_groups"),
    }
    check_bad_inputs(prelude, cases, "mx.nd.gn_weight_standardize(mx.nd.array([[1., 3.]]), "
                     "mx.nd.ones(1))[0].asnumpy().round(3).tolist()", "[[-1.0, 1.0]]")


# -------------------------------------------------------------------------------------------------
# Mixed precision: the standardization stays float32 (the master weight, float32 statistics); the
# convolution gets the cast result

def _ws_net():
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.WSConv2D(8, 3, padding=1, in_channels=3, use_gain=True),
            gn_mx.GroupNorm(num_groups=4), gluon.nn.Activation("relu"),
            gn_mx.WSConv2D(8, 3, padding=1, in_channels=8), gn_mx.GroupNorm(num_groups=4),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(4))
    return net


def _casts(sym, op):
    """{node name: [amp_cast dtype or None per input]} of every `op` node."""
    ns = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    return {n["name"]: [ns[i[0]]["attrs"]["dtype"] if ns[i[0]]["op"] == "amp_cast" else None
                        for i in n["inputs"]] for n in ns if n["op"] == op}


def test_amp_convert_symbol_float16_lists(tmp_path):
    """AMP's default float16 lists (a GPU's: Convolution in float16): the weight reaches
    gn_weight_standardize uncast (float32 master), its float32 result is cast to float16 for the
    Convolution; the data path is float16 through GroupNorm. Converting needs no GPU."""
    from mxnet.contrib import amp
    assert "gn_weight_standardize" in amp.list_fp32_ops("float16")
    from mxnet.contrib.amp.lists import symbol_bf16
    assert "gn_weight_standardize" in symbol_bf16.FP32_FUNCS
    net = _ws_net()
    net.initialize()
    net.hybridize()
    net(mx.nd.ones((2, 3, 6, 6)))
    net.export(str(tmp_path / "ws"))
    sym = mx.sym.load(str(tmp_path / "ws-symbol.json"))
    conv = amp.convert_symbol(sym, target_dtype="float16", data_names=["data"],
                              cast_optional_params=False)
    ws = _casts(conv, "gn_weight_standardize")
    assert len(ws) == 2 and all(c[0] in (None, "float32") for c in ws.values()), ws
    convs = _casts(conv, "Convolution")
    assert len(convs) == 2 and all(c[1] == "float16" for c in convs.values()), convs
    args, _, _ = conv.infer_type(data="float32")
    types = dict(zip(conv.list_arguments(), args))
    assert all(types[n] == np.float32 for n in types if n.endswith(("_weight", "_gain"))), types
    internals = conv.get_internals()
    names = internals.list_outputs()
    _, outs, _ = internals.infer_type(data="float32")
    ws_out = {n: t for n, t in zip(names, outs) if "_ws_output0" in n or n.endswith("ws_output")}
    assert ws_out and all(t == np.float32 for t in ws_out.values()), ws_out


def test_amp_cpu_training_and_conversion():
    """amp.init on CPU (gn_mx.amp.cpu_init_kwargs: Convolution stays float32 there): a hybridized
    WS net trains with float32 master weights and float32 standardization; converting a trained
    net with the CPU lists reproduces its float32 output to float16 accuracy."""
    code = """
    import json, numpy as np, mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp
    import gn_mx
    amp.init(**gn_mx.amp.cpu_init_kwargs())
    mx.random.seed(3)
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.WSConv2D(8, 3, padding=1, in_channels=3, use_gain=True),
            gn_mx.GroupNorm(num_groups=4), gluon.nn.Activation("relu"),
            gn_mx.WSConv2D(8, 3, padding=1, in_channels=8), gn_mx.GroupNorm(num_groups=4),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(4))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2, "momentum": 0.9})
    amp.init_trainer(tr)
    x = mx.nd.random.normal(shape=(8, 3, 6, 6))
    y = mx.nd.array(np.arange(8) % 4)
    losses = []
    for _ in range(12):
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
            with amp.scale_loss(loss, tr) as scaled:
                autograd.backward(scaled)
        tr.step(8)
        losses.append(float(loss.mean().asscalar()))
    sym = net._cached_graph[1]
    ns = json.loads(sym.tojson(remove_amp_cast=False))["nodes"]
    ws_in = [ns[i[0]]["attrs"].get("dtype") if ns[i[0]]["op"] == "amp_cast" else None
             for n in ns if n["op"] == "gn_weight_standardize" for i in n["inputs"]]
    gn_in = [ns[n["inputs"][0][0]]["attrs"].get("dtype") for n in ns if n["op"] == "gn_group_norm"
             if ns[n["inputs"][0][0]]["op"] == "amp_cast"]
    print("RESULT", json.dumps({
        "losses": losses, "ws_in": ws_in, "gn_in": gn_in,
        "dtypes": sorted({str(np.dtype(p.dtype)) for p in net.collect_params().values()}),
        "finite": all(bool(np.isfinite(p.data().asnumpy()).all())
                      for p in net.collect_params().values())}))
    """
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert res["dtypes"] == ["float32"] and res["finite"], res
    assert all(t in (None, "float32") for t in res["ws_in"]) and len(res["ws_in"]) == 4, res
    assert res["gn_in"] and all(t == "float16" for t in res["gn_in"]), res  # GN still fp16
    assert res["losses"][-1] < 0.7 * res["losses"][0], res["losses"]


# -------------------------------------------------------------------------------------------------
# Deployment: ONNX (onnxruntime) and the C predict API

def _trained_ws_net(sample):
    """A small WS + GroupNorm CNN with non-trivial gains (2-D or 3-D by `sample`'s rank)."""
    conv = gn_mx.WSConv2D if len(sample) == 3 else gn_mx.WSConv3D
    pool = gluon.nn.GlobalAvgPool2D() if len(sample) == 3 else gluon.nn.GlobalAvgPool3D()
    net = gluon.nn.HybridSequential()
    net.add(conv(8, 3, padding=1, use_gain=True), gn_mx.GroupNorm(num_groups=4),
            gluon.nn.Activation("relu"), conv(8, 1, groups=2, use_bias=False),
            gn_mx.GroupNorm(num_groups=2), pool, gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((2,) + sample))
    rng = np.random.RandomState(5)
    for p in net.collect_params().values():
        if p.name.endswith("gain"):
            p.set_data(mx.nd.array(rng.rand(*p.shape) + 0.5))
    return net


@pytest.mark.parametrize("sample", [(3, 6, 6), (2, 4, 5, 4)], ids=["2d", "3d"])
def test_onnx_export_runs_in_onnxruntime(sample, tmp_path):
    pytest.importorskip("onnxruntime", reason="needs onnx + onnxruntime (pip install 'gn_mx[onnx]')")
    from test_onnx import compare, export
    net = _trained_ws_net(sample)
    path, model = export(net, tmp_path, (2,) + sample, (None, sample[0]) + (None,) * (len(sample) - 1))
    ops = [n.op_type for n in model.graph.node]
    assert "ReduceMean" in ops and ops.count("Conv") == 2, ops
    shapes = [(2,) + sample, (5,) + sample, (1, sample[0]) + tuple(d + 2 for d in sample[1:])]
    diffs = compare(net, path, shapes)
    print(f"WS net {len(sample) - 1}-D: onnxruntime vs MXNet, max abs diff per input shape {diffs}")
    assert max(diffs) <= 1e-5, diffs


def test_c_predict_api_reload(tmp_path):
    """examples/deploy_c/predict.c (MXLoadLib + MXPredCreate) runs an exported WS net and matches
    Python."""
    import shutil
    import subprocess
    from test_deploy import EXAMPLE, MX_ROOT, run_predictor
    if not os.path.exists(os.path.join(MX_ROOT, "include", "mxnet", "c_predict_api.h")):
        pytest.skip("the installed mxnet wheel ships no include/mxnet/c_predict_api.h")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc/gcc) to build examples/deploy_c/predict.c")
    exe = str(tmp_path / "predict")
    p = subprocess.run([cc, "-std=c99", "-O2", os.path.join(EXAMPLE, "predict.c"),
                        f"-I{MX_ROOT}/include", f"-L{MX_ROOT}", "-lmxnet",
                        f"-Wl,-rpath,{MX_ROOT}", "-o", exe], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    net = _trained_ws_net((3, 6, 6))
    prefix = str(tmp_path / "wsnet")
    net.export(prefix)
    model = {"symbol": prefix + "-symbol.json", "params": prefix + "-0000.params"}
    assert '"op": "gn_weight_standardize"' in open(model["symbol"]).read()
    for n in (2, 1):
        x = np.random.RandomState(n).randn(n, 3, 6, 6).astype(np.float32)
        got = run_predictor(exe, model, x, tmp_path)
        np.testing.assert_allclose(got, net(mx.nd.array(x)).asnumpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hybrid_parent", [False, True])
def test_deferred_in_channels(hybrid_parent):
    """Without in_channels the weight's in-channel dim comes from the first input (the layer
    fills it in, since MXNet cannot infer it back through gn_weight_standardize), also inside a
    hybridized parent and with groups."""
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.WSConv2D(8, 3, groups=2, padding=1), gn_mx.WSConv2D(4, 1))
    net.initialize()
    if hybrid_parent:
        net.hybridize()
    y = net(mx.nd.random.normal(shape=(2, 6, 5, 5)))
    assert y.shape == (2, 4, 5, 5)
    assert net[0].weight.shape == (8, 3, 3, 3) and net[1].weight.shape == (4, 8, 1, 1)


def test_standardize_convs_attribute_children():
    """Convolutions held as attributes of a custom block (self.c1 = Conv2D(...)) are swapped in
    the child registry and the attribute alike; the hybridized block runs the new graph."""
    class Block(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.c1 = gluon.nn.Conv2D(4, 3, padding=1, in_channels=2)
                self.n1 = gn_mx.GroupNorm(num_groups=2)

        def hybrid_forward(self, F, x):
            return self.n1(self.c1(x))
    b = Block()
    assert gn_mx.standardize_convs(b) == ["c1"]
    assert type(b.c1) is gn_mx.WSConv2D and b._children["c1"] is b.c1
    b.initialize()
    b.hybridize()
    x = mx.nd.random.normal(shape=(1, 2, 5, 5))
    y = b(x)
    ops = [n["op"] for n in json.loads(b._cached_graph[1].tojson())["nodes"] if n["op"] != "null"]
    assert "gn_weight_standardize" in ops and y.shape == (1, 4, 5, 5)


# -------------------------------------------------------------------------------------------------
# Inside SymbolBlocks (SymbolBlock.imports, GluonCV's SSD / FPN backbones)

def _conv_symbolblock(shared_weight=False):
    """data -> conv (3x3, 4 filters) -> relu -> conv2 (1x1) [-> conv3 on conv2's weight]."""
    data = mx.sym.var("data")
    y = mx.sym.relu(mx.sym.Convolution(data, num_filter=4, kernel=(3, 3), pad=(1, 1),
                                       name="conv"))
    w2 = mx.sym.var("conv2_weight")
    y = mx.sym.Convolution(y, w2, num_filter=4, kernel=(1, 1), no_bias=True, name="conv2")
    if shared_weight:
        y = mx.sym.Convolution(y, w2, num_filter=4, kernel=(1, 1), no_bias=True, name="conv3")
    sb = gluon.SymbolBlock(y, data)
    sb.initialize(mx.init.Normal(1.0))
    sb(mx.nd.zeros((1, 3, 5, 5)))
    return sb


@pytest.mark.parametrize("use_gain", [False, True])
def test_standardize_convs_inside_a_symbolblock(use_gain, tmp_path):
    """Each Convolution node's weight goes through gn_weight_standardize with a new gain
    Parameter (<prefix>gain: trained only with use_gain); output and gain gradient against
    float64; a weight shared by two nodes is standardized once; the export reloads."""
    sb = _conv_symbolblock(shared_weight=True)
    p = {k: v.data().asnumpy() for k, v in sb.collect_params().items()}
    assert gn_mx.standardize_convs(sb, use_gain=use_gain) == ["conv", "conv2", "conv3"]
    assert sorted(sb.collect_params().keys()) == ["conv2_gain", "conv2_weight", "conv_bias",
                                                  "conv_gain", "conv_weight"]
    assert (sb.params.get("conv_gain").grad_req == "write") == use_gain
    x = mx.nd.array(np.random.RandomState(5).randn(2, 3, 5, 5))
    one = (1, 1)
    h = np.maximum(conv_ref(x.asnumpy(), ws_ref(p["conv_weight"], np.ones(4), 1e-6),
                            p["conv_bias"], one, one, one, 1), 0)
    w2 = ws_ref(p["conv2_weight"], np.ones(4), 1e-6)
    want = conv_ref(conv_ref(h, w2, None, one, (0, 0), one, 1), w2, None, one, (0, 0), one, 1)
    with autograd.record():
        y = sb(x)
        y.sum().backward()
    np.testing.assert_allclose(y.asnumpy(), want, rtol=1e-4, atol=1e-3)
    if use_gain:  # the gain is live: gradients reach it
        assert np.abs(sb.params.get("conv2_gain").grad().asnumpy()).max() > 0
    nodes = json.loads(sb._cached_graph[1].tojson())["nodes"]
    assert [n["op"] for n in nodes].count("gn_weight_standardize") == 2
    sb.hybridize()
    np.testing.assert_allclose(sb(x).asnumpy(), want, rtol=1e-4, atol=1e-3)
    export_and_reload(sb, [x.asnumpy()], tmp_path, rtol=1e-5, atol=1e-4)
    assert gn_mx.standardize_convs(sb) == []  # standardized weights are op outputs: left alone


def test_standardize_convs_symbolblock_child_include_and_model_zoo(tmp_path):
    """A SymbolBlock inside a Gluon tree is found (paths 'child:node'), include= sees each node;
    SymbolBlock.imports of an exported ResNet-18 gets every convolution standardized and trains."""
    net = gluon.nn.HybridSequential()
    net.add(_conv_symbolblock(), gluon.nn.Conv2D(2, 1, in_channels=4))
    net[1].initialize()
    chosen = gn_mx.standardize_convs(net, include=lambda path, c: path != "0:conv2")
    assert chosen == ["1", "0:conv"] and type(net[1]) is gn_mx.WSConv2D
    assert "conv2_gain" not in net[0].collect_params()
    net[1].gain.initialize()
    net.hybridize()
    assert net(mx.nd.ones((1, 3, 5, 5))).shape == (1, 2, 5, 5)

    from mxnet.gluon.model_zoo import vision
    zoo = vision.resnet18_v1(classes=4)
    zoo.initialize()
    zoo.hybridize()
    x = mx.nd.random.normal(shape=(2, 3, 32, 32))
    zoo(x)
    zoo.export(str(tmp_path / "r18"))
    sb = gluon.SymbolBlock.imports(str(tmp_path / "r18-symbol.json"), ["data"],
                                   str(tmp_path / "r18-0000.params"))
    assert len(gn_mx.standardize_convs(sb, use_gain=True)) == 20
    trainer = gluon.Trainer(sb.collect_params(), "sgd", {"learning_rate": 0.01})
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(sb(x), mx.nd.array([0, 1]))
    loss.backward()
    trainer.step(2)
    assert np.isfinite(sb(x).asnumpy()).all()
