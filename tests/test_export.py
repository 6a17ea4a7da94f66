"""Export and reload of both blocks: the exported symbol's ops and attributes, and reloading in a
fresh interpreter (which must `import gn_mx` first) or in this one gives the same outputs.

The GroupNorm net helpers come from test_blocks.py, the DecorrelatedBatchNorm ones from
test_dbn_blocks.py. GroupNorm(activation=...)'s export is checked with its block test there.
"""
import json

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import gn_mx
from conftest import dbn_data as _data, run_python, reload_outputs
from test_blocks import _net
from test_dbn_blocks import CPU, _dbn_layer, _net as _dbn_net, _stats_of, _train_step


# ---------------------------------------------------------------------------------------------
# GroupNorm


def test_export_reload_in_fresh_process(tmp_path, ctx):
    net = _net(gamma_initializer=mx.init.Uniform(1.0), beta_initializer=mx.init.Uniform(1.0))
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    x = mx.nd.random.normal(shape=(2, 3, 6, 6), ctx=ctx)
    y = net(x).asnumpy()
    prefix = str(tmp_path / "gnnet")
    net.export(prefix, epoch=0)
    ops = {n["op"] for n in json.load(open(prefix + "-symbol.json"))["nodes"]}
    assert "gn_group_norm" in ops
    np.testing.assert_allclose(reload_outputs(prefix, [x.asnumpy()])[0], y, rtol=0, atol=1e-5)


def test_reload_without_import_fails_clearly(tmp_path):
    """Documented behaviour: a process must `import gn_mx` before loading a gn_mx symbol."""
    blk = gn_mx.GroupNorm(num_groups=2)
    blk.initialize()
    blk.hybridize()
    blk(mx.nd.ones((1, 4, 3)))
    prefix = str(tmp_path / "gn")
    blk.export(prefix)
    p = run_python(f"""
        import mxnet as mx
        try:
            mx.sym.load({prefix + '-symbol.json'!r})
            print('LOADED')
        except mx.base.MXNetError as e:
            print('MXNetError', 'gn_group_norm' in str(e))
    """)
    assert p.returncode == 0 and "MXNetError True" in p.stdout, p.stdout + p.stderr[-2000:]


def test_plain_block_exports_no_act_type(tmp_path):
    blk = gn_mx.GroupNorm(num_groups=2)
    blk.initialize()
    blk.hybridize()
    blk(mx.nd.ones((1, 4, 3)))
    blk.export(str(tmp_path / "gn"))
    nodes = json.load(open(str(tmp_path / "gn-symbol.json")))["nodes"]
    gn = [n for n in nodes if n["op"] == "gn_group_norm"][0]
    assert "act_type" not in gn["attrs"]
    with pytest.raises(ValueError, match="activation"):
        gn_mx.GroupNorm(num_groups=2, activation="tanh")


# ---------------------------------------------------------------------------------------------
# DecorrelatedBatchNorm


def _hybrid_dbn_net():
    """The DBN test net, Xavier-initialized on the CPU and hybridized, and a (4, 4, 6, 6) input."""
    net = _dbn_net()
    net.initialize(mx.init.Xavier(), ctx=CPU)
    net.hybridize()
    return net, mx.nd.array(_data((4, 4, 6, 6), np.float32))


def test_export_writes_inference_graph_and_reloads(tmp_path):
    net, x = _hybrid_dbn_net()
    for _ in range(3):
        _train_step(net, x)  # the last call before export is a training call
    expected = net(x).asnumpy()
    _train_step(net, x)
    expected_after = net(x).asnumpy()
    assert np.abs(expected - expected_after).max() > 0
    prefix = str(tmp_path / "dbn_net")
    # Export straight after a training call: the block must still write the inference graph.
    _train_step(net, x)
    stats = _stats_of(net)
    net.export(prefix)
    expected = net(x).asnumpy()
    graph = json.load(open(prefix + "-symbol.json"))
    ops = [n["op"] for n in graph["nodes"]]
    assert "gn_dbn_inference" in ops and "gn_dbn" not in ops
    sym = mx.sym.load(prefix + "-symbol.json")
    aux = sym.list_auxiliary_states()
    assert any(a.endswith("running_mean") for a in aux)
    assert any(a.endswith("running_projection") for a in aux)
    for a, b in zip(_stats_of(net), stats):  # exporting touched no statistics
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(reload_outputs(prefix, [x.asnumpy()])[0], expected, rtol=1e-5,
                               atol=1e-5)


def test_export_static_alloc_after_training_steps(tmp_path):
    """static_alloc: the last training step's running-statistics update must be in the file."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(8, 3), gn_mx.DecorrelatedBatchNorm(num_groups=2),
                gluon.nn.Dense(3))
    net.initialize(ctx=CPU)
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.random.normal(shape=(4, 3, 8, 8))
    net(x)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    for _ in range(3):
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(4)
    expected = net(x)  # no sync before export: the update may still be pending
    prefix = str(tmp_path / "static")
    net.export(prefix)
    reloaded = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    np.testing.assert_allclose(reloaded(x).asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-5)


def test_export_after_eval_then_training_continues(tmp_path):
    net, x = _hybrid_dbn_net()
    net(x)
    net.export(str(tmp_path / "m"))
    y1, _, _ = _train_step(net, x)  # training still uses batch statistics after export
    blk = _dbn_layer(net)
    assert np.abs(blk.running_mean.data().asnumpy()).max() > 0


def test_export_when_only_training_ran(tmp_path):
    """No inference call before export: the inference graph is traced for the export."""
    net, x = _hybrid_dbn_net()
    for _ in range(2):
        _train_step(net, x)
    prefix = str(tmp_path / "train_only")
    net.export(prefix)
    ops = [n["op"] for n in json.load(open(prefix + "-symbol.json"))["nodes"]]
    assert "gn_dbn_inference" in ops and "gn_dbn" not in ops
    expected = net(x).asnumpy()
    reloaded = gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"], prefix + "-0000.params")
    np.testing.assert_allclose(reloaded(x).asnumpy(), expected, rtol=1e-5, atol=1e-5)
    y_train, _, _ = _train_step(net, x)  # and training continues with batch statistics
    imp = _dbn_net()
    imp.initialize(ctx=CPU)
    f = str(tmp_path / "p.params")
    net.save_parameters(f)
    imp.load_parameters(f, ctx=CPU)
    with autograd.train_mode():
        np.testing.assert_allclose(net(x).asnumpy(), imp(x).asnumpy(), rtol=1e-5, atol=1e-5)
