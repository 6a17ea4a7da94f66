"""Locate libgn_mx.so and load it into MXNet exactly once per process."""
import os
import threading

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


def load():
    """Load the library into MXNet (idempotent, thread-safe) and return its path."""
    mx = _import_mxnet()
    path = library_path()
    with _lock:
        # The marker lives on the mxnet module so that a reloaded gn_mx does not load twice:
        # MXNet refuses to register the same op names again.
        if getattr(mx, "_gn_mx_library", None) == path:
            return path
        mx.library.load(path, verbose=False)
        mx._gn_mx_library = path
    return path
