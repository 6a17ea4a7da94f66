"""Decorrelated BN: gn_dbn / gn_dbn_inference ops and gn_mx.DecorrelatedBatchNorm.

References are float64 numpy (tests/reference.py, written from the paper's math) evaluated on the
already-rounded inputs. The ops are CPU-only, so everything runs on mx.cpu().
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import GRAD_TOL, ROOT, run_python, tol
from reference import (dbn_bwd_ref, dbn_inference_ref, dbn_ref, numeric_grad,
                       _dbn_group_matrix)

CPU = mx.cpu()
EPS = 1e-5
MOM = 0.9
DTYPES = [np.float16, np.float32, np.float64]
SHAPES = {0: (64, 8), 1: (6, 8, 11), 2: (4, 8, 5, 3), 3: (2, 8, 3, 3, 3)}


def _data(shape, dtype, offset=0.5):
    """Correlated, well-conditioned data: channel c mixes channel c-1."""
    x = np.random.randn(*shape)
    x[:, 1:] += 0.6 * x[:, :-1]
    return (x + offset).astype(dtype)


def _stats(C, G, dtype):
    D = C // G
    return (mx.nd.zeros((C,), dtype=dtype),
            mx.nd.array(np.tile(np.eye(D), (G, 1, 1)), dtype=dtype))


def _acc(dtype):
    return np.float64 if dtype == np.float64 else np.float32


# ---------------------------------------------------------------------------------------------
# Op forward / backward vs the float64 reference

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
@pytest.mark.parametrize("G", [1, 2, 8])
def test_forward_backward_vs_reference(dtype, rank, G):
    shape = SHAPES[rank]
    C = shape[1]
    x = _data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    rm, rp = _stats(C, G, dtype)
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    with autograd.record():
        outs = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=EPS, momentum=MOM)
    outs[0].backward(mx.nd.array(dy, dtype=dtype))
    y, mean, eigvec, eigval = [o.asnumpy() for o in outs]
    assert y.dtype == dtype and mean.dtype == _acc(dtype) and eigvec.dtype == _acc(dtype)

    ref, rmean, W = dbn_ref(x, G, EPS)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=atol)
    np.testing.assert_allclose(mean, rmean, rtol=rtol, atol=atol)
    # Saved eigendecomposition reproduces Sigma^{-1/2}.
    W_saved = np.einsum("gij,gj,gkj->gik", eigvec.astype(np.float64),
                        eigval.astype(np.float64) ** -0.5, eigvec.astype(np.float64))
    np.testing.assert_allclose(W_saved, W, rtol=10 * rtol, atol=10 * atol)
    # Running statistics updated in place.
    D = C // G
    np.testing.assert_allclose(rm.asnumpy(), (1 - MOM) * rmean, rtol=rtol, atol=atol)
    np.testing.assert_allclose(rp.asnumpy(), MOM * np.eye(D) + (1 - MOM) * W,
                               rtol=rtol, atol=atol)

    rdx = dbn_bwd_ref(x, dy, G, EPS)
    grtol, gatol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(xs.grad.asnumpy(), rdx, rtol=grtol, atol=gatol)


def test_fp16_data_with_fp32_running_stats():
    x = _data((8, 4, 6), np.float16)
    rm, rp = _stats(4, 2, np.float32)
    y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float16), rm, rp, num_groups=2)[0]
    assert y.dtype == np.float16 and rp.dtype == np.float32
    ref, rmean, W = dbn_ref(x, 2, EPS)
    np.testing.assert_allclose(y.asnumpy(), ref, *tol(np.float16))
    np.testing.assert_allclose(rp.asnumpy(), MOM * np.eye(2) + (1 - MOM) * W, rtol=1e-4, atol=1e-5)
    yi = gn_mx.ops.dbn_inference(mx.nd.array(x, dtype=np.float16), rm, rp, num_groups=2)
    np.testing.assert_allclose(yi.asnumpy(), dbn_inference_ref(x, rm.asnumpy(), rp.asnumpy(), 2),
                               *tol(np.float16))


@pytest.mark.parametrize("G", [1, 3])
def test_whitening_property(G):
    """Training output of every group: zero mean, identity covariance (up to eps)."""
    x = _data((16, 12, 4, 4), np.float64, offset=-2.3) * 3.0
    rm, rp = _stats(12, G, np.float64)
    y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float64), rm, rp, num_groups=G, eps=1e-9)[0]
    y = y.asnumpy()
    for g in range(G):
        Y = _dbn_group_matrix(y, G, g)
        np.testing.assert_allclose(Y.mean(axis=1), 0, atol=1e-10)
        np.testing.assert_allclose(Y @ Y.T / Y.shape[1], np.eye(Y.shape[0]), atol=1e-7)


def test_large_offset_fp32():
    """Centring before the covariance keeps fp32 accurate for |mean| >> std."""
    x = (_data((16, 8, 8), np.float64) + 1000.0).astype(np.float32)
    rm, rp = _stats(8, 2, np.float32)
    y = mx.nd.gn_dbn(mx.nd.array(x), rm, rp, num_groups=2)[0].asnumpy()
    np.testing.assert_allclose(y, dbn_ref(x, 2, EPS)[0], rtol=1e-3, atol=2e-3)


def test_groups_equal_channels_is_batchnorm():
    """D = 1: per-channel standardization over (N, spatial) with the population variance."""
    x = _data((5, 6, 7), np.float64)
    rm, rp = _stats(6, 6, np.float64)
    y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float64), rm, rp, num_groups=6)[0].asnumpy()
    mu = x.mean(axis=(0, 2), keepdims=True)
    var = x.var(axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + EPS), rtol=1e-12, atol=1e-12)


def _op_fd_check(x, G, eps=EPS, rtol=1e-5, atol=1e-6):
    """Op gradient (float64) vs central differences of the op's own forward."""
    dy = np.random.randn(*x.shape)
    rm, rp = _stats(x.shape[1], G, np.float64)

    def f(z):
        return float((mx.nd.gn_dbn(mx.nd.array(z, dtype=np.float64), rm, rp, num_groups=G,
                                   eps=eps)[0].asnumpy() * dy).sum())

    xs = mx.nd.array(x, dtype=np.float64)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=eps)[0]
    y.backward(mx.nd.array(dy, dtype=np.float64))
    np.testing.assert_allclose(xs.grad.asnumpy(), numeric_grad(f, x), rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape,G", [((3, 6, 4), 2), ((10, 3), 1), ((2, 4, 2, 2), 4)])
def test_gradient_finite_differences(shape, G):
    _op_fd_check(_data(shape, np.float64), G)


def test_gradient_equal_eigenvalues():
    """Sigma = I + eps exactly (orthogonal centred rows of equal norm): the divided-difference
    backward needs no guard; the 1/(l_i - l_j) form would be 0/0 here."""
    x = np.array([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]]) + 3.0
    _op_fd_check(x, 1)


def test_reference_backward_vs_finite_differences():
    x = _data((4, 6, 3), np.float64)
    dy = np.random.randn(*x.shape)
    num = numeric_grad(lambda z: float((dbn_ref(z, 3, EPS)[0] * dy).sum()), x)
    np.testing.assert_allclose(dbn_bwd_ref(x, dy, 3, EPS), num, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_inference_op_and_backward(dtype):
    G, shape = 2, (3, 6, 5)
    x = _data(shape, dtype)
    rm = mx.nd.array(np.random.randn(6), dtype=dtype)
    P = np.random.randn(G, 3, 3)
    rp = mx.nd.array(P, dtype=dtype)
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    dy = np.random.randn(*shape).astype(dtype)
    with autograd.record():
        y = mx.nd.gn_dbn_inference(xs, rm, rp, num_groups=G)
    y.backward(mx.nd.array(dy, dtype=dtype))
    ref = dbn_inference_ref(x, rm.asnumpy(), rp.asnumpy(), G)
    np.testing.assert_allclose(y.asnumpy(), ref, *tol(dtype))
    Pr = rp.asnumpy().astype(np.float64)
    rdx = dbn_inference_ref(dy, np.zeros(6), np.transpose(Pr, (0, 2, 1)), G)
    np.testing.assert_allclose(xs.grad.asnumpy(), rdx, *tol(dtype, GRAD_TOL))


@pytest.mark.parametrize("env", [{"GNMX_CPU_ISA": "generic"},
                                 {"MXNET_ENGINE_TYPE": "NaiveEngine", "OMP_NUM_THREADS": "2"}],
                         ids=["blas_path", "two_threads"])
def test_kernel_paths_match_reference(env):
    """float32 panels use AVX2 kernels when the CPU has them; GNMX_CPU_ISA=generic forces the
    BLAS path (as on other CPUs). MXNet's threaded engine gives library ops one OpenMP thread;
    NaiveEngine runs them on the caller, so OMP_NUM_THREADS=2 covers the per-thread statistics
    merge. Shapes include several column chunks per group. Fresh processes: both choices are
    made once per process."""
    code = f"""
        import sys; sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import numpy as np, mxnet as mx, gn_mx
        from mxnet import autograd
        from reference import dbn_ref, dbn_bwd_ref
        for shape, G, off in [((6, 8, 11), 2, 0.5), ((40, 64, 3), 1, 0.0), ((4, 12, 5, 5), 12, 0.0),
                              ((20, 6, 40, 40), 3, 50.0), ((5, 32, 30, 30), 2, -3.0)]:
            for dtype in (np.float32, np.float64):
                x = (np.random.randn(*shape) + off).astype(dtype)
                dy = np.random.randn(*shape).astype(dtype)
                C = shape[1]; D = C // G
                rm = mx.nd.zeros((C,), dtype=dtype)
                rp = mx.nd.array(np.tile(np.eye(D), (G, 1, 1)), dtype=dtype)
                xs = mx.nd.array(x, dtype=dtype); xs.attach_grad()
                with autograd.record():
                    y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G)[0]
                y.backward(mx.nd.array(dy, dtype=dtype))
                tol = 1e-4 if dtype == np.float32 else 1e-9
                np.testing.assert_allclose(y.asnumpy(), dbn_ref(x, G, 1e-5)[0], rtol=tol,
                                           atol=tol * (1 + abs(off)))
                np.testing.assert_allclose(xs.grad.asnumpy(), dbn_bwd_ref(x, dy, G, 1e-5),
                                           rtol=10 * tol, atol=tol * (1 + abs(off)))
        print("PATH_OK")
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env=dict(os.environ, **env))
    assert p.returncode == 0 and "PATH_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Robustness

@pytest.mark.parametrize("shape,G", [((2, 8, 2), 1), ((3, 16), 2), ((1, 4), 1)])
def test_near_singular_covariance_is_finite(shape, G):
    """N * spatial <= group size: Sigma is (nearly) eps*I along the missing directions."""
    for dtype in (np.float32, np.float64):
        x = _data(shape, dtype)
        rm, rp = _stats(shape[1], G, dtype)
        xs = mx.nd.array(x, dtype=dtype)
        xs.attach_grad()
        with autograd.record():
            y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G)[0]
        y.backward(mx.nd.ones_like(y))
        assert np.isfinite(y.asnumpy()).all() and np.isfinite(xs.grad.asnumpy()).all()
        assert np.isfinite(rp.asnumpy()).all()
    # A constant batch gives zeros.
    rm, rp = _stats(4, 2, np.float32)
    y = mx.nd.gn_dbn(mx.nd.ones((3, 4, 2)) * 7, rm, rp, num_groups=2)[0].asnumpy()
    np.testing.assert_allclose(y, 0, atol=1e-6)


def test_nan_input_does_not_crash():
    x = _data((4, 6, 3), np.float32)
    x[1, 2, 1] = np.nan
    rm, rp = _stats(6, 2, np.float32)
    xs = mx.nd.array(x)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn(xs, rm, rp, num_groups=2)[0]
    y.backward(mx.nd.ones_like(y))
    y = y.asnumpy()
    assert np.isnan(y[:, :3]).all()  # the poisoned group
    assert np.isfinite(y[:, 3:]).all()  # the other group is untouched
    mx.nd.waitall()


# ---------------------------------------------------------------------------------------------
# Gluon block

def _net(G=2, momentum=MOM):
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3, padding=1, in_channels=4))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=G, momentum=momentum,
                                            gamma_initializer=mx.init.Uniform(1.0),
                                            beta_initializer=mx.init.Uniform(1.0)))
        net.add(gluon.nn.Activation("relu"))
    return net


def _twin_nets(tmp_path, **kw):
    """Two nets with identical parameters (the second one loads the first one's file)."""
    a = _net(**kw)
    a.initialize(mx.init.Xavier(), ctx=CPU)
    x = mx.nd.array(_data((4, 4, 6, 6), np.float32))
    a(x)
    f = str(tmp_path / "twin.params")
    a.save_parameters(f)
    b = _net(**kw)
    b.load_parameters(f, ctx=CPU)
    return a, b, x


def _dbn_layer(net):
    return [b for b in net._children.values() if isinstance(b, gn_mx.DecorrelatedBatchNorm)][0]


def _stats_of(net):
    blk = _dbn_layer(net)
    return blk.running_mean.data().asnumpy(), blk.running_projection.data().asnumpy()


def test_block_parameters_and_deferred_init():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=3)
    blk.initialize(ctx=CPU)
    y = blk(mx.nd.array(_data((4, 12, 5), np.float32)))
    assert y.shape == (4, 12, 5)
    assert blk.gamma.shape == (12,) and blk.beta.shape == (12,)
    assert blk.running_mean.shape == (12,) and blk.running_projection.shape == (3, 4, 4)
    assert blk.running_mean.grad_req == "null" and blk.running_projection.grad_req == "null"
    # Outside autograd.record() the block infers: the running stats are untouched.
    np.testing.assert_array_equal(blk.running_projection.data().asnumpy(),
                                  np.tile(np.eye(4), (3, 1, 1)))
    np.testing.assert_array_equal(blk.running_mean.data().asnumpy(), 0)


def test_block_train_matches_reference():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, gamma_initializer=mx.init.Uniform(1.0),
                                      beta_initializer=mx.init.Uniform(1.0))
    blk.initialize(ctx=CPU)
    x = _data((6, 4, 3, 3), np.float32)
    xs = mx.nd.array(x)
    xs.attach_grad()
    blk(xs)  # deferred init
    dy = np.random.randn(*x.shape).astype(np.float32)
    with autograd.record():
        y = blk(xs)
    y.backward(mx.nd.array(dy))
    g = blk.gamma.data().asnumpy().reshape(1, 4, 1, 1)
    b = blk.beta.data().asnumpy().reshape(1, 4, 1, 1)
    xhat = dbn_ref(x, 2, EPS)[0]
    np.testing.assert_allclose(y.asnumpy(), xhat * g + b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(xs.grad.asnumpy(), dbn_bwd_ref(x, dy * g, 2, EPS),
                               rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(blk.gamma.grad().asnumpy(), (dy * xhat).sum(axis=(0, 2, 3)),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(blk.beta.grad().asnumpy(), dy.sum(axis=(0, 2, 3)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hybridize", [False, True])
def test_running_stats_converge(hybridize):
    """Training steps on one fixed batch: inference output approaches training output."""
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2, momentum=0.8)
    blk.initialize(ctx=CPU)
    if hybridize:
        blk.hybridize()
    x = mx.nd.array(_data((16, 6, 4, 4), np.float32, offset=3.0))
    y_eval0 = blk(x).asnumpy()
    for _ in range(60):
        with autograd.record():
            y_train = blk(x)
    y_eval = blk(x).asnumpy()
    y_train = y_train.asnumpy()
    assert np.abs(y_eval0 - y_train).max() > 1.0
    np.testing.assert_allclose(y_eval, y_train, rtol=1e-3, atol=1e-3)
    _, rmean, W = dbn_ref(x.asnumpy(), 2, EPS)
    np.testing.assert_allclose(blk.running_mean.data().asnumpy(), rmean, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(blk.running_projection.data().asnumpy(), W, rtol=1e-3, atol=1e-3)


def _train_step(net, x):
    x = x.copy()
    x.attach_grad()
    with autograd.record():
        y = net(x)
        loss = (y * y).sum()
    loss.backward()
    grads = {k.split("_", 1)[1]: p.grad().asnumpy() for k, p in net.collect_params().items()
             if p.grad_req != "null"}
    return y.asnumpy(), x.grad.asnumpy(), grads


@pytest.mark.parametrize("hybrid_kw", [{}, {"static_alloc": True, "static_shape": True}],
                         ids=["plain", "static"])
def test_hybridized_equals_imperative_and_mode_switching(tmp_path, hybrid_kw):
    """A hybridized parent switching train -> eval -> train -> eval matches the imperative net
    call by call: outputs, gradients and running statistics."""
    imp, hyb, x = _twin_nets(tmp_path)
    hyb.hybridize(**hybrid_kw)
    for step in range(2):
        yi, dxi, gi = _train_step(imp, x)
        yh, dxh, gh = _train_step(hyb, x)
        np.testing.assert_allclose(yh, yi, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dxh, dxi, rtol=1e-4, atol=1e-5)
        for k in gi:
            np.testing.assert_allclose(gh[k], gi[k], rtol=1e-4, atol=1e-4)
        for a, b in zip(_stats_of(hyb), _stats_of(imp)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        stats_before = _stats_of(hyb)
        ye_i = imp(x).asnumpy()
        ye_h = hyb(x).asnumpy()
        np.testing.assert_allclose(ye_h, ye_i, rtol=1e-5, atol=1e-5)
        assert np.abs(ye_h - yh).max() > 1e-3  # eval really used the running statistics
        for a, b in zip(_stats_of(hyb), stats_before):  # and did not update them
            np.testing.assert_array_equal(a, b)
        with autograd.train_mode():  # train mode without recording: batch statistics
            np.testing.assert_allclose(hyb(x).asnumpy(), imp(x).asnumpy(), rtol=1e-5, atol=1e-5)
        with autograd.record(train_mode=False):  # recording in predict mode: running stats
            np.testing.assert_allclose(hyb(x).asnumpy(), imp(x).asnumpy(), rtol=1e-5, atol=1e-5)


def test_hybridized_block_alone_first_call_in_eval():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    blk.hybridize()
    x = mx.nd.array(_data((8, 4, 5), np.float32, offset=2.0))
    y0 = blk(x).asnumpy()  # eval first: identity projection, zero mean
    np.testing.assert_allclose(y0, x.asnumpy(), rtol=1e-6, atol=1e-6)
    with autograd.record():
        y1 = blk(x).asnumpy()
    np.testing.assert_allclose(y1, dbn_ref(x.asnumpy(), 2, EPS)[0], rtol=1e-4, atol=1e-4)
    y2 = blk(x).asnumpy()
    np.testing.assert_allclose(y2, dbn_inference_ref(x.asnumpy(), *_stats_of_block(blk), 2),
                               rtol=1e-4, atol=1e-4)


def _stats_of_block(blk):
    return blk.running_mean.data().asnumpy(), blk.running_projection.data().asnumpy()


def test_grad_through_eval_mode_hybridized():
    """gn_dbn_inference has a backward, so a predict-mode recorded graph is differentiable."""
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=1)
    blk.initialize(ctx=CPU)
    blk.hybridize()
    x = mx.nd.array(_data((4, 3, 2), np.float32))
    x.attach_grad()
    with autograd.record(train_mode=False):
        y = blk(x)
    y.backward()
    np.testing.assert_allclose(x.grad.asnumpy(), 1.0, rtol=1e-6)  # P = I, gamma = 1


def test_export_writes_inference_graph_and_reloads(tmp_path):
    net = _net()
    net.initialize(mx.init.Xavier(), ctx=CPU)
    net.hybridize()
    x = mx.nd.array(_data((4, 4, 6, 6), np.float32))
    for _ in range(3):
        _train_step(net, x)  # the last call before export is a training call
    expected = net(x).asnumpy()
    _train_step(net, x)
    expected_after = net(x).asnumpy()
    assert np.abs(expected - expected_after).max() > 0
    prefix = str(tmp_path / "dbn_net")
    # Export straight after a training call: the block must still write the inference graph.
    _train_step(net, x)
    stats = _stats_of(net)
    net.export(prefix)
    expected = net(x).asnumpy()
    graph = json.load(open(prefix + "-symbol.json"))
    ops = [n["op"] for n in graph["nodes"]]
    assert "gn_dbn_inference" in ops and "gn_dbn" not in ops
    sym = mx.sym.load(prefix + "-symbol.json")
    aux = sym.list_auxiliary_states()
    assert any(a.endswith("running_mean") for a in aux)
    assert any(a.endswith("running_projection") for a in aux)
    for a, b in zip(_stats_of(net), stats):  # exporting touched no statistics
        np.testing.assert_array_equal(a, b)
    np.save(str(tmp_path / "x.npy"), x.asnumpy())
    np.save(str(tmp_path / "y.npy"), expected)
    p = run_python(f"""
        import numpy as np, mxnet as mx
        import gn_mx
        from mxnet import gluon, autograd
        net = gluon.SymbolBlock.imports({prefix!r} + "-symbol.json", ["data"],
                                        {prefix!r} + "-0000.params")
        x = mx.nd.array(np.load({str(tmp_path / "x.npy")!r}))
        y = net(x).asnumpy()
        np.testing.assert_allclose(y, np.load({str(tmp_path / "y.npy")!r}), rtol=1e-5, atol=1e-5)
        print("RELOAD_OK")
    """)
    assert p.returncode == 0 and "RELOAD_OK" in p.stdout, p.stdout + p.stderr


def test_export_static_alloc_after_training_steps(tmp_path):
    """static_alloc: the last training step's running-statistics update must be in the file."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3), gn_mx.DecorrelatedBatchNorm(num_groups=2),
                gluon.nn.Dense(3))
    net.initialize(ctx=CPU)
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.random.normal(shape=(4, 3, 8, 8))
    net(x)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    for _ in range(3):
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(4)
    expected = net(x)  # no sync before export: the update may still be pending
    prefix = str(tmp_path / "static")
    net.export(prefix)
    reloaded = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    np.testing.assert_allclose(reloaded(x).asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-5)


def test_static_alloc_running_stats_visible_and_saved(tmp_path):
    """static_alloc CachedOps push library ops with their inputs as read-only dependencies, so
    gn_dbn's in-place update would be invisible to later readers; the block orders them after
    it. Each read and save_parameters right after a training call sees the update."""
    imp, hyb, x = _twin_nets(tmp_path)
    hyb.hybridize(static_alloc=True, static_shape=True)
    for _ in range(2):
        for net in (imp, hyb):
            with autograd.record():
                loss = net(x).sum()
        np.testing.assert_allclose(_stats_of(hyb)[0], _stats_of(imp)[0], rtol=1e-6, atol=1e-6)
    f = str(tmp_path / "after_train.params")
    hyb.save_parameters(f)
    saved = {k: v for k, v in mx.nd.load(f).items() if "running_projection" in k}
    np.testing.assert_allclose(list(saved.values())[0].asnumpy(), _stats_of(imp)[1],
                               rtol=1e-6, atol=1e-6)


def test_export_after_eval_then_training_continues(tmp_path):
    net = _net()
    net.initialize(mx.init.Xavier(), ctx=CPU)
    net.hybridize()
    x = mx.nd.array(_data((4, 4, 6, 6), np.float32))
    net(x)
    net.export(str(tmp_path / "m"))
    y1, _, _ = _train_step(net, x)  # training still uses batch statistics after export
    blk = _dbn_layer(net)
    assert np.abs(blk.running_mean.data().asnumpy()).max() > 0


def test_export_when_only_training_ran(tmp_path):
    """No inference call before export: the inference graph is traced for the export."""
    net = _net()
    net.initialize(mx.init.Xavier(), ctx=CPU)
    net.hybridize()
    x = mx.nd.array(_data((4, 4, 6, 6), np.float32))
    for _ in range(2):
        _train_step(net, x)
    prefix = str(tmp_path / "train_only")
    net.export(prefix)
    ops = [n["op"] for n in json.load(open(prefix + "-symbol.json"))["nodes"]]
    assert "gn_dbn_inference" in ops and "gn_dbn" not in ops
    expected = net(x).asnumpy()
    reloaded = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    np.testing.assert_allclose(reloaded(x).asnumpy(), expected, rtol=1e-5, atol=1e-5)
    y_train, _, _ = _train_step(net, x)  # and training continues with batch statistics
    imp = _net()
    imp.initialize(ctx=CPU)
    f = str(tmp_path / "p.params")
    net.save_parameters(f)
    imp.load_parameters(f, ctx=CPU)
    with autograd.train_mode():
        np.testing.assert_allclose(net(x).asnumpy(), imp(x).asnumpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hybridize", [False, True])
def test_block_float16(hybridize):
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    x = _data((8, 4, 5), np.float16)
    blk(mx.nd.array(x, dtype=np.float32))
    blk.cast("float16")
    if hybridize:
        blk.hybridize()
    xs = mx.nd.array(x, dtype=np.float16)
    with autograd.record():
        y = blk(xs)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.asnumpy(), dbn_ref(x, 2, EPS)[0], *tol(np.float16))
    assert blk.running_projection.data().dtype == np.float16
    y_eval = blk(xs)
    ref = dbn_inference_ref(x, *_stats_of_block(blk), 2)
    np.testing.assert_allclose(y_eval.asnumpy(), ref, *tol(np.float16))


class _ToFloat16(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return F.cast(x, dtype="float16")


def test_multi_precision_float32_params_float16_data(tmp_path):
    """float32 gamma/beta/running stats with float16 data produced inside a hybridized net
    (multi-precision): hybridized == imperative, and the exported graph has no amp_multicast."""
    def make():
        net = gluon.nn.HybridSequential()
        with net.name_scope():
            net.add(gluon.nn.Conv2D(4, 3, padding=1, in_channels=4), _ToFloat16(),
                    gn_mx.DecorrelatedBatchNorm(num_groups=2))
        return net
    imp = make()
    imp.initialize(mx.init.Xavier(), ctx=CPU)
    x = mx.nd.array(_data((4, 4, 5, 5), np.float32))
    imp(x)
    f = str(tmp_path / "mp.params")
    imp.save_parameters(f)
    hyb = make()
    hyb.load_parameters(f, ctx=CPU)
    hyb.hybridize()
    yi, dxi, gi = _train_step(imp, x)
    yh, dxh, gh = _train_step(hyb, x)
    assert yh.dtype == np.float16 and _dbn_layer(hyb).gamma.data().dtype == np.float32
    np.testing.assert_allclose(yh, yi, rtol=1e-3, atol=1e-3)
    for k in gi:
        np.testing.assert_allclose(gh[k], gi[k], rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(hyb(x).asnumpy(), imp(x).asnumpy(), rtol=1e-3, atol=1e-3)
    hyb.export(str(tmp_path / "mp"))
    ops = [n["op"] for n in json.load(open(str(tmp_path / "mp-symbol.json")))["nodes"]]
    assert "amp_multicast" not in ops and "gn_dbn_inference" in ops


def test_grad_req_add_accumulates_block_params():
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    x = mx.nd.array(_data((6, 4, 5), np.float32))
    blk(x)
    grads = []
    for req in ("write", "add"):
        for p in (blk.gamma, blk.beta):
            p.grad_req = req
            p.zero_grad()
        for _ in range(2):
            with autograd.record():
                loss = (blk(x) ** 2).sum()
            loss.backward()
        grads.append(blk.gamma.grad().asnumpy().copy())
    np.testing.assert_allclose(grads[1], 2 * grads[0], rtol=1e-4, atol=1e-4)


def test_example_dbn_cnn_runs(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "dbn_cnn.py"),
                        "--steps", "8", "--out", str(tmp_path / "dbn_cnn")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout[-2000:] + p.stderr[-2000:]


def test_block_constructor_errors():
    with pytest.raises(ValueError, match="num_groups"):
        gn_mx.DecorrelatedBatchNorm(num_groups=0)
    with pytest.raises(ValueError, match="epsilon"):
        gn_mx.DecorrelatedBatchNorm(epsilon=0.0)
    with pytest.raises(ValueError, match="momentum"):
        gn_mx.DecorrelatedBatchNorm(momentum=1.5)
    with pytest.raises(ValueError, match="divisible"):
        gn_mx.DecorrelatedBatchNorm(num_groups=4, in_channels=6)


# ---------------------------------------------------------------------------------------------
# Bad input: MXNetError with a clear message, and the process survives. The cases run one after
# another in one fresh interpreter (a crash shows up as a bad exit code and the missing cases);
# a process per case would spend ~3 s of MXNet import each.

PRELUDE = """
import mxnet as mx, gn_mx
x = mx.nd.ones((2, 6, 4))
rm, rp = mx.nd.zeros((6,)), mx.nd.zeros((2, 3, 3))
"""

BAD = {
    "channels_not_divisible": ("mx.nd.gn_dbn(x, mx.nd.zeros((6,)), mx.nd.zeros((4, 1, 1)), "
                               "num_groups=4)",
                               "gn_dbn: channels (C=6) must be divisible by num_groups (4)"),
    "num_groups_zero": ("mx.nd.gn_dbn(x, rm, rp, num_groups=0)",
                        "gn_dbn: num_groups must be positive; got 0"),
    "group_size_zero": ("mx.nd.gn_dbn_inference(x, rm, rp, num_groups=12)",
                        "gn_dbn_inference: channels (C=6) must be divisible by num_groups (12)"),
    "wrong_projection_shape": ("mx.nd.gn_dbn(x, rm, mx.nd.zeros((2, 3, 2)), num_groups=2)",
                               "running_projection must have shape (2, 3, 3) for data shape "
                               "(2, 6, 4) and num_groups=2; got (2, 3, 2)"),
    "wrong_mean_shape": ("mx.nd.gn_dbn_inference(x, mx.nd.zeros((3,)), rp, num_groups=2)",
                         "running_mean must have shape (6,)"),
    "integer_data": ("mx.nd.gn_dbn(x.astype('int32'), rm, rp, num_groups=2)",
                     "gn_dbn: data must be float16, float32 or float64; got int32"),
    "stats_dtype_mismatch": ("mx.nd.gn_dbn(x, rm.astype('float64'), rp.astype('float64'), "
                             "num_groups=2)",
                             "running_mean dtype must equal the data dtype"),
    "one_dim_data": ("mx.nd.gn_dbn(mx.nd.ones((6,)), rm, rp, num_groups=2)",
                     "data must have at least 2 dims (N, C, *spatial); got shape (6,)"),
    "eps_zero": ("mx.nd.gn_dbn(x, rm, rp, num_groups=2, eps=0)", "eps must be a finite number > 0"),
    "momentum_out_of_range": ("mx.nd.gn_dbn(x, rm, rp, num_groups=2, momentum=1.5)",
                              "momentum must be in [0, 1]; got 1.5"),
    "unknown_attribute": ("mx.nd.gn_dbn_inference(x, rm, rp, num_groups=2, eps=1e-3)",
                          "gn_dbn_inference: unknown attribute 'eps'"),
    "symbolic_bad_groups": ("mx.sym.gn_dbn(mx.sym.var('d'), mx.sym.var('m'), mx.sym.var('p'), "
                            "num_groups=4).infer_shape(d=(2, 6, 4))",
                            "channels (C=6) must be divisible by num_groups (4)"),
    # Gluon wraps deferred-init shape errors in ValueError; the op's message is inside.
    "block_bad_groups_in_graph": ("n = gn_mx.DecorrelatedBatchNorm(num_groups=4); n.initialize();"
                                  " n.hybridize(); n(x)",
                                  "channels (C=6) must be divisible by num_groups (4)"),
}


def test_bad_inputs_raise_and_process_survives():
    code = PRELUDE
    for name, (stmt, _) in BAD.items():
        code += textwrap.dedent(f"""
            try:
                {stmt}
                mx.nd.waitall()
                print("CASE {name} NO_ERROR")
            except (mx.base.MXNetError, ValueError) as e:
                print("CASE {name}", type(e).__name__, str(e).replace("\\n", " "))
        """)
    code += "\nprint('ALIVE', float(mx.nd.ones((2,)).sum().asscalar()))\n"
    p = run_python(code)
    assert p.returncode == 0 and "ALIVE 2.0" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    lines = {ln.split()[1]: ln for ln in p.stdout.splitlines() if ln.startswith("CASE ")}
    failures = [f"{name}: want {want!r}; got {lines.get(name)!r}"[:600]
                for name, (_, want) in BAD.items()
                if name not in lines or "NO_ERROR" in lines[name] or want not in lines[name]]
    assert not failures, "\n".join(failures)
