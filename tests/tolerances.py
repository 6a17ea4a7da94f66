"""The one tolerance table, keyed by dtype (re-exported by conftest.py; imported directly by code
that must not import MXNet, such as tests/edge_cases.py under tests/gpu)."""
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
DTYPES = [np.float16, np.float32, np.float64]


def tol(dtype, table=TOL):
    return table[np.dtype(dtype).type]
