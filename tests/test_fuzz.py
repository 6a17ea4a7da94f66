"""Fuzz: random shapes (0-4 spatial dims, sizes of 1), groups, dtypes and dtype pairs, eps /
num_groups / momentum attribute strings, imperative / hybridized / symbolic, forward / backward.
Each case must match the float64 reference or raise MXNetError (see tests/fuzz_worker.py).

Hypothesis runs derandomized (fixed seed, no example database) inside ONE subprocess, so CI sees
the same cases every run and a crash (segfault, abort) is caught: the worker prints each case
before running it, and the crashing one is replayed alone in a fresh process and reported.
"""
import json
import os
import subprocess
import sys

import pytest

from gn_mx._library import OPS

pytest.importorskip("hypothesis")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fuzz_worker.py")
N_CASES = int(os.environ.get("GNMX_FUZZ_CASES", "2000"))


def _worker(args, extra_env=None, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_SUBGRAPH_VERBOSE="0", **(extra_env or {}))
    return subprocess.run([sys.executable, WORKER] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=os.path.dirname(HERE), env=env)


def _lines(p, tag):
    return [ln[len(tag) + 1:] for ln in p.stdout.splitlines() if ln.startswith(tag + " ")]


def test_fuzz_ops_against_reference():
    p = _worker(["run", str(N_CASES)])
    if p.returncode != 0 or not _lines(p, "COUNTS"):
        started = _lines(p, "START")
        assert started, f"fuzz worker failed before any case:\n{p.stderr[-4000:]}"
        case = started[-1]
        replay = _worker(["replay", case], timeout=120)
        pytest.fail(f"fuzz worker died (rc {p.returncode}) on case {case}\n"
                    f"replayed alone: rc {replay.returncode}, {replay.stdout[-500:]}\n"
                    f"stderr: {p.stderr[-3000:]}")
    counts = json.loads(_lines(p, "COUNTS")[-1])
    failures = [json.loads(f) for f in _lines(p, "FAILURE")]
    print(f"fuzz: {counts}")
    assert counts["calls"] == N_CASES
    assert counts["mismatches"] == 0, json.dumps(failures, indent=1)[:6000]
    # both outcomes are exercised, every op is
    assert counts["ok"] > N_CASES // 3 and counts["errors_raised"] > N_CASES // 10, counts
    assert sorted(counts["by_op"]) == sorted(OPS), counts


def test_fuzz_checker_detects_wrong_results():
    """The same harness with every result perturbed (x1.1 + 0.1) must report mismatches."""
    p = _worker(["run", "40"], extra_env={"GNMX_FUZZ_SELFTEST": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    counts = json.loads(_lines(p, "COUNTS")[-1])
    checked = counts["calls"] - counts["errors_raised"] - counts["unchecked"]
    assert checked > 10 and counts["mismatches"] >= 0.9 * checked, counts
