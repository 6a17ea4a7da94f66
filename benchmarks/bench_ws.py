#!/usr/bin/env python
"""What Weight Standardization costs on the CPU: gn_mx.WSConv2D vs plain Conv2D vs a composed WS.

    flock /tmp/gnmx-bench.lock python benchmarks/bench_ws.py --out benchmarks/results   # ~3 min
    python benchmarks/bench_ws.py --quick

One child process (2 OpenMP threads with OMP_WAIT_POLICY=passive, glibc keeping freed memory:
MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1e11, MKLDNN on), every table timed interleaved
(round-robin), medians:

  step     the training step (forward, softmax cross-entropy, backward, SGD(momentum) update) of
           bench_in_network.py's ResNet-style CNN on (16, 3, 64, 64) (stride-2 stem, 3 stages of
           2 basic blocks at 16/32/64 channels, 1x1 projections, gn_mx.GroupNorm(8) after every
           conv, hybridized with static_alloc), with its 15 convolutions as
             plain     gluon.nn.Conv2D
             ws        gn_mx.WSConv2D (gn_weight_standardize on every forward)
             composed  Conv2D with the standardization in MXNet ops (mean, broadcast_sub, square,
                       mean, sqrt, broadcast_div), the way one writes WS without gn_mx
           Target: ws / plain <= 1.05.
  weights  the standardization alone, forward+backward over the same weights: each of the net's
           15 conv weights, and one (256, 256, 3, 3) weight (fan-in 2304, ResNet-50's widest 3x3),
           gn_mx op vs the composed ops (imperative, autograd).

Outputs: stdout; with --out DIR also DIR/ws_cpu{--suffix}.{md,json} (the tracked ones: ws_cpu.*,
2 threads, and ws_cpu_1t.* from --threads 1 --suffix _1t).
"""
import argparse
import json
import os
import sys

from _common import KEPT, add_timing_args, run_regimes, timing_defaults, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ["plain", "ws", "composed"]
EPS = 1e-6


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

    def composed_ws(F, w):
        """WS in MXNet's own ops: what a user writes without gn_mx."""
        axes = tuple(range(1, 4))
        d = F.broadcast_sub(w, F.mean(w, axis=axes, keepdims=True))
        var = F.mean(F.square(d), axis=axes, keepdims=True)
        return F.broadcast_div(d, F.sqrt(var + EPS))

    class ComposedWSConv2D(nn.Conv2D):
        def hybrid_forward(self, F, x, weight, bias=None):
            return super().hybrid_forward(F, x, composed_ws(F, weight), bias)

    def conv(kind, *a, **kw):
        if kind == "ws":
            return gn_mx.WSConv2D(*a, ws_eps=EPS, **kw)
        return (ComposedWSConv2D if kind == "composed" else nn.Conv2D)(*a, **kw)

    class Basic(gluon.HybridBlock):  # bench_in_network.py's basic block, conv class chosen
        def __init__(self, kind, cin, cout, stride):
            super().__init__()
            with self.name_scope():
                self.c1 = conv(kind, cout, 3, stride, 1, use_bias=False, in_channels=cin)
                self.n1 = gn_mx.GroupNorm(8, in_channels=cout)
                self.c2 = conv(kind, cout, 3, 1, 1, use_bias=False, in_channels=cout)
                self.n2 = gn_mx.GroupNorm(8, in_channels=cout)
                self.proj = (conv(kind, cout, 1, stride, use_bias=False, in_channels=cin)
                             if (stride != 1 or cin != cout) else None)

        def hybrid_forward(self, F, x):
            y = F.relu(self.n1(self.c1(x)))
            y = self.n2(self.c2(y))
            return F.relu(y + (self.proj(x) if self.proj is not None else x))

    class ResNet(gluon.HybridBlock):
        def __init__(self, kind):
            super().__init__()
            with self.name_scope():
                self.stem = conv(kind, 16, 3, 2, 1, use_bias=False, in_channels=3)
                self.sn = gn_mx.GroupNorm(8, in_channels=16)
                self.blocks = nn.HybridSequential()
                cin = 16
                for cout, stride in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
                    self.blocks.add(Basic(kind, cin, cout, stride))
                    cin = cout
                self.head = nn.Dense(10, in_units=64)

        def hybrid_forward(self, F, x):
            y = self.blocks(F.relu(self.sn(self.stem(x))))
            return self.head(F.mean(y, axis=(2, 3)))

    W = mx.nd.waitall
    timer = Timer(args.min_sample_ms / 1e3, args.rounds, args.max_cell_s)
    out = {"threads": int(os.environ.get("OMP_NUM_THREADS", "0")), "env": {
        k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_",
                                       "MALLOC_TRIM_THRESHOLD_", "MXNET_MKLDNN_ENABLED",
                                       "OMP_WAIT_POLICY")},
        "mkldnn": mx.runtime.Features().is_enabled("MKLDNN"), "loadavg_start": os.getloadavg()}

    lossf = gluon.loss.SoftmaxCrossEntropyLoss()
    label = mx.nd.array(np.random.randint(0, 10, size=16))
    x = mx.nd.random.normal(shape=(16, 3, 64, 64))
    # one set of initial parameters for all three nets (the same weights, the same step)
    nets, steps = {}, {}
    for kind in KINDS:
        net = ResNet(kind)
        net.initialize(mx.init.Xavier())
        nets[kind] = net
    base = nets["plain"]._collect_params_with_prefix()  # structural names: 'stem.weight', ...
    for kind in KINDS:
        for n, p in nets[kind]._collect_params_with_prefix().items():
            if n in base:  # all but the WS gains (ones)
                p.set_data(base[n].data())
    outs = {}
    for kind in KINDS:
        net = nets[kind]
        net.hybridize(static_alloc=True, static_shape=True)
        outs[kind] = net(x).asnumpy()
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})

        def st(net=net, tr=tr):
            with autograd.record():
                loss = lossf(net(x), label)
            loss.backward()
            tr.step(16)
        steps[kind] = (st, W)
    # the two WS nets compute the same function of the same weights
    out["ws_vs_composed_max_rel_diff"] = float(np.abs(outs["ws"] - outs["composed"]).max()
                                               / np.abs(outs["composed"]).max())
    out["step_s"] = timer.run(steps)
    print(".", end="", file=sys.stderr, flush=True)

    # the standardization alone, forward+backward, on the same weights
    def ws_fb(weights, use_gn_mx):
        gains = [mx.nd.ones(w.shape[0]) for w in weights]
        for w in weights:
            w.attach_grad()

        def f():
            with autograd.record():
                if use_gn_mx:
                    ys = [mx.nd.gn_weight_standardize(w, g, eps=EPS)[0] for w, g in zip(weights, gains)]
                else:
                    ys = [composed_ws(mx.nd, w) for w in weights]
            autograd.backward(ys)
        return f
    net_w = [p.data().copy() for n, p in sorted(nets["plain"].collect_params().items())
             if p.data().ndim == 4]
    big = [mx.nd.random.normal(shape=(256, 256, 3, 3)) * 0.02]
    alone = {}
    for label_, ws_ in (("net_weights", net_w), ("w256x256x3x3", big)):
        alone[label_] = timer.run({"gn_mx": (ws_fb([w.copy() for w in ws_], True), W),
                                   "composed": (ws_fb([w.copy() for w in ws_], False), W)})
    out["weights_s"] = alone
    out["n_conv_weights"] = len(net_w)
    out["loadavg_end"] = os.getloadavg()
    json.dump(out, sys.stdout)


def ms(v):
    return "%.3f" % (v * 1e3) if isinstance(v, float) else str(v)[:40]


def report(r):
    st = r["step_s"]
    lines = ["", "%d thread(s), load average %.1f -> %.1f (1-min; the machine is shared)" % (
        r["threads"], r["loadavg_start"][0], r["loadavg_end"][0]), "",
        "Training step of the ResNet-style CNN (15 convs, gn_mx.GroupNorm) on 16x3x64x64 (ms):", "",
        "| convolutions | step | / plain |", "| --- | --- | --- |"]
    for k in KINDS:
        rel = "%.3f" % (st[k] / st["plain"]) if isinstance(st.get(k), float) else "-"
        lines.append("| %s | %s | %s |" % (k, ms(st.get(k)), rel))
    lines += ["", "WS net vs composed-WS net on the same weights: max relative output difference "
              "%.1e" % r["ws_vs_composed_max_rel_diff"], "",
              "The standardization alone, forward+backward (ms):", "",
              "| weights | gn_mx | composed | composed / gn_mx |", "| --- | --- | --- | --- |"]
    for name, t in r["weights_s"].items():
        what = ("the net's %d conv weights" % r["n_conv_weights"]) if name == "net_weights" else name
        rel = ("%.2f" % (t["composed"] / t["gn_mx"])
               if isinstance(t.get("gn_mx"), float) and isinstance(t.get("composed"), float) else "-")
        lines.append("| %s | %s | %s | %s |" % (what, ms(t.get("gn_mx")), ms(t.get("composed")), rel))
    a = st.get("ws", 0) / st["plain"] if isinstance(st.get("ws"), float) else None
    lines += ["", "Target: WS step / plain step <= 1.05: %s (%.3f)" % (
        "met" if a is not None and a <= 1.05 else "NOT met", a or float("nan"))]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_timing_args(ap, "kept")
    ap.add_argument("--suffix", default="", help="appended to the result file names")
    args = ap.parse_args()
    timing_defaults(args, quick=(3, 100.0, 15.0), full=(9, 250.0, 40.0))
    if args.child:
        return child(args)
    import subprocess
    up_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    runs = run_regimes(__file__, args, {"kept": dict(KEPT, OMP_WAIT_POLICY="passive")})
    r = runs["kept"]
    text = report(r)
    print(text)
    if args.out is None:
        return
    import platform
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True,
                         text=True).stdout.strip()
    about = ("%s; nproc %d; %s; python %s; OMP_NUM_THREADS=%d, OMP_WAIT_POLICY=passive, glibc "
             "keeps freed memory; one run, contenders interleaved; uptime before: %s" % (
                 cpu, os.cpu_count(), platform.platform(), platform.python_version(), args.threads,
                 up_before))
    write_results(os.path.join(args.out, "ws_cpu%s" % args.suffix),
                  "Weight Standardization, CPU (`benchmarks/bench_ws.py`)", about, text,
                  {"runs": runs, "cpu": cpu, "nproc": os.cpu_count()})


if __name__ == "__main__":
    main()
