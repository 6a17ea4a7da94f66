"""Channels-last GroupNorm (axis=-1): gn_group_norm, its backward and double backward, gn_moments,
the fused activation, the blocks and wrappers, hybridize/export/reload, AMP, the NumPy interface,
the Module API.

The channels-last kernels read (N, *spatial, C) memory directly; every result here is compared with
the channels-first op on the same data transposed (within rounding: the two layouts sum in a
different order) and with the float64 reference. The numerical edge cases run in this layout in
test_edge_cases.py (edge_cases.ChannelsLast).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import reload_outputs, run_python
from reference import group_norm_bwd_ref, group_norm_ref, moments_ref
from tolerances import GRAD_TOL, tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = [np.float16, np.float32, np.float64]
ACTS = [None, "relu", "silu"]


def first(a):
    """(N, *spatial, C) -> (N, C, *spatial)."""
    return np.ascontiguousarray(np.moveaxis(a, -1, 1)) if a.ndim > 2 else a


def last(a):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)) if a.ndim > 2 else a


def _run_gn(x, gamma, beta, G, axis, act=None, dy=None, dmean=None, drstd=None, eps=1e-5):
    """gn_group_norm forward (+ backward with dy) on numpy arrays; numpy results."""
    xs, gs, bs = (mx.nd.array(a, dtype=a.dtype) for a in (x, gamma, beta))
    for a in (xs, gs, bs):
        a.attach_grad()
    kw = {} if act is None else {"act_type": act}
    if axis != 1:
        kw["axis"] = axis
    with autograd.record():
        y, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps, **kw)
    out = {"y": y, "mean": mean, "rstd": rstd}
    if dy is not None:
        heads, grads = [y], [mx.nd.array(dy, dtype=dy.dtype)]
        if dmean is not None:
            heads += [mean, rstd]
            grads += [mx.nd.array(dmean, dtype=mean.dtype), mx.nd.array(drstd, dtype=rstd.dtype)]
        autograd.backward(heads, grads)
        out.update(dx=xs.grad, dgamma=gs.grad, dbeta=bs.grad)
    return {k: v.asnumpy() for k, v in out.items()}


# Shapes (channels last) and groups: 0-3 spatial dims; one sample (threads share it), uneven
# sample counts, groups of one channel, many channels, rows longer than a statistics chunk.
SHAPES = [
    ((4, 12), 3),
    ((3, 7, 8), 2),
    ((2, 5, 6, 16), 4),
    ((1, 40, 40, 32), 8),
    ((3, 9, 11, 6), 6),
    ((2, 3, 4, 5, 8), 2),
    ((2, 6, 5000), 10),
    ((5, 17, 17, 64), 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", ACTS, ids=str)
@pytest.mark.parametrize("shape,G", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_matches_transposed_channels_first(shape, G, act, dtype):
    """axis=-1 on (N, *spatial, C) == axis=1 on the transposed data, forward and backward (with
    gradients into mean and rstd), and both match the float64 reference."""
    rng = np.random.RandomState(sum(shape) + G)
    C = shape[-1]
    x = (rng.randn(*shape) * 2 + 0.5).astype(dtype)
    dy = rng.randn(*shape).astype(dtype)
    gamma = (rng.rand(C) + 0.5).astype(dtype)
    beta = rng.randn(C).astype(dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean = rng.randn(shape[0], G).astype(acc)
    drstd = rng.randn(shape[0], G).astype(acc)
    rl = _run_gn(x, gamma, beta, G, -1, act, dy, dmean, drstd)
    rf = _run_gn(first(x), gamma, beta, G, 1, act, first(dy), dmean, drstd)
    rt, gt = tol(dtype), tol(dtype, GRAD_TOL)
    for k in ("y", "dx"):
        np.testing.assert_allclose(first(rl[k]).astype(np.float64), rf[k].astype(np.float64),
                                   *(rt if k == "y" else gt), err_msg=k)
    for k in ("mean", "rstd"):
        np.testing.assert_allclose(rl[k], rf[k], *rt, err_msg=k)
    for k in ("dgamma", "dbeta"):
        np.testing.assert_allclose(rl[k].astype(np.float64), rf[k].astype(np.float64),
                                   rtol=gt[0], atol=gt[1] * max(1.0, np.abs(rf[k]).max()),
                                   err_msg=k)
    x64 = first(x).astype(np.float64)
    ref, rmean, rrstd = group_norm_ref(x64, gamma.astype(np.float64), beta.astype(np.float64), G,
                                       1e-5, act=act)
    np.testing.assert_allclose(first(rl["y"]).astype(np.float64), ref, *rt)
    np.testing.assert_allclose(rl["mean"], rmean, *rt)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma.astype(np.float64), first(dy).astype(np.float64),
                                       G, 1e-5, dmean, drstd, act=act, beta=beta.astype(np.float64))
    np.testing.assert_allclose(first(rl["dx"]).astype(np.float64), rdx, *gt)
    np.testing.assert_allclose(rl["dgamma"].astype(np.float64), rdg, rtol=gt[0],
                               atol=gt[1] * max(1.0, np.abs(rdg).max()))


def test_fp16_data_fp32_params():
    """float16 data with float32 gamma/beta (multi-precision) in both layouts."""
    rng = np.random.RandomState(3)
    x = rng.randn(2, 6, 6, 8).astype(np.float16)
    dy = rng.randn(2, 6, 6, 8).astype(np.float16)
    g, b = (rng.rand(8) + 0.5).astype(np.float32), rng.randn(8).astype(np.float32)
    rl = _run_gn(x, g, b, 4, -1, "silu", dy)
    rf = _run_gn(first(x), g, b, 4, 1, "silu", first(dy))
    assert rl["dgamma"].dtype == np.float32 and rl["y"].dtype == np.float16
    np.testing.assert_allclose(first(rl["y"]).astype(np.float32), rf["y"].astype(np.float32),
                               *tol(np.float16))
    np.testing.assert_allclose(rl["dgamma"], rf["dgamma"], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(first(rl["dx"]).astype(np.float32), rf["dx"].astype(np.float32),
                               *tol(np.float16, GRAD_TOL))


@pytest.mark.parametrize("axis", [-1, 3])
def test_last_axis_spellings(axis):
    x = np.random.RandomState(0).randn(2, 3, 4, 6).astype(np.float32)
    r = _run_gn(x, np.ones(6, np.float32), np.zeros(6, np.float32), 3, axis)
    ref = _run_gn(first(x), np.ones(6, np.float32), np.zeros(6, np.float32), 3, 1)
    np.testing.assert_allclose(first(r["y"]), ref["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 2, -2, 5])
def test_other_axes_are_refused(axis):
    x = mx.nd.ones((2, 3, 4, 6))
    with pytest.raises(mx.base.MXNetError, match=r"gn_group_norm: axis must be 1 .* got axis="
                                                 + str(axis)):
        mx.nd.gn_group_norm(x, mx.nd.ones(6), mx.nd.zeros(6), num_groups=3, axis=axis)[0].wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="gn_moments: axis must be 1"):
        mx.nd.gn_moments(x, num_groups=3, axis=axis)[0].wait_to_read()


def test_axis_message_has_one_wording():
    """The op's message (validate.h) and the blocks' (_validate.channel_axis) are AXIS_RULE's."""
    from gn_mx._validate import AXIS_RULE, channel_axis
    shape = (2, 3, 4, 6)
    want = "gn_group_norm: " + AXIS_RULE.format(last=3) + "; got axis=2 for "
    with pytest.raises(mx.base.MXNetError) as e:
        mx.nd.gn_group_norm(mx.nd.ones(shape), mx.nd.ones(6), mx.nd.zeros(6), num_groups=3,
                            axis=2)[0].wait_to_read()
    assert want + "data shape " in str(e.value), str(e.value)
    with pytest.raises(ValueError) as e:
        channel_axis("gn_group_norm", 2, shape)
    assert str(e.value) == want + "input shape (2, 3, 4, 6)"


def test_bad_axis_attribute_and_arguments():
    with pytest.raises(mx.base.MXNetError, match="gn_group_norm: attribute axis must be an integer"):
        mx.nd.gn_group_norm(mx.nd.ones((2, 4)), mx.nd.ones(4), mx.nd.zeros(4), axis="last")
    for bad in (0, 1.5, "x", True):
        with pytest.raises(ValueError, match="GroupNorm: axis must be 1"):
            gn_mx.GroupNorm(2, axis=bad)
    with pytest.raises(ValueError, match="gn_mx.ops.group_norm: axis must be 1"):
        gn_mx.ops.group_norm(mx.nd.ones((2, 4)), mx.nd.ones(4), mx.nd.zeros(4), axis=0)
    blk = gn_mx.GroupNorm(2, axis=2)
    blk.initialize()
    with pytest.raises(ValueError, match=r"GroupNorm '.*': axis must be 1 .* got axis=2 for input "
                                         r"shape \(2, 3, 4, 4\)"):
        blk(mx.nd.ones((2, 3, 4, 4)))
    blk = gn_mx.GroupNorm(3, axis=-1)
    blk.initialize()
    with pytest.raises(ValueError, match=r"channels \(C=4\) must be divisible by num_groups \(3\)"):
        blk(mx.nd.ones((2, 3, 3, 4)))  # C is the last axis (4), not axis 1 (3)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_moments(dtype):
    rng = np.random.RandomState(5)
    x = (rng.randn(3, 5, 7, 12) + 4).astype(dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean, dvar = rng.randn(3, 4).astype(acc), rng.randn(3, 4).astype(acc)

    def run(data, axis):
        xs = mx.nd.array(data, dtype=dtype)
        xs.attach_grad()
        with autograd.record():
            m, v = gn_mx.ops.moments(xs, num_groups=4, axis=axis)
        autograd.backward([m, v], [mx.nd.array(dmean, dtype=acc), mx.nd.array(dvar, dtype=acc)])
        return m.asnumpy(), v.asnumpy(), xs.grad.asnumpy()

    ml, vl, dl = run(x, -1)
    mf, vf, df = run(first(x), 1)
    rm, rv = moments_ref(first(x).astype(np.float64), 4)
    np.testing.assert_allclose(ml, rm, *tol(dtype))
    np.testing.assert_allclose(vl, rv, *tol(dtype))
    np.testing.assert_allclose(ml, mf, *tol(dtype))
    np.testing.assert_allclose(first(dl).astype(np.float64), df.astype(np.float64),
                               *tol(dtype, GRAD_TOL))


@pytest.mark.parametrize("act", ACTS, ids=str)
def test_double_backward(act):
    """autograd.grad(create_graph=True) through gn_group_norm(axis=-1): the gradient of
    sum(dx * w) w.r.t. x, gamma, beta equals the channels-first one on transposed data."""
    rng = np.random.RandomState(9)
    x = rng.randn(2, 5, 4, 6)
    dy, w = rng.randn(*x.shape), rng.randn(*x.shape)
    g, b = rng.rand(6) + 0.5, rng.randn(6)

    def run(xv, dyv, wv, axis):
        xs, gs, bs = (mx.nd.array(a, dtype=np.float64) for a in (xv, g, b))
        for a in (xs, gs, bs):
            a.attach_grad()
        kw = {"act_type": act} if act else {}
        with autograd.record():
            y = gn_mx.ops.group_norm(xs, gs, bs, num_groups=3, axis=axis, **kw)
            dx, dg = autograd.grad(y, [xs, gs], head_grads=mx.nd.array(dyv, dtype=np.float64),
                                   create_graph=True, retain_graph=True)
            loss = (dx * mx.nd.array(wv, dtype=np.float64)).sum() + (dg * dg).sum()
        loss.backward()
        return xs.grad.asnumpy(), gs.grad.asnumpy(), bs.grad.asnumpy()

    l = run(x, dy, w, -1)
    f = run(first(x), first(dy), first(w), 1)
    np.testing.assert_allclose(first(l[0]), f[0], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(l[1], f[1], rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(l[2], f[2], rtol=1e-9, atol=1e-11)
    assert np.abs(f[0]).max() > 1e-3  # the second derivative is not trivially zero


# ---------------------------------------------------------------------------------------------
# Blocks, graphs, export


class _TransposedGN(gluon.HybridBlock):
    """The workaround GroupNorm(axis=-1) replaces: transpose to channels first, GroupNorm,
    transpose back."""

    def __init__(self, norm, **kw):
        super().__init__(**kw)
        self.norm = norm

    def hybrid_forward(self, F, x):
        return F.transpose(self.norm(F.transpose(x, (0, 3, 1, 2))), (0, 2, 3, 1))


def _net(norm):
    """A channels-last net: Dense(flatten=False) works on the last axis, as NHWC convolutions do."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, flatten=False, in_units=4), norm, gluon.nn.Dense(4, flatten=False,
                                                                             in_units=8))
    return net


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("act", [None, "silu"], ids=str)
def test_block_trains_like_transposed_channels_first(hybridize, act):
    """A net with GroupNorm(axis=-1) gives the outputs and gradients of the same net normalizing
    through two transposes and GroupNorm(axis=1), and trains the same (three SGD steps)."""
    init = dict(gamma_initializer=mx.init.Uniform(1.0), beta_initializer=mx.init.Uniform(1.0))
    mx.random.seed(7)
    net_l = _net(gn_mx.GroupNorm(4, axis=-1, activation=act, in_channels=8, **init))
    net_l.initialize(mx.init.Xavier())
    net_f = _net(_TransposedGN(gn_mx.GroupNorm(4, activation=act, in_channels=8)))
    net_f.initialize()
    for pl, pf in zip(net_l.collect_params().values(), net_f.collect_params().values()):
        pf.set_data(pl.data())
    if hybridize:
        net_l.hybridize()
        net_f.hybridize()
    x = mx.nd.array(np.random.RandomState(1).randn(3, 6, 5, 4))
    tl = gluon.Trainer(net_l.collect_params(), "sgd", {"learning_rate": 0.1})
    tf = gluon.Trainer(net_f.collect_params(), "sgd", {"learning_rate": 0.1})
    for _ in range(3):
        outs = []
        for net, tr in ((net_l, tl), (net_f, tf)):
            with autograd.record():
                y = net(x)
                loss = (y * y).mean()
            loss.backward()
            tr.step(1)
            outs.append(y.asnumpy())
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for pl, pf in zip(net_l.collect_params().values(), net_f.collect_params().values()):
        np.testing.assert_allclose(pl.data().asnumpy(), pf.data().asnumpy(), rtol=1e-4, atol=1e-5)


def test_block_export_reload_fresh_process(tmp_path):
    """A hybridized GroupNorm(axis=-1) exports `axis` into the graph and reloads in a fresh
    process with the same outputs; the default block writes no axis attribute."""
    blk = gn_mx.GroupNorm(2, axis=-1, activation="relu", gamma_initializer=mx.init.Uniform(1.0),
                          beta_initializer=mx.init.Uniform(1.0))
    blk.initialize()
    blk.hybridize()
    x = np.random.RandomState(2).randn(2, 5, 5, 6).astype(np.float32)
    y = blk(mx.nd.array(x)).asnumpy()
    prefix = str(tmp_path / "gn_nhwc")
    blk.export(prefix)
    node = [n for n in json.load(open(prefix + "-symbol.json"))["nodes"]
            if n["op"] == "gn_group_norm"][0]
    assert node["attrs"]["axis"] == "-1"
    np.testing.assert_allclose(reload_outputs(prefix, [x])[0], y, rtol=0, atol=1e-6)
    plain = gn_mx.GroupNorm(2)
    plain.initialize()
    plain.hybridize()
    plain(mx.nd.ones((1, 4, 3)))
    plain.export(str(tmp_path / "plain"))
    node = [n for n in json.load(open(str(tmp_path / "plain-symbol.json")))["nodes"]
            if n["op"] == "gn_group_norm"][0]
    assert "axis" not in node["attrs"]
    assert "axis=-1" in repr(blk) and "axis" not in repr(plain)


def test_deferred_init_reads_last_axis():
    blk = gn_mx.GroupNorm(2, axis=-1)
    blk.initialize()
    blk.hybridize()
    y = blk(mx.nd.ones((2, 3, 4, 6)))
    assert blk.gamma.shape == (6,) and y.shape == (2, 3, 4, 6)


def test_symbol_helper_and_module():
    """gn_mx.sym.group_norm(axis=-1) in the Module API: forward/backward like the block."""
    data = mx.sym.var("data")
    out = gn_mx.sym.group_norm(data, num_groups=2, name="gn0", axis=-1)
    assert out.infer_shape(data=(2, 3, 4, 6))[0][1] == (6,)  # gamma (C,) from the last axis
    net = mx.sym.make_loss(mx.sym.sum(mx.sym.square(out)))
    mod = mx.mod.Module(net, data_names=["data"], label_names=None)
    mod.bind(data_shapes=[("data", (2, 3, 4, 6))], inputs_need_grad=True)
    mod.init_params(mx.init.Uniform(1.0))
    x = np.random.RandomState(4).randn(2, 3, 4, 6).astype(np.float32)
    mod.forward(mx.io.DataBatch([mx.nd.array(x)]), is_train=True)
    mod.backward()
    dx = mod.get_input_grads()[0].asnumpy()
    args, _ = mod.get_params()
    g, b = args["gn0_gamma"].asnumpy(), args["gn0_beta"].asnumpy()
    z, _, _ = group_norm_ref(first(x).astype(np.float64), g, b, 2, 1e-5)
    rdx, _, _ = group_norm_bwd_ref(first(x).astype(np.float64), g, 2 * z, 2, 1e-5)
    np.testing.assert_allclose(first(dx), rdx, rtol=1e-3, atol=1e-4)


def test_numpy_interface():
    from mxnet import np as mnp, npx
    npx.set_np()
    try:
        blk = gn_mx.GroupNorm(2, axis=-1)
        blk.initialize()
        x = np.random.RandomState(6).randn(2, 4, 4, 6).astype(np.float32)
        y = blk(mnp.array(x))
        assert type(y).__name__ == "ndarray" and y.shape == x.shape
        ref, _, _ = group_norm_ref(first(x).astype(np.float64), np.ones(6), np.zeros(6), 2, 1e-5)
        np.testing.assert_allclose(first(y.asnumpy()), ref, rtol=1e-4, atol=1e-4)
        e = blk(mnp.zeros((0, 4, 4, 6)))
        assert e.shape == (0, 4, 4, 6)
        blk.hybridize()
        y2 = blk(mnp.array(x))
        np.testing.assert_allclose(y2.asnumpy(), y.asnumpy(), rtol=1e-6, atol=1e-6)
    finally:
        npx.reset_np()


def test_amp_float16():
    """MXNet AMP (convert_hybrid_block, float16) keeps gn_group_norm(axis=-1) in float16 with its
    axis; the converted net's output is the float32 one within float16 rounding."""
    code = """
        import numpy as np, mxnet as mx, gn_mx
        from mxnet import gluon
        from mxnet.contrib import amp
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(8, flatten=False, in_units=4), gn_mx.GroupNorm(4, axis=-1))
        net.initialize(mx.init.Xavier())
        net.hybridize()
        x = mx.nd.array(np.random.RandomState(0).randn(2, 5, 5, 4))
        ref = net(x).asnumpy()
        conv = amp.convert_hybrid_block(net, ctx=mx.cpu(), **gn_mx.amp.cpu_convert_kwargs())
        out = conv(x)
        import json
        nodes = json.loads(conv._cached_graph[1].tojson())["nodes"]
        gn = [n for n in nodes if n["op"] == "gn_group_norm"][0]
        print("AXIS", gn["attrs"].get("axis"), "ERR", float(np.abs(out.asnumpy() - ref).max()))
    """
    p = run_python(code)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("AXIS")][0].split()
    # not bit-identical (it ran in float16), within float16 rounding
    assert line[1] == "-1" and 0 < float(line[3]) < 2e-2, p.stdout


@pytest.mark.parametrize("shape,G,act", [((1, 256, 256, 33), 3, None), ((3, 128, 128, 64), 8, "silu")],
                         ids=["odd_C", "silu"])
def test_streamed_forward_output(shape, G, act):
    """fp32 outputs of 8 MB and more are streamed out of an L1 buffer (odd C: rows start at every
    alignment, the stores' scalar head): y and the statistics are channels first's."""
    rng = np.random.RandomState(1)
    x = rng.randn(*shape).astype(np.float32)
    assert x.nbytes >= 8 << 20
    g, b = (rng.rand(shape[-1]) + .5).astype(np.float32), rng.randn(shape[-1]).astype(np.float32)
    rl, rf = _run_gn(x, g, b, G, -1, act), _run_gn(first(x), g, b, G, 1, act)
    np.testing.assert_allclose(first(rl["y"]), rf["y"], rtol=1e-5, atol=1e-5)
    for k in ("mean", "rstd"):
        np.testing.assert_allclose(rl[k], rf[k], rtol=1e-5, atol=1e-6)


_STREAM_RUN = """
import sys, numpy as np, mxnet as mx, gn_mx
shape = tuple(int(v) for v in sys.argv[1].split(","))
x = mx.nd.array(np.random.RandomState(1).randn(*shape).astype(np.float32))
C = shape[-1]
mx.nd.gn_group_norm(x, mx.nd.ones(C), mx.nd.zeros(C), num_groups=3, axis=-1)[0].wait_to_read()
print("FORWARD_DONE")
"""


def _stream_store_called(shape):
    """Whether the channels-last forward of float32 data of `shape` calls the rows' streaming
    store (RowPrims::stream): a gdb breakpoint on the portable primitives' (GNMX_CPU_ISA=generic:
    a function of its own, reached through the RowPrims table like every ISA's) is hit or not."""
    env = dict(os.environ, GNMX_CPU_ISA="generic", OMP_NUM_THREADS="1")
    # Symbols of libgn_mx.so only (libmxnet's would take most of the time): stop once when it
    # loads, read its symbols, break on the store, run on; gdb -batch ends the run at the first hit.
    gdb = ["gdb", "-batch", "-nx", "-iex", "set debuginfod enabled off", "-iex",
           "set auto-solib-add off", "-ex", "set pagination off", "-ex", "tcatch load libgn_mx",
           "-ex", "run", "-ex", "sharedlibrary libgn_mx", "-ex",
           "break gn_mx::simd::GenericRows<float>::stream", "-ex", "continue"]
    p = subprocess.run(gdb + ["--args", sys.executable, "-c", _STREAM_RUN,
                              ",".join(map(str, shape))],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert re.search(r"Breakpoint \d+ at", p.stdout), p.stdout[-2000:] + p.stderr[-2000:]  # found
    hit = re.search(r"hit Breakpoint \d+, .*GenericRows<float>::stream", p.stdout) is not None
    assert hit or "FORWARD_DONE" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    return hit


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb to see which store path ran")
def test_streamed_forward_output_takes_the_streaming_path():
    """test_streamed_forward_output's first shape (8.6 MB of float32 output) is written through the
    streaming store, and one just below kStreamBytesFwd (8 MB, group_norm_cpu_common.h) is not:
    the size check above alone would pass if the threshold moved or the path were skipped."""
    assert _stream_store_called((1, 256, 256, 33))
    assert not _stream_store_called((1, 252, 252, 33))  # 8.38e6 bytes < 8 MiB = 8.39e6


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", [None, "silu"], ids=str)
def test_large_samples(act, dtype):
    """Samples larger than a core's L2 (1.2 MB fp32; many statistics chunks): the results, with
    output gradients of mean / rstd too, are channels first's and the float64 references'; fp32
    with a group far off zero whose spread is below eps (the exact-group rule after the fast pass:
    |mean| * rstd > 2^24)."""
    shape, G = (2, 48, 48, 112), 14  # groups of 8 channels x 2304 rows
    rng = np.random.RandomState(7)
    x = (rng.randn(*shape) * 2 + 0.5)
    if dtype == np.float32:
        x[..., 8:16] = 1e5 + rng.randn(*shape[:-1], 8) * 1e-3  # group 1: recomputed exactly
    x = x.astype(dtype)
    dy = rng.randn(*shape).astype(dtype)
    g, b = (rng.rand(shape[-1]) + .5).astype(dtype), rng.randn(shape[-1]).astype(dtype)
    dmean, drstd = (rng.randn(shape[0], G).astype(dtype) for _ in range(2))
    rl = _run_gn(x, g, b, G, -1, act, dy, dmean, drstd)
    rf = _run_gn(first(x), g, b, G, 1, act, first(dy), dmean, drstd)
    t = 1e-4 if dtype == np.float32 else 1e-10
    for k in ("y", "dx"):
        np.testing.assert_allclose(first(rl[k]), rf[k], rtol=t, atol=t * max(1, abs(rf[k]).max()))
    for k in ("mean", "rstd", "dgamma", "dbeta"):
        np.testing.assert_allclose(rl[k], rf[k], rtol=t, atol=t * max(1, abs(rf[k]).max()))
    ref = group_norm_ref(first(x).astype(np.float64), g.astype(np.float64), b.astype(np.float64),
                         G, 1e-5, act=act)
    rt, at = tol(dtype)
    np.testing.assert_allclose(first(rl["y"]), ref[0], rtol=rt, atol=at)
    np.testing.assert_allclose(rl["mean"], ref[1], rtol=rt, atol=at * 1e5)


@pytest.mark.parametrize("env", [{"GNMX_CPU_ISA": "generic"},
                                 {"MXNET_ENGINE_TYPE": "NaiveEngine", "OMP_NUM_THREADS": "2"}],
                         ids=["portable_loops", "two_threads"])
def test_kernel_paths(env):
    """The portable row loops (GNMX_CPU_ISA=generic) and a team of two threads (per-sample and
    shared-sample schedules: N = 1, 2, 3) give the channels-first results. Fresh processes: both
    choices are made once per process."""
    code = f"""
        import sys; sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import numpy as np, mxnet as mx, gn_mx
        from test_channels_last import _run_gn, first
        for shape, G in [((1, 64, 64, 32), 8), ((2, 40, 40, 16), 4), ((3, 30, 30, 24), 6),
                         ((3, 100, 96), 4)]:
            for dtype, act in ((np.float32, None), (np.float16, "silu"), (np.float64, "relu")):
                rng = np.random.RandomState(0)
                x = (rng.randn(*shape) + 3).astype(dtype)
                dy = rng.randn(*shape).astype(dtype)
                g, b = (rng.rand(shape[-1]) + .5).astype(dtype), rng.randn(shape[-1]).astype(dtype)
                rl = _run_gn(x, g, b, G, -1, act, dy)
                rf = _run_gn(first(x), g, b, G, 1, act, first(dy))
                t = 2e-2 if dtype == np.float16 else 1e-4
                for k in ("y", "dx"):
                    np.testing.assert_allclose(first(rl[k]).astype(float), rf[k].astype(float),
                                               rtol=t, atol=t)
                for k in ("mean", "rstd", "dgamma", "dbeta"):
                    np.testing.assert_allclose(rl[k].astype(float), rf[k].astype(float),
                                               rtol=t, atol=t * max(1, abs(rf[k]).max()))
        print("PATH_OK")
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env={**os.environ, **env}, timeout=600)
    assert p.returncode == 0 and "PATH_OK" in p.stdout, p.stdout + p.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# gn_mx.convert


def test_convert_instance_norm_last_axis():
    """InstanceNorm over the last axis becomes GroupNorm(num_groups=C, axis=-1): same output."""
    nn = gluon.nn
    x = mx.nd.array(np.random.RandomState(3).randn(2, 5, 5, 6))
    for axis, sample in ((-1, None), (3, x)):
        net = nn.HybridSequential()
        net.add(nn.Dense(6, flatten=False, in_units=6),
                nn.InstanceNorm(axis=axis, in_channels=6, gamma_initializer=mx.init.Uniform(1.0),
                                beta_initializer=mx.init.Uniform(1.0)))
        net.initialize()
        want = net(x).asnumpy()
        gn_mx.convert(net, sample=sample)
        assert isinstance(net[1], gn_mx.GroupNorm) and net[1]._axis == -1, net.gn_mx_report
        assert "axis=-1" in repr(net[1]) and "num_groups=6" in repr(net[1])
        np.testing.assert_allclose(net(x).asnumpy(), want, rtol=1e-4, atol=1e-5)


def test_convert_warns_about_layers_left_in_place():
    """A conversion that leaves a norm layer warns once, naming it and the reason:
    LayerNorm(axis=-1) on (N, T, C) normalizes each position alone (no GroupNorm);
    InstanceNorm(axis=3) without sample= has an unknown rank."""
    nn = gluon.nn
    net = nn.HybridSequential()
    net.add(nn.Dense(8, flatten=False, in_units=4), nn.LayerNorm(axis=-1, in_channels=8))
    net.initialize()
    x = mx.nd.ones((2, 7, 4))
    with pytest.warns(UserWarning, match=r"gn_mx.convert: 1 normalization layer\(s\) left in "
                                         r"place .*1: LayerNorm\(axis=-1\) on 3-D input"):
        gn_mx.convert(net, sample=x)
    assert isinstance(net[1], nn.LayerNorm)
    inst = nn.HybridSequential()
    inst.add(nn.InstanceNorm(axis=3, in_channels=6))
    inst.initialize()
    with pytest.warns(UserWarning, match=r"InstanceNorm\(axis=3\).*input rank is unknown"):
        gn_mx.convert(inst)
    import warnings
    ok = nn.HybridSequential()
    ok.add(nn.InstanceNorm(in_channels=4))
    ok.initialize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gn_mx.convert(ok)  # everything converted: no warning


# ---------------------------------------------------------------------------------------------
# ONNX


@pytest.mark.parametrize("act", [None, "silu"], ids=str)
@pytest.mark.parametrize("spatial", [0, 1, 2, 3])
def test_onnx_export_runs_in_onnxruntime(spatial, act, tmp_path):
    """gn_group_norm(axis=-1) exports as a composition on an (N, S, G, D) view (no Transpose,
    no GroupNormalization) that onnxruntime runs with MXNet's results, for other batch and spatial
    sizes too (dynamic shapes); gn_moments(axis=-1) and the statistics outputs likewise."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from gn_mx import onnx as gn_onnx
    C, G = 12, 3
    data = mx.sym.var("data")
    gamma, beta = mx.sym.var("gamma"), mx.sym.var("beta")
    kw = {"act_type": act} if act else {}
    gn = mx.sym.gn_group_norm(data, gamma, beta, num_groups=G, eps=1e-3, axis=-1, name="gn", **kw)
    mo = mx.sym.gn_moments(data, num_groups=2, axis=-1, name="mo")
    sym = mx.sym.Group([gn[0], gn[1], gn[2], mo[0], mo[1]])
    rng = np.random.RandomState(spatial)
    params = {"gamma": mx.nd.array(rng.rand(C) + 0.5), "beta": mx.nd.array(rng.randn(C))}
    sample = (2,) + (4, 5, 3)[:spatial] + (C,)
    path = gn_onnx.export_model(sym, params, in_shapes=[sample], in_types=[np.float32],
                                onnx_file_path=str(tmp_path / "nhwc.onnx"), dynamic=True,
                                dynamic_input_shapes=[(None,) + (None,) * spatial + (C,)])
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    ops = {n.op_type for n in model.graph.node}
    assert "Transpose" not in ops and "GroupNormalization" not in ops, ops
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for shape in (sample, (3,) + tuple(d + 1 for d in sample[1:-1]) + (C,)):
        x = (rng.randn(*shape) * 2 + 10).astype(np.float32)
        ex = sym.bind(mx.cpu(), {"data": mx.nd.array(x), **params})
        want = [o.asnumpy() for o in ex.forward()]
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"data": x})))
        for key, w in zip(["gn0", "gn1", "gn2", "mo0", "mo1"], want):
            assert got[key].shape == w.shape, key
            np.testing.assert_allclose(got[key], w, rtol=1e-4, atol=1e-4 * max(1, np.abs(w).max()),
                                       err_msg=key)


# ---------------------------------------------------------------------------------------------
# The C predict API (tests/test_deploy.py's predictor: examples/deploy_c/predict.c)

from test_deploy import predictor, run_predictor  # noqa: E402,F401  (fixture and helper)


def test_c_predictor_channels_last(predictor, tmp_path):  # noqa: F811
    """A channels-last net (GroupNorm(axis=-1) with a fused silu) exported by Gluon runs through
    MXNet's C predict API with the library loaded, with Python's outputs."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, flatten=False, in_units=3),
            gn_mx.GroupNorm(4, axis=-1, activation="silu", in_channels=8,
                            gamma_initializer=mx.init.Uniform(1.0),
                            beta_initializer=mx.init.Uniform(1.0)),
            gluon.nn.Dense(2, flatten=False, in_units=8))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    x = np.random.RandomState(5).randn(2, 6, 6, 3).astype(np.float32)
    want = net(mx.nd.array(x)).asnumpy()
    prefix = str(tmp_path / "nhwc")
    net.export(prefix)
    assert '"axis": "-1"' in open(prefix + "-symbol.json").read()
    model = {"symbol": prefix + "-symbol.json", "params": prefix + "-0000.params"}
    got = run_predictor(predictor, model, x, tmp_path)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
