"""benchmarks/gpusim/_gpusim_parse.py on a hand-written excerpt of GPGPU-Sim's timing-mode output:
per-kernel cycles, DRAM bytes from the CUMULATIVE counters (differences), blocks per SM, ratios."""
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


def test_short_name():
    assert parse.short_name(STATS_K) == "stats_kernel"
    assert parse.short_name(COPY_K) == "sim_copy_kernel"
    assert parse.short_name("plain") == "plain"
