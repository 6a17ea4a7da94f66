"""Decorrelated BN ops: gn_dbn / gn_dbn_inference forward and backward.

References are float64 numpy (tests/reference.py, written from the paper's math) evaluated on the
already-rounded inputs; gradients are also checked against finite differences. The block-level
tests are in test_dbn_blocks.py, bad input in test_errors.py.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd

import gn_mx  # noqa: F401
from conftest import DTYPES, GRAD_TOL, ROOT, dbn_data as _data, dbn_fd_check, tol
from reference import (dbn_bwd_ref, dbn_inference_ref, dbn_ref, numeric_grad,
                       _dbn_group_matrix)

CPU = mx.cpu()
EPS = 1e-5
MOM = 0.9
SHAPES = {0: (64, 8), 1: (6, 8, 11), 2: (4, 8, 5, 3), 3: (2, 8, 3, 3, 3)}


def _stats(C, G, dtype):
    D = C // G
    return (mx.nd.zeros((C,), dtype=dtype),
            mx.nd.array(np.tile(np.eye(D), (G, 1, 1)), dtype=dtype))


def _acc(dtype):
    return np.float64 if dtype == np.float64 else np.float32


# ---------------------------------------------------------------------------------------------
# Op forward / backward vs the float64 reference

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
@pytest.mark.parametrize("G", [1, 2, 8])
def test_forward_backward_vs_reference(ctx, dtype, rank, G):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        shape = SHAPES[rank]
        C = shape[1]
        x = _data(shape, dtype)
        dy = np.random.randn(*shape).astype(dtype)
        rm, rp = _stats(C, G, dtype)
        xs = mx.nd.array(x, dtype=dtype)
        xs.attach_grad()
        with autograd.record():
            outs = mx.nd.gn_dbn(xs, rm, rp, num_groups=G, eps=EPS, momentum=MOM)
        outs[0].backward(mx.nd.array(dy, dtype=dtype))
        y, mean, eigvec, eigval = [o.asnumpy() for o in outs]
        assert y.dtype == dtype and mean.dtype == _acc(dtype) and eigvec.dtype == _acc(dtype)

        ref, rmean, W = dbn_ref(x, G, EPS)
        rtol, atol = tol(dtype)
        np.testing.assert_allclose(y, ref, rtol=rtol, atol=atol)
        np.testing.assert_allclose(mean, rmean, rtol=rtol, atol=atol)
        # Saved eigendecomposition reproduces Sigma^{-1/2}.
        W_saved = np.einsum("gij,gj,gkj->gik", eigvec.astype(np.float64),
                            eigval.astype(np.float64) ** -0.5, eigvec.astype(np.float64))
        np.testing.assert_allclose(W_saved, W, rtol=10 * rtol, atol=10 * atol)
        # Running statistics updated in place.
        D = C // G
        np.testing.assert_allclose(rm.asnumpy(), (1 - MOM) * rmean, rtol=rtol, atol=atol)
        np.testing.assert_allclose(rp.asnumpy(), MOM * np.eye(D) + (1 - MOM) * W,
                                   rtol=rtol, atol=atol)

        rdx = dbn_bwd_ref(x, dy, G, EPS)
        grtol, gatol = tol(dtype, GRAD_TOL)
        np.testing.assert_allclose(xs.grad.asnumpy(), rdx, rtol=grtol, atol=gatol)


def test_fp16_data_with_fp32_running_stats(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = _data((8, 4, 6), np.float16)
        rm, rp = _stats(4, 2, np.float32)
        y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float16), rm, rp, num_groups=2)[0]
        assert y.dtype == np.float16 and rp.dtype == np.float32
        ref, rmean, W = dbn_ref(x, 2, EPS)
        np.testing.assert_allclose(y.asnumpy(), ref, *tol(np.float16))
        np.testing.assert_allclose(rp.asnumpy(), MOM * np.eye(2) + (1 - MOM) * W, *tol(np.float32))
        yi = gn_mx.ops.dbn_inference(mx.nd.array(x, dtype=np.float16), rm, rp, num_groups=2)
        np.testing.assert_allclose(yi.asnumpy(), dbn_inference_ref(x, rm.asnumpy(), rp.asnumpy(), 2),
                                   *tol(np.float16))


@pytest.mark.parametrize("G", [1, 3])
def test_whitening_property(ctx, G):
    """Training output of every group: zero mean, identity covariance (up to eps)."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = _data((16, 12, 4, 4), np.float64, offset=-2.3) * 3.0
        rm, rp = _stats(12, G, np.float64)
        y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float64), rm, rp, num_groups=G, eps=1e-9)[0]
        y = y.asnumpy()
        for g in range(G):
            Y = _dbn_group_matrix(y, G, g)
            # float64 property checks: the mean is removed to rounding (1e-10 on O(1) values);
            # the covariance is I - eps (Sigma + eps I)^-1, within 1e-7 of I for eps = 1e-9
            np.testing.assert_allclose(Y.mean(axis=1), 0, atol=1e-10)
            np.testing.assert_allclose(Y @ Y.T / Y.shape[1], np.eye(Y.shape[0]), atol=1e-7)


def test_large_offset_fp32(ctx):
    """Centring before the covariance keeps fp32 accurate for |mean| >> std."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = (_data((16, 8, 8), np.float64) + 1000.0).astype(np.float32)
        rm, rp = _stats(8, 2, np.float32)
        y = mx.nd.gn_dbn(mx.nd.array(x), rm, rp, num_groups=2)[0].asnumpy()
        # float32 at offset 1000: the centred data keep ~1000 * 2^-24 absolute rounding, so this is
        # looser than tol(float32)
        np.testing.assert_allclose(y, dbn_ref(x, 2, EPS)[0], rtol=1e-3, atol=2e-3)


def test_groups_equal_channels_is_batchnorm(ctx):
    """D = 1: per-channel standardization over (N, spatial) with the population variance."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = _data((5, 6, 7), np.float64)
        rm, rp = _stats(6, 6, np.float64)
        y = mx.nd.gn_dbn(mx.nd.array(x, dtype=np.float64), rm, rp, num_groups=6)[0].asnumpy()
        mu = x.mean(axis=(0, 2), keepdims=True)
        var = x.var(axis=(0, 2), keepdims=True)
        # float64 and D = 1 (the projection is 1 / sqrt(var + eps)): exact to rounding
        np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + EPS), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape,G", [((3, 6, 4), 2), ((10, 3), 1), ((2, 4, 2, 2), 4)])
def test_gradient_finite_differences(ctx, shape, G):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        dbn_fd_check(_data(shape, np.float64), G)


def test_gradient_equal_eigenvalues(ctx):
    """Sigma = I + eps exactly (orthogonal centred rows of equal norm): the divided-difference
    backward needs no guard; the 1/(l_i - l_j) form would be 0/0 here."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = np.array([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]]) + 3.0
        dbn_fd_check(x, 1)


def test_reference_backward_vs_finite_differences():
    x = _data((4, 6, 3), np.float64)
    dy = np.random.randn(*x.shape)
    num = numeric_grad(lambda z: float((dbn_ref(z, 3, EPS)[0] * dy).sum()), x)
    np.testing.assert_allclose(dbn_bwd_ref(x, dy, 3, EPS), num, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_inference_op_and_backward(ctx, dtype):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        G, shape = 2, (3, 6, 5)
        x = _data(shape, dtype)
        rm = mx.nd.array(np.random.randn(6), dtype=dtype)
        P = np.random.randn(G, 3, 3)
        rp = mx.nd.array(P, dtype=dtype)
        xs = mx.nd.array(x, dtype=dtype)
        xs.attach_grad()
        dy = np.random.randn(*shape).astype(dtype)
        with autograd.record():
            y = mx.nd.gn_dbn_inference(xs, rm, rp, num_groups=G)
        y.backward(mx.nd.array(dy, dtype=dtype))
        ref = dbn_inference_ref(x, rm.asnumpy(), rp.asnumpy(), G)
        np.testing.assert_allclose(y.asnumpy(), ref, *tol(dtype))
        Pr = rp.asnumpy().astype(np.float64)
        rdx = dbn_inference_ref(dy, np.zeros(6), np.transpose(Pr, (0, 2, 1)), G)
        np.testing.assert_allclose(xs.grad.asnumpy(), rdx, *tol(dtype, GRAD_TOL))


@pytest.mark.parametrize("env", [{"GNMX_CPU_ISA": "generic"},
                                 {"MXNET_ENGINE_TYPE": "NaiveEngine", "OMP_NUM_THREADS": "2"}],
                         ids=["blas_path", "two_threads"])
def test_kernel_paths_match_reference(env):
    """float32 panels use AVX2 kernels when the CPU has them; GNMX_CPU_ISA=generic forces the
    BLAS path (as on other CPUs). With OMP_NUM_THREADS=2 the ops run a team of two threads
    (NaiveEngine: on the caller, deterministic), which covers the per-thread statistics merge. Shapes include several column chunks per group. Fresh processes: both choices are
    made once per process."""
    code = f"""
        import sys; sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        import numpy as np, mxnet as mx, gn_mx
        from conftest import dbn_train_step
        from reference import dbn_ref, dbn_bwd_ref
        for shape, G, off in [((6, 8, 11), 2, 0.5), ((40, 64, 3), 1, 0.0), ((4, 12, 5, 5), 12, 0.0),
                              ((20, 6, 40, 40), 3, 50.0), ((5, 32, 30, 30), 2, -3.0)]:
            for dtype in (np.float32, np.float64):
                x = (np.random.randn(*shape) + off).astype(dtype)
                dy = np.random.randn(*shape).astype(dtype)
                y, dx, _ = dbn_train_step(x, dy, G)
                tol = 1e-4 if dtype == np.float32 else 1e-9
                np.testing.assert_allclose(y, dbn_ref(x, G, 1e-5)[0], rtol=tol,
                                           atol=tol * (1 + abs(off)))
                np.testing.assert_allclose(dx, dbn_bwd_ref(x, dy, G, 1e-5),
                                           rtol=10 * tol, atol=tol * (1 + abs(off)))
        print("PATH_OK")
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env=dict(os.environ, **env))
    assert p.returncode == 0 and "PATH_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Robustness

@pytest.mark.parametrize("shape,G", [((2, 8, 2), 1), ((3, 16), 2), ((1, 4), 1)])
def test_near_singular_covariance_is_finite(ctx, shape, G):
    """N * spatial <= group size: Sigma is (nearly) eps*I along the missing directions."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        for dtype in (np.float32, np.float64):
            x = _data(shape, dtype)
            rm, rp = _stats(shape[1], G, dtype)
            xs = mx.nd.array(x, dtype=dtype)
            xs.attach_grad()
            with autograd.record():
                y = mx.nd.gn_dbn(xs, rm, rp, num_groups=G)[0]
            y.backward(mx.nd.ones_like(y))
            assert np.isfinite(y.asnumpy()).all() and np.isfinite(xs.grad.asnumpy()).all()
            assert np.isfinite(rp.asnumpy()).all()
        # A constant batch gives zeros.
        rm, rp = _stats(4, 2, np.float32)
        y = mx.nd.gn_dbn(mx.nd.ones((3, 4, 2)) * 7, rm, rp, num_groups=2)[0].asnumpy()
        np.testing.assert_allclose(y, 0, atol=1e-6)


def test_nan_input_does_not_crash(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = _data((4, 6, 3), np.float32)
        x[1, 2, 1] = np.nan
        rm, rp = _stats(6, 2, np.float32)
        xs = mx.nd.array(x)
        xs.attach_grad()
        with autograd.record():
            y = mx.nd.gn_dbn(xs, rm, rp, num_groups=2)[0]
        y.backward(mx.nd.ones_like(y))
        y = y.asnumpy()
        assert np.isnan(y[:, :3]).all()  # the poisoned group
        assert np.isfinite(y[:, 3:]).all()  # the other group is untouched
        mx.nd.waitall()
