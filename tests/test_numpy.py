"""The NumPy interface (``npx.set_np()``): blocks and functional wrappers take and return mx.np arrays.

Every test that switches the interface on does it through the `np_mode` fixture, which restores the
legacy mode (``npx.reset_np()``) afterwards, so other tests are unaffected. Results under set_np are
compared with the same computation on legacy NDArrays (itself tested against float64 references in
test_blocks.py / test_dbn_blocks.py) and, for GroupNorm, directly with the float64 reference.
"""
import json
import os

import numpy as onp
import pytest

import mxnet as mx
from mxnet import autograd, gluon, npx

import gn_mx
from conftest import run_python, tol
from reference import group_norm_ref

CPU = mx.cpu()
HYBRID = {"imperative": None, "hybrid": {}, "static": {"static_alloc": True, "static_shape": True}}


def _arr(value, np_kind):
    return mx.np.array(value, dtype=value.dtype) if np_kind else mx.nd.array(value, dtype=value.dtype)


def _net(cls, **kw):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), cls(num_groups=2, **kw))
    return net


def _params(net):
    """(key, Parameter) in creation order; keys do not depend on the instance counters."""
    return [(f"{i}_{p.name.rsplit('_', 2)[-1]}", p)
            for i, p in enumerate(net.collect_params().values())]


def _param_values(net):
    rng = onp.random.RandomState(7)
    vals = {}
    for key, p in _params(net):
        if p.name.endswith("running_projection"):
            D = p.shape[1]
            vals[key] = (onp.eye(D) + 0.1 * rng.randn(p.shape[0], D, D)).astype(onp.float32)
        elif p.name.endswith("running_mean"):
            vals[key] = (0.1 * rng.randn(*p.shape)).astype(onp.float32)
        else:
            vals[key] = (0.5 * rng.randn(*p.shape) + p.name.endswith("gamma")).astype(onp.float32)
    return vals


def _scenario(cls, hybrid, np_kind, x, dy, values=None):
    """Inference, a recorded training pass with backward, inference again; all results as numpy."""
    net = _net(cls)
    net.initialize(ctx=CPU)
    xs = _arr(x, np_kind)
    net(xs)  # deferred init
    if values is None:
        values = _param_values(net)
    for key, p in _params(net):
        p.set_data(_arr(values[key], np_kind))
    if hybrid is not None:
        net.hybridize(**hybrid)
    res = {}
    y = net(xs)
    assert isinstance(y, mx.np.ndarray) == np_kind and isinstance(y, mx.nd.NDArray)
    res["y_infer"] = y.asnumpy()
    xs.attach_grad()
    with autograd.record():
        y = net(xs)
    assert isinstance(y, mx.np.ndarray) == np_kind
    y.backward(_arr(dy, np_kind))
    res["y_train"] = y.asnumpy()
    res["dx"] = xs.grad.asnumpy()
    for key, p in _params(net):
        if p.grad_req != "null":
            assert isinstance(p.grad(), mx.np.ndarray) == np_kind
            res["grad_" + key] = p.grad().asnumpy()
        res["after_" + key] = p.data().asnumpy()
    res["y_infer2"] = net(xs).asnumpy()
    return res, values


@pytest.mark.parametrize("hybrid", list(HYBRID), ids=str)
@pytest.mark.parametrize("cls", [gn_mx.GroupNorm, gn_mx.DecorrelatedBatchNorm],
                         ids=lambda c: c.__name__)
def test_blocks_under_set_np_match_legacy(cls, hybrid):
    x = onp.random.randn(4, 3, 6, 6).astype(onp.float32)
    dy = onp.random.randn(4, 8, 4, 4).astype(onp.float32)
    ref, values = _scenario(cls, HYBRID[hybrid], False, x, dy)
    npx.set_np()
    try:
        got, _ = _scenario(cls, HYBRID[hybrid], True, x, dy, values)
    finally:
        npx.reset_np()
    assert set(got) == set(ref)
    for k in ref:
        onp.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if cls is gn_mx.DecorrelatedBatchNorm:  # the training pass moved the running statistics
        key = [k for k in values if k.endswith("mean")][0]
        assert not onp.allclose(ref["after_" + key], values[key])
        assert not onp.allclose(ref["y_infer"], ref["y_train"], atol=1e-3)


def test_group_norm_np_vs_float64_reference(np_mode):
    blk = gn_mx.GroupNorm(num_groups=3, gamma_initializer=mx.init.Uniform(1.0),
                          beta_initializer=mx.init.Uniform(1.0))
    blk.initialize(ctx=CPU)
    blk.hybridize()
    x = onp.random.randn(2, 6, 5).astype(onp.float32) * 3 + 1
    y = blk(mx.np.array(x))
    assert type(y) is mx.np.ndarray
    assert isinstance(blk.gamma.data(), mx.np.ndarray)
    out, _, _ = group_norm_ref(x, blk.gamma.data().asnumpy(), blk.beta.data().asnumpy(), 3, 1e-5)
    onp.testing.assert_allclose(y.asnumpy(), out, *tol(onp.float32))


def test_dbn_group_size_deferred_under_set_np(np_mode):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(12, flatten=False), gn_mx.DecorrelatedBatchNorm(group_size=4))
    net.initialize(ctx=CPU)
    net.hybridize()
    x = mx.np.random.normal(size=(16, 12))
    with autograd.record():
        y = net(x)
    assert type(y) is mx.np.ndarray and y.shape == (16, 12)
    assert net[1].running_projection.shape == (3, 4, 4)
    yhat = y.asnumpy().reshape(16, 3, 4)
    for g in range(3):  # whitened per group (gamma=1, beta=0): identity covariance
        onp.testing.assert_allclose(onp.cov(yhat[:, g].T, bias=True), onp.eye(4), atol=2e-3)


def test_ops_accept_both_kinds_and_return_the_given_kind():
    x = onp.random.randn(3, 4, 5).astype(onp.float32)
    g = onp.random.rand(4).astype(onp.float32) + 0.5
    b = onp.random.randn(4).astype(onp.float32)
    rm = onp.zeros(4, onp.float32)
    rp = onp.tile(onp.eye(2, dtype=onp.float32), (2, 1, 1))
    ref = {
        "moments": [a.asnumpy() for a in gn_mx.ops.moments(mx.nd.array(x), num_groups=2)],
        "gn": [a.asnumpy() for a in gn_mx.ops.group_norm(mx.nd.array(x), mx.nd.array(g),
                                                         mx.nd.array(b), num_groups=2,
                                                         return_stats=True)],
        "dbn_inf": gn_mx.ops.dbn_inference(mx.nd.array(x), mx.nd.array(rm + 0.3),
                                           mx.nd.array(rp * 2), num_groups=2).asnumpy(),
    }
    rm_l, rp_l = mx.nd.array(rm), mx.nd.array(rp)
    ref["dbn"] = gn_mx.ops.dbn(mx.nd.array(x), rm_l, rp_l, num_groups=2).asnumpy()
    npx.set_np()
    try:
        xs = mx.np.array(x)
        mo = gn_mx.ops.moments(xs, num_groups=2)
        gn = gn_mx.ops.group_norm(xs, mx.np.array(g), mx.np.array(b), num_groups=2,
                                  return_stats=True)
        inf = gn_mx.ops.dbn_inference(xs, mx.np.array(rm + 0.3), mx.np.array(rp * 2), num_groups=2)
        rm_n, rp_n = mx.np.array(rm), mx.np.array(rp)
        db = gn_mx.ops.dbn(xs, rm_n, rp_n, num_groups=2)
        for a in list(mo) + list(gn) + [inf, db]:
            assert type(a) is mx.np.ndarray
        for a, r in zip(list(mo) + list(gn), ref["moments"] + ref["gn"]):
            onp.testing.assert_array_equal(a.asnumpy(), r)
        onp.testing.assert_array_equal(inf.asnumpy(), ref["dbn_inf"])
        onp.testing.assert_array_equal(db.asnumpy(), ref["dbn"])
        # the running statistics of np arrays are updated in place, as for legacy arrays
        onp.testing.assert_array_equal(rm_n.asnumpy(), rm_l.asnumpy())
        onp.testing.assert_array_equal(rp_n.asnumpy(), rp_l.asnumpy())
        assert not onp.allclose(rm_n.asnumpy(), 0)
        # autograd through the wrapper with np arrays
        xs.attach_grad()
        gs, bs = mx.np.array(g), mx.np.array(b)
        with autograd.record():
            y = gn_mx.ops.group_norm(xs, gs, bs, num_groups=2)
        y.backward(mx.np.ones_like(y))
        dx_np = xs.grad.asnumpy()
        # symbols: np symbols in, np symbol out; legacy in, legacy out
        s = gn_mx.ops.group_norm(mx.sym.var("d").as_np_ndarray(), mx.sym.var("g").as_np_ndarray(),
                                 mx.sym.var("b").as_np_ndarray(), num_groups=2)
        assert isinstance(s, mx.sym.np._Symbol)
        assert s.list_arguments() == ["d", "g", "b"]
    finally:
        npx.reset_np()
    s = gn_mx.ops.group_norm(mx.sym.var("d"), mx.sym.var("g"), mx.sym.var("b"), num_groups=2)
    assert type(s) is mx.sym.Symbol
    xl = mx.nd.array(x)
    xl.attach_grad()
    with autograd.record():
        y = gn_mx.ops.group_norm(xl, mx.nd.array(g), mx.nd.array(b), num_groups=2)
    y.backward(mx.nd.ones_like(y))
    onp.testing.assert_array_equal(dx_np, xl.grad.asnumpy())
    assert onp.abs(dx_np).max() > 0


def test_conversion_is_zero_copy(np_mode):
    from gn_mx import _np
    x = mx.np.zeros((2, 4, 3))
    v = _np.to_legacy(x)
    assert type(v) is mx.nd.NDArray
    v[:] = 5  # a view of the same memory, not a copy
    assert float(x.sum()) == 5 * 24
    w = _np.to_np(v)
    w[0] = 1
    assert float(x.sum()) == 5 * 12 + 12
    s = mx.sym.var("a").as_np_ndarray()
    assert _np.to_legacy(s).tojson() == s.tojson()  # same graph node, nothing added


def test_export_under_set_np_reloads_in_fresh_process(tmp_path, np_mode):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3), gn_mx.GroupNorm(num_groups=4),
            gn_mx.DecorrelatedBatchNorm(num_groups=2))
    net.initialize(ctx=CPU)
    net.hybridize(static_alloc=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    x = mx.np.random.normal(size=(4, 3, 7, 7))
    for _ in range(2):
        with autograd.record():
            loss = (net(x) ** 2).mean()
        loss.backward()
        trainer.step(4)
    prefix = str(tmp_path / "npmodel")
    net.export(prefix)  # right after training: the inference graph
    expected = net(x).asnumpy()
    with open(prefix + "-symbol.json") as f:
        ops = {n["op"] for n in json.load(f)["nodes"]}
    assert {"gn_group_norm", "gn_dbn_inference"} <= ops and "gn_dbn" not in ops
    onp.save(tmp_path / "x.npy", x.asnumpy())
    onp.save(tmp_path / "expected.npy", expected)
    r = run_python(f"""
        import warnings; warnings.simplefilter("ignore")
        import numpy as onp, mxnet as mx, gn_mx
        mx.npx.set_np()
        blk = mx.gluon.SymbolBlock.imports({prefix + '-symbol.json'!r}, ['data'],
                                           {prefix + '-0000.params'!r})
        y = blk(mx.np.array(onp.load({str(tmp_path / 'x.npy')!r})))
        assert type(y) is mx.np.ndarray, type(y)
        onp.testing.assert_allclose(y.asnumpy(), onp.load({str(tmp_path / 'expected.npy')!r}),
                                    rtol=1e-5, atol=1e-6)
        print("OK")
    """, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
