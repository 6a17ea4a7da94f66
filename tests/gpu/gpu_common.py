"""The shared preamble of the tests/gpu modules: `from gpu_common import ...` first.

The modules drive the CUDA kernels through tests/gpu/harness_np.py (numpy + ctypes, no torch, no
MXNet), so one list runs on a GPU, on the CPU emulator (GNMX_HARNESS_EMU=1, or no GPU found) and
on GPGPU-Sim (tests/gpu/sim/gpgpusim.sh). Importing this skips the importing module where the
emulator would be needed but g++ is missing. Also: the device kind, the dtypes, parametrize ids, the
seeded inputs and the relative error all modules measure.
"""
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import harness_np as hnp  # noqa: E402

EMU = hnp.emulated()
SIM = hnp.simulated()
if EMU and shutil.which("g++") is None:
    pytest.skip("the CUDA emulator needs g++", allow_module_level=True)

DTYPES = [np.float16, np.float32, np.float64]
ACC = hnp.acc_dtype


def ids(v):
    """Parametrize ids: numpy dtypes by name."""
    if isinstance(v, type) and issubclass(v, np.generic):
        return np.dtype(v).name
    return str(v)


def rel_err(a, ref):
    """max|a - ref| / max(1, max|ref|), in float64 (nan when a holds a nan where ref does not)."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(1.0, float(np.abs(ref).max())))


def rng(seed):
    return np.random.default_rng(seed)


def randn(shape, dtype, seed, scale=1.0, offset=0.0):
    """float64 normal samples (seeded), times scale plus offset, rounded to dtype."""
    return (rng(seed).standard_normal(shape) * scale + offset).astype(dtype)


def skip_on_simulator(reason):
    """Marks a test that GPGPU-Sim cannot run (the reason is reported with the skip)."""
    return pytest.mark.skipif(SIM, reason=f"not on GPGPU-Sim: {reason}")
