"""GPU harness tests: the framework-free CUDA kernels vs float64 references.

numpy-driven (tests/gpu/harness_np.py), so the same list runs on a GPU, on the CPU emulator
(GNMX_HARNESS_EMU=1) and on GPGPU-Sim (tests/gpu/sim/gpgpusim.sh):
    python -m pytest --confcutdir=tests/gpu tests/gpu -q
(--confcutdir keeps tests/conftest.py, which imports mxnet, out.)

References are float64 numpy computations on the already-rounded inputs (tests/reference.py: the
textbook xhat forms, independent of the kernels' centred-sum forms); errors are measured as
max|ours - ref| / max(1, max|ref|) against one tolerance table keyed by dtype. (The torch-driven
version also compared with torch.nn.functional.group_norm through e <= max(tol, 2 e_torch), a
bound that e < tol already implies.)
"""
import math

import numpy as np
import pytest

from gpu_common import ACC, DTYPES, hnp, ids, rel_err, rng  # skips without g++ (emulator)
from reference import group_norm_bwd_ref, group_norm_ref, moments_bwd_ref, moments_ref

# (forward tol, backward tol) on the relative max error
TOL = {np.float16: (4e-3, 1.5e-2), np.float32: (2e-5, 1e-4), np.float64: (1e-11, 1e-9)}

SHAPES = [  # (shape, groups)
    ((4, 6), [1, 2, 6]),                     # 0 spatial dims
    ((3, 8, 7), [1, 4, 8]),                  # 1 spatial dim, odd S
    ((2, 12, 5, 6), [1, 3, 12]),             # 2 spatial dims
    ((2, 8, 3, 4, 5), [1, 2, 8]),            # 3 spatial dims
    ((1, 6, 9, 9), [3]),                     # odd group length (scalar paths)
    ((2, 64, 16, 16), [1, 32, 64]),
    ((1, 32, 128, 128), [1, 4]),             # few large groups: split statistics
    ((8, 256, 3), [1, 256]),                 # short rows, G = C
]
SD_SHAPES = [((2, c, hw, hw), [32]) for c in (320, 640, 1280) for hw in (64, 32, 16, 8)]


def cases(shapes):
    return [(s, g) for s, gs in shapes for g in gs]


def make(shape, dtype, pdtype=None, offset=0.0, seed=0):
    r = rng(seed)
    C = shape[1]
    x = (r.standard_normal(shape) * 2 + offset).astype(dtype)
    pdtype = pdtype or dtype
    gamma = (r.random(C) + 0.5).astype(pdtype)
    beta = r.standard_normal(C).astype(pdtype)
    return x, gamma, beta


def dtype_pairs():
    return [(d, d) for d in DTYPES] + [(np.float16, np.float32)]


def over_shapes_and_dtype_pairs(test):
    """test(shape, G, dtype, pdtype) over SHAPES x every (data, parameter) dtype pair."""
    test = pytest.mark.parametrize("shape,G", cases(SHAPES), ids=ids)(test)
    return pytest.mark.parametrize("dtype,pdtype", dtype_pairs(), ids=ids)(test)


def over_sd_unet(test):
    """test(shape, G, dtype) over the SD-UNet shapes x DTYPES."""
    test = pytest.mark.parametrize("shape,G", cases(SD_SHAPES), ids=ids)(test)
    return pytest.mark.parametrize("dtype", DTYPES, ids=ids)(test)


# -------------------------------------------------------------------------------------------------
# moments


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", cases(SHAPES), ids=ids)
@pytest.mark.parametrize("use_ws", [True, False], ids=["split", "nosplit"])
def test_moments(shape, G, dtype, use_ws):
    x, _, _ = make(shape, dtype)
    mean, var = hnp.moments(x, G, use_workspace=use_ws)
    assert mean.dtype == ACC(dtype) and var.dtype == ACC(dtype)
    rm, rv = moments_ref(x, G)
    tol = TOL[dtype][0]
    assert rel_err(mean, rm) < tol
    assert rel_err(var, rv) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", cases(SHAPES[:6]), ids=ids)
def test_moments_backward(shape, G, dtype):
    x, _, _ = make(shape, dtype)
    mean, _ = hnp.moments(x, G)
    r = rng(1)
    dmean = r.standard_normal(mean.shape).astype(mean.dtype)
    dvar = r.standard_normal(mean.shape).astype(mean.dtype)
    dx = hnp.moments_bwd(dmean, dvar, x, mean, G)
    assert dx.dtype == dtype
    assert rel_err(dx, moments_bwd_ref(x, G, dmean, dvar)) < TOL[dtype][1]


# -------------------------------------------------------------------------------------------------
# group_norm forward / backward


def check_forward(shape, G, dtype, pdtype, use_ws=True, offset=0.0, eps=1e-5):
    x, gamma, beta = make(shape, dtype, pdtype, offset)
    y, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G, eps, use_workspace=use_ws)
    ry, rm, rr = group_norm_ref(x, gamma, beta, G, eps)
    tol = TOL[dtype][0]
    assert y.dtype == dtype and mean.dtype == ACC(dtype) and rstd.dtype == ACC(dtype)
    e_y = rel_err(y, ry)
    assert e_y < tol, f"y error {e_y}"
    assert rel_err(mean, rm) < tol
    assert rel_err(rstd, rr) < tol
    return x, gamma, beta, y, mean, rstd


@over_shapes_and_dtype_pairs
def test_forward(shape, G, dtype, pdtype):
    check_forward(shape, G, dtype, pdtype)


@over_sd_unet
def test_forward_sd_unet(shape, G, dtype):
    check_forward(shape, G, dtype, dtype)


@pytest.mark.parametrize("shape,G", [((2, 320, 64, 64), 32), ((1, 32, 128, 128), 1)], ids=ids)
def test_forward_no_workspace(shape, G):
    check_forward(shape, G, np.float32, np.float32, use_ws=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
def test_forward_large_offset(dtype):
    # |mean| >> std: one-pass Welford must not lose the variance (Apex-style offset test).
    check_forward((2, 64, 32, 32), 8, dtype, dtype, offset=1000.0)


def test_forward_constant_group_is_finite():
    x = np.full((2, 8, 4, 4), 3.0, np.float32)
    gamma, beta = np.ones(8, np.float32), np.zeros(8, np.float32)
    y, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, 4)
    assert np.isfinite(y).all() and np.allclose(mean, 3.0)
    assert np.allclose(rstd, 1 / math.sqrt(1e-5), rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_forward_misaligned(dtype):
    # Buffers one element past an aligned start: 16-byte vector loads are not allowed, the scalar
    # path must be taken.
    shape, G = (2, 16, 8, 8), 4
    x, gamma, beta = make(shape, dtype)
    y, _, _ = hnp.group_norm_fwd(x, gamma, beta, G, offsets={"x": 1, "y": 1})
    ry, _, _ = group_norm_ref(x, gamma, beta, G, 1e-5)
    assert rel_err(y, ry) < TOL[dtype][0]


def check_backward(shape, G, dtype, pdtype, stat_grads=False, param_grads=True, offset=0.0):
    eps = 1e-5
    x, gamma, beta = make(shape, dtype, pdtype, offset)
    _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G, eps)
    r = rng(7)
    dy = r.standard_normal(shape).astype(dtype)
    dmean = drstd = None
    if stat_grads:
        dmean = r.standard_normal(mean.shape).astype(mean.dtype)
        drstd = r.standard_normal(mean.shape).astype(mean.dtype)
    dx, dgamma, dbeta = hnp.group_norm_bwd(dy, x, mean, rstd, gamma, G, dmean, drstd, param_grads)
    rdx, rdg, rdb = group_norm_bwd_ref(x, gamma, dy, G, eps, dmean, drstd)
    tol = TOL[dtype][1]
    e_dx = rel_err(dx, rdx)
    assert dx.dtype == dtype
    assert e_dx < tol, f"dx error {e_dx}"
    if param_grads:
        assert dgamma.dtype == pdtype and dbeta.dtype == pdtype
        assert rel_err(dgamma, rdg) < tol, f"dgamma error {rel_err(dgamma, rdg)}"
        assert rel_err(dbeta, rdb) < tol, f"dbeta error {rel_err(dbeta, rdb)}"
    else:
        assert dgamma is None and dbeta is None


@over_shapes_and_dtype_pairs
def test_backward(shape, G, dtype, pdtype):
    check_backward(shape, G, dtype, pdtype)


@over_sd_unet
def test_backward_sd_unet(shape, G, dtype):
    check_backward(shape, G, dtype, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", [((2, 12, 5, 6), 3), ((3, 8, 7), 8), ((1, 16, 64, 64), 2)],
                         ids=ids)
def test_backward_stat_grads(shape, G, dtype):
    check_backward(shape, G, dtype, dtype, stat_grads=True)


def test_backward_no_param_grads():
    check_backward((2, 12, 5, 6), 3, np.float32, np.float32, param_grads=False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=ids)
def test_backward_large_offset(dtype):
    check_backward((2, 64, 16, 16), 8, dtype, dtype, offset=1000.0)


def test_deterministic():
    x, gamma, beta = make((2, 320, 64, 64), np.float16)
    a = hnp.group_norm_fwd(x, gamma, beta, 32)
    b = hnp.group_norm_fwd(x, gamma, beta, 32)
    for u, v in zip(a, b):
        assert u.tobytes() == v.tobytes()


def test_bad_dims_return_error():
    x, gamma, beta = make((2, 6, 4), np.float32)
    with pytest.raises(hnp.KernelError, match="divisible"):
        hnp.group_norm_fwd(x, gamma, beta, 4)


# -------------------------------------------------------------------------------------------------
# Fused activation (act_type): forward act(z), backward through the recomputed pre-activation

ACT_SHAPES = [((3, 8, 7), 4), ((2, 12, 5, 6), 3), ((4, 6), 6), ((1, 32, 64, 64), 2),
              ((2, 64, 16, 16), 32)]


@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize("dtype,pdtype", dtype_pairs(), ids=ids)
@pytest.mark.parametrize("shape,G", ACT_SHAPES, ids=ids)
def test_fused_activation(shape, G, dtype, pdtype, act):
    eps = 1e-5
    x, gamma, beta = make(shape, dtype, pdtype)
    y, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G, eps, act=act)
    r = rng(3)
    dy = r.standard_normal(shape).astype(dtype)
    dmean = r.standard_normal(mean.shape).astype(mean.dtype)
    drstd = r.standard_normal(mean.shape).astype(mean.dtype)
    dx, dgamma, dbeta = hnp.group_norm_bwd(dy, x, mean, rstd, gamma, G, dmean, drstd, True,
                                           beta=beta, eps=eps, act=act)
    ry, rm, rr = group_norm_ref(x, gamma, beta, G, eps, act=act)
    ftol, btol = TOL[dtype]
    assert rel_err(y, ry) < ftol, f"y error {rel_err(y, ry)}"
    assert rel_err(mean, rm) < ftol and rel_err(rstd, rr) < ftol  # the normalization statistics
    rdx, rdg, rdb = group_norm_bwd_ref(x, gamma, dy, G, eps, dmean, drstd, act=act, beta=beta)
    if act == "relu" and dtype == np.float16:
        btol *= 2  # z within fp16 rounding of relu's kink
    assert rel_err(dx, rdx) < btol, f"dx error {rel_err(dx, rdx)}"
    assert rel_err(dgamma, rdg) < btol, f"dgamma error {rel_err(dgamma, rdg)}"
    assert rel_err(dbeta, rdb) < btol, f"dbeta error {rel_err(dbeta, rdb)}"


def test_fused_activation_needs_beta():
    x, gamma, beta = make((2, 8, 5), np.float32)
    _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, 4, act="silu")
    with pytest.raises(hnp.KernelError, match="needs beta"):
        hnp.group_norm_bwd(np.ones_like(x), x, mean, rstd, gamma, 4, act="silu")
