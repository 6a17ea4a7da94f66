"""Gluon blocks. They hold parameters and choose ops; all math is in the native ops."""
import numbers

from mxnet.gluon import HybridBlock

from . import _library

_library.load()


def _check_groups(cls, num_groups, epsilon, in_channels):
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups <= 0:
        raise ValueError(f"{cls}: num_groups must be a positive integer, got {num_groups!r}")
    if not isinstance(epsilon, numbers.Real) or not epsilon >= 0 or epsilon == float("inf"):
        raise ValueError(f"{cls}: epsilon must be a finite number >= 0, got {epsilon!r}")
    if isinstance(in_channels, bool) or not isinstance(in_channels, numbers.Integral) or in_channels < 0:
        raise ValueError(f"{cls}: in_channels must be an integer >= 0 (0 = infer), got {in_channels!r}")
    if in_channels and in_channels % num_groups:
        raise ValueError(f"{cls}: in_channels ({in_channels}) must be divisible by num_groups "
                         f"({num_groups})")


def accumulating_params(F, *params):
    """Route parameters through `identity` so that grad_req='add' accumulates.

    MXNet's lib_api passes no `req` to library ops: their backward always overwrites the gradient
    buffer it is given. A built-in identity between the parameter and the op receives the library's
    gradient in a temporary and honours 'add' (and 'write') itself, at the cost of copying C values.
    """
    return tuple(F.identity(p) for p in params)


class GroupNorm(HybridBlock):
    """Group Normalization (Wu & He, 2018) with the paper's per-channel affine.

    For data (N, C, *spatial) with any number of spatial dims (including none), channels are split
    into ``num_groups`` groups; each (sample, group) is normalized by its own mean and variance, then
    ``out = gamma[c] * xhat + beta[c]``. Unlike MXNet 1.x's built-in ``GroupNorm`` (gamma/beta of shape
    ``(num_groups,)``), gamma and beta here have shape ``(C,)``, as in PyTorch and TensorFlow.

    float16 data is reduced in float32 straight from float16 memory; gamma/beta may be float32 with
    float16 data (multi-precision).

    Parameters
    ----------
    num_groups : int, default 32
    epsilon : float, default 1e-5
    center : bool, default True
        Learn ``beta``; if False it stays at its initial value (zeros).
    scale : bool, default True
        Learn ``gamma``; if False it stays at its initial value (ones).
    beta_initializer, gamma_initializer : str or Initializer
    in_channels : int, default 0
        Number of channels; 0 infers it from the first input (deferred initialization).
    """

    def __init__(self, num_groups=32, epsilon=1e-5, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones", in_channels=0, **kwargs):
        super().__init__(**kwargs)
        _check_groups("GroupNorm", num_groups, epsilon, in_channels)
        self._num_groups = int(num_groups)
        self._epsilon = float(epsilon)
        self._center = bool(center)
        self._scale = bool(scale)
        self._in_channels = int(in_channels)
        with self.name_scope():
            self.gamma = self.params.get("gamma", grad_req="write" if scale else "null",
                                         shape=(in_channels,), init=gamma_initializer,
                                         allow_deferred_init=True, differentiable=scale)
            self.beta = self.params.get("beta", grad_req="write" if center else "null",
                                        shape=(in_channels,), init=beta_initializer,
                                        allow_deferred_init=True, differentiable=center)

    def hybrid_forward(self, F, x, gamma, beta):
        gamma, beta = accumulating_params(F, gamma, beta)
        return F.gn_group_norm(x, gamma, beta, num_groups=self._num_groups, eps=self._epsilon)[0]

    def __repr__(self):
        c = self.gamma.shape[0] if self.gamma.shape else 0
        return (f"{self.__class__.__name__}(num_groups={self._num_groups}, eps={self._epsilon}, "
                f"center={self._center}, scale={self._scale}, in_channels={c or None})")
