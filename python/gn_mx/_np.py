"""Zero-copy bridging between MXNet's NumPy interface (``mx.np`` / ``npx.set_np()``) and the legacy
NDArray/Symbol API the library ops are registered in.

Library ops (like all of MXNet 1.9's legacy ops) reject ``mx.np.ndarray`` inputs. ``as_nd_ndarray()``
and ``as_np_ndarray()`` re-wrap the same array handle (``MXShallowCopyNDArray``; autograd history is
kept) or the same graph node (``MXShallowCopySymbol``), so converting costs no pass over the data and
adds no node to a traced or exported graph.
"""
from mxnet import numpy as _mnp
from mxnet.symbol.numpy import _Symbol as _NpSymbol


def is_np(x):
    """True for ``mx.np.ndarray`` and NumPy-interface symbols."""
    return isinstance(x, (_mnp.ndarray, _NpSymbol))


def to_legacy(x):
    """The legacy NDArray/Symbol view of ``x`` (``x`` itself when it already is one, or None)."""
    return x.as_nd_ndarray() if is_np(x) else x


def to_np(x):
    """The NumPy-interface view of a legacy NDArray/Symbol (lists/tuples element-wise)."""
    if isinstance(x, (list, tuple)):
        return type(x)(to_np(e) for e in x)
    return x if x is None or is_np(x) else x.as_np_ndarray()


def like(out, np_kind):
    """``out`` converted to the kind of the caller's input: NumPy-interface if ``np_kind``."""
    return to_np(out) if np_kind else out
