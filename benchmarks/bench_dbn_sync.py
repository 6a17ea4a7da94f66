"""Overhead of synchronized DBN's training step (CPU, in-process devices).

For N = 2 and 4 cpu contexts of one process, one training step of one normalization layer
(forward with autograd recording on every device, backward of all devices to the input and the
parameters, wait) with

    DBN       gn_mx.DecorrelatedBatchNorm: each device whitens its own batch (the fused gn_dbn)
    SyncDBN   gn_mx.SyncDecorrelatedBatchNorm(num_devices=N): the statistics of all N batches

both hybridized, timed in interleaved rounds (A B A B ...; median ms per step, and the ratio
SyncDBN / DBN per round). Also, on one device, the synchronized step's float64 graph without a
barrier (num_devices=1) against the fused op: how much of the overhead is the graph, how much the
waiting. MXNet starts with gn_mx.sync.cpu_pool_environment(4), OMP_NUM_THREADS=1 (4 devices share
2 cores) and the allocator regime of benchmarks/_common.py (KEPT).

    python benchmarks/bench_dbn_sync.py [--rounds 7] [--steps 20] [--out benchmarks/results]
"""
import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import mxnet as mx  # noqa: E402
from mxnet import autograd  # noqa: E402

import gn_mx  # noqa: E402

from _common import KEPT  # noqa: E402

SHAPES = [((2, 64, 16, 16), 4), ((2, 256, 8, 8), 16)]  # per-device batch 2; D = 16


def make(cls, ndev, C, G, **kw):
    ctx = [mx.cpu(i) for i in range(ndev)]
    blk = cls(num_groups=G, in_channels=C, **kw)
    blk.initialize(ctx=ctx)
    blk.hybridize()
    return blk, ctx


def step(blk, xs):
    with autograd.record():
        ys = [blk(x) for x in xs]
    autograd.backward(ys)
    mx.nd.waitall()


def timed(blk, xs, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        step(blk, xs)
    return 1000 * (time.perf_counter() - t0) / steps


def compare(shape, G, ndev, rounds, steps):
    """Median ms per step of DBN and SyncDBN on ndev devices (sync=ndev), interleaved; with
    ndev = 1 the synchronized graph runs without a barrier."""
    C = shape[1]
    a, ctx = make(gn_mx.DecorrelatedBatchNorm, ndev, C, G)
    b, _ = make(gn_mx.SyncDecorrelatedBatchNorm, ndev, C, G, num_devices=ndev)
    xs = [mx.nd.array(np.random.randn(*shape), ctx=c) for c in ctx]
    for x in xs:
        x.attach_grad()  # a layer inside a net: the input gradient is part of the step
    for blk in (a, b):
        step(blk, xs)  # build the graphs
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(timed(a, xs, steps))
        tb.append(timed(b, xs, steps))
    ratio = [y / x for x, y in zip(ta, tb)]
    return {"shape": list(shape), "G": G, "devices": ndev, "dbn_ms": float(np.median(ta)),
            "sync_ms": float(np.median(tb)), "ratio": float(np.median(ratio)),
            "ratio_min": float(min(ratio)), "ratio_max": float(max(ratio))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    missing = {k: v for k, v in dict(KEPT, **gn_mx.sync.cpu_pool_environment(4)).items()
               if os.environ.get(k) != v}
    if missing:  # MXNet and the allocator read them at start: re-run with them set
        os.execve(sys.executable, [sys.executable] + sys.argv,
                  dict(os.environ, **missing))
    load0 = os.getloadavg()
    rows = [compare(shape, G, n, args.rounds, args.steps) for shape, G in SHAPES
            for n in (1, 2, 4)]
    load1 = os.getloadavg()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    head = (f"# Synchronized DBN: training-step overhead (`benchmarks/bench_dbn_sync.py`)\n\n"
            f"Machine: {cpu}, {os.cpu_count()} cores; MXNet {mx.__version__}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. OMP_NUM_THREADS="
            f"{os.environ['OMP_NUM_THREADS']}, allocator {' '.join(f'{k}={v}' for k, v in KEPT.items())}, "
            f"{' '.join(f'{k}={v}' for k, v in gn_mx.sync.cpu_pool_environment(4).items())}. "
            f"Load average {load0[0]:.1f} -> {load1[0]:.1f}.\n"
            f"One layer's training step (forward on every device, backward, wait), fp32, "
            f"hybridized; median ms per step over {args.rounds} interleaved rounds of "
            f"{args.steps} steps; ratio = SyncDBN / DBN per round (median, min-max). "
            f"devices = 1: the synchronized float64 graph without a barrier against the fused op.\n\n"
            "| per-device shape | G | devices | DBN ms | SyncDBN ms | **SyncDBN / DBN** |\n"
            "|---|---|---|---|---|---|\n")
    lines = [f"| {'x'.join(map(str, r['shape']))} | {r['G']} | {r['devices']} | "
             f"{r['dbn_ms']:.2f} | {r['sync_ms']:.2f} | **{r['ratio']:.2f}x** "
             f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |" for r in rows]
    text = head + "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dbn_sync_cpu.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "dbn_sync_cpu.json"), "w") as f:
        json.dump({"load": [load0, load1], "cpu": cpu, "rows": rows, "args": vars(args)}, f,
                  indent=1)


if __name__ == "__main__":
    main()
