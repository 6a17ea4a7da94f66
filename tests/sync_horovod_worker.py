"""One rank of the Horovod exactness check of SyncDecorrelatedBatchNorm(horovod=True), run by
tests/test_dbn_sync.py under ``horovodrun -np 2 --gloo``: each rank whitens its 4 samples with the
statistics of all ranks; its outputs, input gradients and running statistics must equal the matching
part of one DecorrelatedBatchNorm on the whole batch (float64), and the ranks' gamma/beta gradients
summed must equal that DBN's. Prints ``rank R ok`` (or raises)."""
import numpy as np

import mxnet as mx
import horovod.mxnet as hvd
from mxnet import autograd

import gn_mx


def run(cls, x, dy, whitening, **kw):
    blk = cls(num_groups=2, in_channels=x.shape[1], whitening=whitening, **kw)
    blk.initialize()
    blk.cast("float64")
    blk.gamma.set_data(mx.nd.array(1 + 0.1 * np.arange(x.shape[1]), dtype="float64"))
    xd = mx.nd.array(x, dtype="float64")
    xd.attach_grad()
    with autograd.record():
        y = blk(xd)
    y.backward(mx.nd.array(dy, dtype="float64"))
    return {"y": y.asnumpy(), "dx": xd.grad.asnumpy(), "dgamma": blk.gamma.grad(),
            "dbeta": blk.beta.grad(), "rm": blk.running_mean.data().asnumpy(),
            "rp": blk.running_projection.data().asnumpy()}


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.RandomState(0)
    x = rng.randn(4 * size, 4, 3)
    x[:, 1:] += 0.6 * x[:, :-1]
    dy = rng.randn(*x.shape)
    part = slice(4 * rank, 4 * rank + 4)
    for whitening in ("zca", "iternorm"):
        want = run(gn_mx.DecorrelatedBatchNorm, x, dy, whitening)
        got = run(gn_mx.SyncDecorrelatedBatchNorm, x[part], dy[part], whitening, horovod=True,
                  key=f"hvd_{whitening}")
        for k in ("y", "dx"):
            np.testing.assert_allclose(got[k], want[k][part], rtol=1e-9, atol=1e-11, err_msg=k)
        for k in ("rm", "rp"):
            np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-11, err_msg=k)
        for k in ("dgamma", "dbeta"):
            total = hvd.allreduce(got[k], average=False, name=f"check_{whitening}_{k}").asnumpy()
            np.testing.assert_allclose(total, want[k].asnumpy(), rtol=1e-9, atol=1e-11, err_msg=k)
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
