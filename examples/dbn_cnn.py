"""A small CNN with Decorrelated Batch Normalization: train, evaluate, export, reload.

    python examples/dbn_cnn.py [--steps 60] [--out examples/export/dbn_cnn]

Synthetic 2-class task (a bright quadrant decides the class), so it runs anywhere in seconds.
Shows the three things a DBN layer has to get right:
  * training (inside autograd.record()) whitens with batch statistics and updates the running ones;
  * evaluation (plain calls) uses the running statistics, also when the net is hybridized;
  * export writes the inference graph + parameters; a fresh `import gn_mx` reloads it.
"""
import argparse
import os
import warnings

import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx


def make_data(n, rng):
    x = rng.standard_normal((n, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, 2, n)
    x[y == 1, :, :8, :8] += 1.5  # class 1: bright top-left quadrant
    x[:, 1] += 0.8 * x[:, 0]     # correlated channels: what DBN decorrelates
    return mx.nd.array(x), mx.nd.array(y)


def build_net():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=4))   # groups of 4 channels
        net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.MaxPool2D(2))
        net.add(gluon.nn.Conv2D(32, 3, padding=1))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=2))   # groups of 16 channels
        net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.GlobalAvgPool2D())
        net.add(gluon.nn.Dense(2))
    return net


def accuracy(net, x, y):
    return float((net(x).argmax(axis=1) == y).mean().asscalar())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "export", "dbn_cnn"))
    args = p.parse_args()
    rng = np.random.default_rng(0)
    mx.random.seed(0)
    x_train, y_train = make_data(512, rng)
    x_test, y_test = make_data(256, rng)

    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 3e-3})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(args.steps):
        idx = rng.integers(0, len(y_train), args.batch)
        xb, yb = x_train[idx], y_train[idx]
        with autograd.record():                  # training mode: batch statistics
            loss = loss_fn(net(xb), yb).mean()
        loss.backward()
        trainer.step(1)
        if step % 20 == 0 or step == args.steps - 1:
            acc = accuracy(net, x_test, y_test)  # eval mode: running statistics
            print(f"step {step:3d}  loss {float(loss.asscalar()):.4f}  test acc {acc:.3f}")

    dbn = net[1]
    print("first DBN layer:", dbn)
    print("  running_projection", dbn.running_projection.shape,
          "(group 0 diagonal:", np.round(np.diag(dbn.running_projection.data()[0].asnumpy()), 3),
          ")")

    # Export after a training call: gn_mx still writes the inference graph.
    with autograd.record():
        net(x_train[:args.batch])
    expected = net(x_test).asnumpy()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    net.export(args.out)
    ops = {n["op"] for n in __import__("json").load(open(args.out + "-symbol.json"))["nodes"]}
    assert "gn_dbn_inference" in ops and "gn_dbn" not in ops, ops
    with warnings.catch_warnings():
        # MXNet 1.9 warns "Cannot decide type for the following arguments" on every import of
        # an exported model (its input has no stored dtype); float32 is what it then uses
        warnings.filterwarnings("ignore", message="Cannot decide type", category=UserWarning)
        reloaded = gluon.SymbolBlock.imports(args.out + "-symbol.json", ["data"],
                                             args.out + "-0000.params")
    err = np.abs(reloaded(x_test).asnumpy() - expected).max()
    print(f"exported to {args.out}-symbol.json / -0000.params; reload max |diff| = {err:.2e}")
    assert err < 1e-4
    print("OK")


if __name__ == "__main__":
    main()
