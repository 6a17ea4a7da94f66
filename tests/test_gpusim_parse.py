"""benchmarks/gpusim/_gpusim_parse.py on a hand-written excerpt of GPGPU-Sim's timing-mode output:
per-kernel cycles, DRAM bytes from the CUMULATIVE counters (differences), blocks per SM, ratios."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks", "gpusim"))
import _gpusim_parse as parse  # noqa: E402

STATS_K = "_ZN5gn_mx12_GLOBAL__N_112stats_kernelIfEEvPKT_"
COPY_K = "_ZN12_GLOBAL__N_115sim_copy_kernelEP6float4PKS0_l"


def kernel(name, grid, cycles, reads, writes, cta=None, warps=(0, 0, 0)):
    """The lines of one kernel; reads, writes and warps are the CUMULATIVE counters after it."""
    lines = [f"GPGPU-Sim PTX: pushing kernel '{name}' to stream 0, gridDim= ({grid},1,1) "
             "blockDim = (256,1,1) "]
    if cta:
        lines.append(f"GPGPU-Sim uArch: CTA/core = {cta}, limited by: regs")
    lines += [f"kernel_name = {name} ", "kernel_launch_uid = 1 ", f"gpu_sim_cycle = {cycles}",
              "gpu_sim_insn = 123", "Stall:%d\tW0_Idle:%d\tW0_Scoreboard:%d\tW1:0" % warps,
              f"total dram reads = {reads}", "bank skew: 2/1 = 2.00",
              f"total dram writes = {writes}"]
    return lines


def test_row_from_simulator_lines():
    log = (["noise", f"{parse.MARK} info r {{\"min_bytes\":6400}}", f"{parse.MARK} begin r op"]
           + kernel(STATS_K, 200, 1000, 100, 0, cta=2, warps=(1000, 2000, 7))
           + kernel(STATS_K, 40, 500, 150, 50, warps=(1500, 3000, 7))
           + [f"{parse.MARK} end r op", f"{parse.MARK} begin r ref"]
           + kernel(COPY_K, 640, 600, 250, 100, cta=8) + [f"{parse.MARK} end r ref"])
    s = parse.Stream()
    done = [s.feed(ln) for ln in log]
    assert [d for d in done if d] == ["r"]
    r = parse.row_result({"label": "L", "kind": "copy"}, s.rows["r"])
    k1, k2 = r["kernels"]
    assert (k1["kernel"], k1["cycles"], k1["blocks"], k1["blocks_per_sm"]) == \
        ("stats_kernel", 1000, 200, 2)  # ceil(200 / 80) = 3, capped at CTA/core = 2
    assert k2["blocks_per_sm"] == 1  # 40 blocks on 80 SMs; the CTA/core line carries over
    assert (k1["dram_read_bytes"], k2["dram_read_bytes"], k2["dram_write_bytes"]) == \
        (100 * 32, 50 * 32, 50 * 32)
    assert r["cycles"] == 1500 and r["ref_cycles"] == 600
    assert (k1["warp_stall"], k2["warp_stall"], k2["warp_idle"], k2["warp_scoreboard"]) == \
        (1000, 500, 1000, 0)  # differences of the cumulative counters
    assert k1["thread_insn"] == 123
    assert r["ratio"] == pytest.approx(0.4)
    assert r["traffic_vs_min"] == pytest.approx((150 + 50) * 32 / 6400)
    assert r["ref_dram_bytes"] == (100 + 50) * 32
    rows = {"r": {"label": "L"}, "q": {"label": "Q"}}
    table = parse.markdown({"meta": {}, "rows": {"r": r}}, rows, {"q": "bound by X"})
    assert "| r | L | 1500 |" in table and "| q | Q | not run |" in table and "bound by X" in table
    assert [ln for ln in table.splitlines() if ln.startswith("| r |")][0].endswith("| shared |")
    r["process"] = "own"
    table = parse.markdown({"meta": {}, "rows": {"r": r}}, rows, {})
    assert [ln for ln in table.splitlines() if ln.startswith("| r |")][0].endswith("| own |")


def test_blocks_per_launch_when_the_next_launch_is_pushed_first():
    """The simulator prints a launch's push before the previous launch's statistics: each launch
    keeps its own grid (first pushed, first reported), not the name's last one."""
    a, b = kernel(STATS_K, 1, 100, 0, 0), kernel(STATS_K, 3, 200, 0, 0)
    log = ([f"{parse.MARK} begin r op", a[0], b[0]] + a[1:] + b[1:]
           + [f"{parse.MARK} end r op"])
    s = parse.Stream()
    for ln in log:
        s.feed(ln)
    assert [k["blocks"] for k in s.rows["r"]["op"]] == [1, 3]


def test_short_name():
    assert parse.short_name(STATS_K) == "stats_kernel"
    assert parse.short_name(COPY_K) == "sim_copy_kernel"
    assert parse.short_name("plain") == "plain"


def test_driver_runs_each_row_in_its_own_process(tmp_path, monkeypatch):
    """bench_gpusim.main: one simulator process per row; rows already stored are skipped; --rerun
    measures a row again and keeps its old result until the new one is stored (a failed rerun
    leaves it); rows stored before runs were per row are marked shared."""
    import bench_gpusim as bench
    calls = []

    def fake(name, results, out):
        calls.append(name)
        if name == "gn_fwd_fp16":
            raise SystemExit("simulator process failed")
        results["rows"][name] = {"label": name, "kind": "copy", "cycles": 10, "us": 0.01,
                                 "ref_cycles": 5, "ratio": 0.5, "kernels": [], "warp_idle": 0,
                                 "warp_scoreboard": 0, "warp_stall": 0, "process": bench.OWN}
        bench.save(results, out)

    monkeypatch.setattr(bench, "run_process", fake)
    monkeypatch.setattr(bench, "LOGS", str(tmp_path / "logs"))
    monkeypatch.setenv("GNMX_GPGPUSIM_SRC", str(tmp_path))
    out = str(tmp_path / "res")
    bench.main(["--rows", "gn_fwd_fp32,gn_bwd_fp32", "--out", out])
    assert calls == ["gn_fwd_fp32", "gn_bwd_fp32"]
    bench.main(["--rows", "gn_fwd_fp32,gn_bwd_fp32", "--out", out])  # both stored: nothing runs
    assert calls == ["gn_fwd_fp32", "gn_bwd_fp32"]
    with open(os.path.join(out, "gpusim_v100.json")) as f:
        old = json.load(f)
    old["rows"]["gn_fwd_fp16"] = dict(old["rows"]["gn_fwd_fp32"], cycles=99)
    del old["rows"]["gn_fwd_fp16"]["process"]  # stored by the group runs of before
    with open(os.path.join(out, "gpusim_v100.json"), "w") as f:
        json.dump(old, f)
    with pytest.raises(SystemExit):
        bench.main(["--rerun", "gn_fwd_fp16", "--out", out])
    assert calls[-1] == "gn_fwd_fp16"
    with open(os.path.join(out, "gpusim_v100.json")) as f:
        kept = json.load(f)["rows"]
    assert kept["gn_fwd_fp16"]["cycles"] == 99  # the old row, not dropped by the failed rerun
    bench.main(["--out", out, "--rows", "gn_fwd_fp32"])
    with open(os.path.join(out, "gpusim_v100.md")) as f:
        md = f.read()
    assert [ln for ln in md.splitlines() if ln.startswith("| gn_fwd_fp16 |")][0].endswith(
        "| shared |")
    assert [ln for ln in md.splitlines() if ln.startswith("| gn_fwd_fp32 |")][0].endswith("| own |")
