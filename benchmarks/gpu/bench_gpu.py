"""GPU benchmark: gn_mx's CUDA GroupNorm kernels vs torch's CUDA GroupNorm, same process, same GPU.

Each measurement replays a CUDA graph of `reps` back-to-back calls (no Python/launch overhead in the
timing), timed with CUDA events, median of several replays. The bound is the measured device-to-device
copy bandwidth (torch copy_ of a 1 GiB buffer: read + write bytes / time).

Effective bytes: forward reads x and writes y (2 * numel * itemsize); forward+backward adds reading dy
and x and writing dx (5 * numel * itemsize). Parameters and statistics are ignored (tiny).

    python benchmarks/gpu/bench_gpu.py [--quick] [--out benchmarks/results]
writes gpu_bench.json and gpu_bench.md into --out.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
torch = gnh = None  # imported by main() after the arguments (--help needs neither)

SD_SHAPES = [(2, c, hw, hw) for c in (320, 640, 1280) for hw in (64, 32, 16, 8)]
LARGE_SHAPES = [(16, 512, 64, 64), (32, 256, 128, 128), (8, 1280, 32, 32)]


def _repeat(fn, reps):
    def run():
        for _ in range(reps):
            fn()
    return run


def _median_per_call(run, reps, replays):
    """Median seconds per call over `replays` CUDA-event-timed run()s of `reps` calls each."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(times)


def time_graph(fn, reps=20, replays=7, warmup=3):
    """Seconds per call of fn(), from CUDA-graph replays; falls back to eager launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        run = g.replay
    except Exception:  # noqa: BLE001 - capture unsupported: time eager launches instead
        mode = "eager"
        run = _repeat(fn, reps)
    run()
    torch.cuda.synchronize()
    return _median_per_call(run, reps, replays), mode


def copy_bandwidth():
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t, _ = time_graph(lambda: dst.copy_(src), reps=5, replays=5)
    return 2 * n / t


def bench_shape(shape, dtype, G, copy_bw, eps=1e-5):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    C = shape[1]
    gamma = torch.rand(C, device="cuda", dtype=dtype) + 0.5
    beta = torch.randn(C, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    N = shape[0]
    HxW = x.numel() // (N * C)
    numel, isz = x.numel(), x.element_size()

    fwd = gnh.GroupNormFwd(x, gamma, beta, G, eps)
    fwd()
    bwd = gnh.GroupNormBwd(dy, x, fwd.mean, fwd.rstd, gamma, G)

    def ours_fb():
        fwd()
        bwd()

    def torch_fwd():
        return torch.ops.aten.native_group_norm(x, gamma, beta, N, C, HxW, G, eps)

    t_out = torch_fwd()

    def torch_fb():
        y, m, r = torch.ops.aten.native_group_norm(x, gamma, beta, N, C, HxW, G, eps)
        torch.ops.aten.native_group_norm_backward(dy, x, m, r, gamma, N, C, HxW, G,
                                                  [True, True, True])

    del t_out
    res = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""), "G": G}
    for name, fn, nbytes in (("ours_fwd", fwd, 2 * numel * isz),
                             ("torch_fwd", torch_fwd, 2 * numel * isz),
                             ("ours_fwd_bwd", ours_fb, 5 * numel * isz),
                             ("torch_fwd_bwd", torch_fb, 5 * numel * isz)):
        t, mode = time_graph(fn)
        res[name + "_us"] = t * 1e6
        res[name + "_gbs"] = nbytes / t / 1e9
        res[name + "_pct_copy"] = 100.0 * nbytes / t / copy_bw
        res["timing"] = mode
    res["fwd_speedup"] = res["torch_fwd_us"] / res["ours_fwd_us"]
    res["fwd_bwd_speedup"] = res["torch_fwd_bwd_us"] / res["ours_fwd_bwd_us"]
    return res


DBN_SHAPES = [((32, 64, 32, 32), 16), ((32, 64, 32, 32), 4), ((16, 256, 16, 16), 16),
              ((64, 512, 8, 8), 8)]


def torch_dbn(x, G, eps=1e-5):
    """Reference ZCA whitening in x's dtype with torch.linalg.eigh (what a user would write)."""
    N, C = x.shape[:2]
    D = C // G
    X = x.reshape(N, G, D, -1).permute(1, 2, 0, 3).reshape(G, D, -1)
    Xc = X - X.mean(-1, keepdim=True)
    sigma = Xc @ Xc.transpose(1, 2) / X.shape[-1] + eps * torch.eye(D, device=x.device,
                                                                    dtype=x.dtype)
    l, U = torch.linalg.eigh(sigma)
    W = U @ torch.diag_embed(l.clamp_min(eps).rsqrt()) @ U.transpose(1, 2)
    return (W @ Xc).reshape(G, D, N, -1).permute(2, 0, 1, 3).reshape(x.shape)


def bench_dbn(shape, G):
    if not gnh.has("gnh_dbn_fwd"):
        return None
    x = torch.randn(shape, device="cuda", dtype=torch.float32)
    dy = torch.randn_like(x)
    y, mean, U, l = gnh.dbn_fwd(x, G)

    def ours_fb():
        _, m, u, e = gnh.dbn_fwd(x, G)
        gnh.dbn_bwd(dy, x, m, u, e, G)

    xr = x.clone().requires_grad_(True)

    def torch_fb():
        torch_dbn(xr, G).backward(dy)

    res = {"shape": list(shape), "G": G, "dtype": "float32"}
    # eager timing for all four: torch's eigh may synchronize, which graph capture forbids
    for name, fn in (("ours_fwd", lambda: gnh.dbn_fwd(x, G)), ("torch_fwd", lambda: torch_dbn(x, G)),
                     ("ours_fwd_bwd", ours_fb), ("torch_fwd_bwd", torch_fb)):
        t, _ = time_graph_eager(fn)
        res[name + "_us"] = t * 1e6
    return res


def time_graph_eager(fn, reps=10, replays=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return _median_per_call(_repeat(fn, reps), reps, replays), "eager"


def markdown(meta, rows, dbn_rows=()):
    lines = [f"# gn_mx GPU benchmark ({meta['device']})", "",
             f"- date: {meta['date']}; torch {meta['torch']}; CUDA {meta['cuda']}",
             f"- measured device-to-device copy bandwidth: {meta['copy_gbs']:.0f} GB/s",
             "- times: median per call over CUDA-graph replays; %copy = effective bytes / time / copy bw",
             "  (fwd: read x + write y; fwd+bwd: + read dy, x + write dx)", "",
             "| shape | dtype | G | ours fwd us | torch fwd us | fwd speedup | ours fwd %copy "
             "| ours f+b us | torch f+b us | f+b speedup | ours f+b %copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {tuple(r['shape'])} | {r['dtype']} | {r['G']} | {r['ours_fwd_us']:.1f} | "
            f"{r['torch_fwd_us']:.1f} | {r['fwd_speedup']:.2f}x | {r['ours_fwd_pct_copy']:.0f}% | "
            f"{r['ours_fwd_bwd_us']:.1f} | {r['torch_fwd_bwd_us']:.1f} | "
            f"{r['fwd_bwd_speedup']:.2f}x | {r['ours_fwd_bwd_pct_copy']:.0f}% |")
    slow = [r for r in rows if r["fwd_speedup"] < 1 or r["fwd_bwd_speedup"] < 1]
    lines += ["", f"Rows slower than torch (fwd or fwd+bwd): {len(slow)} of {len(rows)}."]
    if dbn_rows:
        lines += ["", "## Decorrelated BN (float32, eager timing incl. launch overhead)", "",
                  "torch reference: ZCA whitening with torch.linalg.eigh, autograd backward.", "",
                  "| shape | G | ours fwd us | torch fwd us | ours f+b us | torch f+b us |",
                  "|---|---|---|---|---|---|"]
        for r in dbn_rows:
            lines.append(f"| {tuple(r['shape'])} | {r['G']} | {r['ours_fwd_us']:.1f} | "
                         f"{r['torch_fwd_us']:.1f} | {r['ours_fwd_bwd_us']:.1f} | "
                         f"{r['torch_fwd_bwd_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write gpu_bench.{json,md} into DIR (e.g. benchmarks/results); default: print only")
    ap.add_argument("--quick", action="store_true", help="SD-UNet shapes only")
    args = ap.parse_args()
    global torch, gnh
    import torch
    import gnh
    torch.backends.cudnn.benchmark = False
    gnh.load()
    copy_bw = copy_bandwidth()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_gbs": copy_bw / 1e9}
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s on {meta['device']}", flush=True)
    shapes = SD_SHAPES + ([] if args.quick else LARGE_SHAPES)
    rows = []
    for dtype in (torch.float16, torch.float32):
        for shape in shapes:
            r = bench_shape(shape, dtype, 32, copy_bw)
            rows.append(r)
            print(f"{str(tuple(shape)):22s} {r['dtype']:8s} fwd {r['ours_fwd_us']:8.1f}us "
                  f"(torch {r['torch_fwd_us']:8.1f}, {r['ours_fwd_pct_copy']:4.0f}% copy)  "
                  f"f+b {r['ours_fwd_bwd_us']:8.1f}us (torch {r['torch_fwd_bwd_us']:8.1f}, "
                  f"{r['ours_fwd_bwd_pct_copy']:4.0f}% copy)", flush=True)
    dbn_rows = []
    for shape, G in ([] if args.quick else DBN_SHAPES):
        try:
            r = bench_dbn(shape, G)
        except Exception as e:  # noqa: BLE001 - keep the GroupNorm results
            print(f"dbn {shape} G={G}: {e}", flush=True)
            continue
        if r:
            dbn_rows.append(r)
            print(f"dbn {str(tuple(shape)):20s} G={G:3d} fwd {r['ours_fwd_us']:8.1f}us "
                  f"(torch {r['torch_fwd_us']:8.1f})  f+b {r['ours_fwd_bwd_us']:8.1f}us "
                  f"(torch {r['torch_fwd_bwd_us']:8.1f})", flush=True)
    if args.out is None:
        print(markdown(meta, rows, dbn_rows))
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "dbn_rows": dbn_rows}, f, indent=1)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(markdown(meta, rows, dbn_rows))
    print(f"wrote {args.out}/gpu_bench.json and gpu_bench.md")


if __name__ == "__main__":
    main()
