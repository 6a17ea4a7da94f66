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


def _cols(x, G):
    """x (N, C, *spatial) as float64 (G, D, N * S) columns."""
    N, C = x.shape[:2]
    return x.astype(np.float64).reshape(N, G, C // G, -1).transpose(1, 2, 0, 3).reshape(
        G, C // G, -1)


def _local_stats(x, tot_other, G, dtype):
    """gn_dbn_local_cov(x, local_sums(x) + tot_other): the step of one device whose peers
    contributed tot_other; returns (tot, cov, mean) as numpy."""
    xs = mx.nd.array(x, dtype=dtype)
    tot = mx.nd.gn_dbn_local_sums(xs, num_groups=G) + mx.nd.array(tot_other, dtype="float64")
    cov, mean = mx.nd.gn_dbn_local_cov(xs, tot, num_groups=G)
    return tot.asnumpy(), cov.asnumpy(), mean.asnumpy()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 6), (2, 6, 5), (2, 4, 3, 2), (1, 8, 2, 3, 2)],
                         ids=lambda s: f"{len(s) - 2}d")
def test_local_statistics_match_float64(shape, dtype):
    """gn_dbn_local_sums / gn_dbn_local_cov with a peer's sums added: the float64 global mean and
    this device's share of the covariance (its columns about the global mean, over the global
    count), for every dtype and 0-3 spatial dims; G = 1 and G = C (D = 1) included."""
    rng = np.random.RandomState(7)
    x = (rng.randn(*shape) * 2 + 1).astype(dtype)
    for G in (1, 2, shape[1]):
        peer = rng.randn(*((4,) + shape[1:]))
        pc, xc = _cols(peer, G), _cols(x, G)
        tot_peer = np.concatenate([pc.sum(axis=2), np.full((G, 1), float(pc.shape[2]))], axis=1)
        tot, cov, mean = _local_stats(x, tot_peer, G, dtype)
        m = xc.shape[2] + pc.shape[2]
        mu = (xc.sum(axis=2) + pc.sum(axis=2)) / m
        want_cov = np.einsum("gik,gjk->gij", xc - mu[..., None], xc - mu[..., None]) / m
        np.testing.assert_allclose(tot[:, -1], m)
        np.testing.assert_allclose(mean, mu.reshape(-1), rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(cov, want_cov, rtol=1e-12, atol=1e-14)


def test_local_statistics_gradients_match_central_differences():
    """d data through gn_dbn_local_sums -> (+ a peer's sums) -> gn_dbn_local_cov, and d tot of
    gn_dbn_local_cov (the count included) on its own, against float64 central differences of
    sum(cov * R) + sum(mean * r)."""
    rng = np.random.RandomState(8)
    shape, G = (3, 4, 2), 2
    x, R, r = rng.randn(*shape), rng.randn(G, 2, 2), rng.randn(4)
    tot_peer = np.concatenate([rng.randn(G, 2), np.full((G, 1), 5.0)], axis=1)

    def f(xv, tv=None):
        xs = mx.nd.array(xv, dtype="float64")
        tot = (mx.nd.gn_dbn_local_sums(xs, num_groups=G) + mx.nd.array(tot_peer, dtype="float64")
               if tv is None else mx.nd.array(tv, dtype="float64"))
        cov, mean = mx.nd.gn_dbn_local_cov(xs, tot, num_groups=G)
        return float((cov.asnumpy() * R).sum() + (mean.asnumpy() * r).sum())

    def fd(fun, v, h=1e-6):
        out = np.zeros_like(v)
        for idx in np.ndindex(*v.shape):
            p, m = v.copy(), v.copy()
            p[idx] += h
            m[idx] -= h
            out[idx] = (fun(p) - fun(m)) / (2 * h)
        return out
    xs = mx.nd.array(x, dtype="float64")
    xs.attach_grad()
    tot_fixed = mx.nd.gn_dbn_local_sums(xs, num_groups=G) + mx.nd.array(tot_peer, dtype="float64")
    tot_fixed.attach_grad()
    with autograd.record():
        tot = mx.nd.gn_dbn_local_sums(xs, num_groups=G) + mx.nd.array(tot_peer, dtype="float64")
        cov, mean = mx.nd.gn_dbn_local_cov(xs, tot, num_groups=G)
        cov2, mean2 = mx.nd.gn_dbn_local_cov(xs.detach(), tot_fixed, num_groups=G)
        loss = sum(mx.nd.sum(c * mx.nd.array(R, dtype="float64"))
                   + mx.nd.sum(m_ * mx.nd.array(r, dtype="float64"))
                   for c, m_ in ((cov, mean), (cov2, mean2)))
    loss.backward()
    np.testing.assert_allclose(xs.grad.asnumpy(), fd(f, x), rtol=1e-6, atol=1e-8)
    tv = tot_fixed.asnumpy()
    np.testing.assert_allclose(tot_fixed.grad.asnumpy(), fd(lambda t: f(x, t), tv), rtol=1e-6,
                               atol=1e-8)


_PATHS = """
import json, sys
import numpy as np, mxnet as mx, gn_mx
rng = np.random.RandomState(9)
res = []
# D = 20 / 14: 6 x 8 tiles with row and column tails; 300 columns: two 256-column blocks of the
# outer products; 2 * 64 * 12 * 12 > 65536: the groups in parallel
for shape, G in (((3, 40, 10, 10), 2), ((2, 56, 12, 12), 4)):
    for dt in ("float16", "float32", "float64"):
        x = (rng.randn(*shape) + 0.5).astype(dt)
        N, C = shape[:2]
        D = C // G
        cols = x.astype(np.float64).reshape(N, G, D, -1).transpose(1, 2, 0, 3).reshape(G, D, -1)
        xs = mx.nd.array(x, dtype=dt)
        tot = mx.nd.gn_dbn_local_sums(xs, num_groups=G)
        cov, mean = mx.nd.gn_dbn_local_cov(xs, tot, num_groups=G)
        mu = cols.mean(axis=2)
        want = np.einsum("gik,gjk->gij", cols - mu[..., None], cols - mu[..., None]) / cols.shape[2]
        e_cov = float(np.abs(cov.asnumpy() - want).max() / np.abs(want).max())
        W = rng.randn(G, D, D) / np.sqrt(D)
        sd = "float32" if dt == "float16" else dt
        gamma, beta = rng.rand(C).astype(sd) + 0.5, rng.randn(C).astype(sd)
        ins = [xs, mx.nd.array(gamma, dtype=sd), mx.nd.array(beta, dtype=sd), mean,
               mx.nd.array(W, dtype="float64")]
        for a in ins:
            a.attach_grad()
        dy = rng.randn(*shape).astype(dt).astype(np.float64)
        with mx.autograd.record():
            y = mx.nd.gn_dbn_apply(*ins, num_groups=G)
        y.backward(mx.nd.array(dy, dtype=dt))
        xc = cols - mu[..., None]
        yr = np.einsum("gij,gjk->gik", W, xc)
        a = dy.reshape(N, G, D, -1).transpose(1, 2, 0, 3).reshape(G, D, -1) * gamma.reshape(
            G, D, 1).astype(np.float64)
        back = lambda v: v.reshape(G, D, N, -1).transpose(2, 0, 1, 3).reshape(shape)
        want_y = back(yr) * gamma.reshape(1, C, 1, 1) + beta.reshape(1, C, 1, 1)
        want_dx = back(np.einsum("gji,gjk->gik", W, a))
        want_dW = np.einsum("gik,gjk->gij", a, xc)
        rel = lambda g, w: float(np.abs(g.astype(np.float64) - w).max() / np.abs(w).max())
        res.append([dt, e_cov, rel(y.asnumpy(), want_y), rel(ins[0].grad.asnumpy(), want_dx),
                    rel(ins[4].grad.asnumpy(), want_dW)])
print("RESULT " + json.dumps(res))
"""


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
def test_data_pass_paths_every_isa_level(level):
    """The statistics and apply passes (dbn_sync_data_cpu.cc) on each forced CPU level, shapes
    with tile tails, two column blocks and the groups in parallel: cov to float64 rounding, out /
    dx / dW within one rounding of the data dtype (float64 math inside)."""
    from test_cpu_isa import LEVELS
    if level not in LEVELS:
        pytest.skip(f"this CPU has no {level}")
    env = dict(os.environ, GNMX_CPU_ISA=level, OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-c", _PATHS], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:]
    import json
    for dt, e_cov, e_y, e_dx, e_dw in json.loads(res):
        u = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-14}[dt]
        assert e_cov <= 1e-13, (level, dt, e_cov)
        assert max(e_y, e_dx) <= u, (level, dt, e_y, e_dx)
        assert e_dw <= 1e-12, (level, dt, e_dw)


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
