"""ctypes driver for build/gpu/libgn_harness.so (tests/gpu/harness.cc) on torch CUDA tensors.

No MXNet: the framework-free CUDA kernels run on raw device pointers on torch's current stream.
`load()` builds the library with tests/gpu/build.sh when it is missing (or GNMX_HARNESS_REBUILD=1).
Used by benchmarks/gpu/bench_gpu.py (timings next to torch); the correctness tests in tests/gpu
drive the same library without torch (tests/gpu/harness_np.py).

GNMX_HARNESS_EMU=1 instead loads the same kernels built for the CPU emulator (tests/gpu/emu/, logic
checks without a GPU; rebuilt when a source changed) into build/gpu-emu/ and runs them on CPU
tensors.
"""
import ctypes
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMU = os.environ.get("GNMX_HARNESS_EMU") == "1"
DEVICE = "cpu" if EMU else "cuda"
LIB = os.path.join(os.environ.get("GNMX_HARNESS_OUT",
                                  os.path.join(ROOT, "build", "gpu-emu" if EMU else "gpu")),
                   "libgn_harness.so")

DTYPE_CODE = {torch.float32: 0, torch.float64: 1, torch.float16: 2}
ACC = {torch.float16: torch.float32, torch.float32: torch.float32, torch.float64: torch.float64}

_lib = None

c_i64, c_int, c_vp, c_dbl, c_size = (ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_double, ctypes.c_size_t)

_SIGS = {
    "gnh_moments_workspace": (c_size, [c_int, c_vp] + [c_i64] * 4),
    "gnh_moments": (ctypes.c_char_p, [c_int, c_vp, c_vp, c_vp] + [c_i64] * 4 + [c_vp, c_vp]),
    "gnh_moments_bwd": (ctypes.c_char_p, [c_int] + [c_vp] * 5 + [c_i64] * 4 + [c_vp]),
    "gnh_gn_fwd_workspace": (c_size, [c_int, c_int, c_vp, c_vp] + [c_i64] * 4),
    "gnh_gn_fwd": (ctypes.c_char_p,
                   [c_int, c_int] + [c_vp] * 6 + [c_i64] * 4 + [c_dbl, c_vp, c_vp]),
    "gnh_gn_bwd_workspace": (c_size, [c_int, c_int, c_vp, c_vp, c_vp] + [c_i64] * 4),
    "gnh_gn_bwd": (ctypes.c_char_p, [c_int, c_int] + [c_vp] * 11 + [c_i64] * 4 + [c_vp]),
    # fused activation (act: 0 none, 1 relu, 2 silu)
    "gnh_gn_fwd_act": (ctypes.c_char_p, [c_int, c_int] + [c_vp] * 6 + [c_i64] * 4
                       + [c_dbl, c_int, c_vp, c_vp]),
    "gnh_gn_bwd_act": (ctypes.c_char_p, [c_int, c_int] + [c_vp] * 12 + [c_i64] * 4
                       + [c_dbl, c_int, c_vp]),
    # DBN (present when src/operator/kernels/dbn_cuda.cu is built in)
    "gnh_dbn_fwd_workspace": (c_size, [c_int, c_int] + [c_i64] * 4),
    "gnh_dbn_fwd": (ctypes.c_char_p, [c_int, c_int] + [c_vp] * 8 + [c_i64] * 4
                    + [c_dbl, c_dbl, c_vp]),
    "gnh_dbn_bwd_workspace": (c_size, [c_int] + [c_i64] * 4),
    "gnh_dbn_bwd": (ctypes.c_char_p, [c_int] + [c_vp] * 7 + [c_i64] * 4 + [c_vp]),
    "gnh_dbn_inference_workspace": (c_size, [c_int, c_int] + [c_i64] * 4),
    "gnh_dbn_inference": (ctypes.c_char_p, [c_int, c_int, c_int] + [c_vp] * 5 + [c_i64] * 4
                          + [c_vp]),
    # per-channel affine (src/operator/kernels/affine_cuda.cu)
    "gnh_affine_fwd": (ctypes.c_char_p, [c_int, c_int] + [c_vp] * 4 + [c_i64] * 3 + [c_vp]),
    "gnh_affine_bwd_workspace": (c_size, [c_int, c_int] + [c_i64] * 3),
    "gnh_affine_bwd": (ctypes.c_char_p, [c_int, c_int] + [c_vp] * 7 + [c_i64] * 3 + [c_vp]),
}


def available():
    """True where the harness can run: a CUDA device, or the CPU emulator."""
    return EMU or torch.cuda.is_available()


def sync():
    if not EMU:
        torch.cuda.synchronize()


def build():
    if EMU:
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "emu", "build_emu.py"),
                        os.path.dirname(LIB)], check=True)
    else:
        subprocess.run(["bash", os.path.join(ROOT, "tests", "gpu", "build.sh")], check=True)


def load():
    global _lib
    if _lib is not None:
        return _lib
    # The emulator build is cached by a hash of its inputs: asking for it always gives a current one.
    if EMU or not os.path.exists(LIB) or os.environ.get("GNMX_HARNESS_REBUILD") == "1":
        build()
    lib = ctypes.CDLL(LIB)
    for name, (res, args) in _SIGS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = res
        fn.argtypes = args
    _lib = lib
    return lib


def has(name):
    return getattr(load(), name, None) is not None


def _p(t):
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("gnh: the kernels take contiguous tensors")
    return ctypes.c_void_p(t.data_ptr())


def _stream():
    return None if EMU else ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _check(err, what):
    if err:
        raise RuntimeError(f"{what}: {err.decode()}")


def _dims(x, G):
    N, C = x.shape[0], x.shape[1]
    S = 1
    for d in x.shape[2:]:
        S *= d
    return N, C, G, S


def workspace(nbytes, device):
    # 256-byte aligned (the caching allocator's blocks are), at least 1 byte so data_ptr is valid.
    return torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)


class Moments:
    """Moments kernel on preallocated buffers (re-runnable, CUDA-graph capturable)."""

    def __init__(self, x, G, use_workspace=True):
        lib = load()
        self.x, self.dims = x, _dims(x, G)
        N = x.shape[0]
        self.mean = torch.empty(N, G, dtype=ACC[x.dtype], device=x.device)
        self.var = torch.empty_like(self.mean)
        n = lib.gnh_moments_workspace(DTYPE_CODE[x.dtype], _p(x), *self.dims)
        self.ws = workspace(n, x.device) if use_workspace else None

    def __call__(self):
        _check(load().gnh_moments(DTYPE_CODE[self.x.dtype], _p(self.x), _p(self.mean),
                                  _p(self.var), *self.dims, _p(self.ws), _stream()),
               "gnh_moments")
        return self.mean, self.var


def moments(x, G, use_workspace=True):
    return Moments(x, G, use_workspace)()


def moments_bwd(dmean, dvar, x, mean, G):
    dx = torch.empty_like(x)
    _check(load().gnh_moments_bwd(DTYPE_CODE[x.dtype], _p(dmean), _p(dvar), _p(x), _p(mean),
                                  _p(dx), *_dims(x, G), _stream()), "gnh_moments_bwd")
    return dx


ACT_CODE = {None: 0, "none": 0, "relu": 1, "silu": 2}


class GroupNormFwd:
    def __init__(self, x, gamma, beta, G, eps=1e-5, use_workspace=True, y=None, act=None):
        lib = load()
        self.x, self.gamma, self.beta, self.eps = x, gamma, beta, eps
        self.act = ACT_CODE[act]
        self.dims = _dims(x, G)
        self.y = torch.empty_like(x) if y is None else y
        N = x.shape[0]
        self.mean = torch.empty(N, G, dtype=ACC[x.dtype], device=x.device)
        self.rstd = torch.empty_like(self.mean)
        self.codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
        n = lib.gnh_gn_fwd_workspace(*self.codes, _p(x), _p(self.y), *self.dims)
        self.ws = workspace(n, x.device) if use_workspace else None

    def __call__(self):
        if self.act:
            _check(load().gnh_gn_fwd_act(*self.codes, _p(self.x), _p(self.gamma), _p(self.beta),
                                         _p(self.y), _p(self.mean), _p(self.rstd), *self.dims,
                                         float(self.eps), self.act, _p(self.ws), _stream()),
                   "gnh_gn_fwd_act")
            return self.y, self.mean, self.rstd
        _check(load().gnh_gn_fwd(*self.codes, _p(self.x), _p(self.gamma), _p(self.beta),
                                 _p(self.y), _p(self.mean), _p(self.rstd), *self.dims,
                                 float(self.eps), _p(self.ws), _stream()), "gnh_gn_fwd")
        return self.y, self.mean, self.rstd


def group_norm_fwd(x, gamma, beta, G, eps=1e-5, use_workspace=True, y=None, act=None):
    return GroupNormFwd(x, gamma, beta, G, eps, use_workspace, y, act)()


class GroupNormBwd:
    def __init__(self, dy, x, mean, rstd, gamma, G, dmean=None, drstd=None, param_grads=True,
                 dx=None, beta=None, eps=1e-5, act=None):
        lib = load()
        self.beta, self.eps, self.act = beta, eps, ACT_CODE[act]
        self.dy, self.x, self.mean, self.rstd, self.gamma = dy, x, mean, rstd, gamma
        self.dmean, self.drstd = dmean, drstd
        self.dims = _dims(x, G)
        self.dx = torch.empty_like(x) if dx is None else dx
        self.dgamma = torch.empty_like(gamma) if param_grads else None
        self.dbeta = torch.empty_like(gamma) if param_grads else None
        self.codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
        n = lib.gnh_gn_bwd_workspace(*self.codes, _p(dy), _p(x), _p(self.dx), *self.dims)
        self.ws = workspace(n, x.device)

    def __call__(self):
        if self.act:
            _check(load().gnh_gn_bwd_act(*self.codes, _p(self.dy), _p(self.x), _p(self.mean),
                                         _p(self.rstd), _p(self.gamma), _p(self.beta), _p(self.dx),
                                         _p(self.dgamma), _p(self.dbeta), _p(self.dmean),
                                         _p(self.drstd), _p(self.ws), *self.dims, float(self.eps),
                                         self.act, _stream()), "gnh_gn_bwd_act")
            return self.dx, self.dgamma, self.dbeta
        _check(load().gnh_gn_bwd(*self.codes, _p(self.dy), _p(self.x), _p(self.mean),
                                 _p(self.rstd), _p(self.gamma), _p(self.dx), _p(self.dgamma),
                                 _p(self.dbeta), _p(self.dmean), _p(self.drstd), _p(self.ws),
                                 *self.dims, _stream()), "gnh_gn_bwd")
        return self.dx, self.dgamma, self.dbeta


def group_norm_bwd(dy, x, mean, rstd, gamma, G, dmean=None, drstd=None, param_grads=True,
                   dx=None, beta=None, eps=1e-5, act=None):
    return GroupNormBwd(dy, x, mean, rstd, gamma, G, dmean, drstd, param_grads, dx, beta, eps,
                        act)()


# -------------------------------------------------------------------------------------------------
# Decorrelated BN


def dbn_fwd(x, G, running_mean=None, running_proj=None, eps=1e-5, momentum=0.9):
    """Training forward; returns (y, mean (C,), eigvec (G, D, D), eigval (G, D)); updates the
    running statistics in place when given."""
    lib = load()
    N, C, G, S = _dims(x, G)
    D = C // G
    acc = ACC[x.dtype]
    stat = running_mean if running_mean is not None else running_proj
    scode = DTYPE_CODE[stat.dtype] if stat is not None else DTYPE_CODE[acc]
    y = torch.empty_like(x)
    mean = torch.empty(C, dtype=acc, device=x.device)
    eigvec = torch.empty(G, D, D, dtype=acc, device=x.device)
    eigval = torch.empty(G, D, dtype=acc, device=x.device)
    ws = workspace(lib.gnh_dbn_fwd_workspace(DTYPE_CODE[x.dtype], scode, N, C, G, S), x.device)
    _check(lib.gnh_dbn_fwd(DTYPE_CODE[x.dtype], scode, _p(x), _p(y), _p(mean), _p(eigvec),
                           _p(eigval), _p(running_mean), _p(running_proj), _p(ws), N, C, G, S,
                           float(eps), float(momentum), _stream()), "gnh_dbn_fwd")
    return y, mean, eigvec, eigval


def dbn_bwd(dy, x, mean, eigvec, eigval, G):
    lib = load()
    N, C, G, S = _dims(x, G)
    dx = torch.empty_like(x)
    ws = workspace(lib.gnh_dbn_bwd_workspace(DTYPE_CODE[x.dtype], N, C, G, S), x.device)
    _check(lib.gnh_dbn_bwd(DTYPE_CODE[x.dtype], _p(dy), _p(x), _p(mean), _p(eigvec), _p(eigval),
                           _p(dx), _p(ws), N, C, G, S, _stream()), "gnh_dbn_bwd")
    return dx


def dbn_inference(x, running_mean, running_proj, G, backward=False):
    """y = P (x - running_mean) per group; with backward=True, x is dy and the result P^T dy."""
    lib = load()
    N, C, G, S = _dims(x, G)
    scode = DTYPE_CODE[running_proj.dtype]
    y = torch.empty_like(x)
    ws = workspace(lib.gnh_dbn_inference_workspace(DTYPE_CODE[x.dtype], scode, N, C, G, S),
                   x.device)
    _check(lib.gnh_dbn_inference(DTYPE_CODE[x.dtype], scode, int(backward), _p(x),
                                 _p(running_mean), _p(running_proj), _p(y), _p(ws), N, C, G, S,
                                 _stream()), "gnh_dbn_inference")
    return y


# -------------------------------------------------------------------------------------------------
# Per-channel affine


def _ncs(x):
    N, C, _, S = _dims(x, 1)
    return N, C, S


def affine_fwd(x, gamma, beta):
    y = torch.empty_like(x)
    _check(load().gnh_affine_fwd(DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype], _p(x), _p(gamma),
                                 _p(beta), _p(y), *_ncs(x), _stream()), "gnh_affine_fwd")
    return y


def affine_bwd(dy, x, gamma, param_grads=True, use_workspace=True):
    """(dx, dgamma, dbeta); use_workspace=False runs the kernels without their workspace."""
    lib = load()
    dx = torch.empty_like(x)
    dgamma = torch.empty_like(gamma) if param_grads else None
    dbeta = torch.empty_like(gamma) if param_grads else None
    codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
    ws = None
    if use_workspace:
        ws = workspace(lib.gnh_affine_bwd_workspace(*codes, *_ncs(x)), x.device)
    _check(lib.gnh_affine_bwd(*codes, _p(dy), _p(x), _p(gamma), _p(dx), _p(dgamma), _p(dbeta),
                              _p(ws), *_ncs(x), _stream()), "gnh_affine_bwd")
    return dx, dgamma, dbeta
