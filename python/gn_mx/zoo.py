"""Drop-in ``norm_layer`` factories for model-zoo constructors (GluonCV style).

Model-zoo constructors take ``norm_layer`` (a class or callable) and ``norm_kwargs`` and create each
normalization layer with one of::

    norm_layer(**norm_kwargs)
    norm_layer(in_channels=c, **norm_kwargs)
    norm_layer(momentum=0.9, epsilon=1e-5, use_global_stats=False, **norm_kwargs)  # BatchNorm keywords

``gn_mx.GroupNorm`` works for the first two; the third fails with TypeError since GroupNorm has no
running statistics. ``norm_layer(...)`` returns a callable that accepts all three: keywords the layer
takes are passed on (the constructor's win over the factory's defaults), ``axis=1`` is accepted (the
channel axis, the only one supported; another axis is a ValueError), and any other keyword is dropped
with one warning per factory naming the dropped keywords.
"""
import inspect
import warnings

from .nn import DecorrelatedBatchNorm, GroupNorm

__all__ = ["norm_layer", "NormLayer"]

# Block keywords every Gluon block takes (passed through **kwargs to Block.__init__).
_BLOCK_KEYWORDS = ("prefix", "params")


class NormLayer:
    """Callable creating ``layer(**kwargs)`` from BatchNorm-style keyword sets (see the module
    docstring); what :func:`norm_layer` returns.

    Parameters
    ----------
    layer : type, default GroupNorm
        The block class to create (``gn_mx.GroupNorm`` or ``gn_mx.DecorrelatedBatchNorm``).
    **defaults
        Keywords given to every layer created (a call's own keywords win).

    Raises
    ------
    TypeError
        ``layer`` is not a class, or a default is a keyword ``layer`` does not take. A call raises
        TypeError for positional arguments and ValueError for an ``axis`` other than 1.

    Examples
    --------
    >>> make = gn_mx.zoo.NormLayer(gn_mx.GroupNorm, num_groups=4)
    >>> make(in_channels=8)
    GroupNorm(num_groups=4, eps=1e-05, center=True, scale=True, in_channels=8)
    """

    def __init__(self, layer=GroupNorm, **defaults):
        if not (isinstance(layer, type) and callable(layer)):
            raise TypeError(f"norm_layer: layer must be a block class, got {layer!r}")
        self.layer = layer
        self.defaults = defaults
        sig = inspect.signature(layer.__init__)
        self._accepted = {name for name, p in sig.parameters.items()
                          if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self._accepted.update(_BLOCK_KEYWORDS)
        self._warned = set()
        unknown = sorted(k for k in defaults if k not in self._accepted and k != "axis")
        if unknown:
            raise TypeError(f"norm_layer({layer.__name__}): unknown keyword(s) {', '.join(unknown)}")

    def __call__(self, *args, **kwargs):
        if args:
            raise TypeError(f"norm_layer({self.layer.__name__}) takes keyword arguments only, got "
                            f"{len(args)} positional")
        kw = dict(self.defaults)
        kw.update(kwargs)
        axis = kw.pop("axis", 1)
        if axis != 1:
            raise ValueError(f"norm_layer({self.layer.__name__}): normalizes the channel axis 1 of "
                             f"(N, C, *spatial) data, got axis={axis!r}")
        dropped = sorted(k for k in kw if k not in self._accepted)
        new = [k for k in dropped if k not in self._warned]
        if new:
            self._warned.update(new)
            warnings.warn(f"gn_mx.norm_layer({self.layer.__name__}): ignoring keyword(s) that do "
                          f"not apply: {', '.join(new)}", UserWarning, stacklevel=2)
        return self.layer(**{k: v for k, v in kw.items() if k in self._accepted})

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"gn_mx.norm_layer({self.layer.__name__}{', ' if args else ''}{args})"


def norm_layer(layer=GroupNorm, **defaults):
    """A ``norm_layer`` for model-zoo constructors (GluonCV style).

    Creates ``layer`` (GroupNorm by default, or DecorrelatedBatchNorm) with ``defaults`` (e.g.
    ``num_groups=32``), accepting and dropping BatchNorm-only keywords (``momentum``,
    ``use_global_stats``, ``running_*_initializer``, ...) with one warning naming them; ``axis=1``
    is accepted, another axis is a ValueError. With GluonCV::

        net = resnet50_v1b(norm_layer=gn_mx.norm_layer(num_groups=32))
        net = resnet50_v1b(norm_layer=gn_mx.norm_layer(gn_mx.DecorrelatedBatchNorm, group_size=16))

    Parameters
    ----------
    layer : type, default GroupNorm
        The block class to create.
    **defaults
        Keywords for every layer created (e.g. ``num_groups=32``); the constructor's own keywords
        win over them.

    Returns
    -------
    NormLayer
        A callable taking keyword arguments only and returning a new ``layer`` block.

    Raises
    ------
    TypeError
        ``layer`` is not a class, or ``defaults`` holds a keyword ``layer`` does not take.

    Examples
    --------
    >>> make = gn_mx.norm_layer(num_groups=2)
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter('ignore')  # "ignoring keyword(s) that do not apply: momentum"
    ...     layer = make(in_channels=4, momentum=0.9)
    >>> layer
    GroupNorm(num_groups=2, eps=1e-05, center=True, scale=True, in_channels=4)
    """
    return NormLayer(layer, **defaults)


def _as_norm_layer(cls, **defaults):
    """``cls.as_norm_layer(**defaults)`` is ``gn_mx.norm_layer(cls, **defaults)``."""
    return NormLayer(cls, **defaults)


GroupNorm.as_norm_layer = classmethod(_as_norm_layer)
DecorrelatedBatchNorm.as_norm_layer = classmethod(_as_norm_layer)
