"""IterNorm whitening (gn_dbn whitening='iternorm', Huang et al., CVPR 2019).

The reference is the paper's algorithm in float64 numpy: Sigma_N = Sigma / tr(Sigma), P_0 = I,
P_{k+1} = 1.5 P_k - 0.5 P_k^3 Sigma_N, W = P_T / sqrt(tr(Sigma)), y = W (x - mu). Gradients are
checked against central differences of that reference (independent of the op's written-out
backward) and of the op itself.
"""
import json

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import gn_mx  # noqa: F401
from conftest import GRAD_TOL, dbn_data, reload_outputs, tol
from reference import _dbn_group_matrix, dbn_ref, iternorm_ref, numeric_grad
from tolerances import FD_TOL

EPS = 1e-3
SHAPES = {0: (40, 8), 1: (6, 8, 7), 2: (3, 8, 4, 3), 3: (2, 8, 3, 2, 3)}


def _stats(C, G, dtype):
    return (mx.nd.zeros((C,), dtype=dtype),
            mx.nd.array(np.tile(np.eye(C // G), (G, 1, 1)), dtype=dtype))


def _run(x, dy, G, T, dtype, affine=None):
    """gn_dbn with IterNorm and its backward: (y, dx, running projection[, dgamma, dbeta])."""
    C = x.shape[1]
    rm, rp = _stats(C, G, np.float32 if dtype == np.float16 else dtype)
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    kw = dict(num_groups=G, eps=EPS, whitening="iternorm", iterations=T)
    if affine is not None:
        g, b = (mx.nd.array(v, dtype=dtype) for v in affine)
        g.attach_grad()
        b.attach_grad()
    with autograd.record():
        if affine is None:
            y = mx.nd.gn_dbn(xs, rm, rp, **kw)[0]
        else:
            y = mx.nd.gn_dbn(xs, g, b, rm, rp, affine=True, **kw)[0]
    y.backward(mx.nd.array(dy, dtype=dtype))
    res = [y.asnumpy(), xs.grad.asnumpy(), rp.asnumpy()]
    if affine is not None:
        res += [g.grad.asnumpy(), b.grad.asnumpy()]
    return res


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
@pytest.mark.parametrize("G,T", [(1, 5), (2, 1), (2, 10)])
def test_forward_vs_paper_reference(dtype, rank, G, T):
    shape = SHAPES[rank]
    x = dbn_data(shape, dtype)
    y, dx, rp = _run(x, np.random.randn(*shape).astype(dtype), G, T, dtype)
    ref, W = iternorm_ref(x.astype(np.float64), G, EPS, T)
    rtol, atol = tol(dtype)
    if dtype == np.float64:  # the iteration amplifies rounding (dbn.h): ~5e-11 at T = 10
        rtol, atol = 1e-8, 1e-9
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=atol * 10)
    # running_projection averages the IterNorm W (not Sigma^{-1/2})
    np.testing.assert_allclose(rp, 0.9 * np.eye(shape[1] // G) + 0.1 * W, rtol=rtol, atol=atol)
    assert np.isfinite(dx).all()


@pytest.mark.parametrize("rank,G,T", [(0, 2, 5), (2, 1, 3), (1, 2, 1)])
def test_backward_finite_differences(rank, G, T):
    """dx of the written-out backward against central differences of the numpy reference (the
    paper's forward), and dx / dgamma / dbeta against differences of the op (fused affine)."""
    shape = {0: (12, 4), 1: (3, 4, 4), 2: (2, 4, 3, 2)}[rank]
    x = dbn_data(shape, np.float64)
    dy = np.random.randn(*shape)
    y, dx, _ = _run(x, dy, G, T, np.float64)
    ref_fd = numeric_grad(lambda z: float((iternorm_ref(z, G, EPS, T)[0] * dy).sum()), x)
    np.testing.assert_allclose(dx, ref_fd, rtol=FD_TOL[0], atol=FD_TOL[1])

    C = shape[1]
    gamma, beta = 0.5 + np.random.rand(C), np.random.randn(C)

    def f(xv, gv, bv):
        rm, rp = _stats(C, G, np.float64)
        out = mx.nd.gn_dbn(*(mx.nd.array(v, dtype=np.float64) for v in (xv, gv, bv)), rm, rp,
                           num_groups=G, eps=EPS, whitening="iternorm", iterations=T,
                           affine=True)[0]
        return float((out.asnumpy() * dy).sum())

    _, dxa, _, dg, db = _run(x, dy, G, T, np.float64, affine=(gamma, beta))
    np.testing.assert_allclose(dxa, numeric_grad(lambda z: f(z, gamma, beta), x), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(dg, numeric_grad(lambda z: f(x, z, beta), gamma), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(db, numeric_grad(lambda z: f(x, gamma, z), beta), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
def test_backward_low_precision_vs_float64(dtype):
    """fp16 / fp32 gradients against the (finite-difference checked) float64 op on the same
    rounded inputs."""
    shape = (6, 8, 5, 3)
    x = dbn_data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    _, dx, _ = _run(x, dy, 2, 5, dtype)
    _, dx64, _ = _run(x.astype(np.float64), dy.astype(np.float64), 2, 5, np.float64)
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(dx, dx64, rtol=rtol, atol=atol * 5)


def _whitening_error(y, G):
    """max over groups of ||cov(y_g) - I||_F / sqrt(D)."""
    D = y.shape[1] // G
    errs = []
    for g in range(G):
        Y = _dbn_group_matrix(y, G, g)
        Yc = Y - Y.mean(axis=1, keepdims=True)
        errs.append(np.linalg.norm(Yc @ Yc.T / Y.shape[1] - np.eye(D)) / np.sqrt(D))
    return max(errs)


def test_whitening_quality_improves_with_iterations():
    """The output covariance approaches I as T grows (numbers in docs/dbn.md) and at T = 10
    IterNorm is close to ZCA (both approximate Sigma^{-1/2}); the op follows the paper's
    algorithm at the largest T allowed (10)."""
    x = dbn_data((256, 16), np.float64)
    errs = []
    for T in (1, 3, 5, 10):
        y, _, _ = _run(x, np.zeros_like(x), 1, T, np.float64)
        errs.append(_whitening_error(y, 1))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] > 0.5 and errs[-1] < 5e-3, errs
    zca, _, _ = dbn_ref(x, 1, EPS)
    y10, _, _ = _run(x, np.zeros_like(x), 1, 10, np.float64)
    np.testing.assert_allclose(y10, zca, rtol=0, atol=2e-2)
    np.testing.assert_allclose(y10, iternorm_ref(x, 1, EPS, 10)[0], rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("scale", [1e-3, 1e4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_extreme_scales(scale, dtype):
    """Data far from unit scale (eps scaled along, so the reference is the same problem)."""
    shape = (16, 8, 3)
    x = (dbn_data(shape, np.float64) * scale + 5 * scale).astype(dtype)
    eps = EPS * scale ** 2
    C, G = 8, 2
    rm, rp = _stats(C, G, dtype)
    y = mx.nd.gn_dbn(mx.nd.array(x, dtype=dtype), rm, rp, num_groups=G, eps=eps,
                     whitening="iternorm", iterations=5)[0].asnumpy()
    ref, _ = iternorm_ref(x.astype(np.float64), G, eps, 5)
    rtol, atol = tol(dtype)
    np.testing.assert_allclose(y, ref, rtol=rtol * 10, atol=atol * 10)


def test_block_training_inference_switch_and_hybridize():
    """The block trains with IterNorm (running projection = average of its W) and infers with
    gn_dbn_inference; hybridized equals imperative in both modes."""
    x = dbn_data((32, 8, 3, 3), np.float32)

    def make():
        net = gn_mx.nn.DecorrelatedBatchNorm(num_groups=2, epsilon=EPS, in_channels=8,
                                             whitening="iternorm", iterations=4, prefix="dbn_")
        net.initialize()
        return net

    outs = []
    for hyb in (False, True):
        net = make()
        if hyb:
            net.hybridize()
        with autograd.record():
            y_train = net(mx.nd.array(x))
        y_inf = net(mx.nd.array(x))
        outs.append((y_train.asnumpy(), y_inf.asnumpy(),
                     net.running_projection.data().asnumpy()))
    ref, W = iternorm_ref(x.astype(np.float64), 2, EPS, 4)
    for y_train, y_inf, rp in outs:
        np.testing.assert_allclose(y_train, ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(rp, 0.9 * np.eye(4) + 0.1 * W, rtol=1e-5, atol=1e-6)
        rm = 0.1 * x.astype(np.float64).mean(axis=(0, 2, 3))
        from reference import dbn_inference_ref
        np.testing.assert_allclose(y_inf, dbn_inference_ref(x, rm, rp, 2), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], rtol=1e-6, atol=1e-6)
    assert "whitening='iternorm'" in repr(make())


def test_export_reload(tmp_path):
    """An IterNorm-trained block exports the same inference graph as ZCA (no new attribute) and
    reloads in a fresh process with the same output."""
    net = gn_mx.nn.DecorrelatedBatchNorm(num_groups=2, in_channels=8, whitening="iternorm",
                                         iterations=3)
    net.initialize()
    net.hybridize()
    x = dbn_data((16, 8, 4), np.float32)
    with autograd.record():
        net(mx.nd.array(x))
    want = net(mx.nd.array(x)).asnumpy()
    prefix = str(tmp_path / "it")
    net.export(prefix)
    nodes = json.load(open(prefix + "-symbol.json"))["nodes"]
    ops = [n["op"] for n in nodes]
    assert "gn_dbn" not in ops and "gn_dbn_inference" in ops
    assert all("whitening" not in n.get("attrs", {}) for n in nodes)
    np.testing.assert_allclose(reload_outputs(prefix, [x])[0], want, rtol=1e-6, atol=1e-6)


def test_errors():
    x = mx.nd.ones((4, 4))
    rm, rp = _stats(4, 1, np.float32)
    with pytest.raises(mx.base.MXNetError, match="whitening must be 'zca' or 'iternorm'"):
        mx.nd.gn_dbn(x, rm, rp, whitening="pca")[0].wait_to_read()
    with pytest.raises(mx.base.MXNetError, match=r"iterations must be in \[1, 10\]"):
        mx.nd.gn_dbn(x, rm, rp, whitening="iternorm", iterations=0)[0].wait_to_read()
    with pytest.raises(ValueError, match="whitening must be 'zca' or 'iternorm'"):
        gn_mx.nn.DecorrelatedBatchNorm(whitening="PCA")
    with pytest.raises(ValueError, match="iterations must be an integer in"):
        gn_mx.nn.DecorrelatedBatchNorm(whitening="iternorm", iterations=11)
