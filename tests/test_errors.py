"""Bad input gives a clear MXNetError naming the problem, and the process keeps running.

The cases of a family run one after another in one fresh interpreter (conftest.check_bad_inputs):
a segfault or abort shows up as a bad exit code naming the case that was running.
"""
import pytest

from conftest import check_bad_inputs, run_python

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
        "with mx.autograd.record():\n"
        "    o = mx.nd.gn_group_norm(x64, g.astype('float64'), b.astype('float64'), num_groups=2)[0]\n"
        "o.backward(mx.nd.ones((2, 6, 4), dtype='float32')); r = x64.grad",
        "the gradient of output 'out' must be float64; got float32"),
    "symbolic_bad_groups": (
        "mx.sym.gn_group_norm(mx.sym.var('d'), mx.sym.var('g'), mx.sym.var('b'), num_groups=4)"
        ".infer_shape(d=(2, 6, 4))",
        "channels (C=6) must be divisible by num_groups (4)"),
    "block_bad_groups_in_graph": (
        "n = gn_mx.GroupNorm(num_groups=4); n.initialize(); n.hybridize(); n(x)",
        "channels (C=6) must be divisible by num_groups (4)"),
}


DBN_PRELUDE = """
import mxnet as mx, gn_mx
x = mx.nd.ones((2, 6, 4))
rm, rp = mx.nd.zeros((6,)), mx.nd.zeros((2, 3, 3))
"""

DBN_CASES = {
    "channels_not_divisible": ("mx.nd.gn_dbn(x, mx.nd.zeros((6,)), mx.nd.zeros((4, 1, 1)), "
                               "num_groups=4)",
                               "gn_dbn: channels (C=6) must be divisible by num_groups (4)"),
    "num_groups_zero": ("mx.nd.gn_dbn(x, rm, rp, num_groups=0)",
                        "gn_dbn: num_groups must be positive; got 0"),
    "group_size_zero": ("mx.nd.gn_dbn_inference(x, rm, rp, num_groups=12)",
                        "gn_dbn_inference: channels (C=6) must be divisible by num_groups (12)"),
    "wrong_projection_shape": ("mx.nd.gn_dbn(x, rm, mx.nd.zeros((2, 3, 2)), num_groups=2)",
                               "running_projection must have shape (2, 3, 3) for data shape "
                               "(2, 6, 4) and num_groups=2; got (2, 3, 2)"),
    "wrong_mean_shape": ("mx.nd.gn_dbn_inference(x, mx.nd.zeros((3,)), rp, num_groups=2)",
                         "running_mean must have shape (6,)"),
    "integer_data": ("mx.nd.gn_dbn(x.astype('int32'), rm, rp, num_groups=2)",
                     "gn_dbn: data must be float16, float32 or float64; got int32"),
    "stats_dtype_mismatch": ("mx.nd.gn_dbn(x, rm.astype('float64'), rp.astype('float64'), "
                             "num_groups=2)",
                             "running_mean dtype must equal the data dtype"),
    "one_dim_data": ("mx.nd.gn_dbn(mx.nd.ones((6,)), rm, rp, num_groups=2)",
                     "data must have at least 2 dims (N, C, *spatial); got shape (6,)"),
    "eps_zero": ("mx.nd.gn_dbn(x, rm, rp, num_groups=2, eps=0)", "eps must be a finite number > 0"),
    "momentum_out_of_range": ("mx.nd.gn_dbn(x, rm, rp, num_groups=2, momentum=1.5)",
                              "momentum must be in [0, 1]; got 1.5"),
    "unknown_attribute": ("mx.nd.gn_dbn_inference(x, rm, rp, num_groups=2, eps=1e-3)",
                          "gn_dbn_inference: unknown attribute 'eps'"),
    "symbolic_bad_groups": ("mx.sym.gn_dbn(mx.sym.var('d'), mx.sym.var('m'), mx.sym.var('p'), "
                            "num_groups=4).infer_shape(d=(2, 6, 4))",
                            "channels (C=6) must be divisible by num_groups (4)"),
    # Gluon wraps deferred-init shape errors in ValueError; the op's message is inside.
    "block_bad_groups_in_graph": ("n = gn_mx.DecorrelatedBatchNorm(num_groups=4); n.initialize();"
                                  " n.hybridize(); n(x)",
                                  "channels (C=6) must be divisible by num_groups (4)"),
    # The group-size limit (kernels/dbn.h kDbnMaxGroupSizeCpu) fails at shape inference, with the
    # op name once (no "gn_dbn: dbn: ..."), symbolic and imperative, both ops.
    "group_size_over_limit_symbolic": ("mx.sym.gn_dbn(mx.sym.var('d'), mx.sym.var('m'), "
                                       "mx.sym.var('p'), num_groups=2).infer_shape(d=(1, 8194, 1))",
                                       "gn_dbn: group size C/num_groups = 4097 exceeds the cpu "
                                       "limit 4096"),
    "group_size_over_limit_inference": ("mx.sym.gn_dbn_inference(mx.sym.var('d'), mx.sym.var('m'),"
                                        " mx.sym.var('p')).infer_shape(d=(2, 5000))",
                                        "gn_dbn_inference: group size C/num_groups = 5000 exceeds "
                                        "the cpu limit 4096"),
    "group_size_over_limit_imperative": ("mx.nd.gn_dbn(mx.nd.ones((1, 4100, 1)), "
                                         "mx.nd.zeros((4100,)), mx.nd.zeros((1, 1, 1)))",
                                         "gn_dbn: group size C/num_groups = 4100 exceeds the cpu "
                                         "limit 4096"),
}


def test_bad_input_raises_and_process_survives():
    check_bad_inputs(PRELUDE, CASES, "mx.nd.gn_group_norm(x, g, b, num_groups=2)[0].shape",
                     "(2, 6, 4)")


def test_dbn_bad_input_raises_and_process_survives():
    check_bad_inputs(DBN_PRELUDE, DBN_CASES, "float(mx.nd.ones((2,)).sum().asscalar())", "2.0")


def test_dbn_group_size_limit_is_inclusive():
    """D = kDbnMaxGroupSizeCpu itself passes shape inference (the limit is the largest D allowed)."""
    import mxnet as mx, gn_mx  # noqa: F401
    _, out, _ = mx.sym.gn_dbn(mx.sym.var('d'), mx.sym.var('m'), mx.sym.var('p'),
                              num_groups=1).infer_shape(d=(2, 4096, 1))
    assert out[0] == (2, 4096, 1)


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
