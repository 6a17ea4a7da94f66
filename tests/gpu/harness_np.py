"""numpy driver of the GPU harness (tests/gpu/harness.cc) that needs neither torch nor MXNet.

It runs the CUDA kernels on a real GPU (build/gpu/libgn_harness.so, built by tests/gpu/build.sh;
device memory through the harness's gnh_alloc / gnh_copy) or, where there is none, the same
kernels built for the CPU emulator (tests/gpu/emu/build_emu.py, build/gpu-emu/), so the CPU CI runs
them too. The shared edge cases (tests/edge_cases.py) drive the kernels through `Runner`.

Choice of device: GNMX_HARNESS_EMU=1 -> the emulator; GNMX_HARNESS_EMU=0 -> the GPU (fails without
one); unset -> the GPU when nvcc and nvidia-smi find one, else the emulator. GNMX_HARNESS_LIB=path
loads that library as it is (no build), on the device chosen as above.
"""
import ctypes
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(HERE, "emu"))
import build_emu  # noqa: E402

DTYPE_CODE = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2}
ACT_CODE = {None: 0, "none": 0, "relu": 1, "silu": 2}

c_i64, c_int, c_vp, c_dbl, c_size, c_str = (ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_double, ctypes.c_size_t, ctypes.c_char_p)
_SIGS = {
    "gnh_device_count": (c_int, []),
    "gnh_alloc": (c_vp, [c_size, ctypes.POINTER(c_str)]),
    "gnh_free": (c_str, [c_vp]),
    "gnh_copy": (c_str, [c_vp, c_vp, c_size, c_int]),
    "gnh_synchronize": (c_str, []),
    "gnh_moments_workspace": (c_size, [c_int, c_vp] + [c_i64] * 4),
    "gnh_moments": (c_str, [c_int, c_vp, c_vp, c_vp] + [c_i64] * 4 + [c_vp, c_vp]),
    "gnh_moments_bwd": (c_str, [c_int] + [c_vp] * 5 + [c_i64] * 4 + [c_vp]),
    "gnh_gn_fwd_workspace": (c_size, [c_int, c_int, c_vp, c_vp] + [c_i64] * 4),
    "gnh_gn_fwd_act": (c_str, [c_int, c_int] + [c_vp] * 6 + [c_i64] * 4
                       + [c_dbl, c_int, c_vp, c_vp]),
    "gnh_gn_bwd_workspace": (c_size, [c_int, c_int, c_vp, c_vp, c_vp] + [c_i64] * 4),
    "gnh_gn_bwd_act": (c_str, [c_int, c_int] + [c_vp] * 12 + [c_i64] * 4 + [c_dbl, c_int, c_vp]),
}


def _gpu_present():
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None or shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


def emulated():
    v = os.environ.get("GNMX_HARNESS_EMU")
    return v == "1" if v in ("0", "1") else not _gpu_present()


_lib = None


def load():
    """The harness library (built or refreshed on first use)."""
    global _lib
    if _lib is not None:
        return _lib
    if os.environ.get("GNMX_HARNESS_LIB"):  # a given build (e.g. an older one, to compare)
        path = os.environ["GNMX_HARNESS_LIB"]
    elif emulated():
        out = os.environ.get("GNMX_HARNESS_EMU_OUT") or build_emu.default_out()
        path = build_emu.build_harness(out)
    else:
        path = os.path.join(os.environ.get("GNMX_HARNESS_OUT", os.path.join(ROOT, "build", "gpu")),
                            "libgn_harness.so")
        if not os.path.exists(path) or os.environ.get("GNMX_HARNESS_REBUILD") == "1":
            subprocess.run(["bash", os.path.join(HERE, "build.sh")], check=True)
    lib = ctypes.CDLL(path)
    for name, (res, args) in _SIGS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    if lib.gnh_device_count() < 1:
        raise RuntimeError(f"{path}: no CUDA device")
    _lib = lib
    return lib


def device_name():
    return "emulator" if emulated() else "gpu"


class KernelError(RuntimeError):
    """A kernel entry point returned an error string (str(e) is that string)."""


def _check(err):
    if err:
        raise KernelError(err.decode())


class _Dev:
    """Device buffers of one call, freed together. `offset` (elements): a buffer starts that many
    elements past its allocation's 256-byte aligned start (misaligned views, as torch's x[1:])."""

    def __init__(self):
        self.lib = load()
        self.bufs = []

    def alloc(self, nbytes, skip=0):
        err = c_str()
        p = self.lib.gnh_alloc(max(int(nbytes) + skip, 1), ctypes.byref(err))
        _check(err.value)
        self.bufs.append(p)
        return p + skip

    def put(self, a, offset=0):
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        p = self.alloc(a.nbytes, offset * a.itemsize)
        _check(self.lib.gnh_copy(p, a.ctypes.data, a.nbytes, 1))
        return p

    def empty(self, shape, dtype, offset=0):
        size = np.dtype(dtype).itemsize
        return self.alloc(int(np.prod(shape)) * size, offset * size), (tuple(shape), dtype)

    def get(self, buf):
        p, (shape, dtype) = buf
        out = np.empty(shape, dtype)
        _check(self.lib.gnh_copy(out.ctypes.data, p, out.nbytes, 0))
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.bufs:
            self.lib.gnh_free(p)


def _dims(x, G):
    return (x.shape[0], x.shape[1], G, int(np.prod(x.shape[2:], dtype=np.int64)))


def _acc(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


class Runner:
    """The kernels as the shared edge cases call them (tests/edge_cases.py's runner interface):
    group_norm(...) and moments(...) on numpy arrays, results as numpy arrays.

    offsets: {buffer: elements} places the data buffers x, y, dy, dx that many elements past a
    16-byte boundary (default all 0: aligned), for the kernels' misaligned paths."""

    name = "cuda"

    def __init__(self, offsets=None):
        self.off = dict(offsets or {})

    def group_norm(self, x, gamma, beta, G, eps, act=None, dy=None, dmean=None, drstd=None):
        lib = load()
        N = x.shape[0]
        acc = _acc(x.dtype)
        codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
        dims = _dims(x, G)
        with _Dev() as d:
            px, pg, pb = d.put(x, self.off.get("x", 0)), d.put(gamma), d.put(beta)
            y = d.empty(x.shape, x.dtype, self.off.get("y", 0))
            mean, rstd = d.empty((N, G), acc), d.empty((N, G), acc)
            nws = lib.gnh_gn_fwd_workspace(*codes, px, y[0], *dims)
            ws = d.alloc(nws) if nws else None
            _check(lib.gnh_gn_fwd_act(*codes, px, pg, pb, y[0], mean[0], rstd[0], *dims, float(eps),
                                      ACT_CODE[act], ws, None))
            res = {"y": y, "mean": mean, "rstd": rstd}
            if dy is not None:
                pdy = d.put(dy, self.off.get("dy", 0))
                pdm = d.put(None if dmean is None else np.asarray(dmean, acc))
                pdr = d.put(None if drstd is None else np.asarray(drstd, acc))
                dx = d.empty(x.shape, x.dtype, self.off.get("dx", 0))
                dg, db = d.empty(gamma.shape, gamma.dtype), d.empty(gamma.shape, gamma.dtype)
                nws = lib.gnh_gn_bwd_workspace(*codes, pdy, px, dx[0], *dims)
                ws = d.alloc(nws)
                _check(lib.gnh_gn_bwd_act(*codes, pdy, px, mean[0], rstd[0], pg, pb, dx[0], dg[0],
                                          db[0], pdm, pdr, ws, *dims, float(eps), ACT_CODE[act],
                                          None))
                res.update(dx=dx, dgamma=dg, dbeta=db)
            _check(lib.gnh_synchronize())
            return {k: d.get(v) for k, v in res.items()}

    def moments(self, x, G, dmean=None, dvar=None):
        lib = load()
        N = x.shape[0]
        acc = _acc(x.dtype)
        code = DTYPE_CODE[x.dtype]
        dims = _dims(x, G)
        with _Dev() as d:
            px = d.put(x, self.off.get("x", 0))
            mean, var = d.empty((N, G), acc), d.empty((N, G), acc)
            nws = lib.gnh_moments_workspace(code, px, *dims)
            ws = d.alloc(nws) if nws else None
            _check(lib.gnh_moments(code, px, mean[0], var[0], *dims, ws, None))
            res = {"mean": mean, "var": var}
            if dmean is not None:
                dx = d.empty(x.shape, x.dtype, self.off.get("dx", 0))
                _check(lib.gnh_moments_bwd(code, d.put(np.asarray(dmean, acc)),
                                           d.put(np.asarray(dvar, acc)), px, mean[0], dx[0], *dims,
                                           None))
                res["dx"] = dx
            _check(lib.gnh_synchronize())
            return {k: d.get(v) for k, v in res.items()}
