"""Rough edges a new user meets: scripts' --help only prints help and writes nothing, shape errors
of the blocks are reported by the block (with the layer's name) also under deferred
initialization, empty batches under the NumPy interface, and the ONNX path prints no library
warnings the user cannot act on."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx
from mxnet import gluon

import gn_mx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scripts():
    found = []
    for top in ("benchmarks", "examples", "tools"):
        for p in sorted(glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)):
            if not os.path.basename(p).startswith("_"):  # helper modules, not scripts
                found.append(p)
    return found


def _git_status():
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True, check=True).stdout


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")) and
                    not os.path.isfile(os.path.join(ROOT, ".git")), reason="needs a git checkout")
def test_every_script_help_only_prints_help(tmp_path):
    scripts = _scripts()
    assert len(scripts) >= 10, scripts
    before = _git_status()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    # All at once (each mostly waits on imports); run from a scratch directory so a script that
    # writes into its working directory would be caught as well.
    procs = [(p, subprocess.Popen([sys.executable, p, "--help"], cwd=str(tmp_path), env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for p in scripts]
    bad = []
    for p, proc in procs:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            bad.append(f"{p}: --help still running after 120 s")
            continue
        if proc.returncode != 0 or "usage:" not in out:
            bad.append(f"{p}: rc {proc.returncode}, output:\n{out[-800:]}")
    assert not bad, "\n".join(bad)
    assert _git_status() == before, "a script's --help changed the repository"
    assert os.listdir(str(tmp_path)) == [], "a script's --help wrote into the working directory"


# ---- shape rules reported by the block, with its name, also under deferred initialization -------

def _conv_then(norm, channels=16):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(channels, 3), norm)
    net.initialize()
    return net


def _raises_from_block(call, *fragments):
    with pytest.raises(ValueError) as e:
        call()
    msg = str(e.value)
    assert "Deferred initialization failed" not in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


@pytest.mark.parametrize("where", ["imperative", "hybridized_parent", "hybridized_block"])
def test_groupnorm_default_groups_after_16_channels(where):
    norm = gn_mx.GroupNorm()  # num_groups=32 by default
    net = _conv_then(norm)
    if where == "hybridized_parent":
        net.hybridize()
    elif where == "hybridized_block":
        norm.hybridize()
    x = mx.nd.ones((2, 3, 8, 8))
    for _ in range(2):  # the first call and the next (still not initialized): the same message
        _raises_from_block(lambda: net(x), f"GroupNorm '{norm.name}'",
                           "channels (C=16) must be divisible by num_groups (32)")
    # A good layer in the same place still initializes and runs afterwards.
    net2 = _conv_then(gn_mx.GroupNorm(num_groups=8))
    assert net2(x).shape == (2, 16, 6, 6)


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("kwargs,fragment", [
    ({"num_groups": 3}, "channels (C=16) must be divisible by num_groups (3)"),
    ({"group_size": 5}, "(16) must be divisible by group_size (5)"),
])
def test_dbn_grouping_errors_under_deferred_init(kwargs, fragment, hybridize):
    norm = gn_mx.DecorrelatedBatchNorm(**kwargs)
    net = _conv_then(norm)
    if hybridize:
        net.hybridize()
    for training in (False, True):
        with mx.autograd.record(train_mode=training):
            _raises_from_block(lambda: net(mx.nd.ones((2, 3, 8, 8))),
                               f"DecorrelatedBatchNorm '{norm.name}'", fragment)


def test_dbn_group_size_limit_and_channel_mismatch_and_rank():
    dbn = gn_mx.DecorrelatedBatchNorm(num_groups=1)
    dbn.initialize()
    _raises_from_block(lambda: dbn(mx.nd.ones((1, 4097))), f"'{dbn.name}'",
                       "group size C/num_groups = 4097 exceeds the limit 4096")
    gn = gn_mx.GroupNorm(num_groups=4, in_channels=8)
    gn.initialize()
    _raises_from_block(lambda: gn(mx.nd.ones((2, 16, 3))), f"'{gn.name}'",
                       "the input has C=16 channels", "the layer has 8")
    gn1 = gn_mx.GroupNorm(num_groups=1)
    gn1.initialize()
    _raises_from_block(lambda: gn1(mx.nd.ones((4,))), f"'{gn1.name}'",
                       "at least 2 dims (N, C, *spatial); got shape (4,)")


# ---- empty batches under the NumPy interface ----------------------------------------------------

@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("cls", ["GroupNorm", "DecorrelatedBatchNorm"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_empty_np_batch_gives_empty_output(np_mode, cls, hybridize, dtype):
    blk = getattr(gn_mx, cls)(num_groups=2)
    blk.initialize()
    if hybridize:
        blk.hybridize()
    x = mx.np.random.normal(size=(3, 4, 5)).astype(dtype)
    blk.cast(dtype)
    ref = blk(x)  # a real batch first: parameters initialized, a graph cached
    stats = [p.data().asnumpy().copy() for p in blk.collect_params().values()]
    for training in (False, True):
        for shape in [(0, 4, 5), (0, 4), (0, 4, 2, 3)]:
            with mx.autograd.record(train_mode=training):
                y = blk(mx.np.zeros(shape, dtype=dtype))
            assert isinstance(y, mx.np.ndarray)
            assert y.shape == shape and y.dtype == np.dtype(dtype)
    mx.nd.waitall()  # no deferred engine error
    for p, before in zip(blk.collect_params().values(), stats):
        np.testing.assert_array_equal(p.data().asnumpy(), before)  # running stats unchanged
    # and the block still computes on real data
    np.testing.assert_allclose(blk(x).asnumpy(), ref.asnumpy(), rtol=1e-3, atol=1e-3)


def test_empty_np_batch_first_call_then_real_batch(np_mode):
    blk = gn_mx.GroupNorm(num_groups=2)  # deferred in_channels
    blk.initialize()
    blk.hybridize()
    assert blk(mx.np.zeros((0, 4, 3))).shape == (0, 4, 3)
    assert blk(mx.np.ones((2, 4, 3))).shape == (2, 4, 3)
    # divisibility is still checked on an empty batch whose C is known
    with pytest.raises(ValueError, match=r"channels \(C=5\) must be divisible by num_groups \(2\)"):
        gn_mx.GroupNorm(num_groups=2)(mx.np.zeros((0, 5, 3)))


@pytest.mark.parametrize("hybridize", [False, True])
def test_empty_np_batch_in_a_network(np_mode, hybridize):
    # (gn_mx layers only: MXNet 1.9's own Conv2D and Activation fail on an empty batch at the
    # next wait)
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.GroupNorm(num_groups=4), gn_mx.DecorrelatedBatchNorm(num_groups=2))
    net.initialize()
    if hybridize:
        net.hybridize()
    net(mx.np.ones((2, 8, 4, 4)))
    empty = mx.np.zeros((0, 8, 4, 4))
    if hybridize:
        # the graph runs the op on what it gets: a clear error at the call, nothing pending
        with pytest.raises(ValueError, match=r"input of shape \(0, 8, 4, 4\) is empty"):
            net(empty)
    else:
        assert net(empty).shape == (0, 8, 4, 4)
    mx.nd.waitall()
    assert net(mx.np.ones((1, 8, 4, 4))).shape == (1, 8, 4, 4)


def test_empty_np_batch_imported_symbolblock(np_mode, tmp_path):
    net = gluon.nn.HybridSequential()
    net.add(gn_mx.GroupNorm(num_groups=2), gn_mx.DecorrelatedBatchNorm(num_groups=2))
    net.initialize()
    net.hybridize()
    x = mx.np.random.normal(size=(2, 4, 3))
    net(x)
    net.export(str(tmp_path / "m"))
    blk = gluon.SymbolBlock.imports(str(tmp_path / "m-symbol.json"), ["data"],
                                    str(tmp_path / "m-0000.params"))
    with pytest.raises(ValueError, match=r"input of shape \(0, 4, 3\) is empty"):
        blk(mx.np.zeros((0, 4, 3)))
    mx.nd.waitall()
    assert blk(x).shape == (2, 4, 3)


def test_empty_np_batch_functional_ops(np_mode):
    x = mx.np.zeros((0, 4, 3))
    g, b = mx.np.ones(4), mx.np.zeros(4)
    assert gn_mx.ops.group_norm(x, g, b, num_groups=2).shape == (0, 4, 3)
    rm, rp = mx.np.zeros(4), mx.np.array(np.stack([np.eye(2)] * 2).astype(np.float32))
    assert gn_mx.ops.dbn_inference(x, rm, rp, num_groups=2).shape == (0, 4, 3)
    for call in (lambda: gn_mx.ops.moments(x, num_groups=2),
                 lambda: gn_mx.ops.group_norm(x, g, b, num_groups=2, return_stats=True),
                 lambda: gn_mx.ops.dbn(x, rm, rp, num_groups=2),
                 lambda: gn_mx.ops.group_norm(mx.np.zeros((2, 4, 0)), g, b, num_groups=2)):
        with pytest.raises(ValueError, match="is empty"):
            call()
    mx.nd.waitall()


# ---- the ONNX path prints no warnings a user cannot act on ---------------------------------------

_ONNX_SCRIPT = r"""
import os, sys, numpy as np, mxnet as mx
from mxnet import gluon
import gn_mx, onnxruntime as ort
d = sys.argv[1]
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(8, 3), gn_mx.GroupNorm(num_groups=4), gn_mx.DecorrelatedBatchNorm(num_groups=2))
net.initialize()
net.hybridize()
x = np.random.RandomState(0).randn(2, 3, 8, 8).astype(np.float32)
y = net(mx.nd.array(x)).asnumpy()
net.export(os.path.join(d, "m"))
import gn_mx.onnx  # the documented export (opset 17; MXNet's own writes onnx's newest)
gn_mx.onnx.export_model(os.path.join(d, "m-symbol.json"), os.path.join(d, "m-0000.params"),
                        in_shapes=[x.shape], in_types=[np.float32],
                        onnx_file_path=os.path.join(d, "m.onnx"))
sess = ort.InferenceSession(os.path.join(d, "m.onnx"), providers=["CPUExecutionProvider"])
assert [i.name for i in sess.get_inputs()] == ["data"], [i.name for i in sess.get_inputs()]
print("MAXERR", float(np.abs(sess.run(None, {"data": x})[0] - y).max()))
"""


def test_onnx_export_and_session_print_no_warnings(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    p = subprocess.run([sys.executable, "-c", _ONNX_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert p.returncode == 0, p.stdout[-2000:]
    lines = [l for l in p.stdout.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("MAXERR"), p.stdout[-2000:]
    assert float(lines[0].split()[1]) < 1e-4


# ---- the raw ops on a zero-size array under the NumPy interface: an error at the call ------------

def _raw_calls(x):
    C = x.shape[1]
    g, b = mx.nd.ones(C), mx.nd.zeros(C)
    rm, rp = mx.nd.zeros(C), mx.nd.array(np.stack([np.eye(2)] * (C // 2)))
    return {
        "gn_group_norm": lambda: mx.nd.gn_group_norm(x, g, b, num_groups=2),
        "gn_moments": lambda: mx.nd.gn_moments(x, num_groups=2),
        "gn_channel_affine": lambda: mx.nd.gn_channel_affine(x, g, b),
        "gn_dbn_inference": lambda: mx.nd.gn_dbn_inference(x, rm, rp, num_groups=C // 2),
        "gn_dbn": lambda: mx.nd.gn_dbn(x, rm, rp, num_groups=C // 2),
    }


@pytest.mark.parametrize("shape", [(0, 4, 3), (2, 4, 0), (0, 4)])
def test_raw_ops_refuse_zero_size_np_arrays_at_the_call(np_mode, shape):
    x = mx.np.zeros(shape).as_nd_ndarray()  # the legacy view the raw ops take (no copy)
    for op, call in _raw_calls(x).items():
        with pytest.raises(mx.base.MXNetError) as e:
            call()  # before: a shape-() result, the error only at the next wait
        msg = str(e.value)
        assert f"{op}: data of shape {shape} is empty" in msg, msg
    mx.nd.waitall()  # nothing pending


def test_raw_op_in_a_hybridized_custom_block_refuses_an_empty_np_batch(np_mode):
    class Norm(gluon.HybridBlock):
        @gn_mx.nn.numpy_interface
        def hybrid_forward(self, F, x):
            return F.gn_moments(x, num_groups=2)[0]

    blk = Norm()
    blk.hybridize()
    assert blk(mx.np.ones((2, 4, 3))).shape == (2, 2)
    # (gn_mx's hybridized-call guard names the block first; the op itself would name gn_moments)
    with pytest.raises((ValueError, mx.base.MXNetError), match=r"shape \(0, 4, 3\) is empty"):
        blk(mx.np.zeros((0, 4, 3)))
    mx.nd.waitall()
    assert blk(mx.np.ones((1, 4, 3))).shape == (1, 2)


def test_legacy_zero_dims_still_mean_unknown():
    # legacy shape semantics: a 0 dim is "not inferred yet", not an empty array
    s = mx.sym.gn_group_norm(mx.sym.var("data"), mx.sym.var("g"), mx.sym.var("b"), num_groups=2)
    args, outs, _ = s.infer_shape_partial(data=(0, 4, 3))  # no "is empty" error
    assert args[1] != (4,)  # gamma is filled from data only once all of data's shape is known
    args, outs, _ = s.infer_shape(data=(2, 4, 3))
    assert outs[0] == (2, 4, 3) and args[1] == (4,)


# ---- the other shape rules, inside a hybridized parent (deferred initialization) ----------------

@pytest.mark.parametrize("case", ["rank", "channels", "group_limit", "group_size"])
def test_shape_rules_reported_by_the_block_inside_a_hybridized_parent(case):
    net = gluon.nn.HybridSequential()
    if case == "rank":
        norm = gn_mx.GroupNorm(num_groups=1)
        net.add(norm)
        x, fragments = mx.nd.ones((4,)), ["at least 2 dims (N, C, *spatial); got shape (4,)"]
    elif case == "channels":
        norm = gn_mx.GroupNorm(num_groups=4, in_channels=8)
        net.add(gluon.nn.Conv2D(16, 3), norm)
        x, fragments = mx.nd.ones((2, 3, 8, 8)), ["the input has C=16 channels", "the layer has 8"]
    elif case == "group_limit":
        norm = gn_mx.DecorrelatedBatchNorm(num_groups=1)
        net.add(gluon.nn.Dense(4097), norm)
        x, fragments = mx.nd.ones((2, 3)), ["group size C/num_groups = 4097 exceeds the limit 4096"]
    else:
        norm = gn_mx.DecorrelatedBatchNorm(group_size=4)
        net.add(gluon.nn.Dense(6), norm)
        x, fragments = mx.nd.ones((2, 3)), ["(6) must be divisible by group_size (4)"]
    net.initialize()
    net.hybridize()
    _raises_from_block(lambda: net(x), f"'{norm.name}'", *fragments)
    mx.nd.waitall()


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("cls", ["GroupNorm", "DecorrelatedBatchNorm"])
def test_integer_input_reported_by_the_block(cls, hybridize):
    blk = getattr(gn_mx, cls)(num_groups=2)  # deferred in_channels
    blk.initialize()
    if hybridize:
        blk.hybridize()
    for dtype in ("int32", "uint8"):
        _raises_from_block(lambda: blk(mx.nd.ones((2, 4, 3), dtype=dtype)), f"'{blk.name}'",
                           f"input dtype must be float16, float32 or float64; got {dtype}")
    assert blk(mx.nd.ones((2, 4, 3))).shape == (2, 4, 3)  # and the block still works
    mx.nd.waitall()


@pytest.mark.parametrize("script,args", [("dbn_cnn.py", ["--steps", "2"]),
                                         ("gradient_penalty.py", ["--steps", "1"])])
def test_examples_print_no_library_warnings(tmp_path, script, args):
    if script == "dbn_cnn.py":
        args = args + ["--out", str(tmp_path / "m")]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)] + args,
                       cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python")))
    assert p.returncode == 0, p.stdout[-2000:]
    assert "Warning" not in p.stdout, p.stdout[-2000:]
