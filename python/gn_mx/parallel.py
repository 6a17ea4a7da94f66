"""Data-parallel helpers: DecorrelatedBatchNorm running statistics across devices and workers.

With ``ctx=[...]`` each device keeps its own copy of every parameter. Trainable parameters stay equal
(the Trainer applies the same reduced gradient everywhere), but running statistics are updated by
each device from its own slice of the batch and drift apart; ``export``/``save_parameters`` write
the first context's copy only (the BatchNorm convention), and in distributed training each worker
has its own. :func:`sync_running_stats` averages them so every copy, and every worker, holds the
same statistics (call it before ``export``/``save_parameters``, or every few steps).

GroupNorm has no running statistics (per-sample statistics), so it needs nothing of this.
"""
import numpy as _onp

from . import _compat, _np
from .nn import DecorrelatedBatchNorm

# Keys of the statistics in a kvstore: ints, like the Trainer's (0..num_params-1), far above them
# but small enough for ps-lite's server assignment (key * 9973 must fit an int32).
_KEY_BASE = 150_000


def dbn_layers(block):
    """The DecorrelatedBatchNorm layers in ``block`` (itself included), in registration order."""
    found = []

    def walk(b):
        if isinstance(b, DecorrelatedBatchNorm):
            found.append(b)
        for child in _compat.children(b):
            walk(child)

    walk(block)
    return found


def _kvstore_of(kvstore):
    """A KVStore from a KVStore, a gluon Trainer or None; rejects optimizer-updating stores."""
    if kvstore is None:
        return None
    from mxnet.gluon import Trainer
    if isinstance(kvstore, Trainer):
        trainer = kvstore
        kv = _compat.trainer_kvstore(trainer)
        if kv is None:
            return None
        num_params, update_on_kvstore = _compat.trainer_info(trainer)
        if num_params >= _KEY_BASE:
            raise ValueError(f"sync_running_stats: more than {_KEY_BASE} parameters in the Trainer")
        if update_on_kvstore and "dist" in kv.type:
            raise ValueError("sync_running_stats: the Trainer updates on the kvstore (the servers "
                             "would apply the optimizer to the statistics); create it with "
                             "update_on_kvstore=False")
        return kv
    return kvstore


def init_kvstore(trainer):
    """Create ``trainer``'s kvstore and broadcast rank 0's parameters now, and wait for it.

    Workaround for MXNet 1.9.1's dist kvstore with ``update_on_kvstore=False``: the Trainer
    broadcasts the initial weights lazily in its first ``step`` and, without waiting, pushes that
    step's gradients; the broadcast's pull of a key can reach the servers after the gradient push of
    the same key, and a worker then receives the summed gradient as its weights (seen in 2-4 of 10
    loopback runs of examples/dist_train.py, with plain Conv/Dense nets too). Call this once after
    ``net.initialize()`` (parameters must not be deferred: give in_channels/in_units, or run one
    forward first) and before the first step. Harmless for other kvstores."""
    import mxnet as mx
    kv = _compat.trainer_kvstore(trainer, init_params=True)
    mx.nd.waitall()
    return kv


def sync_running_stats(block, kvstore=None):
    """Average every DecorrelatedBatchNorm's ``running_mean`` and ``running_projection`` over the
    contexts it lives on and, with a distributed ``kvstore``, over all workers; write the average
    into every copy. Returns the number of layers synchronized.

    block: any Block (the DBN layers inside it are found recursively); its parameters must be
    initialized. kvstore: None (devices of this process only), a ``mx.kv`` KVStore, or a gluon
    ``Trainer`` (its kvstore). A distributed kvstore is used through its own push/pull: the servers
    sum each worker's value, so they must not run an optimizer (a Trainer with
    ``update_on_kvstore=False``; a raw kvstore without ``set_optimizer``). Every worker must call
    this at the same point (it is a collective operation). Local kvstores are not needed for the
    device average and are not used.

    The average is taken in float32 (float64 for float64 statistics) and cast back.
    """
    import mxnet as mx
    kv = _kvstore_of(kvstore)
    workers = kv.num_workers if kv is not None and "dist" in kv.type else 1
    layers = dbn_layers(block)
    if workers > 1:
        seen = kv.__dict__.setdefault("_gnmx_stat_keys", set())
    key = _KEY_BASE
    for layer in layers:
        for param in (layer.running_mean, layer.running_projection):
            copies = [_np.to_legacy(d) for d in param.list_data()]
            acc_dtype = "float64" if copies[0].dtype == _onp.float64 else "float32"
            ctx0 = copies[0].context
            acc = copies[0].astype(acc_dtype, copy=True)
            for d in copies[1:]:
                acc += d.as_in_context(ctx0).astype(acc_dtype, copy=False)
            if len(copies) > 1:
                acc /= len(copies)
            if workers > 1:
                if key not in seen:
                    kv.init(key, mx.nd.zeros(acc.shape, ctx=ctx0, dtype=acc_dtype))
                    seen.add(key)
                kv.push(key, acc)
                kv.pull(key, out=acc)  # the servers' sum over workers
                acc /= workers
            for d in copies:
                acc.astype(d.dtype, copy=False).copyto(d)
            key += 1
    for layer in layers:
        for param in (layer.running_mean, layer.running_projection):
            for d in param.list_data():
                d.wait_to_read()
    return len(layers)
