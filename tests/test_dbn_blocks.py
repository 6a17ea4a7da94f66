"""gn_mx.DecorrelatedBatchNorm: training/inference modes, hybridization, grad_req, float16.

References are float64 numpy (tests/reference.py). The ops themselves are tested in
test_dbn_ops.py; the block's options (group_size, use_global_stats) in test_dbn_options.py;
export and reload in test_export.py.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import GRAD_TOL, ROOT, dbn_data as _data, tol
from reference import dbn_bwd_ref, dbn_inference_ref, dbn_ref
from test_blocks import _fwd_bwd, _graph_ops

CPU = mx.cpu()
EPS = 1e-5
MOM = 0.9


# ---------------------------------------------------------------------------------------------
# Gluon block

def _net(G=2, momentum=MOM):
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=4))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=G, momentum=momentum,
                                            gamma_initializer=mx.init.Uniform(1.0),
                                            beta_initializer=mx.init.Uniform(1.0)))
        net.add(gluon.nn.Activation("relu"))
    return net


def _twin_nets(tmp_path, **kw):
    """Two nets with identical parameters (the second one loads the first one's file)."""
    a = _net(**kw)
    a.initialize(mx.init.Xavier(), ctx=CPU)
    x = mx.nd.array(_data((4, 4, 6, 6), np.float32))
    a(x)
    f = str(tmp_path / "twin.params")
    a.save_parameters(f)
    b = _net(**kw)
    b.load_parameters(f, ctx=CPU)
    return a, b, x


def _dbn_layer(net):
    return [b for b in net._children.values() if isinstance(b, gn_mx.DecorrelatedBatchNorm)][0]


def _stats_of(net):
    blk = _dbn_layer(net)
    return blk.running_mean.data().asnumpy(), blk.running_projection.data().asnumpy()


def test_block_parameters_and_deferred_init():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=3)
    blk.initialize(ctx=CPU)
    y = blk(mx.nd.array(_data((4, 12, 5), np.float32)))
    assert y.shape == (4, 12, 5)
    assert blk.gamma.shape == (12,) and blk.beta.shape == (12,)
    assert blk.running_mean.shape == (12,) and blk.running_projection.shape == (3, 4, 4)
    assert blk.running_mean.grad_req == "null" and blk.running_projection.grad_req == "null"
    # Outside autograd.record() the block infers: the running stats are untouched.
    np.testing.assert_array_equal(blk.running_projection.data().asnumpy(),
                                  np.tile(np.eye(4), (3, 1, 1)))
    np.testing.assert_array_equal(blk.running_mean.data().asnumpy(), 0)


def test_block_train_matches_reference():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, gamma_initializer=mx.init.Uniform(1.0),
                                      beta_initializer=mx.init.Uniform(1.0))
    blk.initialize(ctx=CPU)
    x = _data((6, 4, 3, 3), np.float32)
    xs = mx.nd.array(x)
    xs.attach_grad()
    blk(xs)  # deferred init
    dy = np.random.randn(*x.shape).astype(np.float32)
    with autograd.record():
        y = blk(xs)
    y.backward(mx.nd.array(dy))
    g = blk.gamma.data().asnumpy().reshape(1, 4, 1, 1)
    b = blk.beta.data().asnumpy().reshape(1, 4, 1, 1)
    xhat = dbn_ref(x, 2, EPS)[0]
    np.testing.assert_allclose(y.asnumpy(), xhat * g + b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(xs.grad.asnumpy(), dbn_bwd_ref(x, dy * g, 2, EPS),
                               rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(blk.gamma.grad().asnumpy(), (dy * xhat).sum(axis=(0, 2, 3)),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(blk.beta.grad().asnumpy(), dy.sum(axis=(0, 2, 3)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hybridize", [False, True])
def test_running_stats_converge(hybridize):
    """Training steps on one fixed batch: inference output approaches training output."""
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, momentum=0.8)
    blk.initialize(ctx=CPU)
    if hybridize:
        blk.hybridize()
    x = mx.nd.array(_data((16, 6, 4, 4), np.float32, offset=3.0))
    y_eval0 = blk(x).asnumpy()
    for _ in range(60):
        with autograd.record():
            y_train = blk(x)
    y_eval = blk(x).asnumpy()
    y_train = y_train.asnumpy()
    assert np.abs(y_eval0 - y_train).max() > 1.0
    np.testing.assert_allclose(y_eval, y_train, rtol=1e-3, atol=1e-3)
    _, rmean, W = dbn_ref(x.asnumpy(), 2, EPS)
    np.testing.assert_allclose(blk.running_mean.data().asnumpy(), rmean, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(blk.running_projection.data().asnumpy(), W, rtol=1e-3, atol=1e-3)


def _train_step(net, x):
    """_fwd_bwd on the default context, gradients keyed without the block's name prefix (so that
    two instances, e.g. imperative and hybridized, compare key by key)."""
    y, dx, grads = _fwd_bwd(net, x, None)
    return y, dx, {k.split("_", 1)[1]: g for k, g in grads.items()}


@pytest.mark.parametrize("hybrid_kw", [{}, {"static_alloc": True, "static_shape": True}],
                         ids=["plain", "static"])
def test_hybridized_equals_imperative_and_mode_switching(tmp_path, hybrid_kw):
    """A hybridized parent switching train -> eval -> train -> eval matches the imperative net
    call by call: outputs, gradients and running statistics."""
    imp, hyb, x = _twin_nets(tmp_path)
    hyb.hybridize(**hybrid_kw)
    for step in range(2):
        yi, dxi, gi = _train_step(imp, x)
        yh, dxh, gh = _train_step(hyb, x)
        np.testing.assert_allclose(yh, yi, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dxh, dxi, *tol(np.float32))
        for k in gi:
            np.testing.assert_allclose(gh[k], gi[k], rtol=1e-4, atol=1e-4)
        for a, b in zip(_stats_of(hyb), _stats_of(imp)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        stats_before = _stats_of(hyb)
        ye_i = imp(x).asnumpy()
        ye_h = hyb(x).asnumpy()
        np.testing.assert_allclose(ye_h, ye_i, rtol=1e-5, atol=1e-5)
        assert np.abs(ye_h - yh).max() > 1e-3  # eval really used the running statistics
        for a, b in zip(_stats_of(hyb), stats_before):  # and did not update them
            np.testing.assert_array_equal(a, b)
        with autograd.train_mode():  # train mode without recording: batch statistics
            np.testing.assert_allclose(hyb(x).asnumpy(), imp(x).asnumpy(), rtol=1e-5, atol=1e-5)
        with autograd.record(train_mode=False):  # recording in predict mode: running stats
            np.testing.assert_allclose(hyb(x).asnumpy(), imp(x).asnumpy(), rtol=1e-5, atol=1e-5)


def test_hybridized_block_alone_first_call_in_eval():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    blk.hybridize()
    x = mx.nd.array(_data((8, 4, 5), np.float32, offset=2.0))
    y0 = blk(x).asnumpy()  # eval first: identity projection, zero mean
    np.testing.assert_allclose(y0, x.asnumpy(), rtol=1e-6, atol=1e-6)
    with autograd.record():
        y1 = blk(x).asnumpy()
    np.testing.assert_allclose(y1, dbn_ref(x.asnumpy(), 2, EPS)[0], rtol=1e-4, atol=1e-4)
    y2 = blk(x).asnumpy()
    np.testing.assert_allclose(y2, dbn_inference_ref(x.asnumpy(), *_stats_of_block(blk), 2),
                               rtol=1e-4, atol=1e-4)


def _stats_of_block(blk):
    return blk.running_mean.data().asnumpy(), blk.running_projection.data().asnumpy()


def test_grad_through_eval_mode_hybridized():
    """gn_dbn_inference has a backward, so a predict-mode recorded graph is differentiable."""
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=1)
    blk.initialize(ctx=CPU)
    blk.hybridize()
    x = mx.nd.array(_data((4, 3, 2), np.float32))
    x.attach_grad()
    with autograd.record(train_mode=False):
        y = blk(x)
    y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), 1.0, rtol=1e-6)  # P = I, gamma = 1


def test_static_alloc_running_stats_visible_and_saved(tmp_path):
    """static_alloc CachedOps push library ops with their inputs as read-only dependencies, so
    gn_dbn's in-place update would be invisible to later readers; the block orders them after
    it. Each read and save_parameters right after a training call sees the update."""
    imp, hyb, x = _twin_nets(tmp_path)
    hyb.hybridize(static_alloc=True, static_shape=True)
    for _ in range(2):
        for net in (imp, hyb):
            with autograd.record():
                loss = net(x).sum()
        np.testing.assert_allclose(_stats_of(hyb)[0], _stats_of(imp)[0], rtol=1e-6, atol=1e-6)
    f = str(tmp_path / "after_train.params")
    hyb.save_parameters(f)
    saved = {k: v for k, v in mx.nd.load(f).items() if "running_projection" in k}
    np.testing.assert_allclose(list(saved.values())[0].asnumpy(), _stats_of(imp)[1],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("hybridize", [False, True])
def test_block_float16(hybridize):
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    x = _data((8, 4, 5), np.float16)
    blk(mx.nd.array(x, dtype=np.float32))
    blk.cast("float16")
    if hybridize:
        blk.hybridize()
    xs = mx.nd.array(x, dtype=np.float16)
    with autograd.record():
        y = blk(xs)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.asnumpy(), dbn_ref(x, 2, EPS)[0], *tol(np.float16))
    assert blk.running_projection.data().dtype == np.float16
    y_eval = blk(xs)
    ref = dbn_inference_ref(x, *_stats_of_block(blk), 2)
    np.testing.assert_allclose(y_eval.asnumpy(), ref, *tol(np.float16))


class _ToFloat16(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.cast(x, dtype="float16")


def test_multi_precision_float32_params_float16_data(tmp_path):
    """float32 gamma/beta/running stats with float16 data produced inside a hybridized net
    (multi-precision): hybridized == imperative, and the exported graph has no amp_multicast."""
    def make():
        net = gluon.nn.HybridSequential()
        with net.name_scope():
            net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=4), _ToFloat16(),
                    gn_mx.DecorrelatedBatchNorm(num_groups=2))
        return net
    imp = make()
    imp.initialize(mx.init.Xavier(), ctx=CPU)
    x = mx.nd.array(_data((4, 4, 5, 5), np.float32))
    imp(x)
    f = str(tmp_path / "mp.params")
    imp.save_parameters(f)
    hyb = make()
    hyb.load_parameters(f, ctx=CPU)
    hyb.hybridize()
    yi, dxi, gi = _train_step(imp, x)
    yh, dxh, gh = _train_step(hyb, x)
    assert yh.dtype == np.float16 and _dbn_layer(hyb).gamma.data().dtype == np.float32
    np.testing.assert_allclose(yh, yi, rtol=1e-3, atol=1e-3)
    for k in gi:
        np.testing.assert_allclose(gh[k], gi[k], *tol(np.float16, GRAD_TOL))
    np.testing.assert_allclose(hyb(x).asnumpy(), imp(x).asnumpy(), rtol=1e-3, atol=1e-3)
    hyb.export(str(tmp_path / "mp"))
    ops = [n["op"] for n in json.load(open(str(tmp_path / "mp-symbol.json")))["nodes"]]
    assert "amp_multicast" not in ops and "gn_dbn_inference" in ops


def test_grad_req_add_accumulates_block_params():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    x = mx.nd.array(_data((6, 4, 5), np.float32))
    blk(x)
    grads = []
    for req in ("write", "add"):
        for p in (blk.gamma, blk.beta):
            p.grad_req = req
            p.zero_grad()
        for _ in range(2):
            with autograd.record():
                loss = (blk(x) ** 2).sum()
            loss.backward()
        grads.append(blk.gamma.grad().asnumpy().copy())
    np.testing.assert_allclose(grads[1], 2 * grads[0], rtol=1e-4, atol=1e-4)


def test_example_dbn_cnn_runs(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dbn_cnn.py"),
                        "--steps", "8", "--out", str(tmp_path / "dbn_cnn")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-2000:] + p.stderr[-2000:]


def test_block_constructor_errors():
    with pytest.raises(ValueError, match="num_groups"):
        gn_mx.DecorrelatedBatchNorm(num_groups=0)
    with pytest.raises(ValueError, match="epsilon"):
        gn_mx.DecorrelatedBatchNorm(epsilon=0.0)
    with pytest.raises(ValueError, match="momentum"):
        gn_mx.DecorrelatedBatchNorm(momentum=1.5)
    with pytest.raises(ValueError, match="divisible"):
        gn_mx.DecorrelatedBatchNorm(num_groups=4, in_channels=6)


def test_dbn_grad_req_switch_after_hybridize(ctx):
    """The same trace-time identity choice for DecorrelatedBatchNorm (a mode-keyed graph)."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=3))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=2, momentum=1.0, in_channels=8))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    x = mx.nd.random.normal(shape=(4, 3, 5, 5), ctx=ctx)
    y0, _, g0 = _fwd_bwd(net, x, ctx)
    assert "_copy" not in _graph_ops(net)
    net.collect_params().setattr("grad_req", "add")
    for p in net.collect_params().values():
        if p.grad_req != "null":
            p.zero_grad()
    _fwd_bwd(net, x, ctx)
    y2, _, g2 = _fwd_bwd(net, x, ctx)
    assert "_copy" in _graph_ops(net)
    np.testing.assert_allclose(y2, y0, rtol=1e-5, atol=1e-5)
    for k in g0:
        np.testing.assert_allclose(g2[k], 2 * g0[k], rtol=1e-4, atol=1e-4, err_msg=k)
