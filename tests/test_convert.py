"""gn_mx.convert / gn_mx.convert_symbol / python -m gn_mx.convert (issue 17, items 1, 2, 4).

Every test trains a small net a few steps with MXNet's own layers, converts it, and compares outputs
(and gradients) with the unconverted net: fp32 within 1e-5, fp64 within 1e-12, fp16 within fp16
rounding. GluonCV's GroupNorm is a structural stand-in written here (same attributes, parameters and
hybrid_forward composition as gluoncv.nn.GroupNorm; gluoncv itself is not installed).
"""
import copy
import json
import os
import subprocess
import sys

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import gn_mx
from conftest import ROOT, reload_outputs
from test_deploy import predictor, run_predictor  # noqa: F401  (the C predictor fixture)

TOLS = {np.float32: 1e-5, np.float64: 1e-12, np.float16: 2e-2}


class CVGroupNorm(gluon.HybridBlock):
    """The structure of gluoncv.nn.GroupNorm (BatchNorm over a (1, N*G, -1) view, then affine)."""

    def __init__(self, ngroups=32, in_channels=0, axis=1, epsilon=1e-5, scale=True, **kwargs):
        super().__init__(**kwargs)
        self._kwargs = {"axis": axis, "eps": epsilon, "momentum": 0, "fix_gamma": True,
                        "use_global_stats": False}
        self.ngroups = ngroups
        self.scale = scale
        self.gamma = self.params.get("gamma", shape=(in_channels,), init="ones",
                                     allow_deferred_init=True)
        self.beta = self.params.get("beta", shape=(in_channels,), init="zeros",
                                    allow_deferred_init=True)

    def hybrid_forward(self, F, x, gamma, beta):
        with autograd.train_mode():
            y = x.expand_dims(0).reshape(0, 0, self.ngroups, -1).reshape(1, -3, -1)
            n = x.shape[0] * self.ngroups
            y = F.BatchNorm(y, F.ones(n, ctx=x.context), F.zeros(n, ctx=x.context),
                            F.zeros(n, ctx=x.context), F.ones(n, ctx=x.context), **self._kwargs)
        y = y.reshape_like(x).reshape(0, 0, -1)
        y = y * gamma.reshape(1, -1, 1) + beta.reshape(1, -1, 1) if self.scale else \
            y + beta.reshape(1, -1, 1)
        return y.reshape_like(x)


CVGroupNorm.__name__ = "GroupNorm"  # gluoncv's class name: recognized by structure + name


def make_net(kind, act="relu", C=8, layer_norm=True):
    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Conv2D(C, 3, padding=1, in_channels=3))
        if kind == "group_norm":
            net.add(nn.GroupNorm(num_groups=4))
        elif kind == "instance_norm":
            net.add(nn.InstanceNorm(in_channels=C, scale=True))
        elif kind == "gluoncv":
            net.add(CVGroupNorm(ngroups=2, in_channels=C))
        net.add(nn.Activation("relu") if act == "relu" else nn.Swish())
        net.add(nn.Conv2D(4, 3, padding=1))
        net.add(nn.GlobalAvgPool2D())
        net.add(nn.Flatten())
        net.add(nn.Dense(6))
        if layer_norm:  # (MXNet 1.9's ONNX exporter writes an invalid ReduceMean for LayerNorm)
            net.add(nn.LayerNorm())
    return net


def train(net, steps=3, dtype=np.float32, seed=0):
    rs = np.random.RandomState(seed)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.5})
    loss_fn = gluon.loss.L2Loss()
    for _ in range(steps):
        x = mx.nd.array(rs.randn(4, 3, 6, 6), dtype=dtype)
        y = mx.nd.array(rs.randn(4, 6), dtype=dtype)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        tr.step(4)


def params_np(net):
    return {k: v.data().asnumpy() for k, v in net.collect_params().items()}


def clone(net, kind, act):
    other = make_net(kind, act)
    other.initialize()
    other(mx.nd.zeros((1, 3, 6, 6)))
    for (k1, p1), (k2, p2) in zip(sorted(net.collect_params().items()),
                                  sorted(other.collect_params().items())):
        p2.set_data(p1.data())
    return other


@pytest.mark.parametrize("kind", ["group_norm", "instance_norm", "gluoncv"])
@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("fuse", [False, True])
def test_convert_gluon_matches(kind, hybridize, fuse):
    act = "swish" if (kind == "gluoncv" and fuse) else "relu"
    net = make_net(kind, act)
    net.initialize(mx.init.Xavier())
    if hybridize and kind != "gluoncv":  # GluonCV's GroupNorm reads x.shape: not hybridizable
        net.hybridize()
    x = mx.nd.array(np.random.RandomState(1).randn(3, 3, 6, 6))
    net(x)
    train(net)
    ref = clone(net, kind, act)
    names_before = sorted(net.collect_params().keys())
    out = gn_mx.convert(net, fuse_activation=fuse, sample=x)
    assert out is net
    rep = net.gn_mx_report
    norm = net[1]
    assert isinstance(norm, gn_mx.GroupNorm), rep
    assert sorted(net.collect_params().keys()) == names_before  # names kept
    assert [p for p, _ in rep.replaced] == ["1", "7"], rep  # the norm, the LayerNorm on (N, 6)
    assert isinstance(net[7], gn_mx.GroupNorm) and net[7]._num_groups == 1
    if fuse:
        assert rep.fused == [("1", "silu" if act == "swish" else "relu")]
        assert norm._act == ("silu" if act == "swish" else "relu")
    # the MXNet GroupNorm's per-group gamma became per-channel
    assert norm.gamma.shape == (8,)
    if kind == "group_norm":
        g_old = ref[1].gamma.data().asnumpy()
        np.testing.assert_array_equal(norm.gamma.data().asnumpy(), np.repeat(g_old, 2))
    for data in (x, mx.nd.array(np.random.RandomState(2).randn(2, 3, 5, 7))):
        want = ref(data).asnumpy()
        got = net(data).asnumpy()
        assert np.abs(got - want).max() <= TOLS[np.float32], (np.abs(got - want).max(), rep)
    # gradients: the input's equal; per-channel gamma grads sum (over a group) to the per-group one
    for m in (ref, net):
        m.collect_params().zero_grad()
    grads = []
    for m in (ref, net):
        xx = x.copy()
        xx.attach_grad()
        with autograd.record():
            y = m(xx)
        y.backward(mx.nd.array(np.random.RandomState(3).randn(*y.shape)))
        grads.append((xx.grad.asnumpy(), m[1].gamma.grad().asnumpy(), m[1].beta.grad().asnumpy()))
    np.testing.assert_allclose(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-5)
    dg, db = grads[1][1], grads[1][2]
    if kind == "group_norm":
        dg, db = dg.reshape(4, 2).sum(1), db.reshape(4, 2).sum(1)
    np.testing.assert_allclose(dg, grads[0][1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(db, grads[0][2], rtol=1e-4, atol=1e-5)
    if kind != "group_norm":  # same parameterization: further training stays equal
        train(ref, steps=2, seed=5)
        train(net, steps=2, seed=5)
        got, want = net(x).asnumpy(), ref(x).asnumpy()
        assert np.abs(got - want).max() <= 1e-4


def test_convert_float64():
    net = make_net("group_norm")
    net.initialize(mx.init.Xavier())
    net.cast(np.float64)
    x = mx.nd.array(np.random.RandomState(1).randn(3, 3, 6, 6), dtype=np.float64)
    net(x)
    train(net, dtype=np.float64)
    want = net(x).asnumpy()
    gn_mx.convert(net, fuse_activation=True, sample=x)
    assert isinstance(net[1], gn_mx.GroupNorm) and net[1].gamma.dtype == np.float64
    assert np.abs(net(x).asnumpy() - want).max() <= TOLS[np.float64]


def _fp16_norm_net():
    """An fp16 MXNet-GroupNorm net (norm-only: MXNet's CPU has no fp16 conv/dense; its InstanceNorm
    is float32-only) with random stand-in trained values, and its input."""
    net = nn.HybridSequential()
    net.add(nn.GroupNorm(num_groups=2), nn.Activation("relu"), nn.GroupNorm(num_groups=4))
    net.initialize()
    net.cast(np.float16)
    x = mx.nd.array(np.random.RandomState(1).randn(3, 4, 5, 5) * 3 + 1, dtype=np.float16)
    net(x)
    rs = np.random.RandomState(2)
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rs.randn(*p.shape), dtype=np.float16))
    return net, x


@pytest.mark.parametrize("hybridize", [False, True])
def test_convert_float16(hybridize):
    """fp16 (MXNet's CPU has no fp16 conv/dense: a norm-only net; random stand-in trained values)."""
    net, x = _fp16_norm_net()
    if hybridize:
        net.hybridize()
    want = net(x).asnumpy().astype(np.float64)
    gn_mx.convert(net, fuse_activation=True, sample=x)
    assert len(net.gn_mx_report.replaced) == 2 and len(net.gn_mx_report.fused) == 1
    got = net(x).asnumpy().astype(np.float64)
    assert net[0].gamma.dtype == np.float16
    assert np.abs(got - want).max() <= 1e-2 * max(1.0, np.abs(want).max())


def test_fused_slot_prints_what_it_is():
    """The slot of a fused activation is an identity that says so, also inside the net's repr
    (it printed as an empty ``_Fused(\n\n)`` before)."""
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 1, in_channels=3), nn.GroupNorm(num_groups=2), nn.Activation("relu"),
            nn.InstanceNorm(in_channels=4), nn.Swish())
    net.initialize()
    x = mx.nd.array(np.random.RandomState(0).randn(2, 3, 5, 5))
    want = net(x).asnumpy()
    gn_mx.convert(net, fuse_activation=True, sample=x)
    assert repr(net[2]) == "_Fused(relu: applied by the GroupNorm in slot '1')"
    assert repr(net[4]) == "_Fused(silu: applied by the GroupNorm in slot '3')"
    text = repr(net)
    assert "(2): _Fused(relu: applied by the GroupNorm in slot '1')" in text, text
    assert "_Fused(\n" not in text, text
    assert np.abs(net(x).asnumpy() - want).max() <= 1e-5


def test_layer_norm_and_unmappable_layers_stay_with_reason():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(4, 1, in_channels=3), nn.LayerNorm(axis=1),   # 4-D input: not a GroupNorm
            nn.InstanceNorm(axis=2, in_channels=6),                  # axis != 1
            nn.Activation("relu"), nn.Flatten(), nn.Dense(8),
            nn.LayerNorm())                                           # (N, C): exactly GN(1)
    net.initialize()
    x = mx.nd.array(np.random.RandomState(0).randn(2, 3, 6, 6))
    want = net(x).asnumpy()
    gn_mx.convert(net)  # no sample: no LayerNorm can be decided
    left = dict(net.gn_mx_report.left)
    assert "input rank is unknown" in left["1"] and "input rank is unknown" in left["6"]
    assert "axis" in left["2"]
    gn_mx.convert(net, sample=x)
    rep = net.gn_mx_report
    assert [p for p, _ in rep.replaced] == ["6"], rep
    left = dict(rep.left)
    assert "4-D input" in left["1"]
    assert isinstance(net[1], nn.LayerNorm) and isinstance(net[2], nn.InstanceNorm)
    assert isinstance(net[6], gn_mx.GroupNorm)
    assert np.abs(net(x).asnumpy() - want).max() <= 1e-5
    cv = nn.HybridSequential()
    cv.add(CVGroupNorm(ngroups=2, in_channels=4, axis=2))  # MXNet itself cannot run this one
    gn_mx.convert(cv)
    assert "axis=2" in dict(cv.gn_mx_report.left)["0"] and isinstance(cv[0], CVGroupNorm)


def test_gluoncv_without_scale_ignores_gamma():
    net = nn.HybridSequential()
    net.add(CVGroupNorm(ngroups=2, in_channels=4, scale=False))
    net.initialize()
    net[0].gamma.set_data(mx.nd.array([2.0, 3.0, 4.0, 5.0]))  # ignored by its forward
    net[0].beta.set_data(mx.nd.array([0.1, 0.2, 0.3, 0.4]))
    x = mx.nd.array(np.random.RandomState(0).randn(2, 4, 3, 3))
    want = net(x).asnumpy()
    gn_mx.convert(net)
    assert isinstance(net[0], gn_mx.GroupNorm) and net[0].gamma.grad_req == "null"
    np.testing.assert_array_equal(net[0].gamma.data().asnumpy(), np.ones(4))
    assert np.abs(net(x).asnumpy() - want).max() <= 1e-5


def test_convert_without_sample_reports_unknown_channels():
    net = make_net("group_norm")
    net.initialize()
    net(mx.nd.ones((1, 3, 6, 6)))
    gn_mx.convert(net)
    assert isinstance(net[1], nn.GroupNorm)
    assert "channel count is unknown" in dict(net.gn_mx_report.left)["1"]


def test_convert_uninitialized_net_and_top_level_block():
    net = make_net("instance_norm")  # not initialized: fresh gn_mx blocks, same initializers
    gn_mx.convert(net)
    assert isinstance(net[1], gn_mx.GroupNorm)
    net.initialize()
    assert net(mx.nd.ones((2, 3, 6, 6))).shape == (2, 6)
    b = nn.InstanceNorm(in_channels=5)
    b.initialize()
    x = mx.nd.array(np.random.RandomState(0).randn(2, 5, 4))
    want = b(x).asnumpy()
    nb = gn_mx.convert(b)
    assert isinstance(nb, gn_mx.GroupNorm) and nb.gamma.name == b.gamma.name
    assert np.abs(nb(x).asnumpy() - want).max() <= 1e-5


# ------------------------------------------------------------------------------------------------
# exported models

def export_trained(tmp_path, kind="group_norm", dtype=np.float32, layer_norm=True):
    net = make_net(kind, layer_norm=layer_norm)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.array(np.random.RandomState(1).randn(3, 3, 6, 6))
    net(x)
    train(net)
    if dtype != np.float32:
        net.cast(dtype)
        x = x.astype(dtype)
    want = net(x).asnumpy()
    prefix = str(tmp_path / "orig")
    net.export(prefix)
    return prefix, x, want


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("kind", ["group_norm", "instance_norm"])
def test_convert_symbol_matches_and_reloads(tmp_path, kind, fuse):
    prefix, x, want = export_trained(tmp_path, kind)
    sym, arg, aux = mx.model.load_checkpoint(prefix, 0)
    rep = gn_mx._convert.ConversionReport()
    sym2, arg2, aux2 = gn_mx.convert_symbol(sym, arg, aux, fuse_activation=fuse, report=rep)
    ops = [n["op"] for n in json.loads(sym2.tojson())["nodes"]]
    assert "GroupNorm" not in ops and "InstanceNorm" not in ops and "gn_group_norm" in ops, rep
    assert ("Activation" in ops) != fuse
    assert len(rep.replaced) == 1 and len(rep.fused) == int(fuse)
    out = str(tmp_path / "conv")
    mx.model.save_checkpoint(out, 0, sym2, arg2, aux2)
    blk = gluon.SymbolBlock.imports(out + "-symbol.json", ["data"], out + "-0000.params")
    got = blk(x).asnumpy()
    assert np.abs(got - want).max() <= 1e-5
    if kind != "group_norm" or not fuse:
        return
    # a fresh process that only imports gn_mx loads it too, with the same output
    np.testing.assert_allclose(reload_outputs(out, [x.asnumpy()])[0], want, rtol=0, atol=1e-5)


def test_convert_symbol_fuses_swish(tmp_path):
    net = nn.HybridSequential()
    net.add(nn.Conv2D(8, 3, padding=1, in_channels=3), nn.GroupNorm(num_groups=4), nn.Swish(),
            nn.Conv2D(4, 1), nn.InstanceNorm(in_channels=4), nn.Swish(beta=2.0))  # beta 2: not silu
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = mx.nd.array(np.random.RandomState(0).randn(2, 3, 5, 5))
    net(x)
    rs = np.random.RandomState(1)
    for p in net.collect_params().values():
        if p.name.endswith(("gamma", "beta")):
            p.set_data(mx.nd.array(rs.randn(*p.shape)))
    want = net(x).asnumpy()
    prefix = str(tmp_path / "sw")
    net.export(prefix)
    sym, arg, aux = mx.model.load_checkpoint(prefix, 0)
    rep = gn_mx._convert.ConversionReport()
    sym2, arg2, aux2 = gn_mx.convert_symbol(sym, arg, aux, fuse_activation=True, report=rep)
    nodes = json.loads(sym2.tojson())["nodes"]
    gn = [n for n in nodes if n["op"] == "gn_group_norm"]
    assert len(gn) == 2 and len(rep.fused) == 1, rep
    assert gn[0]["attrs"].get("act_type") == "silu" and "act_type" not in gn[1]["attrs"]
    assert [n["op"] for n in nodes].count("sigmoid") == 1  # only the beta=2 swish's
    out = str(tmp_path / "swc")
    mx.model.save_checkpoint(out, 0, sym2, arg2, aux2)
    blk = gluon.SymbolBlock.imports(out + "-symbol.json", ["data"], out + "-0000.params")
    assert np.abs(blk(x).asnumpy() - want).max() <= 1e-5


def test_convert_symbol_fp16(tmp_path):
    """An fp16 model (norm-only: MXNet's CPU has no fp16 conv/dense), shapes given on the CLI way."""
    net, x = _fp16_norm_net()
    net.hybridize()
    want = net(x).asnumpy().astype(np.float64)
    prefix = str(tmp_path / "fp16")
    net.export(prefix)
    sym, arg, aux = mx.model.load_checkpoint(prefix, 0)
    rep = gn_mx._convert.ConversionReport()
    gn_mx.convert_symbol(sym, arg, aux, report=rep)  # no conv feeds them: C unknown, left in place
    assert len(rep.left) == 2 and "channel count" in rep.left[0][1]
    sym2, arg2, aux2 = gn_mx.convert_symbol(sym, arg, aux, fuse_activation=True,
                                            data_shapes={"data": (1, 4, 5, 5)})
    assert arg2[[k for k in arg2 if k.endswith("gamma")][0]].dtype == np.float16
    out = str(tmp_path / "conv")
    mx.model.save_checkpoint(out, 0, sym2, arg2, aux2)
    blk = gluon.SymbolBlock.imports(out + "-symbol.json", ["data"], out + "-0000.params")
    blk.cast(np.float16)
    got = blk(x).asnumpy().astype(np.float64)
    assert np.abs(got - want).max() <= 2e-2 * max(1.0, np.abs(want).max())


def test_cli(tmp_path):
    prefix, x, want = export_trained(tmp_path)
    out = str(tmp_path / "cli")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "gn_mx.convert", prefix, "0", out,
                        "--fuse-activation"], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "1 replaced, 1 fused" in p.stdout and "RuntimeWarning" not in p.stderr, p.stdout + p.stderr
    blk = gluon.SymbolBlock.imports(out + "-symbol.json", ["data"], out + "-0000.params")
    assert np.abs(blk(x).asnumpy() - want).max() <= 1e-5


def _converted_model(tmp_path, fuse=True, layer_norm=True):
    prefix, x, want = export_trained(tmp_path, "group_norm", layer_norm=layer_norm)
    sym, arg, aux = mx.model.load_checkpoint(prefix, 0)
    sym2, arg2, aux2 = gn_mx.convert_symbol(sym, arg, aux, fuse_activation=fuse)
    out = str(tmp_path / "conv")
    mx.model.save_checkpoint(out, 0, sym2, arg2, aux2)
    return out, x, want


def test_converted_model_in_c_predict_api(predictor, tmp_path):
    """examples/deploy_c/predict.c (MXLoadLib + MXPredCreate) runs the converted model."""
    out, x, want = _converted_model(tmp_path)
    model = {"symbol": out + "-symbol.json", "params": out + "-0000.params"}
    got = run_predictor(predictor, model, x.asnumpy(), tmp_path)
    assert np.abs(got - want).max() <= 1e-5


def test_converted_model_onnx_export(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import gn_mx.onnx  # noqa: F401  (registers the converters)
    out, x, want = _converted_model(tmp_path, layer_norm=False)
    # gn_mx's export (opset 17): MXNet's writes onnx's newest opset (22), which onnxruntime 1.19
    # (the last for Python 3.8/3.9) refuses
    path = gn_mx.onnx.export_model(out + "-symbol.json", out + "-0000.params",
                                   in_shapes=[x.shape], in_types=[np.float32],
                                   onnx_file_path=str(tmp_path / "conv.onnx"))
    onnx.checker.check_model(onnx.load(path))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.asnumpy()})[0]
    assert np.abs(got - want).max() <= 1e-5
