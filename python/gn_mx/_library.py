"""Locate libgn_mx.so and load it into MXNet once per process (nothing is stored on `mxnet`)."""
import ctypes
import importlib
import importlib.util
import os
import re
import sys
import threading
import warnings

_LIB_NAME = "libgn_mx.so"
_lock = threading.Lock()

_INSTALL_HINT = ("install MXNet 1.9 first: pip install 'mxnet==1.9.1' 'numpy<1.24' "
                 "(CPU) or pip install 'mxnet-cu112==1.9.1' 'numpy<1.24' (CUDA 11.2)")


def library_path():
    """Absolute path of the gn_mx op library, libgn_mx.so.

    What ``mx.library.load`` takes, and what a C/C++ deployment (``MXLoadLib``) loads before
    reading an exported model.

    Returns
    -------
    str
        The path of libgn_mx.so next to the gn_mx package.

    Raises
    ------
    ImportError
        The library was never built (a source tree without ``pip install``).

    Examples
    --------
    >>> import os
    >>> os.path.basename(gn_mx.library_path())
    'libgn_mx.so'
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)
    if not os.path.exists(path):
        raise ImportError(
            f"gn_mx: the op library {path} is missing; build it with "
            "`pip install --no-build-isolation .` (or `-e .`) from the gn_mx source tree")
    return path


#: The MXNet release series this gn_mx supports (lib_api's C ABI changes between releases).
SUPPORTED_MXNET = "1.9"


def build_info():
    """What the loaded op library was built with, read from the library itself.

    Returns a dict: ``version`` (gn_mx), ``mxnet`` (the MXNet it was built against), ``lib_api``
    (MXNet's op-library ABI version, an int), ``compiler``, ``build_type``, ``cpu_isa`` (the CPU
    code paths compiled in) and ``cpu_isa_active`` (the one this CPU runs), ``openmp`` (OpenMP
    version, 0 = none), ``cuda`` (``None`` for a CPU-only build, else ``{"runtime": "11.8",
    "sass": ["sm_50", ...], "ptx": ["compute_90"]}``: the CUDA runtime linked in statically and the
    GPU architectures with native code / PTX) and ``summary``, one line of all that. Works without
    MXNet being imported (ctypes reads ``gnmx_build_info`` from libgn_mx.so); see docs/install.md.

    Returns
    -------
    dict
        The keys above.

    Raises
    ------
    ImportError
        The library was never built (from :func:`library_path`).

    Examples
    --------
    >>> info = gn_mx.build_info()
    >>> info['version'] == gn_mx.__version__, info['mxnet']
    (True, 'mxnet 1.9.1')
    >>> sorted(info)  # doctest: +NORMALIZE_WHITESPACE
    ['build_type', 'compiler', 'cpu_isa', 'cpu_isa_active', 'cuda', 'lib_api', 'mxnet', 'openmp',
     'summary', 'version']
    """
    lib = ctypes.CDLL(library_path())
    fn = lib.gnmx_build_info
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    kv = dict(line.split("=", 1) for line in fn().decode().splitlines() if "=" in line)
    info = {k: kv.get(k, "") for k in ("version", "mxnet", "compiler", "build_type",
                                        "cpu_isa_active")}
    info["lib_api"] = int(kv.get("lib_api") or 0)
    info["openmp"] = int(kv.get("openmp") or 0)
    info["cpu_isa"] = [x for x in kv.get("cpu_isa", "").split(",") if x]
    cuda = None
    if kv.get("cuda_runtime"):
        sass, ptx = [], []
        for a in filter(None, kv.get("cuda_archs", "").split(",")):
            num = a.split("-")[0]
            if not a.endswith("-virtual"):
                sass.append("sm_" + num)
            if not a.endswith("-real"):
                ptx.append("compute_" + num)
        cuda = {"runtime": kv["cuda_runtime"], "sass": sass, "ptx": ptx}
    info["cuda"] = cuda
    dev = (f"CUDA {cuda['runtime']} ({', '.join(cuda['sass'])}; PTX {', '.join(cuda['ptx'])})"
           if cuda else "CPU only")
    info["summary"] = (f"gn_mx {info['version']}: {dev}; CPU {'+'.join(info['cpu_isa'])} "
                       f"(using {info['cpu_isa_active']}), OpenMP {info['openmp'] or 'off'}; "
                       f"built against {info['mxnet']} (lib_api {info['lib_api']}) with "
                       f"{info['compiler']}")
    return info


def mxnet_lib_api_version(mxnet):
    """MX_LIBRARY_VERSION of the installed MXNet (from the lib_api.h its wheel ships), or None."""
    header = os.path.join(os.path.dirname(os.path.abspath(mxnet.__file__)), "include", "mxnet",
                          "lib_api.h")
    try:
        with open(header) as f:
            m = re.search(r"^#define MX_LIBRARY_VERSION (\d+)", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def check_mxnet(mx_version, mx_lib_api, info):
    """The ImportError message for an MXNet this library cannot serve, or None when it can.

    ``mx_version``: the installed ``mxnet.__version__``; ``mx_lib_api``: its lib_api version (None:
    unknown); ``info``: :func:`build_info` of the library.
    """
    required = (f"gn_mx {info['version']} needs MXNet {SUPPORTED_MXNET} (it was built against "
                f"{info['mxnet']}, lib_api version {info['lib_api']})")
    if not str(mx_version).startswith(SUPPORTED_MXNET + "."):
        return (f"{required}, but mxnet {mx_version} is installed (lib_api version "
                f"{mx_lib_api if mx_lib_api is not None else 'unknown'}); " + _INSTALL_HINT)
    if mx_lib_api is not None and mx_lib_api != info["lib_api"]:
        return (f"{required}, but the installed mxnet {mx_version} has lib_api version "
                f"{mx_lib_api}; " + _INSTALL_HINT)
    return None


def _import_mxnet():
    try:
        import mxnet
    except ImportError as e:
        raise ImportError(f"gn_mx needs MXNet {SUPPORTED_MXNET}, but `import mxnet` failed ({e}); "
                          + _INSTALL_HINT) from None
    version = getattr(mxnet, "__version__", "?")
    if not version.startswith(SUPPORTED_MXNET + "."):
        raise ImportError(check_mxnet(version, mxnet_lib_api_version(mxnet), build_info()))
    return mxnet


#: The ops libgn_mx.so registers (docs/reference/ops.md); all of them present = the library is loaded.
#: The one list: the fuzz and robustness suites (tests/fuzz_worker.py, tests/test_robust.py) and the
#: self-test read it, so an op added here is fuzzed and checked there too. The last five are the
#: synchronized-DBN ops (python/gn_mx/sync.py; CPU only).
OPS = ("gn_moments", "gn_group_norm", "gn_dbn", "gn_dbn_inference", "gn_channel_affine",
       "gn_weight_standardize", "gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply",
       "gn_dbn_local_sums", "gn_dbn_local_cov")


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
            problem = check_mxnet(mx.__version__, mxnet_lib_api_version(mx), build_info())
            if problem:
                raise ImportError(problem)
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
