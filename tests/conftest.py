"""Shared fixtures: contexts, seeds, one tolerance table keyed by dtype, subprocess runner."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mxnet as mx
import gn_mx  # noqa: F401  (loads the op library)

# (rtol, atol) for comparing an op's output with a float64 reference computed on the same
# (already rounded) inputs. fp16 outputs carry fp16 rounding (2^-11 relative) of O(1) values.
TOL = {
    np.float16: (5e-3, 5e-3),
    np.float32: (1e-4, 1e-5),
    np.float64: (1e-10, 1e-12),
}
# Looser table for gradients, whose fp16 path rounds dy and dx.
GRAD_TOL = {
    np.float16: (2e-2, 2e-2),
    np.float32: (2e-4, 2e-5),
    np.float64: (1e-9, 1e-11),
}
DTYPES = [np.float16, np.float32, np.float64]


def tol(dtype, table=TOL):
    return table[np.dtype(dtype).type]


def contexts():
    ctxs = [mx.cpu()]
    if mx.context.num_gpus() > 0:
        ctxs.append(mx.gpu(0))
    return ctxs


@pytest.fixture(params=contexts(), ids=lambda c: str(c))
def ctx(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(1234)
    mx.random.seed(1234)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, timeout=300, cwd=None):
    """Run `code` in a fresh interpreter (same venv); returns CompletedProcess (never raises)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or ROOT, env=env)
