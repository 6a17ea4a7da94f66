"""GPU benchmark of gn_mx's CUDA kernels vs torch, every shape class of issue 23 in one table.

Classes (rows in this order): tiny_groups ((N, C) data, G up to C), large_n_s1 (large N with S = 1:
the parameter gradients), misaligned (fp16, odd group length / a pointer off by one element),
affine (the per-channel affine of affine_cuda.cu), sd_unet (Stable-Diffusion UNet GroupNorms) and
dbn (Decorrelated BN, ZCA, D = 16..512, G = 1..32, small and large N*S, vs an eigh-based DBN in
torch). Each row is one pass (fwd, bwd, inference) of one case for gn_mx ("ours") and torch:
GroupNorm vs the kernels behind F.group_norm (aten.native_group_norm[_backward]), the affine vs
torch's addcmul + reductions, DBN vs torch.linalg.eigh on the batched covariance, W = U diag(l^-1/2)
U^T applied with matmul, backward through autograd (fp32 matmuls without TF32).

Timing: CUDA events, a warm-up call first, then the median of several runs; GroupNorm and affine
passes replay a CUDA graph of back-to-back calls (no Python or launch overhead), DBN passes are
timed eagerly (torch's eigh synchronizes). A pass whose warm-up call exceeds --case-budget-s is
reported from that one call; a DBN pass predicted (from a smaller D, cubic in D) to outlast the
remaining --budget-s is skipped, as is every case once --budget-s is spent: both say so in the note.

The bound of each row (bytes that must move, flops of the dense math) comes from _bounds.py; %copy
is bytes / time / the measured device-to-device copy bandwidth; %fp32 / %fp64 is flops / time /
the measured fp32 (TF32 off) / fp64 matmul rate. GPU, driver, CUDA, torch and date head the table.

    python benchmarks/gpu/bench_gpu.py [--out benchmarks/results]   # on a GPU machine
    python benchmarks/gpu/bench_gpu.py --estimate                   # H200 lower bounds, runs nothing
    GNMX_HARNESS_EMU=1 python benchmarks/gpu/bench_gpu.py --smoke   # tiny shapes, CPU emulator

Writes gpu_bench.json and gpu_bench.md into --out only when --out is given; see README.md here.
"""
import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
import _bounds as bounds  # noqa: E402  (no torch: --estimate and --help need neither)

torch = gnh = None  # imported by run() (--help and --estimate need neither)

CLASSES = {
    "tiny_groups": "tiny groups and (N, C) data (S = 1)",
    "large_n_s1": "large N with S = 1: parameter gradients over N",
    "misaligned": "fp16, odd group length or a pointer off by one element",
    "affine": "per-channel affine (affine_cuda.cu)",
    "sd_unet": "Stable-Diffusion UNet GroupNorm(32)",
    "sd_unet_nhwc": "the same, channels last (NHWC, axis=-1): group_norm_nsc_cuda.cu",
    "dbn": "Decorrelated BN (ZCA), small and large m = N*S",
}
PASSES = {"tiny_groups": ("fwd", "bwd"), "large_n_s1": ("fwd", "bwd"), "misaligned": ("fwd", "bwd"),
          "affine": ("fwd", "bwd"), "sd_unet": ("fwd", "bwd"), "sd_unet_nhwc": ("fwd", "bwd"),
          "dbn": ("fwd", "bwd", "inference")}
EPS = 1e-5
EIG_ENV = "GNMX_DBN_CUDA_EIG"  # the DBN forward's eigensolver (dbn_cuda.cu, issue 23 item 1)


@dataclass(frozen=True)
class Case:
    cls: str
    shape: tuple
    dtype: str          # "float16" / "float32" / "float64"
    G: int = 1
    offset: int = 0     # elements between the allocation and the tensors (misaligned pointers)
    eig: str = ""       # dbn: GNMX_DBN_CUDA_EIG for this case ("": unset, the kernels' choice)

    @property
    def passes(self):
        # another eigensolver changes only the forward
        return ("fwd",) if self.eig else PASSES[self.cls]

    @property
    def D(self):
        return self.shape[1] // self.G

    @property
    def m(self):
        return bounds.numel(self.shape) // self.shape[1]

    def label(self):
        s = f"{tuple(self.shape)}"
        if self.cls == "dbn":
            return f"{s} G={self.G} D={self.D} m={self.m}" + (f" eig={self.eig}" if self.eig else "")
        if self.cls != "affine":
            s += f" G={self.G}"
        if self.offset:
            s += f" +{self.offset} elem"
        return s


# --------------------------------------------------------------------------------------------------
# The cases: full (a GPU run) and smoke (tiny shapes for the CPU emulator; every class present)

DBN_DS = (16, 64, 128, 256, 512)
DBN_GS = (1, 8, 32)
DBN_MAX_C = 4096        # C = G*D kept sane: (D, G) pairs with a larger C are left out


def dbn_layouts(C, smoke=False):
    """Small m: fully connected data (N, C) with N = 512; large m: (32, C, 32, 32), m = 32768."""
    if smoke:
        return [(32, C), (2, C, 4, 4)]
    return [(512, C), (32, C, 32, 32)]


def full_cases(dbn_eig=()):
    """Every case of a GPU run, in run order; dbn_eig: GNMX_DBN_CUDA_EIG values whose DBN forwards
    are timed again after all default rows (so the budget cuts them first)."""
    cases = []
    for dt in ("float16", "float32"):
        cases += [Case("tiny_groups", (4096, 512), dt, 128), Case("tiny_groups", (4096, 512), dt, 512),
                  Case("tiny_groups", (64, 1024), dt, 32)]
    for dt in ("float16", "float32"):
        cases += [Case("large_n_s1", (65536, 256), dt, 32), Case("large_n_s1", (262144, 64), dt, 8)]
    cases += [Case("misaligned", (16, 96, 63, 63), "float16", 32),        # group length 11907 (odd)
              Case("misaligned", (16, 320, 32, 32), "float16", 32, offset=1)]
    for dt in ("float16", "float32"):
        cases += [Case("affine", (4096, 512), dt), Case("affine", (8, 256, 56, 56), dt)]
    for dt in ("float16", "float32"):
        cases += [Case("sd_unet", (2, c, hw, hw), dt, 32) for c in (320, 640, 1280)
                  for hw in (64, 32, 16, 8)]
    for dt in ("float16", "float32"):  # shape written (N, C, H, W); the data is NHWC
        cases += [Case("sd_unet_nhwc", (2, c, hw, hw), dt, 32) for c in (320, 640, 1280)
                  for hw in (64, 32)]
    for eig in ("",) + tuple(dbn_eig):
        for D in DBN_DS:
            for G in DBN_GS:
                if G * D <= DBN_MAX_C:
                    cases += [Case("dbn", shape, "float32", G, eig=eig) for shape in dbn_layouts(G * D)]
    return cases


def smoke_cases():
    """At most 16 groups per GroupNorm case: the emulator runs ~10 ms per group and block."""
    cases = [Case("tiny_groups", (4, 8), "float32", 4), Case("tiny_groups", (4, 4), "float16", 4),
             Case("large_n_s1", (16, 4), "float32", 1),
             Case("misaligned", (2, 6, 5, 7), "float16", 3),
             Case("misaligned", (2, 8, 4, 4), "float16", 4, offset=1),
             Case("affine", (16, 8), "float32"), Case("affine", (2, 8, 6, 6), "float16"),
             Case("sd_unet", (1, 32, 4, 4), "float32", 8),
             Case("sd_unet_nhwc", (1, 32, 4, 4), "float32", 8)]
    for D, G in ((4, 1), (8, 2)):
        cases += [Case("dbn", shape, "float32", G) for shape in dbn_layouts(G * D, smoke=True)]
    return cases + [Case("dbn", (32, 4), "float32", 1, eig="shared")]  # the --dbn-eig plumbing


# --------------------------------------------------------------------------------------------------
# --estimate: lower bounds on an H200 from _bounds.py alone


def estimate_table(cases, dev=bounds.H200):
    lines = [f"# gn_mx GPU benchmark: lower-bound times on an {dev['name']}", "",
             f"- {dev['sms']} SMs, {dev['copy_bw'] / 1e12:.1f} TB/s HBM, "
             f"{dev['fp32'] / 1e12:.0f} TFLOP/s "
             f"fp32 (non-tensor), {dev['fp64'] / 1e12:.0f} TFLOP/s fp64",
             "- bound: max(bytes / bandwidth, flops / fp32 peak) from benchmarks/gpu/_bounds.py; "
             "nothing was run", "",
             "| class | case | dtype | pass | bytes | flops | bound us | bytes-bound us | fp32-bound us "
             "| fp64-bound us |", "|---|---|---|---|---|---|---|---|---|---|"]
    total, n = 0.0, 0
    for c in cases:
        for p in c.passes:
            b = bounds.case_bound(c, p)
            t = bounds.lower_bound_s(b, dev)
            total, n = total + t, n + 1
            us = [b["bytes"] / dev["copy_bw"] * 1e6, b["flops"] / dev["fp32"] * 1e6,
                  b["flops"] / dev["fp64"] * 1e6]
            lines.append(f"| {c.cls} | {c.label()} | {c.dtype} | {p} | {_mb(b['bytes'])} | "
                         f"{_gf(b['flops'])} | {t * 1e6:.2f} | "
                         + " | ".join(f"{u:.2f}" for u in us) + " |")
    lines += ["", f"Sum of the lower bounds: {total * 1e3:.2f} ms over {n} rows."]
    return "\n".join(lines) + "\n"


def _mb(n):
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.2f} kB"


def _gf(n):
    return f"{n / 1e9:.3g} GF" if n >= 1e8 else f"{n / 1e6:.3g} MF"


# --------------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Seconds of one call (CUDA events on a GPU, perf_counter on the emulator's CPU tensors)."""

    def __init__(self, cuda):
        self.cuda = cuda

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn):
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def graph(self, fn, reps, replays):
        """Median seconds per call over `replays` replays of a CUDA graph of `reps` calls."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        return statistics.median(self.once(g.replay) for _ in range(replays)) / reps


@dataclass
class Pass:
    """The two implementations of one pass; prep_* run untimed before the warm-up."""
    ours: object
    torch: object
    graph: bool             # time by CUDA-graph replays (else eager calls)
    prep_ours: object = None
    prep_torch: object = None


class Skipped(Exception):
    pass


@dataclass
class Timing:
    s: float
    runs: str
    note: str = ""


class Bench:
    def __init__(self, args, cuda):
        self.smoke, self.cuda = args.smoke, cuda
        self.clock = Clock(cuda)
        self.budget_s, self.case_budget_s = args.budget_s, args.case_budget_s
        self.t0 = time.monotonic()
        self.slow = {}      # (impl, pass) -> (D, seconds of one call) of the slowest DBN call so far
        self.dev = gnh.DEVICE

    def remaining(self):
        return self.budget_s - (time.monotonic() - self.t0)

    def measure(self, fn, graph):
        """Warm-up, then the median of several runs within about --case-budget-s."""
        if self.smoke:
            return Timing(self.clock.once(fn), "1")
        budget = self.case_budget_s
        t = self.clock.once(fn)  # warm-up (first-call costs included)
        if t > budget:
            return Timing(t, "1", f"1 run: the warm-up took {t:.2f} s > {budget:g} s")
        t = self.clock.once(fn)
        if graph and self.cuda:
            reps = max(1, min(50, int(2e-3 / max(t, 1e-7))))
            replays = max(3, min(9, int(budget / 4 / max(t * reps, 1e-7))))
            try:
                return Timing(self.clock.graph(fn, reps, replays), f"{replays}x{reps} graph")
            except Exception:  # noqa: BLE001 - capture unsupported: time eager launches instead
                torch.cuda.synchronize()
        if 3 * t > budget / 2:
            return Timing(t, "1", f"1 run after the warm-up: {t:.2f} s, 3 exceed {budget / 2:g} s")
        runs = max(3, min(15, int(budget / 4 / max(t, 1e-7))))
        return Timing(statistics.median(self.clock.once(fn) for _ in range(runs)), str(runs))

    # ---- tensors

    def tensor(self, shape, dtype, offset=0, fill="randn"):
        n = bounds.numel(shape)
        buf = torch.empty(n + offset, dtype=dtype, device=self.dev)
        t = buf[offset:].view(shape)
        if fill == "randn":
            t.copy_(torch.randn(shape, dtype=torch.float32, device=self.dev))
        return t

    # ---- per class: {pass: Pass}

    def gn_passes(self, c):
        if c.cls == "sd_unet_nhwc":
            return self.gn_nhwc_passes(c)
        dt = getattr(torch, c.dtype)
        N, C = c.shape[:2]
        S = bounds.numel(c.shape[2:])
        x = self.tensor(c.shape, dt, c.offset)
        dy = self.tensor(c.shape, dt, c.offset)
        y, dx = self.tensor(c.shape, dt, c.offset, None), self.tensor(c.shape, dt, c.offset, None)
        gamma = (torch.rand(C, device=self.dev) + 0.5).to(dt)
        beta = torch.randn(C, device=self.dev).to(dt)
        fwd = gnh.GroupNormFwd(x, gamma, beta, c.G, EPS, y=y)
        fwd()
        bwd = gnh.GroupNormBwd(dy, x, fwd.mean, fwd.rstd, gamma, c.G, dx=dx)
        aten = torch.ops.aten

        def t_fwd():
            return aten.native_group_norm(x, gamma, beta, N, C, S, c.G, EPS)

        _, tm, tr = t_fwd()

        def t_bwd():
            return aten.native_group_norm_backward(dy, x, tm, tr, gamma, N, C, S, c.G, [True] * 3)

        return {"fwd": Pass(fwd, t_fwd, True), "bwd": Pass(bwd, t_bwd, True)}

    def gn_nhwc_passes(self, c):
        """Channels-last data: the kernels see (N, S, C) memory (gnh_set_channels_last around
        every call; the tensors are allocated (N, C, S)-shaped, which only labels the dims); torch
        runs its group_norm on an NCHW-shaped tensor in channels_last memory format."""
        import ctypes
        dt = getattr(torch, c.dtype)
        N, C = c.shape[:2]
        S = bounds.numel(c.shape[2:])
        lib = gnh.load()
        layout = lib.gnh_set_channels_last
        layout.argtypes, layout.restype = [ctypes.c_int], None

        def nhwc(f):
            def call():
                layout(1)
                try:
                    return f()
                finally:
                    layout(0)
            return call

        x, dy = self.tensor((N, C, S), dt), self.tensor((N, C, S), dt)
        y, dx = self.tensor((N, C, S), dt, 0, None), self.tensor((N, C, S), dt, 0, None)
        gamma = (torch.rand(C, device=self.dev) + 0.5).to(dt)
        beta = torch.randn(C, device=self.dev).to(dt)
        fwd = nhwc(lambda: gnh.GroupNormFwd(x, gamma, beta, c.G, EPS, y=y))()
        nhwc(fwd)()
        bwd = nhwc(lambda: gnh.GroupNormBwd(dy, x, fwd.mean, fwd.rstd, gamma, c.G, dx=dx))()
        cl = torch.channels_last
        xt = torch.randn(c.shape, device=self.dev).to(dt).to(memory_format=cl)
        dyt = torch.randn(c.shape, device=self.dev).to(dt).to(memory_format=cl)
        aten = torch.ops.aten

        def t_fwd():
            return aten.native_group_norm(xt, gamma, beta, N, C, S, c.G, EPS)

        _, tm, tr = t_fwd()

        def t_bwd():
            return aten.native_group_norm_backward(dyt, xt, tm, tr, gamma, N, C, S, c.G, [True] * 3)

        return {"fwd": Pass(nhwc(fwd), t_fwd, True), "bwd": Pass(nhwc(bwd), t_bwd, True)}

    def affine_passes(self, c):
        dt = getattr(torch, c.dtype)
        C = c.shape[1]
        x, dy = self.tensor(c.shape, dt), self.tensor(c.shape, dt)
        gamma = (torch.rand(C, device=self.dev) + 0.5).to(dt)
        beta = torch.randn(C, device=self.dev).to(dt)
        bshape = (1, C) + (1,) * (len(c.shape) - 2)
        red = [0] + list(range(2, len(c.shape)))
        gb, bb = gamma.view(bshape), beta.view(bshape)

        def t_bwd():
            return dy * gb, (dy * x).sum(red), dy.sum(red)

        return {"fwd": Pass(lambda: gnh.affine_fwd(x, gamma, beta), lambda: torch.addcmul(bb, x, gb),
                            True),
                "bwd": Pass(lambda: gnh.affine_bwd(dy, x, gamma), t_bwd, True)}

    def dbn_passes(self, c):
        dt = getattr(torch, c.dtype)
        G, D = c.G, c.D
        x, dy = self.tensor(c.shape, dt), self.tensor(c.shape, dt)
        saved = {}

        def o_fwd():
            saved["fwd"] = gnh.dbn_fwd(x, G, eps=EPS)

        def o_prep():  # the backward needs a forward's statistics: the last timed one's
            if "fwd" not in saved:
                raise Skipped("the forward was not run")

        def o_bwd():
            _, mean, U, l = saved["fwd"]
            return gnh.dbn_bwd(dy, x, mean, U, l, G)

        rm = torch.randn(c.shape[1], dtype=torch.float32, device=self.dev)
        q = torch.linalg.qr(torch.randn(G, D, D, dtype=torch.float32, device=self.dev))[0]
        P = (q * (torch.rand(G, 1, D, device=self.dev) + 0.5)) @ q.transpose(1, 2)  # SPD projection
        tgraph = {}

        def t_fwd():
            with torch.no_grad():
                return torch_dbn(x, G)

        def t_prep():  # the autograd graph of one forward, outside the timing
            tgraph["x"] = x.detach().clone().requires_grad_(True)
            tgraph["y"] = torch_dbn(tgraph["x"], G)

        def t_bwd():
            return torch.autograd.grad(tgraph["y"], tgraph["x"], dy, retain_graph=True)

        return {"fwd": Pass(o_fwd, t_fwd, False),
                "bwd": Pass(o_bwd, t_bwd, False, o_prep, t_prep),
                "inference": Pass(lambda: gnh.dbn_inference(x, rm, P, G),
                                  lambda: torch_dbn_inference(x, rm, P, G), False)}

    # ---- rows

    def run_case(self, c, peaks):
        if self.remaining() <= 0:
            return [self.row(c, p, None, None, peaks, f"skipped: the run's --budget-s "
                             f"({self.budget_s:g} s) is spent") for p in c.passes]
        try:
            passes = (self.dbn_passes(c) if c.cls == "dbn" else
                      self.affine_passes(c) if c.cls == "affine" else self.gn_passes(c))
        except Exception as e:  # noqa: BLE001 - one broken case must not lose the others
            return [self.row(c, p, None, None, peaks, f"error: {_short(e)}") for p in c.passes]
        rows = []
        old = os.environ.get(EIG_ENV)
        if c.eig:
            os.environ[EIG_ENV] = c.eig  # read by dbn_cuda.cu at every forward
        try:
            for p in c.passes:
                ps = passes[p]
                res = {impl: self.timed(c, p, impl, getattr(ps, impl), ps.graph,
                                        getattr(ps, "prep_" + impl))
                       for impl in ("ours", "torch")}
                rows.append(self.row(c, p, res["ours"], res["torch"], peaks))
        finally:
            if c.eig:
                if old is None:
                    os.environ.pop(EIG_ENV, None)
                else:
                    os.environ[EIG_ENV] = old
        del passes
        if self.cuda:
            torch.cuda.empty_cache()
        return rows

    def timed(self, c, p, impl, fn, graph, prep=None):
        key = (impl, p, c.eig)
        if c.cls == "dbn" and key in self.slow and not self.smoke:
            D0, t0 = self.slow[key]
            pred = t0 * (c.D / D0) ** 3
            if c.D >= D0 and pred > max(self.remaining(), 0.0) and pred > self.case_budget_s:
                return Timing(math.nan, "0", f"{impl} skipped: ~{pred:.1f} s predicted from "
                              f"{t0:.2f} s at D={D0} (> the {self.remaining():.0f} s left)")
        try:
            if prep is not None:
                prep()
            t = self.measure(fn, graph)
        except Skipped as e:
            return Timing(math.nan, "0", f"{impl} skipped: {e}")
        except Exception as e:  # noqa: BLE001
            if self.cuda:
                torch.cuda.synchronize()
            return Timing(math.nan, "0", f"{impl} error: {_short(e)}")
        if c.cls == "dbn" and (key not in self.slow or t.s > self.slow[key][1]):
            self.slow[key] = (c.D, t.s)
        if t.note:
            t.note = f"{impl} {t.note}"
        return t

    def row(self, c, p, ours, tref, peaks, note=""):
        b = bounds.case_bound(c, p)
        r = {"cls": c.cls, "case": c.label(), "shape": list(c.shape), "dtype": c.dtype, "G": c.G,
             "D": c.D, "offset": c.offset, "pass": p, "bytes": b["bytes"], "flops": b["flops"],
             "bound_us": 1e6 * max(b["bytes"] / peaks["copy_bw"],
                                   b["flops"] / peaks["fp32"] if c.cls == "dbn" else 0.0)}
        notes = [note] if note else []
        for impl, t in (("ours", ours), ("torch", tref)):
            s = t.s if t is not None else math.nan
            r[f"{impl}_us"] = s * 1e6 if s == s else None
            r[f"{impl}_runs"] = t.runs if t is not None else "0"
            if t is not None and t.note:
                notes.append(t.note)
            for k, peak in (("copy", "copy_bw"), ("fp32", "fp32"), ("fp64", "fp64")):
                num = b["bytes"] if k == "copy" else b["flops"]
                ok = s == s and s > 0 and (k == "copy" or c.cls == "dbn")
                r[f"{impl}_pct_{k}"] = 100.0 * num / s / peaks[peak] if ok else None
        r["speedup"] = (r["torch_us"] / r["ours_us"]) if r["torch_us"] and r["ours_us"] else None
        r["note"] = "; ".join(notes)
        return r


def to_groups(x, G):
    """(N, C, ...) -> (G, D, m): the D x m matrix of each group (a copy, as a torch user would)."""
    N, C = x.shape[:2]
    return x.reshape(N, G, C // G, -1).permute(1, 2, 0, 3).reshape(G, C // G, -1)


def from_groups(X, shape):
    G, D, _ = X.shape
    return X.reshape(G, D, shape[0], -1).permute(2, 0, 1, 3).reshape(shape)


def torch_dbn(x, G, eps=EPS):
    """ZCA whitening as a torch user writes it: batched covariance, torch.linalg.eigh,
    W = U diag(l^-1/2) U^T, applied with matmul; autograd gives the backward."""
    X = to_groups(x, G)
    Xc = X - X.mean(-1, keepdim=True)
    eye = torch.eye(X.shape[1], device=x.device, dtype=x.dtype)
    sigma = Xc @ Xc.transpose(1, 2) / X.shape[-1] + eps * eye
    l, U = torch.linalg.eigh(sigma)
    W = (U * l.clamp_min(eps).rsqrt().unsqueeze(1)) @ U.transpose(1, 2)
    return from_groups(W @ Xc, x.shape)


def torch_dbn_inference(x, running_mean, P, G):
    """y = P (x - running_mean) per group, P: (G, D, D)."""
    X = to_groups(x, G) - running_mean.reshape(G, -1, 1)
    return from_groups(P @ X, x.shape)


def _short(e):
    s = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return s[:160]


# --------------------------------------------------------------------------------------------------
# Device facts and peaks, measured at the start


def measure_peaks(clock, smoke, dev):
    """Copy bandwidth (read + write bytes / time of a device-to-device copy) and fp32 / fp64 matmul
    rates (TF32 off), each the best of a few timed calls after a warm-up."""
    def best(fn, k):
        fn()
        return min(clock.once(fn) for _ in range(k))

    n = (1 << 24) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * n / best(lambda: dst.copy_(src), 3 if smoke else 10)
    del src, dst
    peaks = {"copy_bw": copy_bw}
    k = 256 if smoke else 8192
    for name, dt in (("fp32", torch.float32), ("fp64", torch.float64)):
        a = torch.randn(k, k, dtype=dt, device=dev)
        b = torch.randn(k, k, dtype=dt, device=dev)
        peaks[name] = 2 * k ** 3 / best(lambda: torch.mm(a, b), 2 if smoke else 5)
        del a, b
    if dev == "cuda":
        torch.cuda.empty_cache()
    return peaks


def device_meta(cuda, peaks, smoke):
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "smoke" if smoke else "full", "emulator": gnh.EMU,
            "copy_gbs": peaks["copy_bw"] / 1e9, "fp32_tflops": peaks["fp32"] / 1e12,
            "fp64_tflops": peaks["fp64"] / 1e12, "tf32": False}
    if cuda:
        prop = torch.cuda.get_device_properties(0)
        meta.update(device=prop.name, sms=prop.multi_processor_count, cuda=torch.version.cuda,
                    memory_gib=round(prop.total_memory / 2 ** 30, 1),
                    capability=f"{prop.major}.{prop.minor}", driver=_nvidia_smi("driver_version"),
                    nvcc=_nvcc_version(), linalg=str(torch.backends.cuda.preferred_linalg_library()))
    else:
        meta.update(device=f"CPU ({platform.processor() or platform.machine()}) through the CUDA "
                    "emulator" if gnh.EMU else "CPU", sms=None, cuda=None, driver=None,
                    nvcc=_nvcc_version(), threads=torch.get_num_threads())
    return meta


def _nvidia_smi(field):
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def _nvcc_version():
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        lines = [ln for ln in out.splitlines() if "release" in ln] or out.strip().splitlines()[-1:]
        return lines[0].strip() if lines else None
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------------------------------------
# Output


def _num(v, fmt):
    return "-" if v is None else format(v, fmt)


def _na(v):
    return "n/a" if v is None else v


def _pct(v):
    return "-" if v is None else (f"{v:.1f}%" if v < 10 else f"{v:.0f}%")


def _bound_text(r):
    s = _mb(r["bytes"])
    return s + (f", {_gf(r['flops'])}" if r["cls"] == "dbn" else "")


def markdown(meta, rows):
    cls_seen = [k for k in CLASSES if any(r["cls"] == k for r in rows)]
    lines = [f"# gn_mx GPU benchmark ({meta['device']})", "",
             f"- {meta['mode']} run, {meta['date']}; torch {meta['torch']}, CUDA {_na(meta['cuda'])}, "
             f"driver {_na(meta['driver'])}, nvcc: {_na(meta['nvcc'])}; python {meta['python']}",
             f"- {_na(meta.get('sms'))} SMs, compute capability {_na(meta.get('capability'))}, "
             f"{_na(meta.get('memory_gib'))} GiB; measured copy bandwidth {meta['copy_gbs']:.0f} GB/s "
             f"(read + write of a device copy), matmul fp32 {meta['fp32_tflops']:.1f} TFLOP/s (TF32 off), "
             f"fp64 {meta['fp64_tflops']:.1f} TFLOP/s",
             "- ours: gn_mx's CUDA kernels through tests/gpu/harness.cc; torch: F.group_norm's aten "
             "kernels, addcmul + reductions (affine), eigh-based DBN with autograd (dbn)",
             "- times: median per call (runs: `RxK graph` = R replays of a CUDA graph of K calls, "
             "`n` = n eager calls each timed by CUDA events, DBN eager incl. launch overhead; "
             "on the emulator one call by the CPU clock)",
             "- bound: bytes that must move (+ flops of the dense DBN math), benchmarks/gpu/_bounds.py; "
             "%copy = bytes / time / copy bw; %fp32, %fp64 = flops / time / matmul rate (ours)",
             f"- time budget {_na(meta.get('budget_s'))} s (per pass {meta.get('case_budget_s')} s); "
             f"benchmark wall time {meta.get('wall_s', 0):.0f} s",
             "- classes: " + "; ".join(f"{k} = {CLASSES[k]}" for k in cls_seen)]
    if meta.get("interrupted"):
        lines.append("- INTERRUPTED (SIGTERM or Ctrl-C): the cases after the last row were not run")
    elif meta.get("partial"):
        lines.append("- PARTIAL: written after the last row; the run did not finish (killed?)")
    lines += ["",
              "| class | case | dtype | pass | ours us | torch us | torch/ours | bound | bound us | "
              "ours %copy | ours %fp32 | ours %fp64 | runs ours/torch | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['cls']} | {r['case']} | {r['dtype']} | {r['pass']} | {_num(r['ours_us'], '.1f')} | "
            f"{_num(r['torch_us'], '.1f')} | {_num(r['speedup'], '.2f')} | {_bound_text(r)} | "
            f"{r['bound_us']:.2f} | {_pct(r['ours_pct_copy'])} | {_pct(r['ours_pct_fp32'])} | "
            f"{_pct(r['ours_pct_fp64'])} | {r['ours_runs']}/{r['torch_runs']} | {r['note']} |")
    timed = [r for r in rows if r["speedup"] is not None]
    slow = [r for r in timed if r["speedup"] < 1]
    lines += ["", f"Rows: {len(rows)}; timed for both: {len(timed)}; slower than torch: {len(slow)}; "
              f"with a note (skipped, one run, error): {sum(1 for r in rows if r['note'])}."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Details, columns and budgets: benchmarks/gpu/README.md")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write gpu_bench.{json,md} into DIR (e.g. benchmarks/results); "
                    "default: print only")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes of every class, one run each (checks the script; with "
                    "GNMX_HARNESS_EMU=1 on the CPU emulator)")
    ap.add_argument("--estimate", action="store_true",
                    help="print the H200 lower-bound time of every row of the full run; runs nothing")
    ap.add_argument("--only", default=None, metavar="CLS[,CLS]",
                    help="classes to run: " + ", ".join(CLASSES))
    ap.add_argument("--quick", action="store_true", help="every class but dbn")
    ap.add_argument("--dbn-eig", default="", metavar="PATH[,PATH]",
                    help="also time the DBN forwards with GNMX_DBN_CUDA_EIG set to each (e.g. "
                    "shared,cusolver; where the kernels read it), after the default rows")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the measurements; cases after it are skipped (default "
                    "100, none with --smoke)")
    ap.add_argument("--case-budget-s", type=float, default=1.0,
                    help="a pass whose warm-up call takes longer is reported from that call alone; "
                    "also the target time of each pass's repeats (default 1)")
    return ap.parse_args(argv)


def _eigs(args):
    return [e for e in args.dbn_eig.split(",") if e and e != "auto"]


def select(cases, only, quick=False):
    if quick:
        cases = [c for c in cases if c.cls != "dbn"]
    if not only:
        return cases
    want = only.split(",")
    bad = [w for w in want if w not in CLASSES]
    if bad:
        raise SystemExit(f"bench_gpu.py: unknown class(es) {bad}; choose from {list(CLASSES)}")
    return [c for c in cases if c.cls in want]


def run(args, report):
    """Measures every selected case; report(meta, rows) after each case (partial results survive a
    hang that only SIGKILL ends) and once at the end."""
    global torch, gnh
    import torch
    import gnh
    if not gnh.available():
        raise SystemExit("bench_gpu.py: no CUDA device (GNMX_HARNESS_EMU=1 runs --smoke on the CPU "
                         "emulator)")
    cuda = not gnh.EMU
    if not cuda and not args.smoke:
        raise SystemExit("bench_gpu.py: the emulator measures nothing; use --smoke with it")
    gnh.load()
    torch.manual_seed(0)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    bench = Bench(args, cuda)
    peaks = measure_peaks(bench.clock, args.smoke, gnh.DEVICE)
    meta = device_meta(cuda, peaks, args.smoke)
    meta.update(budget_s=args.budget_s if math.isfinite(args.budget_s) else None,
                case_budget_s=args.case_budget_s, partial=True)
    print(f"{meta['device']}: copy {meta['copy_gbs']:.0f} GB/s, fp32 {meta['fp32_tflops']:.1f} "
          f"TFLOP/s, fp64 {meta['fp64_tflops']:.1f} TFLOP/s", flush=True)
    bench.t0 = time.monotonic()
    rows = []
    try:
        for c in select(smoke_cases() if args.smoke else full_cases(_eigs(args)), args.only, args.quick):
            for r in bench.run_case(c, peaks):
                rows.append(r)
                print(f"{r['cls']:11s} {r['case']:38s} {r['dtype']:7s} {r['pass']:9s} ours "
                      f"{_num(r['ours_us'], '10.1f')} us  torch {_num(r['torch_us'], '10.1f')} us  "
                      f"{_pct(r['ours_pct_copy']):>5s} copy  {r['note']}", flush=True)
            meta["wall_s"] = time.monotonic() - bench.t0
            report(meta, rows, final=False)
        meta["partial"] = False
    except KeyboardInterrupt:
        meta["interrupted"] = True
        print("bench_gpu.py: interrupted; reporting the rows so far", flush=True)
    meta["wall_s"] = time.monotonic() - bench.t0
    report(meta, rows, final=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def writer(out):
    """report(meta, rows, final): print the table at the end, or (--out) write gpu_bench.{json,md}
    after every case, each file replaced atomically."""
    def report(meta, rows, final):
        md = markdown(meta, rows)
        if out is None:
            if final:
                print(md, end="")
            return
        os.makedirs(out, exist_ok=True)
        for name, text in (("gpu_bench.json", json.dumps({"meta": meta, "rows": rows}, indent=1)),
                           ("gpu_bench.md", md)):
            path = os.path.join(out, name)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        if final:
            print(f"wrote {out}/gpu_bench.json and gpu_bench.md")
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.budget_s is None:
        args.budget_s = math.inf if args.smoke else 100.0
    if args.estimate:
        print(estimate_table(select(full_cases(_eigs(args)), args.only, args.quick)), end="")
        return
    import signal
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` in run_all.sh: report the rows so far
    run(args, writer(args.out))


if __name__ == "__main__":
    main()
