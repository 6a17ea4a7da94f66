#!/usr/bin/env python
"""GroupNorm forward (and forward+backward) on the mid shapes, per CPU ISA level of cpu_isa.h, next
to torch, the copy bound and MXNet's per-call cost.

    python benchmarks/bench_cpu_isa.py                      # levels the CPU has, 1 thread, 5 rounds
    python benchmarks/bench_cpu_isa.py --threads 1,2 --rounds 7 --out benchmarks/results

Each level (GNMX_CPU_ISA=generic|avx2|avx512; read once per process) runs in its own child process;
the children run interleaved, round after round (generic, avx2, avx512, generic, ...), so a change
of the machine's load hits every level alike. In a child, every contender of a case is timed
interleaved (bench_group_norm.Timer: repeated samples, each a loop of calls); a child keeps each
contender's MINIMUM sample (on a machine shared with other jobs the least disturbed one: medians
moved 2-3x between identical runs at load 9, minima far less), and per case and level the table gives
the median over rounds of those minima:
  gn_mx       mx.nd.gn_group_norm, imperative (+ waitall)
  block       gn_mx.GroupNorm hybridized (static_alloc), forward only (fp32 fwd rows)
  noop        an EMPTY lib_api op (benchmarks/overhead/noop_op.cc) on the same input: MXNet's
              per-call cost on this path (dispatch, output allocation, engine, waitall)
  torch       torch.nn.functional.group_norm (torch.set_num_threads(t)), under no_grad for fwd
  copy        the bound: torch copy_ of the same bytes (fwd: read x + write y; fwdbwd: 2 copies
              plus one read, as bench_group_norm.py)
and the ratios torch / gn_mx computed inside each child (paired), then their median.
glibc malloc keeps freed memory (MALLOC_ARENA_MAX=1 ...), OMP_WAIT_POLICY=passive.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

SHAPES = [((2, 64, 56, 56), 32), ((8, 256, 28, 28), 32), ((1, 320, 64, 64), 32),
          ((4, 128, 16, 16, 16), 32)]
CASES = [("float32", "fwd"), ("float32", "fwdbwd"), ("float16", "fwd")]
EPS = 1e-5


def _cases(mx, torch, gn_mx, shape, G, dtype, mode):
    """{contender: (step, sync)} of one case in this process."""
    from mxnet import autograd
    import numpy as np
    C, W = shape[1], mx.nd.waitall
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal(shape), dtype=dtype)
    dy = mx.nd.array(rng.standard_normal(shape), dtype=dtype)
    g, b = mx.nd.ones((C,), dtype=dtype), mx.nd.zeros((C,), dtype=dtype)
    tdt = torch.float16 if dtype == "float16" else torch.float32
    tx, tdy = torch.randn(shape).to(tdt), torch.randn(shape).to(tdt)
    tw, tb = torch.ones(C, dtype=tdt), torch.zeros(C, dtype=tdt)
    a = torch.randn(int(np.prod(shape))).to(tdt)
    c = torch.empty_like(a)
    none = lambda: None  # noqa: E731
    out = {"noop": (lambda: mx.nd.bench_noop(x), W)}
    if mode == "fwd":
        out["gn_mx"] = (lambda: mx.nd.gn_group_norm(x, g, b, num_groups=G, eps=EPS)[0], W)
        if dtype == "float32":
            blk = gn_mx.GroupNorm(G, epsilon=EPS, in_channels=C)
            blk.initialize(ctx=mx.cpu())
            blk.hybridize(static_alloc=True, static_shape=True)
            out["block"] = (lambda: blk(x), W)

        def tfwd():
            with torch.no_grad():
                torch.nn.functional.group_norm(tx, G, tw, tb, EPS)
        out["torch"] = (tfwd, none)
        out["copy"] = (lambda: c.copy_(a), none)
        return out
    for t in (x, g, b):
        t.attach_grad()

    def step():
        with autograd.record():
            y = mx.nd.gn_group_norm(x, g, b, num_groups=G, eps=EPS)[0]
        y.backward(dy)
    out["gn_mx"] = (step, W)
    for t in (tx, tw, tb):
        t.requires_grad_(True)
    out["torch"] = (lambda: torch.autograd.grad(
        torch.nn.functional.group_norm(tx, G, tw, tb, EPS), (tx, tw, tb), tdy), none)
    out["copy"] = (lambda: (c.copy_(a), c.copy_(a), a.sum()), none)
    return out


def child(args):
    import mxnet as mx
    import torch
    import gn_mx
    from bench_group_norm import Timer
    from bench_overhead import build_noop
    mx.library.load(build_noop(), verbose=False)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    timer = Timer(args.min_sample_ms / 1e3, args.inner_rounds, 30.0)
    res = {"level": gn_mx.build_info()["cpu_isa_active"], "rows": []}
    for shape, G in SHAPES:
        for dtype, mode in CASES:
            timer.run(_cases(mx, torch, gn_mx, shape, G, dtype, mode))
            res["rows"].append({"shape": list(shape), "G": G, "dtype": dtype, "mode": mode,
                                "s": dict(timer.last_min)})
    json.dump(res, sys.stdout)


def child_env(level, threads):
    env = {k: v for k, v in os.environ.items() if k != "GNMX_CPU_ISA"}
    env.update(GNMX_CPU_ISA=level, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="passive",
               MALLOC_ARENA_MAX="1", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="100000000000")
    return env


def _median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else 0.5 * (v[len(v) // 2 - 1] + v[len(v) // 2])


def collect(args, levels, threads):
    """{(threads, level, row index): [child result rows]} over the interleaved rounds."""
    runs, loads = {}, []
    for rnd in range(args.rounds):
        for t in threads:
            for level in levels:
                p = subprocess.run([sys.executable, __file__, "--child"] + _child_argv(args),
                                   capture_output=True, text=True, env=child_env(level, t))
                if p.returncode != 0:
                    raise SystemExit(p.stderr[-3000:])
                res = json.loads(p.stdout)
                assert res["level"] == level, (res["level"], level)
                for i, row in enumerate(res["rows"]):
                    runs.setdefault((t, level, i), []).append(row)
                loads.append(os.getloadavg()[0])
                print(f"round {rnd + 1}/{args.rounds} t={t} {level}", file=sys.stderr, flush=True)
    return runs, loads


def _child_argv(args):
    return ["--min-sample-ms", str(args.min_sample_ms), "--inner-rounds", str(args.inner_rounds)]


def summarize(runs):
    """Table rows: medians over rounds of each time, and of the per-child ratios."""
    rows = []
    for (t, level, i), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        med = lambda k: _median([r["s"][k] for r in rs if k in r["s"]])  # noqa: E731
        gn = med("gn_mx")
        row = {"threads": t, "level": level, "shape": rs[0]["shape"], "G": rs[0]["G"],
               "dtype": rs[0]["dtype"], "mode": rs[0]["mode"], "gn_mx_ms": gn * 1e3,
               "noop_ms": med("noop") * 1e3, "torch_ms": med("torch") * 1e3,
               "copy_ms": med("copy") * 1e3,
               "torch_over_gn_mx": _median([r["s"]["torch"] / r["s"]["gn_mx"] for r in rs]),
               "gn_mx_over_copy": _median([r["s"]["gn_mx"] / r["s"]["copy"] for r in rs])}
        if "block" in rs[0]["s"]:
            row["block_ms"] = med("block") * 1e3
            row["torch_over_block"] = _median([r["s"]["torch"] / r["s"]["block"] for r in rs])
        rows.append(row)
    return rows


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def markdown(rows, meta):
    f = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"# GroupNorm per CPU ISA level (`benchmarks/bench_cpu_isa.py`)", "",
             f"{meta['date']}; {meta['cpu']} (ISA levels run: {', '.join(meta['levels'])}); "
             f"torch {meta['torch']}, mxnet {meta['mxnet']}; {meta['rounds']} interleaved rounds "
             f"(one child process per level and round); load average (1 min) during the run "
             f"{min(meta['loads']):.1f}-{max(meta['loads']):.1f} (machine shared with other jobs: "
             f"times are noisy, the paired ratios less so). glibc malloc keeping freed memory, "
             f"OMP_WAIT_POLICY=passive. ms per call: per child the minimum sample, then the median over "
             f"rounds.", "",
             "| threads | shape | dtype | mode | level | gn_mx | block | noop (MXNet per call) | "
             "torch | copy bound | torch/gn_mx | torch/block | gn_mx/copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {'x'.join(map(str, r['shape']))} G{r['G']} | {r['dtype']} | "
                     f"{r['mode']} | {r['level']} | {f(r['gn_mx_ms'])} | {f(r.get('block_ms'))} | "
                     f"{f(r['noop_ms'])} | {f(r['torch_ms'])} | {f(r['copy_ms'])} | "
                     f"{r['torch_over_gn_mx']:.2f} | "
                     f"{'' if 'torch_over_block' not in r else format(r['torch_over_block'], '.2f')} | "
                     f"{r['gn_mx_over_copy']:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default=None, help="comma-separated (default: every level the CPU has)")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner-rounds", type=int, default=7, help="samples per contender in a child")
    ap.add_argument("--min-sample-ms", type=float, default=20.0)
    ap.add_argument("--out", default=None, metavar="DIR", help="write DIR/cpu_isa_cpu.{md,json}")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from test_cpu_isa import cpu_isa_levels
    import mxnet as mx
    import torch
    levels = args.levels.split(",") if args.levels else cpu_isa_levels()
    threads = [int(t) for t in args.threads.split(",")]
    runs, loads = collect(args, levels, threads)
    rows = summarize(runs)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
            "levels": levels, "torch": torch.__version__, "mxnet": mx.__version__,
            "rounds": args.rounds, "loads": loads}
    md = markdown(rows, meta)
    print(md)
    if args.out:
        with open(os.path.join(args.out, "cpu_isa_cpu.md"), "w") as f:
            f.write(md)
        with open(os.path.join(args.out, "cpu_isa_cpu.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
