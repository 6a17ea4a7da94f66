"""Sweep counts of the DBN CUDA Jacobi eigensolver (dbn_cuda.cu's block_jacobi), by a host copy.

The device solver applies, per round of the round-robin (circle method) ordering, D/2 disjoint
rotations at once; this copy does the same rounds with numpy (same rr_pair, same rotation formula as
dbn_jacobi_rotation, same power-of-two scaling, stopping rule off <= 1e-30 ||A_0||_F^2 checked
before each sweep, limit 100), so its sweep count is the device's up to rounding. The counts drive
the time estimates in docs/design/dbn.md ("GPU"). Not a timing benchmark: no thread count or allocator
regime applies.

    python benchmarks/dbn_jacobi_sweeps.py [D ...]     # default: 16 32 64 128 256 512
"""
import argparse

import numpy as np

TOL, MAX_SWEEPS = 1e-30, 100


def rr_pairs(r, Dp):
    """The pairs (p, q), p < q, of round r (dbn_cuda.cu's rr_pair for k = 0 .. Dp/2 - 1)."""
    M = Dp - 1
    k = np.arange(Dp // 2)
    a = np.where(k == 0, 0, (k - 1 + r) % M + 1)
    b = (Dp - 1 - k - 1 + r) % M + 1
    return np.minimum(a, b), np.maximum(a, b)


def sweeps(A):
    A = A.copy()
    D = A.shape[0]
    e = np.frexp(np.abs(A).max())[1]
    A = np.ldexp(A, -e)
    fro2 = (A * A).sum()
    Dp = D + (D & 1)
    if D & 1:  # the phantom player D: its pairs are identities
        A = np.pad(A, ((0, 1), (0, 1)))
    for sweep in range(MAX_SWEEPS):
        off = (np.triu(A[:D, :D], 1) ** 2).sum()
        if off <= TOL * fro2 or off == 0.0:
            return sweep
        for r in range(Dp - 1):
            p, q = rr_pairs(r, Dp)
            apq = A[p, q]
            live = (apq != 0.0) & (q < D)
            p, q, apq = p[live], q[live], apq[live]
            if p.size == 0:
                continue
            theta = (A[q, q] - A[p, p]) / (2.0 * apq)
            t = np.where(np.abs(theta) > 1e150, 0.5 / theta,
                         np.sign(theta + (theta == 0)) / (np.abs(theta) + np.sqrt(theta * theta + 1.0)))
            c = 1.0 / np.sqrt(t * t + 1.0)
            s = t * c
            Ap, Aq = A[:, p].copy(), A[:, q].copy()  # A <- A J
            A[:, p], A[:, q] = c * Ap - s * Aq, s * Ap + c * Aq
            Ap, Aq = A[p, :].copy(), A[q, :].copy()  # A <- J^T A
            A[p, :], A[q, :] = c[:, None] * Ap - s[:, None] * Aq, s[:, None] * Ap + c[:, None] * Aq
            A[p, q] = A[q, p] = 0.0
    return MAX_SWEEPS


def covariances(D, rng):
    """Sigma of the GPU tests' data (I + R / (2 sqrt(D)) mixing, m = 4D samples) and of data
    with a graded spectrum (channel scales 1e-2 .. 1e2)."""
    m = 4 * D
    mix = np.eye(D) + rng.standard_normal((D, D)) * (0.5 / D ** 0.5)
    X = mix @ rng.standard_normal((D, m))
    Xc = X - X.mean(1, keepdims=True)
    yield "tests' data", Xc @ Xc.T / m + 1e-5 * np.eye(D)
    X = np.logspace(-2, 2, D)[:, None] * (mix @ rng.standard_normal((D, m)))
    Xc = X - X.mean(1, keepdims=True)
    yield "graded 1e-2..1e2", Xc @ Xc.T / m + 1e-5 * np.eye(D)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("D", nargs="*", type=int, default=[16, 32, 64, 128, 256, 512],
                    help="group sizes (default: 16 32 64 128 256 512)")
    Ds = ap.parse_args().D
    rng = np.random.default_rng(0)
    print("| D | data | sweeps |\n|---|---|---|")
    for D in Ds:
        for name, S in covariances(D, rng):
            print(f"| {D} | {name} | {sweeps(S)} |", flush=True)


if __name__ == "__main__":
    main()
