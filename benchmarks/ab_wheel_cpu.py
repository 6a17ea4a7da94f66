#!/usr/bin/env python
"""A/B of the CPU kernels of two gn_mx installations: the wheel's library against another build.

    flock /tmp/gnmx-bench.lock python benchmarks/ab_wheel_cpu.py --a VENV_A/bin/python \\
        --b .venv/bin/python [--rounds 6] [--out wheel_ab_cpu]

Each side is an interpreter whose `import gn_mx` finds that side's library (e.g. A: a venv with the
manylinux2014 wheel installed, B: the development venv's editable build). The same child script
runs in both, in turn (A B, then B A, ... in alternating order), OMP_NUM_THREADS=1, glibc told to
keep freed memory (benchmarks/_common.KEPT), from a neutral folder. A child times, fp32, imperative:
  - GroupNorm forward and forward+backward (mx.nd.gn_group_norm) on bench_group_norm.SHAPES, and
    with the fused SiLU on three of them (it calls libm's expf per element: the wheel binds glibc
    2.17's expf@GLIBC_2.2.5, a build on this machine expf@GLIBC_2.27);
  - DBN on bench_dbn.SHAPES: ZCA forward+backward (gn_dbn), inference (gn_dbn_inference) and
    IterNorm (T=5) forward+backward;
each case the median of 5 samples, a sample a loop of >= --min-sample-ms of process CPU time
(all threads; on a shared machine far steadier than wall time, which is recorded too). Per case
and round the
ratio time(A)/time(B) of the two children of that round (paired: the machine's drift cancels);
reported: each side's median time and the median (min-max) of the paired ratios. Ratio < 1: A
is faster. --out NAME writes benchmarks/results/NAME.{md,json}.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import KEPT, result_stem, write_results  # noqa: E402


def _cases():
    from bench_dbn import SHAPES as DBN_SHAPES
    from bench_group_norm import SHAPES as GN_SHAPES
    out = []
    for shape, g in GN_SHAPES:
        out += [("gn_fwd", shape, g), ("gn_fwdbwd", shape, g)]
    for shape, g in GN_SHAPES[2:5]:  # the fused SiLU calls expf per element (libm's, see below)
        out += [("gnsilu_fwd", shape, g), ("gnsilu_fwdbwd", shape, g)]
    for shape, g in DBN_SHAPES:
        out += [("zca_fwdbwd", shape, g), ("zca_inf", shape, g), ("itn_fwdbwd", shape, g)]
    return out


def child(min_sample_s):
    import numpy as np
    import mxnet as mx
    from mxnet import autograd
    import gn_mx
    res = {"library": gn_mx.library_path() if hasattr(gn_mx, "library_path") else None,
           "build_info": {k: v for k, v in gn_mx.build_info().items() if k != "summary"},
           "t": {}, "wall": {}}
    rs = np.random.RandomState(0)
    for kind, shape, g in _cases():
        c = shape[1]
        x = mx.nd.array(rs.randn(*shape).astype(np.float32))
        dy = mx.nd.array(rs.randn(*shape).astype(np.float32))
        x.attach_grad()
        if kind.startswith("gn"):
            gamma, beta = mx.nd.ones(c), mx.nd.zeros(c)
            act = "silu" if kind.startswith("gnsilu") else "none"

            def op():
                return mx.nd.gn_group_norm(x, gamma, beta, num_groups=g, act_type=act)[0]
        else:
            d = c // g
            rm, rp = mx.nd.zeros((c,)), mx.nd.array(np.tile(np.eye(d), (g, 1, 1)))
            kw = dict(num_groups=g, eps=1e-5)
            if kind.startswith("itn"):
                kw.update(whitening="iternorm", iterations=5)

            def op():
                if kind == "zca_inf":
                    return mx.nd.gn_dbn_inference(x, rm, rp, num_groups=g)
                return mx.nd.gn_dbn(x, rm, rp, **kw)[0]
        if kind.endswith("fwdbwd"):
            def call():
                with autograd.record():
                    y = op()
                y.backward(dy)
                x.grad.wait_to_read()
        else:
            def call():
                op().wait_to_read()
        call()
        call()
        n = 1
        while True:  # calls per sample: the loop takes >= min_sample_s of CPU time
            t0 = time.process_time()
            for _ in range(n):
                call()
            if time.process_time() - t0 >= min_sample_s:
                break
            n *= 2
        cpu, wall = [], []
        for _ in range(5):
            t0, w0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                call()
            cpu.append((time.process_time() - t0) / n)
            wall.append((time.perf_counter() - w0) / n)
        name = "%s %s G=%d" % (kind, "x".join(map(str, shape)), g)
        res["t"][name], res["wall"][name] = sorted(cpu)[2], sorted(wall)[2]
    print("AB-RESULT " + json.dumps(res))


def _run_side(py, min_sample_s, work):
    env = dict(os.environ, OMP_NUM_THREADS="1", **KEPT)
    env.pop("PYTHONPATH", None)
    r = subprocess.run([py, os.path.abspath(__file__), "--child", "--min-sample-ms",
                        str(min_sample_s * 1e3)], capture_output=True, text=True, env=env, cwd=work)
    if r.returncode != 0 or "AB-RESULT " not in r.stdout:
        raise SystemExit(f"child {py} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.split("AB-RESULT ", 1)[1])


def _median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", help="interpreter of side A (the wheel)")
    ap.add_argument("--b", help="interpreter of side B (the baseline build)")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--min-sample-ms", type=float, default=20.0)
    ap.add_argument("--out", default=None, metavar="NAME")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.min_sample_ms / 1e3)
    if not (a.a and a.b):
        ap.error("--a and --b name the two interpreters")
    load = [os.getloadavg()]
    t0 = time.time()
    runs = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for side in order:
                runs[side].append(_run_side(a.a if side == "A" else a.b, a.min_sample_ms / 1e3, work))
            load.append(os.getloadavg())
            print(f"round {r + 1}/{a.rounds} done ({time.time() - t0:.0f} s, load "
                  f"{load[-1][0]:.1f})", file=sys.stderr)
    names = list(runs["A"][0]["t"])
    rows, ratios_all = [], []
    for n in names:
        ta = [x["t"][n] for x in runs["A"]]
        tb = [x["t"][n] for x in runs["B"]]
        ratios = [p / q for p, q in zip(ta, tb)]
        wall = [x["wall"][n] / y["wall"][n] for x, y in zip(runs["A"], runs["B"])]
        ratios_all.append(_median(ratios))
        rows.append((n, _median(ta), _median(tb), _median(ratios), min(ratios), max(ratios),
                     _median(wall)))
    cpu = ""
    try:
        cpu = next(l for l in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                   .splitlines() if l.startswith("Model name")).split(":", 1)[1].strip()
    except Exception:
        pass
    info = {s: runs[s][0]["build_info"] for s in ("A", "B")}
    lines = [f"A = {a.label_a} ({info['A'].get('compiler')}), B = {a.label_b} "
             f"({info['B'].get('compiler')}); 1 thread, fp32, imperative; {a.rounds} rounds "
             "alternating A/B; per case the median of the paired per-round ratios A/B "
             "(min-max); < 1: A faster. Times are process CPU time per call (all threads: the op runs on "
             "MXNet's engine thread), which other processes on a shared machine disturb far less "
             "than wall time; the wall-time ratio is shown beside it.", "",
             "| case | A CPU ms | B CPU ms | A/B median | A/B min-max | wall A/B median |",
             "|---|---|---|---|---|---|"]
    for n, ta, tb, med, lo, hi, wr in rows:
        lines.append(f"| {n} | {ta * 1e3:.3f} | {tb * 1e3:.3f} | {med:.3f} | {lo:.3f}-{hi:.3f} "
                     f"| {wr:.3f} |")
    overall = _median(ratios_all)
    lines += ["", f"Median over the {len(rows)} cases of the per-case median ratio: "
              f"**{overall:.3f}**; cases below 0.98: "
              f"{sum(r[3] < 0.98 for r in rows)}, above 1.02: {sum(r[3] > 1.02 for r in rows)}."]
    text = "\n".join(lines)
    print(text)
    about = (f"{cpu}, nproc {os.cpu_count()}, load average "
             f"(1/5/15 min) before {load[0][0]:.2f}/{load[0][1]:.2f}/{load[0][2]:.2f}, after "
             f"{load[-1][0]:.2f}/{load[-1][1]:.2f}/{load[-1][2]:.2f}; OMP_NUM_THREADS=1, "
             "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000; "
             f"{time.time() - t0:.0f} s in all.\n")
    if a.out:
        write_results(result_stem(a.out, "wheel_ab_cpu"),
                      "CPU kernels: the manylinux2014 wheel's library vs the development build",
                      about, text,
                      {"a": a.label_a, "b": a.label_b, "build_info": info, "load": load,
                       "cpu": cpu, "rounds": a.rounds,
                       "cases": [dict(zip(("case", "a_cpu_s", "b_cpu_s", "ratio_median", "ratio_min",
                                           "ratio_max", "wall_ratio_median"), r)) for r in rows],
                       "median_ratio": overall})


if __name__ == "__main__":
    main()
