"""The emulated kernels give bitwise the same outputs under every thread schedule, and the shared
edge cases hold with FMA contraction.

A GPU runs a block's threads in no fixed order; the emulator runs them between barriers in forward,
reverse or seeded random order (GNMX_EMU_SCHED, tests/gpu/emu/include/cuda_emu.h). A kernel whose
output depends on that order has a race (a read of what another thread writes without a barrier
between), which forward order alone hides when the writer has the lower index. Here the whole GPU
test list (every test file of tests/gpu but this one, the emulator's rule tests and the benchmark)
runs under forward and reverse order in fresh processes, and every result any test reads back
from the device must be bitwise equal, call by call; the edge-case list (tests/edge_cases.py) and
the launch-plan boundaries (test_gpu_plans.py) also run in-process, the plans under a seeded
random order too.

nvcc contracts a * b + c into FMAs by default; the emulator's default build does not. The FMA
variant (GNMX_EMU_FMA=1: -ffp-contract=fast -mfma, its own build/gpu-emu-fma) runs the edge-case
list and the team-uniformity cases, so tolerances are checked against GPU-like rounding too.
Emulator only (on a GPU the hardware schedules and rounds).
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/
import harness_np  # noqa: E402

if not harness_np.emulated():
    pytest.skip("thread schedules and the FMA build are the emulator's", allow_module_level=True)

import edge_cases  # noqa: E402
from test_gpu_plans import PLAN_CASES, data  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))


class Recorder(harness_np.Runner):
    """A Runner that keeps every result it returns, in call order."""

    def __init__(self):
        super().__init__()
        self.results = []

    def group_norm(self, *a, **k):
        r = super().group_norm(*a, **k)
        self.results.append(r)
        return r

    def moments(self, *a, **k):
        r = super().moments(*a, **k)
        self.results.append(r)
        return r


def edge_case_outputs():
    rec = Recorder()
    for case in edge_cases.CASES:
        case(rec)
    return rec.results


def plan_outputs():
    rec = Recorder()
    for dtype, (N, G, D, S) in PLAN_CASES:
        x, gamma, beta, dy, dmean, drstd = data(N, G, D, S, dtype, seed=3)
        rec.group_norm(x, gamma, beta, G, 1e-5, act="silu", dy=dy, dmean=dmean, drstd=drstd)
        rec.moments(x, G, dmean=dmean, dvar=drstd)
    return rec.results


def assert_bitwise_equal(a, b, what):
    assert len(a) == len(b), what
    for i, (ra, rb) in enumerate(zip(a, b)):
        assert ra.keys() == rb.keys(), (what, i)
        for k in ra:
            va, vb = np.ascontiguousarray(ra[k]), np.ascontiguousarray(rb[k])
            assert va.dtype == vb.dtype and va.shape == vb.shape, (what, i, k)
            assert va.tobytes() == vb.tobytes(), f"{what}: call {i}, output {k} differs"


@pytest.fixture(scope="module")
def lib():
    return harness_np.load()


# Every GPU test file except this one, the emulator's own rule tests (they plant violations) and
# the benchmark.
LIST_EXCLUDED = {"test_gpu_schedules.py", "test_gpu_emu_rules.py", "test_bench_gpu.py"}


def gpu_test_files():
    return sorted(f for f in os.listdir(HERE)
                  if f.startswith("test_gpu") and f.endswith(".py") and f not in LIST_EXCLUDED)


def run_list_recorded(sched, record):
    """pytest on the GPU test list in a fresh process under GNMX_EMU_SCHED=sched; every result the
    tests read back from the device is appended to `record` (harness_np's GNMX_HARNESS_RECORD)."""
    env = dict(os.environ, GNMX_EMU_SCHED=sched, GNMX_HARNESS_RECORD=str(record),
               GNMX_HARNESS_EMU="1")
    files = [os.path.join(HERE, f) for f in gpu_test_files()]
    r = subprocess.run([sys.executable, "-m", "pytest", "--confcutdir", HERE, "-q",
                        "-p", "no:cacheprovider"] + files,
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"{sched}:\n" + r.stdout[-6000:] + r.stderr[-3000:]
    return record.read_text().splitlines()


def test_gpu_test_list_bitwise_equal_under_two_schedules(lib, tmp_path):
    """The whole GPU test list (GroupNorm, moments, both layouts, the double backward, the affine,
    the parameter reductions, DBN ZCA / IterNorm / inference) under forward and reverse thread
    order: every result of every test bitwise equal, call by call."""
    fwd = run_list_recorded("forward", tmp_path / "forward.txt")
    rev = run_list_recorded("reverse", tmp_path / "reverse.txt")
    assert len(fwd) > 3000, len(fwd)
    assert len(fwd) == len(rev), (len(fwd), len(rev))
    diff = [i for i, (a, b) in enumerate(zip(fwd, rev)) if a != b]
    assert not diff, f"{len(diff)} results differ between forward and reverse order, first: " \
                     f"result {diff[0]}: {fwd[diff[0]]} vs {rev[diff[0]]}"


@pytest.mark.parametrize("source", [edge_case_outputs, plan_outputs], ids=["edge_cases", "plans"])
def test_schedules_bitwise_equal(lib, monkeypatch, source):
    """In-process, with a seeded random order too (the plan boundaries: where a block's threads
    share the most work)."""
    scheds = ["forward", "reverse"] + (["random:20261201"] if source is plan_outputs else [])
    got = {}
    for sched in scheds:
        monkeypatch.setenv("GNMX_EMU_SCHED", sched)
        got[sched] = source()
    assert len(got["forward"]) > 20
    for sched in scheds[1:]:
        assert_bitwise_equal(got["forward"], got[sched], f"{source.__name__}: forward vs {sched}")


def cpu_has_fma():
    try:
        with open("/proc/cpuinfo") as f:
            return re.search(r"^flags\s*:.*\bfma\b", f.read(), re.M) is not None
    except OSError:
        return False


@pytest.mark.skipif(not cpu_has_fma(), reason="the FMA build variant needs a CPU with FMA3")
def test_fma_build_variant():
    env = dict(os.environ, GNMX_EMU_FMA="1", GNMX_HARNESS_EMU="1")
    env.pop("GNMX_HARNESS_LIB", None)
    env.pop("GNMX_HARNESS_EMU_OUT", None)
    tests = [os.path.join(HERE, f) for f in ("test_gpu_edge_cases.py", "test_gpu_uniform.py")]
    r = subprocess.run([sys.executable, "-m", "pytest", "--confcutdir", HERE, "-q", "-x",
                        "-p", "no:cacheprovider"] + tests,
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert re.search(r"\b1\d\d passed", r.stdout), r.stdout[-2000:]
    # it ran on the FMA build: its library, compiled with contraction
    assert os.path.exists(os.path.join(ROOT, "build", "gpu-emu-fma", "libgn_harness.so"))
