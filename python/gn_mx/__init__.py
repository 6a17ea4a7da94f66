"""gn_mx: native GroupNorm and Decorrelated Batch Normalization ops for MXNet 1.9.

``import gn_mx`` loads the op library (once per process, whatever else loaded it) and registers
``gn_moments``, ``gn_group_norm``, ``gn_dbn``, ``gn_dbn_inference`` and ``gn_channel_affine`` in
``mx.nd`` and ``mx.sym``; a fresh process that reloads an exported model only needs this import
before ``gluon.SymbolBlock.imports`` / ``mx.sym.load``. With onnx installed it also registers the
ONNX converters (``gn_mx.onnx``) with ``mx.onnx.export_model``.
"""
from ._library import build_info, library_path, load as _load
from . import amp

amp.install(_load)  # loads the library keeping amp.init()'s wrappers; registers our ops with AMP

from . import _symbolic  # noqa: E402

_symbolic.install()  # shape placeholders for shapeless parameter variables (see _symbolic.py)

from . import ops, parallel, sym  # noqa: E402
from .nn import DecorrelatedBatchNorm, GroupNorm  # noqa: E402
from .parallel import sync_running_stats  # noqa: E402
from .zoo import norm_layer  # noqa: E402
from ._library import register_onnx_converters as _onnx  # noqa: E402

_onnx()  # ONNX export of the gn_mx ops via mx.onnx.export_model, when onnx is installed

__version__ = "0.1.0"
__all__ = ["DecorrelatedBatchNorm", "GroupNorm", "build_info", "library_path", "norm_layer", "ops",
           "parallel", "sym", "sync_running_stats", "__version__"]
