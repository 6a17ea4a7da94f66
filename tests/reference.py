"""Re-export of python/gn_mx/_reference.py (its one home: the wheel ships it for python -m gn_mx.selftest).
Loaded without importing gn_mx (and so MXNet): see tests/pkg_shared.py."""
import sys

from pkg_shared import load

sys.modules[__name__] = load("_reference")
