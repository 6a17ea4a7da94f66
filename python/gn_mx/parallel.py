"""Data-parallel helpers: DecorrelatedBatchNorm running statistics across devices and workers.

With ``ctx=[...]`` each device keeps its own copy of every parameter. Trainable parameters stay equal
(the Trainer applies the same reduced gradient everywhere), but running statistics are updated by
each device from its own slice of the batch and drift apart; ``export``/``save_parameters`` write
the first context's copy only (the BatchNorm convention), and in distributed training each worker
has its own. :func:`sync_running_stats` averages them so every copy, and every worker, holds the
same statistics (call it before ``export``/``save_parameters``, or every few steps).

Across processes it uses MXNet's distributed kvstore (``dist_*``, the servers sum) or Horovod's
allreduce (``hvd.DistributedTrainer``, a Trainer with ``hvd.DistributedOptimizer``, or the
``horovod.mxnet`` module itself). Horovod is recognised by the module its classes come from and is
never imported here: without Horovod installed nothing of it is touched.

GroupNorm has no running statistics (per-sample statistics), so it needs nothing of this.
"""
import sys as _sys
import types as _types

import numpy as _onp

from . import _compat, _np
from .nn import DecorrelatedBatchNorm

__all__ = ["sync_running_stats", "init_kvstore", "dbn_layers"]

# Keys of the statistics in a kvstore: ints, like the Trainer's (0..num_params-1), far above them
# but small enough for ps-lite's server assignment (key * 9973 must fit an int32).
_KEY_BASE = 150_000


def dbn_layers(block):
    """The DecorrelatedBatchNorm layers in ``block`` (itself included), in registration order.

    Parameters
    ----------
    block : Block
        Any Gluon block.

    Returns
    -------
    list of DecorrelatedBatchNorm

    Examples
    --------
    >>> net = mx.gluon.nn.HybridSequential()
    >>> net.add(gn_mx.GroupNorm(2), gn_mx.DecorrelatedBatchNorm(num_groups=2))
    >>> [type(b).__name__ for b in gn_mx.parallel.dbn_layers(net)]
    ['DecorrelatedBatchNorm']
    """
    found = []

    def walk(b):
        if isinstance(b, DecorrelatedBatchNorm):
            found.append(b)
        for child in _compat.children(b):
            walk(child)

    walk(block)
    return found


_HOROVOD = "horovod.mxnet"
_SUPPORTED = ("supported: MXNet's dist_sync/dist_device_sync kvstores (a Trainer with "
              "update_on_kvstore=False) and Horovod (hvd.DistributedTrainer, a Trainer with "
              "hvd.DistributedOptimizer, or the horovod.mxnet module)")


def _from_horovod(obj):
    """Whether ``obj`` is a Horovod module or an instance of a class defined in Horovod (by module
    name: nothing is imported)."""
    if isinstance(obj, _types.ModuleType):
        return obj.__name__.split(".")[0] == "horovod"
    return any((getattr(c, "__module__", None) or "").split(".")[0] == "horovod"
               for c in type(obj).__mro__)


def _horovod_api(module=None):
    """The ``horovod.mxnet`` functions sync_running_stats uses (a module passed by the user, else
    the one already imported), initialized."""
    hvd = module if module is not None else _sys.modules.get(_HOROVOD)
    if hvd is None or not all(hasattr(hvd, f) for f in ("grouped_allreduce_", "size")):
        name = getattr(module, "__name__", _HOROVOD)
        raise ValueError(f"sync_running_stats: '{name}' is not Horovod's MXNet module (it needs "
                         f"grouped_allreduce_ and size); pass horovod.mxnet (import horovod.mxnet "
                         f"as hvd) or its DistributedTrainer")
    if hasattr(hvd, "is_initialized") and not hvd.is_initialized():
        raise ValueError("sync_running_stats: Horovod is not initialized; call hvd.init() first")
    return hvd


class _Horovod:
    """Cross-process sum through Horovod: one grouped allreduce of all statistics (per dtype)."""

    def __init__(self, hvd):
        self.hvd = hvd
        self.workers = int(hvd.size())

    def sum_(self, arrays):
        by_dtype = {}
        for a in arrays:
            by_dtype.setdefault(_onp.dtype(a.dtype).name, []).append(a)
        for dtype, group in sorted(by_dtype.items()):
            # every rank makes the same calls in the same order: the same layers, the same name
            self.hvd.grouped_allreduce_(group, average=False,
                                        name=f"gn_mx.sync_running_stats.{dtype}")


class _DistKVStore:
    """Cross-worker sum through a dist_* kvstore's push/pull (the servers sum)."""

    def __init__(self, kv):
        self.kv = kv
        self.workers = kv.num_workers

    def sum_(self, arrays):
        import mxnet as mx
        seen = self.kv.__dict__.setdefault("_gnmx_stat_keys", set())
        for key, acc in enumerate(arrays, _KEY_BASE):
            if key not in seen:
                self.kv.init(key, mx.nd.zeros(acc.shape, ctx=acc.context, dtype=acc.dtype))
                seen.add(key)
            self.kv.push(key, acc)
            self.kv.pull(key, out=acc)


def _check_trainer_kvstore(trainer, kv):
    num_params, update_on_kvstore = _compat.trainer_info(trainer)
    if num_params >= _KEY_BASE:
        raise ValueError(f"sync_running_stats: more than {_KEY_BASE} parameters in the Trainer")
    if update_on_kvstore and "dist" in kv.type:
        raise ValueError("sync_running_stats: the Trainer updates on the kvstore (the servers "
                         "would apply the optimizer to the statistics); create it with "
                         "update_on_kvstore=False")


def _cross_process(kvstore):
    """How to sum over processes for sync_running_stats' ``kvstore`` argument: None (this process
    only), or an object with ``workers`` and ``sum_(arrays)`` (in place). Raises for a multi-worker
    run it cannot synchronize rather than averaging the local contexts only."""
    if kvstore is None:
        return None
    from mxnet.gluon import Trainer
    if isinstance(kvstore, _types.ModuleType):
        if not _from_horovod(kvstore):
            raise TypeError(f"sync_running_stats: module '{kvstore.__name__}' is not Horovod's "
                            f"MXNet module; pass horovod.mxnet, a Trainer or a KVStore")
        return _Horovod(_horovod_api(kvstore))
    if isinstance(kvstore, Trainer):
        trainer = kvstore
        if _from_horovod(trainer) or _from_horovod(trainer.optimizer):
            return _Horovod(_horovod_api())  # DistributedTrainer / DistributedOptimizer
        kv = _compat.trainer_kvstore(trainer)
        if kv is None:
            hvd = _sys.modules.get(_HOROVOD)
            if (hvd is not None and getattr(hvd, "is_initialized", lambda: False)()
                    and hvd.size() > 1):
                raise ValueError(f"sync_running_stats: a gluon Trainer without kvstore in a "
                                 f"Horovod run of {hvd.size()} processes would average this "
                                 f"process's statistics only; pass hvd.DistributedTrainer or the "
                                 f"horovod.mxnet module ({_SUPPORTED})")
            return None
        _check_trainer_kvstore(trainer, kv)
    else:
        kv = kvstore
    if _from_horovod(kv):
        return _Horovod(_horovod_api())
    if not (hasattr(kv, "type") and hasattr(kv, "num_workers")):
        raise TypeError(f"sync_running_stats: kvstore must be None, a KVStore, a gluon Trainer or "
                        f"horovod.mxnet, not {type(kv).__name__}")
    kv_type = str(kv.type)
    if "dist" in kv_type and "async" not in kv_type:  # dist_async servers need an optimizer
        return _DistKVStore(kv) if kv.num_workers > 1 else None
    if kv.num_workers > 1:
        raise ValueError(f"sync_running_stats: cannot average the statistics over the "
                         f"{kv.num_workers} workers of a '{kv_type}' kvstore ({_SUPPORTED})")
    return None


def init_kvstore(trainer):
    """Create ``trainer``'s kvstore and broadcast rank 0's parameters now, and wait for it.

    Workaround for MXNet 1.9.1's dist kvstore with ``update_on_kvstore=False``: the Trainer
    broadcasts the initial weights lazily in its first ``step`` and, without waiting, pushes that
    step's gradients; the broadcast's pull of a key can reach the servers after the gradient push of
    the same key, and a worker then receives the summed gradient as its weights (seen in 2-4 of 10
    loopback runs of examples/dist_train.py, with plain Conv/Dense nets too). Call this once after
    ``net.initialize()`` (parameters must not be deferred: give in_channels/in_units, or run one
    forward first) and before the first step. Harmless for other kvstores.

    Parameters
    ----------
    trainer : gluon.Trainer
        The Trainer whose kvstore to create.

    Returns
    -------
    KVStore or None
        The trainer's kvstore (None when it uses none).

    Examples
    --------
    >>> net = gn_mx.GroupNorm(2, in_channels=4)
    >>> net.initialize()
    >>> trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', kvstore='local')
    >>> kv = gn_mx.parallel.init_kvstore(trainer)
    """
    import mxnet as mx
    kv = _compat.trainer_kvstore(trainer, init_params=True)
    mx.nd.waitall()
    return kv


def sync_running_stats(block, kvstore=None):
    """Average every DecorrelatedBatchNorm's ``running_mean`` and ``running_projection`` over the
    contexts it lives on and, in a multi-process run, over all processes; write the average into
    every copy. Returns the number of layers synchronized.

    block: any Block (the DBN layers inside it are found recursively); its parameters must be
    initialized. kvstore: one of
      * None: the devices of this process only;
      * a gluon ``Trainer`` or a ``mx.kv`` KVStore: a distributed kvstore (``dist_sync``,
        ``dist_device_sync``) is used through its own push/pull: the servers sum each worker's
        value, so they must not run an optimizer (a Trainer with ``update_on_kvstore=False``; a
        raw kvstore without ``set_optimizer``). Local kvstores are not needed for the device
        average and are not used;
      * Horovod: ``hvd.DistributedTrainer``, a Trainer with ``hvd.DistributedOptimizer``, the
        ``horovod.mxnet`` module itself (``hvd``): one grouped ``allreduce`` of all the
        statistics (``hvd.init()`` must have been called).
    A trainer or kvstore of a multi-process run that none of these can synchronize (``dist_async``,
    other kvstore types with several workers, a plain Trainer without kvstore while Horovod runs
    several processes) raises ValueError instead of averaging the local contexts only.

    Every process must call this at the same point (it is a collective operation).
    The average is taken in float32 (float64 for float64 statistics) and cast back.

    Parameters
    ----------
    block : Block
        Any Block; the DecorrelatedBatchNorm layers inside it (itself included) are synchronized.
        Its parameters must be initialized.
    kvstore : None, gluon.Trainer, KVStore or module, optional
        How to reach the other processes (see above); None: this process's devices only.

    Returns
    -------
    int
        The number of layers synchronized.

    Raises
    ------
    ValueError
        A multi-process run that ``kvstore`` cannot synchronize, a Trainer that updates on the
        kvstore, Horovod not initialized.
    TypeError
        ``kvstore`` of an unsupported kind.

    Examples
    --------
    >>> dbn = gn_mx.DecorrelatedBatchNorm(num_groups=2, in_channels=4)
    >>> dbn.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    >>> dbn.running_mean.set_data(mx.nd.ones(4))
    >>> dbn.running_mean.data(mx.cpu(1))[:] = 3
    >>> gn_mx.sync_running_stats(dbn)
    1
    >>> dbn.running_mean.data(mx.cpu(0)).asnumpy()
    array([2., 2., 2., 2.], dtype=float32)
    """
    remote = _cross_process(kvstore)
    layers = dbn_layers(block)
    copies, accs = [], []
    for layer in layers:
        for param in (layer.running_mean, layer.running_projection):
            per_ctx = [_np.to_legacy(d) for d in param.list_data()]
            acc_dtype = "float64" if per_ctx[0].dtype == _onp.float64 else "float32"
            ctx0 = per_ctx[0].context
            acc = per_ctx[0].astype(acc_dtype, copy=True)
            for d in per_ctx[1:]:
                acc += d.as_in_context(ctx0).astype(acc_dtype, copy=False)
            if len(per_ctx) > 1:
                acc /= len(per_ctx)
            copies.append(per_ctx)
            accs.append(acc)
    if remote is not None and remote.workers > 1 and accs:
        remote.sum_(accs)
        for acc in accs:
            acc /= remote.workers
    for per_ctx, acc in zip(copies, accs):
        for d in per_ctx:
            acc.astype(d.dtype, copy=False).copyto(d)
    for per_ctx in copies:
        for d in per_ctx:
            d.wait_to_read()
    return len(layers)
