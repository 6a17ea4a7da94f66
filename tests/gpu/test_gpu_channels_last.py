"""Channels-last (GroupDims::channels_last, the ops' axis = -1) CUDA kernels
(src/operator/kernels/group_norm_nsc_cuda.cu), numpy-driven: on a GPU when there is one, else
under the CPU emulator (GNMX_HARNESS_EMU=1 forces it).

- the shared edge-case list (tests/edge_cases.py) through edge_cases.ChannelsLast, as the CPU op
  runs it in tests/test_edge_cases.py;
- forward / backward (gradients into mean and rstd too), every dtype, fp16 data with fp32
  parameters, 0-3 spatial dims, the fused activation, against the channels-first kernels on the
  transposed data and the float64 reference; gn_moments and its backward.
"""
import ctypes
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import edge_cases  # noqa: E402
import harness_np  # noqa: E402
from reference import group_norm_bwd_ref, group_norm_ref, moments_ref  # noqa: E402

if harness_np.emulated() and shutil.which("g++") is None:
    pytest.skip("the CUDA emulator needs g++", allow_module_level=True)


class AxisRunner(harness_np.Runner):
    """harness_np.Runner plus `axis`: with axis=-1 the (N, *spatial, C) array goes to the kernels
    unchanged in memory (labelled (N, C, S) for the harness's dims) with gnh_set_channels_last(1);
    data-shaped results come back in the input's shape."""

    name = "cuda"

    def _layout(self, on):
        lib = harness_np.load()
        fn = lib.gnh_set_channels_last
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(1 if on else 0)

    def _call(self, method, x, axis, data_args, **kw):
        if axis == 1 or x.ndim < 3:
            return method(x, **data_args, **kw)
        shape, N, C = x.shape, x.shape[0], x.shape[-1]
        S = int(np.prod(shape[1:-1]))
        relabel = (lambda a: None if a is None else np.ascontiguousarray(a).reshape(N, C, S))
        self._layout(True)
        try:
            r = method(relabel(x), **{k: relabel(v) for k, v in data_args.items()}, **kw)
        finally:
            self._layout(False)
        return {k: v.reshape(shape) if k in ("y", "dx") else v for k, v in r.items()}

    def group_norm(self, x, gamma, beta, G, eps, act=None, dy=None, dmean=None, drstd=None,
                   axis=1):
        return self._call(lambda x, dy: harness_np.Runner.group_norm(
            self, x, gamma, beta, G, eps, act=act, dy=dy, dmean=dmean, drstd=drstd),
            x, axis, {"dy": dy})

    def moments(self, x, G, dmean=None, dvar=None, axis=1):
        return self._call(lambda x: harness_np.Runner.moments(self, x, G, dmean=dmean, dvar=dvar),
                          x, axis, {})


@pytest.fixture(scope="module")
def runner():
    harness_np.load()  # build (emulator: cached by input hash) once
    return AxisRunner()


LAYOUT_CASES = edge_cases.LAYOUT_CASES


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=edge_cases.case_id)
def test_edge_case_channels_last(runner, case):
    case(edge_cases.channels_last(runner))


def _first(a):
    return np.ascontiguousarray(np.moveaxis(a, -1, 1)) if a.ndim > 2 else a


TOL = {np.float16: (1e-2, 1e-2), np.float32: (1e-4, 1e-5), np.float64: (1e-10, 1e-12)}
GTOL = {np.float16: (3e-2, 3e-2), np.float32: (3e-4, 3e-5), np.float64: (1e-9, 1e-11)}
SHAPES = [((3, 7, 8), 2), ((2, 5, 6, 16), 4), ((1, 9, 9, 32), 8), ((2, 3, 4, 5, 8), 2),
          ((2, 300, 6), 3), ((3, 4, 4, 10), 5)]


@pytest.mark.parametrize("pdtype", [None, np.float32], ids=["params_like_data", "params_fp32"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("act", [None, "relu", "silu"], ids=str)
@pytest.mark.parametrize("shape,G", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_matches_channels_first(runner, shape, G, act, dtype, pdtype):
    if pdtype is not None and dtype != np.float16:
        pytest.skip("fp32 parameters go with fp16 data")
    rng = np.random.RandomState(sum(shape) + G)
    C = shape[-1]
    pd = pdtype or dtype
    x = (rng.randn(*shape) * 2 + 0.5).astype(dtype)
    dy = rng.randn(*shape).astype(dtype)
    gamma, beta = (rng.rand(C) + 0.5).astype(pd), rng.randn(C).astype(pd)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean, drstd = rng.randn(shape[0], G).astype(acc), rng.randn(shape[0], G).astype(acc)
    rl = runner.group_norm(x, gamma, beta, G, 1e-5, act=act, dy=dy, dmean=dmean, drstd=drstd,
                           axis=-1)
    rf = runner.group_norm(_first(x), gamma, beta, G, 1e-5, act=act, dy=_first(dy), dmean=dmean,
                           drstd=drstd)
    t, gt = TOL[dtype], GTOL[dtype]
    f64 = (lambda a: a.astype(np.float64))
    np.testing.assert_allclose(f64(_first(rl["y"])), f64(rf["y"]), *t)
    np.testing.assert_allclose(rl["mean"], rf["mean"], *t)
    np.testing.assert_allclose(rl["rstd"], rf["rstd"], *t)
    np.testing.assert_allclose(f64(_first(rl["dx"])), f64(rf["dx"]), *gt)
    for k in ("dgamma", "dbeta"):
        np.testing.assert_allclose(f64(rl[k]), f64(rf[k]), rtol=gt[0],
                                   atol=gt[1] * max(1.0, np.abs(f64(rf[k])).max()), err_msg=k)
    x64 = f64(_first(x))
    ref, rmean, _ = group_norm_ref(x64, f64(gamma), f64(beta), G, 1e-5, act=act)
    np.testing.assert_allclose(f64(_first(rl["y"])), ref, *t)
    rdx, rdg, _ = group_norm_bwd_ref(x64, f64(gamma), f64(_first(dy)), G, 1e-5, dmean, drstd,
                                     act=act, beta=f64(beta))
    np.testing.assert_allclose(f64(_first(rl["dx"])), rdx, *gt)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
def test_moments(runner, dtype):
    rng = np.random.RandomState(2)
    x = (rng.randn(3, 5, 6, 12) + 4).astype(dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean, dvar = rng.randn(3, 4).astype(acc), rng.randn(3, 4).astype(acc)
    rl = runner.moments(x, 4, dmean=dmean, dvar=dvar, axis=-1)
    rf = runner.moments(_first(x), 4, dmean=dmean, dvar=dvar)
    rm, rv = moments_ref(_first(x).astype(np.float64), 4)
    np.testing.assert_allclose(rl["mean"], rm, *TOL[dtype])
    np.testing.assert_allclose(rl["var"], rv, *TOL[dtype])
    np.testing.assert_allclose(_first(rl["dx"]).astype(np.float64), rf["dx"].astype(np.float64),
                               *GTOL[dtype])
