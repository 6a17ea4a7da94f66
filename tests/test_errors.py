"""Bad input gives a clear MXNetError naming the problem, and the process keeps running.

Each case runs in a fresh interpreter: a segfault or abort would show up as a bad exit code.
"""
import pytest

from conftest import run_python

PRELUDE = """
import mxnet as mx, gn_mx
x = mx.nd.ones((2, 6, 4))
g, b = mx.nd.ones((6,)), mx.nd.zeros((6,))
"""

CASES = {
    "channels_not_divisible": ("mx.nd.gn_group_norm(x, g, b, num_groups=4)",
                               "channels (C=6) must be divisible by num_groups (4)"),
    "num_groups_zero": ("mx.nd.gn_group_norm(x, g, b, num_groups=0)",
                        "num_groups must be positive; got 0"),
    "num_groups_negative": ("mx.nd.gn_moments(x, num_groups=-2)",
                            "num_groups must be positive; got -2"),
    "num_groups_not_int": ("mx.nd.gn_group_norm(x, g, b, num_groups='two')",
                           "num_groups must be an integer; got 'two'"),
    "eps_negative": ("mx.nd.gn_group_norm(x, g, b, num_groups=2, eps=-1e-5)",
                     "eps must be a finite number >= 0"),
    "eps_nan": ("mx.nd.gn_group_norm(x, g, b, num_groups=2, eps=float('nan'))",
                "eps must be a finite number >= 0"),
    "unknown_attribute": ("mx.nd.gn_group_norm(x, g, b, num_group=2)",
                          "unknown attribute 'num_group'"),
    "gamma_wrong_shape": ("mx.nd.gn_group_norm(x, mx.nd.ones((3,)), b, num_groups=2)",
                          "gamma must have shape (6,) for data shape (2, 6, 4); got (3,)"),
    "beta_wrong_rank": ("mx.nd.gn_group_norm(x, g, mx.nd.zeros((6, 1)), num_groups=2)",
                        "beta must have shape (6,)"),
    "gamma_wrong_dtype": ("mx.nd.gn_group_norm(x, g.astype('float64'), b, num_groups=2)",
                          "gamma dtype must equal the data dtype"),
    "fp32_data_fp16_params": ("mx.nd.gn_group_norm(x, g.astype('float16'), b.astype('float16'))",
                              "got gamma float16 with data float32"),
    "integer_data": ("mx.nd.gn_group_norm(x.astype('int32'), g, b, num_groups=2)",
                     "data must be float16, float32 or float64; got int32"),
    "integer_data_moments": ("mx.nd.gn_moments(x.astype('uint8'), num_groups=2)",
                             "data must be float16, float32 or float64; got uint8"),
    "one_dim_data": ("mx.nd.gn_group_norm(mx.nd.ones((6,)), g, b, num_groups=2)",
                     "data must have at least 2 dims (N, C, *spatial); got shape (6,)"),
    "affine_wrong_gamma_shape": ("mx.nd.gn_channel_affine(x, mx.nd.ones((5,)), b)",
                                 "gn_channel_affine: gamma must have shape (6,)"),
    "affine_integer_data": ("mx.nd.gn_channel_affine(x.astype('int64'), g, b)",
                            "gn_channel_affine: data must be float16, float32 or float64; got int64"),
    "head_grad_wrong_dtype": (
        "x64 = x.astype('float64'); x64.attach_grad()\n"
        "    with mx.autograd.record():\n"
        "        o = mx.nd.gn_group_norm(x64, g.astype('float64'), b.astype('float64'), num_groups=2)[0]\n"
        "    o.backward(mx.nd.ones((2, 6, 4), dtype='float32')); r = x64.grad",
        "the gradient of output 'out' must be float64; got float32"),
    "symbolic_bad_groups": (
        "mx.sym.gn_group_norm(mx.sym.var('d'), mx.sym.var('g'), mx.sym.var('b'), num_groups=4)"
        ".infer_shape(d=(2, 6, 4))",
        "channels (C=6) must be divisible by num_groups (4)"),
    "block_bad_groups_in_graph": (
        "n = gn_mx.GroupNorm(num_groups=4); n.initialize(); n.hybridize(); n(x)",
        "channels (C=6) must be divisible by num_groups (4)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_and_process_survives(name):
    stmt, expected = CASES[name]
    code = PRELUDE + f"""
try:
    r = {stmt}
    if isinstance(r, (list, tuple)):
        r[0].wait_to_read()
    elif hasattr(r, 'wait_to_read'):
        r.wait_to_read()
    print('NO ERROR')
except mx.base.MXNetError as e:
    print('MXNetError:', str(e))
except ValueError as e:  # Gluon wraps deferred-init failures in ValueError, message included
    print('ValueError:', str(e))
y = mx.nd.gn_group_norm(x, g, b, num_groups=2)[0].asnumpy()
print('SURVIVED', y.shape)
"""
    p = run_python(code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SURVIVED (2, 6, 4)" in p.stdout
    assert "NO ERROR" not in p.stdout
    assert expected in p.stdout, p.stdout[-3000:]


@pytest.mark.parametrize("kwargs, expected", [
    ("num_groups=0", "num_groups must be a positive integer"),
    ("num_groups=2.5", "num_groups must be a positive integer"),
    ("epsilon=-1.0", "epsilon must be a finite number >= 0"),
    ("num_groups=4, in_channels=6", "in_channels (6) must be divisible by num_groups (4)"),
])
def test_block_constructor_validates(kwargs, expected):
    import gn_mx
    with pytest.raises(ValueError) as e:
        eval(f"gn_mx.GroupNorm({kwargs})")
    assert expected in str(e.value)


def test_missing_library_message(tmp_path):
    """A gn_mx whose library was never built says how to build it."""
    import shutil, os
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "gn_mx")
    dst = tmp_path / "gn_mx"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    p = run_python("import gn_mx", cwd=str(tmp_path))
    assert p.returncode != 0
    assert "op library" in p.stderr and "pip install --no-build-isolation" in p.stderr
