/*
 * dbn_math.h: per-group fp64 small-matrix math of Decorrelated BN, shared by the CPU and CUDA
 * kernels (GN_HOST_DEVICE, no allocation, no LAPACK): the Jacobi rotation, its scaling and stopping
 * rule, and every D x D step after the eigensolver, written once over an "executor" (below) that
 * runs them serially on the host and block-parallel on the device. All matrices are D x D,
 * row-major, double.
 * An eigenvector matrix U stores eigenvector j in column j: U[i*D + j].
 * Formulas are documented in dbn.h (forward) and dbn_cpu.cc (backward derivation).
 */
#pragma once
#include <cmath>

#include <cstdint>

#include "../common/acc_type.h"
#include "dbn.h"

namespace gn_mx {

// The Jacobi rotation (c, s) that zeroes A_pq of a symmetric matrix: t = tan(angle) is the smaller
// root of t^2 + 2 theta t - 1 = 0 with theta = (A_qq - A_pp) / (2 A_pq); for huge theta, t ~ 1/(2 theta)
// avoids overflowing theta^2 (kDbnJacobiThetaHuge: theta^2 + 1 stays finite and exact enough below
// 1e150, and above it 1/(2 theta) equals the root to fp64 rounding). Requires apq != 0.
constexpr double kDbnJacobiThetaHuge = 1e150;
GN_HOST_DEVICE inline void dbn_jacobi_rotation(double app, double aqq, double apq, double* c,
                                               double* s) {
  const double theta = (aqq - app) / (2.0 * apq);
  double t;
  if (fabs(theta) > kDbnJacobiThetaHuge) {
    t = 0.5 / theta;
  } else {
    t = 1.0 / (fabs(theta) + sqrt(theta * theta + 1.0));
    if (theta < 0) t = -t;
  }
  *c = 1.0 / sqrt(t * t + 1.0);
  *s = t * *c;
}

// The plane rotation of one pair of entries: (x, y) <- (c x - s y, s x + c y).
GN_HOST_DEVICE inline void dbn_rotate(double* x, double* y, double c, double s) {
  const double a = *x, b = *y;
  *x = c * a - s * b;
  *y = s * a + c * b;
}

// Cyclic Jacobi eigensolver for a symmetric matrix, serial (the CPU's solver for D <= 8 and the
// last fallback above; dbn_cuda.cu's block_jacobi is its block-parallel form). `A` is destroyed; on return `l` holds the
// eigenvalues in ascending order and U the matching orthonormal eigenvectors (columns).
// Each rotation is J = [[c, s], [-s, c]] in the (p, q) plane chosen so that (J^T A J)_pq = 0.
// Range: A is first scaled by the power of two 2^-e that brings max|A_ij| into [0.5, 1) (exact:
// no rounding), so the stopping rule's sums of squares neither overflow (entries up to the float64
// maximum; unscaled, sum A^2 = inf for |A| > ~1e154 stopped the solver before any rotation) nor
// underflow (tiny matrices); the eigenvalues are scaled back by 2^e at the end.
GN_HOST_DEVICE inline int dbn_jacobi_scale_exponent(double amax) {
  int e = 0;
  if (amax > 0 && amax - amax == 0.0) frexp(amax, &e);  // finite and > 0
  return e;
}

// The stopping rule of both Jacobi solvers (dbn_jacobi_eigh here, block_jacobi in dbn_cuda.cu), on
// the scaled matrix: stop before a sweep once off(A) = sum_{p<q} A_pq^2 <= kDbnJacobiTol *
// ||A_0||_F^2 (its Frobenius norm before the first rotation) or off(A) = 0, or after
// kDbnJacobiMaxSweeps sweeps (cyclic Jacobi converges quadratically: ~6-10 sweeps in practice).
constexpr double kDbnJacobiTol = 1e-30;
constexpr int kDbnJacobiMaxSweeps = 100;
GN_HOST_DEVICE inline bool dbn_jacobi_converged(double off, double fro2) {
  return off <= kDbnJacobiTol * fro2 || off == 0.0;
}

GN_HOST_DEVICE inline void dbn_jacobi_eigh(double* A, double* U, double* l, int D) {
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) U[i * D + j] = (i == j) ? 1.0 : 0.0;
  double amax = 0.0;
  for (int i = 0; i < D * D; ++i) amax = fmax(amax, fabs(A[i]));
  const int e = dbn_jacobi_scale_exponent(amax);
  if (e != 0)
    for (int i = 0; i < D * D; ++i) A[i] = ldexp(A[i], -e);
  double fro2 = 0.0;
  for (int i = 0; i < D * D; ++i) fro2 += A[i] * A[i];
  for (int sweep = 0; sweep < kDbnJacobiMaxSweeps; ++sweep) {
    double off = 0.0;
    for (int p = 0; p < D; ++p)
      for (int q = p + 1; q < D; ++q) off += A[p * D + q] * A[p * D + q];
    if (dbn_jacobi_converged(off, fro2)) break;
    for (int p = 0; p < D; ++p) {
      for (int q = p + 1; q < D; ++q) {
        const double apq = A[p * D + q];
        if (apq == 0.0) continue;
        double c, s;
        dbn_jacobi_rotation(A[p * D + p], A[q * D + q], apq, &c, &s);
        for (int k = 0; k < D; ++k) dbn_rotate(&A[k * D + p], &A[k * D + q], c, s);  // A <- A J
        for (int k = 0; k < D; ++k) dbn_rotate(&A[p * D + k], &A[q * D + k], c, s);  // A <- J^T A
        A[p * D + q] = A[q * D + p] = 0.0;
        for (int k = 0; k < D; ++k) dbn_rotate(&U[k * D + p], &U[k * D + q], c, s);  // U <- U J
      }
    }
  }
  for (int i = 0; i < D; ++i) l[i] = ldexp(A[i * D + i], e);
  for (int i = 0; i < D; ++i) {  // selection sort, ascending (same order as LAPACK)
    int best = i;
    for (int j = i + 1; j < D; ++j)
      if (l[j] < l[best]) best = j;
    if (best != i) {
      const double tl = l[i]; l[i] = l[best]; l[best] = tl;
      for (int k = 0; k < D; ++k) {
        const double tu = U[k * D + i]; U[k * D + i] = U[k * D + best]; U[k * D + best] = tu;
      }
    }
  }
}

// ---- The D x D steps, written once over an executor ------------------------------------------
// An executor `ex` says how a step runs; the steps below are the only source of this math for the
// CPU (dbn_small_cpu.h's CpuExec: plain loops, register-blocked products) and the CUDA kernels
// (dbn_cuda.cu's BlockExec: one thread block per group). Its members:
//   ex.each(n, f)        f(e) for every e in [0, n)        (host: a loop; device: the block's
//   ex.each_ij(D, f)     f(i, j) for every i, j in [0, D)   threads stride over the range)
//   ex.each_lower(D, f)  f(i, j) for every 0 <= j <= i < D
//   ex.sum(n, f)         sum of f(e) over [0, n) as a double, returned to every thread (host: in
//                        ascending order; device: per-thread strided sums, then the block's fixed
//                        tree; every thread of the block must call it)
//   ex.sync()            what each()/each_ij() wrote is visible to all (host: nothing;
//                        device: __syncthreads())
//   ex.mm(A, B, C, D)    C = A B for D x D row-major fp64 matrices, inputs already visible,
//                        C visible on return (host: dbn_small::dmm_nn; device: shared-memory
//                        tiles + __syncthreads()), summed in fp64
//   ex.mm_orth(A, B, C, D)  the same for a product with an orthogonal factor (U or U^T) whose C
//                        ends in the data's accumulation type: its normwise error is <= D u ||C||
//                        in any precision u (an orthogonal factor keeps norms), so an executor may
//                        sum it in fp32 when that type is fp32 (the device does, dbn.h; the host
//                        runs mm)
// No step writes what another thread of the same each() reads, so the host's serial order and the
// device's parallel one compute the same values (sums run over k in ascending order in both).

// The exact eigenvalues of cov + eps*I are >= eps; rounding in the covariance can push the
// smallest ones slightly below (even negative for badly scaled data), so clamp to eps (NaN stays).
GN_HOST_DEVICE inline double dbn_clamp_eigval(double l, double eps) {
  return (l >= eps || l != l) ? l : eps;
}

// B <- scale * (B + B^T) / 2 in place: symmetric in exact arithmetic, exactly symmetric after.
// Each pair (i, j <= i) is read and written by one call of f, so it is safe in parallel. Ends synced.
template <class Ex>
GN_HOST_DEVICE void dbn_symmetrize(Ex& ex, double* B, int D, double scale) {
  ex.each_lower(D, [&](int i, int j) {
    const double b = 0.5 * (B[i * D + j] + B[j * D + i]) * scale;
    B[i * D + j] = B[j * D + i] = b;
  });
  ex.sync();
}

// W = U diag(l^-1/2) U^T = Sigma^{-1/2} from V = U diag(l^-1/2) and Ut = U^T (formed by the
// caller, each together with other work): W = V Ut, symmetrized (its rounding is not). Ends synced.
template <class Ex>
GN_HOST_DEVICE void dbn_inv_sqrt(Ex& ex, const double* V, const double* Ut, int D, double* W) {
  ex.mm_orth(V, Ut, W, D);
  dbn_symmetrize(ex, W, D, 1.0);
}

// The forward's post-processing of an eigendecomposition Sigma = U diag(l) U^T (ascending l):
// clamp l to >= eps in place, then W = U diag(l^-1/2) U^T. Scratch: Ut, V (D*D), r (D); W may
// alias U (last read before the product). Ends synced.
template <class Ex>
GN_HOST_DEVICE void dbn_whitening_matrix(Ex& ex, const double* U, double* l, int D, double eps,
                                         double* W, double* Ut, double* V, double* r) {
  ex.each(D, [&](int k) {
    l[k] = dbn_clamp_eigval(l[k], eps);
    r[k] = 1.0 / sqrt(l[k]);  // D roots, not D^2
  });
  ex.sync();
  ex.each_ij(D, [&](int i, int k) {
    const double u = U[i * D + k];
    V[i * D + k] = u * r[k];
    Ut[k * D + i] = u;
  });
  ex.sync();
  dbn_inv_sqrt(ex, V, Ut, D, W);
}

// r = momentum * r + (1 - momentum) * batch, computed in double.
GN_HOST_DEVICE inline double dbn_running_update(double r, double batch, double momentum) {
  return momentum * r + (1.0 - momentum) * batch;
}

// Running statistics of group g (stat dtype `t`, either pointer may be null: no update):
// running_proj[g] <- update(running_proj[g], W), running_mean[g*D:] <- update(.., mean[g*D:]).
template <class Ex, typename M>
GN_HOST_DEVICE void dbn_update_running(Ex& ex, DType t, void* running_proj, void* running_mean,
                                       int64_t g, int D, const double* W, const M* mean,
                                       double momentum) {
  const int64_t DD = int64_t(D) * D;
  if (running_proj)
    ex.each(D * D, [&](int e) {
      const int64_t i = g * DD + e;
      dbn_store_stat(t, running_proj, i,
                     dbn_running_update(dbn_load_stat(t, running_proj, i), W[e], momentum));
    });
  if (running_mean)
    ex.each(D, [&](int d) {
      const int64_t i = g * D + d;
      dbn_store_stat(t, running_mean, i,
                     dbn_running_update(dbn_load_stat(t, running_mean, i),
                                        static_cast<double>(mean[i]), momentum));
    });
}

// Daleckii-Krein divided difference of f(l) = l^-1/2, from si = sqrt(l_i), sj = sqrt(l_j):
//   (f(l_i) - f(l_j)) / (l_i - l_j) = -1 / (sqrt(l_i) sqrt(l_j) (sqrt(l_i) + sqrt(l_j)))
// which is also f'(l_i) = -1/2 l_i^-3/2 on the diagonal, so equal eigenvalues need no guard.
GN_HOST_DEVICE inline double dbn_inv_sqrt_divdiff(double si, double sj) {
  return -1.0 / (si * sj * (si + sj));
}

// Scratch of dbn_bwd_small: H, T, Ut (D*D each), sq (D) and r (D).
struct DbnBwdScratch {
  double *H, *T, *Ut, *sq, *r;
};

// The fused affine's parameter gradient through a whitening matrix: out[i] = sum_j M_ij G_ij, i.e.
// dgamma_c = sum(dy_c xhat_c) for xhat = M Xc and G = dY Xc^T (sum over the columns). Each row
// is one call of f. Ends synced.
template <class Ex>
GN_HOST_DEVICE void dbn_affine_dgamma(Ex& ex, const double* M, const double* G, int D,
                                      double* out) {
  ex.each(D, [&](int i) {
    double acc = 0.0;
    for (int j = 0; j < D; ++j) acc += M[i * D + j] * G[i * D + j];
    out[i] = acc;
  });
  ex.sync();
}

// Backward small-matrix step for one group. Inputs: U, l (forward eigendecomposition, l >= eps),
// GW = dY Xc^T (not necessarily symmetric; overwritten), m = number of columns. Outputs:
// W = Sigma^{-1/2} and B = (2/m) G_S with G_S = U (K o (U^T sym(GW) U)) U^T, so that
// dX = W (dY - mean(dY)) + B Xc (derivation above BwdLayout in dbn_cpu.cc).
// Fused affine (gamma non-null; dY is then the gradient of gamma xhat + beta): dgamma[i] =
// sum_j W_ij GW_ij (dbn_affine_dgamma) and GW's rows are scaled by gamma (the whitening's
// gradient is gamma dY), so dX = W diag(gamma) (dY - mean(dY)) + B Xc.
// B may alias GW; W must not alias the scratch. Ends synced.
template <class Ex>
GN_HOST_DEVICE void dbn_bwd_small(Ex& ex, const double* U, const double* l, double* GW, int D,
                                  double m, const double* gamma, double* dgamma, double* W,
                                  double* B, DbnBwdScratch s) {
  double *H = s.H, *T = s.T, *Ut = s.Ut;
  ex.each(D, [&](int k) {  // K and l^-1/2 from D roots, not D^2
    s.sq[k] = sqrt(l[k]);
    s.r[k] = 1.0 / s.sq[k];
  });
  ex.sync();
  ex.each_ij(D, [&](int i, int k) {
    const double u = U[i * D + k];
    Ut[k * D + i] = u;
    T[i * D + k] = u * s.r[k];  // V = U diag(l^-1/2)
  });
  ex.sync();
  dbn_inv_sqrt(ex, T, Ut, D, W);
  if (gamma) {
    dbn_affine_dgamma(ex, W, GW, D, dgamma);
    ex.each_ij(D, [&](int i, int j) { GW[i * D + j] *= gamma[i]; });
    ex.sync();
  }
  ex.each_ij(D, [&](int i, int j) { H[i * D + j] = 0.5 * (GW[i * D + j] + GW[j * D + i]); });
  ex.sync();
  ex.mm(H, U, T, D);   // T = sym(GW) U
  ex.mm(Ut, T, H, D);  // H = U^T sym(GW) U
  ex.each_ij(D, [&](int i, int j) { H[i * D + j] *= dbn_inv_sqrt_divdiff(s.sq[i], s.sq[j]); });
  ex.sync();
  ex.mm_orth(U, H, T, D);   // T = U (K o H)
  ex.mm_orth(T, Ut, B, D);  // B = T U^T
  dbn_symmetrize(ex, B, D, 2.0 / m);
}

// ---- IterNorm (Huang et al., CVPR 2019): whitening by Newton iterations --------------------------
// Sigma_N = Sigma / tr(Sigma), P_0 = I, P_{k+1} = 1.5 P_k - 0.5 P_k^3 Sigma_N (k < T),
// W = P_T / sqrt(tr(Sigma)) ~ Sigma^{-1/2} (exact as T -> inf: the eigenvalues of Sigma_N lie in
// (0, 1], where the iteration converges). Matrix products only: no eigensolver.
// T in [1, kDbnMaxIterations] (dbn.h).
//
// Written for row-major products C = A B only (the executor's mm), the iteration runs on the
// transposes Q_k = P_k^T (Sn = Sigma_N is exactly symmetric: Sigma is stored symmetric):
//   R1_k = Sn Q_k = (P_k Sn)^T,  R2_k = R1_k Q_k = (P_k^2 Sn)^T,  Q_{k+1} = 1.5 Q_k - 0.5 R2_k Q_k,
// three products per iteration, none for k = 0 (Q_0 = I: R1 = R2 = R3 = Sn exactly). P_k is a
// polynomial in Sn, so all of them are symmetric in exact arithmetic: the executor's mm_it_sym
// computes the upper triangle (about half the work) and mirrors it, which keeps the whole
// forward state exactly symmetric (Q_k = P_k). The backward keeps Q_k, R1_k, R2_k of every
// iteration (3 T matrices) instead of recomputing them; its products (with the non-symmetric
// G = dL/dP) are full.
//
// Precision (docs/numerics.md "IterNorm"): the iteration's state and products are in `S`, float
// for fp16 / fp32 data when T <= kDbnIterNormFp32MaxT (dbn_iternorm_fp32), else double; the trace,
// Sigma_N's scale, W, dL/dSigma's trace terms and the dSn sum are double. A rounding error E made
// in iteration k is propagated by the linearized iteration E -> 1.5 E - 0.5 (E P^2 + P E P +
// P^2 E) Sn; in Sn's eigenbasis (P_k diagonal with p <= min(1.5^k, s^-1/2), s <= 1) entry (i, j)
// is scaled by |1.5 - 0.5 (p_i^2 + p_i p_j + p_j^2) s_j| <= g_k = max(1.5, (2.25^k + 1.5^k + 1)/2
// - 1.5): 1.5, 2.7, 6.4, 14, 32, 70 for k = 1..6. The errors made in iterations 0 .. T-1, each
// amplified by the later g_k, sum to at most ~50 u at T = 4, ~720 u at T = 5 (4.3e-5 in fp32),
// ~2.3e4 u at T = 6 (1.3e-3) and ~1.6e6 u at T = 7 (worst case s_j ~ 1: one dominant eigenvalue;
// measured: <= 2e-6 relative in y and dx for fp32 iterations at T <= 5 across well-conditioned,
// rank-deficient and 1e6-spread Sigma, 2e-5 at T = 6, 1e-3 .. 1e4 at T = 7 .. 10). So fp32
// iterations stay at T <= 5; fp64 data keeps fp64 math.
constexpr int kDbnIterNormFp32MaxT = 5;
GN_HOST_DEVICE inline bool dbn_iternorm_fp32(DType dtype, int T) {
  return dtype != DType::kFloat64 && T <= kDbnIterNormFp32MaxT;
}

// *tr = trace(A), visible to all on return.
template <class Ex>
GN_HOST_DEVICE void dbn_trace(Ex& ex, const double* A, int D, double* tr) {
  const double t = ex.sum(D, [&](int i) { return A[i * D + i]; });
  ex.each(1, [&](int) { *tr = t; });
  ex.sync();
}

// The iteration's state (S: float or double; row-major D x D matrices) and the double scalars.
// Forward (keep = false): Q holds two alternating matrices, R1 / R2 one each. Backward (keep):
// Q_0 .. Q_T, R1_0 .. R1_{T-1}, R2_0 .. R2_{T-1}, and the back steps' G (dL/dP_k), Y1, Y2, X.
template <typename S>
struct DbnIterScratch {
  S *Sn, *Q, *R1, *R2, *G, *Y1, *Y2, *X;
  double* dSn;  // backward: -1/2 sum_k (P_k^3)^T dL/dP_{k+1} (D x D)
  double* tr;   // tr(Sigma), then the tail's diagonal term
  double* dtr;  // dL/dtr through W's 1/sqrt(tr)
};
// Sizes: D x D matrices of type S, and doubles.
GN_HOST_DEVICE inline int64_t dbn_iternorm_mats(int T, bool keep) {
  return keep ? 3 * int64_t(T) + 6 : 5;
}
GN_HOST_DEVICE inline int64_t dbn_iternorm_doubles(int D, bool keep) {
  return (keep ? int64_t(D) * D : 0) + 2;
}
template <typename S>
GN_HOST_DEVICE inline DbnIterScratch<S> dbn_iternorm_layout(S* s, double* d, int D, int T,
                                                            bool keep) {
  const int64_t DD = int64_t(D) * D, nq = keep ? T + 1 : 2, nr = keep ? T : 1;
  DbnIterScratch<S> L;
  L.Sn = s;
  L.Q = L.Sn + DD;
  L.R1 = L.Q + nq * DD;
  L.R2 = L.R1 + nr * DD;
  L.G = keep ? L.R2 + nr * DD : nullptr;
  L.Y1 = keep ? L.G + DD : nullptr;
  L.Y2 = keep ? L.Y1 + DD : nullptr;
  L.X = keep ? L.Y2 + DD : nullptr;
  L.dSn = keep ? d : nullptr;
  L.tr = d + (keep ? DD : 0);
  L.dtr = L.tr + 1;
  return L;
}

// tr = tr(Sigma), Sn = Sigma / tr, Q_0 = I. Ends synced.
template <class Ex, typename S>
GN_HOST_DEVICE void dbn_iternorm_start(Ex& ex, const double* Sigma, int D,
                                       const DbnIterScratch<S>& L) {
  dbn_trace(ex, Sigma, D, L.tr);
  const double inv_tr = 1.0 / *L.tr;
  ex.each_ij(D, [&](int i, int j) {
    L.Sn[i * D + j] = static_cast<S>(Sigma[i * D + j] * inv_tr);
    L.Q[i * D + j] = S(i == j ? 1 : 0);
  });
  ex.sync();
}

// Launch granularity: a device may run an iteration, or a back step, as separate calls, one per
// part (part = -1: all of it). Each part has at most two D x D products, and no part reads what
// another thread block of the same part writes: its products read only matrices finished by
// earlier parts, and its elementwise steps touch only entries of the products it wrote itself.
// So a device may spread a part's output tiles over several blocks of one launch with no barrier
// between them (dbn_iternorm_cuda.cuh: the tiles of a group's products over gridDim.y blocks):
//   iteration k > 0:  R1 | R2 | R3 and the update (Q_k is read by all three, written by none);
//   back step k > 0:  Y1 | Y2 | Y3, dSn, G R2 | the rest and G's update (G is read by parts 0 and
//                     2 and written by part 3 only);
//   k = 0:            the iteration and the back step are elementwise (one part each).
GN_HOST_DEVICE inline int dbn_iternorm_iter_parts(int k) { return k == 0 ? 1 : 3; }
GN_HOST_DEVICE inline int dbn_bwd_iternorm_step_parts(int k) { return k == 0 ? 1 : 4; }
// The k-blocks of the iteration's products (the executors' mm_it): each entry is summed as
// partial sums of kDbnIterKb products (docs/numerics.md: blocked accumulation).
constexpr int kDbnIterKb = 128;

// Iteration k (Q_k -> Q_{k+1}; with keep R1_k, R2_k stay, else all in the two-slot buffers).
// Returns the slot index of Q_{k+1}. Ends synced.
template <class Ex, typename S>
GN_HOST_DEVICE int dbn_iternorm_iter(Ex& ex, int D, int k, bool keep, const DbnIterScratch<S>& L,
                                     int part = -1) {
  const int64_t DD = int64_t(D) * D;
  const int cur = keep ? k : k % 2, nxt = keep ? k + 1 : (k + 1) % 2;
  const S* Qk = L.Q + cur * DD;
  S* Qn = L.Q + nxt * DD;
  S* R1 = L.R1 + (keep ? k : 0) * DD;
  S* R2 = L.R2 + (keep ? k : 0) * DD;
  if (k == 0) {  // Q_0 = I: R1 = R2 = R3 = Sn, exactly what the products would give
    if (part > 0) return nxt;
    ex.each_ij(D, [&](int i, int j) {
      const S s = L.Sn[i * D + j];
      R1[i * D + j] = R2[i * D + j] = s;
      Qn[i * D + j] = S(1.5) * Qk[i * D + j] - S(0.5) * s;
    });
    ex.sync();
    return nxt;
  }
  if (part < 0 || part == 0) ex.mm_it_sym(L.Sn, Qk, R1, D);  // (P Sn)^T
  if (part < 0 || part == 1) ex.mm_it_sym(R1, Qk, R2, D);     // (P^2 Sn)^T
  if (part >= 0 && part != 2) return nxt;
  ex.mm_it_sym(R2, Qk, Qn, D);  // (P^3 Sn)^T
  ex.each_ij(D, [&](int i, int j) {
    Qn[i * D + j] = S(1.5) * Qk[i * D + j] - S(0.5) * Qn[i * D + j];
  });
  ex.sync();
  return nxt;
}

// W = sym(P_T) / sqrt(tr) in double (symmetric in exact arithmetic; its rounding is not).
template <class Ex, typename S>
GN_HOST_DEVICE void dbn_iternorm_w(Ex& ex, const S* QT, int D, double tr, double* W) {
  const double s = 1.0 / sqrt(tr);
  ex.each_lower(D, [&](int i, int j) {
    const double w =
        0.5 * (static_cast<double>(QT[i * D + j]) + static_cast<double>(QT[j * D + i])) * s;
    W[i * D + j] = W[j * D + i] = w;
  });
  ex.sync();
}

// IterNorm forward of one group: W = sym(P_T) / sqrt(tr(Sigma)). Scratch: dbn_iternorm_layout
// with keep = false. Ends synced.
template <class Ex, typename S>
GN_HOST_DEVICE void dbn_iternorm_whitening(Ex& ex, const double* Sigma, int D, int T, double* W,
                                           const DbnIterScratch<S>& L) {
  dbn_iternorm_start(ex, Sigma, D, L);
  int cur = 0;
  for (int k = 0; k < T; ++k) cur = dbn_iternorm_iter(ex, D, k, false, L);
  dbn_iternorm_w(ex, L.Q + int64_t(cur) * D * D, D, *L.tr, W);
}

// IterNorm backward of one group, through the iterations written out (the paper's eqs.): from
// GW = dY Xc^T (overwritten) and Sigma (the forward's, eps included). W = sym(P_T) / sqrt(tr), so
//   G = dL/dP_T = sym(GW) / sqrt(tr),  dL/dtr|W = -tr^-3/2 / 2 <sym(GW), P_T>,  for k = T-1 .. 0
//   with M = P_k:  dSn += -1/2 (M^3)^T G,
//                  G <- 3/2 G - 1/2 (G (M^2 Sn)^T + (M^2)^T G Sn^T + M^T G (M Sn)^T)   (dL/dP_k)
//   dL/dSigma = dSn / tr + (dL/dtr|W - <dSn, Sigma> / tr^2) I
// and B = (2/m) sym(dL/dSigma), so that dX = W (dY - mean(dY)) + B Xc as for ZCA (dbn_cpu.cc's
// derivation, steps 1, 3, 4). With the kept transposes (M^T = Q_k, (M Sn)^T = R1_k,
// (M^2 Sn)^T = R2_k, Sn^T = Sn) a back step is six products:
//   Y1 = Q G, Y2 = Q Y1, dSn -= 1/2 Q Y2, X = G R2 + Y2 Sn + Y1 R1, G <- 3/2 G - 1/2 X
// and none for k = 0 (Q_0 = I: dSn -= G/2; G's own update there would be dL/dP_0, which nothing
// reads). Fused affine as dbn_bwd_small.
// B may alias GW; W must not alias the scratch. Ends synced.
// In three stages that keep all their state in the scratch (so that a device may run each in its
// own launch, dbn_cuda.cu): head (the iterations, W, dgamma, G, dSn = 0; the iterations may also
// run as separate calls of dbn_iternorm_start / dbn_iternorm_iter with keep before
// dbn_bwd_iternorm_head_finish), one back step per k = T-1 .. 0, tail (B).
template <class Ex, typename S>
GN_HOST_DEVICE void dbn_bwd_iternorm_head_finish(Ex& ex, double* GW, int D, int T,
                                                 const double* gamma, double* dgamma, double* W,
                                                 const DbnIterScratch<S>& L) {
  const int DD = D * D;
  const S* QT = L.Q + int64_t(T) * DD;
  dbn_iternorm_w(ex, QT, D, *L.tr, W);
  if (gamma) {
    dbn_affine_dgamma(ex, W, GW, D, dgamma);
    ex.each_ij(D, [&](int i, int j) { GW[i * D + j] *= gamma[i]; });
    ex.sync();
  }
  dbn_symmetrize(ex, GW, D, 1.0);
  // dL/dtr through W's 1/sqrt(tr): <sym(GW), P_T> = <sym(GW), Q_T>.
  const double rs = 1.0 / sqrt(*L.tr);
  const double s = ex.sum(DD, [&](int e) { return GW[e] * static_cast<double>(QT[e]); });
  ex.each(1, [&](int) { *L.dtr = -0.5 * rs * rs * rs * s; });
  ex.each_ij(D, [&](int i, int j) {
    L.G[i * D + j] = static_cast<S>(GW[i * D + j] * rs);
    L.dSn[i * D + j] = 0.0;
  });
  ex.sync();
}

template <class Ex, typename S>
GN_HOST_DEVICE void dbn_bwd_iternorm_head(Ex& ex, const double* Sigma, double* GW, int D, int T,
                                          const double* gamma, double* dgamma, double* W,
                                          const DbnIterScratch<S>& L) {
  dbn_iternorm_start(ex, Sigma, D, L);
  for (int k = 0; k < T; ++k) dbn_iternorm_iter(ex, D, k, true, L);
  dbn_bwd_iternorm_head_finish(ex, GW, D, T, gamma, dgamma, W, L);
}

// Back step k: G = dL/dP_{k+1} -> dL/dP_k, dSn += -1/2 (P_k^3)^T G. Ends synced.
template <class Ex, typename S>
GN_HOST_DEVICE void dbn_bwd_iternorm_step(Ex& ex, int D, int k, const DbnIterScratch<S>& L,
                                          int part = -1) {
  const int64_t DD = int64_t(D) * D;
  S *G = L.G, *Y1 = L.Y1, *Y2 = L.Y2, *X = L.X;
  double* dSn = L.dSn;
  if (k == 0) {  // Q_0 = I: dSn -= G / 2; dL/dP_0 is not needed (P_0 = I is no function of Sn)
    ex.each_ij(D, [&](int i, int j) {
      dSn[i * D + j] -= 0.5 * static_cast<double>(G[i * D + j]);
    });
    ex.sync();
    return;
  }
  const S* Q = L.Q + k * DD;
  if (part < 0 || part == 0) ex.mm_it(Q, G, Y1, D);   // M^T G
  if (part < 0 || part == 1) ex.mm_it(Q, Y1, Y2, D);  // (M^2)^T G
  if (part < 0 || part == 2) {
    ex.mm_it(Q, Y2, X, D);                             // (M^3)^T G
    ex.each_ij(D, [&](int i, int j) { dSn[i * D + j] -= 0.5 * static_cast<double>(X[i * D + j]); });
    ex.sync();
    ex.mm_it(G, L.R2 + k * DD, X, D);                  // G (M^2 Sn)^T
  }
  if (part >= 0 && part != 3) return;
  ex.mm_it_acc(Y2, L.Sn, X, D);           // + (M^2)^T G Sn^T
  ex.mm_it_acc(Y1, L.R1 + k * DD, X, D);  // + M^T G (M Sn)^T
  ex.each_ij(D, [&](int i, int j) {
    G[i * D + j] = S(1.5) * G[i * D + j] - S(0.5) * X[i * D + j];
  });
  ex.sync();
}

// dL/dSigma = dSn / tr + (dtr_w - <dSn, Sigma> / tr^2) I; B = (2/m) sym(dL/dSigma).
template <class Ex, typename S>
GN_HOST_DEVICE void dbn_bwd_iternorm_tail(Ex& ex, const double* Sigma, int D, double m, double* B,
                                          const DbnIterScratch<S>& L) {
  const int DD = D * D;
  const double trv = *L.tr, dtr_w = *L.dtr;
  const double* dSn = L.dSn;
  const double s = ex.sum(DD, [&](int e) { return dSn[e] * Sigma[e]; });
  ex.sync();  // every thread has read tr before it is overwritten
  ex.each(1, [&](int) { *L.tr = dtr_w - s / (trv * trv); });
  ex.sync();
  const double diag = *L.tr;
  ex.each_ij(D, [&](int i, int j) { B[i * D + j] = dSn[i * D + j] / trv + (i == j ? diag : 0.0); });
  ex.sync();
  dbn_symmetrize(ex, B, D, 2.0 / m);
}

template <class Ex, typename S>
GN_HOST_DEVICE void dbn_bwd_iternorm(Ex& ex, const double* Sigma, double* GW, int D, int T,
                                     double m, const double* gamma, double* dgamma, double* W,
                                     double* B, const DbnIterScratch<S>& L) {
  dbn_bwd_iternorm_head(ex, Sigma, GW, D, T, gamma, dgamma, W, L);
  for (int k = T - 1; k >= 0; --k) dbn_bwd_iternorm_step(ex, D, k, L);
  dbn_bwd_iternorm_tail(ex, Sigma, D, m, B, L);
}

}  // namespace gn_mx
