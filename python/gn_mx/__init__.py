"""gn_mx: native GroupNorm and Decorrelated Batch Normalization ops for MXNet 1.9.

``import gn_mx`` loads the op library (once) and registers ``gn_moments``, ``gn_group_norm``,
``gn_dbn`` and ``gn_dbn_inference`` in ``mx.nd`` and ``mx.sym``; a fresh process that reloads an
exported model only needs this import before ``gluon.SymbolBlock.imports``.
"""
from ._library import library_path, load as _load
from . import amp

amp.install(_load)  # loads the library keeping amp.init()'s wrappers; registers our ops with AMP

from . import _symbolic  # noqa: E402

_symbolic.install()  # shape placeholders for shapeless parameter variables (see _symbolic.py)

from . import ops  # noqa: E402
from .nn import DecorrelatedBatchNorm, GroupNorm  # noqa: E402

__version__ = "0.1.0"
__all__ = ["DecorrelatedBatchNorm", "GroupNorm", "library_path", "ops", "__version__"]
