"""GPU harness tests: the framework-free CUDA kernels vs float64 references and torch.

Runs only where torch with a CUDA device is importable (the H200 machine; no MXNet needed there):
    bash benchmarks/gpu/run_all.sh              # build + these tests + benchmark
    python -m pytest --confcutdir=tests/gpu tests/gpu -q
(--confcutdir keeps tests/conftest.py, which imports mxnet, out.) Anywhere else the whole module
is skipped, so the CPU CI's `pytest tests/` stays green.

References are float64 torch computations on the already-rounded inputs; errors are measured as
max|ours - ref| / max(1, max|ref|) against one tolerance table keyed by dtype.
"""
import math

import pytest

from gpu_common import DEV, DTYPES, gnh, ids, rel_err  # skips the module without torch / a device
import torch

# (forward tol, backward tol) on the relative max error
TOL = {torch.float16: (4e-3, 1.5e-2), torch.float32: (2e-5, 1e-4), torch.float64: (1e-11, 1e-9)}

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


def ref_gn(x, gamma, beta, G, eps):
    """float64 forward; returns (y, mean, rstd) as differentiable functions of the inputs."""
    N, C = x.shape[:2]
    xr = x.reshape(N, G, -1)
    mean = xr.mean(-1)
    var = ((xr - mean[..., None]) ** 2).mean(-1)
    rstd = 1.0 / torch.sqrt(var + eps)
    xh = ((xr - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    y = xh * gamma[None, :, None] + beta[None, :, None]
    return y.reshape(x.shape), mean, rstd


def make(shape, dtype, pdtype=None, offset=0.0, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + offset).to(dtype).to(DEV)
    pdtype = pdtype or dtype
    gamma = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(pdtype).to(DEV)
    beta = torch.randn(C, generator=g, dtype=torch.float64).to(pdtype).to(DEV)
    return x, gamma, beta


def dtype_pairs():
    return [(d, d) for d in DTYPES] + [(torch.float16, torch.float32)]


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
    mean, var = gnh.moments(x, G, use_workspace=use_ws)
    gnh.sync()
    assert mean.dtype == gnh.ACC[dtype] and var.dtype == gnh.ACC[dtype]
    xr = x.double().reshape(shape[0], G, -1)
    tol = TOL[dtype][0]
    assert rel_err(mean, xr.mean(-1)) < tol
    assert rel_err(var, xr.var(-1, unbiased=False)) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape,G", cases(SHAPES[:6]), ids=ids)
def test_moments_backward(shape, G, dtype):
    x, _, _ = make(shape, dtype)
    mean, _ = gnh.moments(x, G)
    dmean = torch.randn_like(mean)
    dvar = torch.randn_like(mean)
    dx = gnh.moments_bwd(dmean, dvar, x, mean, G)
    xd = x.detach().to(torch.float64, copy=True).requires_grad_(True)
    xr = xd.reshape(shape[0], G, -1)
    m = xr.mean(-1)
    v = ((xr - m[..., None]) ** 2).mean(-1)
    (m * dmean.double() + v * dvar.double()).sum().backward()
    gnh.sync()
    assert rel_err(dx, xd.grad) < TOL[dtype][1]


# -------------------------------------------------------------------------------------------------
# group_norm forward / backward


def check_forward(shape, G, dtype, pdtype, use_ws=True, offset=0.0, eps=1e-5):
    x, gamma, beta = make(shape, dtype, pdtype, offset)
    y, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, G, eps, use_workspace=use_ws)
    gnh.sync()
    ry, rm, rr = ref_gn(x.double(), gamma.double(), beta.double(), G, eps)
    tol = TOL[dtype][0]
    assert y.dtype == dtype and mean.dtype == gnh.ACC[dtype] and rstd.dtype == gnh.ACC[dtype]
    e_y = rel_err(y, ry)
    assert e_y < tol, f"y error {e_y}"
    assert rel_err(mean, rm) < tol
    assert rel_err(rstd, rr) < tol
    if pdtype == dtype:  # torch's own kernel, same storage dtype, same rounded inputs
        ty = torch.nn.functional.group_norm(x, G, gamma, beta, eps)
        e_t = rel_err(ty, ry)
        assert e_y <= max(tol, 2 * e_t), f"ours {e_y} vs torch {e_t}"
    return x, gamma, beta, y, mean, rstd


@over_shapes_and_dtype_pairs
def test_forward(shape, G, dtype, pdtype):
    check_forward(shape, G, dtype, pdtype)


@over_sd_unet
def test_forward_sd_unet(shape, G, dtype):
    check_forward(shape, G, dtype, dtype)


@pytest.mark.parametrize("shape,G", [((2, 320, 64, 64), 32), ((1, 32, 128, 128), 1)], ids=ids)
def test_forward_no_workspace(shape, G):
    check_forward(shape, G, torch.float32, torch.float32, use_ws=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=ids)
def test_forward_large_offset(dtype):
    # |mean| >> std: one-pass Welford must not lose the variance (Apex-style offset test).
    check_forward((2, 64, 32, 32), 8, dtype, dtype, offset=1000.0)


def test_forward_constant_group_is_finite():
    x = torch.full((2, 8, 4, 4), 3.0, device=DEV)
    gamma = torch.ones(8, device=DEV)
    beta = torch.zeros(8, device=DEV)
    y, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, 4)
    gnh.sync()
    assert torch.isfinite(y).all() and torch.allclose(mean, torch.full_like(mean, 3.0))
    assert torch.allclose(rstd, torch.full_like(rstd, 1 / math.sqrt(1e-5)), rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_forward_misaligned(dtype):
    # Offset views: 16-byte vector loads are not allowed, the scalar path must be taken.
    shape, G = (2, 16, 8, 8), 4
    x0, gamma, beta = make(shape, dtype)
    buf = torch.empty(x0.numel() + 1, dtype=dtype, device=DEV)
    x = buf[1:].view(shape)
    x.copy_(x0)
    y, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, G)
    gnh.sync()
    ry, _, _ = ref_gn(x.double(), gamma.double(), beta.double(), G, 1e-5)
    assert rel_err(y, ry) < TOL[dtype][0]


def check_backward(shape, G, dtype, pdtype, stat_grads=False, param_grads=True, offset=0.0):
    eps = 1e-5
    x, gamma, beta = make(shape, dtype, pdtype, offset)
    y, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, G, eps)
    g = torch.Generator(device="cpu").manual_seed(7)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    dmean = drstd = None
    if stat_grads:
        dmean = torch.randn(mean.shape, generator=g, dtype=torch.float64).to(mean.dtype).to(DEV)
        drstd = torch.randn(mean.shape, generator=g, dtype=torch.float64).to(mean.dtype).to(DEV)
    dx, dgamma, dbeta = gnh.group_norm_bwd(dy, x, mean, rstd, gamma, G, dmean, drstd, param_grads)
    gnh.sync()

    xd = x.detach().to(torch.float64, copy=True).requires_grad_(True)
    gd = gamma.detach().to(torch.float64, copy=True).requires_grad_(True)
    bd = beta.detach().to(torch.float64, copy=True).requires_grad_(True)
    ry, rm, rr = ref_gn(xd, gd, bd, G, eps)
    loss = (ry * dy.double()).sum()
    if stat_grads:
        loss = loss + (rm * dmean.double()).sum() + (rr * drstd.double()).sum()
    loss.backward()
    tol = TOL[dtype][1]
    e_dx = rel_err(dx, xd.grad)
    assert dx.dtype == dtype
    assert e_dx < tol, f"dx error {e_dx}"
    if param_grads:
        assert dgamma.dtype == pdtype and dbeta.dtype == pdtype
        assert rel_err(dgamma, gd.grad) < tol, f"dgamma error {rel_err(dgamma, gd.grad)}"
        assert rel_err(dbeta, bd.grad) < tol, f"dbeta error {rel_err(dbeta, bd.grad)}"
    if pdtype == dtype and not stat_grads:
        xt = x.detach().clone().requires_grad_(True)
        gt = gamma.detach().clone().requires_grad_(True)
        bt = beta.detach().clone().requires_grad_(True)
        torch.nn.functional.group_norm(xt, G, gt, bt, eps).backward(dy)
        e_t = rel_err(xt.grad, xd.grad)
        assert e_dx <= max(tol, 2 * e_t), f"ours {e_dx} vs torch {e_t}"


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
    check_backward((2, 12, 5, 6), 3, torch.float32, torch.float32, param_grads=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=ids)
def test_backward_large_offset(dtype):
    check_backward((2, 64, 16, 16), 8, dtype, dtype, offset=1000.0)


def test_deterministic():
    x, gamma, beta = make((2, 320, 64, 64), torch.float16)
    a = [t.clone() for t in gnh.group_norm_fwd(x, gamma, beta, 32)]
    b = gnh.group_norm_fwd(x, gamma, beta, 32)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_bad_dims_return_error():
    x, gamma, beta = make((2, 6, 4), torch.float32)
    with pytest.raises(RuntimeError, match="divisible"):
        gnh.group_norm_fwd(x, gamma, beta, 4)


# -------------------------------------------------------------------------------------------------
# Fused activation (act_type): forward act(z), backward through the recomputed pre-activation

ACT_SHAPES = [((3, 8, 7), 4), ((2, 12, 5, 6), 3), ((4, 6), 6), ((1, 32, 64, 64), 2),
              ((2, 64, 16, 16), 32)]


def ref_act(z, act):
    return torch.relu(z) if act == "relu" else z * torch.sigmoid(z)


@pytest.mark.parametrize("act", ["relu", "silu"])
@pytest.mark.parametrize("dtype,pdtype", dtype_pairs(), ids=ids)
@pytest.mark.parametrize("shape,G", ACT_SHAPES, ids=ids)
def test_fused_activation(shape, G, dtype, pdtype, act):
    eps = 1e-5
    x, gamma, beta = make(shape, dtype, pdtype)
    y, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, G, eps, act=act)
    g = torch.Generator(device="cpu").manual_seed(3)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(DEV)
    dmean = torch.randn(mean.shape, generator=g, dtype=torch.float64).to(mean.dtype).to(DEV)
    drstd = torch.randn(mean.shape, generator=g, dtype=torch.float64).to(mean.dtype).to(DEV)
    dx, dgamma, dbeta = gnh.group_norm_bwd(dy, x, mean, rstd, gamma, G, dmean, drstd, True,
                                           beta=beta, eps=eps, act=act)
    gnh.sync()
    xd = x.detach().to(torch.float64, copy=True).requires_grad_(True)
    gd = gamma.detach().to(torch.float64, copy=True).requires_grad_(True)
    bd = beta.detach().to(torch.float64, copy=True).requires_grad_(True)
    rz, rm, rr = ref_gn(xd, gd, bd, G, eps)
    ry = ref_act(rz, act)
    ftol, btol = TOL[dtype]
    assert rel_err(y, ry) < ftol, f"y error {rel_err(y, ry)}"
    assert rel_err(mean, rm) < ftol and rel_err(rstd, rr) < ftol  # the normalization statistics
    (((ry * dy.double()).sum() + (rm * dmean.double()).sum() + (rr * drstd.double()).sum())
     .backward())
    if act == "relu" and dtype == torch.float16:
        btol *= 2  # z within fp16 rounding of relu's kink
    assert rel_err(dx, xd.grad) < btol, f"dx error {rel_err(dx, xd.grad)}"
    assert rel_err(dgamma, gd.grad) < btol, f"dgamma error {rel_err(dgamma, gd.grad)}"
    assert rel_err(dbeta, bd.grad) < btol, f"dbeta error {rel_err(dbeta, bd.grad)}"


def test_fused_activation_needs_beta():
    x, gamma, beta = make((2, 8, 5), torch.float32)
    y, mean, rstd = gnh.group_norm_fwd(x, gamma, beta, 4, act="silu")
    with pytest.raises(RuntimeError, match="needs beta"):
        gnh.group_norm_bwd(torch.ones_like(x), x, mean, rstd, gamma, 4, act="silu")
