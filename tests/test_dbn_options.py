"""DecorrelatedBatchNorm's BatchNorm-style options: use_global_stats and group_size.

References: float64 numpy (tests/reference.py) and central finite differences.
"""
import json

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import tol
from reference import dbn_inference_ref, dbn_ref, numeric_grad

CPU = mx.cpu()
EPS = 1e-5


def _data(shape, dtype=np.float32):
    x = np.random.randn(*shape)
    x[:, 1:] += 0.6 * x[:, :-1]
    return (x + 0.5).astype(dtype)


def _set_stats(blk, G, D, dtype=np.float32, seed=3):
    rng = np.random.RandomState(seed)
    rm = (0.2 * rng.randn(G * D)).astype(dtype)
    rp = (np.eye(D) + 0.2 * rng.randn(G, D, D)).astype(dtype)
    blk.running_mean.set_data(mx.nd.array(rm, dtype=dtype))
    blk.running_projection.set_data(mx.nd.array(rp, dtype=dtype))
    return rm, rp


# ---------------------------------------------------------------------------------------------
# use_global_stats

@pytest.mark.parametrize("hybrid", [None, {}, {"static_alloc": True}], ids=str)
def test_use_global_stats_trains_with_running_stats(hybrid):
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, use_global_stats=True, in_channels=6,
                                      gamma_initializer=mx.init.Uniform(1.0),
                                      beta_initializer=mx.init.Uniform(1.0))
    blk.initialize(ctx=CPU)
    rm, rp = _set_stats(blk, 2, 3)
    if hybrid is not None:
        blk.hybridize(**hybrid)
    x = _data((5, 6, 4))
    dy = np.random.randn(*x.shape).astype(np.float32)
    xs = mx.nd.array(x)
    xs.attach_grad()
    with autograd.record():  # training mode: still the running statistics
        y = blk(xs)
    y.backward(mx.nd.array(dy))
    g = blk.gamma.data().asnumpy().reshape(1, 6, 1)
    b = blk.beta.data().asnumpy().reshape(1, 6, 1)
    xhat = dbn_inference_ref(x, rm, rp, 2)
    np.testing.assert_allclose(y.asnumpy(), xhat * g + b, rtol=1e-5, atol=1e-5)
    # dx = P^T (gamma * dy) per group
    dxhat = (dy * g).astype(np.float64)
    ref_dx = np.empty_like(dxhat)
    for grp in range(2):
        sl = slice(3 * grp, 3 * grp + 3)
        ref_dx[:, sl] = np.einsum("ji,njs->nis", rp[grp].astype(np.float64), dxhat[:, sl])
    np.testing.assert_allclose(xs.grad.asnumpy(), ref_dx, *tol(np.float32))
    np.testing.assert_allclose(blk.gamma.grad().asnumpy(), (dy * xhat).sum(axis=(0, 2)),
                               rtol=1e-4, atol=1e-4)
    mx.nd.waitall()
    np.testing.assert_array_equal(blk.running_mean.data().asnumpy(), rm)  # aux not updated
    np.testing.assert_array_equal(blk.running_projection.data().asnumpy(), rp)
    # one graph for both modes: inference gives the same output
    np.testing.assert_allclose(blk(xs).asnumpy(), y.asnumpy(), rtol=1e-6, atol=1e-6)
    assert not gn_mx._hybrid.is_mode_keyed(blk)


def test_use_global_stats_finite_differences_float64():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, use_global_stats=True, in_channels=4,
                                      gamma_initializer=mx.init.Uniform(1.0))
    blk.initialize(ctx=CPU)
    blk.cast("float64")
    _set_stats(blk, 2, 2, np.float64)
    x = _data((3, 4, 2), np.float64)
    dy = np.random.randn(*x.shape)

    def f(v):
        with autograd.record():
            return float((blk(mx.nd.array(v, dtype=np.float64)) * mx.nd.array(dy, dtype=np.float64)
                          ).sum().asscalar())

    xs = mx.nd.array(x, dtype=np.float64)
    xs.attach_grad()
    with autograd.record():
        y = blk(xs)
    y.backward(mx.nd.array(dy, dtype=np.float64))
    np.testing.assert_allclose(xs.grad.asnumpy(), numeric_grad(f, x), rtol=1e-6, atol=1e-8)


def test_use_global_stats_export_and_default_off(tmp_path):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 1), gn_mx.DecorrelatedBatchNorm(num_groups=2, use_global_stats=True))
    net.initialize(ctx=CPU)
    net.hybridize()
    x = mx.nd.array(_data((2, 3, 4, 4)))
    with autograd.record():
        y = net(x)
    prefix = str(tmp_path / "ugs")
    net.export(prefix)
    ops = [n["op"] for n in json.load(open(prefix + "-symbol.json"))["nodes"]]
    assert "gn_dbn_inference" in ops and "gn_dbn" not in ops
    blk = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    np.testing.assert_allclose(blk(x).asnumpy(), y.asnumpy(), rtol=1e-5, atol=1e-6)
    assert gn_mx.DecorrelatedBatchNorm()._use_global_stats is False


# ---------------------------------------------------------------------------------------------
# group_size

@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("in_channels", [0, 12])
def test_group_size_equals_num_groups(hybridize, in_channels):
    x = _data((8, 12, 3))
    outs = []
    for kw in ({"group_size": 4}, {"num_groups": 3}):
        blk = gn_mx.DecorrelatedBatchNorm(in_channels=in_channels, momentum=0.5, **kw)
        blk.initialize(ctx=CPU)
        if hybridize:
            blk.hybridize()
        with autograd.record():
            y = blk(mx.nd.array(x))
        outs.append((y.asnumpy(), blk.running_projection.data().asnumpy(), blk(mx.nd.array(x))
                     .asnumpy()))
        assert blk.running_projection.shape == (3, 4, 4)
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(outs[0][0], dbn_ref(x, 3, EPS)[0], rtol=1e-4, atol=1e-4)
    assert "group_size=4" in repr(blk.__class__(group_size=4))


@pytest.mark.parametrize("hybridize", [False, True])
def test_group_size_deferred_inside_containers(tmp_path, hybridize):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3), gn_mx.GroupNorm(num_groups=4),
            gn_mx.DecorrelatedBatchNorm(group_size=8), gluon.nn.Conv2D(8, 1),
            gn_mx.DecorrelatedBatchNorm(group_size=2))
    net.initialize(ctx=CPU)
    if hybridize:
        net.hybridize()
    x = mx.nd.array(_data((4, 3, 6, 6)))
    with autograd.record():
        y = net(x)
    y.backward()
    assert net[2].running_projection.shape == (2, 8, 8)
    assert net[4].running_projection.shape == (4, 2, 2)
    assert np.isfinite(net[0].weight.grad().asnumpy()).all()
    if hybridize:
        prefix = str(tmp_path / "gs")
        net.export(prefix)
        nodes = json.load(open(prefix + "-symbol.json"))["nodes"]
        groups = [n["attrs"]["num_groups"] for n in nodes if n["op"] == "gn_dbn_inference"]
        assert groups == ["2", "4"]
        blk = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
        np.testing.assert_allclose(blk(x).asnumpy(), net(x).asnumpy(), rtol=1e-5, atol=1e-5)


def test_grouping_errors():
    D = gn_mx.DecorrelatedBatchNorm
    with pytest.raises(ValueError, match="not both"):
        D(num_groups=2, group_size=4)
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="group_size must be a positive integer"):
            D(group_size=bad)
    with pytest.raises(ValueError, match=r"in_channels \(10\) must be divisible by group_size \(4\)"):
        D(group_size=4, in_channels=10)
    with pytest.raises(ValueError, match="divisible by num_groups"):
        D(num_groups=4, in_channels=10)
    assert D()._num_groups == 16  # neither given: the old default
    for hybridize in (False, True):
        blk = D(group_size=4)
        blk.initialize(ctx=CPU)
        if hybridize:
            blk.hybridize()
        with pytest.raises(ValueError, match=r"\(10\) must be divisible by group_size \(4\)"):
            blk(mx.nd.ones((2, 10, 3)))
