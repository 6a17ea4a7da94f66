"""Double backward of gn_group_norm (issue 17, item 3).

`_backward_gn_group_norm` is re-registered by the library as an ordinary op (forward = the
first-order backward, backward = the double backward; src/operator/mx/group_norm_grad2_ops.cc).
Checked against float64 central differences:
- the op's own vector-Jacobian product, into all nine inputs (dy, dmean, drstd, x, gamma, beta, out,
  mean, rstd), every activation;
- grad-of-grad through gn_group_norm with autograd.grad(create_graph=True), every dtype;
- the forward-op route (examples/gradient_penalty.py), imperative and hybridized.
"""
import importlib.util
import os

import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd

import gn_mx  # noqa: F401
from conftest import ROOT

ACTS = ["none", "relu", "silu"]
INPUTS = ["dout", "dmean", "drstd", "data", "gamma", "beta", "out", "mean", "rstd"]


def bwd_op(*args, **kw):
    return mx.nd._internal._backward_gn_group_norm(*args, **kw)


def act_kw(act):
    return {} if act == "none" else {"act_type": act}


def make_inputs(rs, N=2, C=4, G=2, S=3, act="none"):
    x = rs.randn(N, C, S) * 1.5 + 0.3
    gamma, beta = rs.randn(C), rs.randn(C) * 0.5
    out, mean, rstd = mx.nd.gn_group_norm(mx.nd.array(x, dtype=np.float64),
                                         mx.nd.array(gamma, dtype=np.float64),
                                         mx.nd.array(beta, dtype=np.float64), num_groups=G,
                                         **act_kw(act))
    return [rs.randn(N, C, S), rs.randn(N, G), rs.randn(N, G), x, gamma, beta, out.asnumpy(),
            mean.asnumpy(), rstd.asnumpy()]


@pytest.mark.parametrize("act", ACTS)
def test_op_vjp_matches_finite_differences(act):
    rs = np.random.RandomState(3)
    G = 2
    vals = make_inputs(rs, G=G, act=act)
    heads = [rs.randn(*vals[3].shape), rs.randn(4), rs.randn(4)]
    kw = dict(num_groups=G, **act_kw(act))

    def L(vs):
        outs = bwd_op(*[mx.nd.array(v, dtype=np.float64) for v in vs], **kw)
        return sum(float((o.asnumpy() * h).sum()) for o, h in zip(outs, heads))

    arrs = [mx.nd.array(v, dtype=np.float64) for v in vals]
    for a in arrs:
        a.attach_grad()
    with autograd.record():
        outs = bwd_op(*arrs, **kw)
    autograd.backward(list(outs), [mx.nd.array(h, dtype=np.float64) for h in heads])
    h = 1e-6
    for k, name in enumerate(INPUTS):
        num = np.zeros_like(vals[k])
        for i in np.ndindex(*vals[k].shape):
            vp = [v.copy() for v in vals]
            vm = [v.copy() for v in vals]
            vp[k][i] += h
            vm[k][i] -= h
            num[i] = (L(vp) - L(vm)) / (2 * h)
        np.testing.assert_allclose(arrs[k].grad.asnumpy(), num, rtol=1e-6, atol=1e-7,
                                   err_msg=f"d/d{name} ({act})")


def first_order(x, gamma, beta, v, G, act, dtype, create_graph=False, w=None):
    """dL/d(x, gamma, beta) for L = <v, gn_group_norm(x)>; with w: also <w, dL/dx> backpropagated."""
    xs = [mx.nd.array(a, dtype=dtype) for a in (x, gamma, beta)]
    for a in xs:
        a.attach_grad()
    with autograd.record():
        y = mx.nd.gn_group_norm(*xs, num_groups=G, **act_kw(act))[0]
        grads = autograd.grad(y, xs, head_grads=mx.nd.array(v, dtype=dtype),
                              create_graph=create_graph, retain_graph=True)
        if w is None:
            return [g.asnumpy().astype(np.float64) for g in grads]
        z = (grads[0] * mx.nd.array(w, dtype=dtype)).sum() + (grads[1] * 0.3).sum() \
            + (grads[2] * 0.7).sum()
    z.backward()
    return [a.grad.asnumpy().astype(np.float64) for a in xs]


def penalty_fd(x, gamma, beta, v, w, G, act):
    def f(x_, g_, b_):
        gx, gg, gb = first_order(x_, g_, b_, v, G, act, np.float64)
        return (gx * w).sum() + 0.3 * gg.sum() + 0.7 * gb.sum()

    h = 1e-6
    out = []
    for k in range(3):
        args = [x, gamma, beta]
        num = np.zeros_like(args[k])
        for i in np.ndindex(*args[k].shape):
            ap = [a.copy() for a in args]
            am = [a.copy() for a in args]
            ap[k][i] += h
            am[k][i] -= h
            num[i] = (f(*ap) - f(*am)) / (2 * h)
        out.append(num)
    return out


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_grad_of_grad_through_group_norm(act, dtype):
    rs = np.random.RandomState(5)
    N, C, G, S = 2, 6, 3, 4
    x = rs.randn(N, C, S)
    gamma, beta, v, w = rs.randn(C), rs.randn(C) * 0.3, rs.randn(N, C, S), rs.randn(N, C, S)
    x, gamma, beta = (np.asarray(a, dtype=dtype).astype(np.float64) for a in (x, gamma, beta))
    want = penalty_fd(x, gamma, beta, v, w, G, act)
    got = first_order(x, gamma, beta, v, G, act, dtype, create_graph=True, w=w)
    tol = {np.float64: (1e-6, 1e-7), np.float32: (1e-3, 1e-3), np.float16: (5e-2, 5e-2)}[dtype]
    for name, g, n in zip(("x", "gamma", "beta"), got, want):
        np.testing.assert_allclose(g, n, rtol=tol[0], atol=tol[1] * max(1, np.abs(n).max()),
                                   err_msg=f"{name} {act} {np.dtype(dtype).name}")


def test_first_order_unchanged_and_op_shapes():
    """The re-registered op's forward is the first-order backward; its inference fills shapes."""
    rs = np.random.RandomState(0)
    x = mx.nd.array(rs.randn(2, 4, 5))
    g, b = mx.nd.array(rs.randn(4)), mx.nd.array(rs.randn(4))
    for a in (x, g, b):
        a.attach_grad()
    dy = mx.nd.array(rs.randn(2, 4, 5))
    with autograd.record():
        out, mean, rstd = mx.nd.gn_group_norm(x, g, b, num_groups=2)
    out.backward(dy)
    z = mx.nd.zeros((2, 2))
    dx, dg, db = bwd_op(dy, z, z, x, g, b, out, mean, rstd, num_groups=2)
    for a, r in ((x, dx), (g, dg), (b, db)):
        np.testing.assert_array_equal(a.grad.asnumpy(), r.asnumpy())
    # variables of known rank (MXNet 1.9's lib-op glue needs every input's rank: gn_mx/_symbolic.py)
    ranks = dict(zip(INPUTS, (3, 2, 2, 3, 1, 1, 3, 2, 2)))
    s = mx.sym._internal._backward_gn_group_norm(
        *[mx.sym.var(n, shape=(0,) * ranks[n]) for n in INPUTS], num_groups=2)
    arg_shapes, out_shapes, _ = s.infer_shape(data=(2, 4, 5))
    assert out_shapes == [(2, 4, 5), (4,), (4,)]
    assert dict(zip(s.list_arguments(), arg_shapes))["mean"] == (2, 2)
    with pytest.raises(mx.base.MXNetError, match="_backward_gn_group_norm: input 'mean' must"):
        s.infer_shape(data=(2, 4, 5), mean=(2, 3))
    with pytest.raises(mx.base.MXNetError, match="input 'mean' must be float32"):
        s.infer_type(data=np.float32, mean=np.float64)


def _example():
    spec = importlib.util.spec_from_file_location(
        "gnmx_gradient_penalty", os.path.join(ROOT, "examples", "gradient_penalty.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gradient_penalty_example_trains():
    """The example's own fp32 hybridized WGAN-GP steps (MKLDNN convolutions) run and stay finite."""
    ex = _example()
    history = ex.main(steps=2)
    assert len(history) == 2 and np.isfinite(history).all() and history[0][1] > 0


@pytest.mark.filterwarnings("ignore:Parameter critic_b0 is not used")
@pytest.mark.parametrize("hybridize", [False, True])
def test_gradient_penalty_example(hybridize):
    ex = _example()
    critic, penalty = ex.build(dtype=np.float64, seed=0)
    if hybridize:
        penalty.hybridize()
    x = mx.nd.array(np.random.RandomState(1).randn(3, 3, 6, 6), dtype=np.float64)
    grads = ex.penalty_grads(penalty, critic, x)
    # the penalty's input gradient equals autograd's first-order input gradient of the critic
    xx = x.copy()
    xx.attach_grad()
    with autograd.record():
        d = critic(xx)
    d.backward()
    np.testing.assert_allclose(penalty.input_grad(x).asnumpy(), xx.grad.asnumpy(), rtol=1e-10,
                               atol=1e-12)
    # against central differences of the penalty in every parameter (a few entries each)
    params = critic.collect_params()
    rs = np.random.RandomState(2)
    for name, p in params.items():
        base = p.data().asnumpy()
        for _ in range(3):
            i = tuple(rs.randint(s) for s in base.shape)
            vals = []
            for sgn in (1, -1):
                pert = base.copy()
                pert[i] += sgn * 1e-6
                p.set_data(mx.nd.array(pert, dtype=np.float64))
                vals.append(float(penalty(x).asscalar()))
            p.set_data(mx.nd.array(base, dtype=np.float64))
            num = (vals[0] - vals[1]) / 2e-6
            np.testing.assert_allclose(grads[name][i], num, rtol=1e-5, atol=1e-8, err_msg=name)


def test_moments_op_vjp_matches_finite_differences():
    """_backward_gn_moments: [dmean, dvar, data, mean, var] -> ddata, gradient into all five."""
    rs = np.random.RandomState(4)
    x = rs.randn(2, 4, 3)
    mean, var = mx.nd.gn_moments(mx.nd.array(x, dtype=np.float64), num_groups=2)
    vals = [rs.randn(2, 2), rs.randn(2, 2), x, mean.asnumpy(), var.asnumpy()]
    head = rs.randn(*x.shape)

    def L(vs):
        out = mx.nd._internal._backward_gn_moments(*[mx.nd.array(v, dtype=np.float64) for v in vs],
                                                   num_groups=2)
        return float((out.asnumpy() * head).sum())

    arrs = [mx.nd.array(v, dtype=np.float64) for v in vals]
    for a in arrs:
        a.attach_grad()
    with autograd.record():
        out = mx.nd._internal._backward_gn_moments(*arrs, num_groups=2)
    out.backward(mx.nd.array(head, dtype=np.float64))
    for k in range(5):
        num = np.zeros_like(vals[k])
        for i in np.ndindex(*vals[k].shape):
            vp = [v.copy() for v in vals]
            vm = [v.copy() for v in vals]
            vp[k][i] += 1e-6
            vm[k][i] -= 1e-6
            num[i] = (L(vp) - L(vm)) / 2e-6
        np.testing.assert_allclose(arrs[k].grad.asnumpy(), num, rtol=1e-6, atol=1e-8,
                                   err_msg=["dmean", "dvar", "data", "mean", "var"][k])


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_grad_of_grad_through_moments(dtype):
    rs = np.random.RandomState(6)
    x0 = np.asarray(rs.randn(2, 6, 4), dtype=dtype).astype(np.float64)
    vm, vv, w = rs.randn(2, 3), rs.randn(2, 3), rs.randn(2, 6, 4)

    def first(x, dt, create_graph=False):
        xs = mx.nd.array(x, dtype=dt)
        xs.attach_grad()
        acc = np.float64 if dt == np.float64 else np.float32
        with autograd.record():
            m, v = mx.nd.gn_moments(xs, num_groups=3)
            g = autograd.grad([m, v], [xs], head_grads=[mx.nd.array(vm, dtype=acc),
                                                        mx.nd.array(vv, dtype=acc)],
                              create_graph=create_graph, retain_graph=True)[0]
            if not create_graph:
                return g.asnumpy().astype(np.float64)
            z = (g * mx.nd.array(w, dtype=dt)).sum()
        z.backward()
        return xs.grad.asnumpy().astype(np.float64)

    num = np.zeros_like(x0)
    for i in np.ndindex(*x0.shape):
        xp, xm = x0.copy(), x0.copy()
        xp[i] += 1e-6
        xm[i] -= 1e-6
        num[i] = ((first(xp, np.float64) * w).sum() - (first(xm, np.float64) * w).sum()) / 2e-6
    got = first(x0, dtype, create_graph=True)
    tol = {np.float64: 1e-7, np.float32: 1e-4, np.float16: 2e-2}[dtype]
    np.testing.assert_allclose(got, num, rtol=tol, atol=tol * max(1, np.abs(num).max()))
