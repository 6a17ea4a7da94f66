"""``python -m gn_mx.selftest``: check gn_mx on this machine's CPU and on every GPU MXNet sees.

Runs, on each device:
  * the numerical edge cases of gn_group_norm / gn_moments (the one list, gn_mx/_edge_cases.py,
    which the project's CI runs on the CPU and on the CUDA kernels too);
  * forward and gradient checks of every op (gn_group_norm with each fused activation, gn_moments,
    gn_dbn ZCA and IterNorm, gn_dbn_inference, gn_channel_affine) in float16, float32 and float64,
    0 to 3 spatial dimensions, against float64 references computed on the CPU with numpy
    (gn_mx/_reference.py; IterNorm's gradient by central differences of its float64 forward),
    gn_weight_standardize forward and gradient, gn_group_norm on channels-last data (axis=-1) and
    its double backward; the synchronized-DBN ops (CPU-only, checked on the CPU): gn_sync_sum
    with one device, gn_dbn_whiten (ZCA, IterNorm) of a known covariance, gn_dbn_apply,
    gn_dbn_local_sums / gn_dbn_local_cov (group sums, mean, covariance);
  * a short timing table: gn_mx's GroupNorm next to MXNet's own GroupNorm and BatchNorm.
It prints a report (gn_mx build, MXNet, GPUs with driver and CUDA versions, PASS/FAIL per check
with the error's message, timings) and exits 0 when every check passed, 1 when one failed, 2 when
it could not start (one line with the reason, e.g. a GPU asked for that cannot be used).

    python -m gn_mx.selftest                  # every device
    python -m gn_mx.selftest --cpu            # the CPU only
    python -m gn_mx.selftest --gpus 0,1 --no-timing
Please attach the whole report to a bug report (docs/selftest.md).
"""
import argparse
import ctypes
import os
import platform
import re
import sys
import time
import warnings

import numpy as np

from . import _edge_cases, _reference as ref
from ._tolerances import FD_TOL, GRAD_TOL, TOL, tol

DTYPES = (np.float16, np.float32, np.float64)
# 0 to 3 spatial dimensions, C = 6 (G = 1, 2, 3 and 6 all divide it).
SHAPES = ((8, 6), (3, 6, 5), (2, 6, 3, 4), (2, 6, 2, 3, 2))
# Gradients against central differences: GRAD_TOL, at least FD_TOL.
FD_GRAD_TOL = {d: tuple(max(a, b) for a, b in zip(GRAD_TOL[d], FD_TOL)) for d in GRAD_TOL}


class MxRunner:
    """The edge cases' runner interface (gn_mx/_edge_cases.py) on mx.nd.gn_group_norm /
    gn_moments on `ctx` (tests/test_edge_cases.py uses it too)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.name = str(ctx)

    def _nd(self, a, dtype=None):
        import mxnet as mx
        a = np.asarray(a)
        return mx.nd.array(a, ctx=self.ctx, dtype=dtype or a.dtype)

    def group_norm(self, x, gamma, beta, G, eps, act=None, dy=None, dmean=None, drstd=None,
                   axis=1):
        import mxnet as mx
        from mxnet import autograd
        xs, gs, bs = self._nd(x), self._nd(gamma), self._nd(beta)
        for a in (xs, gs, bs):
            a.attach_grad()
        kw = {} if act is None else {"act_type": act}
        kw.update({} if axis == 1 else {"axis": axis})
        with autograd.record():
            y, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps, **kw)
        res = {"y": y, "mean": mean, "rstd": rstd}
        if dy is not None:
            heads, grads = [y], [self._nd(dy)]
            if dmean is not None or drstd is not None:
                zero = np.zeros(mean.shape)
                heads += [mean, rstd]
                grads += [self._nd(zero if dmean is None else dmean, mean.dtype),
                          self._nd(zero if drstd is None else drstd, rstd.dtype)]
            autograd.backward(heads, grads)
            res.update(dx=xs.grad, dgamma=gs.grad, dbeta=bs.grad)
        return {k: v.asnumpy() for k, v in res.items()}

    def moments(self, x, G, dmean=None, dvar=None, axis=1):
        import mxnet as mx
        from mxnet import autograd
        xs = self._nd(x)
        xs.attach_grad()
        kw = {} if axis == 1 else {"axis": axis}
        with autograd.record():
            mean, var = mx.nd.gn_moments(xs, num_groups=G, **kw)
        res = {"mean": mean, "var": var}
        if dmean is not None:
            autograd.backward([mean, var], [self._nd(dmean, mean.dtype), self._nd(dvar, var.dtype)])
            res["dx"] = xs.grad
        return {k: v.asnumpy() for k, v in res.items()}


# ------------------------------------------------------------------------------------------------
# Op checks: each returns the largest error relative to its tolerance (<= 1 passes) or raises.


def _close(name, got, want, dtype, table):
    """max |got - want| / (atol + rtol |want|); raises AssertionError above 1 (or on NaN)."""
    rtol, atol = tol(dtype, table)
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {got.shape}, expected {want.shape}")
    r = float(np.max(np.abs(got - want) / (atol + rtol * np.abs(want)), initial=0.0))
    if not np.all(np.isfinite(got)) or not r <= 1.0:
        raise AssertionError(f"{name}: off by {r:.3g} x the tolerance (rtol {rtol:g}, atol {atol:g})")
    return r


def _data(shape, dtype, seed, offset=0.0):
    rng = np.random.RandomState(seed)
    return (rng.randn(*shape) + offset).astype(dtype)


def _nd(ctx, a, dtype=None):
    import mxnet as mx
    return mx.nd.array(a, ctx=ctx, dtype=dtype or np.asarray(a).dtype)


def check_group_norm(ctx, dtype, shape, act):
    G = 3 if shape[1] % 3 == 0 else 1
    x, dy = _data(shape, dtype, 1, 0.5), _data(shape, dtype, 2)
    gamma, beta = _data(shape[1:2], dtype, 3), _data(shape[1:2], dtype, 4)
    r = MxRunner(ctx).group_norm(x, gamma, beta, G, 1e-5, act=act, dy=dy)
    y, mean, rstd = ref.group_norm_ref(x, gamma, beta, G, 1e-5, act=act)
    dx, dg, db = ref.group_norm_bwd_ref(x, gamma, dy, G, 1e-5, act=act, beta=beta)
    return max(_close("y", r["y"], y, dtype, TOL), _close("mean", r["mean"], mean, dtype, TOL),
               _close("rstd", r["rstd"], rstd, dtype, TOL),
               _close("dx", r["dx"], dx, dtype, GRAD_TOL),
               _close("dgamma", r["dgamma"], dg, dtype, GRAD_TOL),
               _close("dbeta", r["dbeta"], db, dtype, GRAD_TOL))


def check_moments(ctx, dtype, shape):
    x = _data(shape, dtype, 5, 2.0)
    G = 2
    mean, var = ref.moments_ref(x, G)
    dmean, dvar = _data(mean.shape, np.float64, 6), _data(mean.shape, np.float64, 7)
    r = MxRunner(ctx).moments(x, G, dmean=dmean, dvar=dvar)
    return max(_close("mean", r["mean"], mean, dtype, TOL), _close("var", r["var"], var, dtype, TOL),
               _close("dx", r["dx"], ref.moments_bwd_ref(x, G, dmean, dvar), dtype, GRAD_TOL))


def _dbn_stats(ctx, C, G, dtype):
    import mxnet as mx
    sd = np.float32 if dtype == np.float16 else dtype
    return (mx.nd.zeros((C,), ctx=ctx, dtype=sd),
            _nd(ctx, np.tile(np.eye(C // G), (G, 1, 1)), sd))


def _dbn_run(ctx, x, dy, G, eps, **kw):
    import mxnet as mx
    from mxnet import autograd
    rm, rp = _dbn_stats(ctx, x.shape[1], G, x.dtype.type)
    xs = _nd(ctx, x)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=eps, **kw)[0]
    y.backward(_nd(ctx, dy))
    return y.asnumpy(), xs.grad.asnumpy()


def _dbn_shape(shape):
    """DBN needs more samples than the group size for a well-conditioned covariance."""
    return (max(shape[0], 24 // int(np.prod(shape[2:]))) ,) + shape[1:]


def check_dbn_zca(ctx, dtype, shape):
    shape, G, eps = _dbn_shape(shape), 2, 1e-3
    x, dy = _data(shape, dtype, 8), _data(shape, dtype, 9)
    y, dx = _dbn_run(ctx, x, dy, G, eps)
    return max(_close("y", y, ref.dbn_ref(x, G, eps)[0], dtype, TOL),
               _close("dx", dx, ref.dbn_bwd_ref(x, dy, G, eps), dtype, GRAD_TOL))


def check_dbn_iternorm(ctx, dtype, shape, T=5):
    shape, G, eps = _dbn_shape(shape), 2, 1e-3
    x, dy = _data(shape, dtype, 10), _data(shape, dtype, 11)
    y, dx = _dbn_run(ctx, x, dy, G, eps, whitening="iternorm", iterations=T)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    fd = ref.numeric_grad(lambda z: float((ref.iternorm_ref(z, G, eps, T)[0] * dy64).sum()), x64)
    return max(_close("y", y, ref.iternorm_ref(x, G, eps, T)[0], dtype, TOL),
               _close("dx", dx, fd, dtype, FD_GRAD_TOL))


def check_dbn_inference(ctx, dtype, shape):
    import mxnet as mx
    from mxnet import autograd
    G, C = 2, shape[1]
    x, dy = _data(shape, dtype, 12), _data(shape, dtype, 13)
    sd = np.float32 if dtype == np.float16 else dtype
    rm = _data((C,), sd, 14)
    rp = (np.tile(np.eye(C // G), (G, 1, 1)) + 0.3 * _data((G, C // G, C // G), np.float64, 15))
    rp = rp.astype(sd)
    xs = _nd(ctx, x)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_dbn_inference(xs, _nd(ctx, rm), _nd(ctx, rp), num_groups=G)
    y.backward(_nd(ctx, dy))
    return max(_close("y", y.asnumpy(), ref.dbn_inference_ref(x, rm, rp, G), dtype, TOL),
               _close("dx", xs.grad.asnumpy(), ref.dbn_inference_bwd_ref(dy, rp, G), dtype,
                      GRAD_TOL))


def check_channel_affine(ctx, dtype, shape):
    import mxnet as mx
    from mxnet import autograd
    x, dy = _data(shape, dtype, 16), _data(shape, dtype, 17)
    g, b = _data(shape[1:2], dtype, 18), _data(shape[1:2], dtype, 19)
    xs, gs, bs = _nd(ctx, x), _nd(ctx, g), _nd(ctx, b)
    for a in (xs, gs, bs):
        a.attach_grad()
    with autograd.record():
        y = mx.nd.gn_channel_affine(xs, gs, bs)
    y.backward(_nd(ctx, dy))
    dx, dg, db = ref.channel_affine_bwd_ref(x, g, dy)
    return max(_close("y", y.asnumpy(), ref.channel_affine_ref(x, g, b), dtype, TOL),
               _close("dx", xs.grad.asnumpy(), dx, dtype, GRAD_TOL),
               _close("dgamma", gs.grad.asnumpy(), dg, dtype, GRAD_TOL),
               _close("dbeta", bs.grad.asnumpy(), db, dtype, GRAD_TOL))


def _ws_ref(w, gain, eps):
    rows = w.reshape(w.shape[0], -1).astype(np.float64)
    mean, var = rows.mean(1, keepdims=True), rows.var(1, keepdims=True)
    return ((rows - mean) / np.sqrt(var + eps) * np.asarray(gain, np.float64)[:, None]).reshape(
        w.shape)


def check_weight_standardize(ctx, dtype, shape):
    """gn_weight_standardize forward and weight gradient (central differences of the float64
    reference) on an (O, *fan_in) weight."""
    import mxnet as mx
    from mxnet import autograd
    w, dy = _data(shape, dtype, 20), _data(shape, dtype, 21)
    gain = (1.0 + 0.5 * _data(shape[:1], np.float64, 22)).astype(dtype)
    ws = _nd(ctx, w)
    ws.attach_grad()
    with autograd.record():
        y = mx.nd.gn_weight_standardize(ws, _nd(ctx, gain), eps=1e-5)[0]
    y.backward(_nd(ctx, dy))
    dy64 = dy.astype(np.float64)
    fd = ref.numeric_grad(lambda z: float((_ws_ref(z, gain, 1e-5) * dy64).sum()), w)
    return max(_close("y", y.asnumpy(), _ws_ref(w, gain, 1e-5), dtype, TOL),
               _close("dw", ws.grad.asnumpy(), fd, dtype, FD_GRAD_TOL))


def check_group_norm_channels_last(ctx, dtype, shape):
    """gn_group_norm(axis=-1) on (N, *spatial, C) data against the channels-first reference."""
    G = 3
    x_cf, dy_cf = _data(shape, dtype, 23, 0.5), _data(shape, dtype, 24)
    gamma, beta = _data(shape[1:2], dtype, 25), _data(shape[1:2], dtype, 26)
    last = lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))  # noqa: E731
    r = MxRunner(ctx).group_norm(last(x_cf), gamma, beta, G, 1e-5, dy=last(dy_cf), axis=-1)
    y = ref.group_norm_ref(x_cf, gamma, beta, G, 1e-5)[0]
    dx, dg, db = ref.group_norm_bwd_ref(x_cf, gamma, dy_cf, G, 1e-5)
    return max(_close("y", r["y"], last(y), dtype, TOL),
               _close("dx", r["dx"], last(dx), dtype, GRAD_TOL),
               _close("dgamma", r["dgamma"], dg, dtype, GRAD_TOL),
               _close("dbeta", r["dbeta"], db, dtype, GRAD_TOL))


def check_group_norm_double_backward(ctx, dtype, shape):
    """d/dx of <w, d<v, gn_group_norm(x)>/dx> (autograd.grad with create_graph) against central
    differences of the float64 reference's first-order gradient."""
    import mxnet as mx
    from mxnet import autograd
    G = 3
    x, v, w = _data(shape, dtype, 27, 0.5), _data(shape, dtype, 28), _data(shape, dtype, 29)
    gamma, beta = _data(shape[1:2], dtype, 30), _data(shape[1:2], dtype, 31)
    xs = _nd(ctx, x)
    xs.attach_grad()
    with autograd.record():
        y = mx.nd.gn_group_norm(xs, _nd(ctx, gamma), _nd(ctx, beta), num_groups=G, eps=1e-5)[0]
        dx = autograd.grad(y, [xs], head_grads=_nd(ctx, v), create_graph=True,
                           retain_graph=True)[0]
        z = (dx * _nd(ctx, w)).sum()
    z.backward()
    v64, w64 = v.astype(np.float64), w.astype(np.float64)
    fd = ref.numeric_grad(lambda t: float(
        (ref.group_norm_bwd_ref(t, gamma, v64, G, 1e-5)[0] * w64).sum()), x)
    return _close("d2x", xs.grad.asnumpy(), fd, dtype, _D2_TOL)


# Second derivatives: central differences of a first derivative lose more digits than FD_TOL.
_D2_TOL = {d: tuple(max(a, b) for a, b in zip(GRAD_TOL[d], (1e-4, 1e-5))) for d in GRAD_TOL}



# The synchronized-DBN ops (gn_mx/sync.py) are CPU-only: their checks run on the CPU on every device.
_SYNC_KEYS = iter(range(1 << 62))


def check_sync_sum(ctx, shape):
    """gn_sync_sum with num_devices=1 (one caller completes the round): out == data, grad == dy."""
    import mxnet as mx
    from mxnet import autograd
    x, dy = _data(shape, np.float64, 32), _data(shape, np.float64, 33)
    xs = _nd(mx.cpu(), x)
    xs.attach_grad()
    key = f"gn_mx.selftest/{os.getpid()}/{next(_SYNC_KEYS)}"
    with autograd.record():
        y = mx.nd.gn_sync_sum(xs, key=key, num_devices=1, timeout=10)
    y.backward(_nd(mx.cpu(), dy))
    return max(_close("out", y.asnumpy(), x, np.float64, TOL),
               _close("ddata", xs.grad.asnumpy(), dy, np.float64, GRAD_TOL))


def _whiten_ref(cov, eps, whitening, T):
    """W (G, D, D) of a covariance (eps added here, as the op does): ZCA or IterNorm."""
    out = []
    for S in cov + eps * np.eye(cov.shape[-1]):
        if whitening == "zca":
            lam, U = np.linalg.eigh(S)
            out.append(U @ np.diag(1 / np.sqrt(lam)) @ U.T)
            continue
        tr = np.trace(S)
        Sn, P = S / tr, np.eye(len(S))
        for _ in range(T):
            P = 1.5 * P - 0.5 * P @ P @ P @ Sn
        out.append(P / np.sqrt(tr))
    return np.array(out)


def check_dbn_whiten(ctx, whitening, G=2, D=3, T=5):
    """gn_dbn_whiten's W of a known covariance against the float64 numpy whitening matrix."""
    import mxnet as mx
    A = _data((G, D, 4 * D), np.float64, 34)
    cov = np.einsum("gik,gjk->gij", A, A) / A.shape[-1]
    f64 = lambda a: _nd(mx.cpu(), a, "float64")  # noqa: E731
    W = mx.nd.gn_dbn_whiten(f64(cov), f64(np.zeros(G * D)), f64(np.zeros(G * D)),
                            f64(np.zeros((G, D, D))), eps=1e-3, whitening=whitening,
                            iterations=T)[0]
    return _close("W", W.asnumpy(), _whiten_ref(cov, 1e-3, whitening, T), np.float64, TOL)


def check_dbn_apply(ctx, dtype, shape, G=2):
    """gn_dbn_apply: out = gamma[c] (W_g (x - mean))[c] + beta[c] against float64 numpy."""
    import mxnet as mx
    C, D = shape[1], shape[1] // G
    x = _data(shape, dtype, 35)
    sd = np.float32 if dtype == np.float16 else dtype
    gamma, beta = _data((C,), sd, 36, 1.0), _data((C,), sd, 37)
    mean, W = _data((C,), np.float64, 38), _data((G, D, D), np.float64, 39)
    cpu = mx.cpu()
    y = mx.nd.gn_dbn_apply(_nd(cpu, x), _nd(cpu, gamma), _nd(cpu, beta), _nd(cpu, mean),
                           _nd(cpu, W), num_groups=G)
    return _close("out", y.asnumpy(), _dbn_apply_ref(x, gamma, beta, mean, W), dtype, TOL)


def _dbn_apply_ref(x, gamma, beta, mean, W):
    """gamma[c] (W_g (x - mean))[c] + beta[c] in float64, channels split into G = len(W) groups."""
    N, C, G = x.shape[0], x.shape[1], len(W)
    bshape = (1, C) + (1,) * (x.ndim - 2)
    xg = (x.astype(np.float64) - mean.reshape(bshape)).reshape((N, G, C // G, -1))
    y = np.einsum("gij,ngjs->ngis", W, xg).reshape(x.shape)
    return y * gamma.astype(np.float64).reshape(bshape) + beta.astype(np.float64).reshape(bshape)


def check_dbn_local_stats(ctx, dtype, shape, G=2):
    """gn_dbn_local_sums / gn_dbn_local_cov of one device: the group sums and count, the mean and
    covariance against float64 numpy."""
    import mxnet as mx
    N, C, D = shape[0], shape[1], shape[1] // G
    x = _data(shape, dtype, 40)
    xs = _nd(mx.cpu(), x)
    tot = mx.nd.gn_dbn_local_sums(xs, num_groups=G)
    cov, mean = mx.nd.gn_dbn_local_cov(xs, tot, num_groups=G)
    cols = x.astype(np.float64).reshape((N, G, D, -1)).transpose(1, 2, 0, 3).reshape((G, D, -1))
    m = cols.shape[-1]
    mu = cols.mean(axis=2, keepdims=True)
    want_tot = np.concatenate([cols.sum(axis=2), np.full((G, 1), float(m))], axis=1)
    want_cov = np.einsum("gik,gjk->gij", cols - mu, cols - mu) / m
    return max(_close("tot", tot.asnumpy(), want_tot, np.float64, TOL),
               _close("mean", mean.asnumpy(), mu.reshape(-1), np.float64, TOL),
               _close("cov", cov.asnumpy(), want_cov, np.float64, TOL))


#: Every op of the library (``_library.OPS``) -> the prefix of its checks' names.
CHECKED_OPS = {"gn_group_norm": "group_norm", "gn_moments": "moments", "gn_dbn": "dbn zca",
               "gn_dbn_inference": "dbn_inference", "gn_channel_affine": "channel_affine",
               "gn_weight_standardize": "weight_standardize", "gn_sync_sum": "sync_sum",
               "gn_dbn_whiten": "dbn_whiten", "gn_dbn_apply": "dbn_apply",
               "gn_dbn_local_sums": "dbn_local_stats", "gn_dbn_local_cov": "dbn_local_stats"}


def op_checks():
    """[(name, function(ctx) -> error ratio)] of every op, dtype and 0-3 spatial dims."""
    out = []
    for dtype in DTYPES:
        dn = np.dtype(dtype).name
        for shape in SHAPES:
            sn = "x".join(map(str, shape))
            for act in (None, "relu", "silu"):
                out.append((f"group_norm {dn} {sn} act={act or 'none'}",
                            lambda c, d=dtype, s=shape, a=act: check_group_norm(c, d, s, a)))
            out.append((f"moments {dn} {sn}", lambda c, d=dtype, s=shape: check_moments(c, d, s)))
            out.append((f"channel_affine {dn} {sn}",
                        lambda c, d=dtype, s=shape: check_channel_affine(c, d, s)))
            out.append((f"dbn_inference {dn} {sn}",
                        lambda c, d=dtype, s=shape: check_dbn_inference(c, d, s)))
        for shape in SHAPES[1:]:
            sn = "x".join(map(str, shape))
            out.append((f"group_norm axis=-1 {dn} {sn}",
                        lambda c, d=dtype, s=shape: check_group_norm_channels_last(c, d, s)))
        for shape in ((4, 6), (4, 2, 3, 3)):
            out.append((f"weight_standardize {dn} {'x'.join(map(str, shape))}",
                        lambda c, d=dtype, s=shape: check_weight_standardize(c, d, s)))
        out.append((f"group_norm double backward {dn} 2x6x4",
                    lambda c, d=dtype: check_group_norm_double_backward(c, d, (2, 6, 4))))
        for shape in (SHAPES[0], SHAPES[2]):
            sn = "x".join(map(str, _dbn_shape(shape)))
            out.append((f"dbn zca {dn} {sn}", lambda c, d=dtype, s=shape: check_dbn_zca(c, d, s)))
            out.append((f"dbn iternorm {dn} {sn}",
                        lambda c, d=dtype, s=shape: check_dbn_iternorm(c, d, s)))
        out.append((f"dbn_apply {dn} 3x4x2x2",
                    lambda c, d=dtype: check_dbn_apply(c, d, (3, 4, 2, 2))))
        out.append((f"dbn_local_stats {dn} 3x4x2x2",
                    lambda c, d=dtype: check_dbn_local_stats(c, d, (3, 4, 2, 2))))
    out.append(("sync_sum float64 2x3", lambda c: check_sync_sum(c, (2, 3))))
    for whitening in ("zca", "iternorm"):
        out.append((f"dbn_whiten {whitening} float64 2x3x3",
                    lambda c, w=whitening: check_dbn_whiten(c, w)))
    return out


# ------------------------------------------------------------------------------------------------
# The machine


def _cuda_driver_info():
    """(driver CUDA version, [(name, 'major.minor', total MB)]) from libcuda, or (None, [])."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, []
    if cu.cuInit(0) != 0:
        return None, []
    ver, n = ctypes.c_int(0), ctypes.c_int(0)
    cu.cuDriverGetVersion(ctypes.byref(ver))
    cu.cuDeviceGetCount(ctypes.byref(n))
    gpus = []
    for i in range(n.value):
        dev, name = ctypes.c_int(0), ctypes.create_string_buffer(128)
        major, minor, mem = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_size_t(0)
        cu.cuDeviceGet(ctypes.byref(dev), i)
        cu.cuDeviceGetName(name, 128, dev)
        cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
        cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
        cu.cuDeviceTotalMem_v2(ctypes.byref(mem), dev)
        gpus.append((name.value.decode(errors="replace"), f"{major.value}.{minor.value}",
                     mem.value >> 20))
    return ver.value, gpus


def _nvidia_driver():
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda_version(v):
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"


def machine_report(gpu_ids):
    import mxnet as mx
    from . import build_info, library_path
    info = build_info()
    feats = mx.runtime.Features()
    lines = [f"gn_mx selftest  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
             f"build      {info['summary']}",
             f"library    {library_path()}",
             f"MXNet      {mx.__version__} (CUDA {'on' if feats.is_enabled('CUDA') else 'off'}, "
             f"cuDNN {'on' if feats.is_enabled('CUDNN') else 'off'}), numpy {np.__version__}, "
             f"Python {platform.python_version()}, {platform.platform()}",
             f"CPU        {_cpu_model()}, {os.cpu_count()} logical cores, "
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"]
    drv, gpus = _cuda_driver_info()
    if drv is not None or gpu_ids:
        lines.append(f"Driver     {_nvidia_driver() or 'unknown'}; driver CUDA {_cuda_version(drv)}")
        for i in gpu_ids:
            name, cc, mb = gpus[i] if i < len(gpus) else ("unknown", "?", 0)
            lines.append(f"GPU {i}      {name}, compute capability {cc}, {mb} MiB")
    else:
        lines.append("GPUs       none visible to MXNet")
    return lines


# ------------------------------------------------------------------------------------------------
# Timing


def _time_ms(fn, repeat):
    import mxnet as mx
    fn()
    mx.nd.waitall()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        mx.nd.waitall()
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def timing_rows(ctx, gpu):
    """[(case, gn_mx GroupNorm, MXNet GroupNorm, MXNet BatchNorm)] forward + backward, ms."""
    import mxnet as mx
    from mxnet import autograd
    shape, G = ((32, 256, 28, 28), 32) if gpu else ((8, 64, 28, 28), 32)
    rows = []
    for dtype in ((np.float32, np.float16) if gpu else (np.float32,)):
        C = shape[1]
        x = mx.nd.random.normal(shape=shape, ctx=ctx).astype(dtype)
        g, b = mx.nd.ones((C,), ctx=ctx, dtype=dtype), mx.nd.zeros((C,), ctx=ctx, dtype=dtype)
        x.attach_grad()
        g.attach_grad()
        b.attach_grad()
        # MXNet's GroupNorm takes (num_groups,) gamma / beta; its BatchNorm float32 params.
        pg = [mx.nd.ones((G,), ctx=ctx, dtype=dtype), mx.nd.zeros((G,), ctx=ctx, dtype=dtype)]
        pb = [mx.nd.ones((C,), ctx=ctx), mx.nd.zeros((C,), ctx=ctx),
              mx.nd.zeros((C,), ctx=ctx), mx.nd.ones((C,), ctx=ctx)]
        for p in pg + pb[:2]:
            p.attach_grad()

        def ours():
            with autograd.record():
                y = mx.nd.gn_group_norm(x, g, b, num_groups=G, eps=1e-5)[0]
            y.backward()

        def mx_gn():
            with autograd.record():
                y = mx.nd.GroupNorm(x, pg[0], pg[1], num_groups=G, eps=1e-5)
            y.backward()

        def mx_bn():
            with autograd.record():
                y = mx.nd.BatchNorm(x, *pb, fix_gamma=False)
            y.backward()

        repeat = 10 if gpu else 3
        vals = []
        for fn in (ours, mx_gn, mx_bn):
            try:
                vals.append(f"{_time_ms(fn, repeat):.3f}")
            except Exception as e:  # an MXNet op missing for this dtype/device is a note, not a failure
                vals.append("n/a (" + str(e).splitlines()[0][:40] + ")")
        rows.append((f"{'x'.join(map(str, shape))} G={G} {np.dtype(dtype).name}", *vals))
    return rows


# ------------------------------------------------------------------------------------------------


def _run_device(ctx, label, out, edge=True, ops=True):
    """Run the checks on ctx; print per-check lines; return the number of failures."""
    failed = 0
    if edge:
        families, fails = {}, []
        t0 = time.perf_counter()
        for case in _edge_cases.CASES:
            fam = case.id.split("[", 1)[0]
            ok = True
            try:
                case(MxRunner(ctx))
            except Exception as e:  # noqa: BLE001 (a failed check is reported, never fatal)
                ok = False
                fails.append((case.id, _first_line(e)))
            n, p = families.get(fam, (0, 0))
            families[fam] = (n + 1, p + ok)
        out(f"  edge cases ({len(_edge_cases.CASES)}, {time.perf_counter() - t0:.1f} s):")
        for fam, (n, p) in families.items():
            out(f"    [{'PASS' if p == n else 'FAIL'}] {fam:<44} {p}/{n}")
        for cid, msg in fails:
            out(f"    FAIL {cid}: {msg}")
        failed += len(fails)
    if ops:
        t0 = time.perf_counter()
        results = []
        for name, fn in op_checks():
            try:
                results.append((name, True, f"{fn(ctx):.2f} of tolerance"))
            except Exception as e:  # noqa: BLE001
                results.append((name, False, _first_line(e)))
        out(f"  op forward + gradient checks vs float64 CPU references ({len(results)}, "
            f"{time.perf_counter() - t0:.1f} s):")
        for name, ok, msg in results:
            out(f"    [{'PASS' if ok else 'FAIL'}] {name:<44} {msg}")
        failed += sum(not ok for _, ok, _ in results)
    return failed


_FRAME = ("Traceback", "File ", "[bt]", "Stack trace", "^")


def _first_line(e):
    """The error's meaningful line: the last line of its text that is not a traceback frame
    (MXNetError's text starts with a C++ 'Traceback (most recent call last):' and ends with the
    message), prefixed with the exception's type."""
    lines = [t.strip() for t in str(e).strip().splitlines() if t.strip()]
    msgs = [t for t in lines if not t.startswith(_FRAME) and not t.split(":", 1)[0].isdigit()]
    msg = msgs[-1] if msgs else type(e).__name__
    msg = re.sub(r"^(MXNetError: )?(\[\d+\] )?", "", msg)  # lib_api's "[0] op: message"
    return f"{type(e).__name__}: {msg}"[:300]


def gpu_problem(mx, gpu_ids):
    """Why the GPUs asked for cannot be used (one line), or None: MXNet or gn_mx without CUDA, no
    GPU visible, an id out of range."""
    from . import build_info
    if not gpu_ids:
        return None
    if not mx.runtime.Features().is_enabled("CUDA"):
        return (f"MXNet {mx.__version__} is built without CUDA (GPU support is disabled): install "
                "mxnet-cu112==1.9.1, or run with --cpu")
    if build_info().get("cuda") is None:
        return ("this gn_mx build has no CUDA kernels (built without nvcc): reinstall a CUDA "
                "build of gn_mx (docs/install.md), or run with --cpu")
    n = mx.context.num_gpus()
    bad = [i for i in gpu_ids if not 0 <= i < n]
    if bad:
        seen = ("no GPU (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them)" if n == 0
                else f"{n} GPU(s), ids 0-{n - 1}")
        return f"GPU id(s) {bad} asked for, but MXNet sees {seen}"
    return None


def _gpu_ids(mx, a):
    """The GPU ids to check: --gpus (a ValueError for a bad list), none with --cpu, else every GPU
    MXNet sees (none when MXNet has no CUDA)."""
    if a.cpu:
        return []
    if a.gpus:
        try:
            return [int(i) for i in a.gpus.split(",")]
        except ValueError:
            raise ValueError(f"--gpus wants comma-separated GPU ids such as 0,1; got {a.gpus!r}")
    return list(range(mx.context.num_gpus()))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gn_mx.selftest",
                                 description="Check gn_mx on the CPU and every GPU MXNet sees.")
    ap.add_argument("--cpu", action="store_true", help="the CPU only")
    ap.add_argument("--gpus", default=None, help="comma-separated GPU ids (default: all)")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing table")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = lambda s="": print(s, flush=True)  # noqa: E731
    try:
        import mxnet as mx
        import gn_mx  # noqa: F401  (loads the op library)
        gpu_ids = _gpu_ids(mx, a)
        problem = gpu_problem(mx, gpu_ids)
        if problem:
            out(f"gn_mx selftest could not start: {problem}")
            return 2
        for lines in machine_report(gpu_ids):
            out(lines)
    except Exception as e:  # noqa: BLE001
        out(f"gn_mx selftest could not start: {_first_line(e)}")
        return 2
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy on the non-finite cases
    devices = [(mx.cpu(), "CPU")] + [(mx.gpu(i), f"GPU {i}") for i in gpu_ids]
    failed, timings = 0, []
    for ctx, label in devices:
        out()
        out(f"== {label} ({ctx}) ==")
        try:
            failed += _run_device(ctx, label, out)
            if not a.no_timing:
                timings += [(label,) + r for r in timing_rows(ctx, ctx.device_type == "gpu")]
        except Exception as e:  # noqa: BLE001  (a crash of the device counts as a failure)
            failed += 1
            out(f"  FAIL: the checks on {label} stopped: {_first_line(e)}")
    if timings:
        out()
        out("== timing: forward + backward, median ms (MXNet's own ops for comparison) ==")
        out(f"  {'device':<7} {'case':<28} {'gn_mx GroupNorm':>16} {'MXNet GroupNorm':>16} "
            f"{'MXNet BatchNorm':>16}")
        for dev, case, ours, gn, bn in timings:
            out(f"  {dev:<7} {case:<28} {ours:>16} {gn:>16} {bn:>16}")
    out()
    total = time.perf_counter() - t_start
    out(f"gn_mx selftest: {'PASSED' if not failed else f'FAILED ({failed} check(s))'} in "
        f"{total:.1f} s on {len(devices)} device(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
