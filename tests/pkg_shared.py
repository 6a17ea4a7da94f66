"""Load a module of python/gn_mx that must serve the tests too, WITHOUT importing gn_mx itself.

gn_mx/__init__.py imports MXNet and loads the op library; the GPU tests (tests/gpu: the harness on a
real GPU, the CPU emulator, the simulator) have neither. The numpy-only modules that the package
ships for ``python -m gn_mx.selftest`` (_edge_cases, _reference, _tolerances) are therefore loaded
from the source tree under a private package name, so each has one home and the tests keep their
``import edge_cases`` / ``from reference import ...``.
"""
import importlib
import os
import sys
import types

_PKG = "_gn_mx_src"
_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "gn_mx")


def load(name):
    """The module python/gn_mx/<name>.py (its relative imports resolve among its siblings)."""
    if _PKG not in sys.modules:
        pkg = types.ModuleType(_PKG)
        pkg.__path__ = [_DIR]
        sys.modules[_PKG] = pkg
    return importlib.import_module(f"{_PKG}.{name}")
