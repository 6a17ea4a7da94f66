"""Time gn_dbn (Decorrelated BN) forward and forward+backward against gn_group_norm, and against a
torch implementation (eigh + autograd) when torch is importable.

    OMP_NUM_THREADS=2 python benchmarks/bench_dbn.py            # issue shapes, fp32
    python benchmarks/bench_dbn.py --threads 1 --repeat 20

--threads sets OMP_NUM_THREADS before MXNet is imported and torch.set_num_threads. NB: MXNet's
threaded engine runs library ops on worker threads whose OpenMP team is 1 thread whatever
OMP_NUM_THREADS says (measured: process CPU time == wall time), so gn_dbn/gn_group_norm use one
thread per op there; --naive (MXNET_ENGINE_TYPE=NaiveEngine) runs ops on the calling thread, where
OMP_NUM_THREADS applies. The "thr" column is process CPU time / wall time of gn_dbn fwd+bwd, i.e.
the threads actually used. Reported: median wall-clock ms per call.
"""
import argparse
import os
import sys
import time

SHAPES = [  # (N, C, H, W), num_groups: the anchors (group size 16, 16, 64, 32)
    ((32, 64, 16, 16), 4),
    ((8, 128, 32, 32), 8),
    ((128, 256, 8, 8), 4),
    ((16, 64, 32, 32), 2),
]


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
                   help="OpenMP threads (default: $OMP_NUM_THREADS, else MXNet's default)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"])
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--naive", action="store_true",
                   help="MXNET_ENGINE_TYPE=NaiveEngine: ops run on the calling thread")
    return p.parse_args()


def median_ms(fn, repeat, sync, cpu_ratio=None):
    fn()
    sync()
    times = []
    wall = cpu = 0.0
    for _ in range(repeat):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        wall += dt
        cpu += time.process_time() - c0
    if cpu_ratio is not None:
        cpu_ratio.append(cpu / wall)
    times.sort()
    return times[len(times) // 2]


def mx_timings(shape, G, dtype, repeat):
    import numpy as np
    import mxnet as mx
    from mxnet import autograd
    import gn_mx  # noqa: F401

    N, C = shape[:2]
    D = C // G
    x = mx.nd.array(np.random.randn(*shape), dtype=dtype)
    dy = mx.nd.array(np.random.randn(*shape), dtype=dtype)
    rm = mx.nd.zeros((C,), dtype=dtype)
    rp = mx.nd.array(np.tile(np.eye(D), (G, 1, 1)), dtype=dtype)
    gamma = mx.nd.ones((C,), dtype=dtype)
    beta = mx.nd.zeros((C,), dtype=dtype)
    x.attach_grad()
    sync = mx.nd.waitall

    def dbn_fwd():
        mx.nd.gn_dbn(x, rm, rp, num_groups=G)

    def dbn_fwd_bwd():
        with autograd.record():
            y = mx.nd.gn_dbn(x, rm, rp, num_groups=G)[0]
        y.backward(dy)

    def dbn_inf():
        mx.nd.gn_dbn_inference(x, rm, rp, num_groups=G)

    def gn_fwd():
        mx.nd.gn_group_norm(x, gamma, beta, num_groups=G)

    def gn_fwd_bwd():
        with autograd.record():
            y = mx.nd.gn_group_norm(x, gamma, beta, num_groups=G)[0]
        y.backward(dy)

    ratio = []
    r = {k: median_ms(f, repeat, sync, ratio if k == "dbn_fwd_bwd" else None) for k, f in [
        ("dbn_fwd", dbn_fwd), ("dbn_fwd_bwd", dbn_fwd_bwd), ("dbn_inference", dbn_inf),
        ("gn_fwd", gn_fwd), ("gn_fwd_bwd", gn_fwd_bwd)]}
    r["thr"] = ratio[0]
    return r


def torch_timings(shape, G, dtype, repeat):
    import torch

    tdtype = getattr(torch, dtype)
    N, C = shape[:2]
    D = C // G

    def dbn(x, eps=1e-5):
        # (N, C, *) -> (G, D, m): the layout transposes are part of a framework implementation.
        xg = x.reshape(N, G, D, -1).permute(1, 2, 0, 3).reshape(G, D, -1)
        m = xg.shape[2]
        xc = xg - xg.mean(dim=2, keepdim=True)
        sigma = xc @ xc.transpose(1, 2) / m + eps * torch.eye(D, dtype=x.dtype)
        lam, U = torch.linalg.eigh(sigma.double())
        W = (U * lam.rsqrt().unsqueeze(1)) @ U.transpose(1, 2)
        y = W.to(x.dtype) @ xc
        return y.reshape(G, D, N, -1).permute(2, 0, 1, 3).reshape(x.shape)

    x = torch.randn(*shape, dtype=tdtype, requires_grad=True)
    dy = torch.randn(*shape, dtype=tdtype)

    def fwd():
        with torch.no_grad():
            dbn(x)

    def fwd_bwd():
        y = dbn(x)
        y.backward(dy)

    return {"torch_fwd": median_ms(fwd, repeat, lambda: None),
            "torch_fwd_bwd": median_ms(fwd_bwd, repeat, lambda: None)}


def main():
    args = parse()
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.naive:
        os.environ["MXNET_ENGINE_TYPE"] = "NaiveEngine"
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import mxnet as mx  # noqa: F401  (after OMP_NUM_THREADS is set)
    have_torch = False
    if not args.no_torch:
        try:
            import torch
            if args.threads > 0:
                torch.set_num_threads(args.threads)
            have_torch = True
        except ImportError:
            pass
    threads = os.environ.get("OMP_NUM_THREADS", "MXNet default")
    engine = os.environ.get("MXNET_ENGINE_TYPE", "ThreadedEnginePerDevice")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# gn_dbn benchmark, dtype {args.dtype}, OMP_NUM_THREADS={threads}, engine {engine}, "
          f"{os.cpu_count()} cores (load avg {load:.1f}), median of {args.repeat}; ms per call"
          + (f"; torch {torch.__version__} with {torch.get_num_threads()} threads"
             if have_torch else "; torch not available"))
    cols = ["dbn_fwd", "dbn_fwd_bwd", "thr", "dbn_inference", "gn_fwd", "gn_fwd_bwd"]
    if have_torch:
        cols += ["torch_fwd", "torch_fwd_bwd"]
    print("| shape | G | D | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for shape, G in SHAPES:
        r = mx_timings(shape, G, args.dtype, args.repeat)
        if have_torch:
            r.update(torch_timings(shape, G, args.dtype, args.repeat))
        print(f"| {shape} | {G} | {shape[1] // G} | "
              + " | ".join(f"{r[c]:.1f}" if c == "thr" else f"{r[c]:.2f}" for c in cols) + " |",
              flush=True)


if __name__ == "__main__":
    main()
