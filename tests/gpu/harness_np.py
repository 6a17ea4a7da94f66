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
import hashlib
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
    "gnh_gn_grad2_workspace": (c_size, [c_int, c_int] + [c_i64] * 4 + [c_int]),
    "gnh_gn_grad2": (c_str, [c_int, c_int] + [c_vp] * 20 + [c_i64] * 4 + [c_int, c_vp]),
    "gnh_moments_grad2": (c_str, [c_int] + [c_vp] * 9 + [c_i64] * 4 + [c_vp]),
    "gnh_dbn_fwd_workspace2": (c_size, [c_int, c_int] + [c_i64] * 4 + [c_int, c_int]),
    "gnh_dbn_fwd2": (c_str, [c_int, c_int, c_int] + [c_vp] * 10 + [c_i64] * 4
                     + [c_dbl, c_dbl, c_int, c_int, c_vp]),
    "gnh_dbn_bwd_workspace2": (c_size, [c_int] + [c_i64] * 4 + [c_int, c_int]),
    "gnh_dbn_bwd2": (c_str, [c_int, c_int] + [c_vp] * 10 + [c_i64] * 4 + [c_int, c_int, c_vp]),
    "gnh_dbn_inference_workspace": (c_size, [c_int, c_int] + [c_i64] * 4),
    "gnh_dbn_inference": (c_str, [c_int, c_int, c_int] + [c_vp] * 5 + [c_i64] * 4 + [c_vp]),
    "gnh_dbn_inference_affine_workspace": (c_size, [c_int, c_int] + [c_i64] * 4),
    "gnh_dbn_inference_affine": (c_str, [c_int] * 4 + [c_vp] * 10 + [c_i64] * 4 + [c_vp]),
    "gnh_affine_fwd": (c_str, [c_int, c_int] + [c_vp] * 4 + [c_i64] * 3 + [c_vp]),
    "gnh_affine_bwd_workspace": (c_size, [c_int, c_int] + [c_i64] * 3),
    "gnh_affine_bwd": (c_str, [c_int, c_int] + [c_vp] * 7 + [c_i64] * 3 + [c_vp]),
}


def _gpu_present():
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None or shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


def emulated():
    v = os.environ.get("GNMX_HARNESS_EMU")
    return v == "1" if v in ("0", "1") else not _gpu_present()


def simulated():
    """True under GPGPU-Sim (tests/gpu/sim/gpgpusim.sh sets GNMX_HARNESS_SIM=1)."""
    return os.environ.get("GNMX_HARNESS_SIM") == "1"


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
    missing = [name for name in _SIGS if not hasattr(lib, name)]
    if missing:  # a library built before harness.cc gained these entry points
        raise RuntimeError(f"{path} lacks {', '.join(missing)}: rebuild it "
                           "(GNMX_HARNESS_REBUILD=1, or bash tests/gpu/build.sh)")
    for name, (res, args) in _SIGS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    if lib.gnh_device_count() < 1:
        raise RuntimeError(f"{path}: no CUDA device")
    _lib = lib
    return lib


def device_name():
    return "emulator" if emulated() else "simulator" if simulated() else "gpu"


class KernelError(RuntimeError):
    """A kernel entry point returned an error string (str(e) is that string)."""


def _check(err):
    if err:
        raise KernelError(err.decode())


def _record(out):
    """GNMX_HARNESS_RECORD=FILE: append one line per result read back from the device (its dtype,
    shape and the SHA-256 of its bytes), in call order: test_gpu_schedules.py runs GPU test files
    under several thread schedules and compares these files line by line."""
    path = os.environ.get("GNMX_HARNESS_RECORD")
    if path:
        digest = hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest()[:24]
        with open(path, "a") as f:
            f.write(f"{out.dtype} {out.shape} {digest}\n")


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
        _record(out)
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


# -------------------------------------------------------------------------------------------------
# Functional entry points on numpy arrays (the tests/gpu modules and benchmarks/gpu's correctness
# path): each copies its inputs to the device, runs the kernels, synchronizes and returns numpy
# arrays. `offsets` ({name: elements}) places a data buffer that many elements past a 256-byte
# aligned start (misaligned views); `use_workspace=False` runs a kernel without its workspace.

ACC = {np.dtype(np.float16): np.float32, np.dtype(np.float32): np.float32,
       np.dtype(np.float64): np.float64}
WHITENING = {"zca": 0, "iternorm": 1}


def acc_dtype(dtype):
    """The accumulation dtype of the kernels' statistics for data of `dtype`."""
    return ACC[np.dtype(dtype)]


def _ws(d, nbytes, use=True):
    return d.alloc(nbytes) if use and nbytes else None


def _done(d, bufs):
    _check(d.lib.gnh_synchronize())
    return tuple(None if b is None else d.get(b) for b in bufs)


def moments(x, G, use_workspace=True):
    """(mean, var) per (n, g) in acc_dtype(x.dtype)."""
    lib, N, acc = load(), x.shape[0], acc_dtype(x.dtype)
    with _Dev() as d:
        px = d.put(x)
        mean, var = d.empty((N, G), acc), d.empty((N, G), acc)
        ws = _ws(d, lib.gnh_moments_workspace(DTYPE_CODE[x.dtype], px, *_dims(x, G)), use_workspace)
        _check(lib.gnh_moments(DTYPE_CODE[x.dtype], px, mean[0], var[0], *_dims(x, G), ws, None))
        return _done(d, [mean, var])


def moments_bwd(dmean, dvar, x, mean, G):
    lib, acc = load(), acc_dtype(x.dtype)
    with _Dev() as d:
        dx = d.empty(x.shape, x.dtype)
        _check(lib.gnh_moments_bwd(DTYPE_CODE[x.dtype], d.put(np.asarray(dmean, acc)),
                                   d.put(np.asarray(dvar, acc)), d.put(x), d.put(np.asarray(mean, acc)),
                                   dx[0], *_dims(x, G), None))
        return _done(d, [dx])[0]


def group_norm_fwd(x, gamma, beta, G, eps=1e-5, act=None, use_workspace=True, offsets=None):
    """(y, mean, rstd); offsets: {"x": k, "y": k} elements past an aligned start."""
    lib, N, acc, off = load(), x.shape[0], acc_dtype(x.dtype), offsets or {}
    codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
    with _Dev() as d:
        px = d.put(x, off.get("x", 0))
        y = d.empty(x.shape, x.dtype, off.get("y", 0))
        mean, rstd = d.empty((N, G), acc), d.empty((N, G), acc)
        ws = _ws(d, lib.gnh_gn_fwd_workspace(*codes, px, y[0], *_dims(x, G)), use_workspace)
        _check(lib.gnh_gn_fwd_act(*codes, px, d.put(gamma), d.put(beta), y[0], mean[0], rstd[0],
                                  *_dims(x, G), float(eps), ACT_CODE[act], ws, None))
        return _done(d, [y, mean, rstd])


def group_norm_bwd(dy, x, mean, rstd, gamma, G, dmean=None, drstd=None, param_grads=True,
                   beta=None, eps=1e-5, act=None, offsets=None):
    """(dx, dgamma, dbeta) (the last two None with param_grads=False); offsets: x, dy, dx."""
    lib, acc, off = load(), acc_dtype(x.dtype), offsets or {}
    codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
    with _Dev() as d:
        px, pdy = d.put(x, off.get("x", 0)), d.put(dy, off.get("dy", 0))
        dx = d.empty(x.shape, x.dtype, off.get("dx", 0))
        dg = d.empty(gamma.shape, gamma.dtype) if param_grads else None
        db = d.empty(gamma.shape, gamma.dtype) if param_grads else None
        ws = _ws(d, lib.gnh_gn_bwd_workspace(*codes, pdy, px, dx[0], *_dims(x, G)))
        stat = [None if v is None else d.put(np.asarray(v, acc)) for v in (mean, rstd, dmean, drstd)]
        _check(lib.gnh_gn_bwd_act(*codes, pdy, px, stat[0], stat[1], d.put(gamma), d.put(beta),
                                  dx[0], dg and dg[0], db and db[0], stat[2], stat[3], ws,
                                  *_dims(x, G), float(eps), ACT_CODE[act], None))
        return _done(d, [dx, dg, db])


GRAD2_IN = ("dy", "dmean_o", "drstd_o", "x", "gamma", "beta", "mean", "rstd")
GRAD2_OUT = ("ddy", "ddmean_o", "ddrstd_o", "dx", "dgamma", "dbeta", "dmean", "drstd")


def group_norm_grad2(G, inputs, gdx=None, gdgamma=None, gdbeta=None, act=None):
    """The double backward (group_norm_grad2.h): `inputs` maps GRAD2_IN's names to the first-order
    backward's inputs (dmean_o / drstd_o may be None); returns {GRAD2_OUT name: array}."""
    lib = load()
    x, gamma = inputs["x"], inputs["gamma"]
    N, acc = x.shape[0], acc_dtype(x.dtype)
    codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
    stat_names = ("dmean_o", "drstd_o", "mean", "rstd")
    with _Dev() as d:
        p = {k: d.put(None if inputs.get(k) is None else
                      np.asarray(inputs[k], acc) if k in stat_names else inputs[k]) for k in GRAD2_IN}
        shapes = {"ddy": (x.shape, x.dtype), "dx": (x.shape, x.dtype),
                  "dgamma": (gamma.shape, gamma.dtype), "dbeta": (gamma.shape, gamma.dtype)}
        out = {k: d.empty(*shapes.get(k, ((N, G), acc))) for k in GRAD2_OUT}
        ws = _ws(d, lib.gnh_gn_grad2_workspace(*codes, *_dims(x, G), ACT_CODE[act]))
        _check(lib.gnh_gn_grad2(*codes, *[p[k] for k in GRAD2_IN], d.put(gdx), d.put(gdgamma),
                                d.put(gdbeta), *[out[k][0] for k in GRAD2_OUT], ws, *_dims(x, G),
                                ACT_CODE[act], None))
        return dict(zip(GRAD2_OUT, _done(d, [out[k] for k in GRAD2_OUT])))


def moments_grad2(dmean_o, dvar_o, x, mean, G, gdx=None):
    """(ddmean_o, ddvar_o, dx, dmean) of gn_moments' double backward (group_norm_grad2.h)."""
    lib, N, acc = load(), x.shape[0], acc_dtype(x.dtype)
    with _Dev() as d:
        out = [d.empty((N, G), acc), d.empty((N, G), acc), d.empty(x.shape, x.dtype),
               d.empty((N, G), acc)]
        _check(lib.gnh_moments_grad2(DTYPE_CODE[x.dtype], d.put(np.asarray(dmean_o, acc)),
                                     d.put(np.asarray(dvar_o, acc)), d.put(x),
                                     d.put(np.asarray(mean, acc)), d.put(gdx),
                                     *[o[0] for o in out], *_dims(x, G), None))
        return _done(d, out)


def dbn_fwd(x, G, running_mean=None, running_proj=None, eps=1e-5, momentum=0.9, whitening="zca",
            iterations=5, gamma=None, beta=None):
    """Training forward: (y, mean (C,), eigvec (G, D, D), eigval (G, D)) in acc_dtype (IterNorm:
    Sigma and its diagonal). running_mean / running_proj (numpy, stat dtype = their dtype) are
    updated in place when given."""
    lib, (N, C, _, S) = load(), _dims(x, G)
    D, acc = C // G, acc_dtype(x.dtype)
    stat = running_mean if running_mean is not None else running_proj
    scode = DTYPE_CODE[np.dtype(stat.dtype if stat is not None else acc)]
    pcode = DTYPE_CODE[np.dtype(gamma.dtype if gamma is not None else acc)]
    w = WHITENING[whitening]
    with _Dev() as d:
        y, mean = d.empty(x.shape, x.dtype), d.empty((C,), acc)
        U, lam = d.empty((G, D, D), acc), d.empty((G, D), acc)
        rm = None if running_mean is None else (d.put(running_mean), (running_mean.shape, running_mean.dtype))
        rp = None if running_proj is None else (d.put(running_proj), (running_proj.shape, running_proj.dtype))
        ws = _ws(d, lib.gnh_dbn_fwd_workspace2(DTYPE_CODE[x.dtype], scode, N, C, G, S, w, iterations))
        _check(lib.gnh_dbn_fwd2(DTYPE_CODE[x.dtype], scode, pcode, d.put(x), d.put(gamma),
                                d.put(beta), y[0], mean[0], U[0], lam[0], rm and rm[0],
                                rp and rp[0], ws, N, C, G, S, float(eps), float(momentum), w,
                                int(iterations), None))
        res = _done(d, [y, mean, U, lam, rm, rp])
        for arr, new in ((running_mean, res[4]), (running_proj, res[5])):
            if arr is not None:
                arr[...] = new
        return res[:4]


def dbn_bwd(dy, x, mean, eigvec, eigval, G, whitening="zca", iterations=5, gamma=None):
    """dx, or (dx, dgamma, dbeta) with the fused affine's gamma."""
    lib, (N, C, _, S) = load(), _dims(x, G)
    acc = acc_dtype(x.dtype)
    w = WHITENING[whitening]
    with _Dev() as d:
        dx = d.empty(x.shape, x.dtype)
        dg = db = None
        if gamma is not None:
            dg, db = d.empty(gamma.shape, gamma.dtype), d.empty(gamma.shape, gamma.dtype)
        pcode = DTYPE_CODE[np.dtype(gamma.dtype if gamma is not None else acc)]
        ws = _ws(d, lib.gnh_dbn_bwd_workspace2(DTYPE_CODE[x.dtype], N, C, G, S, w, iterations))
        _check(lib.gnh_dbn_bwd2(DTYPE_CODE[x.dtype], pcode, d.put(dy), d.put(x),
                                d.put(np.asarray(mean, acc)), d.put(np.asarray(eigvec, acc)),
                                d.put(np.asarray(eigval, acc)), d.put(gamma), dx[0], dg and dg[0],
                                db and db[0], ws, N, C, G, S, w, int(iterations), None))
        res = _done(d, [dx, dg, db])
        return res if gamma is not None else res[0]


def dbn_inference(x, running_mean, running_proj, G, backward=False):
    """y = P (x - running_mean) per group; backward=True: x is dy and the result P^T dy."""
    lib, (N, C, _, S) = load(), _dims(x, G)
    scode = DTYPE_CODE[np.dtype(running_proj.dtype)]
    with _Dev() as d:
        y = d.empty(x.shape, x.dtype)
        ws = _ws(d, lib.gnh_dbn_inference_workspace(DTYPE_CODE[x.dtype], scode, N, C, G, S))
        _check(lib.gnh_dbn_inference(DTYPE_CODE[x.dtype], scode, int(backward), d.put(x),
                                     d.put(running_mean), d.put(running_proj), y[0], ws, N, C, G,
                                     S, None))
        return _done(d, [y])[0]


def dbn_inference_affine(x, running_mean, running_proj, gamma, beta, G, dy=None):
    """The inference op with the fused affine: y = gamma P (x - running_mean) + beta; with dy also
    its backward (dx = P^T (gamma dy), dgamma, dbeta): (y, dx, dgamma, dbeta)."""
    lib, (N, C, _, S) = load(), _dims(x, G)
    codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[np.dtype(running_proj.dtype)],
             DTYPE_CODE[np.dtype(gamma.dtype)])
    with _Dev() as d:
        ws = _ws(d, lib.gnh_dbn_inference_affine_workspace(*codes[:2], N, C, G, S))
        stats = (d.put(running_mean), d.put(running_proj), d.put(gamma), d.put(beta))
        y = d.empty(x.shape, x.dtype)
        _check(lib.gnh_dbn_inference_affine(*codes, 0, d.put(x), None, *stats, y[0], None, None,
                                            ws, N, C, G, S, None))
        out = [y]
        if dy is not None:
            dx, dg, db = (d.empty(x.shape, x.dtype), d.empty(gamma.shape, gamma.dtype),
                          d.empty(gamma.shape, gamma.dtype))
            _check(lib.gnh_dbn_inference_affine(*codes, 1, d.put(dy), d.put(x), *stats, dx[0],
                                                dg[0], db[0], ws, N, C, G, S, None))
            out += [dx, dg, db]
        res = _done(d, out)
        return tuple(res) + (None,) * (4 - len(res))


def _ncs(x):
    N, C, _, S = _dims(x, 1)
    return N, C, S


def affine_fwd(x, gamma, beta, offset=0):
    lib = load()
    with _Dev() as d:
        y = d.empty(x.shape, x.dtype, offset)
        _check(lib.gnh_affine_fwd(DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype], d.put(x, offset),
                                  d.put(gamma), d.put(beta), y[0], *_ncs(x), None))
        return _done(d, [y])[0]


def affine_bwd(dy, x, gamma, param_grads=True, use_workspace=True, offset=0):
    """(dx, dgamma, dbeta); use_workspace=False runs the kernels without their workspace; offset:
    dy, x and dx start that many elements past an aligned start."""
    lib = load()
    codes = (DTYPE_CODE[x.dtype], DTYPE_CODE[gamma.dtype])
    with _Dev() as d:
        dx = d.empty(x.shape, x.dtype, offset)
        dg = d.empty(gamma.shape, gamma.dtype) if param_grads else None
        db = d.empty(gamma.shape, gamma.dtype) if param_grads else None
        ws = _ws(d, lib.gnh_affine_bwd_workspace(*codes, *_ncs(x)), use_workspace)
        _check(lib.gnh_affine_bwd(*codes, d.put(dy, offset), d.put(x, offset), d.put(gamma), dx[0],
                                  dg and dg[0], db and db[0], ws, *_ncs(x), None))
        return _done(d, [dx, dg, db])
