"""DBN CUDA kernels on extreme but finite float64 data (issue 10, item 4).

The block-parallel Jacobi eigensolver scales its matrix by a power of two before the stopping rule's
sums of squares; unscaled, sum A^2 overflowed for |x| > ~1e77 and the solver stopped before any
rotation. numpy-driven like test_gpu_dbn.py (GPU, emulator or GPGPU-Sim).
"""
import numpy as np
import pytest

from gpu_common import hnp, rel_err  # skips without g++ (emulator)
from test_gpu_dbn import eye, make, ref_dbn, whitened_cov  # noqa: E402


@pytest.mark.parametrize("scale", [1e-150, 1e100, 1e150])
@pytest.mark.parametrize("shape,G", [((32, 8), 2), ((16, 16, 2), 2), ((8, 32, 8), 1)])
def test_dbn_forward_extreme_scale_float64(shape, G, scale):
    x = make(shape, np.float64) * scale
    eps = 1e-5 * scale * scale  # the same relative eps at every scale
    C, D = shape[1], shape[1] // G
    rm, rp = np.zeros(C), np.zeros((G, D, D))
    y, mean, U, lam = hnp.dbn_fwd(x, G, rm, rp, eps, 0.0)
    ry, _, rl, _ = ref_dbn(x, G, eps)
    assert rel_err(y, ry) < 1e-8, rel_err(y, ry)
    assert (np.abs(lam - rl) / np.abs(rl)).max() < 1e-8
    assert np.abs(whitened_cov(y, G) - eye(G, D)).max() < 1e-2
