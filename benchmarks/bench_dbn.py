#!/usr/bin/env python
"""Decorrelated BN on the CPU: gn_dbn / gn_dbn_inference against a PyTorch eigh + autograd
implementation, side by side.

    python benchmarks/bench_dbn.py                     # 1 and 2 threads x both allocator regimes
    python benchmarks/bench_dbn.py --threads 2 --regimes keep --rounds 15
    python benchmarks/bench_dbn.py --out dbn_cpu       # also write benchmarks/results/dbn_cpu.*
    python benchmarks/bench_dbn.py --affine            # fused affine vs gn_dbn + gn_channel_affine

Contenders (same data, shapes, eps, thread count; one process per (threads, regime), interleaved
round-robin: each round runs every contender once, one sample = a loop of calls >= --min-sample-s):
  gn_fwd / gn_fwdbwd  mx.nd.gn_dbn forward, and forward + backward under autograd (dx)
  gn_inf              mx.nd.gn_dbn_inference (y = P (x - running_mean))
  torch_fwd / torch_fwdbwd / torch_inf
                      the usual framework implementation: (N, C, *) -> (G, D, m) permute, centre,
                      covariance by matmul, torch.linalg.eigh in float64, W = U diag(l^-1/2) U^T,
                      y = W xc, permute back; backward by autograd. torch_inf: y = P (x - mean) with
                      the same permutes.
  bmm                 torch.bmm((G, D, D), (G, D, m)) on already grouped, contiguous data: the bare
                      matrix product of the inference op (no layout change, no centring).
  it_fwd / it_fwdbwd  gn_dbn with whitening='iternorm', iterations=5 (IterNorm, Huang et al. 2019)
  torch_it_fwd / torch_it_fwdbwd
                      IterNorm written in torch (the paper's algorithm in fp32, as its reference
                      code: trace-normalize, 5 Newton steps P <- 1.5 P - 0.5 P^3 Sigma_N), autograd
The IterNorm table also runs group sizes 128, 256 and 512 (LARGE_D), and shows the bound: the
rate of gn_mx IterNorm's forward + backward products (iternorm_flops) per second of process CPU
time against sgemm's, measured the same way (per busy core: meaningful on a loaded machine).
Machine bounds measured in each child with torch: sgemm GFLOP/s (2048^3) and copy GB/s (64 MB
clone: read + write), so the inference op is reported as GFLOP/s and GB/s against them.

Thread counts: OMP_NUM_THREADS=t before MXNet is imported (MXNet sizes its OpenMP teams from it),
torch.set_num_threads(t). Reported per contender: median and min ms per call over rounds, and the
process CPU time per call / wall time ("thr": threads actually busy; < t on a loaded machine).
Regimes: "default" = glibc as shipped (MXNet page-faults fresh outputs in on every call), "keep" =
MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 (freed memory reused).
Prints only, unless --out NAME: then writes NAME.{md,json} (under benchmarks/results unless NAME
has a directory part; the tracked reference is --out dbn_cpu).

--affine: the DecorrelatedBatchNorm graph before and after the affine was fused into the op, in one
process, interleaved (no torch needed): "unfused" = gn_dbn / gn_dbn_inference then
gn_channel_affine (the graph of models exported before), "fused" = the same op with affine=True
(the block's graph now); forward, forward + backward under autograd (dx, dgamma, dbeta), and
inference forward. --out NAME writes NAME.{md,json} (tracked: --affine --out dbn_affine_cpu).
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
RESULTS = os.path.join(HERE, "results")

SHAPES = [  # (N, C, H, W), num_groups: group sizes 16, 16, 64, 32
    ((32, 64, 16, 16), 4),
    ((8, 128, 32, 32), 8),
    ((128, 256, 8, 8), 4),
    ((16, 64, 32, 32), 2),
]
LARGE_D = [  # the IterNorm comparison adds group sizes 128, 256 and 512
    ((32, 256, 8, 8), 2),
    ((32, 256, 8, 8), 1),
    ((32, 512, 8, 8), 1),
]
ITERATIONS = 5  # IterNorm's T (the paper's and the op's default)
EPS = 1e-5
KEEP_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
            "MALLOC_TRIM_THRESHOLD_": "100000000000"}
CONTENDERS = ["gn_fwd", "gn_fwdbwd", "gn_inf", "torch_fwd", "torch_fwdbwd", "torch_inf", "bmm",
              "it_fwd", "it_fwdbwd", "torch_it_fwd", "torch_it_fwdbwd"]


def _median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def round_robin(fns, rounds, min_sample_s, max_time_s):
    """fns: name -> (step, sync). Returns name -> {med_ms, min_ms, thr}."""
    inner, wall, cpu = {}, {}, {}
    for name, (step, sync) in fns.items():
        step(); sync()  # warm-up: allocations, first-call set-up
        t0 = time.perf_counter()
        step(); sync()
        one = max(time.perf_counter() - t0, 1e-6)
        inner[name] = max(1, int(min_sample_s / one))
        wall[name], cpu[name] = [], []
    t_start = time.perf_counter()
    for r in range(rounds):
        for name, (step, sync) in fns.items():
            k = inner[name]
            c0 = time.process_time()
            t0 = time.perf_counter()
            for _ in range(k):
                step()
            sync()
            wall[name].append((time.perf_counter() - t0) / k)
            cpu[name].append((time.process_time() - c0) / k)
        if r >= 4 and time.perf_counter() - t_start > max_time_s:
            break
    return {n: {"med_ms": 1e3 * _median(wall[n]), "min_ms": 1e3 * min(wall[n]),
                "cpu_med_ms": 1e3 * _median(cpu[n]), "cpu_min_ms": 1e3 * min(cpu[n]),
                "thr": sum(cpu[n]) / sum(wall[n]), "samples": len(wall[n])} for n in fns}


# ------------------------------------------------------------------------------------------------
# Child: one thread count, one allocator regime


def child_main(args):
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import mxnet as mx
    from mxnet import autograd
    import torch
    import gn_mx  # noqa: F401

    t = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(t)
    np.random.seed(0)
    torch.manual_seed(0)
    out = {"threads": t, "torch": torch.__version__, "mxnet": mx.__version__,
           "load_before": os.getloadavg(), "shapes": []}

    # Machine bounds, measured with torch at this thread count.
    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    big = torch.randn(16 << 20)  # 64 MB
    dst = torch.empty_like(big)  # preallocated: a warm copy, whatever the allocator regime
    sink = {}

    def gemm():
        sink["c"] = a @ b

    def copy():
        dst.copy_(big)

    r = round_robin({"gemm": (gemm, lambda: None), "copy": (copy, lambda: None)},
                    rounds=max(5, args.rounds // 2), min_sample_s=0.05, max_time_s=10)
    out["sgemm_gflops"] = 2 * 2048 ** 3 / (r["gemm"]["min_ms"] * 1e-3) / 1e9
    out["sgemm_gflops_cpu"] = 2 * 2048 ** 3 / (r["gemm"]["cpu_min_ms"] * 1e-3) / 1e9  # per CPU-s
    out["copy_gbs"] = 2 * big.numel() * 4 / (r["copy"]["min_ms"] * 1e-3) / 1e9
    del sink["c"], dst, big

    for shape, G in SHAPES + LARGE_D:
        N, C = shape[:2]
        D = C // G
        S = int(np.prod(shape[2:]))
        m = N * S
        xnp = np.random.randn(*shape).astype(np.float32)
        xnp[:, 1:] += 0.5 * xnp[:, :-1]  # correlated channels
        dynp = np.random.randn(*shape).astype(np.float32)
        x = mx.nd.array(xnp)
        dy = mx.nd.array(dynp)
        rm = mx.nd.zeros((C,))
        rp = mx.nd.array(np.tile(np.eye(D), (G, 1, 1)))
        x.attach_grad()

        def gn_fwd():
            mx.nd.gn_dbn(x, rm, rp, num_groups=G, eps=EPS)

        def gn_fwdbwd():
            with autograd.record():
                y = mx.nd.gn_dbn(x, rm, rp, num_groups=G, eps=EPS)[0]
            y.backward(dy)

        def gn_inf():
            mx.nd.gn_dbn_inference(x, rm, rp, num_groups=G)

        it_kw = dict(num_groups=G, eps=EPS, whitening="iternorm", iterations=ITERATIONS)

        def it_fwd():
            mx.nd.gn_dbn(x, rm, rp, **it_kw)

        def it_fwdbwd():
            with autograd.record():
                y = mx.nd.gn_dbn(x, rm, rp, **it_kw)[0]
            y.backward(dy)

        tx = torch.from_numpy(xnp.copy()).requires_grad_(True)
        tdy = torch.from_numpy(dynp.copy())
        tP = torch.eye(D).repeat(G, 1, 1).contiguous()
        tmean = torch.zeros(C)
        txg = torch.randn(G, D, m)

        def dbn_torch(xt):
            xg = xt.reshape(N, G, D, S).permute(1, 2, 0, 3).reshape(G, D, m)
            xc = xg - xg.mean(dim=2, keepdim=True)
            sigma = xc @ xc.transpose(1, 2) / m + EPS * torch.eye(D, dtype=xt.dtype)
            lam, U = torch.linalg.eigh(sigma.double())
            W = (U * lam.rsqrt().unsqueeze(1)) @ U.transpose(1, 2)
            y = W.to(xt.dtype) @ xc
            return y.reshape(G, D, N, S).permute(2, 0, 1, 3).reshape(xt.shape)

        def iternorm_torch(xt):
            xg = xt.reshape(N, G, D, S).permute(1, 2, 0, 3).reshape(G, D, m)
            xc = xg - xg.mean(dim=2, keepdim=True)
            sigma = xc @ xc.transpose(1, 2) / m + EPS * torch.eye(D, dtype=xt.dtype)
            tr = sigma.diagonal(dim1=1, dim2=2).sum(-1).reshape(G, 1, 1)
            sn = sigma / tr
            P = torch.eye(D, dtype=xt.dtype).expand(G, D, D)
            for _ in range(ITERATIONS):
                P = 1.5 * P - 0.5 * (P @ P @ P @ sn)
            y = (P / tr.sqrt()) @ xc
            return y.reshape(G, D, N, S).permute(2, 0, 1, 3).reshape(xt.shape)

        def torch_it_fwd():
            with torch.no_grad():
                sink["y"] = iternorm_torch(tx)

        def torch_it_fwdbwd():
            tx.grad = None
            iternorm_torch(tx).backward(tdy)

        def torch_fwd():
            with torch.no_grad():
                sink["y"] = dbn_torch(tx)

        def torch_fwdbwd():
            tx.grad = None
            dbn_torch(tx).backward(tdy)

        def torch_inf():
            with torch.no_grad():
                xg = tx.reshape(N, G, D, S).permute(1, 2, 0, 3).reshape(G, D, m)
                y = tP @ (xg - tmean.reshape(G, D, 1))
                sink["y"] = y.reshape(G, D, N, S).permute(2, 0, 1, 3).reshape(tx.shape)

        def bmm():
            sink["y"] = torch.bmm(tP, txg)

        mxs, nos = mx.nd.waitall, (lambda: None)
        fns = {"gn_fwd": (gn_fwd, mxs), "gn_fwdbwd": (gn_fwdbwd, mxs), "gn_inf": (gn_inf, mxs),
               "torch_fwd": (torch_fwd, nos), "torch_fwdbwd": (torch_fwdbwd, nos),
               "torch_inf": (torch_inf, nos), "bmm": (bmm, nos), "it_fwd": (it_fwd, mxs),
               "it_fwdbwd": (it_fwdbwd, mxs), "torch_it_fwd": (torch_it_fwd, nos),
               "torch_it_fwdbwd": (torch_it_fwdbwd, nos)}
        if (shape, G) in LARGE_D:  # the IterNorm comparison only
            fns = {k: v for k, v in fns.items() if k in ("gn_fwd", "gn_fwdbwd", "gn_inf", "torch_fwdbwd",
                                                         "it_fwd", "it_fwdbwd", "torch_it_fwd",
                                                         "torch_it_fwdbwd")}
        res = round_robin(fns, args.rounds, args.min_sample_s, args.max_time_s)
        sink.clear()
        out["shapes"].append({"shape": list(shape), "G": G, "D": D, "m": m, "res": res})
        print(f"# threads={t} {shape} G={G}: " + ", ".join(
            f"{k} {v['med_ms']:.2f}" for k, v in res.items()), file=sys.stderr, flush=True)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))


def affine_child_main(args):
    """--affine child: fused vs unfused affine on every shape, one thread count and regime."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import mxnet as mx
    from mxnet import autograd
    import gn_mx  # noqa: F401

    np.random.seed(0)
    out = {"threads": int(os.environ["OMP_NUM_THREADS"]), "mxnet": mx.__version__,
           "load_before": os.getloadavg(), "shapes": []}
    for shape, G in SHAPES:
        C = shape[1]
        D = C // G
        xnp = np.random.randn(*shape).astype(np.float32)
        xnp[:, 1:] += 0.5 * xnp[:, :-1]
        x, dy = mx.nd.array(xnp), mx.nd.array(np.random.randn(*shape).astype(np.float32))
        gamma = mx.nd.array(0.5 + np.random.rand(C).astype(np.float32))
        beta = mx.nd.array(np.random.randn(C).astype(np.float32))
        rm, rp = mx.nd.zeros((C,)), mx.nd.array(np.tile(np.eye(D), (G, 1, 1)))
        for a in (x, gamma, beta):
            a.attach_grad()

        def train(fused):
            if fused:
                return mx.nd.gn_dbn(x, gamma, beta, rm, rp, num_groups=G, eps=EPS,
                                    affine=True)[0]
            return mx.nd.gn_channel_affine(mx.nd.gn_dbn(x, rm, rp, num_groups=G, eps=EPS)[0],
                                           gamma, beta)

        def infer(fused):
            if fused:
                return mx.nd.gn_dbn_inference(x, gamma, beta, rm, rp, num_groups=G, affine=True)
            return mx.nd.gn_channel_affine(mx.nd.gn_dbn_inference(x, rm, rp, num_groups=G),
                                           gamma, beta)

        def fwdbwd(fused):
            with autograd.record():
                y = train(fused)
            y.backward(dy)

        fns = {}
        for kind in ("unfused", "fused"):
            f = kind == "fused"
            fns[f"{kind}_fwd"] = (lambda f=f: train(f), mx.nd.waitall)
            fns[f"{kind}_fwdbwd"] = (lambda f=f: fwdbwd(f), mx.nd.waitall)
            fns[f"{kind}_inf"] = (lambda f=f: infer(f), mx.nd.waitall)
        res = round_robin(fns, args.rounds, args.min_sample_s, args.max_time_s)
        out["shapes"].append({"shape": list(shape), "G": G, "D": D, "res": res})
        print(f"# threads={out['threads']} {shape} G={G}: " + ", ".join(
            f"{k} {v['med_ms']:.2f}" for k, v in res.items()), file=sys.stderr, flush=True)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))


def affine_table(run):
    lines = ["| shape | G | D | pass | unfused ms (CPU ms) | fused ms (CPU ms) | speed-up wall | "
             "speed-up CPU time |", "|---|---|---|---|---|---|---|---|"]
    for s in run["shapes"]:
        r = s["res"]
        shape = "x".join(str(v) for v in s["shape"])
        for ps, label in (("fwd", "forward"), ("fwdbwd", "fwd+bwd"), ("inf", "inference fwd")):
            u, f = r[f"unfused_{ps}"], r[f"fused_{ps}"]
            lines.append(f"| {shape} | {s['G']} | {s['D']} | {label} | {u['med_ms']:.2f} "
                         f"({u['cpu_med_ms']:.2f}) | {f['med_ms']:.2f} ({f['cpu_med_ms']:.2f}) | "
                         f"{u['med_ms'] / f['med_ms']:.2f}x | "
                         f"{u['cpu_med_ms'] / f['cpu_med_ms']:.2f}x |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Parent


def machine_info():
    cpu, flags = platform.processor() or "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    fl = line.split()
                    flags = [k for k in ("avx2", "fma", "f16c", "avx512f") if k in fl]
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "isa_flags": flags,
            "system": platform.platform(), "python": platform.python_version()}


def table(run):
    """Markdown table of one (threads, regime) child result."""
    lines = ["| shape | G | D | gn_dbn fwd | gn_dbn fwd+bwd (thr) | torch fwd | torch fwd+bwd (thr) "
             "| **fwd+bwd speed-up** | CPU-time speed-up | fwd speed-up | gn_dbn_inference | torch inf "
             "| bmm | inf GFLOP/s | inf GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in run["shapes"]:
        r = s["res"]
        if "torch_fwd" not in r:  # a LARGE_D shape: IterNorm table only
            continue
        elems = s["shape"][1] * s["m"]  # C * N * spatial
        inf_s = r["gn_inf"]["med_ms"] * 1e-3
        gflops = 2 * s["D"] ** 2 * s["m"] * s["G"] / inf_s / 1e9
        gbs = 2 * elems * 4 / inf_s / 1e9
        shape = "x".join(str(v) for v in s["shape"])
        lines.append(
            f"| {shape} | {s['G']} | {s['D']} | {r['gn_fwd']['med_ms']:.2f} | "
            f"{r['gn_fwdbwd']['med_ms']:.2f} ({r['gn_fwdbwd']['thr']:.1f}) | "
            f"{r['torch_fwd']['med_ms']:.2f} | "
            f"{r['torch_fwdbwd']['med_ms']:.2f} ({r['torch_fwdbwd']['thr']:.1f}) | "
            f"**{r['torch_fwdbwd']['med_ms'] / r['gn_fwdbwd']['med_ms']:.2f}x** "
            f"(min {r['torch_fwdbwd']['min_ms'] / r['gn_fwdbwd']['min_ms']:.2f}x) | "
            f"{r['torch_fwdbwd']['cpu_med_ms'] / r['gn_fwdbwd']['cpu_med_ms']:.2f}x | "
            f"{r['torch_fwd']['med_ms'] / r['gn_fwd']['med_ms']:.2f}x | "
            f"{r['gn_inf']['med_ms']:.2f} | {r['torch_inf']['med_ms']:.2f} | "
            f"{r['bmm']['med_ms']:.2f} | {gflops:.0f} | {gbs:.1f} |")
    return "\n".join(lines)


def iternorm_flops(G, D, m, T=ITERATIONS):
    """Floating-point operations of gn_mx IterNorm's forward + backward products: per group the
    D x D chains (forward 3 (T - 1) symmetric products at half a product each, backward the same
    again plus 6 (T - 1) + 1 full back step products, 2 D^3 each; dbn_math.h) and the data
    products (covariance D^2 m, whitening 2 D^2 m, backward gram 2 D^2 m and apply 4 D^2 m)."""
    return G * ((9 * (T - 1) + 1) * 2 * D ** 3 + 9 * D ** 2 * m)


def iternorm_table(run):
    """ZCA vs IterNorm (gn_mx) vs torch, fwd and fwd+bwd ms; CPU ms in parentheses; inference
    (gn_dbn_inference, the same op for both whitenings); the products' GFLOP/s vs sgemm."""
    lines = ["| shape | G | D | ZCA fwd | ZCA fwd+bwd | IterNorm fwd | IterNorm fwd+bwd | "
             "torch eigh fwd+bwd | torch IterNorm fwd | torch IterNorm fwd+bwd | inference | "
             "IterNorm fwd+bwd speed-up vs torch IterNorm: wall (CPU time) | IterNorm / ZCA "
             "fwd+bwd: wall (CPU time) | bound: IterNorm fwd+bwd GFLOP per CPU-s (sgemm's) | "
             "fastest fwd+bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in run["shapes"]:
        r = s["res"]
        if "it_fwd" not in r:
            continue
        shape = "x".join(str(v) for v in s["shape"])

        def c(k):
            return f"{r[k]['med_ms']:.2f} ({r[k]['cpu_med_ms']:.2f})"
        fb = {k: r[k]["cpu_med_ms"] for k in ("gn_fwdbwd", "it_fwdbwd", "torch_fwdbwd",
                                              "torch_it_fwdbwd")}
        names = {"gn_fwdbwd": "ZCA", "it_fwdbwd": "IterNorm", "torch_fwdbwd": "torch eigh",
                 "torch_it_fwdbwd": "torch IterNorm"}
        best = names[min(fb, key=fb.get)]
        def ratio(a, b, k):
            return r[a][k] / r[b][k]
        sp = (ratio("torch_it_fwdbwd", "it_fwdbwd", "med_ms"),
              ratio("torch_it_fwdbwd", "it_fwdbwd", "cpu_med_ms"))
        vz = ratio("it_fwdbwd", "gn_fwdbwd", "med_ms"), ratio("it_fwdbwd", "gn_fwdbwd", "cpu_med_ms")
        gf = iternorm_flops(s["G"], s["D"], s["m"]) / (r["it_fwdbwd"]["cpu_min_ms"] * 1e-3) / 1e9
        inf = f"{r['gn_inf']['med_ms']:.2f}" if "gn_inf" in r else "-"
        lines.append(f"| {shape} | {s['G']} | {s['D']} | {c('gn_fwd')} | {c('gn_fwdbwd')} | "
                     f"{c('it_fwd')} | {c('it_fwdbwd')} | {c('torch_fwdbwd')} | "
                     f"{c('torch_it_fwd')} | {c('torch_it_fwdbwd')} | {inf} | "
                     f"**{sp[0]:.2f}x** ({sp[1]:.2f}x) | {vz[0]:.2f}x ({vz[1]:.2f}x) | "
                     f"{gf:.0f} ({run['sgemm_gflops_cpu']:.0f}) | {best} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--regimes", default="keep,default", help="comma list of keep, default")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--min-sample-s", type=float, default=0.03)
    p.add_argument("--max-time-s", type=float, default=40.0, help="per shape")
    p.add_argument("--no-write", action="store_true", help="print only (the default)")
    p.add_argument("--out", default=None, metavar="NAME",
                   help="write NAME.{md,json} (a basename: under benchmarks/results, e.g. dbn_cpu; "
                        "or a path); default: print only")
    p.add_argument("--affine", action="store_true",
                   help="fused affine vs gn_dbn + gn_channel_affine (dbn_affine_cpu.md)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return affine_child_main(args) if args.affine else child_main(args)

    runs = []
    for regime in args.regimes.split(","):
        for t in [int(v) for v in args.threads.split(",")]:
            env = dict(os.environ, OMP_NUM_THREADS=str(t))
            for k in KEEP_ENV:
                env.pop(k, None)
            if regime == "keep":
                env.update(KEEP_ENV)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rounds", str(args.rounds),
                   "--min-sample-s", str(args.min_sample_s), "--max-time-s", str(args.max_time_s)]
            cmd += ["--affine"] if args.affine else []
            pr = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            if pr.returncode != 0:
                sys.exit(f"child failed (threads={t}, regime={regime})")
            run = json.loads(pr.stdout.strip().splitlines()[-1])
            run["regime"] = regime
            runs.append(run)
            bounds = ("" if args.affine else f"; sgemm {run['sgemm_gflops']:.0f} GFLOP/s, copy "
                      f"{run['copy_gbs']:.1f} GB/s")
            print(f"\n## threads={t}, allocator {regime}; load average "
                  f"{run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f}{bounds}\n")
            print((affine_table if args.affine else table)(run), flush=True)
            if not args.affine:
                print("\n" + iternorm_table(run), flush=True)
    info = machine_info()
    info["date_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.no_write or args.out is None:
        return
    stem = os.path.join(RESULTS, args.out)  # an absolute or relative path with a directory wins
    if os.path.dirname(args.out):
        stem = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    if args.affine:
        return write_affine(info, runs, stem)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": info, "runs": runs}, f, indent=1)
    md = [f"# Decorrelated BN CPU benchmark (`benchmarks/bench_dbn.py`)", "",
          f"Machine: {info['cpu']}, {info['cores']} cores, ISA {'/'.join(info['isa_flags'])}; "
          f"{info['system']}; torch {runs[0]['torch']}, MXNet {runs[0]['mxnet']}; {info['date_utc']}.",
          "fp32, eps 1e-5. Times: median ms per call over interleaved rounds (speed-ups = torch / "
          "gn_dbn, also from the minima, and from the process CPU time per call, which a loaded "
          "machine distorts less at 1 thread); thr = process CPU time / wall time; inference "
          "GFLOP/s = 2 D^2 N S C / t, GB/s = (x read + y written) / t; bmm = torch.bmm of the "
          "same (G, D, D) x (G, D, m) product on grouped contiguous data.", ""]
    for run in runs:
        md += [f"## {run['threads']} thread(s), allocator: "
               + ("glibc default" if run["regime"] == "default" else
                  "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000"), "",
               f"Load average {run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f}; measured "
               f"bounds: sgemm {run['sgemm_gflops']:.0f} GFLOP/s, copy {run['copy_gbs']:.1f} GB/s "
               "(read + write).", "", table(run), "",
               f"ZCA vs IterNorm (T = {ITERATIONS}) vs torch, ms per call (process CPU ms per "
               "call); fastest fwd+bwd by CPU time:", "", iternorm_table(run), ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md))


def regime_name(regime):
    return ("glibc default" if regime == "default" else
            "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000")


def write_affine(info, runs, stem):
    with open(stem + ".json", "w") as f:
        json.dump({"machine": info, "runs": runs}, f, indent=1)
    md = ["# DBN affine fused into the op vs gn_channel_affine after it "
          "(`benchmarks/bench_dbn.py --affine`)", "",
          f"Machine: {info['cpu']}, {info['cores']} cores, ISA {'/'.join(info['isa_flags'])}; "
          f"{info['system']}; MXNet {runs[0]['mxnet']}; {info['date_utc']}.",
          "fp32, eps 1e-5, imperative mx.nd calls (the ops of DecorrelatedBatchNorm's graph). "
          "unfused = gn_dbn (or gn_dbn_inference) + gn_channel_affine, the graph of models "
          "exported before the fusion; fused = the same op with affine=True. Median ms per call "
          "over interleaved rounds in one process; CPU = process CPU time per call (less "
          "distorted by a loaded machine).", ""]
    for run in runs:
        md += [f"## {run['threads']} thread(s), allocator: {regime_name(run['regime'])}", "",
               f"Load average {run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f}.", "",
               affine_table(run), ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md))


if __name__ == "__main__":
    main()
