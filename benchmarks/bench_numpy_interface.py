"""Per-call cost of the NumPy interface (npx.set_np()) for gn_mx.GroupNorm, vs legacy NDArrays.

The conversion is zero-copy (as_nd_ndarray / as_np_ndarray re-wrap the same handle), so the cost is
per call, not per element. Contenders run round-robin in one process; prints the load average and
thread count. Usage: OMP_NUM_THREADS=1 python benchmarks/bench_numpy_interface.py [--reps N]
Prints only (benchmarks/results/numpy_interface_cpu.md holds a copy of a run's output).
"""
import argparse
import os
import time

import numpy as onp

import mxnet as mx
from mxnet import npx

import gn_mx


def make(np_mode, hybridize, shape):
    (npx.set_np if np_mode else npx.reset_np)()
    blk = gn_mx.GroupNorm(num_groups=8, in_channels=shape[1])
    blk.initialize()
    if hybridize:
        blk.hybridize()
    x = mx.nd.random.normal(shape=shape)
    if np_mode:
        x = x.as_np_ndarray()
    blk(x).wait_to_read()
    return blk, x, np_mode


def main(shapes=((4, 32, 8, 8), (8, 64, 32, 32)), reps=30, calls=50):
    for shape in shapes:
        cfgs = {f"{'np' if n else 'legacy'}-{'hybrid' if h else 'imperative'}": make(n, h, shape)
                for n in (False, True) for h in (False, True)}
        times = {k: [] for k in cfgs}
        for _ in range(reps):
            for k, (blk, x, np_mode) in cfgs.items():
                (npx.set_np if np_mode else npx.reset_np)()
                t = time.perf_counter()
                for _ in range(calls):
                    y = blk(x)
                y.wait_to_read()
                times[k].append((time.perf_counter() - t) / calls * 1e6)
        npx.reset_np()
        print(f"shape {shape}, load {os.getloadavg()}, OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS')}")
        for k, v in times.items():
            print(f"  {k:18s} median {onp.median(v):8.1f} us/call")


if __name__ == "__main__":
    _ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _ap.add_argument("--reps", type=int, default=30, help="interleaved rounds (median over them)")
    _ap.add_argument("--calls", type=int, default=50, help="calls per sample")
    _a = _ap.parse_args()
    main(reps=_a.reps, calls=_a.calls)
