#!/usr/bin/env python
"""Speed-up of converting a ResNet-style model from MXNet's GroupNorm to gn_mx (issue 17).

    python benchmarks/bench_convert.py              # ~2 min; 2 threads
    python benchmarks/bench_convert.py --quick

The model: the ResNet-style CNN of bench_in_network.py (stride-2 stem, 3 stages of 2 basic blocks,
16/32/64 channels, 13 conv layers + dense, 13 norm layers) with MXNet's gluon.nn.GroupNorm(8) and
nn.Activation('relu') after the norms; trained 3 SGD steps, exported (symbol + params), fp32.
Contenders:
  exported  forward (inference) of the exported model as MXNet trained it      (SymbolBlock.imports)
            | converted: gn_mx.convert_symbol | converted + fused relu (--fuse-activation)
  gluon     training step (forward, softmax cross-entropy, backward, SGD) of the Gluon net:
            MXNet's layers | after gn_mx.convert | after gn_mx.convert(fuse_activation=True)
on (16, 3, 64, 64), hybridized with static_alloc. Each contender's output is checked against the
original before timing (max abs difference reported). Both allocator regimes (glibc defaults,
and freed memory kept: MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11), one
subprocess each, OMP_NUM_THREADS=--threads (2). Medians of interleaved samples.

Outputs: stdout; with --out DIR also DIR/convert_cpu.{md,json} (the tracked ones: --out benchmarks/results).
"""
import argparse
import json
import os
import sys
import tempfile

from _common import KEPT, add_timing_args, run_regimes, timing_defaults, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REGIMES = {"default": ({}, "glibc malloc defaults"), "kept": (KEPT, "freed memory kept")}
G = 8


def child(args):
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.gluon import nn
    import gn_mx
    from bench_group_norm import Timer

    mx.random.seed(0)
    rs = np.random.RandomState(0)

    def unit(cout):
        s = nn.HybridSequential()
        s.add(nn.GroupNorm(G), nn.Activation("relu"))
        return s

    class Basic(gluon.HybridBlock):
        def __init__(self, cin, cout, stride):
            super().__init__()
            with self.name_scope():
                self.c1 = nn.Conv2D(cout, 3, stride, 1, use_bias=False, in_channels=cin)
                self.n1 = unit(cout)
                self.c2 = nn.Conv2D(cout, 3, 1, 1, use_bias=False, in_channels=cout)
                self.n2 = nn.GroupNorm(G)
                self.proj = (nn.Conv2D(cout, 1, stride, use_bias=False, in_channels=cin)
                             if (stride != 1 or cin != cout) else None)

        def hybrid_forward(self, F, x):
            y = self.n2(self.c2(self.n1(self.c1(x))))
            return F.relu(y + (self.proj(x) if self.proj is not None else x))

    def resnet():
        net = nn.HybridSequential()
        with net.name_scope():
            net.add(nn.Conv2D(16, 3, 2, 1, use_bias=False, in_channels=3), unit(16))
            cin = 16
            for cout, stride in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
                net.add(Basic(cin, cout, stride))
                cin = cout
            net.add(nn.GlobalAvgPool2D(), nn.Flatten(), nn.Dense(10, in_units=64))
        return net

    lossf = gluon.loss.SoftmaxCrossEntropyLoss()
    x = mx.nd.array(rs.randn(16, 3, 64, 64))
    label = mx.nd.array(rs.randint(0, 10, size=16))

    def trained():
        mx.random.seed(0)
        net = resnet()
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=True, static_shape=True)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9})
        for _ in range(3):
            with autograd.record():
                loss = lossf(net(x), label)
            loss.backward()
            tr.step(16)
        return net

    W = mx.nd.waitall
    timer = Timer(args.min_sample_ms / 1e3, args.rounds, args.max_cell_s)
    out = {"threads": int(os.environ.get("OMP_NUM_THREADS", "0")),
           "env": {k: os.environ.get(k) for k in KEPT}, "loadavg_start": os.getloadavg(),
           "max_abs_diff": {}}

    # --- exported model
    base = trained()
    want = base(x).asnumpy()
    tmp = tempfile.mkdtemp()
    base.export(os.path.join(tmp, "orig"))
    sym, arg, aux = mx.model.load_checkpoint(os.path.join(tmp, "orig"), 0)
    blocks = {}
    for name, fuse in (("mxnet_groupnorm", None), ("converted", False),
                       ("converted_fused", True)):
        prefix = os.path.join(tmp, name)
        if fuse is None:
            s, a, b = sym, arg, aux
        else:
            s, a, b = gn_mx.convert_symbol(sym, arg, aux, fuse_activation=fuse)
        mx.model.save_checkpoint(prefix, 0, s, a, b)
        blk = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
        blk.hybridize(static_alloc=True, static_shape=True)
        out["max_abs_diff"]["exported_" + name] = float(np.abs(blk(x).asnumpy() - want).max())
        blocks[name] = (lambda blk=blk: blk(x), W)
    out["exported_fwd_s"] = timer.run(blocks)
    print(".", end="", file=sys.stderr, flush=True)

    # --- Gluon training step
    steps = {}
    for name, fuse in (("mxnet_groupnorm", None), ("converted", False),
                       ("converted_fused", True)):
        net = trained()
        if fuse is not None:
            gn_mx.convert(net, fuse_activation=fuse, sample=x)
            net.hybridize(static_alloc=True, static_shape=True)
        out["max_abs_diff"]["gluon_" + name] = float(np.abs(net(x).asnumpy() - want).max())
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})

        def st(net=net, tr=tr):
            with autograd.record():
                loss = lossf(net(x), label)
            loss.backward()
            tr.step(16)
        steps[name] = (st, W)
    out["gluon_step_s"] = timer.run(steps)
    out["loadavg_end"] = os.getloadavg()
    json.dump(out, sys.stdout)


def report(runs):
    lines = []
    for name, r in runs.items():
        lines += ["", "### %s (%s), %d threads, load average %.1f -> %.1f" % (
            name, REGIMES[name][1], r["threads"], r["loadavg_start"][0], r["loadavg_end"][0]), "",
            "| model | exported model forward (ms) | speed-up | Gluon training step (ms) | speed-up |",
            "| --- | --- | --- | --- | --- |"]
        f, s = r["exported_fwd_s"], r["gluon_step_s"]
        for k in ("mxnet_groupnorm", "converted", "converted_fused"):
            lines.append("| %s | %.2f | %.2fx | %.2f | %.2fx |" % (
                k, f[k] * 1e3, f["mxnet_groupnorm"] / f[k], s[k] * 1e3,
                s["mxnet_groupnorm"] / s[k]))
        lines += ["", "Max abs output difference vs the original (fp32): " + ", ".join(
            "%s %.1e" % kv for kv in r["max_abs_diff"].items())]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(ap, "default,kept")
    args = ap.parse_args()
    timing_defaults(args, quick=(3, 100.0, 10.0), full=(7, 200.0, 20.0))
    if args.child:
        return child(args)
    runs = run_regimes(__file__, args, {k: v[0] for k, v in REGIMES.items()})
    text = report(runs)
    print(text)
    if args.out is None:
        return
    write_results(os.path.join(args.out, "convert_cpu"),
                  "Converting MXNet GroupNorm models to gn_mx, CPU (`benchmarks/bench_convert.py`)",
                  "fp32; ResNet-style CNN (13 GroupNorm(8) layers) on 16x3x64x64; times are medians "
                  "of interleaved samples.", text, {"runs": runs, "report": text})


if __name__ == "__main__":
    main()
