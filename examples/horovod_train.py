"""Data-parallel training of a GroupNorm + DecorrelatedBatchNorm net with Horovod (one process per
rank; gradients averaged by Horovod's allreduce).

Every rank trains on its own data; `hvd.DistributedTrainer` keeps the weights identical. DBN's
running statistics are per rank: call `gn_mx.sync_running_stats(net, trainer)` on every rank
before export (it averages them with one Horovod allreduce), then export on rank 0.

Needs Horovod built with MXNet (docs/distributed.md; `GNMX_HOROVOD=1 bash dev.sh test` builds it).

    python examples/horovod_train.py --launch-local 2 --out DIR      # horovodrun on 127.0.0.1
    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py --out DIR
    horovodrun -np 8 -H host1:4,host2:4 python examples/horovod_train.py --out DIR   # two machines

DIR (default examples/export/horovod, git-ignored) receives rank 0's exported model
(model-symbol.json, model-0000.params) and, per rank, rank{r}.npz: its parameters, its DBN
statistics before and after the average, its weights after the first step, and a probe input with
the output of the trained net (rank{r}.npz is what tests/test_horovod.py checks).
"""
import argparse
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "export", "horovod")
ORDERS = ("horovod-first", "gn_mx-first", "by-rank")


def import_order(order):
    """The import order this process uses: 'by-rank' gives rank 0 horovod.mxnet first and the other
    ranks gn_mx first (Horovod loads its library RTLD_GLOBAL next to libmxnet's), so one run covers
    both orders."""
    if order != "by-rank":
        return order
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    return "horovod-first" if rank == 0 else "gn_mx-first"


def build_net(gluon, gn_mx):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gn_mx.GroupNorm(num_groups=4, in_channels=8),
            gluon.nn.Activation("relu"),
            gn_mx.DecorrelatedBatchNorm(group_size=4, in_channels=8, momentum=0.8),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(3, in_units=8))
    return net


def worker(args):
    order = import_order(args.import_order)
    if order == "horovod-first":
        import horovod.mxnet as hvd
        import gn_mx
    else:
        import gn_mx
        import horovod.mxnet as hvd
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mx.random.seed(rank)  # different initial weights on every rank: rank 0's are broadcast
    net = build_net(gluon, gn_mx)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.1, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.RandomState(100 + rank)  # every rank its own data
    for step in range(args.steps):
        x = mx.nd.array(rng.randn(args.batch, 3, 8, 8))
        y = mx.nd.array(rng.randint(0, 3, args.batch))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(args.batch)  # DistributedTrainer averages over ranks: the global-batch mean
        if step == 0:
            first = {f"step0_{i}": p.data().asnumpy()
                     for i, p in enumerate(net.collect_params().values())}
        print(f"rank {rank}/{size} ({order}) step {step} loss {loss.mean().asscalar():.4f}",
              flush=True)

    dbn = gn_mx.parallel.dbn_layers(net)
    before = {f"before_{i}_{k}": getattr(b, k).data().asnumpy() for i, b in enumerate(dbn)
              for k in ("running_mean", "running_projection")}
    # The one thing to call before export: every rank, same point (a collective operation).
    gn_mx.sync_running_stats(net, trainer)
    after = {f"after_{i}_{k}": getattr(b, k).data().asnumpy() for i, b in enumerate(dbn)
             for k in ("running_mean", "running_projection")}
    params = {f"param_{i}": p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
    probe = mx.nd.array(np.random.RandomState(7).randn(4, 3, 8, 8))
    os.makedirs(args.out, exist_ok=True)
    if rank == 0:
        net.export(os.path.join(args.out, "model"))
    np.savez(os.path.join(args.out, f"rank{rank}.npz"), **before, **after, **params, **first,
             probe=probe.asnumpy(), probe_out=net(probe).asnumpy(), size=size)
    print(f"rank {rank} done ({order})", flush=True)


def horovodrun_path():
    """horovodrun next to this interpreter (the venv's), else on PATH, else None."""
    local = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if os.path.exists(local):
        return local
    import shutil
    return shutil.which("horovodrun")


_MARK = "GNMX_HOROVOD_LAUNCH"


def _pids_with(marker):
    """Processes started by one launch: their environment holds GNMX_HOROVOD_LAUNCH=<marker>
    (horovodrun hands its environment to the ranks)."""
    needle = b"\0" + f"{_MARK}={marker}".encode() + b"\0"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in b"\0" + f.read() + b"\0":
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _stop(proc, marker):
    """Stop horovodrun's process group, then any process of this launch still alive."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
    deadline = time.monotonic() + 5
    while _pids_with(marker) and time.monotonic() < deadline:
        for pid in _pids_with(marker):  # processes of this launch only
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def launch_local(num_ranks, out, steps=3, batch=8, import_order="by-rank", timeout=120,
                 marker=None):
    """``horovodrun -np N -H localhost:N --gloo`` over the loopback interface, bounded by
    ``timeout`` seconds; returns (returncode, output). Every process it started is stopped on
    return, also on timeout or error (found by ``marker`` in their environment; default: unique)."""
    hvdrun = horovodrun_path()
    if hvdrun is None:
        raise FileNotFoundError("horovodrun not found: install Horovod (docs/distributed.md)")
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    cmd = [hvdrun, "-np", str(num_ranks), "-H", f"localhost:{num_ranks}", "--gloo",
           "--network-interface", "lo", "--start-timeout", str(max(10, timeout // 2)),
           sys.executable, os.path.abspath(__file__), "--out", out, "--steps", str(steps),
           "--batch", str(batch), "--import-order", import_order]
    marker = marker or f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, **{_MARK: marker})
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"horovodrun did not finish in {timeout} s")
        return proc.returncode, text
    finally:
        _stop(proc, marker)
        if proc.stdout:
            proc.stdout.close()


def cross_rank_differences(out, num_ranks):
    """Largest |rank r - rank 0| over the DBN statistics before and after sync_running_stats, and
    over the trainable weights."""
    import numpy as np
    w = [np.load(os.path.join(out, f"rank{r}.npz")) for r in range(num_ranks)]
    diff = {"before": 0.0, "after": 0.0, "weights": 0.0}
    for k in w[0].files:
        part = k.split("_")[0]
        key = {"before": "before", "after": "after", "param": "weights"}.get(part)
        if key is None:
            continue
        for r in range(1, num_ranks):
            d = np.abs(w[r][k].astype(np.float64) - w[0][k]).max()
            diff[key] = max(diff[key], float(d))
    return diff


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--import-order", choices=ORDERS, default="horovod-first")
    ap.add_argument("--launch-local", type=int, metavar="RANKS", default=0,
                    help="run RANKS ranks with horovodrun on 127.0.0.1 (Gloo)")
    ap.add_argument("--timeout", type=int, default=120, help="for --launch-local (seconds)")
    args = ap.parse_args()
    if args.launch_local:
        rc, text = launch_local(args.launch_local, args.out, args.steps, args.batch,
                                args.import_order, args.timeout)
        print(text, end="")
        if rc:
            sys.exit(rc)
        d = cross_rank_differences(args.out, args.launch_local)
        print(f"max |rank r - rank 0|: DBN statistics before sync {d['before']:.3e}, after "
              f"{d['after']:.3e}; weights {d['weights']:.3e}. Model: {args.out}/model-*")
    else:
        worker(args)


if __name__ == "__main__":
    main()
