"""The shared numerical edge cases (tests/edge_cases.py) on the CUDA kernels.

On a GPU machine the kernels run on the GPU; elsewhere (the CPU CI) the same kernels run under the
CPU emulator (tests/gpu/emu), so every case the MXNet ops pass on the CPU (tests/test_edge_cases.py)
runs against the CUDA code in CI too. Needs neither torch nor MXNet (tests/gpu/harness_np.py: numpy
+ ctypes); the emulator needs g++.
"""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import edge_cases  # noqa: E402
import harness_np  # noqa: E402

if harness_np.emulated() and shutil.which("g++") is None:
    pytest.skip("the CUDA emulator needs g++", allow_module_level=True)


@pytest.fixture(scope="module")
def runner():
    harness_np.load()  # build (emulator: cached by input hash) once, outside the first case's time
    return harness_np.Runner()


@pytest.mark.parametrize("case", edge_cases.CASES, ids=edge_cases.case_id)
def test_edge_case(runner, case):
    case(runner)
