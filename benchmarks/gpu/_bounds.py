"""What each benchmarked kernel must at least move or compute: one function per shape class.

No torch, no GPU: bench_gpu.py uses these for the %copy / %fp32 / %fp64 columns of a measured run,
and its --estimate mode for the lower-bound times of an H200 (H200 below). A bound is a dict
{"bytes": bytes that must cross HBM, "flops": floating-point operations a straightforward
implementation performs}; the lower-bound time of a row is max(bytes / bandwidth, flops / peak).

Conventions (the same for gn_mx and for torch, so the fractions compare):
- Tensors are counted once per pass that must touch them: a kernel that keeps data on chip between
  its statistics and its output reads x once. Two-pass kernels (statistics, then output) read x
  twice, so 100% of the bound is out of their reach; ~50-70% is good for them.
- GroupNorm statistics are accumulated in fp32 for fp16/fp32 data, fp64 for fp64 (gn_mx's AccT);
  mean and rstd (N x G each) are outputs of the forward and inputs of the backward. At G = C with
  S = 1 they are as large as the data, which is why they are counted.
- Parameters: gamma, beta (C each) in the parameter dtype (the data's dtype here); their gradients
  are written once.
- DBN flops are those of the dense formulation (docs of dbn_bound); its bytes are x/y/dy/dx only.
"""

DTYPE_SIZE = {"float16": 2, "float32": 4, "float64": 8}
ACC_SIZE = {"float16": 4, "float32": 4, "float64": 8}

# The --estimate device: an H200 SXM by its data sheet. fp32 is the non-tensor (FMA) rate; fp64 is
# the same figure as the brief gives it (~67 TFLOP/s with the fp64 tensor cores DGEMM uses; plain
# fp64 FMA is about half of it). Bounds use the data sheet, so a measured run reaches < 100%.
H200 = {"name": "NVIDIA H200 (data sheet, estimate)", "sms": 132, "copy_bw": 4.8e12,
        "fp32": 67e12, "fp64": 67e12}

# The eigensolver's flops for one D x D symmetric matrix with eigenvectors: Golub & Van Loan's
# count for the symmetric QR algorithm (tridiagonalization + implicit QR + accumulation), ~9 D^3.
# A cyclic Jacobi solver does ~4 D^3 per sweep (two-sided rotations of A plus U), 6-30 sweeps.
EIG_FLOPS_PER_D3 = 9


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _ncs(shape):
    N, C = shape[0], shape[1]
    return N, C, numel(shape[2:])


def gn_bound(shape, dtype, G, pass_):
    """GroupNorm (classes tiny_groups, sd_unet, large_n_s1, misaligned).

    fwd: read x, write y, mean, rstd; read gamma, beta.
    bwd: read dy, x, mean, rstd, gamma; write dx, dgamma, dbeta.
    fwd+bwd: the sum. flops: ~8 per element forward, ~12 backward (not the limit anywhere)."""
    N, C, _ = _ncs(shape)
    n, isz, asz = numel(shape), DTYPE_SIZE[dtype], ACC_SIZE[dtype]
    stats = 2 * N * G * asz
    fwd = {"bytes": 2 * n * isz + stats + 2 * C * isz, "flops": 8 * n}
    bwd = {"bytes": 3 * n * isz + stats + 3 * C * isz, "flops": 12 * n}
    return _pick(pass_, fwd, bwd)


def affine_bound(shape, dtype, pass_):
    """Per-channel affine y = gamma[c] x + beta[c] (class affine).

    fwd: read x, gamma, beta; write y.  bwd: read dy, x, gamma; write dx, dgamma, dbeta."""
    _, C, _ = _ncs(shape)
    n, isz = numel(shape), DTYPE_SIZE[dtype]
    fwd = {"bytes": 2 * n * isz + 2 * C * isz, "flops": 2 * n}
    bwd = {"bytes": 3 * n * isz + 3 * C * isz, "flops": 5 * n}
    return _pick(pass_, fwd, bwd)


def dbn_bound(shape, dtype, G, pass_):
    """Decorrelated BN, ZCA whitening (class dbn), G groups of D = C/G channels, m = N*S columns.

    Per group, dense formulation (what gn_mx and the torch eigh reference both compute):
      fwd: mean D m, Gram Xc Xc^T 2 D^2 m, eigensolver ~9 D^3, W = U diag U^T 2 D^3,
           apply W Xc 2 D^2 m.                                   bytes: read x, write y
      bwd: G_W = dY Xc^T 2 D^2 m, W and U^T Gs U, U (K o .) U^T 4 D x D products 8 D^3 (+ W 2 D^3),
           dX = W dY' + (2/m) G_S Xc 4 D^2 m.                     bytes: read dy, x, write dx
      inference: P (x - r_mean) 2 D^2 m.                          bytes: read x, write y
    The D x D part is fp64 in gn_mx (dbn.h) and fp32 in the torch reference; the table gives the
    rate against both peaks."""
    N, C, S = _ncs(shape)
    D, m = C // G, N * S
    n, isz = numel(shape), DTYPE_SIZE[dtype]
    fwd = {"bytes": 2 * n * isz,
           "flops": G * (D * m + 4 * D * D * m + (EIG_FLOPS_PER_D3 + 2) * D ** 3)}
    bwd = {"bytes": 3 * n * isz, "flops": G * (6 * D * D * m + 10 * D ** 3)}
    inf = {"bytes": 2 * n * isz, "flops": G * 2 * D * D * m}
    if pass_ == "inference":
        return inf
    return _pick(pass_, fwd, bwd)


def _pick(pass_, fwd, bwd):
    if pass_ == "fwd":
        return fwd
    if pass_ == "bwd":
        return bwd
    if pass_ == "fwd+bwd":
        return {k: fwd[k] + bwd[k] for k in fwd}
    raise ValueError(f"unknown pass {pass_!r} (fwd, bwd, fwd+bwd, inference)")


def case_bound(case, pass_):
    """The bound of one benchmark case (bench_gpu.Case or anything with cls, shape, dtype, G)."""
    if case.cls == "affine":
        return affine_bound(case.shape, case.dtype, pass_)
    if case.cls == "dbn":
        return dbn_bound(case.shape, case.dtype, case.G, pass_)
    return gn_bound(case.shape, case.dtype, case.G, pass_)


def lower_bound_s(bound, device=H200, flop_peak="fp32"):
    """Seconds no implementation can beat on `device`: max(bytes / bandwidth, flops / peak)."""
    return max(bound["bytes"] / device["copy_bw"], bound["flops"] / device[flop_peak])
