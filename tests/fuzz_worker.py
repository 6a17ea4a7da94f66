"""Fuzz worker for tests/test_fuzz.py (run in a subprocess; not a pytest module).

  python tests/fuzz_worker.py run N        # N hypothesis cases (derandomized), prints counts
  python tests/fuzz_worker.py replay JSON  # one case, given as the JSON printed by `run`

Every case draws an op, a shape (0-4 spatial dims, sizes of 1 included), groups, data dtype and
parameter / statistics dtype (float16 data with float32 params), eps / num_groups / momentum as
attribute STRINGS (valid and invalid spellings), a mode (imperative, hybridized, symbolic) and
forward or forward+backward. `expect_error` (a Python mirror of the ops' documented rules) says
whether the op must raise MXNetError; otherwise outputs and gradients are compared with the float64
references of tests/reference.py. The synchronized-DBN ops (gn_sync_sum, gn_dbn_whiten,
gn_dbn_apply, gn_dbn_local_sums, gn_dbn_local_cov) have their rules, inputs (planted bad ones
included) and checks in tests/fuzz_sync.py; their errors must also name one of the broken rules.
Before each call the case is printed as `START <json>` so that the parent can name the input of a
crash.
"""
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mxnet as mx  # noqa: E402
import gn_mx  # noqa: E402,F401
import fuzz_sync  # noqa: E402  (the synchronized-DBN ops' rules, inputs and checks)
from gn_mx._library import OPS  # noqa: E402  (the one op list: every op is fuzzed)
from mxnet import autograd, gluon  # noqa: E402

from reference import (dbn_bwd_ref, dbn_inference_ref, dbn_ref, group_norm_bwd_ref,  # noqa: E402
                       group_norm_ref, moments_bwd_ref, moments_ref)

FLT_MIN, DBL_MIN = 1.1754943508222875e-38, 2.2250738585072014e-308
ATTRS = {"gn_moments": ["num_groups"], "gn_group_norm": ["num_groups", "eps"],
         "gn_channel_affine": [], "gn_dbn": ["num_groups", "eps", "momentum"],
         "gn_dbn_inference": ["num_groups"], "gn_weight_standardize": ["eps"], **fuzz_sync.ATTRS}
assert set(ATTRS) == set(OPS), "fuzz_worker.py: ATTRS, _inputs and check need every op of OPS"
# ops with an eps attribute checked as gn_group_norm's (finite, >= 0, 0 or a normal of the
# accumulation dtype)
_GN_EPS = ("gn_group_norm", "gn_weight_standardize")
_INT = re.compile(r"^[+-]?[0-9]+$")
_NUM = re.compile(r"^[+-]?(([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?)$")
_SPECIAL = re.compile(r"^[+-]?(inf|infinity|nan)$", re.IGNORECASE)
_WS = " \t\n\r\f\v"


# ---- the documented rules, in Python -------------------------------------------------------------
def parse_int(s):
    t = s.strip(_WS)
    if not _INT.match(t):
        raise ValueError("must be an integer")
    v = int(t)
    if not -2**63 <= v < 2**63:
        raise ValueError("out of the int64 range")
    return v


def parse_num(s):
    t = s.strip(_WS)
    if _SPECIAL.match(t):
        return float(t)
    m = _NUM.match(t)
    if not m:
        raise ValueError("must be a number")
    v = float(t)
    if math.isinf(v):
        raise ValueError("out of the float64 range")
    if v == 0 and any(c in "123456789" for c in m.group(2).split("e")[0].split("E")[0]):
        raise ValueError("underflows to 0 in float64")
    return v


def expect_error(c):
    """None if the call is valid, else a short reason (for the synchronized-DBN ops: the message
    fragments of every broken rule, joined by ' | ', one of which the error must contain)."""
    op, dt, pdt = c["op"], c["dtype"], c["pdtype"]
    if op in fuzz_sync.SYNC_OPS:
        return " | ".join(fuzz_sync.violations(c, parse_int, parse_num)) or None
    try:
        G = parse_int(c["attrs"]["num_groups"]) if "num_groups" in c["attrs"] else 1
        eps = parse_num(c["attrs"]["eps"]) if "eps" in c["attrs"] else 1e-5
        mom = parse_num(c["attrs"]["momentum"]) if "momentum" in c["attrs"] else 0.9
    except ValueError as e:
        return str(e)
    if any(k not in ATTRS[op] for k in c["attrs"]):
        return "unknown attribute"
    if G <= 0:
        return "num_groups must be positive"
    C = c["shape"][1]
    if C % G:
        return "not divisible"
    if "dbn" in op and G != c["G"]:
        return "running_projection shape does not match num_groups"
    if op == "gn_dbn":
        if not (eps > 0 and math.isfinite(eps)):
            return "eps must be a finite number > 0"
        if not 0 <= mom <= 1:
            return "momentum"
    elif op in _GN_EPS:
        if not (eps >= 0 and math.isfinite(eps)):
            return "eps must be a finite number >= 0"
    if pdt is not None and pdt != dt and not (dt == "float16" and pdt == "float32"):
        return "param dtype"
    if op in _GN_EPS + ("gn_dbn",) and eps != 0:
        if eps < (DBL_MIN if dt == "float64" else FLT_MIN):
            return "eps below the accumulation dtype's normal range"
        if op == "gn_dbn" and (pdt or dt) == "float16" and eps < 2.4e-10:
            return "eps too small for float16 statistics"
    return None


# ---- running one case -------------------------------------------------------------------------------
class _OpBlock(gluon.HybridBlock):
    def __init__(self, op, attrs):
        super().__init__()
        self._op, self._attrs = op, attrs

    def hybrid_forward(self, F, *xs):
        return getattr(F, self._op)(*xs, **self._attrs)


def _inputs(c, rng):
    op, shape, dt = c["op"], tuple(c["shape"]), c["dtype"]
    if op in fuzz_sync.SYNC_OPS:
        return fuzz_sync.inputs(c, rng)
    pdt = c["pdtype"] or dt
    C = shape[1]
    x = (rng.standard_normal(shape) * c["scale"] + c["shift"]).astype(dt)
    if op == "gn_moments":
        return [x]
    if op in ("gn_group_norm", "gn_channel_affine"):
        return [x, (rng.random(C) + 0.5).astype(pdt), rng.standard_normal(C).astype(pdt)]
    if op == "gn_weight_standardize":  # x is the weight (O, *fan_in), O = shape[0]; gain (O,)
        return [x, (rng.random(shape[0]) + 0.5).astype(pdt)]
    G = max(1, c["G"])
    D = C // G
    rm = (rng.standard_normal(C) * 0.1).astype(pdt)
    A = rng.standard_normal((G, D, D)) * 0.3
    rp = (np.eye(D)[None] + A @ A.transpose(0, 2, 1) * 0.1).astype(pdt)
    return [x, rm, rp]


def _run(c, inputs, rng):
    """Outputs (numpy), head gradients, with backward the gradients of the forward inputs, and the
    inputs after the call (the running statistics an op updates in place)."""
    op, mode, attrs = c["op"], c["mode"], fuzz_sync.unique_attrs(c)
    n_out = {"gn_moments": 2, "gn_group_norm": 3, "gn_dbn": 4, "gn_weight_standardize": 3,
             "gn_dbn_whiten": 3, "gn_dbn_local_cov": 2}.get(op, 1)
    heads_for = [0, 1] if op == "gn_moments" else [0]
    if mode == "symbolic":
        names = ["data", "p1", "p2", "p3", "p4"][:len(inputs)]
        syms = [mx.sym.var(n) for n in names]
        s = getattr(mx.sym, op)(*syms, **attrs)
        outs_sym = mx.sym.Group([s[i] for i in heads_for]) if n_out > 1 else s
        aux_names = s.list_auxiliary_states()
        shapes = {n: a.shape for n, a in zip(names, inputs)}
        types = {n: a.dtype for n, a in zip(names, inputs)}
        grad_req = {n: ("write" if c["backward"] and n not in aux_names else "null")
                    for n in outs_sym.list_arguments()}
        exe = outs_sym.simple_bind(mx.cpu(), grad_req=grad_req, type_dict=types, **shapes)
        for n, a in zip(names, inputs):
            (exe.aux_dict if n in aux_names else exe.arg_dict)[n][:] = a
        exe.forward(is_train=c["backward"])
        outs = [o.asnumpy() for o in exe.outputs]
        grads = None
        if c["backward"]:
            heads = [rng.standard_normal(o.shape).astype(o.dtype) for o in outs]
            exe.backward([mx.nd.array(h, dtype=h.dtype) for h in heads])
            grads = [exe.grad_dict[n].asnumpy() if n in exe.grad_dict and grad_req.get(n) == "write"
                     else None for n in names]
        after = [(exe.aux_dict if n in aux_names else exe.arg_dict)[n].asnumpy() for n in names]
        return outs, heads if c["backward"] else None, grads, after
    arrs = [mx.nd.array(a, dtype=a.dtype) for a in inputs]
    for a in arrs:
        if a.size:  # MXNet's own zeros_like fails on a zero-size array (legacy shapes)
            a.attach_grad()
    fn = (lambda *xs: getattr(mx.nd, op)(*xs, **attrs)) if mode == "imperative" else \
        _OpBlock(op, attrs)
    if mode == "hybridized":
        fn.hybridize()
    with autograd.record(train_mode=c["backward"]):
        res = fn(*arrs)
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        sel = [res[i] for i in heads_for]
    for o in sel:  # a failed forward raises here, with its own message, not at the backward
        o.wait_to_read()
    heads = None
    if c["backward"]:
        heads = [rng.standard_normal(o.shape).astype(o.dtype) for o in sel]
        autograd.backward(sel, head_grads=[mx.nd.array(h, dtype=h.dtype) for h in heads])
    outs = [o.asnumpy() for o in sel]
    grads = [None if a.grad is None else a.grad.asnumpy() for a in arrs] if c["backward"] else None
    return outs, heads, grads, [a.asnumpy() for a in arrs]


_U = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-13}
# Unit of the accumulation dtype (statistics and the normalization run in float32 for float16 data):
# the conditioning terms (cancellation in x - mean, amplified by rstd) scale with it, the output's
# own rounding with _U.
_U_ACC = {"float16": 1e-6, "float32": 1e-6, "float64": 1e-13}


def _close(name, got, ref, tol):
    """got ~ ref within tol * max(1, max|ref|); where ref is not finite (eps = 0 on a constant
    group: 0 * inf) got must not be finite either; float16 results beyond its range are inf."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        return f"{name}: shape {got.shape} != {ref.shape}"
    fin = np.isfinite(ref)
    if np.isfinite(got[~fin]).any():
        return f"{name}: finite where the reference is not"
    keep = fin & (np.abs(np.where(fin, ref, 0)) < 6e4 if got.dtype == np.float16 else fin)
    r, g = ref[keep], got[keep]
    if not np.isfinite(g).all():
        return f"{name}: non-finite values where the reference is finite"
    scale = max(1.0, float(np.abs(r).max()) if r.size else 1.0)
    err = float(np.abs(g - r).max()) if r.size else 0.0
    if err > tol * scale:
        return f"{name}: max error {err:.3g} > {tol * scale:.3g}"
    return None


# check()'s verdict for a case whose tolerance cannot tell a right result from a wrong one (an
# ill-conditioned float16 DBN forward): counted apart, neither ok nor a mismatch.
UNCHECKED = "unchecked"


def _check_ws(w, gain, eps, outs, heads, grads, u, ua):
    """gn_weight_standardize against gn_group_norm's reference on the weight as (1, O, F) data in O
    groups, gamma = gain, beta = 0 (docs/reference/ops.md); the same tolerances."""
    O = w.shape[0]
    x = w.reshape(1, O, -1)
    ref, _, rstd = group_norm_ref(x, gain, np.zeros(O), O, eps)
    fin = rstd[np.isfinite(rstd)]
    cond = max(1.0, float(fin.max() if fin.size else 1.0) * float(np.abs(x).max()))
    errs = [_close("out", outs[0], ref.reshape(w.shape), 20 * u + 20 * ua * cond)]
    if grads:
        dx, dg, _ = group_norm_bwd_ref(x, gain, heads[0].astype(np.float64).reshape(x.shape), O, eps)
        errs += [_close("dweight", grads[0], dx.reshape(w.shape), 200 * u + 200 * ua * cond ** 2),
                 _close("dgain", grads[1], dg, 100 * u * cond * x.size)]
    return errs


def check(c, inputs, outs, heads, grads, after=None):
    """Compare with the float64 references; returns a mismatch text, UNCHECKED or None."""
    op, dt = c["op"], c["dtype"]
    if op in fuzz_sync.SYNC_OPS:
        errs = fuzz_sync.check(c, inputs, outs, heads, grads, after, _close, _U)
        if errs == UNCHECKED:
            return UNCHECKED
        errs = [e for e in errs if e]
        return "; ".join(errs) if errs else None
    attrs = c["attrs"]
    G = parse_int(attrs["num_groups"]) if "num_groups" in attrs else 1
    eps = parse_num(attrs["eps"]) if "eps" in attrs else 1e-5
    x = inputs[0].astype(np.float64)
    u = _U[dt]
    if op == "gn_moments":
        mean, var = moments_ref(x, G)
        errs = [_close("mean", outs[0], mean, 20 * u), _close("var", outs[1], var, 50 * u)]
        if grads:
            errs.append(_close("dx", grads[0], moments_bwd_ref(x, G, heads[0], heads[1]), 50 * u))
    elif op == "gn_group_norm":
        g, b = inputs[1].astype(np.float64), inputs[2].astype(np.float64)
        ref, _, rstd = group_norm_ref(x, g, b, G, eps)
        fin = rstd[np.isfinite(rstd)]
        cond = max(1.0, float(fin.max() if fin.size else 1.0) * float(np.abs(x).max()))
        ua = _U_ACC[dt]
        errs = [_close("out", outs[0], ref, 20 * u + 20 * ua * cond)]
        if grads:
            dx, dg, db = group_norm_bwd_ref(x, g, heads[0], G, eps)
            errs += [_close("dx", grads[0], dx, 200 * u + 200 * ua * cond ** 2),
                     _close("dgamma", grads[1], dg, 100 * u * cond * x.size),
                     _close("dbeta", grads[2], db, 20 * u * x.size)]
    elif op == "gn_weight_standardize":
        errs = _check_ws(x, inputs[1].astype(np.float64), eps, outs, heads, grads, u, _U_ACC[dt])
    elif op == "gn_channel_affine":
        g, b = inputs[1].astype(np.float64), inputs[2].astype(np.float64)
        bs = (1, -1) + (1,) * (x.ndim - 2)
        errs = [_close("out", outs[0], x * g.reshape(bs) + b.reshape(bs), 10 * u)]
        if grads:
            dy = heads[0].astype(np.float64)
            red = (0,) + tuple(range(2, x.ndim))
            errs += [_close("dx", grads[0], dy * g.reshape(bs), 10 * u),
                     _close("dgamma", grads[1], (dy * x).sum(axis=red), 10 * u * x.size),
                     _close("dbeta", grads[2], dy.sum(axis=red), 10 * u * x.size)]
    elif op == "gn_dbn":
        ref, _, W = dbn_ref(x, G, eps)
        lam = np.linalg.eigvalsh(np.linalg.inv(W @ W))  # Sigma's eigenvalues
        cond = float(lam.max() / lam.min())
        if 50 * u * cond >= 1 and not (grads and c["well_conditioned"]):
            return UNCHECKED  # a tolerance beyond the outputs' scale would pass anything
        errs = [_close("out", outs[0], ref, 50 * u * cond)]
        if grads and c["well_conditioned"]:
            errs.append(_close("dx", grads[0], dbn_bwd_ref(x, heads[0], G, eps),
                               500 * u * cond ** 1.5))
    else:
        rm, rp = inputs[1].astype(np.float64), inputs[2].astype(np.float64)
        errs = [_close("out", outs[0], dbn_inference_ref(x, rm, rp, G), 20 * u)]
        if grads:
            N, C = x.shape[:2]
            D = C // G
            dy = heads[0].astype(np.float64).reshape(N, G, D, -1)
            dx = np.einsum("gji,ngjs->ngis", rp, dy).reshape(x.shape)
            errs.append(_close("dx", grads[0], dx, 20 * u))
    errs = [e for e in errs if e]
    return "; ".join(errs) if errs else None


def run_case(c):
    """'ok' | 'error' (expected MXNetError) | 'unchecked' (UNCHECKED) | 'mismatch: ...'."""
    rng = np.random.default_rng(c["seed"])
    inputs = _inputs(c, rng)
    why = expect_error(c)
    try:
        outs, heads, grads, after = _run(c, inputs, rng)
    except (mx.base.MXNetError, ValueError, RuntimeError) as e:
        msg = str(e)
        if why is None:
            return "mismatch: unexpected error: " + msg[-400:]
        if ".h[" in msg or ".cc[" in msg or "/src/operator" in msg:
            return "mismatch: error text has a build path: " + msg[-300:]
        if c["op"] in fuzz_sync.SYNC_OPS and not any(f in msg for f in why.split(" | ")):
            return f"mismatch: the error names none of ({why}): " + msg[-400:]
        return "error"
    if why is not None:
        return f"mismatch: no error raised (expected: {why})"
    if os.environ.get("GNMX_FUZZ_SELFTEST"):  # proves the checker can fail: perturb results
        outs = [o * 1.1 + 0.1 for o in outs]
        grads = [g * 1.1 + 0.1 if g is not None else None for g in grads or []] or None
    bad = check(c, inputs, outs, heads, grads, after)
    if bad == UNCHECKED:
        return UNCHECKED
    return "mismatch: " + bad if bad else "ok"


# ---- case strategy ------------------------------------------------------------------------------------
def strategy():
    from hypothesis import strategies as st

    int_strs = st.one_of(
        st.integers(1, 4).map(str),
        st.sampled_from([" 2", "2 ", "+1", "\t1\n", "0", "-2", "0x2", "2.0", "", "two", "1e1",
                         "3", "99999999999999999999"]))
    eps_strs = st.one_of(
        st.sampled_from([1e-5, 1e-3, 0.1, 1.0]).map(repr),
        st.sampled_from(["0", "1e-300", "1e-40", "5e-324", "1.2e-38", "2.4e-10", "1e-10",
                         " 1e-05 ", "1E-3", ".5", "5.", "0x1p-3", "nan", "inf", "-1e-5",
                         "1e400", "1e-400", "1e-5x", "e-5"]))
    mom_strs = st.sampled_from(["0.9", "0", "1", "0.5", "1.5", "-0.1", "nan", "0x1"])

    @st.composite
    def case(draw):
        op = draw(st.sampled_from(OPS))
        dbn = "dbn" in op
        G = draw(st.integers(1, 4))
        D = draw(st.sampled_from([1, 2, 3, 4, 5, 9]) if dbn else st.integers(1, 4))
        nsp = draw(st.integers(0, 4))
        sp = draw(st.lists(st.integers(1, 3), min_size=nsp, max_size=nsp))
        N = draw(st.integers(1, 4))
        if dbn and draw(st.booleans()):
            N = max(N, 2 * D + 2)  # well-conditioned batches too
        shape = [N, G * D] + sp
        sync = op in fuzz_sync.SYNC_OPS
        if sync:
            dtype, pdtype = fuzz_sync.draw_dtypes(draw, st, op)
            attrs = fuzz_sync.draw_attrs(draw, st, op, G, int_strs, eps_strs, mom_strs, parse_int)
        else:
            dtype = draw(st.sampled_from(["float16", "float32", "float64"]))
            pdtype = None
            if op != "gn_moments":
                pdtype = draw(st.sampled_from([dtype, dtype, "float32", "float64", "float16"]))
            attrs = {}
        if "num_groups" in ATTRS[op] and not sync:
            # mostly the right G, sometimes an arbitrary spelling
            attrs["num_groups"] = str(G) if draw(st.integers(0, 5)) else draw(int_strs)
        if "eps" in ATTRS[op] and not sync and draw(st.integers(0, 2)) == 0:
            attrs["eps"] = draw(eps_strs)
        if op == "gn_dbn" and "eps" not in attrs:
            attrs["eps"] = draw(st.sampled_from(["1e-3", "0.01", "0.1"]))
        if op == "gn_dbn" and draw(st.integers(0, 3)) == 0:
            attrs["momentum"] = draw(mom_strs)
        if draw(st.integers(0, 19)) == 0:
            attrs["num_group"] = "2"  # a typo: unknown attribute
        m = N * int(np.prod(sp)) if sp else N
        mode = draw(st.sampled_from(["imperative", "imperative", "hybridized", "symbolic"]))
        extra = {"corrupt": fuzz_sync.draw_corrupt(draw, st, op, mode)} if sync else {}
        return {
            **extra, "op": op, "shape": shape, "G": G, "dtype": dtype, "pdtype": pdtype,
            "attrs": attrs,
            "mode": mode,
            "backward": draw(st.booleans()),
            "scale": draw(st.sampled_from([1.0, 1.0, 3.0, 0.01])),
            "shift": draw(st.sampled_from([0.0, 0.0, 2.0])),
            "seed": draw(st.integers(0, 2**31 - 1)),
            "well_conditioned": bool(dbn and m >= 2 * D + 2 and dtype != "float16"),
        }
    return case()


def main():
    if sys.argv[1] == "replay":
        c = json.loads(sys.argv[2])
        print("START " + json.dumps(c), flush=True)
        print("RESULT " + run_case(c), flush=True)
        return
    from hypothesis import HealthCheck, Phase, given, settings
    n = int(sys.argv[2])
    counts = {"calls": 0, "ok": 0, "errors_raised": 0, "unchecked": 0, "mismatches": 0,
              "by_op": {}}
    failures = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy())
    def fuzz(c):
        print("START " + json.dumps(c), flush=True)
        r = run_case(c)
        counts["calls"] += 1
        counts["by_op"][c["op"]] = counts["by_op"].get(c["op"], 0) + 1
        if r == "ok":
            counts["ok"] += 1
        elif r == "error":
            counts["errors_raised"] += 1
        elif r == UNCHECKED:
            counts["unchecked"] += 1
        else:
            counts["mismatches"] += 1
            failures.append({"case": c, "result": r})

    fuzz()
    print("COUNTS " + json.dumps(counts), flush=True)
    for f in failures[:20]:
        print("FAILURE " + json.dumps(f), flush=True)


if __name__ == "__main__":
    main()
