"""Data-parallel training on one machine: two CPU contexts, split_and_load, a Trainer with a kvstore."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import tol

CTXS = [mx.cpu(0), mx.cpu(1)]


def _gn_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gn_mx.GroupNorm(num_groups=4, in_channels=8),
            gluon.nn.Activation("relu"), gluon.nn.Conv2D(8, 3, in_channels=8),
            gn_mx.GroupNorm(num_groups=2, in_channels=8), gluon.nn.GlobalAvgPool2D(),
            gluon.nn.Dense(3, in_units=8))
    return net


def _dbn_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gn_mx.DecorrelatedBatchNorm(group_size=4),
            gluon.nn.Activation("relu"), gn_mx.GroupNorm(num_groups=2), gluon.nn.GlobalAvgPool2D(),
            gluon.nn.Dense(3))
    return net


def _batches(steps, n=8, seed=0):
    rng = np.random.RandomState(seed)
    return [(rng.randn(n, 3, 6, 6), rng.randint(0, 3, n)) for _ in range(steps)]


def _train(net, ctxs, batches, kvstore, dtype="float64"):
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}, kvstore=kvstore)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for x, y in batches:
        xs = gluon.utils.split_and_load(mx.nd.array(x, dtype=dtype), ctxs)
        ys = gluon.utils.split_and_load(mx.nd.array(y, dtype=dtype), ctxs)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(len(x))
    return trainer


def _params(net, ctx):
    return {i: p.data(ctx).asnumpy() for i, p in enumerate(net.collect_params().values())}


@pytest.mark.parametrize("kvstore", ["device", "local"])
def test_group_norm_two_devices_match_one_device(kvstore):
    batches = _batches(3)
    ref = _gn_net()
    ref.initialize(mx.init.Xavier(), ctx=CTXS[0])
    ref.cast("float64")
    init = [p.data().asnumpy() for p in ref.collect_params().values()]
    net = _gn_net()
    net.initialize(ctx=CTXS)
    net.cast("float64")
    for p, v in zip(net.collect_params().values(), init):
        p.set_data(mx.nd.array(v, dtype="float64"))
    ref.hybridize()
    net.hybridize()
    _train(ref, [CTXS[0]], batches, kvstore=None)
    _train(net, CTXS, batches, kvstore=kvstore)
    want = _params(ref, CTXS[0])
    moved = 0
    for ctx in CTXS:
        got = _params(net, ctx)
        for i in want:
            np.testing.assert_allclose(got[i], want[i], *tol(np.float64))
            moved += not np.allclose(want[i], init[i])
    assert moved == 2 * len(want)  # every parameter was trained
    x = mx.nd.array(batches[0][0], dtype="float64")
    np.testing.assert_allclose(net(x.as_in_context(CTXS[1])).asnumpy(),
                               ref(x).asnumpy(), *tol(np.float64))


def test_dbn_two_devices_and_sync_running_stats(tmp_path):
    net = _dbn_net()
    net.initialize(mx.init.Xavier(), ctx=CTXS)
    net.hybridize()
    _train(net, CTXS, _batches(4), kvstore="device", dtype="float32")
    dbn = net[1]
    stats = [[p.data(c).asnumpy() for c in CTXS] for p in (dbn.running_mean, dbn.running_projection)]
    for per_ctx in stats:
        assert all(np.isfinite(a).all() for a in per_ctx)
        assert not np.allclose(per_ctx[0], per_ctx[1])  # each device saw its own half batch
    for p in net.collect_params().values():  # trainable parameters agree across devices
        if p.grad_req != "null":
            np.testing.assert_array_equal(p.data(CTXS[0]).asnumpy(), p.data(CTXS[1]).asnumpy())
            assert np.isfinite(p.data().asnumpy()).all()
    assert gn_mx.sync_running_stats(net) == 1
    for p, per_ctx in zip((dbn.running_mean, dbn.running_projection), stats):
        mean = (per_ctx[0].astype(np.float64) + per_ctx[1]) / 2
        for c in CTXS:
            np.testing.assert_allclose(p.data(c).asnumpy(), mean, rtol=1e-6, atol=1e-7)
    x = mx.nd.random.normal(shape=(4, 3, 6, 6))
    np.testing.assert_allclose(net(x.as_in_context(CTXS[0])).asnumpy(),
                               net(x.as_in_context(CTXS[1])).asnumpy(), rtol=1e-5, atol=1e-6)
    prefix = str(tmp_path / "dp")
    net.export(prefix)
    blk = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    np.testing.assert_allclose(blk(x).asnumpy(), net(x).asnumpy(), rtol=1e-5, atol=1e-6)


def test_sync_running_stats_single_context_and_non_dist_kvstore():
    net = _dbn_net()
    net.initialize(ctx=mx.cpu())
    with autograd.record():
        net(mx.nd.random.normal(shape=(8, 3, 6, 6)))
    before = net[1].running_projection.data().asnumpy()
    kv = mx.kv.create("local")
    assert gn_mx.sync_running_stats(net, kvstore=kv) == 1
    np.testing.assert_array_equal(net[1].running_projection.data().asnumpy(), before)
    assert gn_mx.sync_running_stats(_gn_net()) == 0


def test_sync_running_stats_under_set_np():
    mx.npx.set_np()
    try:
        net = _dbn_net()
        net.initialize(ctx=CTXS)
        net.hybridize()
        x = mx.np.random.normal(size=(8, 3, 6, 6))
        with autograd.record():
            for part in gluon.utils.split_and_load(x, CTXS):
                net(part)
        rm = net[1].running_mean
        assert isinstance(rm.data(CTXS[1]), mx.np.ndarray)
        per_ctx = [rm.data(c).asnumpy() for c in CTXS]
        assert not np.allclose(per_ctx[0], per_ctx[1])
        gn_mx.sync_running_stats(net)
        for c in CTXS:
            np.testing.assert_allclose(rm.data(c).asnumpy(), (per_ctx[0] + per_ctx[1]) / 2,
                                       rtol=1e-6, atol=1e-7)
    finally:
        mx.npx.reset_np()
