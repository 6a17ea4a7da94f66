"""benchmarks/bench_inference.py: runs (tiny repetitions), prints every path's row, checks that the
paths compute the same function, writes nothing without --out, and writes NAME.{md,json} with it."""
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_inference.py")


def _git_status():
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True).stdout


def _load():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_inference", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runs_and_writes_nothing_without_out(tmp_path):
    before = _git_status()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    p = subprocess.run([sys.executable, SCRIPT, "--batches", "1", "--rounds", "1",
                        "--min-sample-ms", "1", "--max-cell-s", "1"], cwd=str(tmp_path), env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    out = p.stdout
    mod = _load()
    rows = mod.MX_ROWS + (mod.ORT_ROWS if importlib.util.find_spec("onnxruntime") else [])
    for row in rows:
        line = next((l for l in out.splitlines() if l.startswith("| `%s`" % row)), None)
        assert line is not None, out
        float(line.split("|")[2])  # a time, not an error
    # thread count and allocator regime are stated
    assert "OMP_NUM_THREADS=2 " in out and "intra_op_num_threads=2" in out, out
    assert "MALLOC_ARENA_MAX=1" in out, out
    # every path computes the same function as its reference net
    diffs = out.split("Largest absolute output difference")[1].split(":", 1)[1].split(".\n")[0]
    for item in diffs.split(", "):
        name, value = item.split()
        assert float(value) < 1e-4, item
    assert "Warning" not in out and "W onnxruntime" not in out, out
    assert os.listdir(str(tmp_path)) == []
    assert _git_status() == before


def test_out_names_a_result_stem(tmp_path, monkeypatch):
    mod = _load()
    run = {"threads": 2, "cpus": 2, "loadavg_start": [1.0], "loadavg_end": [1.0], "mxnet": "1.9.1",
           "onnxruntime": "1.32.0", "errors": {}, "max_abs_diff": {"ort_gn/1": 1e-7},
           "layers": {"mx_gn": [6, 5]},
           "ms": {"1": {"mx_gn": 3.0, "mx_gn_relu": 2.9, "mx_affine": 2.8, "mx_bn_folded": 1.3,
                        "mx_none": 1.2, "mx_none_mkldnn": 1.1, "ort_gn": 1.1, "ort_bn": 0.9}}}
    monkeypatch.setattr(mod, "BATCHES", [1])
    text = mod.report({"kept/2t": run}, None)
    assert "fastest `ort_bn` (0.90 ms)" in text
    assert "of the GroupNorm paths, `ort_gn` is fastest (1.10 ms)" in text
    assert "runs 2.7x faster in onnxruntime" in text  # 3.0 / 1.1
    assert "costs 0.32 ms per layer" in text  # (2.8 - 1.2) / 5
    assert "Not reliable" not in text
    assert "Not reliable" in mod.report({"kept/2t": dict(run, loadavg_end=[3.0])}, None)
    args = types.SimpleNamespace(rounds=3, note="load 1")
    mod.write(mod.result_stem(str(tmp_path), "inference_cpu"), {"kept/2t": run}, text, args)
    assert sorted(os.listdir(str(tmp_path))) == ["inference_cpu.json", "inference_cpu.md"]
    md = (tmp_path / "inference_cpu.md").read_text()
    assert "load 1" in md and "MKLDNN" in md and text in md
    assert json.loads((tmp_path / "inference_cpu.json").read_text())["runs"]["kept/2t"] == run
    # a bare name goes under benchmarks/results, another path is taken as given
    assert mod.result_stem("inference_cpu", "x") == os.path.join(ROOT, "benchmarks", "results",
                                                                 "inference_cpu")
    assert mod.result_stem(str(tmp_path / "sub" / "r"), "x") == str(tmp_path / "sub" / "r")
