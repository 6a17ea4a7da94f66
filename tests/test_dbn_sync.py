"""SyncDecorrelatedBatchNorm (python/gn_mx/sync.py) and its ops gn_sync_sum / gn_dbn_whiten /
gn_cast_like: N in-process cpu devices with batch b each == one DecorrelatedBatchNorm on the N*b
batch (outputs, input gradients, gamma/beta gradients, running statistics), imperative and
hybridized, ZCA and IterNorm; every failure mode ends with its error within its timeout.

The CPU resource-pool variables must be set before MXNet starts: the module sets them when it is
imported first, and the tests that need a fresh MXNet run in a subprocess.
"""
import itertools
import os
import threading
import time

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import gn_mx
from gn_mx import sync
from conftest import dbn_data, run_python
from tolerances import GRAD_TOL, TOL, tol

_keys = itertools.count()


@pytest.fixture(autouse=True)
def _pools(monkeypatch):
    """The pool variables the block checks (MXNet itself read them at its start: conftest)."""
    for k, v in sync.cpu_pool_environment(4).items():
        monkeypatch.setenv(k, v)


def _key():
    return f"test_dbn_sync_{os.getpid()}_{next(_keys)}"


def _params(C, dtype, seed=1):
    rng = np.random.RandomState(seed)
    return (1 + 0.3 * rng.randn(C)).astype(dtype), (0.2 * rng.randn(C)).astype(dtype)


def _reference(x, dy, gamma, beta, G, dtype, **kw):
    """One DecorrelatedBatchNorm on the whole batch: y, dx, dgamma, dbeta, running stats."""
    blk = gn_mx.DecorrelatedBatchNorm(num_groups=G, in_channels=x.shape[1], **kw)
    blk.initialize()
    blk.cast(dtype)
    blk.gamma.set_data(mx.nd.array(gamma, dtype=dtype))
    blk.beta.set_data(mx.nd.array(beta, dtype=dtype))
    xd = mx.nd.array(x, dtype=dtype)
    xd.attach_grad()
    with autograd.record():
        y = blk(xd)
    y.backward(mx.nd.array(dy, dtype=dtype))
    return [a.asnumpy() for a in (y, xd.grad, blk.gamma.grad(), blk.beta.grad(),
                                  blk.running_mean.data(), blk.running_projection.data())]


def _synced(x, dy, gamma, beta, G, dtype, ndev, hybridize=False, **kw):
    """SyncDecorrelatedBatchNorm over ndev cpu contexts, x split along the batch."""
    ctx = [mx.cpu(i) for i in range(ndev)]
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=ndev, key=_key(), timeout=30,
                                          num_groups=G, in_channels=x.shape[1], **kw)
    blk.initialize(ctx=ctx)
    blk.cast(dtype)
    blk.gamma.set_data(mx.nd.array(gamma, dtype=dtype))
    blk.beta.set_data(mx.nd.array(beta, dtype=dtype))
    if hybridize:
        blk.hybridize()
    xs = [mx.nd.array(p, ctx=c, dtype=dtype) for p, c in zip(np.split(x, ndev), ctx)]
    dys = [mx.nd.array(p, ctx=c, dtype=dtype) for p, c in zip(np.split(dy, ndev), ctx)]
    for a in xs:
        a.attach_grad()
    with autograd.record():
        ys = [blk(a) for a in xs]
    autograd.backward(ys, dys)
    cat = lambda arrs: np.concatenate([a.asnumpy() for a in arrs])  # noqa: E731
    summed = lambda p: sum(g.asnumpy().astype(np.float64) for g in p.list_grad())  # noqa: E731
    stats = [[d.asnumpy() for d in p.list_data()]
             for p in (blk.running_mean, blk.running_projection)]
    for copies in stats:  # every device holds the same running statistics
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
    return [cat(ys), cat(a.grad for a in xs), summed(blk.gamma), summed(blk.beta),
            stats[0][0], stats[1][0]]


_NAMES = ("out", "dx", "dgamma", "dbeta", "running_mean", "running_projection")


def _compare(got, want, dtype):
    for name, g, w in zip(_NAMES, got, want):
        rtol, atol = tol(dtype, GRAD_TOL if name.startswith("d") else TOL)
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol,
                                   atol=atol * scale, err_msg=name)


@pytest.mark.parametrize("whitening", ["zca", "iternorm"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("shape,G,ndev", [((8, 4), 2, 2), ((4, 6, 3, 3), 2, 4),
                                          ((4, 4, 2, 2, 2), 1, 2)])
def test_devices_equal_one_dbn_on_the_whole_batch(shape, G, ndev, dtype, whitening):
    x = dbn_data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    gamma, beta = _params(shape[1], dtype)
    kw = {"whitening": whitening}
    want = _reference(x, dy, gamma, beta, G, dtype, **kw)
    _compare(_synced(x, dy, gamma, beta, G, dtype, ndev, **kw), want, dtype)


@pytest.mark.parametrize("whitening", ["zca", "iternorm"])
def test_hybridized_equals_imperative_and_reference(whitening):
    x = dbn_data((6, 4, 3), np.float64)
    dy = np.random.randn(*x.shape)
    gamma, beta = _params(4, np.float64)
    kw = {"whitening": whitening}
    want = _reference(x, dy, gamma, beta, 2, np.float64, **kw)
    hyb = _synced(x, dy, gamma, beta, 2, np.float64, 3, hybridize=True, **kw)
    _compare(hyb, want, np.float64)


def test_whiten_gradient_matches_central_differences():
    """gn_dbn_whiten's d cov against float64 central differences of sum(W * R), ZCA and IterNorm."""
    rng = np.random.RandomState(3)
    A = rng.randn(2, 3, 5)
    cov = np.einsum("gik,gjk->gij", A, A) / 5
    R = rng.randn(2, 3, 3)
    for kw in ({}, {"whitening": "iternorm", "iterations": 4}):
        def f(c):
            rm, rp = mx.nd.zeros((6,), dtype="float64"), mx.nd.zeros((2, 3, 3), dtype="float64")
            W = mx.nd.gn_dbn_whiten(mx.nd.array(c, dtype="float64"),
                                    mx.nd.zeros((6,), dtype="float64"), rm, rp, eps=1e-3, **kw)[0]
            return float((W.asnumpy() * R).sum())
        c = mx.nd.array(cov, dtype="float64")
        c.attach_grad()
        rm, rp = mx.nd.zeros((6,), dtype="float64"), mx.nd.zeros((2, 3, 3), dtype="float64")
        with autograd.record():
            W = mx.nd.gn_dbn_whiten(c, mx.nd.zeros((6,), dtype="float64"), rm, rp, eps=1e-3,
                                    **kw)[0]
        W.backward(mx.nd.array(R, dtype="float64"))
        h = 1e-6
        fd = np.zeros_like(cov)
        for idx in np.ndindex(*cov.shape):
            g, i, j = idx
            if i > j:
                continue
            E = np.zeros_like(cov)
            E[g, i, j] = E[g, j, i] = h  # symmetric perturbation: d/dC_ij + d/dC_ji
            fd[idx] = (f(cov + E) - f(cov - E)) / (2 * h)
        got = c.grad.asnumpy()
        sym = got + np.transpose(got, (0, 2, 1)) - got * np.eye(3)  # the same directions
        iu = np.triu_indices(3)
        np.testing.assert_allclose(sym[:, iu[0], iu[1]], fd[:, iu[0], iu[1]], rtol=1e-5, atol=1e-7)


def test_inference_and_export_have_no_sync_op(tmp_path):
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=2, key=_key(), num_groups=2, in_channels=4)
    blk.initialize()
    blk.hybridize()
    x = mx.nd.array(dbn_data((4, 4, 2), np.float32))
    y = blk(x)  # inference: running statistics, no barrier
    blk.export(str(tmp_path / "m"))
    graph = open(tmp_path / "m-symbol.json").read()
    assert "gn_dbn_inference" in graph and "gn_sync_sum" not in graph and "gn_dbn_whiten" not in graph
    np.save(tmp_path / "x.npy", x.asnumpy())
    proc = run_python(f"""
        import mxnet as mx, numpy as np, gn_mx
        net = mx.gluon.SymbolBlock.imports({str(tmp_path / 'm-symbol.json')!r}, ['data'],
                                           {str(tmp_path / 'm-0000.params')!r})
        print(net(mx.nd.array(np.load({str(tmp_path / 'x.npy')!r}))).asnumpy().tolist())
    """, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    np.testing.assert_allclose(np.array(eval(proc.stdout.strip().splitlines()[-1])), y.asnumpy(),
                               rtol=1e-6, atol=1e-6)


# ---- failure modes: each ends with its error within its timeout -----------------------------------

def _wait_error(arr, *texts):
    t0 = time.time()
    with pytest.raises(mx.base.MXNetError) as e:
        arr.wait_to_read()
    for t in texts:
        assert t in str(e.value), str(e.value)[-2000:]
    return time.time() - t0


def _sum(x, key, ndev, timeout=1.0):
    return mx.nd.gn_sync_sum(x, key=key, num_devices=ndev, timeout=timeout)


def test_device_never_arrives_times_out_then_key_works_again():
    key = _key()
    x = mx.nd.ones((3,), dtype="float64", ctx=mx.cpu(0))
    elapsed = _wait_error(_sum(x, key, 2), f"key '{key}/fwd'", "timed out after 1 s",
                          "1 of 2 devices arrived")
    assert elapsed < 10
    outs = [_sum(mx.nd.ones((3,), dtype="float64", ctx=mx.cpu(i)) * (i + 1), key, 2)
            for i in range(2)]
    for o in outs:
        np.testing.assert_array_equal(o.asnumpy(), [3, 3, 3])


def test_block_device_never_arrives_names_key_and_count():
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=2, key="lonely", timeout=1, num_groups=2,
                                          in_channels=4)
    blk.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    with autograd.record():
        y = blk(mx.nd.array(dbn_data((4, 4), np.float32), ctx=mx.cpu(0)))
    _wait_error(y, "gn_sync_sum", "key 'lonely/mean/fwd'", "1 of 2 devices arrived")


def test_failed_device_call_every_device_gets_an_error():
    """Device 1's call fails at the call (a bad shape): device 0 gets the timeout error."""
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=2, key=_key(), timeout=1, num_groups=2,
                                          in_channels=4)
    blk.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    with autograd.record():
        y0 = blk(mx.nd.array(dbn_data((4, 4), np.float32), ctx=mx.cpu(0)))
        with pytest.raises(ValueError, match="channels"):
            blk(mx.nd.ones((4, 6), ctx=mx.cpu(1)))
    _wait_error(y0, "1 of 2 devices arrived")


@pytest.mark.parametrize("what", ["num_devices", "size"])
def test_mismatched_calls_fail_on_every_device(what):
    key = _key()
    a = _sum(mx.nd.ones((3,), dtype="float64", ctx=mx.cpu(0)), key, 2, timeout=5)
    b = _sum(mx.nd.ones((3 if what == "num_devices" else 4,), dtype="float64", ctx=mx.cpu(1)),
             key, 3 if what == "num_devices" else 2, timeout=5)
    for arr in (a, b):
        assert _wait_error(arr, "mismatched calls", f"key '{key}/fwd'") < 5


def test_naive_engine_refused():
    proc = run_python("""
        import os
        os.environ['MXNET_ENGINE_TYPE'] = 'NaiveEngine'
        import mxnet as mx, gn_mx
        blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=2, num_groups=2, in_channels=4)
        blk.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
        try:
            with mx.autograd.record():
                blk(mx.nd.ones((2, 4)))
        except ValueError as e:
            print('REFUSED', e)
    """, timeout=120)
    assert "REFUSED" in proc.stdout and "NaiveEngine" in proc.stdout, proc.stderr[-2000:]


def test_static_alloc_refused():
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=2, num_groups=2, in_channels=4)
    net = mx.gluon.nn.HybridSequential()
    net.add(blk)
    with pytest.raises(ValueError, match="static_alloc=True is not supported"):
        net.hybridize(static_alloc=True)
    net.hybridize()  # without it: fine


def test_small_cpu_pools_named(monkeypatch):
    monkeypatch.delenv("MXNET_CPU_TEMP_COPY")
    monkeypatch.setenv("MXNET_CPU_PARALLEL_RAND_COPY", "2")
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=2, num_groups=2, in_channels=4)
    blk.initialize()
    with pytest.raises(ValueError, match="MXNET_CPU_TEMP_COPY=unset, MXNET_CPU_PARALLEL_RAND_COPY=2"):
        with autograd.record():
            blk(mx.nd.ones((2, 4)))


@pytest.mark.parametrize("kw,text", [({"num_devices": 0}, "num_devices"),
                                     ({"num_devices": 1.5}, "num_devices"),
                                     ({"timeout": 0}, "timeout")])
def test_bad_arguments(kw, text):
    with pytest.raises(ValueError, match=text):
        gn_mx.SyncDecorrelatedBatchNorm(num_groups=2, **kw)


@pytest.mark.parametrize("attrs,text", [({}, "key is required"),
                                        ({"key": "k", "num_devices": 0}, "num_devices"),
                                        ({"key": "k", "timeout": -1}, "timeout")])
def test_sync_sum_bad_attributes(attrs, text):
    with pytest.raises(mx.base.MXNetError, match=text):
        mx.nd.gn_sync_sum(mx.nd.ones((2,), dtype="float64"), **attrs).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match="float64"):
        mx.nd.gn_sync_sum(mx.nd.ones((2,)), key="k").wait_to_read()
