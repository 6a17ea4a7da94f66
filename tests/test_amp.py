"""gn_mx with MXNet AMP (mxnet.contrib.amp) and with float16-cast nets.

amp.init() is process-global and irreversible, so every AMP scenario runs in a fresh interpreter
(conftest.run_python); the net.cast('float16') tests need no AMP and run in-process.

MXNet 1.9.1 CPU limits these tests work within (see docs/amp_and_small_batch.md): no float16
gemm (Convolution/FullyConnected stay fp32 via gn_mx.amp.cpu_init_kwargs), AMP's imperative casts
skip fp16 -> fp32 on CPU (nets are hybridized), amp_multicast rejects fp16 inputs on CPU.
"""
import json

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon
from mxnet.contrib.amp import lists as amp_lists

import gn_mx
from conftest import run_python

HAS_DBN = hasattr(gn_mx, "DecorrelatedBatchNorm")
ON_GPU = mx.context.num_gpus() > 0


def test_ops_are_in_amp_lists():
    fp16, bf16 = amp_lists.symbol_fp16, amp_lists.symbol_bf16
    assert gn_mx.amp.registered_ops()[0] == ("gn_group_norm", "gn_moments")
    for op in ("gn_group_norm", "gn_moments"):
        assert op in fp16.FP16_FUNCS and op not in fp16.FP32_FUNCS
        assert op in bf16.FP32_FUNCS  # MXNet 1.9's lib_api has no bfloat16 tensors
    for op in gn_mx.amp.registered_ops()[1]:
        assert op in fp16.FP32_FUNCS and op not in fp16.FP16_FUNCS and op in bf16.FP32_FUNCS
    # DBN's fused affine runs in the precision that reaches it: no casts, not in the fp16/fp32 lists
    assert "gn_channel_affine" in fp16.FP16_FP32_FUNCS and "gn_channel_affine" in bf16.FP32_FUNCS
    assert "gn_channel_affine" not in fp16.FP16_FUNCS + fp16.FP32_FUNCS
    gn_mx.amp.register()  # idempotent
    assert fp16.FP16_FUNCS.count("gn_group_norm") == 1


def test_every_op_is_in_one_amp_list():
    """Each op of the library (gn_mx._library.OPS) has exactly one AMP class."""
    from gn_mx._library import OPS
    classes = gn_mx.amp.LP16_OPS + gn_mx.amp.FP32_OPS + gn_mx.amp.EITHER_OPS
    assert sorted(classes) == sorted(OPS)


def test_dbn_ops_registered_when_loaded():
    dbn_ops = tuple(op for op in ("gn_dbn", "gn_dbn_inference") if hasattr(mx.nd, op))
    assert gn_mx.amp.registered_ops()[1] == dbn_ops + ("gn_weight_standardize",)
    if HAS_DBN:
        assert dbn_ops == ("gn_dbn", "gn_dbn_inference")


def test_cpu_op_lists_keep_gemm_fp32():
    lp16, fp32, cond = gn_mx.amp.cpu_op_lists()
    for op in ("Convolution", "FullyConnected", "Deconvolution", "RNN"):
        assert op in fp32 and op not in lp16
    assert "gn_group_norm" in lp16 and "gn_moments" in lp16
    assert not set(lp16) & set(fp32)
    assert not set(lp16) & {c[0] for c in cond}
    kw = gn_mx.amp.cpu_convert_kwargs()
    assert kw["target_dtype_ops"] == lp16 and kw["fp32_ops"] == fp32
    with pytest.raises(ValueError):
        gn_mx.amp.cpu_op_lists("bfloat16")


@pytest.mark.parametrize("cast_optional_params", [False, True])
def test_convert_symbol_raw_ops_with_unknown_dtypes(cast_optional_params):
    """The graph pass calls our inferType with only data's dtype known (gamma/beta -1) and keeps
    parameters fp32 (cast_optional_params=False) or casts them to fp16 offline (True)."""
    from mxnet.contrib import amp  # convert_symbol needs no amp.init()
    data, gamma, beta = mx.sym.var("data"), mx.sym.var("gamma"), mx.sym.var("beta")
    gn = mx.sym.gn_group_norm(data, gamma, beta, num_groups=2, name="gn")
    mom = mx.sym.gn_moments(gn[0], num_groups=2, name="mom")
    sym = mx.sym.Group([gn[0], mom[0], mom[1]])
    conv = amp.convert_symbol(sym, target_dtype="float16", data_names=["data"],
                              cast_optional_params=cast_optional_params)
    ns = json.loads(conv.tojson(remove_amp_cast=False))["nodes"]
    gn_node = [n for n in ns if n["op"] == "gn_group_norm"][0]
    assert ns[gn_node["inputs"][0][0]]["op"] == "amp_cast"  # data cast to fp16 before the op
    arg_t, out_t, _ = conv.infer_type(data="float32")
    args = dict(zip(conv.list_arguments(), arg_t))
    want_param = np.float16 if cast_optional_params else np.float32
    assert args["gamma"] == want_param and args["beta"] == want_param
    assert out_t == [np.float32] * 3  # fp16 outputs are cast back; moments are fp32 anyway

    rng = np.random.RandomState(0)
    feed = {"data": mx.nd.array(rng.randn(2, 4, 5) * 3 + 1),
            "gamma": mx.nd.array(rng.rand(4) + 0.5), "beta": mx.nd.array(rng.randn(4))}
    ref = [o.asnumpy() for o in sym.bind(mx.cpu(), dict(feed)).forward()]
    feed16 = {k: v.astype(args[k]) for k, v in feed.items()}
    got = [o.asnumpy() for o in conv.bind(mx.cpu(), feed16).forward()]
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-2, atol=1e-2)


# -------------------------------------------------------------------------------------------------
# AMP scenarios, each in a fresh interpreter

_PRELUDE = """
import json, sys
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.contrib import amp

ORDER = "__ORDER__"
if ORDER == "amp_first":
    # amp.init() before the library is loaded: gn_mx's ops do not exist yet, and loading the
    # library regenerates every op function (dropping the wrappers amp.init() installed).
    # The CPU lists by hand (gn_mx.amp.cpu_init_kwargs is not importable yet).
    gemm = ["Convolution", "Deconvolution", "FullyConnected", "RNN"]
    amp.init(target_dtype="float16",
             target_precision_ops=[o for o in amp.list_lp16_ops("float16") if o not in gemm],
             fp32_ops=list(amp.list_fp32_ops("float16")) + gemm)
    import gn_mx
else:
    import gn_mx
    amp.init(**gn_mx.amp.cpu_init_kwargs())

def is_amp_wrapper(fn):
    return getattr(fn, "__globals__", None) is amp.amp.__dict__

HAS_DBN = hasattr(gn_mx, "DecorrelatedBatchNorm")
mx.random.seed(7)
np.random.seed(7)

def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1), gn_mx.GroupNorm(num_groups=4),
            gluon.nn.Activation("relu"))
    if HAS_DBN:
        net.add(gluon.nn.Conv2D(8, 3, padding=1), gn_mx.DecorrelatedBatchNorm(num_groups=2),
                gluon.nn.Activation("relu"))
    net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(4))
    return net

x = mx.nd.random.normal(shape=(8, 3, 6, 6))
y = mx.nd.array(np.arange(8) % 4)

def nodes(sym):
    return json.loads(sym.tojson(remove_amp_cast=False))["nodes"]

def input_casts(sym, op):
    # dtypes of the amp_cast nodes feeding each `op` node: {node name: [dtype or None per input]}
    ns = nodes(sym)
    out = {}
    for n in ns:
        if n["op"] == op:
            out[n["name"]] = [ns[i[0]]["attrs"]["dtype"] if ns[i[0]]["op"] == "amp_cast" else None
                              for i in n["inputs"]]
    return out

res = {"has_dbn": HAS_DBN,
        "wrapped": {n: is_amp_wrapper(getattr(mod, n))
                    for n in ("Convolution", "FullyConnected", "gn_group_norm", "gn_moments",
                              "broadcast_add", "SoftmaxOutput")
                    for mod in (mx.nd,) },
        "wrapped_sym": {n: is_amp_wrapper(getattr(mx.sym, n))
                        for n in ("Convolution", "gn_group_norm", "gn_moments")}}
if HAS_DBN:
    res["wrapped"]["gn_dbn"] = is_amp_wrapper(mx.nd.gn_dbn)
"""

_TRAIN = """
net = make_net()
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2, "momentum": 0.9})
amp.init_trainer(trainer)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
losses = []
for step in range(15):
    with autograd.record():
        loss = loss_fn(net(x), y)
        with amp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    trainer.step(x.shape[0])
    losses.append(float(loss.mean().asscalar()))
sym = net._cached_graph[1]
res["losses"] = losses
res["gn_casts"] = input_casts(sym, "gn_group_norm")
res["conv_casts"] = input_casts(sym, "Convolution")
res["dbn_casts"] = input_casts(sym, "gn_dbn")
res["param_dtypes"] = sorted({str(np.dtype(p.dtype)) for p in net.collect_params().values()})
res["grads_finite"] = all(np.isfinite(p.grad().asnumpy()).all()
                          for p in net.collect_params().values() if p.grad_req != "null")
out = net(x)
res["out_dtype"] = str(np.dtype(out.dtype))
# inference graph (DBN switches to gn_dbn_inference, still fp32 under AMP)
res["infer_finite"] = bool(np.isfinite(out.asnumpy()).all())
print("RESULT " + json.dumps(res))
"""

_CONVERT = """
net = make_net()
net.initialize(mx.init.Xavier())
net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
with autograd.record():  # one training step so DBN's running statistics are not the identity
    loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
loss.backward()
trainer.step(x.shape[0])
ref = net(x).asnumpy()
kw = gn_mx.amp.cpu_convert_kwargs() if mx.context.num_gpus() == 0 else {}
ctx = mx.cpu() if mx.context.num_gpus() == 0 else mx.gpu(0)
conv = amp.convert_hybrid_block(net, ctx=ctx, **kw)
out = conv(x.as_in_context(ctx))
res["convert_err"] = float(np.abs(out.asnumpy() - ref).max())
res["convert_out_dtype"] = str(np.dtype(out.dtype))
# converters check user-given lists against AMP's: ours are in them now
sym = net._cached_graph[1]
for name, lists in (("explicit", dict(target_dtype_ops=["gn_group_norm", "gn_moments"],
                                      fp32_ops=["Convolution", "FullyConnected"])),
                    ("defaults", {})):
    s = amp.convert_symbol(sym, target_dtype="float16", data_names=["data"], **lists)
    res["convert_symbol_" + name] = sorted({n["op"] for n in nodes(s)} - {"null"})
s = amp.convert_symbol(sym, target_dtype="bfloat16", data_names=["data"])
res["convert_symbol_bf16"] = sorted({n["op"] for n in nodes(s)} - {"null"})
print("RESULT " + json.dumps(res))
"""


def _scenario(order, body):
    code = (_PRELUDE + body).replace("__ORDER__", order)
    proc = run_python(code, timeout=240)
    assert proc.returncode == 0, f"scenario failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("order", ["gn_first", "amp_first"])
def test_amp_init_trainer_training(order):
    r = _scenario(order, _TRAIN)
    assert r["has_dbn"] == HAS_DBN
    # every wrapper survives the library load, ours included, in either order
    assert all(r["wrapped"].values()), r["wrapped"]
    assert all(r["wrapped_sym"].values()), r["wrapped_sym"]
    # gn_group_norm gets float16 data and (cast) float16 gamma/beta; conv stays fp32 on CPU
    assert r["gn_casts"] and all(c == ["float16"] * 3 for c in r["gn_casts"].values()), r
    assert r["conv_casts"] and all(set(c) == {"float32"} for c in r["conv_casts"].values()), r
    if r["has_dbn"]:
        # DBN runs fp32: data and its fused gamma/beta cast to float32, running statistics (aux)
        # never cast
        assert r["dbn_casts"] and all(c == ["float32", "float32", "float32", None, None]
                                      for c in r["dbn_casts"].values()), r
    assert r["param_dtypes"] == ["float32"]  # AMP keeps fp32 master parameters
    assert r["grads_finite"] and r["infer_finite"]
    losses = r["losses"]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("order", ["gn_first", "amp_first"])
def test_amp_convert_hybrid_block(order):
    r = _scenario(order, _CONVERT)
    assert r["has_dbn"] == HAS_DBN
    assert r["convert_err"] < 2e-2, r
    assert r["convert_out_dtype"] == "float32"
    for key in ("convert_symbol_explicit", "convert_symbol_defaults", "convert_symbol_bf16"):
        assert "gn_group_norm" in r[key], r
        if r["has_dbn"]:
            assert "gn_dbn" in r[key] or "gn_dbn_inference" in r[key], r


@pytest.mark.skipif(not HAS_DBN, reason="DecorrelatedBatchNorm not built")
def test_amp_groupnorm_feeding_dbn_directly():
    code = """
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp
    import gn_mx
    amp.init(**gn_mx.amp.cpu_init_kwargs())
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3), gn_mx.GroupNorm(4), gn_mx.DecorrelatedBatchNorm(2),
            gluon.nn.Activation("relu"), gluon.nn.Dense(4))
    net.initialize()
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    amp.init_trainer(trainer)
    x, y = mx.nd.random.uniform(shape=(4, 3, 8, 8)), mx.nd.array([0, 1, 2, 3])
    with autograd.record(), amp.scale_loss(gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y),
                                           trainer) as scaled:
        autograd.backward(scaled)
    trainer.step(4)
    print("OK", net(x).asnumpy().shape)
    """
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0 and "OK (4, 4)" in proc.stdout, proc.stderr[-2000:]


def test_bfloat16_amp_init_before_import_wraps_ops_fp32():
    """bf16 AMP, amp.init() first: the wrappers are rebuilt and every gn_mx op is cast to fp32."""
    code = """
    import numpy as np
    import mxnet as mx
    from mxnet.contrib import amp
    amp.init(target_dtype="bfloat16")
    import gn_mx
    def cast_dtype(fn):
        assert fn.__globals__ is amp.amp.__dict__, fn
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
        return cells["target_dtype"].cell_contents
    ops = [o for o in ("gn_group_norm", "gn_moments", "gn_dbn", "gn_dbn_inference",
                       "gn_channel_affine") if hasattr(mx.nd, o)]
    print("FP32", all(np.dtype(cast_dtype(getattr(m, o))) == np.float32
                      for o in ops for m in (mx.nd, mx.sym)))
    print("BF16", cast_dtype(mx.nd.Convolution) == amp.amp.bfloat16)
    """
    proc = run_python(code, timeout=120)
    assert "FP32 True" in proc.stdout and "BF16 True" in proc.stdout, proc.stdout + proc.stderr


def test_unregistered_op_is_rejected_by_converter():
    """Documents the MXNet behaviour gn_mx.amp works around (runs without amp.init)."""
    code = """
    import mxnet as mx
    from mxnet.contrib import amp
    d = mx.sym.var("data")
    s = mx.sym.Activation(d, act_type="relu")
    try:
        amp.convert_symbol(s, target_dtype_ops=["not_an_amp_op"], fp32_ops=[])
    except AssertionError as e:
        print("REJECTED", "not in any of them" in str(e))
    """
    proc = run_python(code, timeout=120)
    assert "REJECTED True" in proc.stdout, proc.stdout + proc.stderr


# -------------------------------------------------------------------------------------------------
# net.cast('float16') training (no AMP)

class _CastTo(gluon.HybridBlock):
    def __init__(self, dtype, **kwargs):
        super().__init__(**kwargs)
        self._dtype = dtype

    def hybrid_forward(self, F, x):
        return F.cast(x, dtype=self._dtype)


def _fp16_net(fp16):
    """Small CNN; with fp16=True its normalization part gets float16 data.

    MXNet 1.9.1 has no float16 gemm on CPU, so there the Conv2D/Dense blocks stay float32 and
    explicit casts surround the float16 part; on a GPU the whole net is float16. With fp16=False
    the casts are no-ops (the float32 reference).
    """
    part = "float16" if fp16 else "float32"
    tail = "float16" if fp16 and ON_GPU else "float32"
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1), _CastTo(part),
            gn_mx.GroupNorm(num_groups=4), gluon.nn.Activation("relu"))
    if HAS_DBN:
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=2), gluon.nn.Activation("relu"))
    net.add(_CastTo(tail), gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(4))
    return net


def _gemm_blocks(net):
    return [b for b in net._children.values() if isinstance(b, (gluon.nn.Conv2D, gluon.nn.Dense))]


def _train(net, x, y, steps, multi_precision=False):
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": 0.5, "momentum": 0.9,
                             "multi_precision": multi_precision})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        losses.append(float(loss.astype("float32").mean().asscalar()))
    return np.array(losses)


@pytest.fixture(scope="module")
def fp16_setup(tmp_path_factory):
    rng = np.random.RandomState(0)
    x = rng.randn(16, 3, 6, 6).astype(np.float32)
    w = rng.randn(3 * 36, 4)
    y = (x.reshape(16, -1) @ w).argmax(1).astype(np.float32)
    mx.random.seed(3)
    net = _fp16_net(False)
    net.initialize(mx.init.Xavier())
    net(mx.nd.array(x))
    path = str(tmp_path_factory.mktemp("fp16") / "init.params")
    net.save_parameters(path)
    ref = _fp16_net(False)
    ref.load_parameters(path)
    ref.hybridize()
    ref_losses = _train(ref, mx.nd.array(x), mx.nd.array(y), 25)
    return path, mx.nd.array(x), mx.nd.array(y), ref_losses


@pytest.mark.parametrize("variant", ["fp16_params", "fp16_params_multi_precision",
                                     "fp32_norm_params"])
def test_cast_float16_training_tracks_fp32(fp16_setup, variant):
    path, x, y, ref_losses = fp16_setup
    assert ref_losses[-1] < 0.7 * ref_losses[0], ref_losses  # the fp32 run learns
    net = _fp16_net(True)
    net.load_parameters(path)
    net.cast("float16")
    if not ON_GPU:
        for b in _gemm_blocks(net):
            b.cast("float32")
    if variant == "fp32_norm_params":
        # fp16 data with fp32 gamma/beta (and DBN statistics): the ops' multi-precision path
        for b in net._children.values():
            if isinstance(b, gn_mx.GroupNorm) or (HAS_DBN and isinstance(b, gn_mx.DecorrelatedBatchNorm)):
                b.cast("float32")
    net.hybridize()
    gn = [b for b in net._children.values() if isinstance(b, gn_mx.GroupNorm)][0]
    want = np.float32 if variant == "fp32_norm_params" else np.float16
    assert gn.gamma.data().dtype == want
    losses = _train(net, x, y, 25, multi_precision=variant.endswith("multi_precision"))
    assert np.isfinite(losses).all(), losses
    for p in net.collect_params().values():
        assert np.isfinite(p.data().asnumpy().astype(np.float32)).all(), p.name
    assert gn.gamma.data().dtype == want  # the optimizer kept the parameter dtype
    assert np.any(losses != ref_losses)  # float16 really ran: the rounding shows
    # tracks the fp32 run: same trajectory up to fp16 rounding
    assert np.abs(losses - ref_losses).max() < 0.05 + 0.05 * ref_losses.max(), (losses, ref_losses)
    assert losses[-1] < 0.7 * losses[0]
