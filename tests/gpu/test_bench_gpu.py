"""benchmarks/gpu/bench_gpu.py checked without a GPU.

- --smoke (tiny shapes of every class, one run each) through the CUDA emulator with torch CPU
  (GNMX_HARNESS_EMU=1; on a GPU machine it runs on the GPU): the table has every shape class and
  pass, sane columns, and the bounds of _bounds.py. Skipped without torch, like the other modules.
- --estimate and --help need neither torch nor a device: they run everywhere (the CPU CI too).
- run_all.sh's time limits add up to less than 5 minutes, and it copies its results to $OUT.

    GNMX_HARNESS_EMU=1 python -m pytest --confcutdir=tests/gpu tests/gpu/test_bench_gpu.py -q
"""
import json
import math
import os
import re
import subprocess
import sys
import time
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_BENCH = os.path.join(ROOT, "benchmarks", "gpu")
BENCH = os.path.join(GPU_BENCH, "bench_gpu.py")
sys.path.insert(0, GPU_BENCH)
import bench_gpu  # noqa: E402  (imports neither torch nor the harness)
import _bounds as bounds  # noqa: E402


def _run(args, cwd=ROOT, timeout=600):
    r = subprocess.run([sys.executable, BENCH] + args, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def _table_rows(md):
    """The data rows of the markdown table(s), split into cells."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| class") and "---" not in line]


# ---- without torch


def test_full_cases_cover_the_issue():
    cases = bench_gpu.full_cases()
    classes = {c.cls for c in cases}
    assert classes == set(bench_gpu.CLASSES)
    gn = {(c.shape, c.G) for c in cases if c.cls == "tiny_groups"}
    assert {((4096, 512), 128), ((4096, 512), 512), ((64, 1024), 32)} <= gn
    assert {c.dtype for c in cases if c.cls == "large_n_s1"} == {"float16", "float32"}
    assert all(len(c.shape) == 2 and c.shape[0] >= 65536 for c in cases if c.cls == "large_n_s1")
    assert {c.shape for c in cases if c.cls == "affine"} == {(4096, 512), (8, 256, 56, 56)}
    mis = [c for c in cases if c.cls == "misaligned"]
    assert all(c.dtype == "float16" for c in mis)
    assert any(c.offset for c in mis)
    assert any(bounds.numel(c.shape[2:]) * c.D % 8 for c in mis)  # a group length of odd bytes/16
    dbn = [c for c in cases if c.cls == "dbn"]
    assert {c.D for c in dbn} == {16, 64, 128, 256, 512}
    assert {1, 8, 32} <= {c.G for c in dbn}
    for D in {c.D for c in dbn}:  # small and large m at every D
        ms = {c.m for c in dbn if c.D == D}
        assert min(ms) <= 512 and max(ms) >= 32768, (D, ms)
    assert all(c.shape[1] <= bench_gpu.DBN_MAX_C for c in dbn)


def test_bounds_by_hand():
    # GroupNorm fwd, (4096, 512) fp16, G = 128: x + y (2 B each), mean + rstd (fp32), gamma + beta
    b = bounds.gn_bound((4096, 512), "float16", 128, "fwd")
    assert b["bytes"] == 2 * 4096 * 512 * 2 + 2 * 4096 * 128 * 4 + 2 * 512 * 2
    bb = bounds.gn_bound((4096, 512), "float16", 128, "bwd")
    assert bb["bytes"] == 3 * 4096 * 512 * 2 + 2 * 4096 * 128 * 4 + 3 * 512 * 2
    assert bounds.gn_bound((4096, 512), "float16", 128, "fwd+bwd")["bytes"] == b["bytes"] + bb["bytes"]
    a = bounds.affine_bound((8, 256, 56, 56), "float32", "bwd")
    assert a["bytes"] == 3 * 8 * 256 * 56 * 56 * 4 + 3 * 256 * 4
    # DBN, G = 2 groups of D = 4, m = N*S = 3*5 = 15
    d = bounds.dbn_bound((3, 8, 5), "float32", 2, "fwd")
    assert d["bytes"] == 2 * 3 * 8 * 5 * 4
    assert d["flops"] == 2 * (4 * 15 + 4 * 16 * 15 + 11 * 64)
    assert bounds.dbn_bound((3, 8, 5), "float32", 2, "inference")["flops"] == 2 * 2 * 16 * 15
    assert bounds.lower_bound_s({"bytes": 4.8e12, "flops": 0}) == pytest.approx(1.0)
    assert bounds.lower_bound_s({"bytes": 0, "flops": 134e12}) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown pass"):
        bounds.gn_bound((2, 4), "float32", 2, "sideways")


def test_estimate_lists_every_row():
    out = _run(["--estimate"])
    rows = _table_rows(out)
    cases = bench_gpu.full_cases()
    assert len(rows) == sum(len(c.passes) for c in cases)
    assert {r[0] for r in rows} == set(bench_gpu.CLASSES)
    assert "132 SMs" in out and "4.8 TB/s" in out and "nothing was run" in out
    # (4096, 512) fp16 G=128 fwd: 12584960 B / 4.8 TB/s = 2.62 us
    row = next(r for r in rows if r[1] == "(4096, 512) G=128" and r[2] == "float16" and r[3] == "fwd")
    assert float(row[6]) == pytest.approx(2.62, abs=0.01)
    assert all(float(r[6]) > 0 for r in rows)


def test_help_only_prints_help(tmp_path):
    before = set(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
    out = _run(["--help"], cwd=str(tmp_path))
    assert "usage:" in out and "--smoke" in out and "--estimate" in out
    assert os.listdir(tmp_path) == []
    assert set(os.listdir(os.path.join(ROOT, "benchmarks", "results"))) == before


def test_run_all_limits_and_out():
    with open(os.path.join(GPU_BENCH, "run_all.sh")) as f:
        sh = f.read()
    lim = {k: int(v) for k, v in re.findall(r'^(T_BUILD|T_TESTS|T_BENCH|GRACE)=(?:"?\$\{\w+:-)?(\d+)',
                                              sh, re.M)}
    assert set(lim) == {"T_BUILD", "T_TESTS", "T_BENCH", "GRACE"}, lim
    assert lim["T_BUILD"] + lim["T_TESTS"] + lim["T_BENCH"] + 3 * lim["GRACE"] < 300, lim
    assert lim["T_BENCH"] > 30  # the benchmark's own budget is T_BENCH - 30
    assert "trap copy_out EXIT" in sh and 'cp "$RES/$f" "$OUT/"' in sh


def _bench(monkeypatch, budget_s=100.0, case_budget_s=0.2):
    """A non-smoke Bench on the CPU clock (no torch needed for its timing logic)."""
    monkeypatch.setattr(bench_gpu, "gnh", types.SimpleNamespace(DEVICE="cpu"))
    args = types.SimpleNamespace(smoke=False, budget_s=budget_s, case_budget_s=case_budget_s)
    return bench_gpu.Bench(args, cuda=False)


def test_measure_budgets(monkeypatch):
    b = _bench(monkeypatch)
    calls = []
    t = b.measure(lambda: calls.append(1), graph=False)
    assert 3 <= int(t.runs) <= 15 and t.note == "" and len(calls) == int(t.runs) + 2  # warm-up, probe
    calls.clear()
    t = b.measure(lambda: (calls.append(1), time.sleep(0.25)), graph=False)  # warm-up > 0.2 s
    assert (t.runs, len(calls)) == ("1", 1) and "warm-up took" in t.note and t.s >= 0.25
    calls.clear()
    t = b.measure(lambda: (calls.append(1), time.sleep(0.05)), graph=False)  # 3 runs > 0.1 s
    assert (t.runs, len(calls)) == ("1", 2) and "1 run after the warm-up" in t.note


def test_slow_dbn_is_predicted_and_skipped(monkeypatch):
    b = _bench(monkeypatch, budget_s=5.0)
    b.slow[("ours", "fwd", "")] = (128, 2.0)  # 2 s at D = 128 -> ~16 s at D = 256 > 5 s left

    def never():
        raise AssertionError("a pass predicted to outlast the budget was run")

    big = bench_gpu.Case("dbn", (512, 256), "float32", 1)
    t = b.timed(big, "fwd", "ours", never, graph=False)
    assert t.runs == "0" and "predicted" in t.note and math.isnan(t.s)
    small = bench_gpu.Case("dbn", (512, 64), "float32", 1)  # a smaller D is never predicted
    assert b.timed(small, "fwd", "ours", lambda: None, graph=False).runs != "0"
    other = bench_gpu.Case("dbn", (512, 256), "float32", 1, eig="cusolver")  # its own history
    assert b.timed(other, "fwd", "ours", lambda: None, graph=False).runs != "0"


def test_spent_budget_skips_cases(monkeypatch):
    b = _bench(monkeypatch, budget_s=0.0)
    peaks = {"copy_bw": 1e12, "fp32": 1e13, "fp64": 1e13}
    for c in (bench_gpu.Case("sd_unet", (2, 320, 8, 8), "float16", 32),
              bench_gpu.Case("dbn", (512, 64), "float32", 4)):
        rows = b.run_case(c, peaks)  # never builds the case's tensors (no torch here)
        assert [r["pass"] for r in rows] == list(c.passes)
        assert all("--budget-s" in r["note"] and r["ours_us"] is None for r in rows)
        assert all(r["bound_us"] > 0 and r["speedup"] is None for r in rows)
    md = bench_gpu.markdown({"device": "x", "mode": "full", "date": "d", "torch": "t", "cuda": None,
                             "driver": None, "nvcc": None, "python": "p", "copy_gbs": 1.0,
                             "fp32_tflops": 1.0, "fp64_tflops": 1.0, "partial": True}, rows)
    assert "PARTIAL" in md and "skipped" in md and "| - | - | - |" in md


# ---- with torch (and the emulator or a GPU)


def test_torch_dbn_references():
    """The torch side of the DBN rows computes what gn_mx does: whitened groups (covariance I),
    inference P (x - mean) per group."""
    torch = pytest.importorskip("torch")
    bench_gpu.torch = torch
    g = torch.Generator().manual_seed(0)
    mix = torch.eye(8, dtype=torch.float64) + 0.3 * torch.randn(8, 8, generator=g, dtype=torch.float64)
    x = torch.einsum("dc,nc...->nd...", mix, torch.randn(64, 8, 3, generator=g, dtype=torch.float64))
    Y = bench_gpu.to_groups(bench_gpu.torch_dbn(x, 2, eps=1e-12), 2)
    assert Y.shape == (2, 4, 64 * 3)
    cov = Y @ Y.transpose(1, 2) / Y.shape[-1]
    assert (cov - torch.eye(4, dtype=torch.float64)).abs().max() < 1e-9
    P = torch.randn(2, 4, 4, generator=g, dtype=torch.float64)
    rm = torch.randn(8, generator=g, dtype=torch.float64)
    ref = torch.einsum("gde,nges->ngds", P, (x - rm.view(1, 8, 1)).view(64, 2, 4, 3)).reshape(x.shape)
    assert (bench_gpu.torch_dbn_inference(x, rm, P, 2) - ref).abs().max() < 1e-12


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gnh
    if not gnh.available():
        pytest.skip("no CUDA device for the GPU harness (GNMX_HARNESS_EMU=1: CPU emulator)")
    gnh.load()  # the emulator build (cached by input hash) outside the smoke run's time
    out = tmp_path_factory.mktemp("bench")
    log = _run(["--smoke", "--out", str(out)])
    with open(out / "gpu_bench.json") as f:
        data = json.load(f)
    return {"dir": out, "log": log, "data": data, "md": (out / "gpu_bench.md").read_text()}


def test_smoke_writes_two_files(smoke):
    assert sorted(os.listdir(smoke["dir"])) == ["gpu_bench.json", "gpu_bench.md"]


def test_smoke_every_class_and_pass(smoke):
    rows = smoke["data"]["rows"]
    seen = {(r["cls"], r["pass"]) for r in rows}
    want = {(k, p) for k, ps in bench_gpu.PASSES.items() for p in ps}
    assert seen == want
    assert len(rows) == sum(len(c.passes) for c in bench_gpu.smoke_cases())
    assert any(r["offset"] for r in rows if r["cls"] == "misaligned")


def test_smoke_columns_are_sane(smoke):
    for r in smoke["data"]["rows"]:
        assert r["note"] == "", r  # nothing skipped, no error
        for k in ("ours_us", "torch_us", "bound_us", "ours_pct_copy"):
            assert r[k] is not None and math.isfinite(r[k]) and r[k] > 0, (k, r)
        assert r["speedup"] == pytest.approx(r["torch_us"] / r["ours_us"])
        case = bench_gpu.Case(r["cls"], tuple(r["shape"]), r["dtype"], r["G"], r["offset"])
        b = bounds.case_bound(case, r["pass"])
        assert (r["bytes"], r["flops"]) == (b["bytes"], b["flops"])
        dbn = r["cls"] == "dbn"
        for k in ("ours_pct_fp32", "ours_pct_fp64"):
            assert (r[k] is not None and r[k] > 0) if dbn else r[k] is None, (k, r)
        assert r["ours_runs"] == "1" and r["torch_runs"] == "1"  # --smoke: one repetition


def test_smoke_header_and_table(smoke):
    meta, md = smoke["data"]["meta"], smoke["md"]
    assert meta["mode"] == "smoke"
    assert meta["partial"] is False and "interrupted" not in meta  # finished: no PARTIAL line
    assert "PARTIAL" not in md and "INTERRUPTED" not in md
    for k in ("copy_gbs", "fp32_tflops", "fp64_tflops"):
        assert meta[k] > 0, meta
    for k in ("device", "torch", "date", "driver", "cuda"):
        assert k in meta
    first = md.splitlines()[0]
    assert first.startswith("# gn_mx GPU benchmark (") and meta["device"] in first
    for text in ("measured copy bandwidth", "matmul fp32", "fp64", "TF32 off", meta["torch"],
                 meta["date"], "| class | case | dtype | pass | ours us | torch us | torch/ours |"):
        assert text in md, text
    table = _table_rows(md)
    assert len(table) == len(smoke["data"]["rows"])
    assert {r[0] for r in table} == set(bench_gpu.CLASSES)
    assert all(len(r) == len(table[0]) for r in table)
