"""The shared preamble of the tests/gpu modules: `from gpu_common import ...` first.

Importing it skips the importing test module unless torch is importable and the harness can run (a
CUDA device, or GNMX_HARNESS_EMU=1 for the CPU emulator), so the CPU CI's `pytest tests/` stays
green. Also: the device, the dtypes, parametrize ids and the relative error all modules measure.
"""
import pytest

torch = pytest.importorskip("torch")
import gnh  # noqa: E402  (tests/gpu is on sys.path: pytest's rootdir-relative import)

if not gnh.available():
    pytest.skip("no CUDA device for the GPU harness (GNMX_HARNESS_EMU=1: CPU emulator)",
                allow_module_level=True)

DEV = gnh.DEVICE
DTYPES = [torch.float16, torch.float32, torch.float64]


def ids(v):
    """Parametrize ids: torch dtypes without the "torch." prefix."""
    return str(v).replace("torch.", "")


def rel_err(a, ref):
    """max|a - ref| / max(1, max|ref|), in float64."""
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / max(1.0, ref.abs().max().item())).item()
