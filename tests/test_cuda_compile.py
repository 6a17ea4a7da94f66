"""CI: every CUDA source compiles (library with GNMX_CUDA=ON + GPU harness), without a GPU.

Runs tests/cuda_compile_check.sh; skipped when no nvcc is installed. Nothing is executed on a GPU:
the GPU checks live in tests/gpu (run by benchmarks/gpu/run_all.sh on a CUDA machine).
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cuda_sources_compile():
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", os.path.join(ROOT, "tests", "cuda_compile_check.sh")],
                       capture_output=True, text=True, env=env, timeout=1500)
    out = r.stdout + r.stderr
    if r.returncode == 0 and "SKIPPED:" in r.stdout:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, out[-6000:]
    assert "cuda_compile_check: OK" in r.stdout
