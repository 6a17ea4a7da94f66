"""gn_mx layers as ``norm_layer`` of model-zoo constructors (GluonCV calling conventions).

The constructor below is written here in the style of GluonCV's ResNet/darknet builders: each stage
creates its norm layers with one of the three conventions seen in model zoos.
"""
import warnings

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gn_mx
from reference import group_norm_ref

CPU = mx.cpu()


class _Block(nn.HybridBlock):
    """conv-norm-relu-conv-norm + shortcut; `style` picks how the norm layers are created."""

    def __init__(self, channels, in_channels, style, norm_layer, norm_kwargs, **kwargs):
        super().__init__(**kwargs)
        nk = {} if norm_kwargs is None else norm_kwargs
        with self.name_scope():
            self.conv1 = nn.Conv2D(channels, 3, padding=1, use_bias=False, in_channels=in_channels)
            self.conv2 = nn.Conv2D(channels, 3, padding=1, use_bias=False, in_channels=channels)
            if style == "kwargs":          # GluonCV BasicBlockV1b: norm_layer(**norm_kwargs)
                self.bn1 = norm_layer(**nk)
                self.bn2 = norm_layer(**nk)
            elif style == "in_channels":   # ResNetV1/V2: norm_layer(in_channels=c, **norm_kwargs)
                self.bn1 = norm_layer(in_channels=channels, **nk)
                self.bn2 = norm_layer(in_channels=channels, **nk)
            else:                          # darknet / CenterNet heads: BatchNorm's own keywords
                self.bn1 = norm_layer(epsilon=1e-5, momentum=0.9, use_global_stats=False,
                                      axis=1, **nk)
                self.bn2 = norm_layer(gamma_initializer="zeros", momentum=0.9,  # last_gamma
                                      running_variance_initializer="ones", **nk)
            self.down = nn.Conv2D(channels, 1, use_bias=False, in_channels=in_channels)

    def hybrid_forward(self, F, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet_like(style, norm_layer=nn.BatchNorm, norm_kwargs=None, classes=5):
    net = nn.HybridSequential()
    with net.name_scope():
        net.add(_Block(16, 3, style, norm_layer, norm_kwargs), _Block(32, 16, style, norm_layer,
                                                                      norm_kwargs),
                nn.GlobalAvgPool2D(), nn.Dense(classes))
    return net


def _norms(net):
    out = []
    net.apply(lambda b: out.append(b) if isinstance(b, (gn_mx.GroupNorm,
                                                        gn_mx.DecorrelatedBatchNorm)) else None)
    return out


def _train(net, steps=2):
    net.initialize(mx.init.Xavier(), ctx=CPU)
    net.hybridize()
    x = mx.nd.random.normal(shape=(4, 3, 8, 8))
    label = mx.nd.array([0, 1, 2, 3])
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), label)
        loss.backward()
        trainer.step(4)
    return x, net(x)


@pytest.mark.filterwarnings("ignore:gn_mx.norm_layer")
@pytest.mark.parametrize("style", ["kwargs", "in_channels", "bn_keywords"])
def test_group_norm_factory_in_each_calling_convention(style):
    factory = gn_mx.norm_layer(num_groups=4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        net = resnet_like(style, norm_layer=factory)
    msgs = [str(m.message) for m in w if "gn_mx.norm_layer" in str(m.message)]
    if style == "bn_keywords":
        # one warning per new set of dropped names (bn1's keywords, then bn2's new one), never
        # repeated for the second residual block
        assert len(msgs) == 2, msgs
        assert "momentum" in msgs[0] and "use_global_stats" in msgs[0] and "axis" not in msgs[0]
        assert "running_variance_initializer" in msgs[1] and "momentum" not in msgs[1]
    else:
        assert msgs == []
    norms = _norms(net)
    assert len(norms) == 4 and all(type(n) is gn_mx.GroupNorm and n._num_groups == 4 for n in norms)
    x, y = _train(net)
    assert np.isfinite(y.asnumpy()).all()
    if style == "bn_keywords":  # gamma_initializer is a GroupNorm keyword: passed on
        fresh = resnet_like(style, norm_layer=gn_mx.norm_layer(num_groups=4))
        fresh.initialize(ctx=CPU)
        fresh(x)
        np.testing.assert_array_equal(_norms(fresh)[1].gamma.data().asnumpy(), 0)
        np.testing.assert_array_equal(_norms(fresh)[0].gamma.data().asnumpy(), 1)
    # the first norm layer computes GroupNorm of its input (per-channel affine)
    blk = net[0]
    h = blk.conv1(x)
    g, b = norms[0].gamma.data().asnumpy(), norms[0].beta.data().asnumpy()
    ref = group_norm_ref(h.asnumpy(), g, b, 4, 1e-5)[0]
    np.testing.assert_allclose(norms[0](h).asnumpy(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.filterwarnings("ignore:gn_mx.norm_layer")
def test_plain_class_and_classmethod():
    # norm_layer=gn_mx.GroupNorm + norm_kwargs works without a factory for the first two styles
    for style in ("kwargs", "in_channels"):
        net = resnet_like(style, norm_layer=gn_mx.GroupNorm, norm_kwargs={"num_groups": 8})
        assert all(n._num_groups == 8 for n in _norms(net))
    with pytest.raises(TypeError):
        resnet_like("bn_keywords", norm_layer=gn_mx.GroupNorm, norm_kwargs={"num_groups": 8})
    f = gn_mx.GroupNorm.as_norm_layer(num_groups=2)
    net = resnet_like("bn_keywords", norm_layer=f, norm_kwargs={"num_groups": 8})
    assert all(n._num_groups == 8 for n in _norms(net))  # the constructor's keywords win
    assert "num_groups=2" in repr(f)


def test_dbn_factory_takes_momentum_and_use_global_stats():
    f = gn_mx.DecorrelatedBatchNorm.as_norm_layer(group_size=4, momentum=0.5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        net = resnet_like("bn_keywords", norm_layer=f)
    msgs = [str(m.message) for m in w if "gn_mx.norm_layer" in str(m.message)]
    assert len(msgs) == 1 and "running_variance_initializer" in msgs[0]
    norms = _norms(net)
    # the constructor's momentum=0.9 wins over the factory default
    assert all(type(n) is gn_mx.DecorrelatedBatchNorm and n._momentum == 0.9 for n in norms)
    assert all(n._use_global_stats is False and n._group_size == 4 for n in norms)
    x, y = _train(net)
    assert np.isfinite(y.asnumpy()).all()
    assert norms[0].running_projection.shape == (4, 4, 4)


def test_factory_errors():
    with pytest.raises(ValueError, match="axis"):
        gn_mx.norm_layer(num_groups=2)(axis=3)
    with pytest.raises(TypeError, match="unknown keyword"):
        gn_mx.norm_layer(num_grups=2)
    with pytest.raises(TypeError, match="keyword arguments only"):
        gn_mx.norm_layer()(1)
    with pytest.raises(ValueError, match="divisible"):
        gn_mx.norm_layer(num_groups=3)(in_channels=16)
