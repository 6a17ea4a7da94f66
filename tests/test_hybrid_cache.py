"""The keyed CachedOps of hybridized blocks (python/gn_mx/_hybrid.py): one cache per training mode
for graphs that depend on it, every cache rebuilt when the accumulating parameters change; and the
package layering that keeps MXNet's private names in _compat.py and the library load in one place.
Behaviour through the public API (values, gradients, export) is tested in test_blocks.py,
test_dbn_blocks.py and test_export.py."""
import ast
import os

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from gn_mx import _compat, _hybrid
from conftest import ROOT

CPU = mx.cpu()
PKG = os.path.join(ROOT, "python", "gn_mx")


def _op(blk):
    return _compat.hybrid_cache(blk).op


def _train(blk, x):
    with autograd.record():
        y = blk(x)
    y.backward()


def _dbn_net():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Dense(6, flatten=False, in_units=6))
        # momentum 1: the running statistics (hence the predictions) stay fixed in training
        net.add(gn_mx.DecorrelatedBatchNorm(num_groups=2, in_channels=6, momentum=1.0))
    net.initialize(ctx=CPU)
    net.hybridize()
    return net


def test_mode_keyed_only_where_the_graph_depends_on_the_mode():
    x = mx.nd.random.normal(shape=(8, 6, 6))
    net = _dbn_net()  # the parent owns the CachedOp of the traced DBN
    gn = gn_mx.GroupNorm(num_groups=2)
    frozen = gn_mx.DecorrelatedBatchNorm(num_groups=2, use_global_stats=True)
    for blk in (gn, frozen):
        blk.initialize(ctx=CPU)
        blk.hybridize()
    for blk in (net, gn, frozen):
        _train(blk, x)
    assert _hybrid.is_mode_keyed(net)
    assert not _hybrid.is_mode_keyed(gn) and not _hybrid.is_mode_keyed(frozen)
    net.hybridize()  # clears every cache, and what the graph was found to depend on
    assert not _hybrid.is_mode_keyed(net)


def test_mode_switches_reuse_each_modes_cached_op():
    x = mx.nd.random.normal(shape=(8, 6, 6))
    net = _dbn_net()
    _train(net, x)
    train_op = _op(net)
    y_pred = net(x)
    pred_op = _op(net)
    assert pred_op is not train_op
    for _ in range(2):
        _train(net, x)
        assert _op(net) is train_op
        np.testing.assert_allclose(net(x).asnumpy(), y_pred.asnumpy(), rtol=1e-5, atol=1e-5)
        assert _op(net) is pred_op


def test_grad_req_change_rebuilds_every_mode():
    x = mx.nd.random.normal(shape=(8, 6, 6))
    net = _dbn_net()
    _train(net, x)
    train_op = _op(net)
    net(x)
    pred_op = _op(net)
    net.collect_params().setattr("grad_req", "add")
    _train(net, x)
    assert _op(net) is not train_op
    net(x)
    assert _op(net) is not pred_op


@pytest.mark.parametrize("static", [False, True], ids=["plain", "static_alloc"])
def test_unkeyed_block_keeps_its_cached_op(static):
    """GroupNorm's graph does not depend on the mode: one CachedOp serves both."""
    blk = gn_mx.GroupNorm(num_groups=2)
    blk.initialize(ctx=CPU)
    blk.hybridize(static_alloc=static)
    x = mx.nd.random.normal(shape=(2, 4, 5))
    _train(blk, x)
    op = _op(blk)
    blk(x)
    _train(blk, x)
    assert _op(blk) is op


def _modules():
    """(file name, parsed module) of every module of the package."""
    for name in sorted(os.listdir(PKG)):
        if name.endswith(".py"):
            with open(os.path.join(PKG, name)) as f:
                yield name, ast.parse(f.read())


def _attributes(tree):
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def _imported(tree):
    """(module, name) of every ``from module import name`` (relative: '.module')."""
    return {("." * n.level + (n.module or ""), a.name) for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) for a in n.names}


def test_private_hybridblock_names_only_in_compat():
    """HybridBlock's private methods and cache attributes are reached in _compat.py alone."""
    private = {n for n in _compat.HYBRID_METHODS + _compat.HYBRID_CACHE_ATTRS if n.startswith("_")}
    hits = {}
    for name, tree in _modules():
        if name == "_compat.py":
            continue
        found = sorted(_attributes(tree) & private)
        found += [f"{m}.{n}" for m, n in _imported(tree) if m == "mxnet.gluon" and n == "block"]
        found += [m for m, _ in _imported(tree) if m == "mxnet.gluon.block"]
        if found:
            hits[name] = found
    assert not hits, hits


def test_library_loaded_in_one_place():
    """mx.library.load is called by _library.load alone, and only __init__.py uses that (through
    amp.install): no other module loads the library on import."""
    callers = [name for name, tree in _modules()
               if ("._library", "load") in _imported(tree)
               or any(isinstance(n, ast.Attribute) and n.attr == "load"
                      and isinstance(n.value, ast.Name) and n.value.id == "_library"
                      for n in ast.walk(tree))]
    assert callers == ["__init__.py"], callers
    loaders = [name for name, tree in _modules()
               if any(isinstance(n, ast.Attribute) and n.attr == "load"
                      and isinstance(n.value, ast.Attribute) and n.value.attr == "library"
                      for n in ast.walk(tree))]
    assert loaders == ["_library.py"], loaders
