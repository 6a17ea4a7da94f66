#!/usr/bin/env python
"""What a norm layer costs inside a hybridized network on the CPU (gn_mx vs MXNet's own layers).

    python benchmarks/bench_in_network.py              # ~5 min; 2 threads
    python benchmarks/bench_in_network.py --quick      # fewer rounds

Two networks, hybridized (static_alloc), fp32, each with every norm layer in turn:
  sandwich  Conv2D(64, 3x3) -> norm -> Conv2D(64, 3x3) on (16, 64, 32, 32): forward (inference) and
            forward+backward (autograd.record + backward; no optimizer).
  resnet    a ResNet-style CNN on (16, 3, 64, 64), 10 classes: stride-2 stem conv (16 channels),
            3 stages of 2 basic blocks (conv-norm-relu-conv-norm + skip; 16/32/64 channels at
            32x32/16x16/8x8, stride 2 between stages, 1x1 projection shortcuts), global average
            pool, dense: 13 conv layers (+2 projections) + 1 dense, 13 norm layers. A training step =
            forward, softmax cross-entropy, backward, SGD(momentum) step; also forward alone.
  resnet128 the same CNN's training step on (16, 3, 128, 128) (4 MB activations in the first stage),
            gn_mx GroupNorm and BatchNorm only: where the allocator regime matters.
Norm layers (G = 32 groups in the sandwich, 8 in the resnet):
  gn_mx       gn_mx.GroupNorm(G)                   (this package)
  gn_mx_relu  gn_mx.GroupNorm(G, activation='relu') replacing GroupNorm + ReLU (resnet only, where
              a ReLU follows the norm)
  gluon_gn    gluon.nn.GroupNorm(G)                (MXNet's, per-group gamma/beta)
  bn          gluon.nn.BatchNorm()                 (MXNet's, MKLDNN kernel)
  dbn         gn_mx.DecorrelatedBatchNorm(C // 8)  (this package, groups of 8 channels)
  none        no norm layer (the sandwich: Conv -> Conv; the resnet: no norm): the network's floor,
              so (t - t_none) / t is the norm layer's share of the step
  relu        (sandwich only) a ReLU in the norm's place: an MKLDNN op, no layout change
  lib_affine  (sandwich only) gn_mx's per-channel affine (gn_channel_affine, one cheap pass through
              a library op): what any non-MKLDNN op in that position costs, i.e. the MKLDNN layout
              conversion around it plus the lib_api dispatch
Also timed alone, on the sandwich's activation shape: the gn_mx GroupNorm op (forward, and
forward+backward), to compare with its in-network cost.

Regimes (one subprocess each, 2 OpenMP threads): glibc malloc defaults (what users get: fresh large
outputs are page-faulted in every call) and glibc told to keep freed memory (MALLOC_ARENA_MAX=1
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11), both with MKLDNN on (MXNet's default), plus the
kept-memory regime with MXNET_MKLDNN_ENABLED=0 (no layout conversions at all, but MXNet's slower
non-MKLDNN convolutions). All contenders of a table are timed interleaved (round-robin), medians.

Outputs: stdout; with --out DIR also DIR/in_network_cpu.{md,json} (the tracked ones: --out benchmarks/results).
"""
import argparse
import json
import os
import sys

from _common import KEPT, add_timing_args, run_regimes, timing_defaults, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SANDWICH = ["gn_mx", "gluon_gn", "bn", "dbn", "relu", "lib_affine", "none"]
RESNET = ["gn_mx", "gn_mx_relu", "gluon_gn", "bn", "dbn", "none"]
RESNET_BIG = ["gn_mx", "bn"]
G_SANDWICH, G_RESNET = 32, 8

REGIMES = {
    "default": ({}, "glibc malloc defaults, MKLDNN on"),
    "kept": (KEPT, "glibc keeps freed memory, MKLDNN on"),
    "kept_nomkldnn": (dict(KEPT, MXNET_MKLDNN_ENABLED="0"), "glibc keeps freed memory, MKLDNN off"),
}


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
    np.random.seed(0)

    class Affine(gluon.HybridBlock):
        """gn_channel_affine with gamma=1, beta=0 (a cheap pass through a library op)."""

        def __init__(self, C):
            super().__init__()
            with self.name_scope():
                self.gamma = self.params.get("gamma", shape=(C,), init="ones")
                self.beta = self.params.get("beta", shape=(C,), init="zeros")

        def hybrid_forward(self, F, x, gamma, beta):
            return F.gn_channel_affine(x, gamma, beta)

    def norm(kind, C, G):
        if kind == "gn_mx":
            return gn_mx.GroupNorm(G, in_channels=C)
        if kind == "gn_mx_relu":
            return gn_mx.GroupNorm(G, in_channels=C, activation="relu")
        if kind == "gluon_gn":
            return nn.GroupNorm(G)
        if kind == "bn":
            return nn.BatchNorm(in_channels=C)
        if kind == "dbn":
            return gn_mx.DecorrelatedBatchNorm(C // 8, in_channels=C)
        if kind == "relu":
            return nn.Activation("relu")
        if kind == "lib_affine":
            return Affine(C)
        return None

    def sandwich(kind):
        net = nn.HybridSequential()
        net.add(nn.Conv2D(64, 3, padding=1, in_channels=64))
        m = norm(kind, 64, G_SANDWICH)
        if m is not None:
            net.add(m)
        net.add(nn.Conv2D(64, 3, padding=1, in_channels=64))
        return net

    def norm_relu(F, n, y, relu):
        """n(y) (where the net has a norm layer), then a ReLU unless n fuses it."""
        if n is not None:
            y = n(y)
        return F.relu(y) if relu else y

    class Basic(gluon.HybridBlock):
        def __init__(self, kind, cin, cout, stride):
            super().__init__()
            self.fused = kind == "gn_mx_relu"
            with self.name_scope():
                self.c1 = nn.Conv2D(cout, 3, stride, 1, use_bias=False, in_channels=cin)
                self.n1 = norm(kind, cout, G_RESNET)
                self.c2 = nn.Conv2D(cout, 3, 1, 1, use_bias=False, in_channels=cout)
                self.n2 = norm("gn_mx" if self.fused else kind, cout, G_RESNET)
                self.proj = (nn.Conv2D(cout, 1, stride, use_bias=False, in_channels=cin)
                             if (stride != 1 or cin != cout) else None)

        def hybrid_forward(self, F, x):
            y = norm_relu(F, self.n1, self.c1(x), not self.fused)
            y = self.c2(y)
            if self.n2 is not None:
                y = self.n2(y)
            return F.relu(y + (self.proj(x) if self.proj is not None else x))

    class ResNet(gluon.HybridBlock):
        def __init__(self, kind):
            super().__init__()
            self.fused = kind == "gn_mx_relu"
            with self.name_scope():
                self.stem = nn.Conv2D(16, 3, 2, 1, use_bias=False, in_channels=3)
                self.sn = norm(kind, 16, G_RESNET)
                self.blocks = nn.HybridSequential()
                cin = 16
                for cout, stride in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
                    self.blocks.add(Basic(kind, cin, cout, stride))
                    cin = cout
                self.head = nn.Dense(10, in_units=64)

        def hybrid_forward(self, F, x):
            y = norm_relu(F, self.sn, self.stem(x), not self.fused)
            y = self.blocks(y)
            return self.head(F.mean(y, axis=(2, 3)))

    W = mx.nd.waitall
    timer = Timer(args.min_sample_ms / 1e3, args.rounds, args.max_cell_s)
    out = {"threads": int(os.environ.get("OMP_NUM_THREADS", "0")), "env": {
        k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                                       "MXNET_MKLDNN_ENABLED")},
        "mkldnn": mx.runtime.Features().is_enabled("MKLDNN"), "loadavg_start": os.getloadavg()}

    parts = args.parts.split(",")
    lossf = gluon.loss.SoftmaxCrossEntropyLoss()
    label = mx.nd.array(np.random.randint(0, 10, size=16))

    # --- sandwich
    xs = mx.nd.random.normal(shape=(16, 64, 32, 32))
    dys = mx.nd.random.normal(shape=(16, 64, 32, 32))
    fwd, fb = {}, {}
    for kind in SANDWICH:
        net = sandwich(kind)
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=True, static_shape=True)
        x = xs.copy()
        x.attach_grad()

        def f(net=net):
            net(xs)

        def fbwd(net=net, x=x):
            with autograd.record():
                y = net(x)
            y.backward(dys)
        fwd[kind] = (f, W)
        fb[kind] = (fbwd, W)
    # the GroupNorm op alone on the activation shape
    g1, b1 = mx.nd.ones(64), mx.nd.zeros(64)
    xa = xs.copy()
    xa.attach_grad()
    g1.attach_grad()
    b1.attach_grad()
    fwd["gn_mx_op_alone"] = (lambda: mx.nd.gn_group_norm(xs, g1, b1, num_groups=G_SANDWICH), W)

    def op_fb():
        with autograd.record():
            y = mx.nd.gn_group_norm(xa, g1, b1, num_groups=G_SANDWICH)[0]
        y.backward(dys)
    fb["gn_mx_op_alone"] = (op_fb, W)
    if "sandwich" in parts:
        out["sandwich"] = {"shape": [16, 64, 32, 32], "fwd_s": timer.run(fwd), "fwdbwd_s": timer.run(fb)}
    print(".", end="", file=sys.stderr, flush=True)
    del fwd, fb

    def train_step(kind, x, static):
        """A fresh ResNet(kind) (Xavier init, hybridized) and one SGD training step on x."""
        net = ResNet(kind)
        net.initialize(mx.init.Xavier())
        net.hybridize(static_alloc=static, static_shape=static)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})

        def st():
            with autograd.record():
                loss = lossf(net(x), label)
            loss.backward()
            tr.step(16)
        return net, st

    # --- resnet training step
    xr = mx.nd.random.normal(shape=(16, 3, 64, 64))
    step, rf = {}, {}
    for kind in (RESNET if "resnet" in parts else []):
        net, st = train_step(kind, xr, static=True)

        def f(net=net):
            net(xr)
        step[kind] = (st, W)
        rf[kind] = (f, W)
    if "resnet" in parts:
        out["resnet"] = {"shape": [16, 3, 64, 64], "step_s": timer.run(step), "fwd_s": timer.run(rf)}
    print(".", end="", file=sys.stderr, flush=True)

    # --- the same CNN on 128x128 images (4 MB activations in the first stage): the allocator effect
    xb = mx.nd.random.normal(shape=(16, 3, 128, 128))
    big = {}
    for kind, static in [(k, s) for k in RESNET_BIG for s in (True, False)]:
        if "resnet128" not in parts:
            break
        big[kind + ("" if static else "_hybridize_plain")] = (train_step(kind, xb, static)[1], W)
    if "resnet128" in parts:
        out["resnet128"] = {"shape": [16, 3, 128, 128], "step_s": timer.run(big)}
    out["loadavg_end"] = os.getloadavg()
    json.dump(out, sys.stdout)


def ms(v):
    return "%.2f" % (v * 1e3) if isinstance(v, float) else str(v)[:30]


def ratio(a, b):
    return "%.2f" % (a / b) if isinstance(a, float) and isinstance(b, float) and b > 0 else "-"


def report(runs):
    lines = []
    for name, r in runs.items():
        lines += ["", "### %s (%s), %d threads, load average %.1f -> %.1f" % (
            name, REGIMES[name][1], r["threads"], r["loadavg_start"][0], r["loadavg_end"][0]), ""]
        sw = r.get("sandwich", {"shape": [16, 64, 32, 32], "fwd_s": {}, "fwdbwd_s": {}})
        f, fb = sw["fwd_s"], sw["fwdbwd_s"]
        if "sandwich" in r:
            lines += ["Conv -> norm -> Conv on %s (ms; share = (t - t_none) / t):" % "x".join(map(str, sw["shape"])), "",
                      "| middle | fwd | fwd+bwd | fwd+bwd / bn | share of fwd+bwd |", "| --- | --- | --- | --- | --- |"]
        for k in (SANDWICH + ["gn_mx_op_alone"]) if "sandwich" in r else []:
            share = "-"
            if k not in ("none", "gn_mx_op_alone") and isinstance(fb.get(k), float) and isinstance(fb.get("none"), float):
                share = "%.0f%%" % (100 * (fb[k] - fb["none"]) / fb[k])
            lines.append("| %s | %s | %s | %s | %s |" % (k, ms(f.get(k)), ms(fb.get(k)), ratio(fb.get(k), fb.get("bn")), share))
        rn = r.get("resnet", {"shape": [16, 3, 64, 64], "step_s": {}, "fwd_s": {}})
        st, rf = rn["step_s"], rn["fwd_s"]
        if "resnet" in r:
            lines += ["", "ResNet-style CNN (13 conv + dense) on %s: training step and forward (ms):" % "x".join(map(str, rn["shape"])), "",
                      "| norm | step | step / bn | norm share of step | fwd | fwd / bn |", "| --- | --- | --- | --- | --- | --- |"]
        for k in RESNET if "resnet" in r else []:
            share = "-"
            if k != "none" and isinstance(st.get(k), float) and isinstance(st.get("none"), float):
                share = "%.0f%%" % (100 * (st[k] - st["none"]) / st[k])
            lines.append("| %s | %s | %s | %s | %s | %s |" % (k, ms(st.get(k)), ratio(st.get(k), st.get("bn")), share,
                                                         ms(rf.get(k)), ratio(rf.get(k), rf.get("bn"))))
        if "resnet128" in r:
            b = r["resnet128"]["step_s"]
            lines += ["", "Same CNN on 16x3x128x128, training step (ms): " + ", ".join(
                "%s %s" % (k, ms(v)) for k, v in b.items())]
    # targets
    tl = ["", "Targets (issue 13):"]
    for name, r in runs.items():
        if "sandwich" not in r or "resnet" not in r:
            continue
        fb = r["sandwich"]["fwdbwd_s"]
        st = r["resnet"]["step_s"]
        a = fb.get("gn_mx") / fb.get("bn") if isinstance(fb.get("gn_mx"), float) else None
        b = st.get("gn_mx") / st.get("bn") if isinstance(st.get("gn_mx"), float) else None
        c = st.get("gn_mx_relu") / st.get("bn") if isinstance(st.get("gn_mx_relu"), float) else None
        tl.append("- %s: sandwich fwd+bwd GroupNorm/BatchNorm = %s (target <= 1.2: %s); training step "
                  "GroupNorm/BatchNorm = %s (target <= 1.1: %s), with the fused GroupNorm+ReLU %s" % (
                      name, "%.2f" % a if a else "-", "met" if a and a <= 1.2 else "NOT met",
                      "%.2f" % b if b else "-", "met" if b and b <= 1.1 else "NOT met",
                      "%.2f" % c if c else "-"))
    if "default" in runs and "kept" in runs:
        for net in ("resnet", "resnet128"):
            if net not in runs["default"] or net not in runs["kept"]:
                continue
            d, k = runs["default"][net]["step_s"], runs["kept"][net]["step_s"]
            for n in sorted(d):
                if isinstance(d.get(n), float) and isinstance(k.get(n), float):
                    tl.append("- allocator, %s: the %s training step takes %.1f ms with glibc defaults, %.1f ms "
                              "with freed memory kept (%.0f%% less)" % (net, n, d[n] * 1e3, k[n] * 1e3,
                                                                        100 * (1 - k[n] / d[n])))
    return "\n".join(lines + tl)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(ap, "default,kept,kept_nomkldnn")
    ap.add_argument("--suffix", default="", help="appended to the result file names")
    ap.add_argument("--parts", default="sandwich,resnet,resnet128")
    args = ap.parse_args()
    timing_defaults(args, quick=(3, 100.0, 15.0), full=(7, 250.0, 40.0))
    if args.child:
        return child(args)
    runs = run_regimes(__file__, args, {k: v[0] for k, v in REGIMES.items()},
                       extra=["--parts", args.parts])
    text = report(runs)
    print(text)
    if args.out is None:
        return
    write_results(os.path.join(args.out, "in_network_cpu%s" % args.suffix),
                  "Norm layers inside hybridized networks, CPU (`benchmarks/bench_in_network.py`)",
                  "fp32; times are medians of interleaved samples.", text,
                  {"runs": runs, "report": text})


if __name__ == "__main__":
    main()
