"""gn_mx: native GroupNorm and Decorrelated Batch Normalization ops for MXNet 1.9.

``import gn_mx`` loads the op library (once per process, whatever else loaded it) and registers
``gn_moments``, ``gn_group_norm``, ``gn_dbn``, ``gn_dbn_inference``, ``gn_channel_affine`` and
``gn_weight_standardize`` in
``mx.nd`` and ``mx.sym``; a fresh process that reloads an exported model only needs this import
before ``gluon.SymbolBlock.imports`` / ``mx.sym.load``. With onnx installed it also registers the
ONNX converters (``gn_mx.onnx``) with ``mx.onnx.export_model``.
"""
from . import _compat  # first: without MXNet 1.9 it raises the install hint (others import mxnet)
from . import _symbolic, amp, ops, parallel, sym, sync, ws
from ._convert import convert, convert_symbol  # docs/convert.md
from ._replace import replace_norm  # docs/guide/replace_norm.md
from ._library import build_info, library_path, load as _load, register_onnx_converters as _onnx
from .nn import DecorrelatedBatchNorm, GroupNorm
from .parallel import sync_running_stats
from .sync import SyncDecorrelatedBatchNorm  # docs/guide/dbn_sync.md
from .zoo import norm_layer
from .ws import WSConv1D, WSConv2D, WSConv3D, standardize_convs  # docs/guide/weight_standardization.md

# The one place the op library is loaded (the submodules only use the ops at call time): through
# amp.install, which keeps amp.init()'s wrappers and registers our ops with AMP.
amp.install(_load)
_symbolic.install()  # shape placeholders for shapeless parameter variables (see _symbolic.py)
_onnx()  # ONNX export of the gn_mx ops via mx.onnx.export_model, when onnx is installed

__version__ = "0.1.0"
__all__ = ["DecorrelatedBatchNorm", "GroupNorm", "SyncDecorrelatedBatchNorm", "build_info", "convert", "convert_symbol",
           "library_path", "norm_layer", "ops", "parallel", "replace_norm", "sym",
           "sync", "sync_running_stats", "__version__", "WSConv1D", "WSConv2D", "WSConv3D",
           "standardize_convs", "ws"]
