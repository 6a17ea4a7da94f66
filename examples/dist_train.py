"""Distributed data-parallel training of a GroupNorm + DecorrelatedBatchNorm net with MXNet's own
`dist_sync` kvstore (ps-lite): one process per worker, plus a scheduler and server(s).

Each worker trains on its own data; gradients are summed by the servers, so all workers keep the
same weights. DBN's running statistics are per worker; `gn_mx.sync_running_stats(net, trainer)`
averages them through the kvstore before export, so every worker exports the same model.

Run on one machine (127.0.0.1, 2 workers): `python examples/dist_train.py --launch-local 2`.
Across machines, start on every node the processes below with the same DMLC_PS_ROOT_URI (the
scheduler's address) and DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER:

    DMLC_ROLE=scheduler python -c "import mxnet"          # one, on the DMLC_PS_ROOT_URI host
    DMLC_ROLE=server    python -c "import mxnet"          # DMLC_NUM_SERVER of them
    DMLC_ROLE=worker    python examples/dist_train.py --out DIR   # DMLC_NUM_WORKER of them

(MXNet's tools/launch.py from the source tree does the same over ssh.) A worker writes
DIR/worker{rank}-symbol.json / -0000.params (the exported model) and DIR/worker{rank}.npz (its
parameters, and its DBN statistics before and after the average).
"""
import argparse
import os
import socket
import subprocess
import sys
import time


# Default output directory: under examples/export/ (git-ignored); --out names another.
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "export", "dist")

def build_net(gluon, gn_mx):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gn_mx.GroupNorm(num_groups=4, in_channels=8),
            gluon.nn.Activation("relu"),
            gn_mx.DecorrelatedBatchNorm(group_size=4, in_channels=8, momentum=0.8),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(3, in_units=8))
    return net


def worker(args):
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon
    import gn_mx

    kv = mx.kv.create("dist_sync")
    rank, workers = kv.rank, kv.num_workers
    mx.random.seed(rank)  # different initial weights: rank 0's are broadcast
    net = build_net(gluon, gn_mx)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    # update_on_kvstore=False: the servers only sum (gradients, then the DBN statistics);
    # every worker applies the same update to the same weights.
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                            kvstore=kv, update_on_kvstore=False)
    # Broadcast rank 0's weights before the first step (MXNet 1.9.1 race, see init_kvstore).
    gn_mx.parallel.init_kvstore(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(100 + rank)  # each worker its own data
    for step in range(args.steps):
        x = mx.nd.array(rng.randn(args.batch, 3, 8, 8))
        y = mx.nd.array(rng.randint(0, 3, args.batch))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch * workers)  # the mean over the global batch
        if step == 0:
            first = {f"step0_{i}": p.data().asnumpy()
                     for i, p in enumerate(net.collect_params().values())}
        print(f"worker {rank} step {step} loss {loss.mean().asscalar():.4f}", flush=True)
    dbn = gn_mx.parallel.dbn_layers(net)
    before = {f"before_{i}_{k}": getattr(b, k).data().asnumpy() for i, b in enumerate(dbn)
              for k in ("running_mean", "running_projection")}
    gn_mx.sync_running_stats(net, trainer)  # collective: every worker calls it
    after = {f"after_{i}_{k}": getattr(b, k).data().asnumpy() for i, b in enumerate(dbn)
             for k in ("running_mean", "running_projection")}
    params = {f"param_{i}": p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
    os.makedirs(args.out, exist_ok=True)
    net.export(os.path.join(args.out, f"worker{rank}"))
    np.savez(os.path.join(args.out, f"worker{rank}.npz"), **before, **after, **params, **first)
    print(f"worker {rank} done", flush=True)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(num_workers, out, steps=3, batch=8, timeout=120):
    """Scheduler + 1 server + `num_workers` workers on 127.0.0.1; returns the workers' outputs.
    Every process is stopped on return (terminated, then killed), also on timeout or error."""
    base = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(free_port()),
                DMLC_NUM_SERVER="1", DMLC_NUM_WORKER=str(num_workers),
                DMLC_NODE_HOST="127.0.0.1", DMLC_INTERFACE="lo", PS_VERBOSE="0")
    base.setdefault("OMP_NUM_THREADS", "1")
    procs = []

    def start(role, cmd):
        p = subprocess.Popen(cmd, env=dict(base, DMLC_ROLE=role), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        return p

    try:
        start("scheduler", [sys.executable, "-c", "import mxnet"])
        start("server", [sys.executable, "-c", "import mxnet"])
        workers = [start("worker", [sys.executable, os.path.abspath(__file__), "--out", out,
                                    "--steps", str(steps), "--batch", str(batch)])
                   for _ in range(num_workers)]
        deadline = time.monotonic() + timeout
        outputs = []
        for w in workers:
            try:
                text, _ = w.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"dist_train: a worker did not finish in {timeout} s")
            outputs.append((w.returncode, text))
        for p in procs[:2]:  # scheduler and server stop once the workers have finalized
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return outputs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="output directory (default: %(default)s, ignored by git)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--launch-local", type=int, metavar="WORKERS", default=0,
                    help="start scheduler, server and WORKERS workers on 127.0.0.1")
    args = ap.parse_args()
    if args.launch_local:
        for rc, text in launch_local(args.launch_local, args.out, args.steps, args.batch):
            print(text, end="")
            if rc:
                sys.exit(rc)
    else:
        worker(args)


if __name__ == "__main__":
    main()
