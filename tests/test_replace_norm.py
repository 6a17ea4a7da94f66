"""gn_mx.replace_norm: BatchNorm (and InstanceNorm / LayerNorm) layers of existing nets replaced by
gn_mx layers, then trained hybridized, exported and reloaded in a fresh process: MXNet's model zoo
(ResNet-18 v1, MobileNet 0.25; pretrained=False, nothing is downloaded) and a GluonCV-style net
(norm_layer / norm_kwargs constructor)."""
import json

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn
from mxnet.gluon.model_zoo import vision

import gn_mx
from conftest import export_and_reload


def _norms(net, cls):
    return [b for b in _blocks(net) if isinstance(b, cls)]


def _blocks(net):
    out = []

    def walk(b):
        for c in b._children.values():
            out.append(c)
            walk(c)
    walk(net)
    return out


def _param_names(net, suffixes=("gamma", "beta")):
    return sorted(k for k in net.collect_params().keys() if k.endswith(suffixes))


def _train(net, x, label, steps=3, lr=0.05):
    """A few SGD steps (hybridized nets: the training graph); the losses."""
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), label)
        loss.backward()
        trainer.step(x.shape[0])
        losses.append(float(loss.mean().asscalar()))
    return losses


def _export_and_reload(net, x, tmp_path, ops):
    """Export (the symbol holds `ops` and no BatchNorm), reload in a fresh process with nothing
    but `import gn_mx`, and compare that process's output with this one's."""
    scale = max(1.0, float(np.abs(net(x).asnumpy()).max()))
    prefix = export_and_reload(net, [x.asnumpy()], tmp_path, rtol=0, atol=1e-4 * scale)
    graph_ops = [n["op"] for n in json.load(open(prefix + "-symbol.json"))["nodes"]]
    for op, count in ops.items():
        assert graph_ops.count(op) == count, (op, sorted(set(graph_ops)))
    assert "BatchNorm" not in graph_ops


def _batch_independent(net, x):
    """In training mode, sample 0's output does not depend on the rest of the batch: no
    BatchNorm (batch statistics) is left in the graph. Returns the max difference."""
    with autograd.record():
        full = net(x).asnumpy()
        alone = net(x[0:1]).asnumpy()
    return np.abs(full[0] - alone[0]).max()


def test_resnet18_v1_group_norm_trains_exports_reloads(tmp_path):
    net = vision.resnet18_v1(classes=10)  # before initialize(): channel counts unknown
    bn_names = _param_names(net)
    n_bn = len(_norms(net, nn.BatchNorm))
    assert n_bn == 20
    out = gn_mx.replace_norm(net, num_groups=32)
    assert out is net
    rep = net.gn_mx_report
    assert len(rep.replaced) == 20 and rep.left == [], rep
    assert not _norms(net, nn.BatchNorm) and len(_norms(net, gn_mx.GroupNorm)) == 20
    assert rep.replaced[0][0] == "features.1" and "BatchNorm(C=?) -> GroupNorm(num_groups=32" \
        in rep.replaced[0][1], rep
    assert _param_names(net) == bn_names  # same slots, same prefixes: same parameter names
    assert isinstance(net.features[1], gn_mx.GroupNorm)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    rs = np.random.RandomState(0)
    x = mx.nd.array(rs.randn(4, 3, 32, 32))
    label = mx.nd.array([1, 3, 5, 7])
    losses = _train(net, x, label, steps=4, lr=0.005)
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert net.features[1].gamma.shape == (64,)
    assert _batch_independent(net, x) < 1e-4
    _export_and_reload(net, x, tmp_path, {"gn_group_norm": 20})


def test_resnet18_v1_batchnorm_is_batch_dependent():
    """The property used above can fail: with BatchNorm it does."""
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.array(np.random.RandomState(0).randn(4, 3, 32, 32))
    assert _batch_independent(net, x) > 1e-2


def test_mobilenet_dbn_after_initialize_trains_exports_reloads(tmp_path):
    net = vision.mobilenet0_25(classes=10)
    net.initialize(mx.init.Xavier())  # deferred: C still unknown
    n_bn = len(_norms(net, nn.BatchNorm))
    gn_mx.replace_norm(net, norm=gn_mx.DecorrelatedBatchNorm, group_size=8)
    assert len(net.gn_mx_report.replaced) == n_bn == 27
    dbns = _norms(net, gn_mx.DecorrelatedBatchNorm)
    assert len(dbns) == n_bn and not _norms(net, nn.BatchNorm)
    assert all(d._group_size == 8 and d._momentum == 0.9 for d in dbns)
    net.hybridize()
    rs = np.random.RandomState(1)
    x = mx.nd.array(rs.randn(8, 3, 32, 32))
    label = mx.nd.array(rs.randint(0, 10, 8))
    losses = _train(net, x, label, steps=3, lr=0.02)
    assert all(np.isfinite(losses)), losses
    first = dbns[0]  # C = 8: one group of 8, the running statistics moved
    assert first.running_projection.shape == (1, 8, 8)
    assert np.abs(first.running_projection.data().asnumpy() - np.eye(8)).max() > 1e-3
    _export_and_reload(net, x, tmp_path, {"gn_dbn_inference": n_bn})


def test_mobilenet_group_size_needs_divisible_channels():
    """num_groups=32 cannot divide MobileNet 0.25's C = 8 / 16 layers: one ValueError naming every
    such layer (with sample=: C is inferred by shape inference before initialize()), nothing
    changed."""
    net = vision.mobilenet0_25(classes=10)
    with pytest.raises(ValueError) as e:
        gn_mx.replace_norm(net, num_groups=32, sample=mx.nd.zeros((1, 3, 32, 32)))
    msg = str(e.value)
    assert "replace_norm(GroupNorm, num_groups=32): 4 layer(s) cannot be replaced" in msg, msg
    assert "'features.1' (BatchNorm 'mobilenet" in msg and "C=8 is not divisible by num_groups=32" \
        in msg, msg
    assert "C=16 is not divisible" in msg, msg
    assert len(_norms(net, nn.BatchNorm)) == 27 and not _norms(net, gn_mx.GroupNorm)
    # a group size divides every layer; C from the sample, so GroupNorm gets C / 8 groups
    gn_mx.replace_norm(net, group_size=8, sample=(1, 3, 32, 32))
    groups = [b._num_groups for b in _norms(net, gn_mx.GroupNorm)]
    chans = [b.gamma.shape[0] for b in _norms(net, gn_mx.GroupNorm)]
    assert len(groups) == 27 and all(c == 8 * g for c, g in zip(chans, groups)), (chans, groups)
    assert chans[:3] == [8, 8, 16]
    net.initialize()
    assert net(mx.nd.ones((2, 3, 32, 32))).shape == (2, 10)


def test_group_size_with_unknown_channels_is_an_error():
    net = vision.resnet18_v1(classes=10)
    with pytest.raises(ValueError, match="the channel count is unknown, so group_size=16 gives "
                                         "no num_groups: pass sample="):
        gn_mx.replace_norm(net, group_size=16)
    assert len(_norms(net, nn.BatchNorm)) == 20


def gluoncv_style_net(norm_layer=nn.BatchNorm, norm_kwargs=None, classes=5):
    """A small net written the way GluonCV's constructors are: every norm layer made by
    ``norm_layer(**norm_kwargs)``, some with in_channels, plus other norm kinds."""
    norm_kwargs = norm_kwargs or {}
    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Conv2D(16, 3, padding=1), norm_layer(**norm_kwargs), nn.Activation("relu"))
        body = nn.HybridSequential()
        with body.name_scope():
            body.add(nn.Conv2D(32, 3, padding=1, strides=2),
                     norm_layer(in_channels=32, **norm_kwargs), nn.Activation("relu"),
                     nn.Conv2D(32, 1), nn.InstanceNorm(), nn.LayerNorm(axis=1),
                     nn.Conv2D(32, 1), nn.InstanceNorm(axis=2))  # axis 2: stays
        net.add(body, nn.GlobalAvgPool2D(), nn.Flatten(), nn.Dense(16), nn.LayerNorm(),
                nn.Dense(classes))
    return net


def test_gluoncv_style_net_every_kind(tmp_path):
    net = gluoncv_style_net(norm_kwargs={"momentum": 0.8, "epsilon": 1e-4})
    names = _param_names(net)
    x = mx.nd.array(np.random.RandomState(2).randn(4, 3, 8, 8))
    gn_mx.replace_norm(net, num_groups=4, include=("batch_norm", "instance_norm", "layer_norm"),
                       sample=x)
    rep = net.gn_mx_report
    replaced = dict(rep.replaced)
    assert sorted(replaced) == ["1", "3.1", "3.4", "3.5", "7"], rep
    assert "InstanceNorm(C=32) -> GroupNorm(num_groups=4" in replaced["3.4"]
    # (N, C) input: the LayerNorm's last axis is C
    assert "LayerNorm(C=16) -> GroupNorm(num_groups=4" in replaced["7"]
    assert dict(rep.left) == {"3.7": "InstanceNorm(axis=2): gn_mx normalizes the channel axis 1 "
                                     "of (N, C, *spatial) data"}, rep
    assert net[1]._epsilon == 1e-4 and net[1].gamma.shape == (16,)  # eps kept, C from the sample
    assert _param_names(net) == names
    net.initialize(mx.init.Xavier())
    net.hybridize()
    losses = _train(net, x, mx.nd.array([0, 1, 2, 3]), steps=4)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    _export_and_reload(net, x, tmp_path, {"gn_group_norm": 5})


def test_other_axes_and_unknown_rank_stay_with_reason():
    """(MXNet's own BatchNorm(axis=2) cannot train on CPU here: "Check failed: !is_view"; it is
    only replaced-or-not, not trained.)"""
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 1, in_channels=3), nn.BatchNorm(axis=2), nn.LayerNorm(),
            nn.BatchNorm(in_channels=4))
    gn_mx.replace_norm(net, num_groups=2, include=("batch_norm", "layer_norm"))
    left = dict(net.gn_mx_report.left)
    assert left["1"] == ("BatchNorm(axis=2): gn_mx normalizes the channel axis 1 of "
                         "(N, C, *spatial) data")
    assert left["2"].startswith("LayerNorm(axis=-1) (of unknown input rank: pass sample=)")
    assert [p for p, _ in net.gn_mx_report.replaced] == ["3"]
    assert isinstance(net[1], nn.BatchNorm) and isinstance(net[3], gn_mx.GroupNorm)
    # with a 4-D sample the LayerNorm over the last axis is not over channels either
    net2 = nn.HybridSequential()
    net2.add(nn.Conv2D(4, 1, in_channels=3), nn.LayerNorm())
    gn_mx.replace_norm(net2, num_groups=2, include="layer_norm", sample=(1, 3, 5, 5))
    assert dict(net2.gn_mx_report.left)["1"] == ("LayerNorm(axis=-1): gn_mx normalizes the "
                                                 "channel axis 1 of (N, C, *spatial) data")


def test_gluoncv_style_net_dbn_keeps_batchnorm_options():
    net = gluoncv_style_net(norm_kwargs={"momentum": 0.8, "use_global_stats": True})
    gn_mx.replace_norm(net, norm=gn_mx.DecorrelatedBatchNorm, num_groups=2)
    d = net[1]
    assert isinstance(d, gn_mx.DecorrelatedBatchNorm)
    assert d._momentum == 0.8 and d._use_global_stats and d._num_groups == 2
    assert isinstance(net[3][4], nn.InstanceNorm)  # not included by default


def test_initialized_net_fine_tuning_copies_affine():
    """After initialize() and a forward (C known, values present), hybridized: gamma/beta carry
    over (copy_affine), the hybridized state stays, and the next call runs the new graph."""
    def make():
        net = gluoncv_style_net()
        net.initialize(mx.init.Xavier())
        net.hybridize()
        x = mx.nd.array(np.random.RandomState(3).randn(2, 3, 8, 8))
        net(x)
        rs = np.random.RandomState(4)
        for p in net.collect_params(".*batchnorm.*_(gamma|beta)").values():
            p.set_data(mx.nd.array(rs.rand(*p.shape) + 0.5))
        return net, x

    net, x = make()
    old_gamma = net[1].gamma.data().asnumpy()
    before = net(x).asnumpy()
    gn_mx.replace_norm(net, num_groups=8)
    assert isinstance(net[1], gn_mx.GroupNorm) and net[1]._active
    np.testing.assert_array_equal(net[1].gamma.data().asnumpy(), old_gamma)
    after = net(x).asnumpy()
    assert np.abs(after - before).max() > 1e-3  # the BatchNorms are gone from the cached graph
    # the new layer computes GroupNorm: compare with a float64 reference on its input
    feat = net[0](x).asnumpy().astype(np.float64)
    g = feat.reshape(2, 8, -1)
    ref = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)).reshape(
        feat.shape) * old_gamma[None, :, None, None] + net[1].beta.data().asnumpy()[None, :, None,
                                                                                    None]
    np.testing.assert_allclose(net[1](net[0](x)).asnumpy(), ref, rtol=1e-4, atol=1e-4)

    net, _ = make()
    gn_mx.replace_norm(net, num_groups=8, copy_affine=False)
    np.testing.assert_array_equal(net[1].gamma.data().asnumpy(), np.ones(16))


def test_norm_kwargs_and_a_norm_layer_itself():
    bn = nn.BatchNorm(in_channels=6, prefix="bn_")
    new = gn_mx.replace_norm(bn, num_groups=3, activation="relu")
    assert isinstance(new, gn_mx.GroupNorm) and new.prefix == "bn_"
    assert repr(new) == ("GroupNorm(num_groups=3, eps=1e-05, center=True, scale=True, "
                         "in_channels=6, activation='relu')")
    assert len(new.gn_mx_report.replaced) == 1
    relu_bn = nn.BatchNormReLU(in_channels=4) if hasattr(nn, "BatchNormReLU") else None
    if relu_bn is not None:
        seq = nn.HybridSequential()
        seq.add(relu_bn)
        gn_mx.replace_norm(seq, num_groups=2)
        assert seq[0]._act == "relu"
        seq2 = nn.HybridSequential()
        seq2.add(nn.BatchNormReLU(in_channels=4))
        gn_mx.replace_norm(seq2, norm=gn_mx.DecorrelatedBatchNorm, num_groups=2)
        assert "fused ReLU" in dict(seq2.gn_mx_report.left)["0"]


@pytest.mark.parametrize("kwargs, exc, text", [
    (dict(norm=nn.GroupNorm), TypeError, "norm must be gn_mx.GroupNorm or"),
    (dict(num_groups=2, group_size=2), ValueError, "give num_groups or group_size, not both"),
    (dict(num_groups=0), ValueError, "num_groups must be a positive int, got 0"),
    (dict(group_size=2.0), ValueError, "group_size must be a positive int, got 2.0"),
    (dict(include=("batchnorm",)), ValueError, "unknown kind(s) ['batchnorm'] in include"),
    (dict(in_channels=4), TypeError, "in_channels come(s) from the replaced layer"),
])
def test_bad_arguments(kwargs, exc, text):
    net = nn.HybridSequential()
    net.add(nn.BatchNorm(in_channels=4))
    with pytest.raises(exc) as e:
        gn_mx.replace_norm(net, **kwargs)
    assert text in str(e.value)
    assert isinstance(net[0], nn.BatchNorm)


def test_non_hybrid_block_with_sample():
    """A plain (non-hybrid) Block: sample= runs one predict-mode forward (needs initialize())."""
    class Net(gluon.Block):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.conv = nn.Conv2D(12, 1)
                self.bn = nn.BatchNorm()

        def forward(self, x):
            return self.bn(self.conv(x))

    net = Net()
    with pytest.raises(ValueError, match="needs an initialized block"):
        gn_mx.replace_norm(net, group_size=4, sample=(2, 3, 4, 4))
    net.initialize()
    gn_mx.replace_norm(net, group_size=4, sample=(2, 3, 4, 4))
    assert isinstance(net.bn, gn_mx.GroupNorm) and net.bn._num_groups == 3
    assert net(mx.nd.ones((2, 3, 4, 4))).shape == (2, 12, 4, 4)
