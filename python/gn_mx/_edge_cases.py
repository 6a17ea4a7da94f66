"""The one list of numerical edge cases of gn_group_norm and gn_moments, for every device.

Shipped in the package so that users run it too (python -m gn_mx.selftest, on every GPU MXNet sees
and the CPU); the tests import it as tests/edge_cases.py (a re-export, tests/pkg_shared.py).

Each case states a numerical guarantee of the ops (group_norm.h and docs/numerics.md document them)
and checks it through a *runner*, so the same list runs against
  - the MXNet ops on every context (tests/test_edge_cases.py: cpu, and gpu where MXNet has one);
  - the CUDA kernels, through the framework-free harness, on a real GPU or, in the CPU CI, under
    the CPU emulator (tests/gpu/test_gpu_edge_cases.py via tests/gpu/harness_np.py).
A guarantee added here without its CUDA twin fails CI. No MXNet or torch here (numpy only).

Runner interface (numpy arrays in and out; outputs in their op dtypes):
    run.group_norm(x, gamma, beta, G, eps, act=None, dy=None, dmean=None, drstd=None)
        -> {"y", "mean", "rstd"} and, with dy, {"dx", "dgamma", "dbeta"}: the forward, then the
           backward of sum(y*dy) + sum(mean*dmean) + sum(rstd*drstd) (None: no such term)
    run.moments(x, G, dmean=None, dvar=None) -> {"mean", "var"} and, with dmean/dvar, {"dx"}
Cases: CASES, a list of Case (callable with a runner; `id` names it in pytest).
"""
import numpy as np

from ._reference import act_ref, group_norm_bwd_ref, group_norm_ref, moments_bwd_ref, moments_ref
from ._tolerances import GRAD_TOL, tol

ALL = [np.float16, np.float32, np.float64]


def _acc(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _name(v):
    if v is None:
        return "none"
    if isinstance(v, type) and issubclass(v, np.floating):
        return np.dtype(v).name
    if isinstance(v, tuple):
        return f"{len(v)}d"
    return str(v)


class Case:
    def __init__(self, fn, **params):
        self.fn, self.params = fn, params
        self.id = fn.__name__ + "[" + "-".join(f"{_name(v)}" for v in params.values()) + "]"

    def __call__(self, run):
        self.fn(run, **self.params)

    def __repr__(self):
        return self.id


def _ulp(dtype):
    """Relative rounding of a dtype's result (a few ulp are allowed on top)."""
    return {np.float16: 2e-3, np.float32: 4e-7, np.float64: 1e-12}[dtype]


# -------------------------------------------------------------------------------------------------
# One-element groups: x - mean = 0 exactly


def single_element_groups(run, dtype, offset, act):
    """num_groups = C on (N, C) data: out = act(beta) exactly and dx = 0 exactly, mean = x (a
    rounded mean times rstd = 1/sqrt(eps) would not give that)."""
    rng = np.random.RandomState(11)
    x = (rng.randn(3, 6) + offset).astype(dtype)
    gamma = rng.randn(6).astype(dtype)
    beta = rng.randn(6).astype(dtype)
    dy = rng.randn(3, 6).astype(dtype)
    r = run.group_norm(x, gamma, beta, 6, 1e-5, act=act, dy=dy)
    expect = np.broadcast_to(act_ref(beta.astype(np.float64), act).astype(dtype), (3, 6))
    if act == "silu":  # exact up to the rounding of exp in silu(beta) itself
        np.testing.assert_allclose(r["y"], expect, rtol=4 * np.finfo(dtype).eps, atol=0)
    else:
        np.testing.assert_array_equal(r["y"], expect)
    np.testing.assert_array_equal(r["dx"], np.zeros((3, 6), dtype))
    np.testing.assert_array_equal(r["dgamma"], np.zeros(6, dtype))
    np.testing.assert_array_equal(r["mean"], x.astype(r["mean"].dtype))
    _, _, rdb = group_norm_bwd_ref(x, gamma, dy, 6, 1e-5, act=act, beta=beta)
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(r["dbeta"], rdb, rtol=rtol, atol=atol)


def single_element_tiny_eps(run, dtype):
    """eps at the bottom of the accumulation dtype (1e-300 for float64, the smallest normal float32
    for fp16/fp32 data): one-element groups still give exactly beta (here 0)."""
    eps = 1e-300 if dtype == np.float64 else 1.2e-38
    x = np.random.RandomState(12).randn(2, 4).astype(dtype)
    r = run.group_norm(x, np.ones(4, dtype), np.zeros(4, dtype), 4, eps)
    np.testing.assert_array_equal(r["y"], np.zeros((2, 4), dtype))


def single_element_eps_zero(run, dtype, act):
    """eps = 0 (rstd = inf): a one-element group is constant in x (x - mean = 0 for every x), so the
    output is still exactly act(beta) and dx = dgamma = 0, unlike larger constant groups, where
    0 * inf is NaN (constant_group). The float64 reference says the same."""
    rng = np.random.RandomState(5)
    x = rng.randn(4, 3).astype(dtype)
    g, b = np.array([1.5, -2.0, 0.5], dtype), np.array([0.25, -1.0, 3.0], dtype)
    dy = rng.randn(4, 3).astype(dtype)
    r = run.group_norm(x, g, b, 3, 0.0, act=act, dy=dy)
    expect = np.broadcast_to(act_ref(b.astype(np.float64), act).astype(dtype), x.shape)
    if act == "silu":
        np.testing.assert_allclose(r["y"], expect, rtol=4 * np.finfo(dtype).eps, atol=0)
    else:
        np.testing.assert_array_equal(r["y"], expect)
    assert np.isposinf(r["rstd"]).all()
    ref, _, _ = group_norm_ref(x, g, b, 3, 0.0, act=act)
    np.testing.assert_allclose(ref, expect.astype(np.float64), rtol=4 * np.finfo(dtype).eps)
    np.testing.assert_array_equal(r["dx"], np.zeros(x.shape, dtype))
    np.testing.assert_array_equal(r["dgamma"], np.zeros(3, dtype))
    _, _, rdb = group_norm_bwd_ref(x, g, dy, 3, 0.0, act=act, beta=b)
    rtol, atol = tol(dtype, GRAD_TOL)
    np.testing.assert_allclose(r["dbeta"], rdb, rtol=rtol, atol=atol)


# -------------------------------------------------------------------------------------------------
# Groups of 2-4 elements, |mean| >> spread

TINY_SPREAD = {  # per dtype: {offset: spread}, about 2..10^4 ulp of the offset
    np.float16: {300.0: 0.5, -3e4: 200.0},
    np.float32: {300.0: 1e-3, -3e4: 0.1},
    np.float64: {300.0: 1e-9, -3e4: 1e-7},
}


def tiny_groups_with_large_offsets(run, dtype, M, offset, act):
    """Groups of M = 2..4 elements at |mean| >> spread: within float32 (fp16 data: float16) rounding
    of the float64 reference computed on the rounded input, forward and backward (with gradients
    into mean and rstd)."""
    rng = np.random.RandomState(13 + M)
    G, N = 4, 5
    x = (offset + TINY_SPREAD[dtype][offset] * rng.randn(N, G * M)).astype(dtype)
    # The reference works on x - offset (exact in float64 for these values; the normalization is
    # shift-invariant): numpy's own float64 mean of values near the offset is off by ~ulp(offset).
    x64 = x.astype(np.float64) - offset
    gamma, beta = rng.randn(G * M).astype(dtype), rng.randn(G * M).astype(dtype)
    dy = rng.randn(N, G * M).astype(dtype)
    acc = _acc(dtype)
    dmean, drstd = rng.randn(N, G).astype(acc), (rng.randn(N, G) * 1e-3).astype(acc)
    if act == "relu":  # the rounding of z may not decide relu's kink
        z, _, _ = group_norm_ref(x64, gamma, beta, G, 1e-5)
        assert np.abs(z).min() > 1e-3, "test data hit relu's kink; reseed"
    r = run.group_norm(x, gamma, beta, G, 1e-5, act=act, dy=dy, dmean=dmean, drstd=drstd)
    ref, rmean, rrstd = group_norm_ref(x64, gamma, beta, G, 1e-5, act=act)
    np.testing.assert_allclose(r["mean"], rmean + offset, rtol=4 * np.finfo(r["mean"].dtype).eps)
    # float32 / float16 rounding of the result (a few ulp), nothing amplified by rstd:
    ulp = _ulp(dtype)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(r["y"], ref, rtol=4 * ulp, atol=4 * ulp * scale)
    np.testing.assert_allclose(r["rstd"], rrstd, rtol=4 * max(ulp, 6e-8))
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy, G, 1e-5, dmean, drstd, act=act, beta=beta)
    gscale = np.abs(rdx).max()
    np.testing.assert_allclose(r["dx"], rdx, rtol=16 * ulp, atol=16 * ulp * gscale)
    np.testing.assert_allclose(r["dgamma"], rdg, rtol=16 * ulp, atol=16 * ulp * np.abs(rdg).max())
    np.testing.assert_allclose(r["dbeta"], rdb, rtol=16 * ulp, atol=16 * ulp * np.abs(rdb).max())


# -------------------------------------------------------------------------------------------------
# Large offsets, long fp16 groups, constant groups (the ordinary path)


def large_offset_is_stable(run, dtype):
    """x = 1000 + unit noise: E[x^2]-E[x]^2 would lose every digit in fp32."""
    shape = (2, 16, 32, 32)
    x = (1000 + np.random.RandomState(14).randn(*shape)).astype(dtype)
    x64 = x.astype(np.float64)
    ones, zeros = np.ones(16, dtype), np.zeros(16, dtype)
    r = run.group_norm(x, ones, zeros, 4, 1e-5)
    ref_out, _, ref_rstd = group_norm_ref(x64, ones, zeros, 4, 1e-5)
    np.testing.assert_allclose(r["rstd"], ref_rstd, rtol=1e-4)
    # fp16's output tolerance for both dtypes: a float32 mean near 1000 is rounded to its ulp
    # (~6e-5), an absolute error every output inherits, beyond float32's atol of 1e-5
    np.testing.assert_allclose(r["y"], ref_out, rtol=5e-3, atol=5e-3)
    o = r["y"].astype(np.float64).reshape(2, 4, -1)
    np.testing.assert_allclose(o.mean(axis=2), 0, atol=1e-3)
    np.testing.assert_allclose(o.var(axis=2), 1, atol=5e-3)


def fp16_long_groups(run):
    """Groups of 64k fp16 elements: fp16 accumulation would overflow; fp32 accumulation does not."""
    rng = np.random.RandomState(15)
    shape = (2, 64, 64, 64)  # 8 groups of 16*4096 = 65536 elements
    x = (rng.randn(*shape) * 3 + 5).astype(np.float16)
    gamma = (rng.rand(64) + 0.5).astype(np.float16)
    beta = rng.randn(64).astype(np.float16)
    r = run.group_norm(x, gamma, beta, 4, 1e-5)
    ref_out, ref_mean, ref_rstd = group_norm_ref(x.astype(np.float64), gamma, beta, 4, 1e-5)
    assert np.isfinite(r["y"]).all()
    np.testing.assert_allclose(r["mean"], ref_mean, rtol=1e-5)
    np.testing.assert_allclose(r["rstd"], ref_rstd, rtol=1e-5)
    np.testing.assert_allclose(r["y"], ref_out, rtol=5e-3, atol=1e-2)


def moments_large_offset_fp16(run):
    """float32 statistics of fp16 data at offset 1000: the mean to float32 rounding, the variance
    (1, under a 1000 offset) to 1e-4, which a naive E[x^2]-E[x]^2 in float32 would miss."""
    x = (1000 + np.random.RandomState(16).randn(2, 8, 64, 64)).astype(np.float16)
    r = run.moments(x, 2)
    rm, rv = moments_ref(x.astype(np.float64), 2)
    np.testing.assert_allclose(r["mean"], rm, rtol=1e-6)
    np.testing.assert_allclose(r["var"], rv, rtol=1e-4)


def moments_tiny_groups(run, dtype, M, offset):
    """gn_moments of 2-4 element groups at |mean| >> spread: mean and variance within a few ulp of
    the accumulation dtype of the float64 result (forward; the backward uses the saved,
    accumulation-dtype mean)."""
    rng = np.random.RandomState(19 + M)
    x = (offset + TINY_SPREAD[dtype][offset] * rng.randn(5, 4 * M)).astype(dtype)
    rm, rv = moments_ref(x.astype(np.float64) - offset, 4)
    r = run.moments(x, 4)
    ulp = _ulp(np.dtype(_acc(dtype)).type)
    np.testing.assert_allclose(r["mean"], rm + offset, rtol=4 * np.finfo(r["mean"].dtype).eps)
    np.testing.assert_allclose(r["var"], rv, rtol=4 * ulp, atol=4 * ulp * np.abs(rv).max())


def moments_float32_near_overflow(run, spatial):
    """gn_moments of float32 data with |x| ~ 2e38: the mean is right, the variance (~1e76, beyond
    float32) is inf; the ordinary group is untouched. (64, 64): groups the CUDA statistics split
    across blocks."""
    rng = np.random.RandomState(20)
    x = rng.randn(2, 4, *spatial)
    x[:, :2] = x[:, :2] * 1e38 + 2e38 * np.sign(x[:, :2])
    x = np.clip(x, -3.3e38, 3.3e38).astype(np.float32)
    rm, rv = moments_ref(x.astype(np.float64), 2)
    r = run.moments(x, 2)
    np.testing.assert_allclose(r["mean"], rm, rtol=1e-5, atol=1e-6)
    assert np.isposinf(r["var"][:, 0]).all()
    np.testing.assert_allclose(r["var"][:, 1], rv[:, 1], rtol=1e-5)


def constant_group(run):
    """A constant group normalizes to beta (var = 0, rstd = 1/sqrt(eps)); with eps = 0 it is
    0 * inf: the reference formula gives NaN, so does the op."""
    x = np.full((2, 4, 3, 3), 7.0, np.float32)
    r = run.group_norm(x, np.ones(4, np.float32), np.full(4, 0.5, np.float32), 2, 1e-5)
    np.testing.assert_allclose(r["y"], 0.5, atol=1e-6)
    np.testing.assert_allclose(r["rstd"], 1 / np.sqrt(1e-5), rtol=1e-5)
    r0 = run.group_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32), 2, 0.0)
    assert np.isnan(r0["y"]).all()


def ws_weight_rows(run, dtype, F):
    """Weight Standardization's shape (gn_weight_standardize runs this kernel): a weight of O rows
    of fan-in F as (1, O, F) data in G = O groups, gamma = gain, beta = 0, eps = 1e-6. Everything
    finite. F = 1 (a 1x1 convolution with one input channel): y = 0 and dx = dgamma = 0 exactly.
    Constant rows (F > 1): y = 0 up to the mean's rounding in the accumulation dtype times rstd =
    1/sqrt(eps) (within 16 ulp of the value, x gain); the other rows and every dx as the float64
    formula."""
    rng = np.random.RandomState(23)
    O, eps = 6, 1e-6
    x = (rng.randn(1, O, F) * 0.05 + 0.01).astype(dtype)
    const = list(range(O)) if F == 1 else [1, 4]
    if F > 1:
        x[0, 1] = 0.37
        x[0, 4] = -3.0
    gamma = (rng.rand(O) + 0.5).astype(dtype)
    dy = rng.randn(1, O, F).astype(dtype)
    r = run.group_norm(x, gamma, np.zeros(O, dtype), O, eps, dy=dy)
    for k in ("y", "dx", "dgamma", "dbeta"):
        assert np.isfinite(r[k]).all(), k
    ref, _, _ = group_norm_ref(x, gamma, np.zeros(O), O, eps)
    rdx, _, _ = group_norm_bwd_ref(x, gamma, dy, O, eps)
    if F == 1:
        np.testing.assert_array_equal(r["y"], np.zeros_like(r["y"]))
        np.testing.assert_array_equal(r["dx"], np.zeros_like(r["dx"]))
        np.testing.assert_array_equal(r["dgamma"], np.zeros_like(r["dgamma"]))
        return
    ulp = np.finfo(_acc(dtype)).eps
    for c in const:
        bound = 16 * ulp * abs(float(x[0, c, 0])) / np.sqrt(eps) * float(gamma[c])
        assert np.abs(r["y"][0, c]).max() <= bound, (c, np.abs(r["y"][0, c]).max(), bound)
    others = [i for i in range(O) if i not in const]
    np.testing.assert_allclose(r["y"][:, others], ref[:, others], *tol(dtype))
    scale = max(np.abs(rdx).max(), 1.0)
    np.testing.assert_allclose(r["dx"] / scale, rdx / scale, *tol(dtype, GRAD_TOL))


# -------------------------------------------------------------------------------------------------
# float32 statistics that overflow


def float32_near_overflow(run, spatial, act):
    """|x| ~ 3e38: fp32 sums of x and x^2 overflow (var = inf, rstd = 0 would output act(beta));
    those groups are recomputed (float64), so out is the normalized value and backward is finite
    and right. The last group stays ordinary (the common path)."""
    rng = np.random.RandomState(17)
    shape, G = (2, 4) + spatial, 2
    x = rng.randn(*shape)
    x[:, :2] = x[:, :2] * 1e38 + 2e38 * np.sign(x[:, :2])
    x = np.clip(x, -3.3e38, 3.3e38).astype(np.float32)
    assert np.isfinite(x).all()
    x64 = x.astype(np.float64)
    gamma = rng.randn(4).astype(np.float32)
    beta = rng.randn(4).astype(np.float32)
    dy = rng.randn(*shape).astype(np.float32)
    r = run.group_norm(x, gamma, beta, G, 1e-5, act=act, dy=dy)
    ref, rmean, rrstd = group_norm_ref(x64, gamma, beta, G, 1e-5, act=act)
    if act == "relu":  # the ordinary groups' fp32 z is off by ~1e-6: it must not decide the kink
        z, _, _ = group_norm_ref(x64, gamma, beta, G, 1e-5)
        assert np.abs(z).min() > 1e-5, "test data hit relu's kink; reseed"
    np.testing.assert_allclose(r["y"], ref, *tol(np.float32))
    # atol: the ordinary group's mean of unit-variance data may be ~1e-4
    np.testing.assert_allclose(r["mean"], rmean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r["rstd"], rrstd, rtol=1e-4)  # fp32 subnormal rstd (~3e-39)
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy, G, 1e-5, act=act, beta=beta)
    np.testing.assert_allclose(r["dgamma"], rdg, rtol=1e-4, atol=1e-4 * np.abs(rdg).max())
    np.testing.assert_allclose(r["dbeta"], rdb, rtol=1e-4, atol=1e-4 * np.abs(rdb).max())
    # dx of the huge groups is ~1e-38 (fp32 subnormal range): compare relative to each group.
    dxn = r["dx"].astype(np.float64).reshape(2, G, -1)
    rdxn = rdx.reshape(2, G, -1)
    for n in range(2):
        for g in range(G):
            s = np.abs(rdxn[n, g]).max()
            np.testing.assert_allclose(dxn[n, g], rdxn[n, g], rtol=1e-3, atol=1e-3 * s + 1e-44)


# -------------------------------------------------------------------------------------------------
# NaN / Inf stay in their group


def nonfinite_stays_in_its_group(run, bad, dtype, act):
    """A NaN/Inf element poisons its own group (all of it), and nothing else: other groups are
    what clean data gives, dgamma/dbeta of other groups' channels stay finite; gn_moments too."""
    N, C, G, S = 3, 6, 3, 4
    rng = np.random.RandomState(18)
    x = rng.randn(N, C, S).astype(dtype)
    x[1, 2, 3] = bad  # sample 1, group 1 (channels 2, 3)
    g, b = (rng.rand(C) + 0.5).astype(dtype), rng.randn(C).astype(dtype)
    r = run.group_norm(x, g, b, G, 1e-5, act=act, dy=np.ones_like(x))
    y, dx = r["y"], r["dx"]
    poisoned = np.zeros((N, C), bool)
    poisoned[1, 2:4] = True
    assert not np.isfinite(y[poisoned]).any()  # group 1 of sample 1, all of it
    assert np.isfinite(y[~poisoned]).all() and np.isfinite(dx[~poisoned]).all()
    ok = np.ones((N, G), bool)
    ok[1, 1] = False
    assert np.isfinite(r["mean"][ok]).all() and np.isfinite(r["rstd"][ok]).all()
    ref = group_norm_ref(x, g, b, G, 1e-5, act=act)[0]
    # this checks containment, not precision: the data dtype's tolerance, float32's at best
    rtol, atol = tol(dtype if dtype == np.float16 else np.float32)
    np.testing.assert_allclose(y[~poisoned], ref[~poisoned], rtol=rtol, atol=atol)
    # dgamma/dbeta sum over samples: only the two channels of group 1 can see it
    others = [0, 1, 4, 5]
    assert np.isfinite(r["dgamma"][others]).all() and np.isfinite(r["dbeta"][others]).all()
    if act is None:  # dbeta = sum dy never sees x
        assert np.isfinite(r["dbeta"]).all()
    acc = _acc(dtype)
    m = run.moments(x, G, dmean=np.ones((N, G), acc), dvar=np.ones((N, G), acc))
    assert np.isfinite(m["mean"][ok]).all() and np.isfinite(m["var"][ok]).all()
    assert not np.isfinite(m["var"][1, 1])
    assert np.isfinite(m["dx"][~poisoned]).all()
    rm, rv = moments_ref(x, G)
    np.testing.assert_allclose(m["mean"][ok], rm[ok], rtol=rtol, atol=atol)
    np.testing.assert_allclose(m["var"][ok], rv[ok], rtol=rtol, atol=atol)
    rdx = moments_bwd_ref(x, G, np.ones((N, G)), np.ones((N, G)))
    np.testing.assert_allclose(m["dx"][~poisoned], rdx[~poisoned], *tol(dtype, GRAD_TOL))


# -------------------------------------------------------------------------------------------------

CASES = (
    [Case(single_element_groups, dtype=d, offset=o, act=a)
     for a in (None, "relu", "silu") for d in ALL for o in (0.0, -300.0, 3e4)]
    + [Case(single_element_tiny_eps, dtype=d) for d in ALL]
    + [Case(single_element_eps_zero, dtype=d, act=a) for a in (None, "relu", "silu") for d in ALL]
    + [Case(tiny_groups_with_large_offsets, dtype=d, M=m, offset=o, act=a)
       for a in (None, "relu", "silu") for d in ALL for m in (2, 3, 4) for o in (300.0, -3e4)]
    + [Case(large_offset_is_stable, dtype=d) for d in (np.float32, np.float16)]
    + [Case(fp16_long_groups), Case(moments_large_offset_fp16), Case(constant_group)]
    + [Case(ws_weight_rows, dtype=d, F=f) for d in ALL for f in (1, 9, 576)]
    + [Case(moments_tiny_groups, dtype=d, M=m, offset=o)
       for d in ALL for m in (2, 3, 4) for o in (300.0, -3e4)]
    + [Case(moments_float32_near_overflow, spatial=s) for s in ((64,), (64, 64))]
    + [Case(float32_near_overflow, spatial=s, act=a)
       for a in (None, "relu", "silu") for s in ((), (64,), (64, 64))]
    + [Case(nonfinite_stays_in_its_group, bad=b, dtype=d, act=a)
       for a in (None, "silu") for d in ALL for b in (np.nan, np.inf, -np.inf)]
)


def case_id(case):
    return case.id


# -------------------------------------------------------------------------------------------------
# Channels-last layout (the ops' axis = -1): the same list on the same data stored (N, *spatial, C).
# Self-contained: nothing above depends on it. A runner for this layout must accept `axis`
# (group_norm(..., axis=-1), moments(..., axis=-1)).


def _to_last(a):
    return None if a is None or a.ndim < 3 else np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _to_first(a):
    return a if a.ndim < 3 else np.ascontiguousarray(np.moveaxis(a, -1, 1))


class ChannelsLast:
    """Wraps a runner: the case's (N, C, *spatial) arrays go to the op as (N, *spatial, C) with
    axis=-1 and data-shaped results come back as (N, C, *spatial), so every case states the same
    guarantee for channels-last data (statistics and parameter gradients do not depend on the
    layout). (N, C) data is the same memory in both layouts (it still passes axis=-1)."""

    def __init__(self, run):
        self.run = run
        self.name = getattr(run, "name", "") + "-channels_last"

    def group_norm(self, x, gamma, beta, G, eps, act=None, dy=None, dmean=None, drstd=None):
        last = (lambda a: a if a is None or a.ndim < 3 else _to_last(a))
        r = self.run.group_norm(last(x), gamma, beta, G, eps, act=act, dy=last(dy), dmean=dmean,
                                drstd=drstd, axis=-1)
        return {k: _to_first(v) if k in ("y", "dx") else v for k, v in r.items()}

    def moments(self, x, G, dmean=None, dvar=None):
        r = self.run.moments(x if x.ndim < 3 else _to_last(x), G, dmean=dmean, dvar=dvar, axis=-1)
        return {k: _to_first(v) if k == "dx" else v for k, v in r.items()}


def tiny_spatial_groups(run, dtype, D, S, offset):
    """Groups of D*S = 2..4 elements spread over positions (D channels at S positions, not
    contiguous in channels-last memory) at |mean| >> spread: the tiny-group guarantee of
    tiny_groups_with_large_offsets, checked on (N, C, S) data."""
    rng = np.random.RandomState(40 + D * S)
    G, N = 3, 4
    x = (offset + TINY_SPREAD[dtype][offset] * rng.randn(N, G * D, S)).astype(dtype)
    x64 = x.astype(np.float64) - offset
    gamma, beta = rng.randn(G * D).astype(dtype), rng.randn(G * D).astype(dtype)
    dy = rng.randn(N, G * D, S).astype(dtype)
    r = run.group_norm(x, gamma, beta, G, 1e-5, dy=dy)
    ref, rmean, _ = group_norm_ref(x64, gamma, beta, G, 1e-5)
    np.testing.assert_allclose(r["mean"], rmean + offset, rtol=4 * np.finfo(r["mean"].dtype).eps)
    ulp = _ulp(dtype)
    np.testing.assert_allclose(r["y"], ref, rtol=4 * ulp, atol=4 * ulp * np.abs(ref).max())
    rdx, rdg, rdb = group_norm_bwd_ref(x64, gamma, dy, G, 1e-5)
    np.testing.assert_allclose(r["dx"], rdx, rtol=16 * ulp, atol=16 * ulp * np.abs(rdx).max())
    np.testing.assert_allclose(r["dgamma"], rdg, rtol=16 * ulp, atol=16 * ulp * np.abs(rdg).max())
    np.testing.assert_allclose(r["dbeta"], rdb, rtol=16 * ulp, atol=16 * ulp * np.abs(rdb).max())
    m = run.moments(x, G)
    np.testing.assert_allclose(m["mean"], rmean + offset, rtol=4 * np.finfo(m["mean"].dtype).eps)


#: Cases of the channels-last list beyond CASES (run in both layouts).
LAYOUT_EXTRA_CASES = [Case(tiny_spatial_groups, dtype=d, D=dd, S=s, offset=o)
                      for d in ALL for dd, s in ((1, 2), (1, 4), (2, 2)) for o in (300.0, -3e4)]


#: The channels-last list: every case of CASES on channels-last data, plus LAYOUT_EXTRA_CASES.
LAYOUT_CASES = list(CASES) + LAYOUT_EXTRA_CASES


def channels_last(run):
    """`run` on channels-last data (ChannelsLast); run CASES + LAYOUT_EXTRA_CASES through it."""
    return ChannelsLast(run)
