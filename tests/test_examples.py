"""The examples run end to end. examples/train_small_batch.py --quick must stay under 2 minutes on
2 CPU cores (30-45 s with five normalizations); it needs scikit-learn for its data set (matplotlib
for the plot)."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_small_batch_quick(tmp_path):
    pytest.importorskip("sklearn", reason="train_small_batch.py needs scikit-learn (digits data)")
    import gn_mx
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_small_batch.py"), "--quick",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    with open(tmp_path / "small_batch_quick.json") as f:
        report = json.load(f)
    results = report["results"]
    norms = ["batchnorm", "groupnorm_mxnet", "groupnorm_gn_mx"]
    if hasattr(gn_mx, "DecorrelatedBatchNorm"):
        norms += ["dbn_gn_mx", "dbn_iternorm_gn_mx"]
    got = {(r["norm"], r["precision"], r["batch_size"]) for r in results}
    want = {(n, p, b) for n in norms for p in ("fp32", "amp") for b in (2, 4, 8, 32)}
    assert got == want
    for r in results:
        assert not r["diverged"], r
        assert 0.0 <= r["val_acc"] <= 1.0 and math.isfinite(r["final_loss"]), r
        assert r["steps"] > 0 and r["step_ms"] > 0, r
        assert math.isclose(r["step_ms"], 1000 * r["train_time_s"] / r["steps"], rel_tol=0.05,
                            abs_tol=0.05), r
    # it learns (chance is 10%): the best run of each normalization is well above chance
    for n in norms:
        assert max(r["val_acc"] for r in results if r["norm"] == n) > 0.4, (n, results)

    table = (tmp_path / "small_batch_quick.md").read_text()
    assert "| GroupNorm (gn_mx) | AMP fp16 |" in table and "bs=2" in table
    assert "| GroupNorm (gn_mx) | AMP fp16 |" in proc.stdout
    # two tables (accuracy, then ms per step), each with one row per (normalization, precision)
    acc_part, _, time_part = table.partition("Time per training step in ms")
    assert time_part, table
    for part in (acc_part, time_part):
        rows = [ln for ln in part.splitlines() if ln.startswith("| ") and "normalization" not in ln]
        assert len(rows) == 2 * len(norms), part
    if "dbn_iternorm_gn_mx" in norms:  # the bs=32 cell of IterNorm's fp32 step-time row
        head = "| DBN IterNorm (gn_mx) | fp32 |"
        row = next(ln for ln in time_part.splitlines() if ln.startswith(head))
        r = next(r for r in results if (r["norm"], r["precision"], r["batch_size"])
                 == ("dbn_iternorm_gn_mx", "fp32", 32))
        want_ms = f"{1000 * r['train_time_s'] / r['steps']:.1f}"
        assert row.split("|")[-2].strip() == want_ms, (row, r)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = tmp_path / "small_batch_quick.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quickstart_demo():
    """The README's demo command runs this: train a step, export, reload in a fresh process."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "-> OK" in proc.stdout and "training step 2" in proc.stdout


def test_train_small_batch_ws_seeds(tmp_path):
    """The GroupNorm + WS configuration and several training seeds: one result per seed, table
    cells 'mean% (min-max)' (examples/results/small_batch_ws.* are written this way)."""
    pytest.importorskip("sklearn", reason="train_small_batch.py needs scikit-learn (digits data)")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_small_batch.py"), "--quick",
         "--epochs", "1", "--norms", "groupnorm_ws_gn_mx", "--batch-sizes", "32",
         "--precisions", "fp32", "--seeds", "0", "1", "--name", "ws", "--out", str(tmp_path),
         "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads((tmp_path / "ws.json").read_text())["results"]
    assert [(r["norm"], r["seed"]) for r in results] == [("groupnorm_ws_gn_mx", 0), ("groupnorm_ws_gn_mx", 1)]
    acc = [100 * r["val_acc"] for r in results]
    row = next(ln for ln in (tmp_path / "ws.md").read_text().splitlines()
               if ln.startswith("| GroupNorm + WS (gn_mx) | fp32 |"))
    assert f"{sum(acc) / 2:.1f}% ({min(acc):.1f}-{max(acc):.1f})" in row, (row, acc)
