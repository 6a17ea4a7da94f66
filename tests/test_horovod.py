"""Horovod: sync_running_stats over Horovod's allreduce; errors for runs it cannot synchronize.

The end-to-end test runs examples/horovod_train.py under `horovodrun -np 2 -H localhost:2 --gloo` on
the loopback interface (rank 0 imports horovod.mxnet first, rank 1 gn_mx first), bounded by a
timeout, with every process it started stopped at the end. It needs Horovod built with MXNet
(`GNMX_HOROVOD=1 bash dev.sh test`, which CI does); without it, it is skipped with the reason,
unless GNMX_HOROVOD=1 says Horovod was installed on purpose, then it fails.
The other tests need no Horovod: they hand sync_running_stats fake Horovod objects and fake
multi-worker kvstores (Horovod is recognised by module name; nothing may import it).
"""
import importlib.util
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from gn_mx import parallel
from conftest import ROOT, run_python

_spec = importlib.util.spec_from_file_location(
    "horovod_train", os.path.join(ROOT, "examples", "horovod_train.py"))
horovod_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(horovod_train)


def _dbn_net(ctx):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3, in_channels=3),
            gn_mx.DecorrelatedBatchNorm(num_groups=2, in_channels=4))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    return net


def _trained(ctx, seed=0):
    net = _dbn_net(ctx)
    rng = np.random.RandomState(seed)
    with autograd.record():
        for i, c in enumerate(ctx):
            net(mx.nd.array(rng.randn(6, 3, 5, 5) + i, ctx=c))
    return net


def _stats(net):
    dbn = parallel.dbn_layers(net)[0]
    return [[d.asnumpy() for d in p.list_data()]
            for p in (dbn.running_mean, dbn.running_projection)]


# --- Horovod recognised without importing it: a fake horovod.mxnet --------------------------------

class _FakeHvd(types.ModuleType):
    """A stand-in for horovod.mxnet in a run of `size` ranks: grouped_allreduce_ adds what the
    other ranks are given to hold (`others`, one list per call) and records every call."""

    def __init__(self, size, others):
        super().__init__("horovod.mxnet")
        self._size, self._others, self.calls = size, others, []

    def size(self):
        return self._size

    def is_initialized(self):
        return True

    def grouped_allreduce_(self, tensors, average=None, name=None, **kw):
        self.calls.append((name, [t.shape for t in tensors], [t.dtype for t in tensors], average))
        for t, o in zip(tensors, self._others):
            t += mx.nd.array(o, dtype=t.dtype, ctx=t.context)
        return tensors


class _FakeDistributedTrainer(gluon.Trainer):
    pass


_FakeDistributedTrainer.__module__ = "horovod.mxnet"  # what hvd.DistributedTrainer's class says


class _FakeDistributedOptimizer(mx.optimizer.SGD):
    pass


_FakeDistributedOptimizer.__module__ = "horovod.mxnet"


def _horovod_in(monkeypatch, hvd):
    monkeypatch.setitem(sys.modules, "horovod.mxnet", hvd)


@pytest.mark.parametrize("how", ["module", "trainer", "optimizer"])
def test_horovod_path_averages_contexts_then_ranks(monkeypatch, how):
    ctx = [mx.cpu(0), mx.cpu(1)]
    net = _trained(ctx)
    stats = _stats(net)
    assert not np.allclose(stats[0][0], stats[0][1])  # each context saw its own data
    local = [(s[0].astype(np.float64) + s[1]) / 2 for s in stats]
    # the other rank's local averages (what its allreduce contributes)
    other = [np.random.RandomState(5).randn(*m.shape) for m in local]
    hvd = _FakeHvd(2, other)
    _horovod_in(monkeypatch, hvd)
    params = net.collect_params()
    if how == "module":
        arg = hvd
    elif how == "trainer":
        arg = _FakeDistributedTrainer(params, "sgd", kvstore=None)
    else:
        arg = gluon.Trainer(params, _FakeDistributedOptimizer(), kvstore=None)
    assert gn_mx.sync_running_stats(net, arg) == 1
    # one grouped call of all statistics, summed (average=False) and divided here by the size
    assert hvd.calls == [("gn_mx.sync_running_stats.float32", [(4,), (2, 2, 2)],
                          [np.float32, np.float32], False)]
    for per_ctx, m, o in zip(_stats(net), local, other):
        for a in per_ctx:
            np.testing.assert_allclose(a, (m + o) / 2, rtol=1e-6, atol=1e-7)


def test_horovod_path_float64_statistics(monkeypatch):
    net = _dbn_net([mx.cpu(0)])
    net.cast("float64")
    with autograd.record():
        net(mx.nd.array(np.random.RandomState(1).randn(6, 3, 5, 5), dtype="float64"))
    local = [s[0] for s in _stats(net)]
    assert local[0].dtype == np.float64
    other = [np.random.RandomState(2).randn(*m.shape) for m in local]
    hvd = _FakeHvd(2, other)
    _horovod_in(monkeypatch, hvd)
    assert gn_mx.sync_running_stats(net, hvd) == 1
    assert [c[0] for c in hvd.calls] == ["gn_mx.sync_running_stats.float64"]
    for (a,), m, o in zip(_stats(net), local, other):
        np.testing.assert_allclose(a, (m + o) / 2, rtol=1e-13, atol=1e-15)


def test_horovod_single_rank_is_local_average(monkeypatch):
    hvd = _FakeHvd(1, [])
    _horovod_in(monkeypatch, hvd)
    net = _trained([mx.cpu(0), mx.cpu(1)])
    local = [(s[0].astype(np.float64) + s[1]) / 2 for s in _stats(net)]
    assert gn_mx.sync_running_stats(net, hvd) == 1
    assert hvd.calls == []
    for per_ctx, m in zip(_stats(net), local):
        for a in per_ctx:
            np.testing.assert_allclose(a, m, rtol=1e-6, atol=1e-7)


# --- multi-worker runs it cannot synchronize: a clear error, nothing changed ---------------------

class _FakeKV:
    """A kvstore of a multi-worker run of a type sync_running_stats has no way to reduce over."""

    def __init__(self, kv_type, workers):
        self.type, self.num_workers, self.rank = kv_type, workers, 0


@pytest.mark.parametrize("kv_type", ["byteps", "dist_async", "horovod"])
def test_cannot_synchronize_raises(kv_type):
    net = _trained([mx.cpu(0), mx.cpu(1)])
    before = _stats(net)
    with pytest.raises(ValueError, match=f"cannot average .* 2 workers of a '{kv_type}' kvstore"):
        gn_mx.sync_running_stats(net, _FakeKV(kv_type, 2))
    # a Trainer holding such a kvstore (e.g. a third-party distributed trainer)
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=None, update_on_kvstore=False)
    trainer._init_kvstore()
    trainer._kvstore = _FakeKV(kv_type, 4)
    with pytest.raises(ValueError, match="4 workers"):
        gn_mx.sync_running_stats(net, trainer)
    for b, a in zip(before, _stats(net)):  # not even the local average was written
        for x, y in zip(b, a):
            np.testing.assert_array_equal(x, y)
    # one worker of the same kind: nothing to reduce across, the contexts are averaged
    assert gn_mx.sync_running_stats(net, _FakeKV(kv_type, 1)) == 1


def test_plain_trainer_in_horovod_run_raises(monkeypatch):
    net = _trained([mx.cpu(0)])
    _horovod_in(monkeypatch, _FakeHvd(2, []))
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=None)
    with pytest.raises(ValueError, match="Trainer without kvstore in a Horovod run of 2"):
        gn_mx.sync_running_stats(net, trainer)
    assert gn_mx.sync_running_stats(net) == 1  # None: this process only, as documented


def test_horovod_trainer_without_horovod_module_or_init(monkeypatch):
    net = _trained([mx.cpu(0)])
    monkeypatch.delitem(sys.modules, "horovod.mxnet", raising=False)
    trainer = _FakeDistributedTrainer(net.collect_params(), "sgd", kvstore=None)
    with pytest.raises(ValueError, match="is not Horovod's MXNet module"):
        gn_mx.sync_running_stats(net, trainer)
    hvd = _FakeHvd(2, [])
    hvd.is_initialized = lambda: False
    with pytest.raises(ValueError, match=r"not initialized; call hvd.init\(\)"):
        gn_mx.sync_running_stats(net, hvd)
    with pytest.raises(TypeError, match="module 'json' is not Horovod's"):
        gn_mx.sync_running_stats(net, json)
    with pytest.raises(TypeError, match="kvstore must be None, a KVStore, a gluon Trainer"):
        gn_mx.sync_running_stats(net, "dist_sync")


def test_nothing_imports_horovod():
    """Recognising Horovod objects goes by module name: a process that never imports Horovod runs
    every path of sync_running_stats without loading it (also when Horovod is installed)."""
    proc = run_python("""
        import sys
        import mxnet as mx, gn_mx
        from mxnet import gluon
        net = gluon.nn.HybridSequential()
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=2, in_channels=4))
        net.initialize()
        gn_mx.sync_running_stats(net)
        gn_mx.sync_running_stats(net, mx.kv.create('local'))
        gn_mx.sync_running_stats(net, gluon.Trainer(net.collect_params(), 'sgd'))
        gn_mx.sync_running_stats(net, gluon.Trainer(net.collect_params(), 'sgd', kvstore=None))
        assert not any(m.split('.')[0] == 'horovod' for m in sys.modules), sorted(sys.modules)
        print('NO-HOROVOD-OK')
    """, timeout=120)
    assert proc.returncode == 0 and "NO-HOROVOD-OK" in proc.stdout, proc.stderr[-3000:]


# --- the real thing: horovodrun with 2 ranks over loopback ---------------------------------------

def _horovod_available():
    """None if horovod.mxnet imports (checked in a child: importing it here would load its library
    into the test process), else the reason."""
    if horovod_train.horovodrun_path() is None:
        return "horovodrun not found (Horovod not installed; GNMX_HOROVOD=1 bash dev.sh builds it)"
    proc = run_python("import mxnet, horovod.mxnet as hvd; print(hvd.gloo_built())", timeout=120)
    if proc.returncode != 0:
        return "horovod.mxnet does not import: " + proc.stderr.strip().splitlines()[-1][:300]
    if not proc.stdout.strip().endswith("True"):
        return "Horovod was built without Gloo"
    return None


@pytest.fixture(scope="module")
def horovod():
    reason = _horovod_available()
    if reason is not None:
        if os.environ.get("GNMX_HOROVOD") == "1":
            pytest.fail(f"GNMX_HOROVOD=1 but {reason}")
        pytest.skip(reason)


def test_horovodrun_two_ranks_train_sync_export(horovod, tmp_path):
    out = str(tmp_path)
    marker = f"test-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.monotonic()
    rc, text = horovod_train.launch_local(2, out, steps=3, batch=8, import_order="by-rank",
                                          timeout=150, marker=marker)
    elapsed = time.monotonic() - t0
    assert horovod_train._pids_with(marker) == []  # nothing of the run is left
    assert rc == 0, text[-6000:]
    # both import orders ran, each on its rank
    assert "rank 0 done (horovod-first)" in text, text[-3000:]
    assert "rank 1 done (gn_mx-first)" in text, text[-3000:]
    w = [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(2)]
    assert int(w[0]["size"]) == int(w[1]["size"]) == 2
    params = sorted(k for k in w[0] if k.startswith("param_"))
    assert params and params == sorted(k for k in w[1] if k.startswith("param_"))
    for k in params:
        # rank 0's initial weights broadcast (the ranks were seeded differently), the same averaged
        # gradient applied on both ranks, the statistics averaged: identical
        np.testing.assert_array_equal(w[0][k], w[1][k], err_msg=k)
    stat_keys = sorted(k[len("before_"):] for k in w[0] if k.startswith("before_"))
    assert stat_keys == ["0_running_mean", "0_running_projection"]
    diffs = {}
    for s in stat_keys:
        b0, b1 = w[0]["before_" + s], w[1]["before_" + s]
        assert np.isfinite(b0).all() and np.isfinite(b1).all()
        diffs[s] = float(np.abs(b0.astype(np.float64) - b1).max())
        assert diffs[s] > 1e-3, s  # each rank saw its own data
        np.testing.assert_array_equal(w[0]["after_" + s], w[1]["after_" + s])
        np.testing.assert_allclose(w[0]["after_" + s], (b0.astype(np.float64) + b1) / 2,
                                   rtol=1e-6, atol=1e-7)
    # training happened: every trainable weight moved after the first step
    trainable = [k for k in params if not any(np.array_equal(w[0][k], w[0]["after_" + s])
                                              for s in stat_keys)]
    assert len(trainable) == len(params) - 2
    for k in trainable:  # identical on both ranks already after the first step, and it moved
        np.testing.assert_array_equal(w[0]["step0_" + k[6:]], w[1]["step0_" + k[6:]], err_msg=k)
        assert not np.array_equal(w[0][k], w[0]["step0_" + k[6:]]), k
    # the probe output is the same on both ranks (same weights, same statistics)
    np.testing.assert_array_equal(w[0]["probe_out"], w[1]["probe_out"])
    # rank 0's export reloads in a fresh process (no Horovod there) with the same output
    sym = json.load(open(os.path.join(out, "model-symbol.json")))
    assert "gn_dbn_inference" in [n["op"] for n in sym["nodes"]]
    proc = run_python(f"""
        import numpy as np, mxnet as mx, gn_mx
        out = {out!r}
        blk = mx.gluon.SymbolBlock.imports(out + "/model-symbol.json", ["data"],
                                           out + "/model-0000.params")
        w = np.load(out + "/rank0.npz")
        got = blk(mx.nd.array(w["probe"])).asnumpy()
        np.testing.assert_allclose(got, w["probe_out"], rtol=1e-5, atol=1e-6)
        print("RELOAD-OK", np.abs(got - w["probe_out"]).max())
    """, timeout=120)
    assert proc.returncode == 0 and "RELOAD-OK" in proc.stdout, proc.stderr[-3000:]
    print(f"horovodrun 2 ranks: {elapsed:.1f} s; cross-rank |DBN stat difference| before sync "
          f"{diffs}, after 0")
