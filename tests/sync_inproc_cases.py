"""Synchronized DBN over several in-process cpu devices: run by tests/test_dbn_sync.py in a fresh
interpreter whose MXNet starts with the resource pools gn_mx.sync.cpu_pool_environment(4) asks for
(not collected by pytest on its own: the suite's process started MXNet with the default pools).

N devices with batch b each == one DecorrelatedBatchNorm on the N*b batch (outputs, input gradients,
gamma/beta gradients summed over the devices' copies, running statistics on every device),
imperative and hybridized, ZCA and IterNorm, float64/32/16; failure modes that need several devices.
"""
import itertools
import os
import time

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import gn_mx
from conftest import dbn_data
from tolerances import GRAD_TOL, TOL, tol

_keys = itertools.count()


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


def _synced(x, dy, gamma, beta, G, dtype, ndev, hybridize=None, **kw):
    """SyncDecorrelatedBatchNorm over ndev cpu contexts, x split along the batch."""
    ctx = [mx.cpu(i) for i in range(ndev)]
    blk = gn_mx.SyncDecorrelatedBatchNorm(num_devices=ndev, key=_key(), timeout=30,
                                          num_groups=G, in_channels=x.shape[1], **kw)
    blk.initialize(ctx=ctx)
    blk.cast(dtype)
    blk.gamma.set_data(mx.nd.array(gamma, dtype=dtype))
    blk.beta.set_data(mx.nd.array(beta, dtype=dtype))
    if hybridize is not None:  # the hybridize() flags
        blk.hybridize(**hybridize)
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
                                          ((4, 4, 2, 2, 2), 1, 2), ((6, 3, 2), 3, 3)])
def test_devices_equal_one_dbn_on_the_whole_batch(shape, G, ndev, dtype, whitening):
    x = dbn_data(shape, dtype)
    dy = np.random.randn(*shape).astype(dtype)
    gamma, beta = _params(shape[1], dtype)
    kw = {"whitening": whitening}
    want = _reference(x, dy, gamma, beta, G, dtype, **kw)
    _compare(_synced(x, dy, gamma, beta, G, dtype, ndev, **kw), want, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("whitening", ["zca", "iternorm"])
def test_hybridized_equals_reference(whitening, dtype):
    x = dbn_data((6, 4, 3), dtype)
    dy = np.random.randn(*x.shape).astype(dtype)
    gamma, beta = _params(4, dtype)
    kw = {"whitening": whitening}
    want = _reference(x, dy, gamma, beta, 2, dtype, **kw)
    hyb = _synced(x, dy, gamma, beta, 2, dtype, 3, hybridize={}, **kw)
    _compare(hyb, want, dtype)


@pytest.mark.parametrize("flags", [{"static_alloc": True},
                                   {"static_alloc": True, "static_shape": True}])
def test_static_alloc_equals_reference(flags):
    """Issue 42's probe saw static_alloc hang; with the pools sized it runs, with the same values."""
    x = dbn_data((8, 4, 3), np.float64)
    dy = np.random.randn(*x.shape)
    gamma, beta = _params(4, np.float64)
    want = _reference(x, dy, gamma, beta, 2, np.float64)
    _compare(_synced(x, dy, gamma, beta, 2, np.float64, 4, hybridize=flags), want, np.float64)


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
                          "1 of 2 devices arrived", "MXNET_CPU_TEMP_COPY=2048")
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


