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
    assert "C=16 is not divisible" in msg and "divide it: 1, 2, 4, 8, 16;" in msg, msg
    assert len(_norms(net, nn.BatchNorm)) == 27 and not _norms(net, gn_mx.GroupNorm)
    # a group size divides every layer; C from the sample, so GroupNorm gets C / 8 groups
    gn_mx.replace_norm(net, group_size=8, sample=(1, 3, 32, 32))
    groups = [b._num_groups for b in _norms(net, gn_mx.GroupNorm)]
    chans = [b.gamma.shape[0] for b in _norms(net, gn_mx.GroupNorm)]
    assert len(groups) == 27 and all(c == 8 * g for c, g in zip(chans, groups)), (chans, groups)
    assert chans[:3] == [8, 8, 16]
    net.initialize()
    assert net(mx.nd.ones((2, 3, 32, 32))).shape == (2, 10)


def test_group_size_channels_from_the_graph_or_an_error():
    """Without sample=, a HybridBlock's channel counts are read from its traced graph (the
    convolution feeding each layer), so group_size works before initialize(); a plain Block has
    no graph: the error says what to pass."""
    net = vision.resnet18_v1(classes=10)
    gn_mx.replace_norm(net, group_size=16)
    groups = [b._num_groups for b in _norms(net, gn_mx.GroupNorm)]
    assert len(groups) == 20 and groups[0] == 4 and groups[-1] == 32, groups
    net.initialize()
    assert net(mx.nd.ones((1, 3, 32, 32))).shape == (1, 10)
    assert {b.gamma.shape[0] // b._num_groups for b in _norms(net, gn_mx.GroupNorm)} == {16}
    plain = nn.Sequential()
    plain.add(nn.Dense(8), nn.BatchNorm())
    with pytest.raises(ValueError, match="the channel count is unknown, so group_size=16 gives "
                                         "no num_groups: pass sample="):
        gn_mx.replace_norm(plain, group_size=16)
    assert len(_norms(plain, nn.BatchNorm)) == 1


def test_mobilenet_default_names_every_narrow_layer_up_front_and_fit_groups_converts():
    """mobilenet0_25 with the default num_groups=32, before initialize() and without sample=:
    one ValueError naming all four narrow layers with the valid num_groups (C from the traced
    graph); fit_groups=True converts it in one call, each fitted layer reported."""
    net = vision.mobilenet0_25(classes=10)
    with pytest.raises(ValueError) as e:
        gn_mx.replace_norm(net)
    msg = str(e.value)
    assert "replace_norm(GroupNorm, num_groups=32): 4 layer(s) cannot be replaced" in msg, msg
    assert "'features.1' (BatchNorm 'mobilenet" in msg and "C=8 is not divisible by " \
        "num_groups=32 (num_groups that divide it: 1, 2, 4, 8; or fit_groups=True" in msg, msg
    assert len(_norms(net, nn.BatchNorm)) == 27
    gn_mx.replace_norm(net, fit_groups=True)
    rep = net.gn_mx_report
    fitted = [(p, w) for p, w in rep.replaced if "fitted" in w]
    assert len(rep.replaced) == 27 and len(fitted) == 4, rep
    assert fitted[0][0] == "features.1" and fitted[0][1].endswith(
        "(fitted: num_groups=32 does not divide C=8)"), fitted
    assert [b._num_groups for b in _norms(net, gn_mx.GroupNorm)][:4] == [8, 8, 16, 16]
    net.initialize()
    net.hybridize()
    losses = _train(net, mx.nd.array(np.random.RandomState(0).randn(2, 3, 32, 32)),
                    mx.nd.array([1, 2]), steps=2, lr=0.01)
    assert all(np.isfinite(losses)), losses


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
                                     "or the last axis ((N, C, *spatial) or (N, *spatial, C) "
                                     "data)"}, rep
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
    assert left["1"] == ("BatchNorm(axis=2) (of unknown input rank: pass sample=): gn_mx "
                         "normalizes the channel axis 1 or the last axis ((N, C, *spatial) or "
                         "(N, *spatial, C) data)")
    assert left["2"].startswith("LayerNorm(axis=-1) (of unknown input rank: pass sample=)")
    assert [p for p, _ in net.gn_mx_report.replaced] == ["3"]
    assert isinstance(net[1], nn.BatchNorm) and isinstance(net[3], gn_mx.GroupNorm)
    # with a 4-D sample the LayerNorm over the last axis is not over channels either
    net2 = nn.HybridSequential()
    net2.add(nn.Conv2D(4, 1, in_channels=3), nn.LayerNorm())
    gn_mx.replace_norm(net2, num_groups=2, include="layer_norm", sample=(1, 3, 5, 5))
    assert dict(net2.gn_mx_report.left)["1"] == (
        "LayerNorm(axis=-1): a LayerNorm is a GroupNorm only over the channel axis 1 of (N, C) "
        "input (elsewhere it normalizes each position alone)")


def _nhwc_net(*norms):
    """NCHW input -> Conv2D -> transpose to channels last -> the given norm layers (8 channels)."""
    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, padding=1, in_channels=3),
            nn.HybridLambda(lambda F, x: F.transpose(x, axes=(0, 2, 3, 1))), *norms)
    return net


def _group_norm_nhwc_f64(x, groups, gamma, beta, eps=1e-5):
    """GroupNorm over the last axis of (N, H, W, C) data in float64 (the channels-last rule)."""
    n, c = x.shape[0], x.shape[-1]
    g = x.astype(np.float64).reshape(n, -1, groups, c // groups)
    mean = g.mean(axis=(1, 3), keepdims=True)
    var = g.var(axis=(1, 3), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(x.shape) * gamma + beta


def test_channels_last_batchnorm_becomes_group_norm_on_the_last_axis(tmp_path):
    """BatchNorm(axis=-1) and BatchNorm(axis=3) of 4-D input (told by sample=) normalize per
    channel on the last axis: each becomes GroupNorm(axis=-1) (the gamma / beta kept), checked
    against float64; without a sample axis=3 stays with the reason; DBN takes axis 1 only."""
    x = mx.nd.array(np.random.RandomState(3).randn(2, 3, 5, 5))
    net = _nhwc_net(nn.BatchNorm(axis=-1, in_channels=8), nn.BatchNorm(axis=3, in_channels=8))
    net.initialize(mx.init.Normal(1.0))
    for bn in (net[2], net[3]):
        bn.gamma.set_data(mx.nd.array(np.linspace(0.5, 2.0, 8)))
        bn.beta.set_data(mx.nd.array(np.linspace(-1.0, 1.0, 8)))
    left_alone = _nhwc_net(nn.BatchNorm(axis=3, in_channels=8))
    gn_mx.replace_norm(left_alone, num_groups=4)
    assert dict(left_alone.gn_mx_report.left)["2"].startswith(
        "BatchNorm(axis=3) (of unknown input rank: pass sample=)")
    dbn = _nhwc_net(nn.BatchNorm(axis=-1, in_channels=8))
    gn_mx.replace_norm(dbn, norm=gn_mx.DecorrelatedBatchNorm, num_groups=2)
    assert dict(dbn.gn_mx_report.left)["2"] == (
        "BatchNorm(axis=-1): DecorrelatedBatchNorm normalizes the channel axis 1 only "
        "(GroupNorm takes the last axis: norm=gn_mx.GroupNorm)")

    gn_mx.replace_norm(net, num_groups=4, sample=x)
    assert [p for p, _ in net.gn_mx_report.replaced] == ["2", "3"], net.gn_mx_report
    assert all(isinstance(net[i], gn_mx.GroupNorm) and net[i]._axis == -1 for i in (2, 3))
    conv = net[1](net[0](x)).asnumpy()
    gamma, beta = np.linspace(0.5, 2.0, 8), np.linspace(-1.0, 1.0, 8)
    want = _group_norm_nhwc_f64(_group_norm_nhwc_f64(conv, 4, gamma, beta), 4, gamma, beta)
    np.testing.assert_allclose(net(x).asnumpy(), want, rtol=1e-4, atol=1e-4)
    net.hybridize()
    np.testing.assert_allclose(net(x).asnumpy(), want, rtol=1e-4, atol=1e-4)
    _export_and_reload(net, x, tmp_path, {"gn_group_norm": 2})
    nodes = json.load(open(str(tmp_path / "model-symbol.json")))["nodes"]  # export_and_reload's
    assert [n["attrs"].get("axis") for n in nodes if n["op"] == "gn_group_norm"] == ["-1"] * 2


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


# ------------------------------------------------------------------------------------------------
# Inside SymbolBlocks (issue 40.1): the graph's BatchNorm nodes become gn_group_norm nodes

def _graph_ops(block):
    return [n["op"] for n in json.loads(block._cached_graph[1].tojson())["nodes"]]


def test_symbolblock_imports_of_model_zoo_net_matches_the_block_path(tmp_path):
    """SymbolBlock.imports of an exported ResNet-18: one replace_norm call replaces all 20
    BatchNorm nodes (the block walk alone saw none), the output equals the same net converted
    block by block (same values through another path), it trains, and export + fresh-process
    reload gives the same output with no BatchNorm and no running statistics left."""
    mx.random.seed(0)
    net = vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    rs = np.random.RandomState(0)
    x = mx.nd.array(rs.randn(2, 3, 32, 32))
    net(x)
    prefix = str(tmp_path / "bn")
    net.export(prefix)
    sb = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    assert _graph_ops(sb).count("BatchNorm") == 20
    out = gn_mx.replace_norm(sb)
    rep = sb.gn_mx_report
    assert out is sb and len(rep.replaced) == 20 and rep.left == [], rep
    assert rep.replaced[0] == (f"{net.prefix}batchnorm0_fwd",
                               "BatchNorm(C=64) node -> gn_group_norm(num_groups=32, eps=1e-05)")
    assert "BatchNorm" not in _graph_ops(sb) and _graph_ops(sb).count("gn_group_norm") == 20
    names = list(sb.collect_params().keys())
    assert not [k for k in names if "running" in k], names
    want = gn_mx.replace_norm(net)(x)  # the block path, same gamma/beta values (copy_affine)
    np.testing.assert_allclose(sb(x).asnumpy(), want.asnumpy(), rtol=1e-5, atol=1e-6)
    sb.hybridize()
    losses = _train(sb, x, mx.nd.array([1, 3]), steps=3, lr=0.0005)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert _batch_independent(sb, x) < 1e-4
    _export_and_reload(sb, x, tmp_path, {"gn_group_norm": 20})


def _conv_bn_symbolblock(channels=4, **bn_attrs):
    data = mx.sym.var("data")
    y = mx.sym.Convolution(data, num_filter=channels, kernel=(3, 3), pad=(1, 1), name="conv")
    y = mx.sym.BatchNorm(y, name="bn", **bn_attrs)
    sb = gluon.SymbolBlock(mx.sym.relu(y, name="out"), data)
    sb.initialize(mx.init.Normal(1.0))
    sb(mx.nd.zeros((1, 3, 5, 5)))
    return sb


def _group_norm_f64(x, groups, gamma, beta, eps):
    n, c = x.shape[:2]
    g = x.astype(np.float64).reshape(n, groups, -1)
    y = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)
    return y.reshape(x.shape) * gamma.reshape(1, c, 1, 1) + beta.reshape(1, c, 1, 1)


@pytest.mark.parametrize("fix_gamma", [False, True])
@pytest.mark.parametrize("copy_affine", [True, False])
def test_symbolblock_node_against_float64_group_norm(fix_gamma, copy_affine):
    """The rewritten node is GroupNorm on the old gamma/beta (ones when the BatchNorm fixed its
    gamma; ones / zeros without copy_affine), against a float64 reference."""
    sb = _conv_bn_symbolblock(fix_gamma=fix_gamma, eps=1e-3)
    gamma, beta = sb.params.get("bn_gamma"), sb.params.get("bn_beta")
    g0, b0 = gamma.data().asnumpy(), beta.data().asnumpy()
    gn_mx.replace_norm(sb, num_groups=2, copy_affine=copy_affine)
    assert sb.gn_mx_report.replaced == [
        ("bn", "BatchNorm(C=4) node -> gn_group_norm(num_groups=2, eps=0.001)")]
    assert sorted(sb.collect_params().keys()) == ["bn_beta", "bn_gamma", "conv_bias",
                                                  "conv_weight"]
    g_want = np.ones(4) if fix_gamma or not copy_affine else g0
    b_want = b0 if copy_affine else np.zeros(4)
    assert (gamma.grad_req == "null") == fix_gamma
    x = mx.nd.array(np.random.RandomState(1).randn(2, 3, 5, 5))
    conv = mx.nd.Convolution(x, sb.params.get("conv_weight").data(),
                             sb.params.get("conv_bias").data(), num_filter=4, kernel=(3, 3),
                             pad=(1, 1)).asnumpy()
    want = np.maximum(_group_norm_f64(conv, 2, g_want, b_want, 1e-3), 0)
    np.testing.assert_allclose(sb(x).asnumpy(), want, rtol=1e-4, atol=1e-4)


def test_symbolblock_nodes_that_stay_or_cannot_be_divided():
    sb = _conv_bn_symbolblock(channels=6)
    with pytest.raises(ValueError, match=r"'bn' \(BatchNorm node\): C=6 is not divisible by "
                                         r"num_groups=4"):
        gn_mx.replace_norm(sb, num_groups=4)
    assert "BatchNorm" in _graph_ops(sb)  # nothing changed
    gn_mx.replace_norm(sb, norm=gn_mx.DecorrelatedBatchNorm)
    assert sb.gn_mx_report.left == [("bn", "BatchNorm node: inside a SymbolBlock only GroupNorm "
                                           "replaces BatchNorm (DecorrelatedBatchNorm is not "
                                           "supported there)")]
    assert str(sb.gn_mx_report).splitlines()[0] == "gn_mx.replace_norm: 0 replaced, 1 left in place"
    sb = _conv_bn_symbolblock(axis=3)
    gn_mx.replace_norm(sb, num_groups=1)
    assert "BatchNorm(axis=3) node" in sb.gn_mx_report.left[0][1]


def test_symbolblock_channels_last_node_against_float64():
    """A BatchNorm(axis=-1) node (channels last) becomes gn_group_norm with axis=-1, reported so,
    against the float64 channels-last GroupNorm on the old gamma / beta."""
    data = mx.sym.var("data")
    y = mx.sym.Convolution(data, num_filter=8, kernel=(3, 3), pad=(1, 1), name="conv")
    y = mx.sym.BatchNorm(mx.sym.transpose(y, axes=(0, 2, 3, 1)), axis=-1, fix_gamma=False,
                         name="bn")
    sb = gluon.SymbolBlock(y, data)
    sb.initialize(mx.init.Normal(1.0))
    x = mx.nd.array(np.random.RandomState(4).randn(2, 3, 5, 5))
    sb(x)
    g0, b0 = sb.params.get("bn_gamma").data().asnumpy(), sb.params.get("bn_beta").data().asnumpy()
    gn_mx.replace_norm(sb, num_groups=2)
    assert sb.gn_mx_report.replaced == [
        ("bn", "BatchNorm(C=8) node -> gn_group_norm(num_groups=2, eps=0.001, axis=-1)")]
    conv = mx.nd.Convolution(x, sb.params.get("conv_weight").data(),
                             sb.params.get("conv_bias").data(), num_filter=8, kernel=(3, 3),
                             pad=(1, 1)).asnumpy().transpose(0, 2, 3, 1)
    np.testing.assert_allclose(sb(x).asnumpy(), _group_norm_nhwc_f64(conv, 2, g0, b0, 1e-3),
                               rtol=1e-4, atol=1e-4)


def test_symbolblock_as_a_child():
    """A SymbolBlock inside a Gluon tree (GluonCV's FeatureExpander backbones) is found and its
    nodes are reported under the child's path; the tree's own BatchNorm is replaced too."""
    net = nn.HybridSequential()
    net.add(_conv_bn_symbolblock(), nn.BatchNorm(in_channels=4))
    net[1].initialize()
    gn_mx.replace_norm(net, num_groups=2)
    assert [p for p, _ in net.gn_mx_report.replaced] == ["1", "0:bn"]
    net.hybridize()
    assert net(mx.nd.ones((1, 3, 5, 5))).shape == (1, 4, 5, 5)


def test_layer_errors_name_the_layer_and_the_fix():
    """The dtype and num_groups errors of a GroupNorm (issue 40.4): the layer's name and what to
    do, not the op's message."""
    layer = gn_mx.GroupNorm(num_groups=2, prefix="gn_")
    layer.initialize()
    with pytest.raises(ValueError, match=r"GroupNorm 'gn': the input is float64 but gamma is "
                                         r"float32: cast the layer \(or the whole net\) to the "
                                         r"data's dtype, net.cast\('float64'\), or the data to "
                                         r"the layer's, x.astype\('float32'\)"):
        layer(mx.nd.ones((2, 4, 3), dtype="float64"))
    assert layer(mx.nd.ones((2, 4, 3), dtype="float16")).dtype == np.float16  # fp32 gamma: fine
    layer.cast("float64")
    assert layer(mx.nd.ones((2, 4, 3), dtype="float64")).dtype == np.float64
    bad = gn_mx.GroupNorm(num_groups=3, prefix="gn3_")
    bad.initialize()
    with pytest.raises(ValueError, match=r"GroupNorm 'gn3': channels \(C=4\) must be divisible by "
                                         r"num_groups \(3\) .*divisors of C: 1, 2, 4$"):
        bad(mx.nd.ones((2, 4, 3)))
