#!/usr/bin/env python
"""Inference latency on the CPU: which deployment path of a GroupNorm network is fastest.

    python benchmarks/bench_inference.py                  # ~1-2 min; prints the report
    python benchmarks/bench_inference.py --quick          # fewer rounds
    python benchmarks/bench_inference.py --out inference_cpu   # also writes
                                                  # benchmarks/results/inference_cpu.{md,json}

The network: a 6-conv ResNet-style CNN on (N, 3, 64, 64) images, N = 1 and 8, fp32: a stride-2 stem
conv (16 channels, 32x32) -> norm -> relu; a basic block at 16 channels (conv-norm-relu-conv-norm,
identity skip, relu); a stride-2 basic block at 32 channels (16x16) with a 1x1 projection shortcut;
global average pool, dense (10 classes). 6 convolutions, 5 norm layers (groups of 4 channels for
GroupNorm). Every MXNet contender is hybridized with static_alloc/static_shape and runs in predict
mode (a plain call, as a deployed model does); all contenders of one batch size are timed
interleaved (round-robin samples), medians:

  mx_gn           gn_mx.GroupNorm (this package's op, gn_group_norm)
  mx_gn_relu      gn_mx.GroupNorm(activation='relu'): the ReLU after a norm fused into the op
  mx_affine       gn_mx's cheapest op (gn_channel_affine, a per-channel scale and shift) in the
                  norm's place: what any library op costs there (dispatch + MKLDNN layout change)
  mx_bn_folded    gluon.nn.BatchNorm, then ``optimize_for(x, backend='MKLDNN')``: MXNet's subgraph
                  pass folds each BatchNorm into its convolution (and fuses the ReLUs and the sums)
  mx_none         no norm layer at all (the same convs, hybridized): MXNet's floor without fusion
  mx_none_mkldnn  no norm, ``optimize_for(x, backend='MKLDNN')`` (conv+relu/sum fusion)
  ort_gn          the mx_gn net exported to ONNX (gn_mx.onnx.export_model, opset 17) and run in
                  onnxruntime's CPU provider
  ort_bn          the BatchNorm net exported to ONNX, run in onnxruntime (which folds BN itself)

Threads: OMP_NUM_THREADS=--threads (default 2; a list such as 1,2 runs each) for MXNet (its MKLDNN
kernels), and onnxruntime's intra_op_num_threads=--threads, inter_op_num_threads=1, sequential
execution. (On a machine busier than its cores, MXNet's OpenMP threads wait for each other at every
barrier: 2-thread MXNet times then grow by orders of magnitude; 1 thread stays meaningful.)
Allocator: glibc told to keep freed memory (MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=1e11, the "kept" regime) by default; ``--regimes default`` (glibc defaults)
or both. Each regime and thread count runs in two child processes, one timing the MXNet paths,
one the onnxruntime paths (neither's idle thread pool then runs while the other is timed).
OMP_WAIT_POLICY is passed through and stated (libgomp's default spins before sleeping: with 2
threads on a 2-core machine that has other work, every OpenMP barrier can wait for a descheduled
thread, and the gn_mx ops, several parallel regions per call, suffer most; measured here at load
~3.5: mx_gn 80 / 57 ms (1 / 8 images) by default, 1.7 / 14 ms with OMP_WAIT_POLICY=passive).
mx_gn_relu's output is checked against mx_gn's, the optimize_for nets' against the same nets before, the ONNX ones against the
MXNet net they were exported from.

Outputs: stdout; with --out NAME also NAME.{md,json}: under benchmarks/results for a bare name (the
tracked ones: --out inference_cpu), DIR/inference_cpu.{md,json} for an existing directory DIR.
Nothing is written without --out (the ONNX files go to a temporary directory, removed after).
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import (KEPT, add_timing_args, result_stem, run_regimes, timing_defaults,  # noqa: E402
                     write_results)

BATCHES = [1, 8]
MX_ROWS = ["mx_gn", "mx_gn_relu", "mx_affine", "mx_bn_folded", "mx_none", "mx_none_mkldnn"]
ORT_ROWS = ["ort_gn", "ort_bn"]
GROUP_SIZE = 4  # channels per GroupNorm group
REGIMES = {
    "kept": (KEPT, "glibc malloc keeps freed memory (MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 "
                   "MALLOC_TRIM_THRESHOLD_=1e11)"),
    "default": ({}, "glibc malloc defaults"),
}


# ---- the network (built in the child) -----------------------------------------------------------

def build_net(kind):
    """The 6-conv CNN with norm `kind`: 'gn', 'gn_relu', 'affine', 'bn' or 'none'."""
    import mxnet as mx
    from mxnet import gluon
    import gn_mx

    class Affine(gluon.HybridBlock):
        """gn_channel_affine with (C,) gamma/beta: the cheapest gn_mx op."""

        def __init__(self, channels, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.gamma = self.params.get("gamma", shape=(channels,), init="ones")
                self.beta = self.params.get("beta", shape=(channels,), init="zeros")

        def hybrid_forward(self, F, x, gamma, beta):
            return F.gn_channel_affine(x, gamma, beta)

    def norm(c, relu_follows):
        """(norm block or None, whether the norm applies the following relu itself)."""
        if kind == "gn":
            return gn_mx.GroupNorm(num_groups=c // GROUP_SIZE, in_channels=c), False
        if kind == "gn_relu":
            if relu_follows:
                return gn_mx.GroupNorm(num_groups=c // GROUP_SIZE, in_channels=c,
                                       activation="relu"), True
            return gn_mx.GroupNorm(num_groups=c // GROUP_SIZE, in_channels=c), False
        if kind == "affine":
            return Affine(c), False
        if kind == "bn":
            return gluon.nn.BatchNorm(in_channels=c), False
        return None, False

    class Seq(gluon.HybridBlock):
        def __init__(self, layers, **kw):
            super().__init__(**kw)
            self.layers = []
            for i, l in enumerate(layers):
                self.register_child(l, "l%d" % i)
                self.layers.append(l)

        def hybrid_forward(self, F, x):
            for l in self.layers:
                x = l(x)
            return x

    def conv_norm(cin, cout, stride, relu):
        layers = [gluon.nn.Conv2D(cout, 3, strides=stride, padding=1, use_bias=kind == "none",
                                  in_channels=cin)]
        n, fused = norm(cout, relu)
        if n is not None:
            layers.append(n)
        if relu and not fused:
            layers.append(gluon.nn.Activation("relu"))
        return Seq(layers)

    class Block(gluon.HybridBlock):
        def __init__(self, cin, cout, stride, **kw):
            super().__init__(**kw)
            self.a = conv_norm(cin, cout, stride, True)
            self.b = conv_norm(cout, cout, 1, False)
            self.proj = (gluon.nn.Conv2D(cout, 1, strides=stride, in_channels=cin)
                         if (cin, stride) != (cout, 1) else None)

        def hybrid_forward(self, F, x):
            skip = self.proj(x) if self.proj is not None else x
            return F.relu(self.b(self.a(x)) + skip)

    net = gluon.nn.HybridSequential()
    net.add(conv_norm(3, 16, 2, True), Block(16, 16, 1), Block(16, 32, 2),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(10, in_units=32))
    net.initialize(mx.init.Xavier(magnitude=2.0))
    rng = mx.nd.random
    for name, p in net.collect_params().items():  # non-trivial norm parameters and statistics
        if name.endswith(("gamma", "running_var")):
            p.set_data(rng.uniform(0.5, 1.5, shape=p.shape))
        elif name.endswith(("beta", "running_mean")):
            p.set_data(rng.uniform(-0.2, 0.2, shape=p.shape))
    return net


def count_layers(net):
    """(convolutions, norm layers) in `net`."""
    from mxnet import gluon
    import gn_mx
    convs = norms = 0

    def walk(b):
        nonlocal convs, norms
        if isinstance(b, gluon.nn.Conv2D):
            convs += 1
        if isinstance(b, (gn_mx.GroupNorm, gluon.nn.BatchNorm)) or type(b).__name__ == "Affine":
            norms += 1
        for c in b._children.values():
            walk(c)
    walk(net)
    return convs, norms


# ---- the child: one allocator regime ------------------------------------------------------------

def child(args):
    import numpy as np
    import mxnet as mx
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import gn_mx
    from bench_group_norm import Timer

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    try:
        import onnxruntime as ort
    except ImportError:
        ort = None
    mx.random.seed(0)
    res = {"threads": threads, "cpus": os.cpu_count(),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (libgomp: spin, then sleep)"), "loadavg_start": os.getloadavg(), "mxnet": mx.__version__,
           "onnxruntime": getattr(ort, "__version__", None), "ms": {}, "max_abs_diff": {},
           "errors": {}}
    timer = Timer(args.min_sample_ms / 1e3, args.rounds, args.max_cell_s)
    tmp = tempfile.mkdtemp(prefix="gnmx_bench_inference_")
    try:
        for n in BATCHES:
            x_np = np.random.RandomState(n).uniform(-1, 1, (n, 3, 64, 64)).astype(np.float32)
            x = mx.nd.array(x_np)
            nets, refs = {}, {}
            rows = (("mx_gn", "gn"), ("mx_gn_relu", "gn_relu"), ("mx_affine", "affine"),
                    ("mx_bn_folded", "bn"), ("mx_none", "none"), ("mx_none_mkldnn", "none"))
            if args.part == "ort":  # only the references of the exported nets
                rows = (("mx_gn", "gn"), ("mx_bn_folded", "bn"))
            for row, kind in rows:
                mx.random.seed(1)  # the same conv weights in every net
                net = build_net(kind)
                net.hybridize(static_alloc=True, static_shape=True)
                refs[row] = net(x).asnumpy()
                if row.endswith(("_folded", "_mkldnn")) and args.part == "mx":
                    # MXNet's MKLDNN subgraph backend: BatchNorm folded into its conv, conv+relu
                    # and conv+sum fused (inference graphs)
                    net.optimize_for(x, backend="MKLDNN", static_alloc=True, static_shape=True)
                    res["max_abs_diff"]["%s/%d" % (row, n)] = float(
                        np.abs(net(x).asnumpy() - refs[row]).max())
                nets[row] = net
                if n == BATCHES[0]:
                    res.setdefault("layers", {})[row] = count_layers(net)
            fns = {}
            if args.part == "mx":
                res["max_abs_diff"]["mx_gn_relu/%d" % n] = float(
                    np.abs(refs["mx_gn_relu"] - refs["mx_gn"]).max())
                fns = {row: ((lambda net=nets[row]: net(x)), mx.nd.waitall) for row in MX_ROWS}
            elif ort is not None:
                for row, base in (("ort_gn", "mx_gn"), ("ort_bn", "mx_bn_folded")):
                    try:
                        sess = export_ort(ort, base, refs, x, tmp, threads, n)
                        inp = sess.get_inputs()[0].name
                        out = sess.run(None, {inp: x_np})[0]
                        res["max_abs_diff"]["%s/%d" % (row, n)] = float(np.abs(out - refs[base]).max())
                        fns[row] = ((lambda s=sess, i=inp: s.run(None, {i: x_np})), _nosync)
                    except Exception as e:  # noqa: BLE001 - report the row, keep the others
                        res["errors"]["%s/%d" % (row, n)] = "%s: %s" % (type(e).__name__, e)
            res["ms"][str(n)] = {k: (v * 1e3 if isinstance(v, float) else v)
                                 for k, v in timer.run(fns).items()}
    finally:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    json.dump(res, sys.stdout)


def _nosync():
    pass


def export_ort(ort, base, refs, x, tmp, threads, n):
    """Exports a fresh copy of net `base` (same seed, same parameters) to ONNX and opens it in an
    onnxruntime CPU session with `threads` intra-op threads."""
    import numpy as np
    import mxnet as mx
    import gn_mx.onnx
    mx.random.seed(1)
    net = build_net({"mx_gn": "gn", "mx_bn_folded": "bn"}[base])
    net.hybridize(static_alloc=True, static_shape=True)
    y = net(x).asnumpy()
    assert np.abs(y - refs[base]).max() == 0, "rebuilt net differs"
    prefix = os.path.join(tmp, "%s_%d" % (base, n))
    net.export(prefix)
    path = gn_mx.onnx.export_model(prefix + "-symbol.json", prefix + "-0000.params",
                                   in_shapes=[x.shape], in_types=[np.float32],
                                   onnx_file_path=prefix + ".onnx")
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


# ---- the parent: report ---------------------------------------------------------------------------

def merge(a, b):
    """One table's results from the MXNet child `a` and the onnxruntime child `b`."""
    out = dict(a)
    out["ms"] = {n: dict(a["ms"].get(n, {}), **b["ms"].get(n, {}))
                 for n in sorted(set(a["ms"]) | set(b["ms"]), key=int)}
    for k in ("max_abs_diff", "errors"):
        out[k] = dict(a.get(k, {}), **b.get(k, {}))
    out["loadavg_end"] = b["loadavg_end"]
    out["onnxruntime"] = b.get("onnxruntime")
    return out


DESCRIPTIONS = {
    "mx_gn": "MXNet, gn_mx GroupNorm",
    "mx_gn_relu": "MXNet, gn_mx GroupNorm(activation='relu')",
    "mx_affine": "MXNet, gn_channel_affine in the norm's place",
    "mx_bn_folded": "MXNet, BatchNorm folded into the convs (optimize_for MKLDNN)",
    "mx_none": "MXNet, no norm",
    "mx_none_mkldnn": "MXNet, no norm, optimize_for MKLDNN",
    "ort_gn": "onnxruntime, the gn_mx GroupNorm net exported to ONNX",
    "ort_bn": "onnxruntime, the BatchNorm net exported to ONNX",
}


def fmt(v):
    return "%.2f" % v if isinstance(v, float) else str(v)


def report(runs, args):
    lines = []
    for key, res in runs.items():
        name = key.split("/")[0]
        lines += ["## %d thread%s, regime `%s`: %s" % (
                      res["threads"], "s" if res["threads"] > 1 else "", name, REGIMES[name][1]), "",
                  "Threads: OMP_NUM_THREADS=%d for MXNet %s, onnxruntime %s with "
                  "intra_op_num_threads=%d (inter_op 1, sequential); OMP_WAIT_POLICY %s. Load "
                  "average %.1f at the start, %.1f at the end (1-minute)." % (
                      res["threads"], res["mxnet"], res["onnxruntime"], res["threads"],
                      res.get("omp_wait_policy", "unset"), res["loadavg_start"][0],
                      res["loadavg_end"][0]), "",
                  "| path | " + " | ".join("%d image%s (ms)" % (n, "s" if n > 1 else "")
                                          for n in BATCHES) + " |",
                  "| --- |" + " --- |" * len(BATCHES)]
        for row in MX_ROWS + ORT_ROWS:
            cells = [fmt(res["ms"][str(n)].get(row, res["errors"].get("%s/%d" % (row, n), "n/a")))
                     for n in BATCHES]
            lines.append("| `%s` %s | %s |" % (row, DESCRIPTIONS[row], " | ".join(cells)))
        lines += ["", "Largest absolute output difference against the reference net (checks that "
                  "each path computes the same function): " +
                  ", ".join("%s %.1e" % (k, v) for k, v in sorted(res["max_abs_diff"].items())) + ".",
                  ""]
        if res["errors"]:
            lines += ["Errors: " + "; ".join("%s: %s" % kv for kv in res["errors"].items()), ""]
        lines += conclusions(res)
    return "\n".join(lines)


def conclusions(res):
    """The reading of one regime's table, from its numbers: the fastest path per batch size, what
    a library op costs in the norm's place, and the GroupNorm kernel's own share."""
    norms = res.get("layers", {}).get("mx_gn", [6, 5])[1]
    out = ["Reading (computed from the table above):", ""]
    load = max(res["loadavg_start"][0], res["loadavg_end"][0])
    if res.get("cpus") and load > res["cpus"]:
        out += ["**Not reliable**: the load average (%.1f) exceeded the machine's %d cores while "
                "this table was measured; the differences below may be noise." % (
                    load, res["cpus"]), ""]
    for n in BATCHES:
        ms = {k: v for k, v in res["ms"][str(n)].items() if isinstance(v, float)}
        if not ms:
            continue
        best = min(ms, key=ms.get)
        gn = {k: ms[k] for k in ("mx_gn", "ort_gn") if k in ms}
        line = "- %d image%s: fastest `%s` (%.2f ms)" % (n, "s" if n > 1 else "", best, ms[best])
        if len(gn) == 2:
            r = gn["mx_gn"] / gn["ort_gn"]
            line += "; the GroupNorm net runs %.1fx %s in onnxruntime than in MXNet" % (
                r if r >= 1 else 1 / r, "faster" if r >= 1 else "slower")
        if "mx_bn_folded" in ms and "ort_gn" in ms:
            line += " and %s MXNet's BN-folded net (%.2f vs %.2f ms)" % (
                "beats" if ms["ort_gn"] < ms["mx_bn_folded"] else "does not beat",
                ms["ort_gn"], ms["mx_bn_folded"])
        gn_paths = {k: ms[k] for k in ("mx_gn", "mx_gn_relu", "ort_gn") if k in ms}
        if gn_paths:
            fast = min(gn_paths, key=gn_paths.get)
            line += "; of the GroupNorm paths, `%s` is fastest (%.2f ms)" % (fast, gn_paths[fast])
        if all(k in ms for k in ("mx_gn", "mx_affine", "mx_none")):
            line += ("; inside MXNet, a library op in each of the %d norm positions costs "
                     "%.2f ms per layer (`mx_affine` - `mx_none`), the GroupNorm math on top of "
                     "that %.2f ms per layer (`mx_gn` - `mx_affine`)" % (
                         norms, (ms["mx_affine"] - ms["mx_none"]) / norms,
                         (ms["mx_gn"] - ms["mx_affine"]) / norms))
        out.append(line + ".")
    out.append("")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(ap, "kept", out_help="write NAME.{md,json}: a bare NAME under benchmarks/results "
                    "(tracked: inference_cpu), an existing directory gets inference_cpu.{md,json}; "
                    "default: print only", thread_list=True)
    ap.add_argument("--note", default="", help="a sentence added to the result file (e.g. the "
                    "machine's load)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)),
                    help="batch sizes (default: %(default)s)")
    ap.add_argument("--part", choices=("mx", "ort"), help=argparse.SUPPRESS)  # the child's share
    args = ap.parse_args()
    BATCHES[:] = [int(b) for b in args.batches.split(",")]
    timing_defaults(args, quick=(7, 20.0, 8.0), full=(21, 50.0, 25.0))
    if args.child:
        return child(args)
    for r in args.regimes.split(","):
        if r not in REGIMES:
            ap.error("unknown regime %r (have: %s)" % (r, ", ".join(REGIMES)))
    runs = {}
    for threads in args.threads.split(","):
        args.threads = int(threads)
        # MXNet and onnxruntime in separate processes: neither's idle (spinning) thread pool runs
        # while the other is timed
        parts = [run_regimes(__file__, args, {k: v[0] for k, v in REGIMES.items()},
                             extra=["--batches", args.batches, "--part", part])
                 for part in ("mx", "ort")]
        for name in parts[0]:
            runs["%s/%dt" % (name, args.threads)] = merge(parts[0][name], parts[1][name])
    text = report(runs, args)
    print(text)
    if args.out is None:
        return
    write(result_stem(args.out, "inference_cpu"), runs, text, args)


WHY = """\
Why the GroupNorm net is slower in MXNet than the BN-folded one: MXNet runs its convolutions in
MKLDNN's blocked memory layout. An op outside MKLDNN, which every library (lib_api) op is, gets its
input reordered to the plain NCHW layout, and the next convolution reorders its output back: two
passes over the tensor per library op, plus lib_api's dispatch. `mx_affine` (the cheapest possible
library op) measures that round trip; the difference to `mx_gn` is the GroupNorm computation itself
(see the reading above). BatchNorm folded into the convolutions (`mx_bn_folded`) leaves no op in the
norm's place. onnxruntime runs the exported GroupNorm as standard ONNX ops inside its own optimized
graph, with no lib_api boundary (any layout conversion its optimizer keeps is in the measured time).
For CPU deployment of a gn_mx GroupNorm model, each table's reading names the fastest of the
GroupNorm paths (`mx_gn`, `mx_gn_relu`, `ort_gn`) at that thread count: onnxruntime avoids the
lib_api boundary altogether, and inside MXNet `GroupNorm(activation='relu')` saves the separate
ReLU.
"""


def write(stem, runs, text, args):
    """Writes stem.md (the report and why) and stem.json (the raw runs)."""
    write_results(stem, "Inference latency, CPU (`benchmarks/bench_inference.py`)",
                  "fp32; (N, 3, 64, 64) input into a 6-conv ResNet-style net with 5 norm layers; "
                  "every MXNet path hybridized with static_alloc and static_shape; medians of up to "
                  "%d interleaved samples per path.%s\n" % (
                      args.rounds, (" " + args.note) if args.note else ""),
                  text, {"note": args.note, "rounds": args.rounds, "runs": runs, "report": text},
                  tail=WHY)


if __name__ == "__main__":
    main()
