"""MXNet's distributed kvstore (dist_sync, ps-lite) on 127.0.0.1: scheduler + 1 server + 2 workers.

The workers run examples/dist_train.py (GroupNorm + DBN, a few SGD steps with different data per
worker); every process is stopped by the launcher, also on failure, and the whole run is bounded.
"""
import importlib.util
import json
import os

import numpy as np
import pytest

import mxnet as mx

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("dist_train",
                                               os.path.join(ROOT, "examples", "dist_train.py"))
dist_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dist_train)


def test_dist_sync_two_workers_identical_weights_and_exports(tmp_path):
    out = str(tmp_path)
    results = dist_train.launch_local(2, out, steps=3, batch=8, timeout=60)
    for rc, text in results:
        assert rc == 0, text[-4000:]
    w = [dict(np.load(os.path.join(out, f"worker{r}.npz"))) for r in range(2)]
    params = sorted(k for k in w[0] if k.startswith("param_"))
    assert params and params == sorted(k for k in w[1] if k.startswith("param_"))
    stat_keys = sorted(k[len("before_"):] for k in w[0] if k.startswith("before_"))
    assert len(stat_keys) == 2
    stats = [k for k in params
             if any(np.array_equal(w[0][k], w[0]["after_" + s]) for s in stat_keys)]
    assert len(stats) == 2  # the running statistics (compared below)
    trainable = [k for k in params if k not in stats]
    for k in params:
        # identical on both workers: rank 0's initial weights broadcast (the workers were seeded
        # differently), the same summed gradient applied by both; statistics averaged
        np.testing.assert_array_equal(w[0][k], w[1][k], err_msg=k)
    for s in stat_keys:
        b0, b1 = w[0]["before_" + s], w[1]["before_" + s]
        assert np.isfinite(b0).all() and np.isfinite(b1).all()
        assert not np.allclose(b0, b1)  # each worker saw its own data
        np.testing.assert_array_equal(w[0]["after_" + s], w[1]["after_" + s])
        np.testing.assert_allclose(w[0]["after_" + s], (b0.astype(np.float64) + b1) / 2,
                                   rtol=1e-6, atol=1e-7)
    # training happened: the weights moved after the first step (same on both workers)
    moved = [k for k in trainable if not np.array_equal(w[0][k], w[0]["step0_" + k[6:]])]
    assert moved == trainable
    for k in trainable:
        np.testing.assert_array_equal(w[0]["step0_" + k[6:]], w[1]["step0_" + k[6:]], err_msg=k)
    # both exports are the same model
    sym = [open(os.path.join(out, f"worker{r}-symbol.json")).read() for r in range(2)]
    assert sym[0] == sym[1]
    assert "gn_dbn_inference" in [n["op"] for n in json.loads(sym[0])["nodes"]]
    saved = [mx.nd.load(os.path.join(out, f"worker{r}-0000.params")) for r in range(2)]
    assert set(saved[0]) == set(saved[1]) and any(k.startswith("aux:") for k in saved[0])
    for k in saved[0]:
        np.testing.assert_array_equal(saved[0][k].asnumpy(), saved[1][k].asnumpy(), err_msg=k)
