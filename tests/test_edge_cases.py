"""The shared numerical edge cases (gn_mx/_edge_cases.py, tests/edge_cases.py) on the MXNet ops,
every context, through the runner of python -m gn_mx.selftest.

The same list runs on the CUDA kernels through tests/gpu/test_gpu_edge_cases.py (a real GPU, or the
CPU emulator in CI), so a guarantee stated there holds on both devices or CI fails.
"""
import pytest

import edge_cases
from gn_mx.selftest import MxRunner  # the runner python -m gn_mx.selftest uses on every device


@pytest.mark.parametrize("case", edge_cases.CASES, ids=edge_cases.case_id)
def test_edge_case(ctx, case):
    case(MxRunner(ctx))


LAYOUT_CASES = edge_cases.LAYOUT_CASES


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=edge_cases.case_id)
def test_edge_case_channels_last(ctx, case):
    """The same list on channels-last data (axis=-1; edge_cases.ChannelsLast)."""
    case(edge_cases.channels_last(MxRunner(ctx)))


@pytest.mark.parametrize("case", edge_cases.LAYOUT_EXTRA_CASES, ids=edge_cases.case_id)
def test_edge_case_layout_extra(ctx, case):
    case(MxRunner(ctx))
