"""gn_mx's uses of private MXNet names are checked at import (python/gn_mx/_compat.py)."""
from conftest import run_python

import gn_mx
from gn_mx import _compat


def test_this_mxnet_has_every_internal():
    assert _compat._missing() == []
    assert _compat.check() == _compat.TESTED_MXNET


def test_missing_internal_fails_at_import_naming_it():
    r = run_python("""
        from mxnet.gluon import block
        del block.HybridBlock._build_cache      # as if MXNet had renamed it
        from mxnet.contrib.amp import amp
        del amp._wrap_symbol_functions
        from mxnet.gluon import Trainer
        del Trainer._init_params
        try:
            import gn_mx
        except ImportError as e:
            print("ERR", e)
        else:
            print("IMPORTED")
    """, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ERR" in r.stdout, r.stdout
    assert "HybridBlock._build_cache" in r.stdout and "_wrap_symbol_functions" in r.stdout
    assert "Trainer._init_params" in r.stdout
    assert "mxnet==1.9.1" in r.stdout
