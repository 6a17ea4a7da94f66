"""DBN CUDA kernels on extreme but finite float64 data (issue 10, item 4).

The block-parallel Jacobi eigensolver scales its matrix by a power of two before the stopping rule's
sums of squares; unscaled, sum A^2 overflowed for |x| > ~1e77 and the solver stopped before any
rotation. Same guards as test_gpu_dbn.py (torch + a CUDA device, or GNMX_HARNESS_EMU=1).
"""
import pytest

from gpu_common import DEV, gnh, rel_err  # skips the module without torch / a device
import torch

from test_gpu_dbn import make, ref_dbn, to_groups  # noqa: E402


@pytest.mark.parametrize("scale", [1e-150, 1e100, 1e150])
@pytest.mark.parametrize("shape,G", [((32, 8), 2), ((16, 16, 2), 2), ((8, 32, 8), 1)])
def test_dbn_forward_extreme_scale_float64(shape, G, scale):
    x = (make(shape, torch.float64).double() * scale).to(DEV)
    eps = 1e-5 * scale * scale  # the same relative eps at every scale
    C, D = shape[1], shape[1] // G
    rm = torch.zeros(C, dtype=torch.float64, device=DEV)
    rp = torch.zeros(G, D, D, dtype=torch.float64, device=DEV)
    y, mean, U, l = gnh.dbn_fwd(x, G, rm, rp, eps, 0.0)
    gnh.sync()
    ry, _, rl, _ = ref_dbn(x.double(), G, eps)
    assert rel_err(y, ry) < 1e-8, rel_err(y, ry)
    assert ((l.double() - rl).abs() / rl.abs()).max().item() < 1e-8
    Y = to_groups(y.double(), G)
    Yc = Y - Y.mean(-1, keepdim=True)
    cov = Yc @ Yc.transpose(1, 2) / Y.shape[-1]
    assert (cov - torch.eye(D, dtype=cov.dtype, device=DEV)).abs().max() < 1e-2
