#!/usr/bin/env python
"""Channels-last GroupNorm on the CPU: gn_mx (axis=-1) against torch's channels-last group_norm and
against gn_mx's own channels-first path at the same size.

    python benchmarks/bench_channels_last.py --torch-python /path/to/venv/bin/python \
        --out benchmarks/results
    python benchmarks/bench_channels_last.py --quick      # fewer shapes and rounds

Contenders, each timed forward and forward+backward on the same shape, dtype (fp32), eps:
  gn_mx_nhwc   mx.nd.gn_group_norm(x, gamma, beta, num_groups=G, axis=-1) on (N, *spatial, C)
  gn_mx_nchw   mx.nd.gn_group_norm(...) (axis=1) on (N, C, *spatial): the same data size
  torch_cl     torch.nn.functional.group_norm on the same values in torch's channels-last memory
               format (channels_last for 4-D, channels_last_3d for 5-D: torch's channels-last
               kernels); 2-D data is the same memory in both layouts; 3-D (N, C, L) has no
               channels-last format in torch: an (N, L, C) tensor viewed as (N, C, L) (torch copies
               it to contiguous inside group_norm, which is what NWC data costs there)
torch runs in its own interpreter (--torch-python: a separate venv with torch==2.13.0, never the
dev venv) as a worker process; the driver sends every (shape, contender, mode) sample to the
workers in turn, round after round (interleaved: the contenders see the same machine load), and
reports medians over rounds. Threads: OMP_NUM_THREADS=--threads for both, torch.set_num_threads;
allocator: glibc told to keep freed memory (MALLOC_ARENA_MAX=1, MALLOC_MMAP_MAX_=0,
MALLOC_TRIM_THRESHOLD_=1e11), OMP_WAIT_POLICY=passive. Run it under
`flock /tmp/gnmx-bench.lock` on a shared machine; the result file records uptime's load, nproc and
the CPU model.

Outputs: a table on stdout; with --out DIR also DIR/channels_last_cpu.{md,json}.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import write_results  # noqa: E402

# bench_group_norm.py's shapes (written channels first: (N, C, *spatial)) plus an SD-UNet block.
SHAPES = [
    ((4, 32, 8, 8), 8),
    ((64, 1024), 32),
    ((2, 64, 56, 56), 32),
    ((8, 256, 28, 28), 32),
    ((1, 320, 64, 64), 32),
    ((3, 96, 32, 32, 8), 16),
    ((1, 64, 256, 256), 1),
    ((8, 128, 128, 128), 32),
    ((16, 256, 56, 56), 32),
    ((2, 320, 64, 64), 32),  # (2, 64, 64, 320) channels last: SD-UNet
]
QUICK = [SHAPES[1], SHAPES[2], SHAPES[3], SHAPES[9]]
CONTENDERS = ["gn_mx_nhwc", "gn_mx_nchw", "torch_cl"]
MODES = ["fwd", "fwd_bwd"]

# ---------------------------------------------------------------------------------------------
# Workers: read one JSON request per line, answer one JSON line (seconds per call).

WORKER = r'''
import json, sys, time
import numpy as np
KIND = sys.argv[1]
if KIND == "torch":
    import torch, torch.nn.functional as F
    torch.set_num_threads(int(sys.argv[2]))
else:
    import mxnet as mx, gn_mx
    from mxnet import autograd
cache = {}

def setup(shape, G, who):
    key = (tuple(shape), G, who)
    if key in cache:
        return cache[key]
    rng = np.random.RandomState(0)
    C = shape[1]
    x = rng.randn(*shape).astype(np.float32)           # channels first values
    dy = rng.randn(*shape).astype(np.float32)
    last = lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1)) if a.ndim > 2 else a
    g, b = np.ones(C, np.float32), np.zeros(C, np.float32)
    if who == "torch_cl":
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape))
        if fmt is not None:
            xt = torch.from_numpy(x).to(memory_format=fmt)
            dyt = torch.from_numpy(dy).to(memory_format=fmt)
        elif len(shape) == 3:
            xt = torch.from_numpy(last(x)).permute(0, 2, 1)
            dyt = torch.from_numpy(last(dy)).permute(0, 2, 1)
        else:
            xt, dyt = torch.from_numpy(x), torch.from_numpy(dy)
        st = (xt, dyt, torch.from_numpy(g), torch.from_numpy(b))
    else:
        nhwc = who == "gn_mx_nhwc"
        xs = mx.nd.array(last(x) if nhwc else x)
        st = (xs, mx.nd.array(last(dy) if nhwc else dy), mx.nd.array(g), mx.nd.array(b),
              {"axis": -1} if nhwc else {})
    cache[key] = st
    return st

def once(shape, G, who, mode):
    st = setup(shape, G, who)
    if who == "torch_cl":
        xt, dyt, g, b = st
        if mode == "fwd":
            with torch.no_grad():
                F.group_norm(xt, G, g, b, 1e-5)
        else:
            x = xt.detach().requires_grad_()
            gg, bb = g.clone().requires_grad_(), b.clone().requires_grad_()
            F.group_norm(x, G, gg, bb, 1e-5).backward(dyt)
        return
    xs, dy, g, b, kw = st
    if mode == "fwd":
        mx.nd.gn_group_norm(xs, g, b, num_groups=G, **kw)[0].wait_to_read()
    else:
        for a in (xs, g, b):
            a.attach_grad()
        with autograd.record():
            y = mx.nd.gn_group_norm(xs, g, b, num_groups=G, **kw)[0]
        y.backward(dy)
        xs.grad.wait_to_read()
        g.grad.wait_to_read()

def sample(shape, G, who, mode, min_time):
    once(shape, G, who, mode)  # warm
    n, t = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            once(shape, G, who, mode)
        t = time.perf_counter() - t0
        if t >= min_time:
            return t / n
        n = max(n * 2, int(n * min_time / max(t, 1e-6)) + 1)

for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"s": sample(r["shape"], r["G"], r["who"], r["mode"], r["min_time"])}),
          flush=True)
'''


class Worker:
    def __init__(self, python, kind, threads, env):
        self.p = subprocess.Popen([python, "-c", WORKER, kind, str(threads)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def time(self, shape, G, who, mode, min_time):
        self.p.stdin.write(json.dumps({"shape": list(shape), "G": G, "who": who, "mode": mode,
                                       "min_time": min_time}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker for {who} died")
        return json.loads(line)["s"]

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def machine():
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "nproc": os.cpu_count(),
            "load_before": os.getloadavg()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-python", required=True,
                    help="python of a separate venv with torch==2.13.0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.15, help="seconds per sample")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="directory for channels_last_cpu.{md,json}")
    args = ap.parse_args()
    shapes = QUICK if args.quick else SHAPES
    rounds = 3 if args.quick else args.rounds
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="passive",
               MALLOC_ARENA_MAX="1", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="100000000000")
    info = machine()
    mxw = Worker(sys.executable, "mxnet", args.threads, env)
    tw = Worker(args.torch_python, "torch", args.threads, env)
    tver = subprocess.run([args.torch_python, "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, env=env).stdout.strip()
    times = {}
    t_start = time.time()
    for rnd in range(rounds):
        for shape, G in shapes:
            for mode in MODES:
                order = CONTENDERS if rnd % 2 == 0 else CONTENDERS[::-1]  # alternate the order
                for who in order:
                    w = tw if who == "torch_cl" else mxw
                    s = w.time(shape, G, who, mode, args.min_time)
                    times.setdefault((tuple(shape), G, mode, who), []).append(s)
        print(f"round {rnd + 1}/{rounds} done ({time.time() - t_start:.0f} s)", file=sys.stderr)
    mxw.close()
    tw.close()
    info["load_after"] = os.getloadavg()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    rows, data = [], []
    head = ("| shape (channels last) | G | MB | mode | gn_mx NHWC ms | gn_mx NCHW ms | torch CL ms "
            "| NHWC / torch | NHWC / NCHW | targets |")
    rows += [head, "|" + "---|" * 10]
    for shape, G in shapes:
        cl = (shape[0],) + tuple(shape[2:]) + (shape[1],) if len(shape) > 2 else shape
        mb = 4 * int(__import__("numpy").prod(shape)) / 1e6
        for mode in MODES:
            a, f, t = (med[(tuple(shape), G, mode, w)] for w in CONTENDERS)
            vs_torch, vs_nchw = t / a, a / f
            ok_t = mb < 1 or a <= t
            ok_n = a <= 1.1 * f
            mark = ("ok" if ok_t and ok_n else
                    "MISS " + ", ".join(m for m, o in (("torch", ok_t), ("1.1x NCHW", ok_n)) if not o))
            rows.append(f"| {cl} | {G} | {mb:.1f} | {mode} | {a * 1e3:.3f} | {f * 1e3:.3f} | "
                        f"{t * 1e3:.3f} | {vs_torch:.2f}x | {vs_nchw:.2f} | {mark} |")
            data.append({"shape_channels_last": cl, "G": G, "mb": mb, "mode": mode,
                         "gn_mx_nhwc_s": a, "gn_mx_nchw_s": f, "torch_cl_s": t,
                         "speedup_vs_torch": vs_torch, "nhwc_over_nchw": vs_nchw,
                         "samples": {w: times[(tuple(shape), G, mode, w)] for w in CONTENDERS}})
    about = (f"fp32, {args.threads} threads (OMP_NUM_THREADS, torch.set_num_threads), "
             f"OMP_WAIT_POLICY=passive, glibc malloc keeping freed memory (MALLOC_ARENA_MAX=1, "
             f"MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=1e11); torch {tver}; CPU {info['cpu']}, "
             f"nproc {info['nproc']}, load average before {info['load_before']} / after "
             f"{info['load_after']}; medians of {rounds} interleaved rounds, each sample a loop of "
             f">= {args.min_time} s. NHWC / torch > 1: gn_mx faster; NHWC / NCHW: time ratio "
             f"(target <= 1.1).")
    text = "\n" + "\n".join(rows) + "\n"
    print(about + text)
    if args.out:
        write_results(os.path.join(args.out, "channels_last_cpu"),
                      "Channels-last GroupNorm, CPU", about, text,
                      {"machine": info, "threads": args.threads, "torch": tver, "rows": data})


if __name__ == "__main__":
    main()
