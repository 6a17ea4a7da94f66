"""Train a small CNN with GroupNorm and DecorrelatedBatchNorm for a few steps and export it for
the C predictor (predict.c) and for ONNX.

    python examples/deploy_c/export_model.py OUTDIR [--batch 4] [--steps 3]

writes OUTDIR/model-symbol.json, OUTDIR/model-0000.params (the inference graph with the running
statistics of the last training step), OUTDIR/input.f32 (a batch, raw float32) and
OUTDIR/python_output.txt (what MXNet's Python front end computes for it), then prints the
predict command line.
"""
import argparse
import os

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

import gn_mx

IN_SHAPE = (3, 8, 8)  # (C, H, W) of one sample


def build_net():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3, padding=1))
        net.add(gn_mx.GroupNorm(num_groups=4))
        net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.Conv2D(8, 3, padding=1))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=2, momentum=0.5))
        net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.GlobalAvgPool2D())
        net.add(gluon.nn.Dense(5))
    return net


def dbn_blocks(net):
    return [b for b in net._children.values() if isinstance(b, gn_mx.DecorrelatedBatchNorm)]


def train_and_export(prefix, batch=4, steps=3, seed=0):
    """Train `steps` SGD steps, export to `prefix`; returns a dict with the net, the input batch,
    MXNet's output for it, and each DBN layer's running statistics before and after the last step.
    """
    mx.random.seed(seed)
    rng = np.random.RandomState(seed)
    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.05})
    loss_fn = gluon.loss.L2Loss()
    before = None
    for step in range(steps):
        x = mx.nd.array(rng.randn(16, *IN_SHAPE).astype(np.float32) * 2 + 0.5)
        y = mx.nd.array(rng.randn(16, 5).astype(np.float32))
        if step == steps - 1:
            before = [(b.running_mean.data().asnumpy(), b.running_projection.data().asnumpy())
                      for b in dbn_blocks(net)]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)
    after = [(b.running_mean.data().asnumpy(), b.running_projection.data().asnumpy())
             for b in dbn_blocks(net)]
    data = rng.randn(batch, *IN_SHAPE).astype(np.float32)
    out = net(mx.nd.array(data)).asnumpy()  # inference: running statistics
    net.export(prefix)
    return {"net": net, "input": data, "output": out, "stats_before_last_step": before,
            "stats_after_last_step": after, "symbol": prefix + "-symbol.json",
            "params": prefix + "-0000.params"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    r = train_and_export(os.path.join(args.outdir, "model"), args.batch, args.steps)
    r["input"].tofile(os.path.join(args.outdir, "input.f32"))
    np.savetxt(os.path.join(args.outdir, "python_output.txt"), r["output"], fmt="%.9g")
    shape = " ".join(str(d) for d in r["input"].shape)
    print(f"exported {r['symbol']} and {r['params']}; input batch {r['input'].shape}")
    print("run (PREDICT = the program examples/deploy_c/build.sh built):")
    print(f"  PREDICT {gn_mx.library_path()} {r['symbol']} {r['params']} "
          f"{os.path.join(args.outdir, 'input.f32')} {shape}")


if __name__ == "__main__":
    main()
