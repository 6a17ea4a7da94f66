"""The rows of the simulated-V100 benchmark (bench_gpusim.py): what each runs and against what.

Each row: group (its kernel family, for --list; every row runs in its own simulator process), label,
kind ("copy": ratio to a float4 copy of min_bytes = the op's unavoidable reads + writes; "fma":
ratio of its useful FLOPs per cycle to the simulated fp32 FMA kernel's), make(hnp, lib) -> (op, ref,
info): two closures, each one cold launch sequence (inputs are prepared before, outside the timed
markers), and {"min_bytes": the op's unavoidable DRAM reads + writes}. Shapes are small (x of
0.25-1 MiB) because the simulator costs ~30-110 s of one core per MiB moved.
"""
import ctypes

import numpy as np

FMA_BLOCKS, FMA_ITERS, FMA_CHAINS, FMA_THREADS = 640, 32, 8, 256
FMA_FLOPS = 2 * FMA_CHAINS * FMA_ITERS * FMA_BLOCKS * FMA_THREADS


def _rand(shape, dtype, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _sim_fns(lib):
    lib.gnh_sim_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.gnh_sim_copy.restype = ctypes.c_char_p
    lib.gnh_sim_fma.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.gnh_sim_fma.restype = ctypes.c_char_p
    return lib


def copy_ref(hnp, lib, min_bytes):
    """A copy moving min_bytes (reads + writes) from a fresh buffer; buffers made now."""
    n = max(16, (min_bytes // 2) // 16 * 16)
    lib = _sim_fns(lib)
    d = hnp._Dev()
    src, dst = d.put(np.ones(n // 4, np.float32)), d.alloc(n)

    def ref():
        hnp._check(lib.gnh_sim_copy(dst, src, n))
        hnp._check(lib.gnh_synchronize())
        d.__exit__()
    return ref


def fma_ref(hnp, lib):
    lib = _sim_fns(lib)
    d = hnp._Dev()
    out = d.alloc(FMA_BLOCKS * FMA_THREADS * 4)

    def ref():
        hnp._check(lib.gnh_sim_fma(0, out, FMA_BLOCKS, FMA_ITERS))
        hnp._check(lib.gnh_synchronize())
        d.__exit__()
    return ref


def _bytes(*arrays):
    return int(sum(a.nbytes for a in arrays))


def gn(shape, G, dtype, pdtype=np.float32, act=None, bwd=False, channels_last=False):
    """GroupNorm forward or backward (dx, dgamma, dbeta); channels_last: the same (N, C, S) data
    laid out (N, S, C) (the harness's gnh_set_channels_last)."""
    def make(hnp, lib):
        N, C = shape[0], shape[1]
        x = _rand(shape, dtype)
        if channels_last:  # the memory holds (N, S, C); the harness labels it (N, C, S)
            x = np.ascontiguousarray(x.reshape(N, C, -1))
        gamma, beta = _rand((C,), pdtype, 1) + 1, _rand((C,), pdtype, 2)
        layout = lib.gnh_set_channels_last
        layout.argtypes, layout.restype = [ctypes.c_int], None
        if bwd:
            dy = _rand(x.shape, dtype, 3)
            layout(int(channels_last))
            _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G, act=act)
            layout(0)
            min_bytes = _bytes(dy, x, x)

            def op():
                layout(int(channels_last))
                hnp.group_norm_bwd(dy, x, mean, rstd, gamma, G, beta=beta, act=act)
                layout(0)
        else:
            min_bytes = _bytes(x, x)

            def op():
                layout(int(channels_last))
                hnp.group_norm_fwd(x, gamma, beta, G, act=act)
                layout(0)
        return op, copy_ref(hnp, lib, min_bytes), {"min_bytes": min_bytes}
    return make


def affine(shape, dtype, bwd=False):
    def make(hnp, lib):
        x, C = _rand(shape, dtype), shape[1]
        gamma, beta = _rand((C,), np.float32, 1), _rand((C,), np.float32, 2)
        if bwd:
            dy = _rand(shape, dtype, 3)
            b = _bytes(dy, x, x)
            return (lambda: hnp.affine_bwd(dy, x, gamma)), copy_ref(hnp, lib, b), {"min_bytes": b}
        b = _bytes(x, x)
        return (lambda: hnp.affine_fwd(x, gamma, beta)), copy_ref(hnp, lib, b), {"min_bytes": b}
    return make


def grad2(shape, G, dtype):
    """GroupNorm's double backward: reads dy, x, gdx; writes ddy, dx (the data-sized arrays)."""
    def make(hnp, lib):
        N, C = shape[0], shape[1]
        x, dy, gdx = _rand(shape, dtype), _rand(shape, dtype, 3), _rand(shape, dtype, 4)
        gamma, beta = _rand((C,), dtype, 1) + 1, _rand((C,), dtype, 2)
        _, mean, rstd = hnp.group_norm_fwd(x, gamma, beta, G)
        inputs = dict(dy=dy, x=x, gamma=gamma, beta=beta, mean=mean, rstd=rstd)
        b = _bytes(dy, x, gdx, x, x)
        return (lambda: hnp.group_norm_grad2(G, inputs, gdx=gdx)), copy_ref(hnp, lib, b), \
            {"min_bytes": b}
    return make


def dbn(shape, G, whitening="zca", bwd=False, iterations=5):
    def make(hnp, lib):
        x = _rand(shape, np.float32)
        if bwd:
            dy = _rand(shape, np.float32, 3)
            _, mean, U, lam = hnp.dbn_fwd(x, G, whitening=whitening, iterations=iterations)
            op = (lambda: hnp.dbn_bwd(dy, x, mean, U, lam, G, whitening=whitening,
                                      iterations=iterations))
        else:
            op = (lambda: hnp.dbn_fwd(x, G, whitening=whitening, iterations=iterations))
        return op, fma_ref(hnp, lib), {"min_bytes": _bytes(x, x) if not bwd else _bytes(x, x, x)}
    return make


def dbn_flops(shape, G, passes, iterations=0):
    """Useful FLOPs: `passes` products of the (m x D) data with D x D matrices per group (2 m D C
    each, m = N * S), plus IterNorm's 3 D x D products per Newton iteration per group."""
    N, C = shape[0], shape[1]
    m, D = N * int(np.prod(shape[2:], dtype=np.int64)), C // G
    return int(passes * 2 * m * D * C + iterations * 3 * 2 * D ** 3 * G)


X = (2, 128, 32, 32)          # 1 MiB fp32, 32 groups of 4 x 1024
X_CL = (2, 128, 32 * 32)      # the same data channels-last
DBN_X, DBN_G = (16, 128, 8, 8), 4    # D = 32 (the simulator's shared-memory Jacobi), m = 1024
IT_X = (8, 128, 16, 16)       # IterNorm G = 1: D = 128, m = 2048


def _row(group, label, make, kind="copy", **kw):
    return dict(group=group, label=label, make=make, kind=kind, **kw)


ROWS = {
    "gn_fwd_fp32": _row("gn", "GN fwd fp32 (2,128,32,32) G=32", gn(X, 32, np.float32)),
    "gn_bwd_fp32": _row("gn", "GN bwd fp32 (2,128,32,32) G=32", gn(X, 32, np.float32, bwd=True)),
    "gn_fwd_fp16": _row("gn", "GN fwd fp16, fp32 params (2,128,32,32)", gn(X, 32, np.float16)),
    "gn_bwd_fp16": _row("gn", "GN bwd fp16, fp32 params (2,128,32,32)",
                        gn(X, 32, np.float16, bwd=True)),
    "gn_fwd_silu": _row("gn", "GN fwd + silu fp32 (2,128,32,32)",
                        gn(X, 32, np.float32, act="silu")),
    "gn_fwd_cl": _row("gn", "GN fwd channels-last fp32 (2,32,32,128)",
                      gn(X_CL, 32, np.float32, channels_last=True)),
    "gn_bwd_cl": _row("gn", "GN bwd channels-last fp32 (2,32,32,128)",
                      gn(X_CL, 32, np.float32, bwd=True, channels_last=True)),
    "gn_fwd_tiny": _row("gn", "GN fwd tiny groups (64,1024) G=32 fp32",
                        gn((64, 1024), 32, np.float32)),
    "gn_bwd_tiny": _row("gn", "GN bwd tiny groups (64,1024) G=32 fp32",
                        gn((64, 1024), 32, np.float32, bwd=True)),
    "affine_fwd": _row("gn", "affine fwd fp32 (2,128,32,32)", affine(X, np.float32)),
    "affine_bwd": _row("gn", "affine bwd fp32 (2,128,32,32)", affine(X, np.float32, True)),
    "ws_fwd": _row("gn", "WS fwd: weight (256,128,3,3) fp32 (GN N=1, G=C)",
                   gn((1, 256, 1152), 256, np.float32)),
    "gn_grad2": _row("gn", "GN double backward fp32 (2,64,32,32)",
                     grad2((2, 64, 32, 32), 32, np.float32)),
    "dbn_fwd": _row("dbn", "DBN ZCA fwd (16,128,8,8) G=4 (D=32, m=1024): stats, gram, eig, apply",
                    dbn(DBN_X, DBN_G), kind="fma", flops=dbn_flops(DBN_X, DBN_G, 2),
                    ref_flops=FMA_FLOPS),
    "dbn_bwd": _row("dbn", "DBN ZCA bwd (16,128,8,8) G=4", dbn(DBN_X, DBN_G, bwd=True),
                    kind="fma", flops=dbn_flops(DBN_X, DBN_G, 3), ref_flops=FMA_FLOPS),
    "iternorm_fwd": _row("dbn", "IterNorm fwd (8,128,16,16) G=1 (D=128, m=2048), T=5",
                         dbn(IT_X, 1, "iternorm"), kind="fma",
                         flops=dbn_flops(IT_X, 1, 2, 5), ref_flops=FMA_FLOPS),
    "iternorm_bwd": _row("dbn", "IterNorm bwd (8,128,16,16) G=1, T=5",
                         dbn(IT_X, 1, "iternorm", bwd=True), kind="fma",
                         flops=dbn_flops(IT_X, 1, 3, 5), ref_flops=FMA_FLOPS),
}
# The CI speed rows (tests/gpu/test_gpu_sim_speed.py): small, a minute or two each on one core.
X_CI = (1, 128, 32, 32)       # 512 KiB fp32
ROWS = {"ci_gn_fwd": _row("gn", "CI: GN fwd fp32 (1,128,32,32) G=32", gn(X_CI, 32, np.float32)),
        "ci_gn_bwd": _row("gn", "CI: GN bwd fp32 (1,128,32,32) G=32",
                          gn(X_CI, 32, np.float32, bwd=True)),
        **ROWS}  # first: their values set the CI floors

# What bounds a row that misses its target, from the simulator's counters (filled in from runs).
BOUNDS = {}
