"""The one tolerance table, keyed by dtype: the edge cases and python -m gn_mx.selftest use it, and
the tests through tests/tolerances.py (conftest.py re-exports it). numpy only: the GPU tests load it
without MXNet (tests/pkg_shared.py)."""
import numpy as np

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
# Central differences (h = 1e-6) of a float64 reference are good to about this (truncation and
# cancellation): a gradient checked against them needs at least this much on top of GRAD_TOL.
FD_TOL = (1e-5, 1e-6)
DTYPES = [np.float16, np.float32, np.float64]


def tol(dtype, table=TOL):
    return table[np.dtype(dtype).type]
