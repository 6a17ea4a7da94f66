#!/usr/bin/env python
"""Per-call overhead of a library (lib_api) op against MXNet's built-in ops, on this machine.

    python benchmarks/bench_overhead.py            # ~1 min; prints the report
    python benchmarks/bench_overhead.py --out benchmarks/results   # also writes overhead_cpu.{md,json}

Builds a benchmark-only external library (benchmarks/overhead/noop_op.cc: op `bench_noop`, whose
forward does nothing) with the installed mxnet's lib_api, loads it next to gn_mx and times, in one
process, interleaved round-robin (medians of repeated samples), on 1-element tensors:
  builtin_relu, builtin_identity     built-in ops (MXNet's own dispatch floor)
  lib_noop                           an EMPTY lib_api op: the floor of MXNet's lib_api path
  lib_noop_2attrs                    the same with two (ignored) attributes, as gn_group_norm has
  gn_moments, gn_group_norm          gn_mx ops (the difference to lib_noop is gn_mx's own work plus
                                     MXNet allocating the extra outputs)
and hybridized (static_alloc) gn_mx.GroupNorm blocks, forward only, grad_req 'write' (no identity on
the parameter path) vs 'add' (one identity per parameter), next to gluon.nn.BatchNorm and a block
with one relu, on a tiny and a mid-size input. Also the cost of gn_mx's own attribute parsing per
callback (benchmarks/overhead/attr_parse.cc, plain C++). One thread (OMP_NUM_THREADS=1 unless set), glibc
malloc told to keep freed memory (the regime that does not page-fault outputs in).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))


def build_noop():
    import mxnet as mx
    mxroot = os.path.dirname(mx.__file__)
    out = os.path.join(ROOT, "build", "bench", "libbench_noop.so")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    src = os.path.join(HERE, "overhead", "noop_op.cc")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-Wl,-Bsymbolic",
                        "-I", os.path.join(mxroot, "include", "mxnet"),
                        "-I", os.path.join(mxroot, "include"), src,
                        os.path.join(mxroot, "src", "lib_api.cc"), "-o", out], check=True)
    return out


def attr_parse_ns():
    """ns per parse of gn_group_norm's three attributes, as every callback does it."""
    import mxnet as mx
    mxroot = os.path.dirname(mx.__file__)
    exe = os.path.join(ROOT, "build", "bench", "attr_parse")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    subprocess.run(["g++", "-O2", "-std=c++17", "-I", os.path.join(ROOT, "src", "operator", "mx"),
                    "-I", os.path.join(mxroot, "include", "mxnet"), "-I", os.path.join(mxroot, "include"),
                    os.path.join(HERE, "overhead", "attr_parse.cc"), "-o", exe], check=True)
    return float(subprocess.run([exe], stdout=subprocess.PIPE, text=True, check=True).stdout)


def child():
    import mxnet as mx
    from mxnet import gluon
    import gn_mx
    from bench_group_norm import Timer

    mx.library.load(build_noop(), verbose=False)
    t1 = mx.nd.ones((1, 1))
    g1, b1 = mx.nd.ones((1,)), mx.nd.zeros((1,))
    W = mx.nd.waitall
    imperative = {
        "builtin_relu": (lambda: mx.nd.relu(t1), W),
        "builtin_identity": (lambda: mx.nd.identity(t1), W),
        "lib_noop": (lambda: mx.nd.bench_noop(t1), W),
        "lib_noop_2attrs": (lambda: mx.nd.bench_noop(t1, num_groups=1, eps=1e-5), W),
        "gn_moments": (lambda: mx.nd.gn_moments(t1, num_groups=1), W),
        "gn_group_norm": (lambda: mx.nd.gn_group_norm(t1, g1, b1, num_groups=1), W),
    }
    timer = Timer(0.02, 15, 20.0)

    def us(d):
        return {k: (v * 1e6 if isinstance(v, float) else v) for k, v in d.items()}
    out = {"threads": int(os.environ.get("OMP_NUM_THREADS", "1")), "loadavg_start": os.getloadavg()}
    out["imperative_us"] = us(timer.run(imperative))

    class One(gluon.HybridBlock):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def hybrid_forward(self, F, x):
            return self.fn(F, x)

    blocks = {}
    for shape, G in (((2, 4, 3), 2), ((2, 64, 56, 56), 32)):
        x = mx.nd.random.normal(shape=shape)
        cases = {}
        for req in ("write", "add"):
            blk = gn_mx.GroupNorm(num_groups=G)
            blk.initialize()
            blk.collect_params().setattr("grad_req", req)
            blk.hybridize(static_alloc=True, static_shape=True)
            cases["gn_mx_GroupNorm_" + req] = blk
        bn = gluon.nn.BatchNorm()
        bn.initialize()
        bn.hybridize(static_alloc=True, static_shape=True)
        cases["gluon_BatchNorm"] = bn
        for name, fn in (("relu_block", lambda F, x: F.relu(x)),
                         ("lib_noop_block", lambda F, x: F.bench_noop(x))):
            b = One(fn)
            b.hybridize(static_alloc=True, static_shape=True)
            cases[name] = b
        fns = {k: ((lambda b=b: b(x)), W) for k, b in cases.items()}
        key = "x".join(map(str, shape))
        blocks[key] = us(timer.run(fns))
    out["hybridized_forward_us"] = blocks
    out["attr_parse_ns"] = attr_parse_ns()
    out["loadavg_end"] = os.getloadavg()
    json.dump(out, sys.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="write overhead_cpu.{md,json} into DIR (benchmarks/results: the tracked "
                         "ones); default: print only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MALLOC_ARENA_MAX"] = "1"
    env["MALLOC_MMAP_MAX_"] = "0"
    env["MALLOC_TRIM_THRESHOLD_"] = str(1 << 40)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                       stdout=subprocess.PIPE, text=True, check=True)
    res = json.loads(p.stdout)
    res["date_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    lines = ["# Per-call overhead (`benchmarks/bench_overhead.py`)", "",
             "%s UTC, %d thread(s), load average %.1f -> %.1f; glibc malloc keeping freed memory." % (
                 res["date_utc"], res["threads"], res["loadavg_start"][0], res["loadavg_end"][0]), "",
             "Imperative `mx.nd` call + `waitall` on 1-element tensors (us per call, median):", "",
             "| op | us |", "| --- | --- |"]
    fmt = lambda v: "%.1f" % v if isinstance(v, float) else v  # noqa: E731
    lines += ["| %s | %s |" % (k, fmt(v)) for k, v in res["imperative_us"].items()]
    lines += ["", "Hybridized (static_alloc) block, forward only (us per call, median):", ""]
    for shape, d in res["hybridized_forward_us"].items():
        lines += ["input %s:" % shape, "", "| block | us |", "| --- | --- |"]
        lines += ["| %s | %s |" % (k, fmt(v)) for k, v in d.items()]
        lines.append("")
    lines += ["gn_mx's attribute parsing (gn_group_norm's three attributes, as each callback parses "
              "them): %.0f ns; an imperative call parses 4 times (parseAttrs, inferType, inferShape, "
              "forward), a hybridized one once per forward/backward." % res["attr_parse_ns"], ""]
    text = "\n".join(lines)
    print(text)
    if args.out is None:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead_cpu.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "overhead_cpu.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
