"""The synchronized-DBN ops' part of the fuzzer (tests/fuzz_worker.py; not a pytest module).

gn_sync_sum runs with one caller: num_devices=1 completes the round (out == data, ddata == dout);
a valid num_devices > 1 always comes with a timeout of milliseconds and must time out. Its key is
made unique per call at run time (`unique_attrs`). gn_dbn_whiten gets the covariance of a random
(G, D, m) batch (singular when m < D), gn_dbn_apply random mean / W; both are compared with the
self-test's float64 references (gn_mx.selftest._whiten_ref / _dbn_apply_ref), the whitening's
gradient with central differences of that reference, the running statistics with their update rule.
gn_dbn_local_sums / gn_dbn_local_cov are compared with float64 numpy sums and covariances and their
closed-form gradients; gn_dbn_local_cov's tot is this device's sums plus those of a second, random
"device" (a global mean and count that are not this device's own).

Bad calls: `violations(c)` lists the message fragments of every rule the call breaks (attribute
spellings and values, dtypes, shapes, the planted `corrupt` input, zero-size data); the op must
raise an MXNetError containing one of them.
"""
import itertools
import math
import os

import numpy as np

from gn_mx.selftest import _dbn_apply_ref, _whiten_ref

LOCAL_OPS = ("gn_dbn_local_sums", "gn_dbn_local_cov")
SYNC_OPS = ("gn_sync_sum", "gn_dbn_whiten", "gn_dbn_apply") + LOCAL_OPS
ATTRS = {"gn_sync_sum": ["key", "num_devices", "timeout"],
         "gn_dbn_whiten": ["eps", "momentum", "whitening", "iterations"],
         "gn_dbn_apply": ["num_groups"], "gn_dbn_local_sums": ["num_groups"],
         "gn_dbn_local_cov": ["num_groups"]}
EMPTY = "empty tensors are not supported"
# The planted bad input of a case -> the message fragment it must raise (besides the attributes').
CORRUPT = {
    "gn_sync_sum": {"empty": EMPTY},
    "gn_dbn_whiten": {"empty": EMPTY, "cov_nonsquare": "cov must have shape (G, D, D)",
                      "mean_len": "input 1 must have shape",
                      "rproj_shape": "input 3 must have shape",
                      "mean_dtype": "input 1 must be float64",
                      "stats_mixed": "must have the same dtype",
                      "stats_int": "running statistics must be a float type"},
    "gn_dbn_apply": {"empty": EMPTY, "mean_len": "mean must have shape",
                     "w_shape": "W must have shape", "mean_dtype": "mean must be float64",
                     "w_dtype": "W must be float64", "gamma_len": "gamma must have shape",
                     "rank1": "data must have at least 2 dims"},
    "gn_dbn_local_sums": {"empty": EMPTY, "rank1": "data must have at least 2 dims"},
    "gn_dbn_local_cov": {"empty": EMPTY, "rank1": "data must have at least 2 dims",
                         "tot_shape": "tot must have shape", "tot_dtype": "tot must be float64"},
}
_calls = itertools.count()
UNCHECKED = "unchecked"  # fuzz_worker.UNCHECKED


# ---- the documented rules (docs/reference/ops.md, src/operator/mx/dbn_sync_ops.cc) ---------------
def _attr(attrs, name, parse, default, ok, text):
    """(value, [message fragment]) of one attribute: its spelling, then its range."""
    if name not in attrs:
        return default, []
    try:
        v = parse(attrs[name])
    except ValueError as e:
        msg = str(e)
        return None, [f"attribute {name} " + ("is " + msg if msg.startswith("out of") else msg)]
    return v, ([] if ok(v) else [text])


def _fin(lo, hi=math.inf, lo_open=False):
    """The range check of a number attribute: finite, above lo (or at it), at most hi."""
    return lambda v: math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi


def violations(c, parse_int, parse_num):
    """Message fragments of the rules the case breaks ([] = a valid call); one must be raised."""
    op, a = c["op"], c["attrs"]
    bad = [f"unknown attribute '{k}'" for k in a if k not in ATTRS[op]]
    if c.get("corrupt"):
        bad.append(CORRUPT[op][c["corrupt"]])
    if op == "gn_sync_sum":
        if not a.get("key"):
            bad.append("attribute key is required")
        nd, e1 = _attr(a, "num_devices", parse_int, 1, lambda v: 1 <= v <= 4096,
                       "num_devices must be in [1, 4096]")
        _, e2 = _attr(a, "timeout", parse_num, 60.0, _fin(0, lo_open=True),
                      "timeout must be a finite number of seconds > 0")
        if c["dtype"] != "float64":
            bad.append("input 0 must be float64")
        bad += e1 + e2
        if not bad and nd > 1:
            bad.append(f"timed out after {float(a['timeout']):g} s with 1 of {nd} devices arrived")
        return bad
    if op == "gn_dbn_whiten":
        _, e1 = _attr(a, "eps", parse_num, 1e-5, _fin(0, lo_open=True),
                      "eps must be a finite number > 0")
        _, e2 = _attr(a, "momentum", parse_num, 0.9, _fin(0, 1), "momentum must be in [0, 1]")
        _, e3 = _attr(a, "iterations", parse_int, 5, lambda v: 1 <= v <= 10,
                      "iterations must be in [1, 10]")
        if a.get("whitening", "zca") not in ("zca", "iternorm"):
            bad.append("whitening must be 'zca' or 'iternorm'")
        if c["dtype"] != "float64":
            bad.append("input 0 must be float64")
        return bad + e1 + e2 + e3
    G, e1 = _attr(a, "num_groups", parse_int, 1, lambda v: v > 0, "num_groups must be positive")
    bad += e1
    if not e1 and c["shape"][1] % G:
        bad.append("must be divisible by num_groups")
    elif not e1 and G != c["G"] and op != "gn_dbn_local_sums":
        bad.append("W must have shape" if op == "gn_dbn_apply" else "tot must have shape")
    if op in LOCAL_OPS:
        return bad
    dt, pdt = c["dtype"], c["pdtype"]
    if pdt != dt and not (dt == "float16" and pdt == "float32"):
        bad.append("dtype must equal the data dtype (or be float32 with float16 data)")
    return bad


# ---- inputs --------------------------------------------------------------------------------------
def _columns(c, rng):
    """The case's data as float64 (G, D, m) columns: N * prod(spatial) samples of G groups."""
    shape, G = c["shape"], c["G"]
    m = shape[0] * int(np.prod(shape[2:], dtype=np.int64))
    X = rng.standard_normal((G, shape[1] // G, m)) * c["scale"] + c["shift"]
    return X


def inputs(c, rng):
    """The op's inputs (numpy) for case c, with its `corrupt` input planted."""
    op, dt, bad = c["op"], c["dtype"], c.get("corrupt")
    shape = [0] + c["shape"][1:] if bad == "empty" else c["shape"]
    if op == "gn_sync_sum":
        return [(rng.standard_normal(shape) * c["scale"] + c["shift"]).astype(dt)]
    if op == "gn_dbn_whiten":
        return _whiten_inputs(c, rng)
    if op in LOCAL_OPS:
        return _local_inputs(c, rng, shape)
    C, G = shape[1], c["G"]
    D = C // G
    x = (rng.standard_normal(shape) * c["scale"] + c["shift"]).astype(dt)
    gamma = (rng.random(C + (bad == "gamma_len")) + 0.5).astype(c["pdtype"])
    beta = rng.standard_normal(C).astype(c["pdtype"])
    mean = rng.standard_normal(C + (bad == "mean_len")).astype(
        "float32" if bad == "mean_dtype" else "float64")
    W = (rng.standard_normal((G, D, D + (bad == "w_shape"))) * 0.5).astype(
        "float32" if bad == "w_dtype" else "float64")
    if bad == "rank1":
        x = x.reshape(-1)
    return [x, gamma, beta, mean, W]


def _local_inputs(c, rng, shape):
    """x, and for gn_dbn_local_cov tot = x's group sums and count plus a second device's."""
    x = (rng.standard_normal(shape) * c["scale"] + c["shift"]).astype(c["dtype"])
    if c["op"] == "gn_dbn_local_sums":
        return [x.reshape(-1) if c.get("corrupt") == "rank1" else x]
    G = c["G"]
    other = rng.standard_normal([rng.integers(1, 4)] + list(c["shape"][1:]))
    other = other * c["scale"] + c["shift"]
    tot = _local_sums_ref(x.astype(np.float64), G) + _local_sums_ref(other, G)
    bad = c.get("corrupt")
    if bad == "tot_shape":
        tot = tot[:, :-1]
    if bad == "rank1":
        x = x.reshape(-1)
    return [x, tot.astype("float32" if bad == "tot_dtype" else "float64")]


def _local_sums_ref(x, G):
    """(G, D + 1): per group the channel sums over the (sample, position) columns and their
    count."""
    cols = _group_cols(x, G)
    return np.concatenate([cols.sum(axis=2), np.full((G, 1), float(cols.shape[2]))], axis=1)


def _group_cols(x, G):
    """x (N, C, *spatial) as float64 (G, D, N * S) columns."""
    N, C = x.shape[:2]
    S = int(np.prod(x.shape[2:], dtype=np.int64))
    return x.astype(np.float64).reshape(N, G, C // G, S).transpose(1, 2, 0, 3).reshape(
        G, C // G, N * S)


def _whiten_inputs(c, rng):
    """cov of the case's columns (+ mean, running statistics), with its `corrupt` input planted."""
    bad = c.get("corrupt")
    X = _columns(c, rng)
    G, D, m = X.shape
    cov = np.einsum("gim,gjm->gij", X, X) / m
    mean = X.mean(axis=2).reshape(-1)
    if bad == "empty":
        cov, mean = cov[:0], mean[:0]
    elif bad == "cov_nonsquare":
        cov = np.concatenate([cov, cov[:, :, :1]], axis=2)
    elif bad == "mean_len":
        mean = np.append(mean, 0.0)
    G = cov.shape[0]
    pdt = c["pdtype"]
    A = rng.standard_normal((G, D, D)) * 0.3
    rp = np.eye(D)[None] + A @ A.transpose(0, 2, 1) * 0.1
    if bad == "rproj_shape":
        rp = np.tile(np.eye(D + 1), (G, 1, 1))
    rm = rng.standard_normal(G * D) * 0.1
    rm_dt, rp_dt = {"stats_mixed": ("float32", "float64"),
                    "stats_int": ("int32", "int32")}.get(bad, (pdt, pdt))
    return [cov.astype(c["dtype"]), mean.astype("float32" if bad == "mean_dtype" else "float64"),
            rm.astype(rm_dt), rp.astype(rp_dt)]


def unique_attrs(c):
    """The attributes of one call: gn_sync_sum's key made unique in this process."""
    a = dict(c["attrs"])
    if c["op"] == "gn_sync_sum" and a.get("key"):
        a["key"] = f"{a['key']}/{os.getpid()}/{next(_calls)}"
    return a


# ---- checks --------------------------------------------------------------------------------------
def _whiten_attrs(c):
    """(eps, momentum, whitening, iterations) of a valid gn_dbn_whiten case."""
    a = c["attrs"]
    return (float(a.get("eps", 1e-5)), float(a.get("momentum", 0.9)), a.get("whitening", "zca"),
            int(a.get("iterations", 5)))


def _whiten_grad_fd(cov, eps, whitening, T, R):
    """d sum(R * W) / d cov by float64 central differences of the reference, per group, along the
    symmetric directions e_ij + e_ji (i < j) and e_ii: (G, D, D), upper triangle filled."""
    G, D, _ = cov.shape
    fd = np.zeros_like(cov)
    for g in range(G):
        S = cov[g:g + 1]
        lam = np.linalg.eigvalsh(S[0] + eps * np.eye(D))
        h = 1e-4 * (lam.min() if whitening == "zca" else lam.sum() / D)
        for i, j in zip(*np.triu_indices(D)):
            E = np.zeros_like(S)
            E[0, i, j] = E[0, j, i] = h
            fd[g, i, j] = ((R[g] * _whiten_ref(S + E, eps, whitening, T)[0]).sum()
                           - (R[g] * _whiten_ref(S - E, eps, whitening, T)[0]).sum()) / (2 * h)
    return fd


def _whiten_tols(cond, whitening, T):
    """(W, d cov) tolerances relative to max(1, max|ref|) (None: d cov not checkable). ZCA: the
    eigensolvers' rounding grows with cond(Sigma) (measured: d cov 5e-6 at cond 4e6). IterNorm: the
    uncoupled Newton-Schulz iteration amplifies rounding with T (src/operator/kernels/dbn.h):
    measured W 3e-15 at T = 5, up to 2.5e-5 at T = 10 for cond 1e3 .. 1e6; beyond T = 5 the float64
    reference itself moves by ~1e-2 under perturbations of 1e-6 * trace, so no central difference
    can check d cov there."""
    if whitening == "zca":
        return 1e-11 * cond, (1e-6 + 1e-11 * cond if cond < 1e7 else None)
    return 1e-13 * 8.0 ** T, (1e-6 if T <= 5 else None)


def _check_whiten(c, inputs, outs, heads, grads, after, close):
    """W against the reference, the running statistics' update, d cov against central
    differences."""
    eps, mom, whitening, T = _whiten_attrs(c)
    cov = inputs[0].astype(np.float64)
    lam = np.linalg.eigvalsh(cov + eps * np.eye(cov.shape[-1]))
    cond = float(lam.max() / lam.min()) if lam.min() > 0 else math.inf
    if not 1e-13 * cond < 1e-4:
        # a reference that cannot tell right from wrong: the shape and no crash is all there is
        return [f"W: shape {outs[0].shape}"] if outs[0].shape != cov.shape else UNCHECKED
    wtol, gtol = _whiten_tols(cond, whitening, T)
    W = _whiten_ref(cov, eps, whitening, T)
    errs = [close("W", outs[0], W, wtol)]
    if after is not None:
        u = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-13}[np.dtype(inputs[3].dtype).name]
        rm = mom * inputs[2].astype(np.float64) + (1 - mom) * inputs[1]
        rp = mom * inputs[3].astype(np.float64) + (1 - mom) * W
        errs += [close("running_mean", after[2], rm, 2 * u),
                 close("running_projection", after[3], rp, 2 * u + wtol)]
    if grads and gtol is not None:
        R = heads[0].astype(np.float64)
        got = grads[0]
        sym = got + got.transpose(0, 2, 1) - got * np.eye(got.shape[-1])  # the same directions
        iu = np.triu_indices(got.shape[-1])
        fd = _whiten_grad_fd(cov, eps, whitening, T, R)
        errs.append(close("dcov", sym[:, iu[0], iu[1]], fd[:, iu[0], iu[1]], gtol))
    return errs


def _apply_grads_ref(x, gamma, mean, W, dy):
    """Float64 gradients of gn_dbn_apply (dbn_sync.h): dx, dgamma, dbeta, dmean, dW."""
    N, C, G = x.shape[0], x.shape[1], len(W)
    D = C // G
    xc = (x - mean.reshape((1, C) + (1,) * (x.ndim - 2))).reshape(N, G, D, -1)
    dyg = dy.reshape(N, G, D, -1)
    a = dyg * gamma.reshape(1, G, D, 1)
    y = np.einsum("gij,ngjs->ngis", W, xc)
    dx = np.einsum("gji,ngjs->ngis", W, a)
    return [dx.reshape(x.shape), (dyg * y).sum(axis=(0, 3)).reshape(C),
            dyg.sum(axis=(0, 3)).reshape(C), -dx.sum(axis=(0, 3)).reshape(C),
            np.einsum("ngis,ngjs->gij", a, xc)]


def _check_local(c, inputs, outs, heads, grads, close, units):
    """gn_dbn_local_sums: the sums and count, d data = d sums of the element's channel;
    gn_dbn_local_cov: cov about the global mean tot[:D] / tot[D], divided by tot[D], and the
    gradients of sum(dcov * cov) (the one head) for data and tot (dbn_sync.h's formulas)."""
    G = int(c["attrs"].get("num_groups", "1"))  # valid here: may differ from the case's G (sums)
    x = inputs[0].astype(np.float64)
    N, C = x.shape[:2]
    D, u = C // G, units[c["dtype"]]
    cols = _group_cols(x, G)
    scale = max(1.0, float(np.abs(cols).max()) if cols.size else 1.0) ** 2
    if c["op"] == "gn_dbn_local_sums":
        errs = [close("tot", outs[0], _local_sums_ref(x, G), 1e-14 * cols.shape[2])]
        if grads:
            dx = np.broadcast_to(heads[0][:, :D].reshape(1, C, *([1] * (x.ndim - 2))), x.shape)
            errs.append(close("ddata", grads[0], dx, u))
        return errs
    tot = inputs[1]
    M = tot[:, D:]                                                     # (G, 1)
    mu = tot[:, :D] / M
    xc = cols - mu[:, :, None]
    cov = np.einsum("gik,gjk->gij", xc, xc) / M[:, :, None]
    errs = [close("cov", outs[0], cov, 1e-13 * scale * max(1, cols.shape[2]))]
    if grads:
        R = heads[0].astype(np.float64)
        B = (R + R.transpose(0, 2, 1)) / M[:, :, None]
        dx = np.einsum("gij,gjk->gik", B, xc).reshape(G, D, N, -1).transpose(2, 0, 1, 3)
        dmu = -np.einsum("gij,gj->gi", B, xc.sum(axis=2))
        dcount = -((dmu * mu).sum(axis=1) + (R * cov).sum(axis=(1, 2))) / M[:, 0]
        dtot = np.concatenate([dmu / M, dcount[:, None]], axis=1)
        errs += [close("ddata", grads[0], dx.reshape(x.shape), 10 * u),
                 close("dtot", grads[1], dtot, 1e-12 * scale * max(1, cols.shape[2]))]
    return errs


def check(c, inputs, outs, heads, grads, after, close, units):
    """Mismatch texts (None entries for matches) or UNCHECKED, for one valid call of a sync op."""
    op = c["op"]
    if op == "gn_sync_sum":
        return [close("out", outs[0], inputs[0], 0.0)] + (
            [close("ddata", grads[0], heads[0], 0.0)] if grads else [])
    if op == "gn_dbn_whiten":
        return _check_whiten(c, inputs, outs, heads, grads, after, close)
    if op in LOCAL_OPS:
        return _check_local(c, inputs, outs, heads, grads, close, units)
    x, gamma, beta, mean, W = [a.astype(np.float64) for a in inputs]
    u, up = units[c["dtype"]], units[c["pdtype"]]
    errs = [close("out", outs[0], _dbn_apply_ref(x, gamma, beta, mean, W), 10 * u)]
    if grads:
        ref = _apply_grads_ref(x, gamma, mean, W, heads[0].astype(np.float64))
        m = x.size // x.shape[1]  # terms of each parameter gradient's sum
        for name, g, r, tol in zip(("dx", "dgamma", "dbeta", "dmean", "dW"), grads, ref,
                                   (10 * u, 10 * up, 10 * up, 1e-12 * m, 1e-12 * m)):
            errs.append(close(name, g, r, tol))
    return errs


# ---- case strategy -------------------------------------------------------------------------------
_NDEV = [" 1", "+1", "0", "-1", "2", " 2 ", "4096", "4097", "1.0", "", "one", "0x1",
         "99999999999999999999"]
_TIMEOUT = ["10", "0.5", " 5 ", "1e-3", "0", "-1", "nan", "inf", "1e400", "1e-400", "5s", ""]
_SHORT = ["0.001", "0.01", "1e-3", "0", "nan", "x"]  # with num_devices > 1: never a long wait


def draw_dtypes(draw, st, op):
    """(dtype, pdtype): float64 mostly where the op takes float64 only."""
    if op in LOCAL_OPS:
        return draw(st.sampled_from(["float16", "float32", "float64"])), None
    if op == "gn_dbn_apply":
        dt = draw(st.sampled_from(["float16", "float32", "float64"]))
        return dt, draw(st.sampled_from([dt, dt, dt, "float32", "float64", "float16"]))
    dt = draw(st.sampled_from(["float64"] * 8 + ["float16", "float32"]))
    return dt, (draw(st.sampled_from(["float16", "float32", "float64"]))
                if op == "gn_dbn_whiten" else None)


def draw_attrs(draw, st, op, G, int_strs, eps_strs, mom_strs, parse_int):
    """Attribute strings of a sync-op case (valid mostly, every rule broken sometimes)."""
    a = {}
    if op == "gn_dbn_apply" or op in LOCAL_OPS:
        a["num_groups"] = str(G) if draw(st.integers(0, 5)) else draw(int_strs)
    elif op == "gn_dbn_whiten":
        a["eps"] = draw(st.sampled_from(["1e-3", "1e-5", "0.1"]) if draw(st.integers(0, 3)) < 3
                        else eps_strs)
        for name, values in (("momentum", mom_strs), ("whitening", st.sampled_from(
                ["zca", "iternorm", "iternorm", "iternorm", "ZCA", "pca", ""])), ("iterations",
                st.sampled_from(["1", "3", "5", "5", "10", "0", "11", " 4", "2.0"]))):
            if draw(st.integers(0, 2)) == 2:
                a[name] = draw(values)
    else:
        if draw(st.integers(0, 19)):
            a["key"] = draw(st.sampled_from(["fuzz", "fuzz/a b", "\u00e9t\u00e9"]))
        elif draw(st.booleans()):
            a["key"] = ""
        if draw(st.integers(0, 3)) == 0:
            a["num_devices"] = draw(st.sampled_from(_NDEV))
        try:
            many = parse_int(a.get("num_devices", "1")) > 1
        except ValueError:
            many = False
        if many or draw(st.integers(0, 3)) == 0:
            a["timeout"] = draw(st.sampled_from(_SHORT if many else _TIMEOUT))
    return a


def draw_corrupt(draw, st, op, mode):
    """None mostly, else the name of a planted bad input (CORRUPT). Not "empty" in symbolic mode:
    simple_bind reads a 0 dim as "not known yet" (MXNet's legacy shapes) and fails for every op
    with its own "Failed to allocate CPU Memory"."""
    if draw(st.integers(0, 7)):
        return None
    return draw(st.sampled_from([k for k in sorted(CORRUPT[op])
                                 if k != "empty" or mode != "symbolic"] or [None]))
