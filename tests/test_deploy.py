"""Deployment through MXNet's C predict API (issue 9, items 2 and 4).

examples/deploy_c/predict.c is built here with the system C compiler against the installed
wheel's headers and libmxnet.so; it calls MXLoadLib(gn_mx.library_path()) and runs a model that
examples/deploy_c/export_model.py trained for a few steps (GroupNorm + DecorrelatedBatchNorm) and
exported. Its output must match MXNet's Python output, and the exported parameters must be the
running statistics of the last training step.
"""
import importlib.util
import os
import shutil
import subprocess

import numpy as np
import mxnet as mx
import pytest

import gn_mx
from conftest import ROOT

MX_ROOT = os.path.dirname(os.path.abspath(mx.__file__))
EXAMPLE = os.path.join(ROOT, "examples", "deploy_c")
TOL = 1e-5


def _load_example():
    spec = importlib.util.spec_from_file_location("gnmx_export_model",
                                                  os.path.join(EXAMPLE, "export_model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    if not os.path.exists(os.path.join(MX_ROOT, "include", "mxnet", "c_predict_api.h")):
        pytest.skip("the installed mxnet wheel ships no include/mxnet/c_predict_api.h")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc/gcc) to build examples/deploy_c/predict.c")
    exe = str(tmp_path_factory.mktemp("deploy_c") / "predict")
    # the README's command (examples/deploy_c/build.sh does the same)
    cmd = [cc, "-std=c99", "-O2", "-Wall", "-Werror", os.path.join(EXAMPLE, "predict.c"),
           f"-I{MX_ROOT}/include", f"-L{MX_ROOT}", "-lmxnet", f"-Wl,-rpath,{MX_ROOT}", "-o", exe]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("deploy_model")
    return _load_example().train_and_export(str(d / "model"), batch=4, steps=3)


def run_predictor(exe, model, data, tmp_path):
    inp = tmp_path / f"input_{data.shape[0]}.f32"
    data.astype(np.float32).tofile(inp)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([exe, gn_mx.library_path(), model["symbol"], model["params"], str(inp)]
                       + [str(d) for d in data.shape], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("output shape:"), p.stdout[:500]
    shape = tuple(int(t) for t in lines[0].split(":")[1].split())
    values = np.array([float(t) for line in lines[1:] for t in line.split()], dtype=np.float32)
    return values.reshape(shape)


def test_c_predictor_matches_python(predictor, exported, tmp_path):
    net = exported["net"]
    ops = open(exported["symbol"]).read()
    for op in ("gn_group_norm", "gn_dbn_inference"):
        assert f'"op": "{op}"' in ops, op
    assert '"op": "gn_dbn"' not in ops  # the inference graph
    assert '"affine": "True"' in ops  # DBN's affine fused into gn_dbn_inference
    diffs = []
    for data in (exported["input"], np.random.RandomState(7).randn(1, 3, 8, 8)):
        want = net(mx.nd.array(data)).asnumpy()
        got = run_predictor(predictor, exported, data, tmp_path)
        assert got.shape == want.shape
        diffs.append(float(np.abs(got - want).max()))
    print("C predictor vs Python, max abs diff per batch:", diffs)
    assert max(diffs) <= TOL, diffs
    # the Python output of the example's own batch (what export_model.py writes to disk)
    assert np.abs(exported["output"] - net(mx.nd.array(exported["input"])).asnumpy()).max() == 0


def test_exported_dbn_stats_are_the_last_training_steps(exported):
    saved = mx.nd.load(exported["params"])
    names = sorted(k for k in saved if k.startswith("aux:"))
    means = [k for k in names if k.endswith("running_mean")]
    projs = [k for k in names if k.endswith("running_projection")]
    assert len(means) == len(projs) == 1, names
    (m_before, p_before), = exported["stats_before_last_step"]
    (m_after, p_after), = exported["stats_after_last_step"]
    m_saved, p_saved = saved[means[0]].asnumpy(), saved[projs[0]].asnumpy()
    np.testing.assert_array_equal(m_saved, m_after)
    np.testing.assert_array_equal(p_saved, p_after)
    # the last step did move them (so a stale copy would be caught), and away from the init
    assert np.abs(m_after - m_before).max() > 1e-3 and np.abs(p_after - p_before).max() > 1e-3
    assert np.abs(p_after - np.eye(p_after.shape[-1])).max() > 1e-2


def test_c_predictor_reports_a_bad_model(predictor, exported, tmp_path):
    bad = tmp_path / "bad-symbol.json"
    bad.write_text(open(exported["symbol"]).read().replace('"num_groups": "4"', '"num_groups": "3"'))
    data = exported["input"]
    inp = tmp_path / "in.f32"
    data.tofile(inp)
    p = subprocess.run([predictor, gn_mx.library_path(), str(bad), exported["params"], str(inp)]
                       + [str(d) for d in data.shape], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "MXPredCreate failed" in p.stderr and "gn_group_norm" in p.stderr, p.stderr[-2000:]
