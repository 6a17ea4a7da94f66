#!/usr/bin/env python
"""GroupNorm on the CPU: gn_mx against MXNet's built-in op, the composed Gluon block and PyTorch.

    python benchmarks/bench_group_norm.py                 # 1 and 2 threads, all shapes (a few minutes)
    python benchmarks/bench_group_norm.py --quick         # fewer shapes and repeats
    python benchmarks/bench_group_norm.py --threads 1     # one thread count only

Contenders (same shapes, dtypes, eps, thread count; each measured in the same process, interleaved):
  gn_mx       mx.nd.gn_group_norm (this package; per-channel gamma/beta), imperative
  gn_mx_block gn_mx.GroupNorm hybridized with static_alloc (what a network runs: the CachedOp path,
              no identity on the parameter path since grad_req is 'write'); forward = inference
  mx_builtin  mx.nd.GroupNorm (MXNet's op; per-*group* gamma/beta, so it cannot express the usual layer)
  composed    the Gluon HybridBlock the community writes (reshape, mean, broadcast ops, per-channel affine),
              hybridized; for fp16 also `composed_f32`: the same block with casts to fp32 and back
  torch       torch.nn.functional.group_norm, when torch is importable (torch.set_num_threads(t))
  bound       the memory-bandwidth bound at the same size: copy time of the tensor (read x, write y) for
              forward; 2 copies + 1 read reduction (read x, dy twice, write y, dx) for forward+backward.
              Copy/reduction run with torch (threaded) when available, else numpy (1 thread).
Also reported: the per-call dispatch floor (a trivial MXNet op, a trivial gn_mx op, a trivial torch op)
and peak extra memory of one forward+backward (--memory; fresh process per contender, VmHWM).

Each (allocator regime, thread count) runs in its own process with OMP_NUM_THREADS=t (MXNet sets its
OpenMP team size process-wide from it). Times are medians of repeated samples; each sample times a
loop long enough to be well above the timer resolution. Two allocator regimes (--regimes, default
both):
  kept    glibc's malloc told to keep freed memory (MALLOC_ARENA_MAX=1, MALLOC_MMAP_MAX_=0,
          MALLOC_TRIM_THRESHOLD_): freed tensors are reused warm, as with a caching allocator;
  system  glibc defaults, what users get out of the box: every framework's fresh output tensors are
          page-faulted in from the kernel at each call (MXNet allocates them on its engine threads,
          in per-thread arenas capped at 64 MB), which costs more than the normalization itself on
          large shapes (e.g. 8x128x128x128 fp32: any MXNet op 90-110 ms instead of 15-25 ms) and
          hits every contender. (--system-malloc = --regimes system.)

Outputs: a table on stdout; with --out DIR also DIR/group_norm_cpu.{json,md,png} (the tracked ones:
--out benchmarks/results).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# (shape, num_groups). >= 1 MB of fp32 input: all but the first two; >= 32 MB: the last two.
SHAPES = [
    ((4, 32, 8, 8), 8),             # 32 KB: dispatch-bound
    ((64, 1024), 32),               # 256 KB, no spatial dims
    ((2, 64, 56, 56), 32),          # 1.6 MB
    ((8, 256, 28, 28), 32),         # 6.4 MB
    ((1, 320, 64, 64), 32),         # 5.2 MB, N*G = 32
    ((3, 96, 32, 32, 8), 16),       # 9.4 MB, 3 spatial dims, N*G = 48
    ((1, 64, 256, 256), 1),         # 16.8 MB, one group (threads share it)
    ((8, 128, 128, 128), 32),       # 67 MB
    ((16, 256, 56, 56), 32),        # 51 MB
]
QUICK_SHAPES = [SHAPES[1], SHAPES[2], SHAPES[3], SHAPES[4], SHAPES[8]]
DTYPES = ["float32", "float16"]
MODES = ["fwd", "fwdbwd"]
EPS = 1e-5


def nbytes(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n * (2 if dtype == "float16" else 4)


def shape_str(shape, G):
    return "x".join(str(s) for s in shape) + f" G{G}"


# ------------------------------------------------------------------------------------------------
# Child: timing in one process with a fixed thread count


def _median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class Timer:
    """Interleaved timing of several callables: each round runs every contender once (one sample =
    a loop of `inner` calls); the result per contender is the median over rounds (seconds per call)."""

    def __init__(self, min_sample_s, rounds, max_time_s):
        self.min_sample_s = min_sample_s
        self.rounds = rounds
        self.max_time_s = max_time_s

    def run(self, fns):
        inner, samples = {}, {}
        for name, (step, sync) in fns.items():
            try:
                t0 = time.perf_counter()
                step(); sync()  # warm-up (allocations, graph build)
                one = time.perf_counter() - t0
                if one <= self.max_time_s / 8:
                    t0 = time.perf_counter()
                    step(); sync()
                    one = max(time.perf_counter() - t0, 1e-7)
            except Exception as e:  # noqa: BLE001 - report, keep going
                samples[name] = "error: %s" % str(e).strip().splitlines()[0][:160]
                continue
            samples[name] = [one]
            if one > self.max_time_s / 8:
                continue  # very slow contender (seconds per call): one timed call is enough
            inner[name] = max(1, int(self.min_sample_s / one))
            samples[name] = []
        t_start = time.perf_counter()
        for r in range(self.rounds):
            for name, (step, sync) in fns.items():
                if name not in inner:
                    continue
                k = inner[name]
                t0 = time.perf_counter()
                for _ in range(k):
                    step()
                sync()
                samples[name].append((time.perf_counter() - t0) / k)
            if r >= 2 and time.perf_counter() - t_start > self.max_time_s:
                break
        self.last_min = {n: min(s) for n, s in samples.items() if isinstance(s, list)}
        return {n: (_median(s) if isinstance(s, list) else s) for n, s in samples.items()}


def _nosync():
    pass


def child_main(args):
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
    import gn_mx  # noqa: F401  (registers mx.nd.gn_*)

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        import torch
        import torch.nn.functional as TF
        torch.set_num_threads(threads)
    except ImportError:
        torch = None

    class ComposedGroupNorm(gluon.HybridBlock):
        """GroupNorm with per-channel affine as the community composes it from MXNet ops."""

        def __init__(self, channels, num_groups, ndim, eps=1e-5, cast_fp32=False, dtype="float32"):
            super().__init__()
            self.G, self.eps, self.cast, self.dtype = num_groups, eps, cast_fp32, dtype
            self.aff_shape = (1, channels) + (1,) * (ndim - 2)
            pdt = "float32" if cast_fp32 else dtype
            with self.name_scope():
                self.gamma = self.params.get("gamma", shape=(channels,), init="ones", dtype=pdt)
                self.beta = self.params.get("beta", shape=(channels,), init="zeros", dtype=pdt)

        def hybrid_forward(self, F, x, gamma, beta):
            if self.cast:
                x = F.cast(x, "float32")
            xg = F.reshape(x, (0, self.G, -1))
            mean = F.mean(xg, axis=2, keepdims=True)
            xc = F.broadcast_sub(xg, mean)
            var = F.mean(F.square(xc), axis=2, keepdims=True)
            xn = F.broadcast_div(xc, F.sqrt(var + self.eps))
            xn = F.reshape_like(xn, x)
            y = F.broadcast_add(F.broadcast_mul(xn, F.reshape(gamma, self.aff_shape)),
                                F.reshape(beta, self.aff_shape))
            if self.cast:
                y = F.cast(y, self.dtype)
            return y

    def mx_case(shape, G, dtype, mode, which):
        C = shape[1]
        rng = np.random.default_rng(0)
        x = mx.nd.array(rng.standard_normal(shape), dtype=dtype)
        dy = mx.nd.array(rng.standard_normal(shape), dtype=dtype)
        if which == "gn_mx":
            pdt = dtype
            g, b = mx.nd.ones((C,), dtype=pdt), mx.nd.zeros((C,), dtype=pdt)
            fwd = lambda: mx.nd.gn_group_norm(x, g, b, num_groups=G, eps=EPS)[0]
            params = [g, b]
        elif which == "gn_mx_block":
            blk = gn_mx.GroupNorm(G, epsilon=EPS, in_channels=C)
            blk.initialize(ctx=mx.cpu())
            blk.cast(dtype)
            blk.hybridize(static_alloc=True, static_shape=True)
            fwd = lambda: blk(x)
            params = []
        elif which == "mx_builtin":
            g, b = mx.nd.ones((G,), dtype=dtype), mx.nd.zeros((G,), dtype=dtype)
            fwd = lambda: mx.nd.GroupNorm(x, g, b, num_groups=G, eps=EPS)
            params = [g, b]
        else:
            blk = ComposedGroupNorm(C, G, len(shape), EPS, cast_fp32=(which == "composed_f32"),
                                    dtype=dtype)
            blk.initialize(ctx=mx.cpu())
            blk.hybridize(static_alloc=True)
            fwd = lambda: blk(x)
            params = []
        if mode == "fwd":
            return (fwd, mx.nd.waitall)
        x.attach_grad()
        for p in params:
            p.attach_grad()

        def step():
            with autograd.record():
                y = fwd()
            y.backward(dy)
        return (step, mx.nd.waitall)

    def torch_case(shape, G, dtype, mode):
        C = shape[1]
        tdt = torch.float16 if dtype == "float16" else torch.float32
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen).to(tdt)
        dy = torch.randn(shape, generator=gen).to(tdt)
        w, b = torch.ones(C, dtype=tdt), torch.zeros(C, dtype=tdt)
        if mode == "fwd":
            def step():
                with torch.no_grad():
                    TF.group_norm(x, G, w, b, EPS)
            return (step, _nosync)
        x.requires_grad_(True); w.requires_grad_(True); b.requires_grad_(True)

        def step():
            y = TF.group_norm(x, G, w, b, EPS)
            torch.autograd.grad(y, (x, w, b), dy)  # fresh gradients: no accumulation pass
        return (step, _nosync)

    def bound_cases(shape, dtype):
        n = 1
        for s in shape:
            n *= s
        if torch is not None:
            tdt = torch.float16 if dtype == "float16" else torch.float32
            a = torch.randn(n).to(tdt)
            c = torch.empty_like(a)
            return ((lambda: c.copy_(a), _nosync), (lambda: a.sum(), _nosync))
        a = np.random.standard_normal(n).astype(dtype)
        c = np.empty_like(a)
        return ((lambda: np.copyto(c, a), _nosync), (lambda: a.sum(dtype=np.float32), _nosync))

    timer = Timer(args.min_sample_ms / 1e3, args.rounds, args.max_cell_s)
    out = {"threads": threads, "torch": torch.__version__ if torch is not None else None,
           "mxnet": mx.__version__, "results": [], "floor": {}, "bandwidth": {},
           "loadavg_start": os.getloadavg(), "gn_mx_library": gn_mx.library_path()}

    # Bandwidth of this machine at this thread count: 256 MB copy and read reduction.
    cp, rd = bound_cases((64 * 1024 * 1024,), "float32")
    big = timer.run({"copy": cp, "read": rd})
    out["bandwidth"] = {"bytes": 256 * 2 ** 20, "copy_GBps": 2 * 256 * 2 ** 20 / big["copy"] / 1e9,
                        "read_GBps": 256 * 2 ** 20 / big["read"] / 1e9,
                        "tool": "torch" if torch is not None else "numpy (1 thread)"}

    # Per-call floors: trivial ops on a 1-element tensor.
    t1 = mx.nd.ones((1, 1))
    g1, b1 = mx.nd.ones((1,)), mx.nd.zeros((1,))
    fl = {"mx_trivial_op": (lambda: mx.nd.relu(t1), mx.nd.waitall),
          "gn_mx_trivial_op": (lambda: mx.nd.gn_moments(t1, num_groups=1), mx.nd.waitall),
          "gn_mx_group_norm_1elem": (lambda: mx.nd.gn_group_norm(t1, g1, b1, num_groups=1), mx.nd.waitall)}
    t1g = mx.nd.ones((1, 1))
    t1g.attach_grad()

    def mx_triv_fb():
        with autograd.record():
            y = mx.nd.relu(t1g)
        y.backward()
    fl["mx_trivial_fwdbwd"] = (mx_triv_fb, mx.nd.waitall)
    if torch is not None:
        tt = torch.ones(1, 1)
        fl["torch_trivial_op"] = (lambda: torch.relu(tt), _nosync)
    out["floor"] = timer.run(fl)

    shapes = QUICK_SHAPES if args.quick else SHAPES
    for shape, G in shapes:
        for dtype in DTYPES:
            for mode in MODES:
                fns = {}
                for which in ["gn_mx", "gn_mx_block", "mx_builtin", "composed"] + (["composed_f32"] if dtype == "float16" else []):
                    fns[which] = mx_case(shape, G, dtype, mode, which)
                if torch is not None:
                    fns["torch"] = torch_case(shape, G, dtype, mode)
                cp, rd = bound_cases(shape, dtype)
                fns["_copy"], fns["_read"] = cp, rd
                r = timer.run(fns)
                tc, tr = r.pop("_copy"), r.pop("_read")
                r["bound"] = tc if mode == "fwd" else 2 * tc + tr
                mn = dict(timer.last_min)
                mc, mr = mn.pop("_copy", None), mn.pop("_read", None)
                if mc is not None and mr is not None:
                    mn["bound"] = mc if mode == "fwd" else 2 * mc + mr
                out["results"].append({"shape": list(shape), "G": G, "dtype": dtype, "mode": mode,
                                       "bytes": nbytes(shape, dtype), "times_s": r, "min_times_s": mn})
                print(".", end="", file=sys.stderr, flush=True)
    print("", file=sys.stderr)
    out["loadavg_end"] = os.getloadavg()
    json.dump(out, sys.stdout)


# ------------------------------------------------------------------------------------------------
# Child: extra memory of one forward+backward (fresh process per contender)


def _vm(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def memory_child(args):
    import numpy as np
    import mxnet as mx
    from mxnet import autograd

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
    import gn_mx  # noqa: F401

    shape, G, dtype, which = tuple(args.mem_shape), args.mem_G, args.mem_dtype, args.mem_which
    C = shape[1]
    rng = np.random.default_rng(0)
    if which == "torch":
        import torch
        import torch.nn.functional as TF
        tdt = torch.float16 if dtype == "float16" else torch.float32
        # warm-up on a tiny shape: loads kernels and autograd machinery
        xs = torch.randn(2, C, 2).to(tdt).requires_grad_(True)
        ws = torch.ones(C, dtype=tdt, requires_grad=True)
        torch.autograd.grad(TF.group_norm(xs, G, ws, ws), (xs, ws), torch.ones_like(xs))
        x = torch.randn(shape).to(tdt)
        dy = torch.randn(shape).to(tdt)
        w = torch.ones(C, dtype=tdt, requires_grad=True)
        b = torch.zeros(C, dtype=tdt, requires_grad=True)
        x.requires_grad_(True)
        base = _vm("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")
        y = TF.group_norm(x, G, w, b, EPS)
        grads = torch.autograd.grad(y, (x, w, b), dy)
        peak = _vm("VmHWM")
        del grads, y
    else:
        def build(xx, dyy):
            if which == "gn_mx":
                g = mx.nd.ones((C,), dtype=dtype); b = mx.nd.zeros((C,), dtype=dtype)
                f = lambda: mx.nd.gn_group_norm(xx, g, b, num_groups=G, eps=EPS)[0]
                ps = [g, b]
            elif which == "mx_builtin":
                g = mx.nd.ones((G,), dtype=dtype); b = mx.nd.zeros((G,), dtype=dtype)
                f = lambda: mx.nd.GroupNorm(xx, g, b, num_groups=G, eps=EPS)
                ps = [g, b]
            else:
                cast = which == "composed_f32"
                f, ps = _composed_nd(mx, xx, C, G, dtype, cast), []
            return f, ps

        # warm-up on a tiny shape (engine threads, op registration)
        xs = mx.nd.ones((2, C, 2), dtype=dtype); dys = mx.nd.ones((2, C, 2), dtype=dtype)
        f, ps = build(xs, dys)
        xs.attach_grad()
        for p in ps:
            p.attach_grad()
        with autograd.record():
            y = f()
        y.backward(dys)
        mx.nd.waitall()
        x = mx.nd.array(rng.standard_normal(shape), dtype=dtype)
        dy = mx.nd.array(rng.standard_normal(shape), dtype=dtype)
        f, ps = build(x, dy)
        for p in ps:
            p.attach_grad()
        mx.nd.waitall()
        base = _vm("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")
        x.attach_grad()  # the dx buffer is part of what a forward+backward costs
        with autograd.record():
            y = f()
        y.backward(dy)
        mx.nd.waitall()
        peak = _vm("VmHWM")
    json.dump({"extra_bytes": peak - base}, sys.stdout)


def _composed_nd(mx, x, C, G, dtype, cast):
    """The composed block's graph, imperatively (same ops as ComposedGroupNorm)."""
    pdt = "float32" if cast else dtype
    gamma, beta = mx.nd.ones((C,), dtype=pdt), mx.nd.zeros((C,), dtype=pdt)
    gamma.attach_grad(); beta.attach_grad()
    aff = (1, C) + (1,) * (x.ndim - 2)

    def f():
        F = mx.nd
        xx = F.cast(x, "float32") if cast else x
        xg = F.reshape(xx, (0, G, -1))
        mean = F.mean(xg, axis=2, keepdims=True)
        xc = F.broadcast_sub(xg, mean)
        var = F.mean(F.square(xc), axis=2, keepdims=True)
        xn = F.reshape_like(F.broadcast_div(xc, F.sqrt(var + EPS)), xx)
        y = F.broadcast_add(F.broadcast_mul(xn, gamma.reshape(aff)), beta.reshape(aff))
        return F.cast(y, dtype) if cast else y
    return f


# ------------------------------------------------------------------------------------------------
# Parent


def child_env(threads, system_malloc):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("MXNET_ENGINE_TYPE", "ThreadedEnginePerDevice")
    if not system_malloc:
        # One heap for all threads (MXNet allocates outputs on its engine threads, whose arenas are
        # capped at 64 MB and give pages back), no mmap for big blocks, no trimming: freed tensors
        # are reused warm, as with a caching allocator.
        env["MALLOC_ARENA_MAX"] = "1"
        env["MALLOC_MMAP_MAX_"] = "0"
        env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 40)
    return env


def machine_info():
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    fl = line.split()
                    flags = [k for k in ("avx2", "fma", "f16c", "avx512f") if k in fl]
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "isa_flags": flags, "python": platform.python_version(),
            "system": platform.platform()}


CONTENDERS = ["gn_mx", "gn_mx_block", "torch", "mx_builtin", "composed", "composed_f32", "bound"]


def fmt_ms(v):
    if isinstance(v, str):
        return "err"
    if v is None:
        return "-"
    return "%.3f" % (v * 1e3) if v < 0.1 else "%.1f" % (v * 1e3)


def print_table(all_runs):
    lines = []
    for run in all_runs:
        t = run["threads"]
        bw = run["bandwidth"]
        lines.append("")
        lines.append("allocator=%s threads=%d  copy %.1f GB/s, read %.1f GB/s (%s, 256 MB); load average %.1f -> %.1f" % (
            run.get("regime", "kept"), t, bw["copy_GBps"], bw["read_GBps"], bw["tool"], run["loadavg_start"][0],
            run["loadavg_end"][0]))
        lines.append("dispatch floor per call: " + ", ".join(
            "%s %s us" % (k, ("%.1f" % (v * 1e6)) if not isinstance(v, str) else v)
            for k, v in run["floor"].items()))
        hdr = "%-26s %-7s %-6s %8s |" % ("shape", "dtype", "mode", "MB") + "".join(
            " %11s" % c for c in CONTENDERS) + " | %9s %9s %9s %9s" % ("torch/ours", "torch/blk", "builtin/ou",
                                                                       "ours/bound")
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for r in run["results"]:
            ts = r["times_s"]
            row = "%-26s %-7s %-6s %8.2f |" % (shape_str(r["shape"], r["G"]), r["dtype"], r["mode"],
                                               r["bytes"] / 2 ** 20)
            row += "".join(" %11s" % fmt_ms(ts.get(c)) for c in CONTENDERS)
            ours = ts.get("gn_mx")

            def ratio(a, b):
                if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
                    return "%9.2f" % (a / b)
                return "%9s" % "-"
            row += " | %9s %9s %9s %9s" % (ratio(ts.get("torch"), ours), ratio(ts.get("torch"), ts.get("gn_mx_block")),
                                           ratio(ts.get("mx_builtin"), ours), ratio(ours, ts.get("bound")))
            lines.append(row)
    lines.append("")
    lines.append("times in ms (median); bound = memory-bandwidth bound at that size; ratios > 1 in the")
    lines.append("first three columns mean gn_mx is faster (torch/blk: the hybridized block);")
    lines.append("ours/bound = 1 means at the bandwidth limit.")
    text = "\n".join(lines)
    print(text)
    return text


def _num(v):
    return v if isinstance(v, (int, float)) else None


def targets(all_runs):
    """The issue's targets, checked on this run: list of (name, met, detail)."""
    out = []
    MB = 2 ** 20
    for run in all_runs:
        t = run["threads"]
        tag = "%s t=%d" % (run.get("regime", "kept"), t)
        rs = run["results"]
        key = {(tuple(r["shape"]), r["G"], r["dtype"], r["mode"]): r for r in rs}

        def worst(rows, num, den):
            vals = []
            for r in rows:
                a, b = _num(r["times_s"].get(num)), _num(r["times_s"].get(den))
                if a is not None and b is not None and b > 0:
                    vals.append((a / b, shape_str(r["shape"], r["G"]) + " " + r["mode"]))
            return max(vals) if vals else (None, "")

        f32 = [r for r in rs if r["dtype"] == "float32"]
        big = [r for r in f32 if r["bytes"] >= MB]
        w = worst(big, "gn_mx", "torch")
        out.append(("%s fp32 >= 1 MB: ours/torch <= 1.0" % tag, w[0] is not None and w[0] <= 1.0,
                    "worst %.2f (%s)" % w if w[0] else "n/a"))
        w = worst([r for r in big if r["mode"] == "fwd"], "gn_mx_block", "torch")
        out.append(("%s fp32 >= 1 MB forward: hybridized block/torch <= 1.0" % tag,
                    w[0] is not None and w[0] <= 1.0, "worst %.2f (%s)" % w if w[0] else "n/a"))
        small = [r for r in f32 if r["bytes"] < MB]
        w = worst(small, "gn_mx", "torch")
        out.append(("%s fp32 < 1 MB: ours/torch <= 1.5" % tag, w[0] is not None and w[0] <= 1.5,
                    "worst %.2f (%s)" % w if w[0] else "n/a"))
        large = [r for r in f32 if r["bytes"] >= 32 * MB]
        w = worst(large, "gn_mx", "bound")
        out.append(("%s fp32 >= 32 MB: ours/bound <= 1.3" % tag, w[0] is not None and w[0] <= 1.3,
                    "worst %.2f (%s)" % w if w[0] else "n/a"))
        f16 = [r for r in rs if r["dtype"] == "float16"]
        w = worst([r for r in f16 if 2 * r["bytes"] >= MB], "gn_mx", "torch")
        out.append(("%s fp16: torch/ours >= 3 (shapes >= 1 MB in fp32)" % tag,
                    w[0] is not None and 1 / w[0] >= 3.0,
                    "worst torch/ours %.2f (%s)" % (1 / w[0], w[1]) if w[0] else "n/a"))
        vals = []
        for r in f16:
            if 2 * r["bytes"] < 32 * MB:
                continue
            r32 = key.get((tuple(r["shape"]), r["G"], "float32", r["mode"]))
            a, b = _num(r["times_s"].get("gn_mx")), _num(r32["times_s"].get("gn_mx")) if r32 else None
            if a and b:
                vals.append((a / b, shape_str(r["shape"], r["G"]) + " " + r["mode"]))
        w = max(vals) if vals else (None, "")
        out.append(("%s fp16 faster than our fp32 on >= 32 MB (fp32) shapes" % tag,
                    w[0] is not None and w[0] < 1.0, "worst fp16/fp32 %.2f (%s)" % w if w[0] else "n/a"))
    kept = [r for r in all_runs if r.get("regime", "kept") == all_runs[0].get("regime", "kept")]
    if len(kept) >= 2:
        r1, r2 = kept[0], kept[-1]
        k2 = {(tuple(r["shape"]), r["G"], r["dtype"], r["mode"]): r for r in r2["results"]}
        vals = []
        for r in r1["results"]:
            if r["dtype"] != "float32" or r["bytes"] < 32 * MB:
                continue
            o = k2.get((tuple(r["shape"]), r["G"], r["dtype"], r["mode"]))
            a, b = _num(r["times_s"].get("gn_mx")), _num(o["times_s"].get("gn_mx")) if o else None
            if a and b:
                vals.append((a / b, shape_str(r["shape"], r["G"]) + " " + r["mode"]))
        w = min(vals) if vals else (None, "")
        out.append(("scaling %d->%d threads >= 1.4x on >= 32 MB shapes" % (r1["threads"], r2["threads"]),
                    w[0] is not None and w[0] >= 1.4, "worst %.2fx (%s)" % w if w[0] else "n/a"))
    return out


def plot(all_runs, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no chart", file=sys.stderr)
        return None
    kept = [r for r in all_runs if r.get("regime", "kept") == "kept"]
    run = kept[-1] if kept else all_runs[-1]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    colors = {"gn_mx": "#1b9e77", "gn_mx_block": "#a6761d", "torch": "#d95f02", "mx_builtin": "#7570b3", "composed": "#e7298a",
              "composed_f32": "#66a61e", "bound": "#666666"}
    for ax, (dtype, mode) in zip(axes.flat, [(d, m) for d in DTYPES for m in MODES]):
        rows = [r for r in run["results"] if r["dtype"] == dtype and r["mode"] == mode]
        cs = [c for c in CONTENDERS if any(isinstance(r["times_s"].get(c), float) for r in rows)]
        w = 0.8 / max(1, len(cs))
        for i, c in enumerate(cs):
            xs = [j + i * w for j in range(len(rows))]
            ys = [r["times_s"].get(c) if isinstance(r["times_s"].get(c), float) else 0 for r in rows]
            ax.bar(xs, [y * 1e3 for y in ys], w, label=c, color=colors.get(c))
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rows))])
        ax.set_xticklabels([shape_str(r["shape"], r["G"]) for r in rows], rotation=30, ha="right",
                           fontsize=7)
        ax.set_ylabel("ms per call (log)")
        ax.set_title("%s %s, %d thread(s), %s allocator" % (
            dtype, "forward" if mode == "fwd" else "forward+backward", run["threads"],
            run.get("regime", "kept")), fontsize=9)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path


def run_memory(args):
    out = []
    shape, G = (8, 256, 56, 56), 32
    for dtype in DTYPES:
        whichs = ["gn_mx", "mx_builtin", "composed"] + (["composed_f32"] if dtype == "float16" else [])
        try:
            import torch  # noqa: F401
            whichs.append("torch")
        except ImportError:
            pass
        for which in whichs:
            env = child_env(1, True)
            env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)  # large blocks come from mmap, go back on free
            cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", "--mem-which", which,
                   "--mem-dtype", dtype, "--mem-G", str(G), "--mem-shape"] + [str(s) for s in shape]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            try:
                extra = json.loads(p.stdout.strip().splitlines()[-1])["extra_bytes"]
                ratio = extra / nbytes(shape, dtype)
            except Exception:  # noqa: BLE001
                extra, ratio = None, None
                print("memory child failed (%s %s): %s" % (which, dtype, p.stderr[-400:]), file=sys.stderr)
            out.append({"shape": list(shape), "G": G, "dtype": dtype, "contender": which,
                        "extra_bytes": extra, "extra_over_input": ratio})
            print("extra memory fwd+bwd %-13s %-7s %s: %s" % (
                which, dtype, shape_str(shape, G), "%.2fx input" % ratio if ratio is not None else "failed"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (one process each)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="samples per contender (median)")
    ap.add_argument("--min-sample-ms", type=float, default=None)
    ap.add_argument("--max-cell-s", type=float, default=None, help="time cap per table row")
    ap.add_argument("--no-memory", action="store_true", help="skip the extra-memory measurement")
    ap.add_argument("--system-malloc", action="store_true", help="= --regimes system")
    ap.add_argument("--regimes", default="kept,system", help="allocator regimes: kept, system")
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write group_norm_cpu.{md,json,png} into DIR (benchmarks/results: the "
                         "tracked ones); default: print only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mem-which", help=argparse.SUPPRESS)
    ap.add_argument("--mem-dtype", help=argparse.SUPPRESS)
    ap.add_argument("--mem-G", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mem-shape", type=int, nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.quick else 11
    if args.min_sample_ms is None:
        args.min_sample_ms = 10.0 if args.quick else 20.0
    if args.max_cell_s is None:
        args.max_cell_s = 5.0 if args.quick else 8.0
    if args.child:
        return child_main(args)
    if args.memory_child:
        return memory_child(args)

    all_runs = []
    regimes = ["system"] if args.system_malloc else [r for r in args.regimes.split(",") if r]
    for regime in regimes:
        for t in [int(s) for s in args.threads.split(",") if s]:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rounds", str(args.rounds),
                   "--min-sample-ms", str(args.min_sample_ms), "--max-cell-s", str(args.max_cell_s)]
            if args.quick:
                cmd.append("--quick")
            print("running %s allocator, %d thread(s) ..." % (regime, t), file=sys.stderr)
            p = subprocess.run(cmd, env=child_env(t, regime == "system"), stdout=subprocess.PIPE, text=True)
            if p.returncode != 0:
                sys.exit("benchmark child (%s, threads=%d) failed" % (regime, t))
            run = json.loads(p.stdout)
            run["regime"] = regime
            all_runs.append(run)
    text = print_table(all_runs)
    tg = targets(all_runs)
    tlines = ["targets:"] + ["  [%s] %s: %s" % ("met" if ok else "NOT met", n, d) for n, ok, d in tg]
    print("\n".join(tlines))
    text += "\n" + "\n".join(tlines)
    memory = [] if args.no_memory else run_memory(args)
    doc = {"machine": machine_info(), "allocator": ", ".join(
               {"system": "system: glibc defaults",
                "kept": "kept: glibc, MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2^40 "
                        "(freed memory reused)"}[r] for r in regimes),
           "eps": EPS, "runs": all_runs, "memory_fwdbwd": memory, "table": text,
           "targets": [{"target": n, "met": ok, "detail": d} for n, ok, d in tg],
           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    mi = doc["machine"]
    md = ["# GroupNorm CPU benchmark (`benchmarks/bench_group_norm.py`)", "",
          "Machine: %s, %s cores visible, ISA %s; %s; torch %s; MXNet %s. Allocator: %s. %s UTC." % (
              mi["cpu"], mi["cores"], "/".join(mi["isa_flags"]) or "baseline", mi["system"],
              all_runs[0]["torch"] if all_runs else "-", all_runs[0]["mxnet"] if all_runs else "-",
              doc["allocator"], doc["date_utc"]), "", "```", text.strip(), "```", ""]
    if memory:
        md += ["Peak extra memory of one forward+backward (VmHWM - VmRSS before; fresh process per contender,",
               "large blocks from mmap so freed memory leaves RSS), in multiples of the input's bytes:", ""]
        md += ["| contender | dtype | shape | extra / input |", "| --- | --- | --- | --- |"]
        for m in memory:
            md.append("| %s | %s | %s | %s |" % (m["contender"], m["dtype"], shape_str(m["shape"], m["G"]),
                                               "%.2f" % m["extra_over_input"] if m["extra_over_input"] else "failed"))
        md.append("")
    if args.out is None:
        print("\n".join(md))
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "group_norm_cpu.md"), "w") as f:
        f.write("\n".join(md))
    jpath = os.path.join(args.out, "group_norm_cpu.json")
    with open(jpath, "w") as f:
        json.dump(doc, f, indent=1)
    png = plot(all_runs, os.path.join(args.out, "group_norm_cpu.png"))
    print("wrote %s%s" % (jpath, (" and " + png) if png else ""))


if __name__ == "__main__":
    main()
