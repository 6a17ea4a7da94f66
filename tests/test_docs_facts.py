"""Facts the documentation states about the library, checked against the loaded library (the docs'
code blocks are run by test_docs.py; these are the statements in prose and tables):

- every op of the op contract's table (docs/reference/ops.md, "The ops at a glance") is registered,
  its attributes are exactly those the library accepts (the op's own "unknown attribute ...;
  expected one of: ..." list), each takes its documented default (same output as leaving it
  out), and it has the documented number of outputs;
- the keys of the build_info() example in docs/install.md are the keys build_info() returns;
- the SymbolBlock.imports warning docs/reference/errors.md explains is MXNet's, for any model, and
  the warning-free load it shows gives the same output without warnings.
"""
import ast
import json
import os
import re

import numpy as np
import pytest

import mxnet as mx
import gn_mx
from conftest import ROOT, run_python


def _read(rel):
    return open(os.path.join(ROOT, rel), encoding="utf-8").read()


def contract_table():
    """{op: ({attribute: documented default}, [output names])} from the table."""
    text = _read("docs/reference/ops.md")
    start = text.index("## The ops at a glance")
    rows = {}
    for line in text[start:].split("\n")[2:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("[`"):
            continue
        ops = re.findall(r"`(\w+)`", cells[0])
        if len(ops) != 1:  # the second-derivative row: attributes "as the forward op"
            continue
        attrs = {name: value.strip("`'\"")
                 for name, value in re.findall(r"`(\w+)` \(([^)]*)\)", cells[3])}
        outputs = [o for o in re.findall(r"`([^`]+)`", cells[4]) if re.fullmatch(r"\w+", o)]
        rows[ops[0]] = (attrs, outputs)
    return rows


CONTRACT = contract_table()


def test_contract_table_parsed():
    assert set(CONTRACT) == {"gn_moments", "gn_group_norm", "gn_channel_affine", "gn_dbn",
                             "gn_dbn_inference", "gn_weight_standardize"}, CONTRACT
    assert CONTRACT["gn_dbn"][0] == {"num_groups": "1", "eps": "1e-5", "momentum": "0.9",
                                     "affine": "False", "whitening": "zca", "iterations": "5"}


def test_every_op_is_in_the_contract_table():
    """Every op of the library (gn_mx._library.OPS) has a row of the table, its own or shared (the
    synchronized-DBN ops' row links their section)."""
    from gn_mx._library import OPS
    text = _read("docs/reference/ops.md")
    table = text[text.index("## The ops at a glance"):]
    table = table[:table.index("\n## ", 3)]
    named = {op for line in table.splitlines() if line.startswith("| [")
             for op in re.findall(r"`(\w+)`", line.split("|")[1])}
    assert set(OPS) <= named, set(OPS) - named


def _inputs(op):
    """Inputs for one call of op with its default attributes (fresh aux states each call)."""
    rs = np.random.RandomState(0)
    x = mx.nd.array(rs.randn(6, 4, 3), dtype=np.float64)
    if op in ("gn_moments",):
        return [x]
    if op == "gn_weight_standardize":  # weight (O, I, k) and gain (O,)
        return [x, mx.nd.array(rs.rand(6) + 0.5, dtype=np.float64)]
    if op in ("gn_group_norm", "gn_channel_affine"):
        return [x, mx.nd.array(rs.rand(4) + 0.5, dtype=np.float64),
                mx.nd.array(rs.randn(4), dtype=np.float64)]
    return [x, mx.nd.zeros(4, dtype=np.float64),
            mx.nd.array(np.eye(4)[None] * 1.5, dtype=np.float64)]  # affine=False: no gamma/beta


def _call(op, **attrs):
    out = getattr(mx.nd, op)(*_inputs(op), **attrs)
    outs = out if isinstance(out, list) else [out]
    return [o.asnumpy() for o in outs]


@pytest.mark.parametrize("op", sorted(CONTRACT))
def test_documented_attributes_and_defaults(op):
    attrs, outputs = CONTRACT[op]
    assert hasattr(mx.nd, op) and hasattr(mx.sym, op), op
    plain = _call(op)
    assert len(plain) == len(outputs), (op, outputs)
    for name, default in attrs.items():
        with_default = _call(op, **{name: default})
        for a, b in zip(plain[:1], with_default[:1]):  # out: the default changes nothing
            np.testing.assert_array_equal(a, b, err_msg=f"{op}: {name}={default}")
    assert set(attrs) == registered_attributes(op), (op, sorted(attrs))


def registered_attributes(op):
    """The attribute names the library's op accepts, from its own error for an unknown one
    (``gn_x: unknown attribute 'num_groupz'; expected one of: a, b``)."""
    with pytest.raises(mx.base.MXNetError) as e:
        _call(op, num_groupz="1")
    m = re.search(rf"{op}: unknown attribute 'num_groupz'; expected one of:([^\n]*)", str(e.value))
    assert m, str(e.value)
    return set(re.split(r"[\s,]+", m.group(1).strip())) - {""}


@pytest.mark.parametrize("op, name, value", [("gn_group_norm", "act_type", "relu"),
                                             ("gn_dbn", "whitening", "iternorm"),
                                             ("gn_dbn", "iterations", "3")])
def test_documented_attribute_values_change_the_output(op, name, value):
    """The attributes are read (a non-default value changes the output), so the default test
    above is not passing because the attribute is ignored."""
    base = {"whitening": "iternorm"} if name == "iterations" else {}
    a = _call(op, **base)[0]
    b = _call(op, **dict(base, **{name: value}))[0]
    assert np.abs(a - b).max() > 1e-6, (op, name, value)


def build_info_example():
    """The dict of the build_info() example in docs/install.md (``...`` is an Ellipsis)."""
    text = _read("docs/install.md")
    start = text.index("## `gn_mx.build_info()`")
    m = re.search(r"```text\n(\{.*?\})\n```", text[start:], re.S)
    assert m, "no ```text block with a dict after the build_info() heading"
    return ast.literal_eval(m.group(1))


def test_build_info_keys_are_the_documented_ones():
    doc = build_info_example()
    info = gn_mx.build_info()
    assert set(doc) == set(info), (sorted(doc), sorted(info))
    for key, value in doc.items():  # the same kinds of value (cuda: None on CPU-only builds)
        if key == "cuda" and info["cuda"] is None:
            continue
        assert type(info[key]) is type(value), (key, value, info[key])
    assert set(doc["cuda"]) == {"runtime", "sass", "ptx"}
    if info["cuda"] is not None:
        assert set(info["cuda"]) == set(doc["cuda"])


def test_imports_warning_is_mxnets_and_the_documented_fix(tmp_path):
    """docs/reference/errors.md: SymbolBlock.imports warns 'Cannot decide type ... data: None' for
    any model (a BatchNorm model in a process without gn_mx), gn_mx adds no warning of its own, and
    a SymbolBlock built with a typed input loads the same model without warnings and gives the
    same output. The documented message filter hides that warning and no other."""
    plain = tmp_path / "plain"
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(4, 1, in_channels=3), mx.gluon.nn.BatchNorm(in_channels=4))
    net.initialize()
    net.hybridize()
    net(mx.nd.ones((1, 3, 4, 4)))
    net.export(str(plain))
    gnm = tmp_path / "gnm"
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(4, 1, in_channels=3), gn_mx.GroupNorm(num_groups=2),
            gn_mx.DecorrelatedBatchNorm(num_groups=2))
    net.initialize()
    net.hybridize()
    net(mx.nd.ones((1, 3, 4, 4)))
    net.export(str(gnm))
    code = f"""
        import json, sys, warnings
        import numpy as np
        import mxnet as mx
        if sys.argv[-1] == 'gn':
            import gn_mx
        prefix = {str(plain)!r} if sys.argv[-1] == 'plain' else {str(gnm)!r}
        x = mx.nd.array(np.random.RandomState(0).randn(2, 3, 4, 4))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            blk = mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'],
                                               prefix + '-0000.params')
        a = blk(x).asnumpy()
        print('IMPORTS', json.dumps([str(m.message) for m in w]))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            sym = mx.sym.load(prefix + '-symbol.json')
            blk = mx.gluon.SymbolBlock(sym, mx.sym.var('data', dtype='float32'))
            blk.collect_params().load(prefix + '-0000.params', ctx=mx.cpu())
            b = blk(x).asnumpy()
        print('TYPED', json.dumps([str(m.message) for m in w]), float(np.abs(a - b).max()))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            warnings.filterwarnings('ignore', message='Cannot decide type for the following '
                                                      'arguments')
            mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'],
                                         prefix + '-0000.params')
            warnings.warn('another warning')
        print('FILTERED', json.dumps([str(m.message) for m in w]))
    """
    msg = "Cannot decide type for the following arguments. Consider providing them as input:"
    for which in ("plain", "gn"):
        p = run_python(code.replace("sys.argv[-1]", repr(which)))
        assert p.returncode == 0, p.stdout + p.stderr[-3000:]
        lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in p.stdout.splitlines()
                 if ln.split(" ", 1)[0] in ("IMPORTS", "TYPED", "FILTERED")}
        imports = json.loads(lines["IMPORTS"])
        assert len(imports) == 1 and imports[0].startswith(msg) and "data: None" in imports[0], \
            (which, imports)
        typed, err = lines["TYPED"].rsplit(" ", 1)
        assert json.loads(typed) == [] and float(err) == 0.0, (which, lines["TYPED"])
        assert json.loads(lines["FILTERED"]) == ["another warning"], (which, lines["FILTERED"])
