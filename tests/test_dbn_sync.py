"""SyncDecorrelatedBatchNorm (python/gn_mx/sync.py) and its ops gn_sync_sum / gn_dbn_whiten /
gn_dbn_apply. The multi-device cases (exactness against one DBN on the whole batch, timeouts,
mismatches) are tests/sync_inproc_cases.py, run here in a fresh interpreter whose MXNet starts
with the CPU resource pools synchronized DBN needs; the rest runs in this process.
"""
import importlib.util
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import gn_mx
from gn_mx import sync
from conftest import ROOT, dbn_data, run_python

_keys = itertools.count()
_spec = importlib.util.spec_from_file_location(
    "horovod_train", os.path.join(ROOT, "examples", "horovod_train.py"))
horovod_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(horovod_train)


def _key():
    return f"test_dbn_sync_{os.getpid()}_{next(_keys)}"


def test_in_process_devices():
    """tests/sync_inproc_cases.py under pytest in a fresh process (bounded: every barrier has a
    timeout, and the run itself one more)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **sync.cpu_pool_environment(4))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join("tests", "sync_inproc_cases.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout[-1500:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("whitening", ["zca", "iternorm"])
def test_one_device_composed_path_equals_dbn(whitening):
    """num_devices=1 runs the synchronized step's float64 graph without a barrier: DBN's values."""
    x = dbn_data((6, 4, 3), np.float64)
    dy = np.random.randn(*x.shape)
    got = []
    for cls, kw in ((gn_mx.DecorrelatedBatchNorm, {}), (gn_mx.SyncDecorrelatedBatchNorm, {})):
        blk = cls(num_groups=2, in_channels=4, whitening=whitening, **kw)
        blk.initialize()
        blk.cast("float64")
        xd = mx.nd.array(x, dtype="float64")
        xd.attach_grad()
        with autograd.record():
            y = blk(xd)
        y.backward(mx.nd.array(dy, dtype="float64"))
        got.append([y.asnumpy(), xd.grad.asnumpy(), blk.gamma.grad().asnumpy(),
                    blk.running_projection.data().asnumpy()])
    for a, b in zip(*got):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-11)


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


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_apply_gradients_match_central_differences(dtype):
    """gn_dbn_apply's gradients of data, gamma, beta, mean and W against float64 central
    differences of sum(out * R) (float32 data: the float64 math, one rounding of out)."""
    rng = np.random.RandomState(5)
    shape, G = (3, 4, 2), 2
    args = [rng.randn(*shape), 1 + 0.3 * rng.randn(4), rng.randn(4), rng.randn(4),
            rng.randn(G, 2, 2)]
    dts = [dtype, dtype, dtype, np.float64, np.float64]
    R = rng.randn(*shape)

    def f(vals):
        out = mx.nd.gn_dbn_apply(*[mx.nd.array(v, dtype=d) for v, d in zip(vals, dts)],
                                 num_groups=G)
        return float((out.asnumpy().astype(np.float64) * R).sum())
    nds = [mx.nd.array(v, dtype=d) for v, d in zip(args, dts)]
    for a in nds:
        a.attach_grad()
    with autograd.record():
        out = mx.nd.gn_dbn_apply(*nds, num_groups=G)
    out.backward(mx.nd.array(R, dtype=dtype))
    h = 1e-6 if dtype == np.float64 else 1e-2
    for k, (v, a) in enumerate(zip(args, nds)):
        fd = np.zeros_like(v)
        for idx in np.ndindex(*v.shape):
            p, m = [x.copy() for x in args], [x.copy() for x in args]
            p[k][idx] += h
            m[k][idx] -= h
            fd[idx] = (f(p) - f(m)) / (2 * h)
        rtol = 1e-6 if dtype == np.float64 else 2e-2
        np.testing.assert_allclose(a.grad.asnumpy(), fd, rtol=rtol, atol=rtol, err_msg=str(k))


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


def test_small_cpu_pools_named(monkeypatch):
    monkeypatch.delenv("MXNET_CPU_TEMP_COPY", raising=False)
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


def _horovod_reason():
    """None when horovodrun and horovod.mxnet (with Gloo) are there, else why not."""
    if horovod_train.horovodrun_path() is None:
        return "horovodrun not found (GNMX_HOROVOD=1 bash dev.sh builds Horovod)"
    proc = run_python("import mxnet, horovod.mxnet as hvd; print(hvd.gloo_built())", timeout=120)
    if proc.returncode != 0 or not proc.stdout.strip().endswith("True"):
        return "horovod.mxnet with Gloo does not import: " + proc.stderr.strip()[-300:]
    return None


def test_horovod_two_ranks_equal_one_dbn():
    """tests/sync_horovod_worker.py under horovodrun -np 2 --gloo (loopback), bounded; every process
    of the launch is stopped at the end (examples/horovod_train.py's helpers)."""
    reason = _horovod_reason()
    if reason is not None:
        if os.environ.get("GNMX_HOROVOD") == "1":
            pytest.fail(f"GNMX_HOROVOD=1 but {reason}")
        pytest.skip(reason)
    marker = f"syncdbn-{os.getpid()}-{next(_keys)}"
    cmd = [horovod_train.horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo",
           "--network-interface", "lo", "--start-timeout", "60", sys.executable,
           os.path.join(ROOT, "tests", "sync_horovod_worker.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", **{horovod_train._MARK: marker})
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=150)
    finally:
        horovod_train._stop(proc, marker)
        proc.stdout.close()
    assert proc.returncode == 0, text[-6000:]
    assert "rank 0 ok" in text and "rank 1 ok" in text, text[-3000:]


def test_replace_norm_maps_sync_batch_norm():
    """MXNet's contrib SyncBatchNorm becomes SyncDecorrelatedBatchNorm with its num_devices."""
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(8, 3, in_channels=3),
            mx.gluon.contrib.nn.SyncBatchNorm(in_channels=8, num_devices=4))
    gn_mx.replace_norm(net, norm=gn_mx.DecorrelatedBatchNorm, group_size=4)
    new = net[1]
    assert type(new) is gn_mx.SyncDecorrelatedBatchNorm and new._num_devices == 4
    plain = mx.gluon.nn.HybridSequential()
    plain.add(mx.gluon.nn.BatchNorm(in_channels=8))
    gn_mx.replace_norm(plain, norm=gn_mx.DecorrelatedBatchNorm, group_size=4)
    assert type(plain[0]) is gn_mx.DecorrelatedBatchNorm


def test_train_small_batch_devices(tmp_path):
    """examples/train_small_batch.py --devices 2 with SyncDBN (the split_and_load loop): one result
    per configuration, batch sizes per device, and it learns (chance is 10%)."""
    pytest.importorskip("sklearn", reason="train_small_batch.py needs scikit-learn (digits data)")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_small_batch.py"), "--quick",
         "--epochs", "1", "--devices", "2", "--norms", "syncdbn_gn_mx", "--batch-sizes", "4",
         "--precisions", "fp32", "--name", "sync", "--out", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json
    (r,) = json.loads((tmp_path / "sync.json").read_text())["results"]
    assert (r["norm"], r["batch_size"], r["devices"], r["steps"]) == ("syncdbn_gn_mx", 4, 2, 48)
    assert r["val_acc"] > 0.3, r
    assert "| SyncDBN ZCA (gn_mx) | fp32 |" in (tmp_path / "sync.md").read_text()
