"""The cooperative CPU schedule of gn_group_norm and gn_moments (threads share each group) in every
dtype, forward and backward, with gradients into the statistics outputs (mean/rstd, mean/var).

src/operator/kernels/group_norm_cpu_common.h (make_plan) shares groups between the threads of a team of
nt >= 2 when the N*G groups do not split evenly over the team (N*G < nt, or N*G % nt != 0 with
N*G < 8 nt) and a group has at least kMinCoopGroup = 8192 elements (and the input at least
kMinParallel = 16384). With OMP_NUM_THREADS=2 the shapes below take it: 3 groups of 8192 and one
group of 16384 elements; "buffered" has S = 8 < kSmallS (the buffered loops inside the shared
slices). The team size is fixed when libgomp loads, hence one fresh process for all cases; each
case reports its own failure.
"""
from conftest import run_python

SCRIPT = r"""
import os, sys, traceback
os.environ['OMP_NUM_THREADS'] = '2'  # before libgomp loads
os.environ['OMP_WAIT_POLICY'] = 'passive'  # on a busy machine spinning at barriers only slows
import numpy as np, mxnet as mx
from mxnet import autograd
sys.path.insert(0, 'tests')
import gn_mx  # noqa: F401
from conftest import GRAD_TOL, rounded, tol
from reference import group_norm_bwd_ref, group_norm_ref, moments_bwd_ref, moments_ref

SHAPES = {'shared3': ((1, 6, 64, 64), 3), 'one_group': ((1, 4, 4096), 1),
          'buffered': ((1, 3072, 8), 3)}
DTYPES = (np.float16, np.float32, np.float64)
rng = np.random.RandomState(0)
failures = []


def close(name, got, want, rtol, atol_rel):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol_rel * np.abs(want).max(),
                               err_msg=name)


def group_norm_case(shape, G, dtype, data, param_dtype):
    C, N = shape[1], shape[0]
    eps = 1e-3
    raw = rng.randn(*shape) * (np.sqrt(eps) if data == 'small' else 2.0)
    x, x64 = rounded(raw + (0.0 if data == 'small' else 0.5), dtype)
    gamma, g64 = rounded(rng.rand(C) + 0.5, param_dtype)
    beta, b64 = rounded(rng.randn(C), param_dtype)
    dy, dy64 = rounded(rng.randn(*shape), dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    dmean = rng.randn(N, G)
    drstd = rng.randn(N, G) * (eps if data == 'small' else 1.0)
    xs = mx.nd.array(x, dtype=dtype)
    gs, bs = mx.nd.array(gamma, dtype=param_dtype), mx.nd.array(beta, dtype=param_dtype)
    for a in (xs, gs, bs):
        a.attach_grad()
    with autograd.record():
        out, mean, rstd = mx.nd.gn_group_norm(xs, gs, bs, num_groups=G, eps=eps)
    autograd.backward([out, mean, rstd], [mx.nd.array(dy, dtype=dtype),
                                          mx.nd.array(dmean, dtype=acc),
                                          mx.nd.array(drstd, dtype=acc)])
    ref, rmean, rrstd = group_norm_ref(x64, g64, b64, G, eps)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, g64, dy64, G, eps, dmean=dmean, drstd=drstd)
    if data == 'small':  # eps must matter here, or the case could not catch a dropped eps
        ref0, _, _ = group_norm_ref(x64, g64, b64, G, 0.0)
        assert np.abs(ref0 - ref).max() > 0.1, 'eps does not matter for this data'
    rtol, atol = tol(dtype)
    stat = 1e-10 if dtype == np.float64 else 1e-5
    close('out', out.asnumpy(), ref, rtol, atol)
    close('mean', mean.asnumpy(), rmean, stat, stat)
    close('rstd', rstd.asnumpy(), rrstd, stat, stat)
    rtol, atol = tol(dtype, GRAD_TOL)
    close('dx', xs.grad.asnumpy(), rdx, rtol, atol)
    # dgamma/dbeta are reduced and stored in the parameters' dtype
    rtol, atol = tol(np.float32 if param_dtype == np.float32 else dtype, GRAD_TOL)
    close('dgamma', gs.grad.asnumpy(), rdg, rtol, atol)
    close('dbeta', bs.grad.asnumpy(), rdb, rtol, atol)


def moments_case(shape, G, dtype):
    N = shape[0]
    x, x64 = rounded(rng.randn(*shape) * 3 - 2, dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    with autograd.record():
        mean, var = mx.nd.gn_moments(xs, num_groups=G)
    dmean, dvar = rng.randn(N, G), rng.randn(N, G)
    autograd.backward([mean, var], [mx.nd.array(dmean, dtype=acc), mx.nd.array(dvar, dtype=acc)])
    rm, rv = moments_ref(x64, G)
    stat = 1e-12 if dtype == np.float64 else 1e-5
    close('mean', mean.asnumpy(), rm, stat, stat)
    close('var', var.asnumpy(), rv, stat, stat)
    rdx = moments_bwd_ref(x64, G, dmean.astype(acc), dvar.astype(acc))
    rtol, atol = tol(dtype, GRAD_TOL)
    close('dx', xs.grad.asnumpy(), rdx, rtol, atol)


def run(label, fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001  (report every case, not only the first)
        failures.append(label + ': ' + traceback.format_exc(limit=1)[-1500:])


for name, (shape, G) in SHAPES.items():
    for dtype in DTYPES:
        dn = np.dtype(dtype).name
        for data in ('unit', 'small'):
            run(f'group_norm {name} {dn} {data}', group_norm_case, shape, G, dtype, data, dtype)
        run(f'moments {name} {dn}', moments_case, shape, G, dtype)
    run(f'group_norm {name} float16 data float32 params', group_norm_case, shape, G,
        np.float16, 'unit', np.float32)
print('\n'.join(failures) if failures else 'ALL OK')
"""


def test_cooperative_schedule_every_dtype():
    p = run_python(SCRIPT)
    assert p.returncode == 0 and "ALL OK" in p.stdout, p.stdout[-6000:] + p.stderr[-3000:]
