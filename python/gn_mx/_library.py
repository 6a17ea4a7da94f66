"""Locate libgn_mx.so and load it into MXNet once per process (nothing is stored on `mxnet`)."""
import importlib
import importlib.util
import os
import sys
import threading
import warnings

_LIB_NAME = "libgn_mx.so"
_lock = threading.Lock()

_INSTALL_HINT = ("install MXNet 1.9 first: pip install 'mxnet==1.9.1' 'numpy<1.24' "
                 "(CPU) or pip install 'mxnet-cu112==1.9.1' 'numpy<1.24' (CUDA 11.2)")


def library_path():
    """Absolute path of the gn_mx op library (raises if it was never built)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)
    if not os.path.exists(path):
        raise ImportError(
            f"gn_mx: the op library {path} is missing; build it with "
            "`pip install --no-build-isolation .` (or `-e .`) from the gn_mx source tree")
    return path


def _import_mxnet():
    try:
        import mxnet
    except ImportError as e:
        raise ImportError(f"gn_mx needs MXNet 1.9, but `import mxnet` failed ({e}); "
                          + _INSTALL_HINT) from None
    version = getattr(mxnet, "__version__", "?")
    if not version.startswith("1.9"):
        raise ImportError(f"gn_mx needs MXNet 1.9, found mxnet {version}; " + _INSTALL_HINT)
    return mxnet


#: The ops libgn_mx.so registers (shared/API.md); all of them present = the library is loaded.
OPS = ("gn_moments", "gn_group_norm", "gn_dbn", "gn_dbn_inference", "gn_channel_affine")


def ops_registered(mx=None):
    """True when every gn_mx op is already in ``mx.nd`` and ``mx.sym``.

    That is the case after ``import gn_mx`` and after a direct ``mx.library.load(library_path())``
    (MXNet regenerates ``mx.nd`` / ``mx.sym`` from its op registry after each load).
    """
    mx = mx or _import_mxnet()
    return all(hasattr(mx.nd, n) and hasattr(mx.sym, n) for n in OPS)


def load():
    """Load the library into MXNet (idempotent, thread-safe) and return its path.

    Loading is skipped when the ops are already registered, whoever loaded them (an earlier
    ``import gn_mx``, a reloaded ``gn_mx`` module, or the user's own ``mx.library.load``): the op
    library itself also registers its ops only once per process (src/link/register_once.cc), so a
    repeated ``mx.library.load`` of it is harmless too, but skipping also keeps MXNet from
    regenerating every op function (and dropping wrappers installed on them).
    """
    mx = _import_mxnet()
    path = library_path()
    with _lock:
        if not ops_registered(mx):
            mx.library.load(path, verbose=False)
    return path


def register_onnx_converters():
    """Register gn_mx's ONNX converters (``gn_mx.onnx``) with MXNet's exporter if onnx is there.

    Called by ``import gn_mx``. Cheap: ``import mxnet`` has already imported onnx when it is
    installed. Returns whether the converters are registered; never raises (ONNX export is
    optional: a broken onnx install gives a warning, not a failed ``import gn_mx``).
    """
    mod = sys.modules.get("onnx", False)
    if mod is None or (mod is False and importlib.util.find_spec("onnx") is None):
        return False  # onnx not installed (or deliberately hidden)
    try:
        importlib.import_module(__package__ + ".onnx")
    except Exception as e:  # noqa: BLE001 - optional feature, keep `import gn_mx` working
        warnings.warn(f"gn_mx: ONNX export converters not registered ({type(e).__name__}: {e})")
        return False
    return True
