"""The CI speed check on the simulated V100 (GPGPU-Sim's timing model; issue 39 item 4): small
cold-launch GroupNorm rows of benchmarks/gpusim/ (the same row code and output parser) whose ratio
to a float4 copy of the same bytes, in the same process, may not fall below a floor a little under
the committed value. Cycle counts are deterministic for a fixed simulator, patch, nvcc and PTX, so a
drop below the floor is a kernel (or toolchain) change that made the row slower.

Runs only in timing mode (`bash tests/gpu/sim/gpgpusim.sh timing`, which tests/test_gpgpusim.py
runs when a simulator source is given); skips everywhere else (GPU, emulator, functional mode).
"""
import os
import sys

import pytest
from gpu_common import SIM, hnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpusim"))
import _gpusim_parse as parse  # noqa: E402
import _gpusim_rows as rows  # noqa: E402

pytestmark = pytest.mark.skipif(not (SIM and os.environ.get("GNMX_GPGPUSIM_TIMING") == "1"),
                                reason="timing mode of GPGPU-Sim only (gpgpusim.sh timing)")

# row -> floor of copy cycles / op cycles, a little under the committed value (benchmarks/results/
# gpusim_v100.md): ci_gn_fwd 2324 copy / 5460 op cycles = 0.426 (fwd_resident_kernel, 32 blocks on
# the 80 SMs; kernels of 859a661); ci_gn_bwd 2819 / 6967 = 0.405 (bwd_resident_kernel writing
# dgamma/dbeta itself, one launch; 102a7a7). The two-kernel plans before them: 0.262 and 0.199.
# ~2 and ~3 min of one core plus the PTX parsing.
FLOORS = {"ci_gn_fwd": 0.41, "ci_gn_bwd": 0.39}


def run_row(name, capfd):
    """The row's op and copy, the simulator's lines captured at the file-descriptor level. Only the
    cycles are asserted: the first kernel's DRAM and warp-slot differences also hold what earlier
    tests of the process ran (the counters are cumulative; bench_gpusim.py sees them all)."""
    op, ref, info = rows.ROWS[name]["make"](hnp, hnp.load())
    stream = parse.Stream()
    for part, fn in (("op", op), ("ref", ref)):
        capfd.readouterr()
        stream.feed(f"{parse.MARK} begin {name} {part}")
        fn()
        parse.flush_c_stdout()
        for line in capfd.readouterr().out.splitlines():
            stream.feed(line)
        stream.feed(f"{parse.MARK} end {name} {part}")
    stream.rows[name]["info"] = info
    return parse.row_result(rows.ROWS[name], stream.rows[name])


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_copy_ratio_floor(name, capfd):
    r = run_row(name, capfd)
    with capfd.disabled():
        print(f"\n[gpusim] {name}: {parse.summary(r)}; kernels {r['kernels']}")
    assert r["kernels"] and r["ref_cycles"] > 0, r
    assert r["ratio"] >= FLOORS[name], (
        f"{name}: copy/op = {r['ratio']:.3f} < floor {FLOORS[name]} ({r['cycles']} op cycles vs "
        f"{r['ref_cycles']} copy cycles): a kernel change made this row slower on the simulator")
