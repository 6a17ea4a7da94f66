"""Measured errors of the CUDA GroupNorm kernels on the numerical edge cases, against float64.

    python tests/gpu/edge_case_errors.py            # the kernels as built now (emulator or GPU)
    python tests/gpu/edge_case_errors.py --cpu-op   # the MXNet op on the CPU, for comparison
    GNMX_HARNESS_LIB=/path/libgn_harness.so python tests/gpu/edge_case_errors.py   # another build

Prints one Markdown row per case: max|out - ref| / max|ref| for y, mean, rstd, dgamma, dbeta
and, per group, dx (float64 references on the rounded inputs; "nan" when the kernel returned
NaN/Inf where the reference is finite). docs/numerics.md quotes the table (before/after of issue 22). The assertions live in
tests/edge_cases.py; this only measures.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import harness_np  # noqa: E402
from reference import group_norm_bwd_ref, group_norm_ref  # noqa: E402


def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(a).all():
        return "nan"
    return f"{np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-300):.1e}"


def rel_groups(a, ref, G):
    """max over groups of max|a - ref| / max|ref| within the group (dx of a huge group is ~1e-38),
    the group's scale floored at 1024 x the dtype's smallest subnormal (a 2-element group's dx may
    be ~1e-12: 0 in fp16, not an error)."""
    floor = 1024 * float(np.finfo(a.dtype).smallest_subnormal)
    a = np.asarray(a, np.float64).reshape(a.shape[0] * G, -1)
    ref = np.asarray(ref, np.float64).reshape(ref.shape[0] * G, -1)
    if not np.isfinite(a).all():
        return "nan"
    return f"{max(np.abs(u - v).max() / max(np.abs(v).max(), floor) for u, v in zip(a, ref)):.1e}"


def tiny(dtype, M, offset, spread, act=None):
    rng = np.random.RandomState(13 + M)
    G, N = 4, 5
    x = (offset + spread * rng.randn(N, G * M)).astype(dtype)
    gamma, beta = rng.randn(G * M).astype(dtype), rng.randn(G * M).astype(dtype)
    dy = rng.randn(N, G * M).astype(dtype)
    return x, gamma, beta, dy, G, offset


def single(dtype, offset):
    rng = np.random.RandomState(11)
    x = (rng.randn(3, 6) + offset).astype(dtype)
    g, b, dy = rng.randn(6).astype(dtype), rng.randn(6).astype(dtype), rng.randn(3, 6).astype(dtype)
    return x, g, b, dy, 6, 0.0


def overflow(spatial):
    rng = np.random.RandomState(17)
    x = rng.randn(2, 4, *spatial)
    x[:, :2] = x[:, :2] * 1e38 + 2e38 * np.sign(x[:, :2])
    x = np.clip(x, -3.3e38, 3.3e38).astype(np.float32)
    g, b = rng.randn(4).astype(np.float32), rng.randn(4).astype(np.float32)
    return x, g, b, rng.randn(*x.shape).astype(np.float32), 2, 0.0


CASES = [
    ("2-element groups, fp32, offset 300, spread 1e-3", tiny(np.float32, 2, 300.0, 1e-3), None),
    ("3-element groups, fp32, offset 300, spread 1e-3", tiny(np.float32, 3, 300.0, 1e-3), None),
    ("4-element groups, fp32, offset 300, spread 1e-3", tiny(np.float32, 4, 300.0, 1e-3), None),
    ("4-element groups, fp32, offset 300, silu", tiny(np.float32, 4, 300.0, 1e-3), "silu"),
    ("2-element groups, fp32, offset -3e4, spread 0.1", tiny(np.float32, 2, -3e4, 0.1), None),
    ("2-element groups, fp16, offset -3e4, spread 200", tiny(np.float16, 2, -3e4, 200.0), None),
    ("3-element groups, fp64, offset 300, spread 1e-9", tiny(np.float64, 3, 300.0, 1e-9), None),
    ("1-element groups, fp32, offset 3e4, relu", single(np.float32, 3e4), "relu"),
    ("1-element groups, fp32, offset 3e4, silu", single(np.float32, 3e4), "silu"),
    ("fp32 |x| ~ 2e38, (2, 4) G=2", overflow(()), None),
    ("fp32 |x| ~ 2e38, (2, 4, 64, 64) G=2", overflow((64, 64)), None),
    ("fp32 |x| ~ 2e38, (2, 4, 64) G=2, silu", overflow((64,)), "silu"),
]


def main():
    if "--cpu-op" in sys.argv:  # the MXNet op on the CPU instead (needs mxnet + the built gn_mx)
        import mxnet as mx
        import gn_mx  # noqa: F401
        from gn_mx.selftest import MxRunner
        run = MxRunner(mx.cpu())
        print("device: MXNet op gn_group_norm on cpu")
    else:
        run = harness_np.Runner()
        print(f"device: {harness_np.device_name()}, library: "
              f"{os.environ.get('GNMX_HARNESS_LIB', '(current sources)')}")
    print("| case | y | mean | rstd | dx | dgamma | dbeta |")
    print("|---|---|---|---|---|---|---|")
    for name, (x, g, b, dy, G, off), act in CASES:
        r = run.group_norm(x, g, b, G, 1e-5, act=act, dy=dy)
        x64 = x.astype(np.float64) - off  # exact shift (normalization is shift-invariant)
        ry, rm, rr = group_norm_ref(x64, g, b, G, 1e-5, act=act)
        rdx, rdg, rdb = group_norm_bwd_ref(x64, g, dy, G, 1e-5, act=act, beta=b)
        print(f"| {name} | {rel(r['y'], ry)} | {rel(r['mean'], rm + off)} | {rel(r['rstd'], rr)} "
              f"| {rel_groups(r['dx'], rdx, G)} | {rel(r['dgamma'], rdg)} "
              f"| {rel(r['dbeta'], rdb)} |")


if __name__ == "__main__":
    main()
