"""Robustness under bad input and long runs (issue 10).

- symbolic shape inference with shapeless parameter variables (subprocess: it used to SIGSEGV);
- no leak and no stale text after caught errors (subprocess, RSS);
- NaN/Inf in one group / channel stays there, every op, forward and backward;
- extreme finite inputs in DBN's eigensolver; eps checked against the accumulation dtype;
- the strict attribute parser; empty batches in the blocks;
- zero-size and mismatched inputs of every op (the synchronized-DBN ops read past a zero-size
  mean / wrote past zero-size running statistics before the fix); a barrier nobody joins.
"""
import itertools
import json
import os
import time

import numpy as np
import pytest

import mxnet as mx
import gn_mx

from conftest import check_bad_inputs, run_python
from gn_mx._library import OPS
from reference import dbn_ref, group_norm_ref

# The ops each section covers; every op of the one list (gn_mx._library.OPS) is in each.
_SYNC = {"gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply", "gn_dbn_local_sums", "gn_dbn_local_cov"}
_COVERED = {
    "symbolic inference": {"gn_group_norm", "gn_channel_affine", "gn_dbn", "gn_dbn_inference",
                           "gn_moments", "gn_weight_standardize"} | _SYNC,
    "attribute parser": {"gn_group_norm", "gn_moments", "gn_dbn", "gn_dbn_inference",
                         "gn_weight_standardize", "gn_channel_affine"} | _SYNC,
    "non-finite inputs": {"gn_channel_affine", "gn_dbn", "gn_dbn_inference",
                          "gn_weight_standardize",
                          "gn_group_norm", "gn_moments"} | _SYNC,  # GN, moments: edge_cases.py
    "zero-size and mismatched inputs": None,  # the ops of its cases (_BAD_INPUTS, section 7)
}
_sync_keys = itertools.count()


def _sync_key():
    """A gn_sync_sum key of its own (barriers are process-wide)."""
    return f"test_robust/{os.getpid()}/{next(_sync_keys)}"


@pytest.mark.parametrize("section", sorted(_COVERED))
def test_every_op_is_covered(section):
    ops = _COVERED[section]
    if ops is None:
        ops = {case.split("/")[0] for case in _BAD_INPUTS}
    assert ops == set(OPS), f"{section}: add {set(OPS) - ops}"

# ---------------------------------------------------------------------------------------------
# 1. Symbolic shape inference with parameters of unknown shape

_SYMBOLIC = r"""
import json, mxnet as mx, gn_mx
V = mx.sym.var
res = {}
# the issue's example, verbatim
s = mx.sym.gn_group_norm(mx.sym.var('d'), mx.sym.var('g'), mx.sym.var('b'), num_groups=2)
res['example'] = [list(map(list, r)) for r in s.infer_shape(d=(4, 6))]
OPS = {'gn_group_norm': dict(num_groups=2), 'gn_channel_affine': {},
       'gn_dbn': dict(num_groups=2), 'gn_dbn_inference': dict(num_groups=2)}
for op, kw in OPS.items():
    for nsp in range(4):
        shp = (4, 6) + (3,) * nsp
        key = f'{op}/{nsp}'
        dbn = 'dbn' in op
        n1, n2 = ('st_moving_mean', 'st_moving_var') if dbn else ('p_gamma', 'p_beta')
        s = getattr(mx.sym, op)(V('data'), V(n1, init=mx.init.Zero()),
                                V(n2, init=mx.init.One()), **kw)
        args, outs, aux = s.infer_shape(data=shp)
        names = s.list_arguments() + s.list_auxiliary_states()
        r = {'shapes': dict(zip(names, [list(a) for a in args + aux])),
             'out0': list(outs[0])}
        pa, po, px = s.infer_shape_partial(data=shp)
        r['partial'] = dict(zip(names, [list(a) for a in pa + px]))
        out = s[0] if len(s.list_outputs()) > 1 else s
        m = mx.mod.Module(out, data_names=['data'], label_names=None)
        m.bind(data_shapes=[('data', shp)], for_training=False)
        m.init_params()
        m.forward(mx.io.DataBatch([mx.nd.ones(shp)]), is_train=False)
        r['module_out'] = list(m.get_outputs()[0].shape)
        # JSON saved without any placeholder (as by a gn_mx without this fix) loads and infers
        g = json.loads(s.tojson())
        for n in g['nodes']:
            n.get('attrs', {}).pop('__shape__', None)
        s2 = mx.sym.load_json(json.dumps(g))
        r['json'] = [list(a) for a in s2.infer_shape(data=shp)[0]]
        res[key] = r
for nsp in range(4):
    shp = (4, 6) + (3,) * nsp
    s = mx.sym.gn_weight_standardize(V('data'), V('p_gain', init=mx.init.One()))
    args, outs, aux = s.infer_shape(data=shp)
    pa = s.infer_shape_partial(data=shp)[0]
    g = json.loads(s.tojson())
    for n in g['nodes']:
        n.get('attrs', {}).pop('__shape__', None)
    res[f'gn_weight_standardize/{nsp}'] = [[list(a) for a in args], [list(o) for o in outs],
                                           [list(a) for a in pa],
                                           [list(a) for a in mx.sym.load_json(
                                               json.dumps(g)).infer_shape(data=shp)[0]]]
for nsp in range(4):
    shp = (4, 6) + (3,) * nsp
    s = mx.sym.gn_moments(V('data'), num_groups=2)
    m = mx.mod.Module(s[1], data_names=['data'], label_names=None)
    m.bind(data_shapes=[('data', shp)], for_training=False)
    m.init_params()
    m.forward(mx.io.DataBatch([mx.nd.ones(shp)]), is_train=False)
    res[f'gn_moments/{nsp}'] = [list(s.infer_shape(data=shp)[1][0]),
                                list(m.get_outputs()[0].shape)]
print('RESULT ' + json.dumps(res))
"""


def test_symbolic_inference_with_shapeless_parameters_every_op_and_rank():
    p = run_python(_SYMBOLIC, timeout=240)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert res.pop("example") == [[[4, 6], [6], [6]], [[4, 6], [4, 2], [4, 2]], []]
    assert len(res) == 24
    for nsp in range(4):
        assert res.pop(f"gn_moments/{nsp}") == [[4, 2], [4, 2]]
        shp = [4, 6] + [3] * nsp
        assert res.pop(f"gn_weight_standardize/{nsp}") == [[shp, [4]], [shp, [4], [4]],
                                                          [shp, [4]], [shp, [4]]]
    for key, r in res.items():
        op, nsp = key.split("/")
        shp = [4, 6] + [3] * int(nsp)
        if "dbn" in op:
            want = {"data": shp, "st_moving_mean": [6], "st_moving_var": [2, 3, 3]}
        else:
            want = {"data": shp, "p_gamma": [6], "p_beta": [6]}
        assert r["shapes"] == want, key
        assert r["partial"] == want, key
        assert r["out0"] == shp and r["module_out"] == shp, key
        assert r["json"][0] == shp and r["json"][1:] == [want[k] for k in list(want)[1:]
                                                         if k in ("p_gamma", "p_beta")], key


_SYMBOLIC_SYNC = r"""
import json, mxnet as mx, numpy as np, gn_mx
V = mx.sym.var
def shapes(s, **given):
    args, outs, aux = s.infer_shape(**given)
    names = s.list_arguments() + s.list_auxiliary_states()
    return {'shapes': dict(zip(names, [list(a) for a in args + aux])),
            'partial': dict(zip(names, [list(a) for a in sum(s.infer_shape_partial(**given)[::2],
                                                             [])])),
            'outs': [list(o) for o in outs]}
def reloaded(s, **given):  # JSON saved without placeholders (a gn_mx without them): loads, infers
    g = json.loads(s.tojson())
    for n in g['nodes']:
        n.get('attrs', {}).pop('__shape__', None)
    return [list(a) for a in mx.sym.load_json(json.dumps(g)).infer_shape(**given)[0]]
def module_out(s, name, shp, value):
    m = mx.mod.Module(s, data_names=[name], label_names=None)
    m.bind(data_shapes=[(name, shp)], for_training=False)
    m.init_params()
    m.forward(mx.io.DataBatch([mx.nd.array(value, dtype=value.dtype)]), is_train=False)
    return m.get_outputs()[0].asnumpy().tolist()
res = {}
for nsp in range(4):
    shp = (4, 6) + (3,) * nsp
    s = mx.sym.gn_dbn_apply(V('data'), V('gamma'), V('beta'), V('mean', init=mx.init.Zero()),
                            V('W', init=mx.init.One()), num_groups=2)
    r = shapes(s, data=shp)
    r['json'] = reloaded(s, data=shp)
    r['module'] = list(np.array(module_out(s, 'data', shp, np.ones(shp, np.float32))).shape)
    res[f'gn_dbn_apply/{nsp}'] = r
    s = mx.sym.gn_sync_sum(V('data', dtype='float64'), key='robust/%d' % nsp, num_devices=1,
                          timeout=5)
    x = np.arange(np.prod(shp), dtype=np.float64).reshape(shp)
    res[f'gn_sync_sum/{nsp}'] = dict(shapes(s, data=shp), json=reloaded(s, data=shp),
                                     module_equal=module_out(s, 'data', shp, x) == x.tolist())
    s = mx.sym.gn_dbn_local_cov(V('data'), V('tot'), num_groups=2)
    res[f'gn_dbn_local_cov/{nsp}'] = dict(shapes(s, data=shp), json=reloaded(s, data=shp))
    s = mx.sym.gn_dbn_local_sums(V('data'), num_groups=2)
    res[f'gn_dbn_local_sums/{nsp}'] = dict(shapes(s, data=shp), json=reloaded(s, data=shp))
s = mx.sym.gn_dbn_whiten(V('cov'), V('mean'), V('running_mean'), V('running_projection'))
r = shapes(s, cov=(2, 3, 3))
r['json'] = reloaded(s, cov=(2, 3, 3))
res['gn_dbn_whiten'] = r
print('RESULT ' + json.dumps(res))
"""


def test_symbolic_inference_sync_ops_with_shapeless_inputs():
    """gn_dbn_apply's parameters and gn_dbn_whiten's mean / running statistics as variables without
    a shape: placeholders (_symbolic.PARAM_RANKS) let the op fill them in (without: SIGSEGV in
    MXNet's shape glue for whiten, bad_alloc for apply); gn_sync_sum passes its shape on."""
    p = run_python(_SYMBOLIC_SYNC, timeout=240)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for nsp in range(4):
        shp = [4, 6] + [3] * nsp
        r = res[f"gn_dbn_apply/{nsp}"]
        want = {"data": shp, "gamma": [6], "beta": [6], "mean": [6], "W": [2, 3, 3]}
        assert r["shapes"] == r["partial"] == want, (nsp, r)
        assert r["outs"] == [shp] and r["module"] == shp and r["json"] == list(want.values()), r
        r = res[f"gn_sync_sum/{nsp}"]
        assert r["shapes"] == r["partial"] == {"data": shp} and r["outs"] == [shp], r
        assert r["json"] == [shp] and r["module_equal"], r
        r = res[f"gn_dbn_local_cov/{nsp}"]  # tot (G, D + 1) from data; cov (G, D, D), mean (C,)
        assert r["shapes"] == r["partial"] == {"data": shp, "tot": [2, 4]}, r
        assert r["outs"] == [[2, 3, 3], [6]] and r["json"] == [shp, [2, 4]], r
        r = res[f"gn_dbn_local_sums/{nsp}"]
        assert r["shapes"] == r["partial"] == {"data": shp} and r["outs"] == [[2, 4]], r
    r = res["gn_dbn_whiten"]
    want = {"cov": [2, 3, 3], "mean": [6], "running_mean": [6], "running_projection": [2, 3, 3]}
    assert r["shapes"] == r["partial"] == want, r
    assert r["outs"] == [[2, 3, 3], [2, 3, 3], [2, 3]] and r["json"] == [[2, 3, 3], [6]], r


UNDER_ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


@pytest.mark.skipif(UNDER_ASAN, reason="MXNet 1.9.1 itself writes one entry past its shape buffer "
                    "when data has unknown rank (libmxnet's FInferShape glue; see _symbolic.py); "
                    "ASan flags lib_api's read of it")
def test_symbolic_partial_inference_without_data_shape():
    p = run_python(r"""
import json, mxnet as mx, gn_mx
V = mx.sym.var
res = []
for op, kw, n in [('gn_group_norm', dict(num_groups=2), 3), ('gn_channel_affine', {}, 3),
                  ('gn_dbn', dict(num_groups=2), 3), ('gn_dbn_inference', dict(num_groups=2), 3),
                  ('gn_dbn_apply', dict(num_groups=2), 5), ('gn_dbn_whiten', {}, 4),
                  ('gn_moments', dict(num_groups=2), 1),
                  ('gn_sync_sum', dict(key='k', timeout=5), 1)]:
    ins = [V('data')] + [V('p%d' % i) for i in range(1, n)]
    s = getattr(mx.sym, op)(*ins, **kw)
    for _ in range(20):
        try:
            a, o, x = s.infer_shape_partial()
            res.append(op)
        except mx.base.MXNetError as e:
            # every input of unknown rank: MXNet sizes its buffer as the sum of ranks, -1 here
            res.append(op + ' raised: ' + ('bad_alloc' if 'bad_alloc' in str(e) else str(e)))
print('RESULT ' + json.dumps(res))
""", timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    # with placeholders the ops with parameters complete; gn_moments and gn_sync_sum (data only)
    # get MXNet's clean error for an all-unknown input list
    assert res == [op for op in ["gn_group_norm", "gn_channel_affine", "gn_dbn",
                                 "gn_dbn_inference", "gn_dbn_apply", "gn_dbn_whiten"]
                   for _ in range(20)] + \
        [f"{op} raised: bad_alloc" for op in ("gn_moments", "gn_sync_sum") for _ in range(20)], res


@pytest.mark.xfail(strict=True, reason="known: with data of unknown rank MXNet 1.9.1 sizes its "
                   "shape buffer as -1 + 1 = 0 entries for the two-input gn_weight_standardize and "
                   "writes past it (SIGSEGV in libmxnet, before gn_mx code runs; _symbolic.py's "
                   "'Not covered' case). Fails loudly here so that a fix turns it into a pass")
def test_weight_standardize_partial_inference_without_data_shape():
    p = run_python(r"""
import mxnet as mx, gn_mx
s = mx.sym.gn_weight_standardize(mx.sym.var('data'), mx.sym.var('gain'))
try:
    s.infer_shape_partial()
    print('RESULT completed')
except mx.base.MXNetError as e:
    print('RESULT raised')
""", timeout=120)
    assert p.returncode == 0 and "RESULT " in p.stdout, (p.returncode, p.stderr[-2000:])


# ---------------------------------------------------------------------------------------------
# 2. No leak and no stale text after errors

_LEAK = r"""
import json, mxnet as mx, gn_mx
x = mx.nd.ones((2, 6, 4)); g, b = mx.nd.ones((6,)), mx.nd.zeros((6,))
x.attach_grad()
def rss_mb():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
msgs = []
for i in range(100):
    bad = [lambda: mx.nd.gn_group_norm(x, g, b, num_groups=4),
           lambda: mx.nd.gn_group_norm(x, g, b, num_groups='two'),
           lambda: mx.nd.gn_dbn(x, mx.nd.zeros((6,)), mx.nd.zeros((2, 3, 3)), num_groups=2,
                                momentum=2)][i % 3]
    try:
        bad()[0].wait_to_read()
        msgs.append(None)
    except mx.base.MXNetError as e:
        msgs.append(str(e))
def step():
    with mx.autograd.record():
        y = mx.nd.gn_group_norm(x, g, b, num_groups=2)[0]
    y.backward()
    x.grad.wait_to_read()
for _ in range(200):
    step()
r0 = rss_mb()
for _ in range(__CALLS__):
    step()
r1 = rss_mb()
print('RESULT ' + json.dumps({'msgs': msgs[:3] + msgs[-3:], 'n_none': msgs.count(None),
                              'rss0': r0, 'rss1': r1}))
"""


def test_errors_leave_no_leak_and_no_stale_text():
    calls = 2000
    p = run_python(_LEAK.replace("__CALLS__", str(calls)), timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert r["n_none"] == 0
    expected = ["must be divisible by num_groups (4)", "num_groups must be an integer",
                "momentum must be in [0, 1]"]
    for i, m in enumerate(r["msgs"]):
        k = (i if i < 3 else 100 - 6 + i) % 3
        # exactly one extension message: its own, not the earlier ones
        assert m.count("Extension Traceback") == 1 and "[1]" not in m, m
        assert expected[k] in m, m
        assert all(e not in m for j, e in enumerate(expected) if j != k), m
        # no build-machine paths in the text
        assert ".h[" not in m and ".cc[" not in m and "/src/operator" not in m, m
    # before the fix: ~1 MB per call after 100 errors (2 GB here); now flat
    growth = r["rss1"] - r["rss0"]
    print(f"RSS after 100 errors: {r['rss0']:.1f} MB -> {r['rss1']:.1f} MB over {calls} calls")
    if not UNDER_ASAN:  # ASan's quarantine keeps freed memory resident
        assert growth < 8, growth


_THREADS = r"""
import json, threading, mxnet as mx, gn_mx
x = mx.nd.ones((2, 6, 4)); g, b = mx.nd.ones((6,)), mx.nd.zeros((6,))
wrong, crashed, nerr = [], [], [0]
def work(k):
    try:
        for i in range(300):
            try:
                mx.nd.gn_group_norm(x, g, b, num_groups=4 if i % 10 == k else 2)[0].wait_to_read()
            except mx.base.MXNetError as e:
                nerr[0] += 1
                if "must be divisible by num_groups (4)" not in str(e):
                    wrong.append(str(e)[-300:])
    except Exception as e:
        crashed.append(repr(e))
ts = [threading.Thread(target=work, args=(k,)) for k in range(6)]
[t.start() for t in ts]
[t.join() for t in ts]
print('RESULT ' + json.dumps({'wrong': wrong[:3], 'nwrong': len(wrong), 'crashed': crashed,
                              'nerr': nerr[0]}))
"""


def test_concurrent_errors_keep_their_message():
    p = run_python(_THREADS, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert not r["crashed"] and r["nerr"] == 6 * 30, r
    assert r["nwrong"] == 0, r  # per-thread messages: no thread sees another's, nothing races


def test_sync_sum_barrier_nobody_joins_times_out_each_time():
    """gn_sync_sum(num_devices=2) with one caller: every call ends after its timeout with its own
    message (the key, 1 of 2 arrived), and the key works again afterwards."""
    key, x = _sync_key(), _f64(np.arange(3.0))
    for _ in range(5):
        t0 = time.monotonic()
        with pytest.raises(mx.base.MXNetError) as e:
            mx.nd.gn_sync_sum(x, key=key, num_devices=2, timeout=0.05).wait_to_read()
        elapsed, msg = time.monotonic() - t0, str(e.value)
        assert (f"gn_sync_sum: key '{key}/fwd': timed out after 0.05 s with 1 of 2 devices "
                "arrived") in msg, msg
        assert msg.count("Extension Traceback") == 1 and "[1]" not in msg, msg  # no stale text
        assert 0.04 < elapsed < 5, elapsed
    y = mx.nd.gn_sync_sum(x, key=key, num_devices=1, timeout=0.05)
    np.testing.assert_array_equal(y.asnumpy(), x.asnumpy())


# ---------------------------------------------------------------------------------------------
# 3. NaN / Inf stay in their group or channel, forward and backward (gn_group_norm and gn_moments:
#    tests/edge_cases.py, nonfinite_stays_in_its_group, on both devices)


def _fwd_bwd(fn, inputs, head=None):
    arrs = [mx.nd.array(a, dtype=a.dtype) for a in inputs]
    for a in arrs:
        a.attach_grad()
    with mx.autograd.record():
        out = fn(*arrs)
        outs = out if isinstance(out, (list, tuple)) else [out]
    heads = [mx.nd.ones(o.shape, dtype=o.dtype) if head is None else head(o) for o in outs]
    mx.autograd.backward(outs[:1], head_grads=heads[:1])
    return [o.asnumpy() for o in outs], [a.grad.asnumpy() for a in arrs]


BAD = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_stays_in_its_element_channel_affine(ctx, bad, dtype):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = np.array([[1, bad, 3, 4], [5, 6, 7, 8]], dtype=dtype).reshape(2, 2, 2)
        g = np.array([2, 3], dtype=dtype)
        b = np.array([0.5, -1], dtype=dtype)
        (y,), (dx, dg, db) = _fwd_bwd(mx.nd.gn_channel_affine, [x, g, b])
        mask = ~np.isfinite(x)
        assert (np.isnan(y[mask]) | np.isinf(y[mask])).all() and np.isfinite(y[~mask]).all()
        # dx = gamma * dy whatever x holds (the issue: [2, nan, nan, nan] before the fix)
        np.testing.assert_array_equal(dx, np.broadcast_to(g.reshape(1, 2, 1), x.shape))
        assert np.isfinite(db).all() and np.isfinite(dg[1]) and not np.isfinite(dg[0])


def test_channel_affine_backward_issue_example(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = mx.nd.array([1, np.nan, np.inf, -np.inf]).reshape(1, 1, 4)
        g, b = mx.nd.array([2]), mx.nd.array([0])
        x.attach_grad()
        with mx.autograd.record():
            y = mx.nd.gn_channel_affine(x, g, b)
        y.backward()
        np.testing.assert_array_equal(x.grad.asnumpy().ravel(), [2, 2, 2, 2])


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_stays_in_its_row_weight_standardize(ctx, bad, dtype):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        w = np.random.RandomState(0).randn(3, 2, 3).astype(dtype)
        w[1, 0, 2] = bad  # row 1 of O = 3
        gain = np.array([1.0, 2.0, 0.5], dtype)
        (y, mean, rstd), (dw, dgain) = _fwd_bwd(mx.nd.gn_weight_standardize, [w, gain])
        rows = np.array([True, False, True])
        assert np.isfinite(y[rows]).all() and np.isfinite(dw[rows]).all()
        assert not np.isfinite(y[1]).any() and not np.isfinite(dw[1]).any()
        assert np.isfinite(mean[rows]).all() and np.isfinite(dgain[rows]).all()
        ref = group_norm_ref(w[rows].reshape(1, 2, -1).astype(np.float64), gain[rows], np.zeros(2),
                             2, 1e-5)[0]
        tol = 2e-3 if dtype == np.float16 else 1e-5
        np.testing.assert_allclose(y[rows], ref.reshape(2, 2, 3), rtol=tol, atol=tol)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_stays_in_its_group_dbn(ctx, bad, dtype):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        N, C, G, S = 4, 6, 3, 3
        x = np.random.randn(N, C, S).astype(dtype)
        x[2, 3, 1] = bad  # group 1 (channels 2, 3); DBN's statistics span the batch
        rm, rp = np.zeros(C, dtype), np.tile(np.eye(2, dtype=dtype), (G, 1, 1))
        outs, grads = _fwd_bwd(
            lambda x_, m_, p_: mx.nd.gn_dbn(x_, m_, p_, num_groups=G, eps=1e-3), [x, rm, rp])
        y, dx = outs[0], grads[0]
        grp = np.zeros(C, bool)
        grp[2:4] = True
        assert np.isfinite(y[:, ~grp]).all() and np.isfinite(dx[:, ~grp]).all()
        assert not np.isfinite(y[:, grp]).all()
        ref = dbn_ref(x[:, ~grp], G - 1, 1e-3)[0]
        np.testing.assert_allclose(y[:, ~grp], ref, rtol=1e-3, atol=1e-4)
        # running statistics: only group 1 is touched
        rmn, rpn = mx.nd.array(rm, dtype=dtype), mx.nd.array(rp, dtype=dtype)
        mx.nd.gn_dbn(mx.nd.array(x, dtype=dtype), rmn, rpn, num_groups=G,
                     eps=1e-3)[0].wait_to_read()
        assert np.isfinite(rmn.asnumpy()[~grp]).all() and np.isfinite(rpn.asnumpy()[[0, 2]]).all()
        # inference: a non-finite x element reaches only its own group at its own position,
        # and dx = P^T dy never sees x
        P = np.tile(np.array([[1.5, 0.5], [0.5, 1.0]], dtype), (G, 1, 1))
        (yi,), (dxi, _, _) = _fwd_bwd(
            lambda x_, m_, p_: mx.nd.gn_dbn_inference(x_, m_, p_, num_groups=G), [x, rm, P])
        pos = np.zeros_like(x, bool)
        pos[2, 2:4, 1] = True
        assert np.isfinite(yi[~pos]).all() and not np.isfinite(yi[pos]).all()
        assert np.isfinite(dxi).all()
        # a non-finite running projection of group 0 stays in group 0
        Pb = P.copy()
        Pb[0, 1, 0] = bad
        yb = mx.nd.gn_dbn_inference(mx.nd.array(np.nan_to_num(x, nan=0, posinf=0, neginf=0)),
                                    mx.nd.array(rm), mx.nd.array(Pb), num_groups=G).asnumpy()
        assert np.isfinite(yb[:, 2:]).all()


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_stays_in_its_group_dbn_local_stats(bad, dtype):
    """A non-finite x in group 1 (of 3) reaches group 1's sums, mean and covariance only; through
    both ops the gradient of the other groups' x stays finite and right."""
    rng = np.random.RandomState(4)
    N, G, D, S = 2, 3, 2, 4
    x = rng.randn(N, G * D, S).astype(dtype)
    clean = x.astype(np.float64)
    x[1, 3, 2] = bad  # group 1
    xs = mx.nd.array(x, dtype=dtype)
    xs.attach_grad()
    with mx.autograd.record():
        tot = mx.nd.gn_dbn_local_sums(xs, num_groups=G)
        cov, mean = mx.nd.gn_dbn_local_cov(xs, tot, num_groups=G)
        loss = mx.nd.sum(cov * cov) + mx.nd.sum(mean)
    loss.backward()
    cols = clean.reshape(N, G, D, S).transpose(1, 2, 0, 3).reshape(G, D, -1)
    mu = cols.mean(axis=2)
    want = np.einsum("gik,gjk->gij", cols - mu[..., None], cols - mu[..., None]) / cols.shape[2]
    ok, t, c, m = [0, 2], tot.asnumpy(), cov.asnumpy(), mean.asnumpy().reshape(G, D)
    np.testing.assert_allclose(c[ok], want[ok], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m[ok], mu[ok], rtol=1e-12, atol=1e-14)
    assert np.isfinite(t[ok]).all() and not np.isfinite(t[1, 1])
    assert not np.isfinite(c[1]).all() and not np.isfinite(m[1]).all()
    dx = xs.grad.asnumpy().astype(np.float64).reshape(N, G, D, S)
    # d/dx of sum(C_g^2) + sum(mu_g) = (4 C_g (x - mu) + 1) / m per column, groups 0 and 2
    want_dx = (4 * np.einsum("gij,gjk->gik", want, cols - mu[..., None]) + 1) / cols.shape[2]
    want_dx = want_dx.reshape(G, D, N, S).transpose(2, 0, 1, 3)
    rtol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(dx[:, ok], want_dx[:, ok], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("bad", BAD)
def test_nonfinite_stays_in_its_element_sync_sum(bad):
    """One caller: out is data and ddata is dout, a non-finite element included, in place."""
    x = np.arange(6.0).reshape(2, 3)
    x[1, 2] = bad
    dy = np.arange(6.0).reshape(2, 3) + 1
    dy[0, 1] = bad
    (y,), (dx,) = _fwd_bwd(lambda a: mx.nd.gn_sync_sum(a, key=_sync_key(), timeout=5), [x],
                           head=lambda o: mx.nd.array(dy, dtype="float64"))
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(dx, dy)


@pytest.mark.parametrize("whitening", ["zca", "iternorm"])
@pytest.mark.parametrize("bad", BAD)
def test_nonfinite_stays_in_its_group_dbn_whiten(bad, whitening):
    """A non-finite covariance entry of group 1 (of 3): group 1's W is non-finite, the other groups'
    W, running projection and d cov are right (the documented NaN-for-that-group rule)."""
    from gn_mx.selftest import _whiten_ref
    A = np.random.RandomState(1).randn(3, 2, 6)
    cov = np.einsum("gik,gjk->gij", A, A) / 6
    mean = np.arange(6.0)
    bad_cov = cov.copy()
    bad_cov[1, 0, 1] = bad_cov[1, 1, 0] = bad
    rm, rp = _f64(np.zeros(6)), _f64(np.zeros((3, 2, 2)))
    (W, _, _), (dcov, _) = _fwd_bwd(
        lambda c, m: mx.nd.gn_dbn_whiten(c, m, rm, rp, eps=1e-3, momentum=0.5,
                                         whitening=whitening), [bad_cov, mean])
    ok = [0, 2]
    ref = _whiten_ref(cov[ok], 1e-3, whitening, 5)
    np.testing.assert_allclose(W[ok], ref, rtol=1e-10, atol=1e-12)
    assert not np.isfinite(W[1]).any()
    np.testing.assert_allclose(rp.asnumpy()[ok], 0.5 * ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(rm.asnumpy(), 0.5 * mean)  # the mean input is finite
    assert np.isfinite(dcov[ok]).all()


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_stays_in_its_column_dbn_apply(bad, dtype):
    """A non-finite x[n, c, s] reaches out[n, group(c), s] only; dx = W^T (gamma dy) never sees
    x; dW only in the column of c, dgamma only in c's group. A non-finite W of group 0 reaches
    group 0's channels only."""
    rng = np.random.RandomState(2)
    N, G, D, S = 2, 3, 2, 3
    x = rng.randn(N, G * D, S).astype(dtype)
    x[1, 3, 1] = bad  # group 1, its channel 1
    args = [x, (rng.rand(6) + 0.5).astype(dtype), rng.randn(6).astype(dtype), rng.randn(6),
            rng.randn(G, D, D)]
    (y,), (dx, dgamma, dbeta, dmean, dW) = _fwd_bwd(
        lambda *a: mx.nd.gn_dbn_apply(*a, num_groups=G), args)
    pos = np.zeros(y.shape, bool)
    pos[1, 2:4, 1] = True
    assert not np.isfinite(y[pos]).any() and np.isfinite(y[~pos]).all()
    assert np.isfinite(dx).all() and np.isfinite(dbeta).all() and np.isfinite(dmean).all()
    assert not np.isfinite(dW[1][:, 1]).any()
    dW_ok = dW.copy()
    dW_ok[1][:, 1] = 0
    assert np.isfinite(dW_ok).all()
    assert np.isfinite(dgamma[[0, 1, 4, 5]]).all() and not np.isfinite(dgamma[2:4]).any()
    ok = [a.copy() for a in args]
    ok[0] = np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    ok[4][0, 1, 0] = bad
    y2 = mx.nd.gn_dbn_apply(*[mx.nd.array(a, dtype=a.dtype) for a in ok], num_groups=G).asnumpy()
    assert np.isfinite(y2[:, [0, 2, 3, 4, 5]]).all() and not np.isfinite(y2[:, 1]).any()


# ---------------------------------------------------------------------------------------------
# 4. Extreme finite inputs: the eigensolver's stopping rule


@pytest.mark.parametrize("D, G", [(2, 3), (4, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("scale", [1e-150, 1e-30, 1e30, 1e80, 1e100, 1e150])
def test_dbn_extreme_scale_float64(ctx, D, G, scale):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        C = D * G
        x = np.random.randn(16, C, 3) * scale
        rm, rp = mx.nd.zeros((C,), dtype="float64"), mx.nd.zeros((G, D, D), dtype="float64")
        eps = 1e-5 * scale * scale  # the same relative eps at every scale (>= DBL_MIN here)
        out = mx.nd.gn_dbn(mx.nd.array(x, dtype="float64"), rm, rp, num_groups=G, eps=eps)[0]
        out = out.asnumpy()
        ref = dbn_ref(x, G, eps)[0]
        np.testing.assert_allclose(out, ref, rtol=1e-7, atol=1e-9 * np.abs(ref).max())
        # whitened: each group's covariance is ~ identity (Sigma includes eps, relative 1e-5)
        for g in range(G):
            xg = out[:, g * D:(g + 1) * D].transpose(1, 0, 2).reshape(D, -1)
            cov = np.cov(xg, bias=True)
            np.testing.assert_allclose(cov, np.eye(D), atol=1e-3)


def _nan_or_right(out, x, G, eps, rtol, atol):
    """Either the whole group is NaN (documented overflow) or it is right: never silently wrong."""
    if np.isnan(out).all():
        return
    xs = x / np.abs(x).max()  # DBN is scale invariant up to eps: compare on scaled data
    np.testing.assert_allclose(out, dbn_ref(xs, G, eps / np.abs(x).max() ** 2)[0], rtol=rtol,
                               atol=atol)


def test_dbn_float64_beyond_covariance_range_is_nan_not_silent(ctx):
    """|x| > ~1e154: the covariance overflows float64: that group's output is NaN (today)."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = np.random.randn(8, 4, 2)
        x[:, :2] *= 1e160
        out = mx.nd.gn_dbn(mx.nd.array(x, dtype="float64"), mx.nd.zeros((4,), dtype="float64"),
                           mx.nd.zeros((2, 2, 2), dtype="float64"), num_groups=2)[0].asnumpy()
        _nan_or_right(out[:, :2], x[:, :2], 1, 1e-5, 1e-7, 1e-9)
        np.testing.assert_allclose(out[:, 2:], dbn_ref(x[:, 2:], 1, 1e-5)[0], rtol=1e-7, atol=1e-9)


def test_dbn_float32_large_values(ctx):
    """float32 data: correct to |x| ~ 1e18; beyond ~1e19 the float32 Gram matrix overflows and
    the group's output is NaN today (a kernel with a wider range may make it right instead: either
    passes, a silent finite wrong answer does not)."""
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = (np.random.randn(16, 4, 2) * 1e18).astype(np.float32)
        out = mx.nd.gn_dbn(mx.nd.array(x), mx.nd.zeros((4,)), mx.nd.zeros((2, 2, 2)),
                           num_groups=2)[0].asnumpy()
        np.testing.assert_allclose(out, dbn_ref(x, 2, 1e-5)[0], rtol=2e-3, atol=2e-3)
        x[:, :2] *= np.float32(1e19)
        out = mx.nd.gn_dbn(mx.nd.array(x), mx.nd.zeros((4,)), mx.nd.zeros((2, 2, 2)),
                           num_groups=2)[0].asnumpy()
        _nan_or_right(out[:, :2], x[:, :2].astype(np.float64), 1, 1e-5, 2e-3, 2e-3)
        np.testing.assert_allclose(out[:, 2:], dbn_ref(x[:, 2:], 1, 1e-5)[0], rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------------------------------------
# 5. eps against the accumulation dtype


def _raises(fn, text):
    with pytest.raises(mx.base.MXNetError) as e:
        r = fn()
        (r[0] if isinstance(r, (list, tuple)) else r).wait_to_read()
    assert text in str(e.value), str(e.value)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("eps", ["1e-300", "1e-40", "5e-324"])
def test_eps_below_float32_range_rejected_for_fp16_fp32_data(ctx, dtype, eps):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = mx.nd.ones((2, 4, 1), dtype=dtype)
        g = mx.nd.ones((4,), dtype=dtype)
        _raises(lambda: mx.nd.gn_group_norm(x, g, g, num_groups=4, eps=eps),
                "below the smallest normal float32")
        _raises(lambda: mx.nd.gn_weight_standardize(x, mx.nd.ones((2,), dtype=dtype), eps=eps),
                "below the smallest normal float32")
        _raises(lambda: mx.nd.gn_dbn(x, mx.nd.zeros((4,), dtype=dtype),
                                     mx.nd.zeros((1, 4, 4), dtype=dtype), eps=eps),
                "below the smallest normal float32")


def test_eps_float64(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = mx.nd.array(np.random.randn(2, 4, 1), dtype="float64")
        g = mx.nd.ones((4,), dtype="float64")
        # representable in float64 accumulation: accepted and used (single-element groups)
        y = mx.nd.gn_group_norm(x, g, g * 0, num_groups=4, eps=1e-300)[0].asnumpy()
        np.testing.assert_array_equal(y, 0)
        _raises(lambda: mx.nd.gn_group_norm(x, g, g, num_groups=4, eps=5e-324),
                "below the smallest normal float64")
        # eps = 0 is allowed for GroupNorm (documented: NaN-free only for non-constant groups)
        mx.nd.gn_group_norm(x, g, g, num_groups=1, eps=0)[0].wait_to_read()
        # float32 data: the smallest normal float32 is fine, with m = 1 groups too
        x32 = mx.nd.array(np.random.randn(2, 4, 1))
        y = mx.nd.gn_group_norm(x32, g.astype("float32"), g.astype("float32") * 0, num_groups=4,
                                eps=1.2e-38)[0].asnumpy()
        assert np.isfinite(y).all()


def test_dbn_tiny_eps_m1_float32_finite_and_fp16_stats_bound(ctx):
    with ctx:  # arrays default to the test context (cpu; gpu when present)
        x = mx.nd.array(np.random.randn(1, 4, 1))
        rm, rp = mx.nd.zeros((4,)), mx.nd.zeros((1, 4, 4))
        y = mx.nd.gn_dbn(x, rm, rp, eps=1e-30, momentum=0)[0].asnumpy()
        assert np.isfinite(y).all() and np.isfinite(rp.asnumpy()).all()
        x16 = x.astype("float16")
        _raises(lambda: mx.nd.gn_dbn(x16, rm.astype("float16"), rp.astype("float16"), eps=1e-10),
                "too small for float16 running statistics")
        rp16 = mx.nd.zeros((1, 4, 4), dtype="float16")
        mx.nd.gn_dbn(x16, mx.nd.zeros((4,), dtype="float16"), rp16, eps=2.4e-10,
                     momentum=0)[0].wait_to_read()
        assert np.isfinite(rp16.asnumpy()).all()
        # float32 running statistics with float16 data: tiny eps is fine
        rp32 = mx.nd.zeros((1, 4, 4))
        mx.nd.gn_dbn(x16, mx.nd.zeros((4,)), rp32, eps=1e-12, momentum=0)[0].wait_to_read()
        assert np.isfinite(rp32.asnumpy()).all()


# ---------------------------------------------------------------------------------------------
# 6. One strict attribute parser


X6 = mx.nd.array(np.random.randn(2, 6, 4))
G6, B6 = mx.nd.ones((6,)), mx.nd.zeros((6,))


def _f64(a):
    return mx.nd.array(a, dtype="float64")

GOOD_ATTRS = [
    ("num_groups", "2"), ("num_groups", "+2"), ("num_groups", " 2"), ("num_groups", "2 "),
    ("num_groups", "\t3\n"), ("eps", "1e-5"), ("eps", " 1e-05 "), ("eps", "0.001"), ("eps", ".5"),
    ("eps", "5."), ("eps", "1E-3"), ("eps", "+1e-3"), ("eps", "0"),
]
BAD_ATTRS = [
    ("num_groups", "0x2", "must be an integer"), ("num_groups", "2.0", "must be an integer"),
    ("num_groups", "2L", "must be an integer"), ("num_groups", "", "must be an integer"),
    ("num_groups", "2 2", "must be an integer"), ("num_groups", "1e1", "must be an integer"),
    ("num_groups", "99999999999999999999", "out of the int64 range"),
    ("num_groups", "True", "must be an integer"),
    ("eps", "0x10", "must be a number"), ("eps", "0x1p-3", "must be a number"),
    ("eps", "1e-5x", "must be a number"), ("eps", "1 e-5", "must be a number"),
    ("eps", "", "must be a number"), ("eps", "e-5", "must be a number"), ("eps", ".", "must be a number"),
    ("eps", "1e", "must be a number"), ("eps", "1e400", "out of the float64 range"),
    ("eps", "1e-400", "underflows to 0 in float64"), ("eps", "nan", "finite number"),
    ("eps", "inf", "finite number"), ("eps", "-1e-5", "finite number >= 0"),
    ("eps", "5e-324", "below the smallest normal float32"),
]


@pytest.mark.parametrize("key, val", GOOD_ATTRS)
def test_attribute_parser_accepts(key, val):
    kw = {"num_groups": "2", key: val}
    y = mx.nd.gn_group_norm(X6, G6, B6, **kw)[0].asnumpy()
    ng = int(kw["num_groups"])
    ref = group_norm_ref(X6.asnumpy(), G6.asnumpy(), B6.asnumpy(), ng, float(kw.get("eps", 1e-5)))
    np.testing.assert_allclose(y, ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("key, val, text", BAD_ATTRS)
def test_attribute_parser_rejects(key, val, text):
    kw = {"num_groups": "2", key: val}
    with pytest.raises(mx.base.MXNetError) as e:
        mx.nd.gn_group_norm(X6, G6, B6, **kw)[0].wait_to_read()
    msg = str(e.value)
    assert text in msg, msg
    assert ".h[" not in msg and "/src/operator" not in msg, msg


@pytest.mark.parametrize("op, args, key", [
    ("gn_moments", (X6,), "num_groups"),
    ("gn_dbn", (X6, mx.nd.zeros((6,)), mx.nd.zeros((1, 6, 6))), "momentum"),
    ("gn_dbn", (X6, mx.nd.zeros((6,)), mx.nd.zeros((1, 6, 6))), "eps"),
    ("gn_dbn_inference", (X6, mx.nd.zeros((6,)), mx.nd.zeros((1, 6, 6))), "num_groups"),
    ("gn_weight_standardize", (X6, mx.nd.ones((X6.shape[0],))), "eps"),
    ("gn_sync_sum", (_f64(np.ones(3)),), "num_devices"),
    ("gn_sync_sum", (_f64(np.ones(3)),), "timeout"),
    ("gn_dbn_whiten", (_f64(np.eye(3)[None]), _f64(np.zeros(3))), "eps"),
    ("gn_dbn_whiten", (_f64(np.eye(3)[None]), _f64(np.zeros(3))), "momentum"),
    ("gn_dbn_whiten", (_f64(np.eye(3)[None]), _f64(np.zeros(3))), "iterations"),
    ("gn_dbn_apply", (X6, G6, B6, _f64(np.zeros(6)), _f64(np.ones((1, 6, 6)))), "num_groups"),
    ("gn_dbn_local_sums", (X6,), "num_groups"),
    ("gn_dbn_local_cov", (X6, _f64(np.ones((1, 7)))), "num_groups"),
])
def test_attribute_parser_same_rules_every_op(op, args, key):
    fn = getattr(mx.nd, op)
    extra = _sync_extra(op, key)
    with pytest.raises(mx.base.MXNetError) as e:
        r = fn(*args, *_sync_stats(op), **extra, **{key: "0x1"})
        (r[0] if isinstance(r, (list, tuple)) else r).wait_to_read()
    assert "must be a" in str(e.value)
    good = " 1 " if key in ("num_groups", "num_devices", "iterations") else " 0.5 "
    r = fn(*args, *_sync_stats(op), **extra, **{key: good})
    (r[0] if isinstance(r, (list, tuple)) else r).wait_to_read()


def _sync_extra(op, key):
    """The attributes a call needs besides the one tested: gn_sync_sum's key (one caller; a short
    timeout, though one caller never waits)."""
    if op != "gn_sync_sum":
        return {}
    return {"key": _sync_key(), **({} if key == "timeout" else {"timeout": "5"})}


def _sync_stats(op):
    """gn_dbn_whiten's running statistics, fresh for each call (updated in place)."""
    return (_f64(np.zeros(3)), _f64(np.zeros((1, 3, 3)))) if op == "gn_dbn_whiten" else ()


@pytest.mark.parametrize("op, attrs, text", [
    ("gn_sync_sum", {"timeout": "5"}, "attribute key is required"),
    ("gn_sync_sum", {"key": "", "timeout": "5"}, "attribute key is required"),
    ("gn_sync_sum", {"key": "k", "num_devices": "0", "timeout": "5"},
     "num_devices must be in [1, 4096]; got 0"),
    ("gn_sync_sum", {"key": "k", "num_devices": "4097", "timeout": "5"},
     "num_devices must be in [1, 4096]"),
    ("gn_sync_sum", {"key": "k", "timeout": "0"}, "timeout must be a finite number of seconds > 0"),
    ("gn_sync_sum", {"key": "k", "timeout": "inf"}, "timeout must be a finite number"),
    ("gn_sync_sum", {"key": "k", "timeout": "nan"}, "timeout must be a finite number"),
    ("gn_sync_sum", {"key": "k", "num_device": "1", "timeout": "5"},
     "unknown attribute 'num_device'"),
    ("gn_dbn_whiten", {"whitening": "ZCA"}, "whitening must be 'zca' or 'iternorm'; got 'ZCA'"),
    ("gn_dbn_whiten", {"iterations": "11"}, "iterations must be in [1, 10]; got 11"),
    ("gn_dbn_whiten", {"iterations": "0"}, "iterations must be in [1, 10]"),
    ("gn_dbn_whiten", {"eps": "0"}, "eps must be a finite number > 0"),
    ("gn_dbn_whiten", {"eps": "-1e-3"}, "eps must be a finite number > 0"),
    ("gn_dbn_whiten", {"momentum": "1.5"}, "momentum must be in [0, 1]"),
    ("gn_dbn_whiten", {"momentum": "nan"}, "momentum must be in [0, 1]"),
    ("gn_dbn_whiten", {"num_groups": "1"}, "unknown attribute 'num_groups'"),
    ("gn_dbn_apply", {"num_groups": "0"}, "num_groups must be positive"),
    ("gn_dbn_apply", {"num_groups": "4"}, "must be divisible by num_groups (4)"),
    ("gn_dbn_apply", {"num_groups": "1", "eps": "1e-5"}, "unknown attribute 'eps'"),
    ("gn_dbn_local_sums", {"num_groups": "0"}, "num_groups must be positive"),
    ("gn_dbn_local_sums", {"num_groups": "4"}, "must be divisible by num_groups (4)"),
    ("gn_dbn_local_sums", {"num_groups": "1", "key": "k"}, "unknown attribute 'key'"),
    ("gn_dbn_local_cov", {"num_groups": "-1"}, "num_groups must be positive"),
    ("gn_dbn_local_cov", {"num_groups": "4"}, "must be divisible by num_groups (4)"),
    ("gn_dbn_local_cov", {"num_groups": "1", "eps": "1e-5"}, "unknown attribute 'eps'"),
])
def test_attribute_parser_sync_op_rules(op, attrs, text):
    """The synchronized-DBN ops' own attribute rules: each broken one is named (no call waits:
    every gn_sync_sum case fails before its barrier)."""
    args = {"gn_sync_sum": (_f64(np.ones(3)),),
            "gn_dbn_whiten": (_f64(np.eye(3)[None]), _f64(np.zeros(3))) + _sync_stats(op),
            "gn_dbn_apply": (X6, G6, B6, _f64(np.zeros(6)), _f64(np.ones((1, 6, 6)))),
            "gn_dbn_local_sums": (X6,),
            "gn_dbn_local_cov": (X6, _f64(np.ones((1, 7))))}[op]
    with pytest.raises(mx.base.MXNetError) as e:
        r = getattr(mx.nd, op)(*args, **attrs)
        (r[0] if isinstance(r, (list, tuple)) else r).wait_to_read()
    assert text in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# Empty batches in the blocks


@pytest.mark.parametrize("hybridize", [False, True])
@pytest.mark.parametrize("cls", ["GroupNorm", "DecorrelatedBatchNorm"])
@pytest.mark.parametrize("shape", [(0, 6, 4), (2, 6, 0)])
def test_blocks_empty_batch_clear_error(cls, hybridize, shape):
    blk = getattr(gn_mx, cls)(num_groups=2)
    blk.initialize()
    if hybridize:
        blk.hybridize()
    x = mx.nd.array(np.ones(shape))
    with pytest.raises(ValueError) as e:
        with mx.autograd.record():
            blk(x)
    assert "is empty" in str(e.value) and cls in str(e.value)


# ---------------------------------------------------------------------------------------------
# 7. Zero-size and mismatched inputs: a clear MXNetError, never a crash or garbage. Under MXNet's
#    legacy shapes a 0 dim reads as "not inferred yet", so shape inference lets such inputs through
#    and the ops check what their kernels index with at run time. (Before the fix gn_dbn_whiten
#    read past a zero-size mean (SIGSEGV), wrote past zero-size running statistics and returned a
#    () array of garbage for a zero-size cov; gn_sync_sum made MXNet allocate 2^32 - 1 rows.)

_EMPTY = "empty tensors are not supported (every dim must be > 0)"
_BAD_PRELUDE = """
import mxnet as mx, numpy as np, gn_mx
A = lambda *s, dtype='float32': mx.nd.array(np.ones(s), dtype=dtype)
F = lambda *s: mx.nd.array(np.ones(s), dtype='float64')
"""
_W = "mx.nd.gn_dbn_whiten({}, eps=1e-3)"
_AP = "mx.nd.gn_dbn_apply({}, num_groups=2)"
_BAD_INPUTS = {
    "gn_group_norm/empty": ("mx.nd.gn_group_norm(A(0, 4, 2), A(4), A(4), num_groups=2)", _EMPTY),
    "gn_moments/empty": ("mx.nd.gn_moments(A(2, 4, 0), num_groups=2)", _EMPTY),
    "gn_channel_affine/empty": ("mx.nd.gn_channel_affine(A(0, 4), A(4), A(4))", _EMPTY),
    "gn_dbn/empty": ("mx.nd.gn_dbn(A(0, 4, 2), A(4), A(2, 2, 2), num_groups=2)", _EMPTY),
    "gn_dbn_inference/empty": ("mx.nd.gn_dbn_inference(A(0, 4), A(4), A(2, 2, 2), num_groups=2)",
                               _EMPTY),
    "gn_weight_standardize/empty": ("mx.nd.gn_weight_standardize(A(0, 4, 2), A(0))", _EMPTY),
    "gn_sync_sum/empty": ("mx.nd.gn_sync_sum(F(0, 3), key='bad/1', timeout=5)",
                          _EMPTY + "; data shape (0, 3)"),
    # fails before its barrier: no wait for the second device
    "gn_sync_sum/empty_two_devices": ("mx.nd.gn_sync_sum(F(3, 0), key='bad/2', num_devices=2, "
                                      "timeout=5)", _EMPTY),
    "gn_sync_sum/dtype": ("mx.nd.gn_sync_sum(A(3), key='bad/3', timeout=5)",
                          "input 0 must be float64; got float32"),
    "gn_dbn_whiten/empty_cov": (_W.format("F(0, 2, 2), F(0), F(0), F(0, 2, 2)"),
                                _EMPTY + "; cov shape (0, 2, 2)"),
    "gn_dbn_whiten/empty_group": (_W.format("F(2, 0, 0), F(0), F(0), F(2, 0, 0)"), _EMPTY),
    "gn_dbn_whiten/empty_mean": (_W.format("F(1, 2, 2), F(0), F(2), F(1, 2, 2)"),
                                 "mean must have 2 elements for cov shape (1, 2, 2); got shape "
                                 "(0,)"),
    "gn_dbn_whiten/empty_running_mean": (_W.format("F(1, 2, 2), F(2), F(0), F(0, 2, 2)"),
                                         "running_mean must have 2 elements"),
    "gn_dbn_whiten/empty_running_projection": (_W.format("F(1, 2, 2), F(2), F(2), F(1, 0, 2)"),
                                               "running_projection must have 4 elements"),
    "gn_dbn_whiten/cov_rank": (_W.format("F(2, 2), F(2), F(2), F(2, 2)"),
                               "cov must have shape (G, D, D)"),
    "gn_dbn_whiten/cov_dtype": (_W.format("A(1, 2, 2), F(2), F(2), F(1, 2, 2)"),
                                "input 0 must be float64; got float32"),
    "gn_dbn_whiten/stats_dtype": (_W.format("F(1, 2, 2), F(2), A(2, dtype='int32'), "
                                            "A(1, 2, 2, dtype='int32')"),
                                  "running statistics must be a float type; got int32"),
    "gn_dbn_apply/empty": (_AP.format("A(0, 4, 2), A(4), A(4), F(4), F(2, 2, 2)"), _EMPTY),
    "gn_dbn_apply/empty_spatial": (_AP.format("A(2, 4, 0), A(4), A(4), F(4), F(2, 2, 2)"), _EMPTY),
    "gn_dbn_apply/empty_mean": (_AP.format("A(1, 4, 2), A(4), A(4), F(0), F(2, 2, 2)"),
                                "mean / W do not match data shape (1, 4, 2)"),
    "gn_dbn_apply/empty_W": (_AP.format("A(1, 4, 2), A(4), A(4), F(4), F(2, 0, 2)"),
                             "mean / W do not match data shape (1, 4, 2)"),
    "gn_dbn_apply/W_shape": (_AP.format("A(1, 4, 2), A(4), A(4), F(4), F(1, 4, 4)"),
                             "W must have shape (2, 2, 2) for data shape (1, 4, 2); got (1, 4, 4)"),
    "gn_dbn_apply/mean_dtype": (_AP.format("A(1, 4, 2), A(4), A(4), A(4), F(2, 2, 2)"),
                                "mean must be float64; got float32"),
    "gn_dbn_local_sums/empty": ("mx.nd.gn_dbn_local_sums(A(0, 4, 2), num_groups=2)", _EMPTY),
    "gn_dbn_local_sums/int_data": ("mx.nd.gn_dbn_local_sums(A(1, 4, dtype='int32'), num_groups=2)",
                                   "int32"),
    "gn_dbn_local_cov/empty": ("mx.nd.gn_dbn_local_cov(A(2, 4, 0), F(2, 3), num_groups=2)[0]",
                               _EMPTY),
    "gn_dbn_local_cov/tot_shape": ("mx.nd.gn_dbn_local_cov(A(1, 4, 2), F(2, 2), num_groups=2)[0]",
                                   "tot must have shape (2, 3) for data shape (1, 4, 2); got (2, 2)"),
    "gn_dbn_local_cov/tot_dtype": ("mx.nd.gn_dbn_local_cov(A(1, 4, 2), A(2, 3), num_groups=2)[0]",
                                   "tot must be float64; got float32"),
    "gn_dbn_local_cov/group_too_large": ("mx.nd.gn_dbn_local_cov(A(1, 4097), F(1, 4098), "
                                         "num_groups=1)[0]",
                                         "group size C / num_groups must be <= "),
}


def test_zero_size_and_mismatched_inputs_every_op():
    check_bad_inputs(_BAD_PRELUDE, _BAD_INPUTS,
                     "mx.nd.gn_sync_sum(F(2), key='alive', timeout=5).asnumpy().tolist()",
                     "[1.0, 1.0]")
