/*
 * dbn_math.h: per-group fp64 small-matrix math of Decorrelated BN, shared by the CPU and CUDA
 * kernels (GN_HOST_DEVICE, no allocation, no LAPACK). All matrices are D x D, row-major, double.
 * An eigenvector matrix U stores eigenvector j in column j: U[i*D + j].
 * Formulas are documented in dbn.h (forward) and dbn_cpu.cc (backward derivation).
 */
#pragma once
#include <cmath>

#include "../common/acc_type.h"

namespace gn_mx {

// The Jacobi rotation (c, s) that zeroes A_pq of a symmetric matrix: t = tan(angle) is the smaller
// root of t^2 + 2 theta t - 1 = 0 with theta = (A_qq - A_pp) / (2 A_pq); for huge theta, t ~ 1/(2 theta)
// avoids overflowing theta^2. Requires apq != 0.
GN_HOST_DEVICE inline void dbn_jacobi_rotation(double app, double aqq, double apq, double* c,
                                               double* s) {
  const double theta = (aqq - app) / (2.0 * apq);
  double t;
  if (fabs(theta) > 1e150) {
    t = 0.5 / theta;
  } else {
    t = 1.0 / (fabs(theta) + sqrt(theta * theta + 1.0));
    if (theta < 0) t = -t;
  }
  *c = 1.0 / sqrt(t * t + 1.0);
  *s = t * *c;
}

// Cyclic Jacobi eigensolver for a symmetric matrix: a fallback for dsyevd_ (missing LAPACK or
// info != 0) and usable per thread on a device. `A` is destroyed; on return `l` holds the
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

GN_HOST_DEVICE inline void dbn_jacobi_eigh(double* A, double* U, double* l, int D) {
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) U[i * D + j] = (i == j) ? 1.0 : 0.0;
  double amax = 0.0;
  for (int i = 0; i < D * D; ++i) amax = fmax(amax, fabs(A[i]));
  const int e = dbn_jacobi_scale_exponent(amax);
  if (e != 0)
    for (int i = 0; i < D * D; ++i) A[i] = ldexp(A[i], -e);
  double scale = 0.0;
  for (int i = 0; i < D * D; ++i) scale += A[i] * A[i];
  const double tol = 1e-30 * scale;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0;
    for (int p = 0; p < D; ++p)
      for (int q = p + 1; q < D; ++q) off += A[p * D + q] * A[p * D + q];
    if (off <= tol || off == 0.0) break;
    for (int p = 0; p < D; ++p) {
      for (int q = p + 1; q < D; ++q) {
        const double apq = A[p * D + q];
        if (apq == 0.0) continue;
        double c, s;
        dbn_jacobi_rotation(A[p * D + p], A[q * D + q], apq, &c, &s);
        for (int k = 0; k < D; ++k) {  // A <- A J
          const double akp = A[k * D + p], akq = A[k * D + q];
          A[k * D + p] = c * akp - s * akq;
          A[k * D + q] = s * akp + c * akq;
        }
        for (int k = 0; k < D; ++k) {  // A <- J^T A
          const double apk = A[p * D + k], aqk = A[q * D + k];
          A[p * D + k] = c * apk - s * aqk;
          A[q * D + k] = s * apk + c * aqk;
        }
        A[p * D + q] = A[q * D + p] = 0.0;
        for (int k = 0; k < D; ++k) {  // U <- U J
          const double ukp = U[k * D + p], ukq = U[k * D + q];
          U[k * D + p] = c * ukp - s * ukq;
          U[k * D + q] = s * ukp + c * ukq;
        }
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

// The exact eigenvalues of cov + eps*I are >= eps; rounding in the covariance can push the
// smallest ones slightly below (even negative for badly scaled data), so clamp to eps.
GN_HOST_DEVICE inline void dbn_clamp_eigvals(double* l, int D, double eps) {
  for (int i = 0; i < D; ++i)
    if (!(l[i] >= eps)) l[i] = (l[i] != l[i]) ? l[i] : eps;  // keep NaN as NaN
}

// C = A B for D x D row-major matrices, i-k-j order (unit stride inner loop, vectorizable).
GN_HOST_DEVICE inline void dbn_matmul(const double* A, const double* B, int D, double* C) {
  for (int i = 0; i < D * D; ++i) C[i] = 0.0;
  for (int i = 0; i < D; ++i)
    for (int k = 0; k < D; ++k) {
      const double a = A[i * D + k];
      for (int j = 0; j < D; ++j) C[i * D + j] += a * B[k * D + j];
    }
}

// C = A B^T (rows of both are contiguous): dot products of rows.
GN_HOST_DEVICE inline void dbn_matmul_bt(const double* A, const double* B, int D, double* C) {
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) {
      double s = 0.0;
      for (int k = 0; k < D; ++k) s += A[i * D + k] * B[j * D + k];
      C[i * D + j] = s;
    }
}

// W = U diag(l^-1/2) U^T = Sigma^{-1/2}, as V V^T with V = U diag(l^-1/4).
// V: D*D scratch.
GN_HOST_DEVICE inline void dbn_inv_sqrt(const double* U, const double* l, int D, double* W,
                                        double* V) {
  for (int k = 0; k < D; ++k) {
    const double s = 1.0 / sqrt(sqrt(l[k]));
    for (int i = 0; i < D; ++i) V[i * D + k] = U[i * D + k] * s;
  }
  dbn_matmul_bt(V, V, D, W);
}

// Daleckii-Krein divided difference of f(l) = l^-1/2:
//   (f(l_i) - f(l_j)) / (l_i - l_j) = -1 / (sqrt(l_i) sqrt(l_j) (sqrt(l_i) + sqrt(l_j)))
// which is also f'(l_i) = -1/2 l_i^-3/2 on the diagonal, so equal eigenvalues need no guard.
GN_HOST_DEVICE inline double dbn_inv_sqrt_divdiff(double li, double lj) {
  const double si = sqrt(li), sj = sqrt(lj);
  return -1.0 / (si * sj * (si + sj));
}

// Backward small-matrix step for one group. Inputs: U, l (forward eigendecomposition, l >= eps),
// GW = dY Xc^T (not necessarily symmetric), m = number of columns. Outputs: W = Sigma^{-1/2} and
// B = (2/m) G_S with G_S = U (K o (U^T sym(GW) U)) U^T, so that dX = W (dY - mean(dY)) + B Xc.
// tmp: 3*D*D doubles.
GN_HOST_DEVICE inline void dbn_bwd_group(const double* U, const double* l, const double* GW, int D,
                                         double m, double* W, double* B, double* tmp) {
  double* H = tmp;              // sym(GW), later K o (U^T sym(GW) U)
  double* T = tmp + D * D;      // products
  double* Ut = tmp + 2 * D * D; // U^T
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) {
      H[i * D + j] = 0.5 * (GW[i * D + j] + GW[j * D + i]);
      Ut[i * D + j] = U[j * D + i];
    }
  dbn_matmul(H, U, D, T);   // T = sym(GW) U
  dbn_matmul(Ut, T, D, H);  // H = U^T sym(GW) U
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) H[i * D + j] *= dbn_inv_sqrt_divdiff(l[i], l[j]);
  dbn_matmul(U, H, D, T);   // T = U H
  dbn_matmul_bt(T, U, D, B);  // B = T U^T
  const double two_over_m = 2.0 / m;
  for (int i = 0; i < D; ++i)  // symmetrize (exact in exact arithmetic) and scale
    for (int j = i; j < D; ++j) {
      const double b = 0.5 * (B[i * D + j] + B[j * D + i]) * two_over_m;
      B[i * D + j] = B[j * D + i] = b;
    }
  dbn_inv_sqrt(U, l, D, W, T);
}

// r = momentum * r + (1 - momentum) * batch, computed in double.
GN_HOST_DEVICE inline double dbn_running_update(double r, double batch, double momentum) {
  return momentum * r + (1.0 - momentum) * batch;
}

}  // namespace gn_mx
