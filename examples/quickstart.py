"""gn_mx quickstart: GroupNorm (+ Decorrelated BN) in a hybridized CNN, one training step,
export, and reload in a fresh process that only does `import gn_mx` first.

Run from the repository root after set-up (`bash dev.sh demo` does both).
"""
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon

import gn_mx


def build_net():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(32, 3, padding=1))
        net.add(gn_mx.GroupNorm(num_groups=8))            # per-channel gamma/beta, C inferred
        net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.Conv2D(32, 3, padding=1, strides=2))
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=4))  # ZCA whitening, groups of 8 channels
        net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.GlobalAvgPool2D())
        net.add(gluon.nn.Dense(10))
    return net


def main():
    mx.random.seed(0)
    np.random.seed(0)
    print(f"gn_mx {gn_mx.__version__}, MXNet {mx.__version__}, library {gn_mx.library_path()}")
    net = build_net()
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    x = mx.nd.random.normal(shape=(8, 3, 16, 16))
    label = mx.nd.array(np.random.randint(0, 10, size=8))
    for step in range(3):
        with autograd.record():
            loss = loss_fn(net(x), label).mean()
        loss.backward()
        trainer.step(1)
        print(f"training step {step}: loss {loss.asscalar():.4f}")

    y = net(x).asnumpy()  # inference mode (running statistics for DBN)
    tmp = tempfile.mkdtemp(prefix="gn_mx_quickstart_")
    prefix = os.path.join(tmp, "net")
    net.export(prefix, epoch=0)
    np.save(os.path.join(tmp, "x.npy"), x.asnumpy())
    print(f"exported {prefix}-symbol.json / {prefix}-0000.params")

    code = textwrap.dedent(f"""
        import warnings; warnings.filterwarnings("ignore", "Cannot decide type")
        import numpy as np, mxnet as mx
        import gn_mx  # registers the ops; nothing else is needed to reload
        from mxnet import gluon
        net = gluon.SymbolBlock.imports({prefix + '-symbol.json'!r}, ['data'],
                                        {prefix + '-0000.params'!r})
        np.save({os.path.join(tmp, 'y_reloaded.npy')!r},
                net(mx.nd.array(np.load({os.path.join(tmp, 'x.npy')!r}))).asnumpy())
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    y2 = np.load(os.path.join(tmp, "y_reloaded.npy"))
    err = float(np.abs(y - y2).max())
    ok = err < 1e-5
    print(f"reloaded in a fresh process: max |diff| = {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    sys.exit(main())
