"""Why GroupNorm / Decorrelated BN: validation accuracy vs per-device batch size, fp32 and AMP fp16.

Trains the same small CNN on scikit-learn's handwritten digits (1,797 8x8 images that ship inside
the scikit-learn wheel: nothing is downloaded) with five normalization layers

    BatchNorm             gluon.nn.BatchNorm (batch statistics; running statistics at test time)
    GroupNorm (MXNet)     gluon.nn.GroupNorm (MXNet 1.x built-in: per-*group* gamma/beta)
    GroupNorm (gn_mx)     gn_mx.GroupNorm (per-channel gamma/beta, as in the paper)
    DBN ZCA (gn_mx)       gn_mx.DecorrelatedBatchNorm (group-wise ZCA whitening of the batch)
    DBN IterNorm (gn_mx)  gn_mx.DecorrelatedBatchNorm(whitening='iternorm', iterations=5)
                          (Newton-iteration whitening, Huang et al. CVPR 2019)
    GroupNorm + WS        gn_mx.GroupNorm after gn_mx.WSConv2D convolutions (Weight
                          Standardization, Qiao et al. 2019); not in the default --norms, see below
    SyncDBN ZCA (gn_mx)   gn_mx.SyncDecorrelatedBatchNorm: DBN whitening with the statistics of
                          every device's batch (--devices N); not in the default --norms, see below

at per-device batch sizes 2, 4, 8 and 32, in float32 and with AMP float16, and reports validation
accuracy and the mean time of one training step (forward, backward, update; wall clock, including
the small per-step loss read-back): the shape of Figure 1 of the Group Normalization paper (Wu &
He, 2018). Every run sees the same number of samples (fixed epochs) with the learning rate scaled
linearly with batch size.

AMP: on a GPU, plain ``amp.init()``. On CPU MXNet 1.9.1 has no float16 gemm, so
``amp.init(**gn_mx.amp.cpu_init_kwargs())`` keeps Convolution/FullyConnected in float32; gn_mx's
GroupNorm then still runs in float16 (fp32 accumulation) and DBN in float32, as on a GPU. Nets are
hybridized (MXNet 1.9.1's imperative AMP casts do not handle float16 -> float32 on CPU).

    python examples/train_small_batch.py            # full run (10-25 min on 2 CPU cores)
    python examples/train_small_batch.py --quick    # smoke run (< 2 min on 2 CPU cores)

The Weight Standardization table (examples/results/small_batch_ws.*, docs/guide/weight_standardization.md):

    python examples/train_small_batch.py --norms batchnorm groupnorm_gn_mx groupnorm_ws_gn_mx \
        dbn_gn_mx --batch-sizes 1 2 32 --precisions fp32 --name small_batch_ws --out examples/results

Synchronized DBN (docs/guide/dbn_sync.md): N in-process cpu devices (--devices, the Gluon
split_and_load loop; batch sizes are then per device, the learning rate follows the total N x bs):

    python examples/train_small_batch.py --devices 4 --norms groupnorm_gn_mx dbn_gn_mx syncdbn_gn_mx \
        --batch-sizes 1 2 --precisions fp32 --epochs 4 --seeds 0 1 2 --name small_batch_sync \
        --out examples/results

Writes ``small_batch[_quick].{json,md,png}`` under ``--out`` (default examples/export/results/, ignored
by git; the tracked results are in examples/results/).
"""
import argparse
import json
import os
import sys
import time

# Tiny tensors: one OpenMP thread per op is faster than several (set before MXNet loads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxnet.contrib import amp  # noqa: E402

import gn_mx  # noqa: E402

NORMS = ("batchnorm", "groupnorm_mxnet", "groupnorm_gn_mx", "groupnorm_ws_gn_mx", "dbn_gn_mx",
         "dbn_iternorm_gn_mx", "syncdbn_gn_mx")
DEFAULT_NORMS = tuple(n for n in NORMS if n not in ("groupnorm_ws_gn_mx", "syncdbn_gn_mx"))
LABELS = {"batchnorm": "BatchNorm", "groupnorm_mxnet": "GroupNorm (MXNet built-in)",
          "groupnorm_gn_mx": "GroupNorm (gn_mx)", "groupnorm_ws_gn_mx": "GroupNorm + WS (gn_mx)",
          "dbn_gn_mx": "DBN ZCA (gn_mx)", "dbn_iternorm_gn_mx": "DBN IterNorm (gn_mx)",
          "syncdbn_gn_mx": "SyncDBN ZCA (gn_mx)"}
COLORS = {"batchnorm": "tab:blue", "groupnorm_mxnet": "tab:gray", "groupnorm_gn_mx": "tab:orange",
          "groupnorm_ws_gn_mx": "tab:purple", "dbn_gn_mx": "tab:green",
          "dbn_iternorm_gn_mx": "tab:red", "syncdbn_gn_mx": "tab:olive"}
PRECISIONS = ("fp32", "amp")
BATCH_SIZES = (2, 4, 8, 32)
CHANNELS = (16, 32, 64, 64)
STRIDES = (1, 2, 2, 2)   # 8x8 -> 8x8 -> 4x4 -> 2x2 -> 1x1
GN_GROUP_SIZE = 4   # channels per group for GroupNorm: 4 and 8 groups
DBN_GROUP_SIZE = 8  # channels per whitening group for DBN
ITERNORM_ITERATIONS = 5  # Newton steps of IterNorm (the paper's default)


# ------------------------------------------------------------------------------------------------
# Progress bar: tqdm when installed, else a minimal one on stderr

class _SimpleBar:
    def __init__(self, total, desc, disable=False):
        self.total, self.desc, self.n, self.disable = total, desc, 0, disable
        self.postfix = ""
        self._last = -1

    def update(self, k=1):
        self.n += k
        pct = int(100 * self.n / max(self.total, 1))
        if not self.disable and (pct != self._last or self.n == self.total):
            self._last = pct
            filled = pct * 30 // 100
            sys.stderr.write(f"\r{self.desc} [{'#' * filled}{'.' * (30 - filled)}] {pct:3d}% "
                             f"{self.postfix}")
            sys.stderr.flush()

    def set_postfix_str(self, s):
        self.postfix = s

    def close(self):
        if not self.disable:
            sys.stderr.write("\n")
            sys.stderr.flush()


def progress(total, desc, disable):
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc, disable)
    return tqdm(total=total, desc=desc, disable=disable, leave=False, dynamic_ncols=True,
                file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Data and model

def load_data(quick, seed=0):
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        sys.exit("train_small_batch.py needs scikit-learn for its data set: pip install 'scikit-learn<1.4'")
    digits = load_digits()
    x = digits.images.astype(np.float32)[:, None] / 16.0       # (1797, 1, 8, 8)
    y = digits.target.astype(np.float32)
    perm = np.random.RandomState(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    n_val = 360
    x_tr, y_tr, x_va, y_va = x[n_val:], y[n_val:], x[:n_val], y[:n_val]
    if quick:
        x_tr, y_tr = x_tr[:384], y_tr[:384]
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_va - mean) / std, y_va


def make_norm(kind, channels, devices=1):
    if kind == "batchnorm":
        return gluon.nn.BatchNorm()
    if kind == "groupnorm_mxnet":
        return gluon.nn.GroupNorm(num_groups=channels // GN_GROUP_SIZE)
    if kind in ("groupnorm_gn_mx", "groupnorm_ws_gn_mx"):
        return gn_mx.GroupNorm(num_groups=channels // GN_GROUP_SIZE)
    if kind == "dbn_gn_mx":
        return gn_mx.DecorrelatedBatchNorm(num_groups=channels // DBN_GROUP_SIZE)
    if kind == "dbn_iternorm_gn_mx":
        return gn_mx.DecorrelatedBatchNorm(num_groups=channels // DBN_GROUP_SIZE,
                                           whitening="iternorm", iterations=ITERNORM_ITERATIONS)
    if kind == "syncdbn_gn_mx":
        return gn_mx.SyncDecorrelatedBatchNorm(num_devices=devices,
                                               num_groups=channels // DBN_GROUP_SIZE)
    raise ValueError(f"unknown normalization {kind!r}")


def make_net(kind, devices=1):
    """conv-norm-relu x4 (8x8 -> 8x8 -> 4x4 -> 2x2 -> 1x1), global average pool, linear classifier.

    The last stage is 1x1, so there BatchNorm's statistics at batch size b come from b numbers per
    channel (as in detection/segmentation heads, or any late stage with small per-device batches);
    GroupNorm's come from the channels of one sample and do not depend on b. With
    "groupnorm_ws_gn_mx" the convolutions are gn_mx.WSConv2D (weights standardized per filter).
    """
    conv = gn_mx.WSConv2D if kind == "groupnorm_ws_gn_mx" else gluon.nn.Conv2D
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        for c, s in zip(CHANNELS, STRIDES):
            net.add(conv(c, 3, padding=1, strides=s, use_bias=False))
            net.add(make_norm(kind, c, devices))
            net.add(gluon.nn.Activation("relu"))
        net.add(gluon.nn.GlobalAvgPool2D())
        net.add(gluon.nn.Dense(10))
    return net


# ------------------------------------------------------------------------------------------------
# Training

def evaluate(net, x, y, ctx, batch=120):
    ctx = ctx[0] if isinstance(ctx, list) else ctx
    correct = 0
    for i in range(0, len(x), batch):  # inference mode: BN/DBN use their running statistics
        out = net(mx.nd.array(x[i:i + batch], ctx=ctx))
        correct += int((out.argmax(axis=1).asnumpy() == y[i:i + batch]).sum())
    return correct / len(x)


def train_step(net, loss_fn, trainer, x, y, ctx, precision):
    """Forward and backward of one step (the Trainer's update is the caller's); returns the loss
    (the first device's with several: the split_and_load loop, the Trainer sums the gradients)."""
    if isinstance(ctx, list):
        xs, ys = gluon.utils.split_and_load(x, ctx), gluon.utils.split_and_load(y, ctx)
        with autograd.record():
            losses = [loss_fn(net(xb), yb) for xb, yb in zip(xs, ys)]
        autograd.backward(losses)
        return losses[0]
    xb, yb = mx.nd.array(x, ctx=ctx), mx.nd.array(y, ctx=ctx)
    with autograd.record():
        loss = loss_fn(net(xb), yb)
        if precision == "amp":
            with amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        else:
            loss.backward()
    return loss


def train_one(kind, precision, batch_size, data, args, ctx, seed=None):
    x_tr, y_tr, x_va, y_va = data
    seed = args.seed if seed is None else seed
    mx.random.seed(seed)
    rng = np.random.RandomState(seed)
    net = make_net(kind, args.devices)
    net.initialize(mx.init.Xavier(magnitude=2.0), ctx=ctx)
    # Several devices: plain hybridize() (small_batch_sync.* ran so; static_alloc works as well)
    net.hybridize(**({} if args.devices > 1 else {"static_alloc": True, "static_shape": True}))
    batch_size = batch_size * args.devices  # per-device batch sizes: the step's total from here
    lr = args.base_lr * batch_size / 32.0  # linear scaling rule (Goyal et al.), as in the GN paper
    steps_per_epoch = len(x_tr) // batch_size
    total = steps_per_epoch * args.epochs
    schedule = mx.lr_scheduler.CosineScheduler(max_update=max(total, 1), base_lr=lr,
                                               final_lr=lr * 0.01)
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": lr, "momentum": 0.9, "wd": 1e-4,
                             "lr_scheduler": schedule})
    if precision == "amp":
        amp.init_trainer(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    bar = progress(total, f"{LABELS[kind]:<27} {precision:>4} bs={batch_size:<2}", args.no_progress)
    t0 = time.time()
    loss_ema, diverged = None, False
    for epoch in range(args.epochs):
        perm = rng.permutation(len(x_tr))
        for s in range(steps_per_epoch):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            loss = train_step(net, loss_fn, trainer, x_tr[idx], y_tr[idx], ctx, precision)
            trainer.step(batch_size)
            bar.update(1)
            if s % 20 == 0 or s == steps_per_epoch - 1:
                cur = float(loss.mean().asscalar())
                if not np.isfinite(cur):
                    diverged = True
                loss_ema = cur if loss_ema is None else 0.9 * loss_ema + 0.1 * cur
                bar.set_postfix_str(f"loss {loss_ema:.3f}")
    bar.close()
    train_time = time.time() - t0
    acc = evaluate(net, x_va, y_va, ctx)
    return {"norm": kind, "precision": precision, "batch_size": batch_size // args.devices,
            "devices": args.devices, "seed": seed,
            "val_acc": acc,
            "final_loss": loss_ema, "diverged": diverged, "train_time_s": round(train_time, 4),
            "steps": total, "step_ms": round(1000.0 * train_time / max(total, 1), 2)}


# ------------------------------------------------------------------------------------------------
# Reporting

def step_ms(r):
    """Mean wall-clock time of one training step in ms (results from older runs lack "step_ms")."""
    return 1000.0 * r["train_time_s"] / max(r["steps"], 1)


def accuracy_cell(runs):
    """One run: its accuracy; several seeds: their mean, then (min-max)."""
    acc = [100 * r["val_acc"] for r in runs]
    div = sum(r["diverged"] for r in runs)
    text = f"{acc[0]:.1f}%" if len(acc) == 1 else \
        f"{np.mean(acc):.1f}% ({min(acc):.1f}-{max(acc):.1f})"
    return text + ("" if not div else " (diverged)" if len(runs) == 1 else f" ({div} diverged)")


def step_time_cell(runs):
    return f"{np.mean([step_ms(r) for r in runs]):.1f}"


def results_table(results, batch_sizes, cell=accuracy_cell):
    """One row per (normalization, precision), one column per batch size; cell(runs) fills a cell
    from the runs of that configuration (one per seed)."""
    by = {}
    for r in results:
        by.setdefault((r["norm"], r["precision"], r["batch_size"]), []).append(r)
    rows = sorted({(r["norm"], r["precision"]) for r in results},
                  key=lambda k: (PRECISIONS.index(k[1]), NORMS.index(k[0])))
    head = "| normalization | precision | " + " | ".join(f"bs={b}" for b in batch_sizes) + " |"
    lines = [head, "|" + "---|" * (2 + len(batch_sizes))]
    for norm, prec in rows:
        cells = []
        for b in batch_sizes:
            r = by.get((norm, prec, b))
            cells.append("-" if r is None else cell(r))
        pname = "fp32" if prec == "fp32" else "AMP fp16"
        lines.append(f"| {LABELS[norm]} | {pname} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, batch_sizes, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install 'matplotlib<3.9')")
        return None
    fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(11.5, 4.8), dpi=100)
    for norm in NORMS:
        for prec, style in (("fp32", "-o"), ("amp", "--s")):
            mine = [r for r in results if r["norm"] == norm and r["precision"] == prec]
            bs = sorted({r["batch_size"] for r in mine})
            if not bs:
                continue
            # one point per batch size: the mean over seeds
            runs = [{"batch_size": b, "val_acc": np.mean([r["val_acc"] for r in mine
                                                          if r["batch_size"] == b]),
                     "train_time_s": np.mean([r["train_time_s"] for r in mine
                                              if r["batch_size"] == b]),
                     "steps": next(r["steps"] for r in mine if r["batch_size"] == b)} for b in bs]
            kw = dict(color=COLORS[norm], markersize=4, linewidth=1.5,
                      label=f"{LABELS[norm]}, {'fp32' if prec == 'fp32' else 'AMP fp16'}",
                      alpha=1.0 if prec == "fp32" else 0.7)
            ax.plot(bs, [100 * r["val_acc"] for r in runs], style, **kw)
            ax_t.plot(bs, [step_ms(r) for r in runs], style, **kw)
    for a in (ax, ax_t):
        a.set_xscale("log", base=2)
        a.set_xticks(list(batch_sizes))
        a.set_xticklabels([str(b) for b in batch_sizes])
        a.invert_xaxis()  # as in the paper's Figure 1: batch size shrinks to the right
        a.set_xlabel("batch size (images per device)")
        a.grid(True, alpha=0.3)
    ax.set_ylabel("validation accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax_t.set_ylabel("time per training step (ms)")
    ax_t.set_ylim(bottom=0)
    ax_t.set_title("wall-clock time per training step", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()  # one legend for both panels, below them
    fig.legend(handles, labels, loc="lower center", ncol=max(1, (len(labels) + 1) // 2), fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def load_average():
    """The 1/5/15-minute load averages as "a, b, c" (the machine may be shared), or None."""
    try:
        return ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except (AttributeError, OSError):
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 384 training images, 2 epochs (< 2 min on 2 CPU cores; its accuracies "
                        "only show that training works)")
    p.add_argument("--epochs", type=int, default=None, help="default 6 (2 with --quick)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    p.add_argument("--norms", nargs="+", default=list(DEFAULT_NORMS), choices=NORMS)
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--base-lr", type=float, default=0.2, help="learning rate at batch size 32")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split (and of training)")
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="training seeds (initialization, batch order): each configuration runs "
                        "once per seed on the --seed data split; tables show the mean and range "
                        "(default: --seed alone)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "export", "results"),
                   help="output directory (default: %(default)s, ignored by git; --out "
                        "examples/results refreshes the tracked results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--devices", type=int, default=1,
                   help="in-process devices (cpu(i), or the GPUs): the split_and_load loop, batch "
                        "sizes per device; AMP needs --devices 1")
    p.add_argument("--name", default=None, help="file name stem of the outputs (default "
                   "small_batch, small_batch_quick with --quick)")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 2 if args.quick else 6
    dbn_norms = ("dbn_gn_mx", "dbn_iternorm_gn_mx")
    if not hasattr(gn_mx, "DecorrelatedBatchNorm") and any(n in args.norms for n in dbn_norms):
        print("gn_mx.DecorrelatedBatchNorm is not available in this build: skipping DBN")
        args.norms = [n for n in args.norms if n not in dbn_norms]

    ctx = mx.gpu(0) if mx.context.num_gpus() > 0 else mx.cpu()
    if args.devices > 1:
        if "amp" in args.precisions:
            sys.exit("--devices > 1 runs fp32 only: add --precisions fp32")
        ctx = [mx.gpu(i) if ctx.device_type == "gpu" else mx.cpu(i) for i in range(args.devices)]
        env = gn_mx.sync.cpu_pool_environment(args.devices)  # MXNet reads them at its start:
        if any(os.environ.get(k) != v for k, v in env.items()):  # run again with them set
            os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **env))
    data = load_data(args.quick, args.seed)
    print(f"digits: {len(data[0])} train / {len(data[2])} val images, {args.epochs} epoch(s), "
          f"context {ctx}, mxnet {mx.__version__}")
    results = []
    t_start = time.time()
    # amp.init() is process-global and irreversible: every fp32 run goes first.
    for prec in [q for q in PRECISIONS if q in args.precisions]:
        if prec == "amp":
            if ctx.device_type == "gpu":
                amp.init()
                how = "amp.init() (full AMP: conv/dense in fp16)"
            else:
                amp.init(**gn_mx.amp.cpu_init_kwargs())
                how = "amp.init(**gn_mx.amp.cpu_init_kwargs()) (CPU: conv/dense kept fp32)"
            print(f"AMP: {how}")
        for kind in args.norms:
            for bs in args.batch_sizes:
                for seed in args.seeds or [args.seed]:
                    r = train_one(kind, prec, bs, data, args, ctx, seed)
                    results.append(r)
                    if args.no_progress:
                        print(f"  {LABELS[kind]:<27} {prec:>4} bs={bs:<2} seed {seed} val acc "
                              f"{100 * r['val_acc']:.1f}%  ({r['train_time_s']:.1f}s)")
    elapsed = time.time() - t_start

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name or ("small_batch_quick" if args.quick else "small_batch"))
    table = results_table(results, args.batch_sizes)
    times = results_table(results, args.batch_sizes, cell=step_time_cell)
    seeds = args.seeds or [args.seed]
    seeds_text = (f"training seed {seeds[0]}" if len(seeds) == 1 else
                  f"training seeds {', '.join(map(str, seeds))} (cells: mean, then min-max)")
    setup = (f"scikit-learn digits, {len(data[0])} train / {len(data[2])} val images, "
             f"{seeds_text}, {args.epochs} epoch(s), lr {args.base_lr} x bs/32 (cosine), SGD momentum 0.9, "
             f"context {ctx}{' (batch sizes per device)' if args.devices > 1 else ''}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
             f"{elapsed:.0f} s total")
    load = load_average()
    report = (f"Validation accuracy ({setup})\n\n{table}\n\n"
              f"Time per training step in ms (train_time_s / steps: forward, backward, update; "
              f"wall clock{', load average at the end ' + load if load else ''})\n\n{times}\n")
    print("\n" + report)
    with open(stem + ".json", "w") as f:
        json.dump({"setup": setup, "load_average_at_end": load, "args": vars(args),
                   "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report)
    kind = (ctx[0] if isinstance(ctx, list) else ctx).device_type
    png = plot(results, args.batch_sizes, stem + ".png",
               f"digits: val. accuracy vs batch size ({args.epochs} epoch(s), {kind})")
    print("\nwrote " + ", ".join(x for x in (stem + ".json", stem + ".md", png) if x))
    return results


if __name__ == "__main__":
    main()
