"""Independent float64 numpy references for the gn_mx ops (forward and backward).

Written from the papers' math, not from the kernels: the GroupNorm backward here is the textbook
xhat form, the kernels use a centred-sum form.
"""
import numpy as np


def _groups(x, G):
    x = np.asarray(x, dtype=np.float64)
    N, C = x.shape[:2]
    return x.reshape(N, G, -1)


def moments_ref(x, G):
    xg = _groups(x, G)
    return xg.mean(axis=2), xg.var(axis=2)


def act_ref(z, act):
    """The fused activations of gn_group_norm (act_type), float64."""
    z = np.asarray(z, np.float64)
    if act in (None, "none"):
        return z
    if act == "relu":
        return np.maximum(z, 0.0)
    if act == "silu":
        return z / (1.0 + np.exp(-z))
    raise ValueError(act)


def act_grad_ref(z, act):
    """d act / d z (relu: 0 at z = 0, as MXNet's relu)."""
    z = np.asarray(z, np.float64)
    if act in (None, "none"):
        return np.ones_like(z)
    if act == "relu":
        return (z > 0).astype(np.float64)
    if act == "silu":
        s = 1.0 / (1.0 + np.exp(-z))
        return s * (1.0 + z * (1.0 - s))
    raise ValueError(act)


def _xhat(xg, mean, rstd):
    """(x - mean) * rstd per group; exactly 0 for one-element groups. There x - mean is 0 for every
    x, so xhat, the output (= act(beta)) and its gradients are constant in x: xhat = 0 and
    d xhat / dx = 0 even with eps = 0, where rstd = inf and the product would read 0 * inf = nan.
    (Larger constant groups with eps = 0 stay nan: near them xhat jumps between -1 and 1.)"""
    with np.errstate(invalid="ignore"):
        xhat = (xg - mean) * rstd
    if xg.shape[2] == 1:
        xhat = np.zeros_like(xhat)
    return xhat


def group_norm_ref(x, gamma, beta, G, eps, act=None):
    """Returns out (float64, x's shape), mean (N, G), rstd (N, G); out = act(affine(xhat)).
    One-element groups: out = act(beta) exactly, whatever eps (see _xhat)."""
    x = np.asarray(x, dtype=np.float64)
    N, C = x.shape[:2]
    xg = _groups(x, G)
    mean = xg.mean(axis=2)
    var = xg.var(axis=2)
    with np.errstate(divide="ignore"):
        rstd = 1.0 / np.sqrt(var + eps)
    xhat = _xhat(xg, mean[..., None], rstd[..., None]).reshape(x.shape)
    bshape = (1, C) + (1,) * (x.ndim - 2)
    out = xhat * np.asarray(gamma, np.float64).reshape(bshape) + np.asarray(beta, np.float64).reshape(bshape)
    return act_ref(out, act), mean, rstd


def group_norm_bwd_ref(x, gamma, dy, G, eps, dmean=None, drstd=None, act=None, beta=None):
    """Gradients (dx, dgamma, dbeta) of sum(out*dy) + sum(mean*dmean) + sum(rstd*drstd).

    With an activation (out = act(z), z the affine output; needs beta) the chain rule turns dy into
    dz = dy * act'(z) and the rest is the plain GroupNorm backward of dz."""
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    if act not in (None, "none"):
        z, _, _ = group_norm_ref(x, gamma, beta, G, eps)
        dy = dy * act_grad_ref(z, act)
    N, C = x.shape[:2]
    bshape = (1, C) + (1,) * (x.ndim - 2)
    g = np.asarray(gamma, np.float64).reshape(bshape)
    xg = _groups(x, G)
    m = xg.shape[2]
    mean = xg.mean(axis=2, keepdims=True)
    var = xg.var(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        rstd = 1.0 / np.sqrt(var + eps)
    xhat = _xhat(xg, mean, rstd)
    red = (0,) + tuple(range(2, x.ndim))
    dbeta = dy.sum(axis=red)
    dgamma = (dy * xhat.reshape(x.shape)).sum(axis=red)
    dxhat = (dy * g).reshape(N, G, -1)
    if m == 1:  # out and rstd are constant in x (see _xhat): only mean (= x) passes dmean on
        dx = np.zeros_like(xg)
    else:
        with np.errstate(invalid="ignore"):
            dx = rstd / m * (m * dxhat - dxhat.sum(axis=2, keepdims=True)
                             - xhat * (dxhat * xhat).sum(axis=2, keepdims=True))
    if dmean is not None:
        dx = dx + np.asarray(dmean, np.float64)[..., None] / m
    if drstd is not None and m > 1:
        # d rstd / d x = -rstd^3 (x - mean) / m (0 for one-element groups: var is always 0)
        with np.errstate(invalid="ignore"):
            dx = dx - np.asarray(drstd, np.float64)[..., None] * rstd ** 3 * (xg - mean) / m
    return dx.reshape(x.shape), dgamma, dbeta


def moments_bwd_ref(x, G, dmean, dvar):
    xg = _groups(x, G)
    m = xg.shape[2]
    mean = xg.mean(axis=2, keepdims=True)
    dx = np.asarray(dmean, np.float64)[..., None] / m + \
        np.asarray(dvar, np.float64)[..., None] * 2.0 * (xg - mean) / m
    return dx.reshape(np.shape(x))


def numeric_grad(f, x, h=1e-6):
    """Central differences of the scalar function f at float64 array x."""
    x = np.array(x, dtype=np.float64)
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + h
        fp = f(x)
        x[i] = old - h
        fm = f(x)
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g


# ---------------------------------------------------------------------------------------------
# Decorrelated Batch Normalization (Huang et al., CVPR 2018), per-group ZCA whitening.
# Written from the paper's math with the textbook eigendecomposition backward (1/(l_i - l_j)
# terms, Ionescu et al. 2015); the kernels use the Daleckii-Krein form instead.

def _dbn_group_matrix(x, G, g):
    """Group g of (N, C, *spatial) x as a (D, m) float64 matrix, m = N * prod(spatial)."""
    x = np.asarray(x, dtype=np.float64)
    N, C = x.shape[:2]
    D = C // G
    xr = x.reshape(N, G, D, -1)
    return xr[:, g].transpose(1, 0, 2).reshape(D, -1)


def _dbn_put_group(out, mat, G, g):
    N, C = out.shape[:2]
    D = C // G
    o = out.reshape(N, G, D, -1)
    o[:, g] = mat.reshape(D, N, -1).transpose(1, 0, 2)


def dbn_ref(x, G, eps):
    """Training-mode DBN. Returns out (float64, x's shape), mean (C,), whitening W (G, D, D)."""
    x = np.asarray(x, dtype=np.float64)
    C = x.shape[1]
    D = C // G
    out = np.empty_like(x)
    means = np.empty((G, D))
    Ws = np.empty((G, D, D))
    for g in range(G):
        X = _dbn_group_matrix(x, G, g)
        m = X.shape[1]
        mu = X.mean(axis=1, keepdims=True)
        Xc = X - mu
        Sigma = Xc @ Xc.T / m + eps * np.eye(D)
        lam, U = np.linalg.eigh(Sigma)
        W = U @ np.diag(lam ** -0.5) @ U.T
        _dbn_put_group(out, W @ Xc, G, g)
        means[g] = mu[:, 0]
        Ws[g] = W
    return out, means.reshape(C), Ws


def iternorm_ref(x, G, eps, T):
    """The paper's forward: (y, W (G, D, D)) in float64."""
    x = np.asarray(x, np.float64)
    D = x.shape[1] // G
    out, Ws = np.empty_like(x), []
    for g in range(G):
        X = _dbn_group_matrix(x, G, g)
        Xc = X - X.mean(axis=1, keepdims=True)
        S = Xc @ Xc.T / X.shape[1] + eps * np.eye(D)
        tr = np.trace(S)
        Sn, P = S / tr, np.eye(D)
        for _ in range(T):
            P = 1.5 * P - 0.5 * P @ P @ P @ Sn
        W = P / np.sqrt(tr)
        _dbn_put_group(out, W @ Xc, G, g)
        Ws.append(W)
    return out, np.array(Ws)


def dbn_inference_ref(x, running_mean, running_projection, G):
    x = np.asarray(x, dtype=np.float64)
    D = x.shape[1] // G
    rm = np.asarray(running_mean, np.float64).reshape(G, D)
    P = np.asarray(running_projection, np.float64)
    out = np.empty_like(x)
    for g in range(G):
        X = _dbn_group_matrix(x, G, g)
        _dbn_put_group(out, P[g] @ (X - rm[g][:, None]), G, g)
    return out


def dbn_bwd_ref(x, dy, G, eps):
    """dx of sum(out * dy) for training-mode DBN, through U and Lambda of Sigma = U Lambda U^T.

    dL/dW = dY Xc^T; W = U Lambda^-1/2 U^T gives dL/dU = (G_W + G_W^T) U Lambda^-1/2 and
    dL/dlambda_i = -1/2 lambda_i^-3/2 (U^T G_W U)_ii; the symmetric eigen backward gives
    dL/dSigma = U (Kt o (U^T dL/dU) + diag(dL/dlambda)) U^T, Kt_ij = 1/(lambda_j - lambda_i)
    (0 on the diagonal and, as a guard, for numerically equal eigenvalues, where this form is
    ill-conditioned; use finite differences for such cases). Then
    dXc = W dY + (dL/dSigma + dL/dSigma^T) Xc / m and dX = dXc - mean_cols(dXc).
    """
    x = np.asarray(x, dtype=np.float64)
    dy = np.asarray(dy, dtype=np.float64)
    C = x.shape[1]
    D = C // G
    dx = np.empty_like(x)
    for g in range(G):
        X = _dbn_group_matrix(x, G, g)
        dY = _dbn_group_matrix(dy, G, g)
        m = X.shape[1]
        Xc = X - X.mean(axis=1, keepdims=True)
        Sigma = Xc @ Xc.T / m + eps * np.eye(D)
        lam, U = np.linalg.eigh(Sigma)
        W = U @ np.diag(lam ** -0.5) @ U.T
        GW = dY @ Xc.T
        dU = (GW + GW.T) @ U @ np.diag(lam ** -0.5)
        dlam = -0.5 * lam ** -1.5 * np.diag(U.T @ GW @ U)
        diff = lam[None, :] - lam[:, None]  # lambda_j - lambda_i
        close = np.abs(diff) <= 1e-12 * np.abs(lam).max()
        Kt = np.where(close, 0.0, 1.0 / np.where(close, 1.0, diff))
        GS = U @ (Kt * (U.T @ dU) + np.diag(dlam)) @ U.T
        dXc = W @ dY + (GS + GS.T) @ Xc / m
        _dbn_put_group(dx, dXc - dXc.mean(axis=1, keepdims=True), G, g)
    return dx


def dbn_inference_bwd_ref(dy, running_projection, G):
    """dx of sum(out * dy) for inference-mode DBN: P_g^T dY_g per group (float64)."""
    dy = np.asarray(dy, dtype=np.float64)
    P = np.asarray(running_projection, np.float64)
    dx = np.empty_like(dy)
    for g in range(G):
        _dbn_put_group(dx, P[g].T @ _dbn_group_matrix(dy, G, g), G, g)
    return dx


def channel_affine_ref(x, gamma, beta):
    """gn_channel_affine: y = gamma[c] x + beta[c] (float64)."""
    x = np.asarray(x, np.float64)
    b = (1, -1) + (1,) * (x.ndim - 2)
    return x * np.asarray(gamma, np.float64).reshape(b) + np.asarray(beta, np.float64).reshape(b)


def channel_affine_bwd_ref(x, gamma, dy):
    """(dx, dgamma, dbeta) of sum(y * dy) for gn_channel_affine (float64)."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    b = (1, -1) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    return (dy * np.asarray(gamma, np.float64).reshape(b), (dy * x).sum(axis=axes),
            dy.sum(axis=axes))
