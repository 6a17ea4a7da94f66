#!/usr/bin/env python
"""Fused GroupNorm + activation vs GroupNorm followed by the activation layer, CPU.

    python benchmarks/bench_fused_act.py               # ~3 min; 2 threads, both allocator regimes
    python benchmarks/bench_fused_act.py --quick

Per shape and activation, hybridized (static_alloc) blocks, timed interleaved in one process:
  fused     gn_mx.GroupNorm(G, activation=act)                    (one op: gn_group_norm act_type)
  separate  gn_mx.GroupNorm(G) -> gluon.nn.Activation('relu')      (act = relu; MXNet's relu)
            gn_mx.GroupNorm(G) -> gluon.nn.Swish()                 (act = silu; x * sigmoid(x))
  torch     torch group_norm + relu / silu (reference point; torch.set_num_threads(t))
forward (inference) and forward+backward (autograd.record, backward with a fixed head gradient).
Target (issue 13): fused fwd+bwd >= 1.3x faster than separate on shapes >= 1 MB.
Regimes: glibc malloc defaults, and glibc keeping freed memory (MALLOC_ARENA_MAX=1
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11); one subprocess each.
Outputs: stdout; with --out DIR also DIR/fused_act_cpu.{md,json} (the tracked ones: --out benchmarks/results).
"""
import argparse
import json
import os
import sys

from _common import KEPT, add_timing_args, run_regimes, timing_defaults, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = [((2, 64, 56, 56), 32), ((8, 256, 28, 28), 32), ((1, 320, 64, 64), 32),
          ((2, 640, 32, 32), 32), ((16, 256, 56, 56), 32)]
QUICK = SHAPES[:3]
ACTS = ["relu", "silu"]


def child(args):
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon
    import gn_mx
    from bench_group_norm import Timer
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        import torch
        torch.set_num_threads(threads)
    except ImportError:
        torch = None
    timer = Timer(args.min_sample_ms / 1e3, args.rounds, args.max_cell_s)
    W = mx.nd.waitall
    rows = []
    for shape, G in (QUICK if args.quick else SHAPES):
        x = mx.nd.array(np.random.randn(*shape).astype(np.float32))
        dy = mx.nd.array(np.random.randn(*shape).astype(np.float32))
        for act in ACTS:
            blocks = {}
            fused = gn_mx.GroupNorm(G, activation=act, in_channels=shape[1])
            sep = gluon.nn.HybridSequential()
            sep.add(gn_mx.GroupNorm(G, in_channels=shape[1]))
            sep.add(gluon.nn.Activation("relu") if act == "relu" else gluon.nn.Swish())
            for name, b in (("fused", fused), ("separate", sep)):
                b.initialize()
                b.hybridize(static_alloc=True, static_shape=True)
                blocks[name] = b
            fwd, fb = {}, {}
            for name, b in blocks.items():
                xx = x.copy()
                xx.attach_grad()

                def bw(b=b, xx=xx):
                    with autograd.record():
                        y = b(xx)
                    y.backward(dy)
                fwd[name] = ((lambda b=b: b(x)), W)
                fb[name] = (bw, W)
            if torch is not None:
                tx = torch.randn(shape)
                tdy = torch.randn(shape)
                tw = torch.ones(shape[1], requires_grad=True)
                tb = torch.zeros(shape[1], requires_grad=True)
                tf = torch.relu if act == "relu" else torch.nn.functional.silu

                def t_fwd():
                    with torch.no_grad():
                        tf(torch.nn.functional.group_norm(tx, G, tw, tb))
                txg = tx.clone().requires_grad_(True)

                def t_fb():
                    y = tf(torch.nn.functional.group_norm(txg, G, tw, tb))
                    torch.autograd.grad(y, (txg, tw, tb), tdy)
                fwd["torch"] = (t_fwd, lambda: None)
                fb["torch"] = (t_fb, lambda: None)
            rows.append({"shape": list(shape), "G": G, "act": act, "bytes": 4 * int(np.prod(shape)),
                         "fwd_s": timer.run(fwd), "fwdbwd_s": timer.run(fb)})
            print(".", end="", file=sys.stderr, flush=True)
    print("", file=sys.stderr)
    json.dump({"threads": threads, "rows": rows, "env": {k: os.environ.get(k) for k in KEPT},
               "loadavg": os.getloadavg()}, sys.stdout)


def fmt(v):
    return "%.3f" % (v * 1e3) if isinstance(v, float) else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(ap, "default,kept")
    args = ap.parse_args()
    timing_defaults(args, quick=(5, 20.0, 5.0), full=(9, 40.0, 10.0))
    if args.child:
        return child(args)
    runs = run_regimes(__file__, args, {"default": {}, "kept": KEPT},
                       extra=["--quick"] if args.quick else [])
    lines = []
    worst = {}
    for reg, r in runs.items():
        lines += ["", "### allocator: %s, %d threads, load average %.1f" % (
            "glibc defaults" if reg == "default" else "glibc keeps freed memory", r["threads"], r["loadavg"][0]), "",
            "| shape | act | MB | fwd fused | fwd separate | fwd torch | fwd+bwd fused | fwd+bwd separate | "
            "fwd+bwd torch | separate/fused fwd | separate/fused fwd+bwd |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in r["rows"]:
            f, fb = row["fwd_s"], row["fwdbwd_s"]
            sf = f["separate"] / f["fused"] if isinstance(f.get("fused"), float) else None
            sfb = fb["separate"] / fb["fused"] if isinstance(fb.get("fused"), float) else None
            if sfb is not None and row["bytes"] >= 2 ** 20:
                worst[reg] = min(worst.get(reg, 1e9), sfb)
            lines.append("| %s G%d | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                "x".join(map(str, row["shape"])), row["G"], row["act"], row["bytes"] / 2 ** 20,
                fmt(f.get("fused")), fmt(f.get("separate")), fmt(f.get("torch")), fmt(fb.get("fused")),
                fmt(fb.get("separate")), fmt(fb.get("torch")), "%.2f" % sf if sf else "-",
                "%.2f" % sfb if sfb else "-"))
    lines += ["", "Target: fused fwd+bwd >= 1.3x faster than separate on shapes >= 1 MB: " + "; ".join(
        "%s worst %.2fx (%s)" % (k, v, "met" if v >= 1.3 else "NOT met") for k, v in worst.items())]
    text = "\n".join(lines)
    print(text)
    if args.out is None:
        return
    write_results(os.path.join(args.out, "fused_act_cpu"),
                  "Fused GroupNorm + activation, CPU (`benchmarks/bench_fused_act.py`)",
                  "fp32; times in ms (medians of interleaved samples).", text, {"runs": runs})


if __name__ == "__main__":
    main()
