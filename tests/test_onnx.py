"""ONNX export of gn_mx ops through mx.onnx.export_model, run in onnxruntime (issue 9, items 3, 4).

Needs onnx + onnxruntime (pinned in requirements-dev.txt; `pip install 'gn_mx[onnx]'`). Every
model is exported with a dynamic batch (and spatial) size and run for two batch sizes; outputs
must match MXNet within 1e-5 (fp32), and onnx.checker must accept the model.
"""

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon

import gn_mx

onnx = pytest.importorskip(
    "onnx", reason="ONNX export tests need onnx and onnxruntime: pip install 'gn_mx[onnx]' "
                   "(or the pins in requirements-dev.txt)")
ort = pytest.importorskip(
    "onnxruntime", reason="ONNX export tests need onnxruntime: pip install 'gn_mx[onnx]' "
                          "(or the pins in requirements-dev.txt)")
import gn_mx.onnx as gn_onnx  # noqa: E402

TOL = 1e-5
OPSET = onnx.defs.onnx_opset_version()
# The newest opset the installed onnxruntime runs (1.19, the last for Python 3.8/3.9: 21).
RUNTIME_OPSET = 21 if tuple(int(v) for v in ort.__version__.split(".")[:2]) < (1, 20) else OPSET
# the composition of basic ops (default), and GroupNormalization-21 where the opset has it
MODES = ["compose"] + (["native"] if OPSET >= 21 else [])


@pytest.fixture(params=MODES)
def gn_mode(request, monkeypatch):
    monkeypatch.setattr(gn_onnx, "USE_GROUP_NORMALIZATION", request.param == "native")
    if request.param == "native":  # GroupNormalization-21 needs an opset >= 21 export
        monkeypatch.setattr(gn_onnx, "DEFAULT_OPSET", 21)
    return request.param


def session(path):
    so = ort.SessionOptions()
    so.log_severity_level = 3  # MXNet's exporter lists initializers as graph inputs: ORT warns
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def export(net, tmp_path, sample_shape, dynamic_shape):
    prefix = str(tmp_path / "net")
    net.export(prefix)
    path = gn_onnx.export_model(prefix + "-symbol.json", prefix + "-0000.params",
                                in_shapes=[sample_shape], in_types=[np.float32],
                                onnx_file_path=str(tmp_path / "net.onnx"), dynamic=True,
                                dynamic_input_shapes=[dynamic_shape])
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    return path, model


def compare(net, path, shapes):
    sess = session(path)
    name = sess.get_inputs()[0].name
    diffs = []
    for shape in shapes:
        x = np.random.RandomState(len(shape) + shape[0]).randn(*shape).astype(np.float32)
        want = net(mx.nd.array(x)).asnumpy()
        got = sess.run(None, {name: x})[0]
        assert got.shape == want.shape, (got.shape, want.shape)
        diffs.append(float(np.abs(got - want).max()))
    return diffs


# (spatial dims, layers before GroupNorm, layers after it, sample shape of one input)
GN_NETS = {
    0: (lambda: [gluon.nn.Dense(16)], lambda: [gluon.nn.Activation("relu"), gluon.nn.Dense(3)],
        (6,)),
    # MXNet 1.9's exporter has no 1-D Convolution / Pooling (and its `mean` emits ReduceMean-13
    # attributes, invalid at opset >= 18): GroupNorm normalizes the input itself here.
    1: (lambda: [], lambda: [gluon.nn.Activation("relu")], (8, 7)),
    2: (lambda: [gluon.nn.Conv2D(8, 3, padding=1)], lambda: [],  # GroupNorm is the graph output
        (3, 6, 6)),
    3: (lambda: [gluon.nn.Conv3D(8, 3, padding=1)],
        lambda: [gluon.nn.Activation("relu"), gluon.nn.GlobalAvgPool3D(), gluon.nn.Dense(3)],
        (3, 4, 5, 4)),
}


@pytest.mark.parametrize("spatial", sorted(GN_NETS))
def test_group_norm_cnn(spatial, gn_mode, tmp_path):
    before, after, sample = GN_NETS[spatial]
    net = gluon.nn.HybridSequential()
    net.add(*before(), gn_mx.GroupNorm(num_groups=2), *after())
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((2,) + sample))
    for p in net.collect_params().values():  # non-trivial affine parameters
        if p.name.endswith(("gamma", "beta")):
            p.set_data(mx.nd.array(np.random.RandomState(3).rand(*p.shape) + 0.5))
    path, model = export(net, tmp_path, (2,) + sample, (None, sample[0]) + (None,) * spatial)
    ops = {n.op_type for n in model.graph.node}
    assert ("GroupNormalization" in ops) == (gn_mode == "native"), ops
    shapes = [(2,) + sample, (5,) + sample]
    if spatial:
        shapes.append((3, sample[0]) + tuple(d + 2 for d in sample[1:]))  # another spatial size
    diffs = compare(net, path, shapes)
    print(f"GroupNorm {spatial}-D ({gn_mode}): max abs diff per input shape {diffs}")
    assert max(diffs) <= TOL, diffs


def dbn_net(spatial):
    net = gluon.nn.HybridSequential()
    if spatial:
        net.add(gluon.nn.Conv2D(8, 3, padding=1), gn_mx.DecorrelatedBatchNorm(num_groups=2),
                gluon.nn.Activation("relu"), gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(3))
    else:
        net.add(gluon.nn.Dense(8), gn_mx.DecorrelatedBatchNorm(num_groups=2, momentum=0.5),
                gluon.nn.Activation("relu"), gluon.nn.Dense(3))
    return net


@pytest.mark.parametrize("spatial", [0, 2])
def test_dbn_cnn_after_training(spatial, tmp_path):
    sample = (3, 6, 6) if spatial else (6,)
    rng = np.random.RandomState(0)
    net = dbn_net(spatial)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
    for _ in range(3):
        x = mx.nd.array(rng.randn(16, *sample) * 2 + 1)
        with autograd.record():
            loss = (net(x) ** 2).mean()
        loss.backward()
        trainer.step(16)
    dbn = [b for b in net._children.values() if isinstance(b, gn_mx.DecorrelatedBatchNorm)][0]
    rm, rp = dbn.running_mean.data().asnumpy(), dbn.running_projection.data().asnumpy()
    assert np.abs(rp - np.eye(rp.shape[-1])).max() > 1e-2  # trained away from the init
    path, model = export(net, tmp_path, (2,) + sample, (None,) + sample[:1] + (None,) * spatial)
    # the running statistics of the last training step are in the ONNX model
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(inits[dbn.running_mean.name], rm)
    np.testing.assert_array_equal(inits[dbn.running_projection.name], rp)
    assert "MatMul" in {n.op_type for n in model.graph.node}
    shapes = [(2,) + sample, (7,) + sample]
    if spatial:
        shapes.append((3, 3, 9, 5))
    diffs = compare(net, path, shapes)
    print(f"DBN {spatial}-D: max abs diff per input shape {diffs}")
    assert max(diffs) <= TOL, diffs


def test_statistics_outputs(gn_mode, tmp_path):
    """mean/rstd of gn_group_norm and gn_moments' mean/var as graph outputs."""
    data = mx.sym.var("data")
    gamma, beta = mx.sym.var("gamma"), mx.sym.var("beta")
    gn = mx.sym.gn_group_norm(data, gamma, beta, num_groups=3, eps=1e-3, name="gn")
    mo = mx.sym.gn_moments(data, num_groups=2, name="mo")
    sym = mx.sym.Group([gn[0], gn[1], gn[2], mo[0], mo[1]])
    rng = np.random.RandomState(1)
    params = {"gamma": mx.nd.array(rng.rand(6) + 0.5), "beta": mx.nd.array(rng.randn(6))}
    path = gn_onnx.export_model(sym, params, in_shapes=[(2, 6, 5)], in_types=[np.float32],
                                onnx_file_path=str(tmp_path / "stats.onnx"), dynamic=True,
                                dynamic_input_shapes=[(None, 6, None)])
    onnx.checker.check_model(onnx.load(path), full_check=True)
    sess = session(path)
    for shape in [(2, 6, 5), (4, 6, 3)]:
        x = rng.randn(*shape).astype(np.float32)
        ex = sym.bind(mx.cpu(), {"data": mx.nd.array(x), **params})
        want = [o.asnumpy() for o in ex.forward()]
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"data": x})))
        for key, w in zip(["gn0", "gn1", "gn2", "mo0", "mo1"], want):
            assert got[key].shape == w.shape, key
            assert np.abs(got[key] - w).max() <= TOL * max(1, np.abs(w).max()), key


@pytest.mark.parametrize("act", ["none", "relu", "silu"])
def test_act_type_attribute(act, tmp_path, monkeypatch):
    """The converter honours gn_group_norm's optional fused activation `act_type` (absent means
    'none'): the converter alone (every opset / mapping), then end to end from the op."""
    from onnx import TensorProto, helper

    class Out:
        def __init__(self, name):
            self.name, self.dtype = name, np.dtype(np.float32)

    node = {"name": "gn", "op": "gn_group_norm", "inputs": [[0, 0, 0], [1, 0, 0], [2, 0, 0]],
            "attrs": {"num_groups": "2", "eps": "1e-5"}}
    if act != "none":
        node["attrs"]["act_type"] = act
    graph = [{"op": "null", "name": n, "inputs": []} for n in "xgb"] + [node]
    rng = np.random.RandomState(2)
    g, b = rng.rand(4).astype(np.float32) + 0.5, rng.randn(4).astype(np.float32)
    top = min(OPSET, RUNTIME_OPSET)
    combos = [(13, False), (17, False), (top, False)] + ([(top, True)] if top >= 21 else [])
    for opset, native in combos:
        monkeypatch.setattr(gn_onnx, "USE_GROUP_NORMALIZATION", native)
        init = [onnx.numpy_helper.from_array(g, "g"), onnx.numpy_helper.from_array(b, "b")]
        nodes, dtypes = gn_onnx.convert_group_norm(
            node, outputs_lookup=[[Out("x")], [Out("g")], [Out("b")]], initializer=init,
            opset_version=opset, mx_graph=graph, idx=3)
        out = [helper.make_tensor_value_info(f"gn{i}", TensorProto.FLOAT, None) for i in range(3)]
        model = helper.make_model(
            helper.make_graph(nodes, "t", [helper.make_tensor_value_info(
                "x", TensorProto.FLOAT, [None, 4, None])], out, init),
            opset_imports=[helper.make_opsetid("", opset)])
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        x = rng.randn(3, 4, 5).astype(np.float32)
        y = sess.run(["gn0"], {"x": x})[0]
        xg = x.reshape(3, 2, -1).astype(np.float64)
        ref = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 1e-5))
        ref = ref.reshape(x.shape) * g[:, None] + b[:, None]
        ref = {"none": ref, "relu": np.maximum(ref, 0), "silu": ref / (1 + np.exp(-ref))}[act]
        assert np.abs(y - ref).max() <= TOL, (opset, native, act)
        assert ("GroupNormalization" in {n.op_type for n in nodes}) == native
    # End to end: the op's own act_type, exported and run in onnxruntime.
    data = mx.sym.var("data")
    sym = mx.sym.gn_group_norm(data, mx.sym.var("gamma"), mx.sym.var("beta"), num_groups=2,
                               act_type=act, name="gn")[0]
    params = {"gamma": mx.nd.array(g), "beta": mx.nd.array(b)}
    path = gn_onnx.export_model(sym, params, in_shapes=[(3, 4, 5)], in_types=[np.float32],
                                onnx_file_path=str(tmp_path / "act.onnx"), dynamic=True,
                                dynamic_input_shapes=[(None, 4, None)])
    x = rng.randn(3, 4, 5).astype(np.float32)
    want = sym.bind(mx.cpu(), {"data": mx.nd.array(x), **params}).forward()[0].asnumpy()
    got = session(path).run(None, {"data": x})[0]
    assert np.abs(got - want).max() <= TOL


def test_training_graph_is_refused_clearly(tmp_path):
    data = mx.sym.var("data")
    sym = mx.sym.gn_dbn(data, mx.sym.var("rm"), mx.sym.var("rp"), num_groups=2, name="dbn")[0]
    params = {"rm": mx.nd.zeros(4), "rp": mx.nd.array(np.tile(np.eye(2), (2, 1, 1)))}
    with pytest.raises(NotImplementedError, match="inference graph"):
        gn_onnx.export_model(sym, params, in_shapes=[(8, 4)], in_types=[np.float32],
                             onnx_file_path=str(tmp_path / "train.onnx"))


@pytest.mark.parametrize("op", ["gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply",
                                "gn_dbn_local_sums", "gn_dbn_local_cov"])
def test_sync_training_graph_is_refused_clearly(op, tmp_path):
    """Synchronized DBN's training ops have no ONNX form (the exported SyncDecorrelatedBatchNorm
    graph holds gn_dbn_inference): the exporter names the op and the inference graph."""
    x = mx.sym.var("data")
    V = lambda n: mx.sym.var(n, dtype="float64")  # noqa: E731
    sym = {"gn_sync_sum": lambda: mx.sym.gn_sync_sum(x, key="k", name="s"),
           "gn_dbn_whiten": lambda: mx.sym.gn_dbn_whiten(x, V("m"), V("rm"), V("rp"), name="s")[0],
           "gn_dbn_apply": lambda: mx.sym.gn_dbn_apply(x, V("g"), V("b"), V("m"), V("w"),
                                                       num_groups=2, name="s"),
           "gn_dbn_local_sums": lambda: mx.sym.gn_dbn_local_sums(x, num_groups=2, name="s"),
           "gn_dbn_local_cov": lambda: mx.sym.gn_dbn_local_cov(x, V("t"), num_groups=2,
                                                               name="s")[0]}[op]()
    shape = (2, 2, 2) if op == "gn_dbn_whiten" else (8, 4)
    F = lambda *s: mx.nd.ones(s, dtype="float64")  # noqa: E731
    params = {"m": F(4), "rm": F(4), "rp": F(2, 2, 2), "g": F(4), "b": F(4), "w": F(2, 2, 2),
              "t": F(2, 3)}
    params = {k: v for k, v in params.items() if k in sym.list_inputs()}
    with pytest.raises(NotImplementedError, match=f"s is {op}.*inference graph"):
        gn_onnx.export_model(sym, params, in_shapes=[shape], in_types=[np.float64],
                             onnx_file_path=str(tmp_path / "train.onnx"))


def test_every_op_has_a_converter():
    from gn_mx._library import OPS
    assert set(gn_onnx.CONVERTED_OPS) == set(OPS)
    supported = mx.onnx.get_operator_support()
    assert all(op in supported for op in OPS), [op for op in OPS if op not in supported]


def test_converters_are_registered_on_import():
    supported = mx.onnx.get_operator_support()
    for op in ("gn_group_norm", "gn_moments", "gn_dbn_inference", "gn_channel_affine",
               "identity", "_copy"):
        assert op in supported, op


def test_default_mapping_is_exact_for_data_far_from_zero(tmp_path):
    """The default gn_group_norm mapping keeps two-pass accuracy (onnxruntime's own
    GroupNormalization does not, which is why it is opt-in) at the default optimization level."""
    assert gn_onnx.USE_GROUP_NORMALIZATION is False
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.GroupNorm(num_groups=4))
    net.initialize()
    net.hybridize()
    x = (np.random.RandomState(5).randn(4, 16, 8, 8) + 100).astype(np.float32)
    want = net(mx.nd.array(x)).asnumpy()
    path, model = export(net, tmp_path, x.shape, (None, 16, None, None))
    assert "GroupNormalization" not in {n.op_type for n in model.graph.node}
    got = session(path).run(None, {session(path).get_inputs()[0].name: x})[0]
    diff = float(np.abs(got - want).max())
    print(f"GroupNorm on 100 + N(0, 1) data: max abs diff onnxruntime vs MXNet {diff}")
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("opset", [None, 13, 21, "newest"])
def test_export_opset_default_and_override(opset, tmp_path):
    """gn_mx.onnx.export_model writes DEFAULT_OPSET (17) unless told otherwise; every opset from
    MXNet's 13 up to what onnx and the runtime support gives a valid model with the same result."""
    if opset == "newest":
        opset = min(OPSET, RUNTIME_OPSET)
    data = mx.sym.var("data")
    gn = mx.sym.gn_group_norm(data, mx.sym.var("gamma"), mx.sym.var("beta"), num_groups=2,
                              name="gn")[0]
    sym = mx.sym.Activation(gn, act_type="relu") * 2.0  # (MXNet's own `mean` is invalid at >= 18)
    rng = np.random.RandomState(3)
    params = {"gamma": mx.nd.array(rng.rand(4) + 0.5), "beta": mx.nd.array(rng.randn(4))}
    path = gn_onnx.export_model(sym, params, in_shapes=[(3, 4, 5)], in_types=[np.float32],
                                onnx_file_path=str(tmp_path / "o.onnx"), opset_version=opset)
    model = onnx.load(path)
    stamped = {o.domain: o.version for o in model.opset_import}[""]
    assert stamped == (gn_onnx.DEFAULT_OPSET if opset is None else opset)
    assert gn_onnx.DEFAULT_OPSET == 17
    onnx.checker.check_model(model, full_check=True)
    x = rng.randn(3, 4, 5).astype(np.float32)
    want = sym.bind(mx.cpu(), {"data": mx.nd.array(x), **params}).forward()[0].asnumpy()
    got = session(path).run(None, {"data": x})[0]
    assert np.abs(got - want).max() <= TOL
    # onnx is left as it was (its newest opset, and the checker's default context)
    assert onnx.defs.onnx_opset_version() == OPSET
    assert onnx.checker.DEFAULT_CONTEXT.opset_imports[""] == OPSET


@pytest.mark.parametrize("bad", [11, OPSET + 1, "17", 17.0, True])
def test_export_opset_out_of_range_is_refused(bad, tmp_path):
    sym = mx.sym.gn_moments(mx.sym.var("data"), num_groups=1)[0]
    with pytest.raises(ValueError, match="opset_version must be an int from 12"):
        gn_onnx.export_model(sym, {}, in_shapes=[(2, 3)], in_types=[np.float32],
                             onnx_file_path=str(tmp_path / "bad.onnx"), opset_version=bad)
