"""Synchronized DBN: whitening statistics over every device's batch (docs/guide/dbn_sync.md).

:class:`SyncDecorrelatedBatchNorm` trains like :class:`~gn_mx.DecorrelatedBatchNorm` on the batch of
all devices together: N devices with batch b each give the outputs, gradients and running statistics
of one DBN on the N*b batch. Devices are the contexts of one process (the Gluon ``split_and_load``
loop, ``num_devices`` of them, as MXNet's ``SyncBatchNorm``) or Horovod ranks (``horovod=True``).

The training step, per group (the native ops ``gn_dbn_local_sums``, ``gn_dbn_local_cov``,
``gn_sync_sum``, ``gn_dbn_whiten``, ``gn_dbn_apply``; src/operator/kernels/dbn_sync.h), statistics
in float64:

1. ``[sum_cols(X_p) | m_p]`` summed over the devices gives the global mean ``mu``;
2. ``(X_p - mu)(X_p - mu)^T / m`` summed over the devices, the covariance ``C``;
3. ``W = whitening(C + eps I)`` (ZCA or IterNorm, the fused op's D x D math), running statistics;
4. ``gamma * W (X_p - mu) + beta``, rounded once to the data's dtype (``gn_dbn_apply``).

Each sum's backward is the same sum of the gradients, so the input and parameter gradients are
those of the concatenated batch. Inference is :class:`~gn_mx.DecorrelatedBatchNorm`'s
(``gn_dbn_inference`` on the running statistics): exported graphs hold no synchronization op.
"""
import itertools
import os

from mxnet import autograd as _autograd
from mxnet.ndarray import NDArray

from . import _hybrid
from .nn import DecorrelatedBatchNorm, accumulating_params, numpy_interface

__all__ = ["SyncDecorrelatedBatchNorm", "cpu_pool_environment", "sync_dbn_training"]

#: MXNet's CPU resource pools. MXNet gives every library op one slot of each (kTempSpace and
#: kParallelRandom), the slots are shared by all cpu(i) and handed out round-robin, and a device
#: waiting for the others keeps its slots: another device whose op, before it arrives, was handed
#: one of them waits for it (a deadlock that the timeout ends). Slots are distinct when a pool has
#: more of them than the ops requesting it in all devices' training graphs together: temp space is
#: requested by many of MXNet's own ops (slots are cheap, allocated on use), parallel random by
#: library ops only (~5 MB each, allocated at start; the digits net of
#: examples/train_small_batch.py has 4 synchronized layers = 32 library ops per device and step).
#: And MXNET_CPU_WORKER_NTHREADS: with one worker thread per cpu(i) (the default) the digits run
#: still stopped at a barrier once in three seeds (another op queued behind the waiting one on its
#: device's only thread, we think: the Trainer's cross-device copies); with 2 it ran through.
POOL_VARIABLES = ("MXNET_CPU_TEMP_COPY", "MXNET_CPU_PARALLEL_RAND_COPY", "MXNET_CPU_WORKER_NTHREADS")
_SLOTS_PER_DEVICE = {"MXNET_CPU_TEMP_COPY": 512, "MXNET_CPU_PARALLEL_RAND_COPY": 64}
_WORKERS = 2

_instances = itertools.count()


def cpu_pool_environment(num_devices):
    """The CPU resource-pool sizes and worker threads synchronized DBN needs on ``num_devices`` cpu
    contexts of one process (GPU contexts have pools per device and need nothing).

    MXNet reads the worker count when it is imported: set them in the shell, or in ``os.environ``
    before ``import mxnet``. Sized for nets of up to 7 synchronized layers (8 library ops per layer,
    device and step); deeper nets need more (a timeout's message then names the variables).

    Parameters
    ----------
    num_devices : int

    Returns
    -------
    dict
        ``{variable: value}`` for ``MXNET_CPU_TEMP_COPY``, ``MXNET_CPU_PARALLEL_RAND_COPY`` and
        ``MXNET_CPU_WORKER_NTHREADS``.

    Examples
    --------
    >>> gn_mx.sync.cpu_pool_environment(4)
    {'MXNET_CPU_TEMP_COPY': '2048', 'MXNET_CPU_PARALLEL_RAND_COPY': '256', 'MXNET_CPU_WORKER_NTHREADS': '2'}
    """
    env = {v: str(n * int(num_devices)) for v, n in _SLOTS_PER_DEVICE.items()}
    env["MXNET_CPU_WORKER_NTHREADS"] = str(_WORKERS)
    return env


def _pool_problem(num_devices):
    """A message naming the CPU pool variables set too small for num_devices, else None."""
    want = cpu_pool_environment(num_devices)
    low = [f"{v}={os.environ.get(v, 'unset')}" for v in POOL_VARIABLES
           if int(os.environ.get(v, "0") or 0) < int(want[v])]
    if not low:
        return None
    need = " ".join(f"{k}={v}" for k, v in want.items())
    return (f"{', '.join(low)}: too small for {num_devices} synchronized cpu contexts (a device "
            f"waiting for the others holds MXNet resource slots that another device may need); "
            f"set {need} before importing mxnet (gn_mx.sync.cpu_pool_environment)")


def sync_dbn_training(F, x, gamma, beta, running_mean, running_projection, num_groups, reduce,
                      eps=1e-5, momentum=0.9, whitening="zca", iterations=5):
    """Synchronized DBN's training output (the module docstring's steps), nd or sym.

    ``reduce(F, t, name)`` returns the sum of the float64 tensor ``t`` over the devices (``name``:
    'mean' or 'cov', one barrier each); the identity gives single-device DBN. Running statistics
    are updated in place (``gn_dbn_whiten``).
    """
    tot = reduce(F, F.gn_dbn_local_sums(x, num_groups=num_groups), "mean")
    cov, mu = F.gn_dbn_local_cov(x, tot, num_groups=num_groups)
    kw = {} if whitening == "zca" else {"whitening": whitening, "iterations": iterations}
    W = F.gn_dbn_whiten(reduce(F, cov, "cov"), mu, running_mean, running_projection, eps=eps,
                        momentum=momentum, **kw)[0]
    return F.gn_dbn_apply(x, gamma, beta, mu, W, num_groups=num_groups)


def _in_process_reduce(key, num_devices, timeout):
    """reduce() over the contexts of this process: gn_sync_sum, a barrier per name."""
    def reduce(F, t, name):
        return F.gn_sync_sum(t, key=f"{key}/{name}", num_devices=num_devices, timeout=timeout)
    return reduce


def _horovod_reduce(key):
    """reduce() across Horovod ranks: allreduce forward and backward (imperative only)."""
    import horovod.mxnet as hvd  # noqa: imported only in Horovod mode

    class _AllreduceSum(_autograd.Function):
        def __init__(self, name):
            super().__init__()
            self._name = name

        def forward(self, t):
            return hvd.allreduce(t, average=False, name=f"{self._name}/fwd")

        def backward(self, dt):
            return hvd.allreduce(dt, average=False, name=f"{self._name}/bwd")

    def reduce(F, t, name):
        if not isinstance(t, NDArray):
            raise ValueError(f"{key}: SyncDecorrelatedBatchNorm(horovod=True) runs imperatively "
                             "only (Horovod's allreduce has no graph op): do not hybridize it")
        return _AllreduceSum(f"{key}/{name}")(t)
    return reduce


class SyncDecorrelatedBatchNorm(DecorrelatedBatchNorm):
    """DecorrelatedBatchNorm whose training statistics cover every device's batch (MXNet's
    ``SyncBatchNorm`` for DBN).

    Training whitens each device's slice with the mean and covariance of the whole batch across
    ``num_devices`` contexts of this process (call the block once per context per step, as in the
    ``split_and_load`` loop; every call of a step waits for the others), or across Horovod ranks
    (``horovod=True``). Outputs, gradients and running statistics equal those of one
    DecorrelatedBatchNorm on the concatenated batch (float64 statistics; docs/guide/dbn_sync.md has
    the tolerances). Inference, ``export`` and the parameters are DecorrelatedBatchNorm's.

    Parameters
    ----------
    num_devices : int, default 1
        Contexts of this process that call the block each step (ignored with ``horovod=True``).
        1: no synchronization (the float64 composed path, for testing).
    key : str, optional
        Name of the barrier; default the block's name (unique in the process). Blocks with the same
        key synchronize with each other.
    timeout : float, default 60
        Seconds a device waits for the others; then every waiting device gets an MXNetError naming
        the key and how many devices arrived, and the key is usable again.
    horovod : bool, default False
        Synchronize across Horovod ranks (``hvd.init()`` done) instead; imperative only.
    **kwargs
        DecorrelatedBatchNorm's arguments (``num_groups``, ``group_size``, ``epsilon``,
        ``momentum``, ``whitening``, ...).

    Raises
    ------
    ValueError
        A bad ``num_devices`` or ``timeout``; at a training call with several in-process devices
        under ``MXNET_ENGINE_TYPE=NaiveEngine`` (one thread cannot wait for another
        device), or on cpu contexts whose resource pools are too small
        (:func:`cpu_pool_environment` names the variables).

    Examples
    --------
    >>> sdbn = gn_mx.SyncDecorrelatedBatchNorm(num_devices=1, num_groups=2)
    >>> sdbn.initialize()
    >>> with mx.autograd.record():
    ...     y = sdbn(mx.nd.random.normal(shape=(8, 4)))
    >>> y.shape
    (8, 4)
    """

    def __init__(self, num_devices=1, key=None, timeout=60.0, horovod=False, **kwargs):
        super().__init__(**kwargs)
        if isinstance(num_devices, bool) or int(num_devices) != num_devices or num_devices < 1:
            raise ValueError(f"SyncDecorrelatedBatchNorm: num_devices must be an integer >= 1; "
                             f"got {num_devices!r}")
        if not (float(timeout) > 0 and float(timeout) < float("inf")):
            raise ValueError(f"SyncDecorrelatedBatchNorm: timeout must be a finite number of "
                             f"seconds > 0; got {timeout!r}")
        self._num_devices = int(num_devices)
        self._key = str(key) if key else f"{self.name}#{next(_instances)}"
        self._timeout = float(timeout)
        self._horovod = bool(horovod)

    def _reduce(self, x):
        """The reduce() of this mode; checks what would make in-process devices hang."""
        if self._horovod:
            return _horovod_reduce(self._key)
        if self._num_devices == 1:
            return lambda F, t, name: t
        if os.environ.get("MXNET_ENGINE_TYPE", "") == "NaiveEngine":
            raise ValueError(f"{self.name}: num_devices={self._num_devices} cannot synchronize "
                             "under MXNET_ENGINE_TYPE=NaiveEngine (one thread runs every device: "
                             "the first would wait for the others forever); use the default engine")
        if not isinstance(x, NDArray) or x.context.device_type.startswith("cpu"):
            problem = _pool_problem(self._num_devices)
            if problem:
                raise ValueError(f"{self.name}: {problem}")
        return _in_process_reduce(self._key, self._num_devices, self._timeout)

    @numpy_interface
    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_projection):
        """Synchronized training statistics; inference as DecorrelatedBatchNorm."""
        if not _autograd.is_training() or self._use_global_stats:
            return super().hybrid_forward(F, x, gamma, beta, running_mean, running_projection)
        if not isinstance(x, NDArray):
            _hybrid.note_mode_dependent()
        gamma, beta = accumulating_params(F, gamma, beta, block=self)
        return sync_dbn_training(F, x, gamma, beta, running_mean, running_projection,
                                 self._groups_of(x), self._reduce(x), eps=self._epsilon,
                                 momentum=self._momentum, whitening=self._whitening,
                                 iterations=self._iterations)

    def __repr__(self):
        mode = "horovod=True" if self._horovod else f"num_devices={self._num_devices}"
        return super().__repr__()[:-1] + f", {mode}, key='{self._key}')"
