/*
 * dbn_small_cpu.h: the CPU side of the per-group fp64 D x D math of Decorrelated BN: the
 * register-blocked product dmm_nn behind CpuExec, the host executor that runs dbn_math.h's
 * D x D steps (W = Sigma^{-1/2}, the backward's dbn_bwd_small), and the Householder + QL
 * eigensolver for D > 8.
 *
 * Why a CPU product of its own: plain-loop products (a chain of dependent scalar FMAs per entry,
 * latency-bound, ~1 GFLOP/s) made the D x D steps ~20% of a D = 64 forward+backward. dmm_nn
 * computes C = A B with B row-major, so the inner loop runs along contiguous rows of B and C
 * (the steps form their transposes explicitly, which the device executor also profits from).
 *
 * dmm_nn has an AVX2+FMA kernel (6 x 8 doubles of C in registers) chosen at run time like the
 * float panel kernels of dbn_cpu.cc (GNMX_CPU_ISA=generic forces the portable loop).
 */
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "cpu_isa.h"
#include "dbn_math.h"

namespace gn_mx {
namespace dbn_small {

// C (M x N) = A (M x K) B (K x N), all row-major with leading dimensions lda, ldb, ldc.
inline void dmm_nn_generic(const double* A, int lda, const double* B, int ldb, double* C, int ldc,
                           int M, int N, int K) {
  for (int i = 0; i < M; ++i) {
    double* c = C + static_cast<long>(i) * ldc;
    for (int j = 0; j < N; ++j) c[j] = 0.0;
    for (int k = 0; k < K; ++k) {
      const double a = A[static_cast<long>(i) * lda + k];
      const double* b = B + static_cast<long>(k) * ldb;
      for (int j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

#if defined(GNMX_CPU_X86)
template <int R>
__attribute__((target("avx2,fma"))) void dmm_rows_avx2(const double* A, int lda, const double* B,
                                                       int ldb, double* C, int ldc, int N, int K) {
  int j = 0;
  for (; j + 8 <= N; j += 8) avx2_tile2<double, R>(A, lda, B + j, ldb, C + j, ldc, K);
  if (j < N)  // remaining columns
    for (int r = 0; r < R; ++r) {
      double* c = C + static_cast<long>(r) * ldc;
      const double* a = A + static_cast<long>(r) * lda;
      for (int jj = j; jj < N; ++jj) c[jj] = 0.0;
      for (int k = 0; k < K; ++k) {
        const double av = a[k];
        const double* b = B + static_cast<long>(k) * ldb;
        for (int jj = j; jj < N; ++jj) c[jj] += av * b[jj];
      }
    }
}

// The avx512 level: 16-column strips, then the avx2 rows for the rest (the same bits per entry).
template <int R>
__attribute__((target(GNMX_AVX512_TARGET))) void dmm_rows_avx512(const double* A, int lda,
                                                                const double* B, int ldb,
                                                                double* C, int ldc, int N, int K) {
  int j = 0;
  for (; j + 16 <= N; j += 16) avx512_tile2<double, R>(A, lda, B + j, ldb, C + j, ldc, K);
  if (j < N) dmm_rows_avx2<R>(A, lda, B + j, ldb, C + j, ldc, N - j, K);
}

template <int R, bool W512>
inline void dmm_rows_x86(const double* A, int lda, const double* B, int ldb, double* C, int ldc,
                         int N, int K) {
  if (W512)
    dmm_rows_avx512<R>(A, lda, B, ldb, C, ldc, N, K);
  else
    dmm_rows_avx2<R>(A, lda, B, ldb, C, ldc, N, K);
}

template <bool W512>
inline void dmm_nn_x86(const double* A, int lda, const double* B, int ldb, double* C, int ldc,
                       int M, int N, int K) {
  int i = 0;
  for (; i + 6 <= M; i += 6)
    dmm_rows_x86<6, W512>(A + static_cast<long>(i) * lda, lda, B, ldb,
                          C + static_cast<long>(i) * ldc, ldc, N, K);
  const double* a = A + static_cast<long>(i) * lda;
  double* c = C + static_cast<long>(i) * ldc;
  with_tail_rows(M - i, [&](auto r) {
    dmm_rows_x86<decltype(r)::value, W512>(a, lda, B, ldb, c, ldc, N, K);
  });
}

#endif

inline void dmm_nn(const double* A, int lda, const double* B, int ldb, double* C, int ldc, int M,
                   int N, int K) {
#if defined(GNMX_CPU_X86)
  if (cpu_has_avx512()) return dmm_nn_x86<true>(A, lda, B, ldb, C, ldc, M, N, K);
  if (cpu_has_avx2()) return dmm_nn_x86<false>(A, lda, B, ldb, C, ldc, M, N, K);
#endif
  dmm_nn_generic(A, lda, B, ldb, C, ldc, M, N, K);
}

// ---- IterNorm's D x D products: C (+)= A B, all D x D row-major, S = float or double ----------
// The Newton iterations and their backward are chains of square products (dbn_math.h), ~10^2 of
// them per group at T = 5 .. 10: a cache-blocked kernel, not dmm_nn's whole-K rows. Rows of B
// are taken kKb at a time (a kKb x D block of B stays in L2: 256 KB for float at D = 512); within
// a block the column strips (16 floats / 8 doubles wide) are the outer loop, so a strip of B
// (kKb x 64 bytes) stays in L1 while 6-row tiles of A stream past it; each 6 x (2 lanes) tile of
// C is summed from zero in 12 registers over the block's k (ascending) and then added to C. The
// k-blocks also bound the accumulation error (docs/numerics.md): each entry is a sum of D / kKb
// partial sums of kKb products, error <= (kKb + D / kKb) u |A| |B| instead of D u |A| |B|. The
// CUDA executor sums in the same blocks and order (dbn_cuda.cu, BlockExec::mm_it).
constexpr int kKb = 128;

// Entry (i, j) of one k-block summed from zero in ascending k, then added to C when acc.
template <typename S>
inline S mm_entry(const S* A, const S* B, int D, int i, int j, int k0, int kn) {
  S v = S(0);
  for (int k = k0; k < k0 + kn; ++k)
    v += A[static_cast<long>(i) * D + k] * B[static_cast<long>(k) * D + j];
  return v;
}
template <typename S>
inline void mm_block_generic(const S* A, const S* B, S* C, int D, int j0, int k0, int kn,
                             bool acc) {
  for (int i = 0; i < D; ++i)
    for (int j = j0; j < D; ++j) {
      const S v = mm_entry(A, B, D, i, j, k0, kn);
      C[static_cast<long>(i) * D + j] = acc ? C[static_cast<long>(i) * D + j] + v : v;
    }
}

#if defined(GNMX_CPU_X86)
// One tile of a strip, C rows [0, R) x 2 lanes (+)= A (R x kn, row stride D) B (kn x 2 lanes, row
// stride D): cpu_isa.h's tile, 2 x 8 floats / 2 x 4 doubles (avx2) or twice that (avx512), each
// entry the same FMA chain on both.
template <typename S, int R>
__attribute__((target("avx2,fma"), noinline)) void mm_tile_avx2(const S* A, const S* B, S* C, int D,
                                                               int kn, bool acc) {
  avx2_tile2<S, R>(A, D, B, D, C, D, kn, acc);
}
template <typename S, int R>
__attribute__((target(GNMX_AVX512_TARGET), noinline)) void mm_tile_avx512(const S* A, const S* B, S* C,
                                                                      int D, int kn, bool acc) {
  avx512_tile2<S, R>(A, D, B, D, C, D, kn, acc);
}
template <typename S, int R, bool W512>
inline void mm_tile(const S* A, const S* B, S* C, int D, int kn, bool acc) {
  if (W512)
    mm_tile_avx512<S, R>(A, B, C, D, kn, acc);
  else
    mm_tile_avx2<S, R>(A, B, C, D, kn, acc);
}

// The column strips of one k-block from column j on, each strip's rows in 6-row tiles; returns
// the first column no strip covers. sym: only tiles reaching the upper triangle (j >= i) are
// computed (the caller mirrors).
template <typename S, bool W512>
int mm_strips(const S* A, const S* B, S* C, int D, int k0, int kn, bool acc, bool sym, int j) {
  constexpr int W = 2 * (W512 ? Avx512Vec<S>::kLanes : Avx2Vec<S>::kLanes);
  for (; j + W <= D; j += W) {
    const S* b = B + static_cast<long>(k0) * D + j;
    const int iend = sym ? std::min(D, j + W) : D;  // rows past j + W - 1 are below the strip
    int i = 0;
    for (; i + 6 <= iend; i += 6)
      mm_tile<S, 6, W512>(A + static_cast<long>(i) * D + k0, b, C + static_cast<long>(i) * D + j,
                          D, kn, acc);
    if (i >= iend) continue;
    const int rows = std::min(6, D - i);
    const S* a = A + static_cast<long>(i) * D + k0;
    S* c = C + static_cast<long>(i) * D + j;
    if (rows == 6) {
      mm_tile<S, 6, W512>(a, b, c, D, kn, acc);
      continue;
    }
    with_tail_rows(rows, [&](auto r) { mm_tile<S, decltype(r)::value, W512>(a, b, c, D, kn, acc); });
  }
  return j;
}

// One k-block: avx512 strips first where the level has them, then avx2 strips, then the generic
// loops for the last columns.
template <typename S>
void mm_block_x86(const S* A, const S* B, S* C, int D, int k0, int kn, bool acc, bool sym) {
  int j = cpu_has_avx512() ? mm_strips<S, true>(A, B, C, D, k0, kn, acc, sym, 0) : 0;
  j = mm_strips<S, false>(A, B, C, D, k0, kn, acc, sym, j);
  if (j < D) mm_block_generic(A, B, C, D, j, k0, kn, acc);  // remaining columns
}
#endif

// C = A B (acc: C += A B), D x D row-major. sym: the result is symmetric in exact arithmetic (a
// product of commuting symmetric matrices): its upper triangle is computed (about half the
// work) and mirrored, C_ij = C_ji for i > j, exactly as the CUDA executor does.
template <typename S>
void mm_square(const S* A, const S* B, S* C, int D, bool acc, bool sym = false) {
  for (int k0 = 0; k0 < D; k0 += kKb) {
    const int kn = D - k0 < kKb ? D - k0 : kKb;
    const bool a = acc || k0 > 0;
#if defined(GNMX_CPU_X86)
    if (cpu_has_avx2()) {
      mm_block_x86(A, B, C, D, k0, kn, a, sym);
      continue;
    }
#endif
    mm_block_generic(A, B, C, D, 0, k0, kn, a);
  }
  if (sym)
    for (int i = 1; i < D; ++i)
      for (int j = 0; j < i; ++j) C[static_cast<long>(i) * D + j] = C[static_cast<long>(j) * D + i];
}

// The host executor of dbn_math.h's D x D steps (dbn_whitening_matrix, dbn_bwd_small, IterNorm):
// plain loops; C = A B by dmm_nn (ZCA's few products) or mm_square (IterNorm's chains, float or
// double).
struct CpuExec {
  template <class F> void each(int n, F&& f) const {
    for (int e = 0; e < n; ++e) f(e);
  }
  template <class F> void each_ij(int D, F&& f) const {
    for (int i = 0; i < D; ++i)
      for (int j = 0; j < D; ++j) f(i, j);
  }
  template <class F> void each_lower(int D, F&& f) const {
    for (int i = 0; i < D; ++i)
      for (int j = 0; j <= i; ++j) f(i, j);
  }
  template <class F> double sum(int n, F&& f) const {
    double s = 0.0;
    for (int e = 0; e < n; ++e) s += f(e);
    return s;
  }
  void sync() const {}
  void mm(const double* A, const double* B, double* C, int D) const {
    dmm_nn(A, D, B, D, C, D, D, D, D);
  }
  void mm_orth(const double* A, const double* B, double* C, int D) const { mm(A, B, C, D); }
  // IterNorm's products (dbn_math.h), S = float or double: C = A B and C += A B.
  template <typename S> void mm_it(const S* A, const S* B, S* C, int D) const {
    mm_square(A, B, C, D, false);
  }
  template <typename S> void mm_it_acc(const S* A, const S* B, S* C, int D) const {
    mm_square(A, B, C, D, true);
  }
  template <typename S> void mm_it_sym(const S* A, const S* B, S* C, int D) const {
    mm_square(A, B, C, D, false, true);
  }
};

// ---- Symmetric eigensolver: Householder tridiagonalization + implicit QL -------------------------
// For the group sizes of DBN (D ~ 8..128) this beats LAPACK dsyevd through OpenBLAS by 2-4x (no
// per-call set-up, no tiny BLAS calls) with the same backward stability: orthogonal similarity
// transforms only, eigenvectors orthonormal to rounding. Steps, for a symmetric A (row-major):
//  0. scale A by a power of two so that max |A_ij| is in [0.5, 1) (exact; keeps squares of
//     entries away from overflow / underflow whatever the data's scale), undone on l at the end;
//  1. for k = 0 .. D-3: the reflector H_k = I - tau v v^T (v_0 = 1 implied by scaling below) maps
//     A[k+1:, k] onto alpha e_1 (alpha = -sign(x_0) |x|, so alpha - x_0 never cancels); the
//     trailing block becomes H_k A H_k via the symmetric rank-2 update A -= v w^T + w v^T with
//     p = tau A v, w = p - (tau/2)(p.v) v. Diagonal d_k = A_kk, off-diagonal e_k = alpha;
//  2. Q = H_0 H_1 ... H_{D-3} accumulated backwards (each H_k touches rows/columns > k only), so
//     A = Q T Q^T with T tridiagonal (d, e); Q is kept transposed (rows = columns of Q);
//  3. implicit QL with Wilkinson's shift on (d, e): each sweep chases the bulge with plane
//     rotations, applied to consecutive rows of Q^T (contiguous, vectorizable); an off-diagonal
//     is zero once |e_m| <= DBL_EPSILON (|d_m| + |d_{m+1}|) (kQlEps);
//  4. sort ascending (as LAPACK), U = (Q^T)^T.
// Returns false (caller falls back to Jacobi) if a QL iteration count exceeds kQlMaxIter per eigenvalue
// or the input is not finite. work: 2*D*D + 4*D doubles.
inline size_t eigh_ql_work(int D) { return 2 * static_cast<size_t>(D) * D + 4 * static_cast<size_t>(D); }

// Range limits of the QL solver, each with its reason:
//  kQlHypotLo/Hi: a^2 + b^2 neither underflows nor overflows for max(|a|, |b|) in (1e-150, 1e150)
//    (squares in (1e-300, 1e300), inside fp64's normal range 2.2e-308 .. 1.8e308); outside,
//    std::hypot's scaled (slower) form;
//  kQlMaxIter: QL iterations per eigenvalue before giving up (usually 1-3; the caller falls back);
//  kQlFinite: the largest finite double: an |entry| not <= it is inf or NaN (rejected).
constexpr double kQlHypotLo = 1e-150;
constexpr double kQlHypotHi = 1e150;
constexpr int kQlMaxIter = 60;
constexpr double kQlFinite = std::numeric_limits<double>::max();
constexpr double kQlEps = std::numeric_limits<double>::epsilon();  // deflation: |e_m| <= eps (|d_m| + |d_m+1|)

// sqrt(a^2 + b^2) without std::hypot's cost when no square can overflow or underflow.
inline double fast_hypot(double a, double b) {
  const double m = std::fmax(std::fabs(a), std::fabs(b));
  if (m > kQlHypotLo && m < kQlHypotHi) return std::sqrt(a * a + b * b);
  return std::hypot(a, b);
}

// The solver's scratch, carved from `work` (eigh_ql_work(D) doubles).
struct QlWork {
  double* A;   // D*D, the scaled input, destroyed (reflectors kept right of the diagonal)
  double* Qt;  // D*D, Q^T: its rows are the eigenvectors being rotated
  double* d;   // D, diagonal of the tridiagonal matrix, then the eigenvalues
  double* e;   // D, its off-diagonal
  double* v;   // D, a reflector
  double* p;   // D, p = tau A v, then w
};
inline QlWork ql_work(double* work, int D) {
  QlWork w;
  w.A = work;
  w.Qt = w.A + D * D;
  w.d = w.Qt + D * D;
  w.e = w.d + D;
  w.v = w.e + D;
  w.p = w.v + D;
  return w;
}

// Step 0: A = 2^-ex A_in with max |A_ij| in [0.5, 1); returns false for a non-finite input. A zero
// matrix sets *zero and leaves A untouched (the caller answers l = 0, U = I).
__attribute__((always_inline)) inline bool ql_scale(const double* A_in, int D, double* A, int* ex,
                                                    bool* zero) {
  double amax = 0.0;
  for (int i = 0; i < D * D; ++i) {
    const double a = std::fabs(A_in[i]);
    if (!(a <= kQlFinite)) return false;  // inf / NaN
    amax = a > amax ? a : amax;
  }
  *zero = amax == 0.0;
  *ex = 0;
  if (*zero) return true;
  std::frexp(amax, ex);  // amax = f 2^ex, f in [0.5, 1)
  for (int i = 0; i < D * D; ++i) A[i] = std::ldexp(A_in[i], -*ex);
  return true;
}

// Step 1: Householder tridiagonalization A = Q T Q^T, T = tridiag(d, e). Reflector k is kept in
// row k of A right of the diagonal (v_0 = 1 implied), its tau in taus[k].
__attribute__((always_inline)) inline void ql_tridiagonalize(const QlWork& w, int D, double* taus) {
  double *A = w.A, *d = w.d, *e = w.e, *v = w.v, *p = w.p;
  for (int k = 0; k + 2 < D; ++k) {
    double* x = A + k * D + k + 1;  // row k right of the diagonal == column k below it
    const int n = D - k - 1;
    double nrm2 = 0.0;
#pragma omp simd reduction(+ : nrm2)
    for (int i = 1; i < n; ++i) nrm2 += x[i] * x[i];
    d[k] = A[k * D + k];
    if (nrm2 == 0.0) {  // already tridiagonal in this column
      e[k] = x[0];
      taus[k] = 0.0;
      continue;
    }
    const double x0 = x[0];
    const double norm = std::sqrt(nrm2 + x0 * x0);
    const double alpha = x0 >= 0 ? -norm : norm;
    const double v0 = x0 - alpha;        // |v0| = |x0| + norm: no cancellation
    const double tau = -v0 / alpha;      // with v scaled to v_0 = 1: tau = 2 / (v^T v)
    const double inv_v0 = 1.0 / v0;
    v[0] = 1.0;
    for (int i = 1; i < n; ++i) v[i] = x[i] * inv_v0;
    e[k] = alpha;
    taus[k] = tau;
    double* A2 = A + (k + 1) * D + (k + 1);  // trailing n x n block, row stride D
    double pv = 0.0;
    for (int i = 0; i < n; ++i) {
      const double* row = A2 + i * D;
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int j = 0; j < n; ++j) s += row[j] * v[j];
      p[i] = tau * s;
      pv += p[i] * v[i];
    }
    const double kk = 0.5 * tau * pv;
    for (int i = 0; i < n; ++i) p[i] -= kk * v[i];  // p <- w
    for (int i = 0; i < n; ++i) {
      double* row = A2 + i * D;
      const double vi = v[i], wi = p[i];
#pragma omp simd
      for (int j = 0; j < n; ++j) row[j] -= vi * p[j] + wi * v[j];
    }
    for (int i = 1; i < n; ++i) x[i] = v[i];  // keep the reflector (v_0 = 1 implied)
  }
  if (D >= 2) {
    d[D - 2] = A[(D - 2) * D + D - 2];
    e[D - 2] = A[(D - 2) * D + D - 1];
  }
  d[D - 1] = A[(D - 1) * D + D - 1];
  e[D - 1] = 0.0;
}

// Step 2: Q = H_0 ... H_{D-3}, built backwards (Q2 <- H_k Q2 on rows/columns k+1..D-1) in Qt's
// storage, then transposed in place.
__attribute__((always_inline)) inline void ql_accumulate_q(const QlWork& w, int D,
                                                           const double* taus) {
  double *Q = w.Qt, *v = w.v, *p = w.p;
  for (int i = 0; i < D * D; ++i) Q[i] = 0.0;
  for (int i = 0; i < D; ++i) Q[i * D + i] = 1.0;
  for (int k = D - 3; k >= 0; --k) {
    const double tau = taus[k];
    if (tau == 0.0) continue;
    const int n = D - k - 1;
    const double* x = w.A + k * D + k + 1;
    v[0] = 1.0;
    for (int i = 1; i < n; ++i) v[i] = x[i];
    double* Q2 = Q + (k + 1) * D + (k + 1);
    for (int j = 0; j < n; ++j) p[j] = 0.0;  // p = v^T Q2
    for (int i = 0; i < n; ++i) {
      const double vi = v[i];
      const double* row = Q2 + i * D;
#pragma omp simd
      for (int j = 0; j < n; ++j) p[j] += vi * row[j];
    }
    for (int i = 0; i < n; ++i) {
      const double tvi = tau * v[i];
      double* row = Q2 + i * D;
#pragma omp simd
      for (int j = 0; j < n; ++j) row[j] -= tvi * p[j];
    }
  }
  for (int i = 0; i < D; ++i)  // in-place transpose: Qt rows = columns of Q
    for (int j = i + 1; j < D; ++j) {
      const double t = Q[i * D + j];
      Q[i * D + j] = Q[j * D + i];
      Q[j * D + i] = t;
    }
}

// Step 3: implicit QL with Wilkinson's shift on (d, e); each sweep chases the bulge with plane
// rotations applied to consecutive rows of Qt. False after kQlMaxIter iterations on one eigenvalue.
__attribute__((always_inline)) inline bool ql_implicit(const QlWork& w, int D) {
  double *d = w.d, *e = w.e, *Qt = w.Qt;
  for (int l0 = 0; l0 < D; ++l0) {
    int iter = 0;
    int m;
    do {
      for (m = l0; m < D - 1; ++m) {
        const double dd = std::fabs(d[m]) + std::fabs(d[m + 1]);
        if (std::fabs(e[m]) <= kQlEps * dd) break;
      }
      if (m == l0) break;
      if (++iter > kQlMaxIter) return false;
      double g = (d[l0 + 1] - d[l0]) / (2.0 * e[l0]);
      double r = fast_hypot(g, 1.0);
      g = d[m] - d[l0] + e[l0] / (g + (g >= 0 ? r : -r));
      double s = 1.0, c = 1.0, pp = 0.0;
      int i;
      bool deflated = false;
      for (i = m - 1; i >= l0; --i) {
        const double f = s * e[i], b = c * e[i];
        r = fast_hypot(f, g);
        e[i + 1] = r;
        if (r == 0.0) {  // underflow: split here and restart
          d[i + 1] -= pp;
          e[m] = 0.0;
          deflated = true;
          break;
        }
        s = f / r;
        c = g / r;
        g = d[i + 1] - pp;
        r = (d[i] - g) * s + 2.0 * c * b;
        pp = s * r;
        d[i + 1] = g + pp;
        g = c * r - b;
        double* zi = Qt + i * D;
        double* zj = zi + D;
#pragma omp simd
        for (int k = 0; k < D; ++k) {
          const double fk = zj[k];
          zj[k] = s * zi[k] + c * fk;
          zi[k] = c * zi[k] - s * fk;
        }
      }
      if (deflated) continue;
      d[l0] -= pp;
      e[l0] = g;
      e[m] = 0.0;
    } while (true);
  }
  return true;
}

// Step 4: sort ascending (as LAPACK), unscale by 2^ex, U = Qt^T.
__attribute__((always_inline)) inline void ql_sort_out(const QlWork& w, int D, int ex, double* U,
                                                       double* l) {
  double *d = w.d, *Qt = w.Qt;
  for (int i = 0; i < D; ++i) {
    int best = i;
    for (int j = i + 1; j < D; ++j)
      if (d[j] < d[best]) best = j;
    if (best != i) {
      std::swap(d[i], d[best]);
      double* a = Qt + i * D;
      double* b = Qt + best * D;
      for (int k = 0; k < D; ++k) std::swap(a[k], b[k]);
    }
  }
  for (int i = 0; i < D; ++i) l[i] = std::ldexp(d[i], ex);
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) U[i * D + j] = Qt[j * D + i];
}

__attribute__((always_inline)) inline bool eigh_ql_body(const double* A_in, int D, double* U,
                                                        double* l, double* work) {
  const QlWork w = ql_work(work, D);
  int ex;
  bool zero;
  if (!ql_scale(A_in, D, w.A, &ex, &zero)) return false;
  if (zero) {
    for (int i = 0; i < D; ++i) {
      l[i] = 0.0;
      for (int j = 0; j < D; ++j) U[i * D + j] = i == j ? 1.0 : 0.0;
    }
    return true;
  }
  double* taus = U;  // U is free until step 4: D doubles of scratch
  ql_tridiagonalize(w, D, taus);
  ql_accumulate_q(w, D, taus);
  if (!ql_implicit(w, D)) return false;
  ql_sort_out(w, D, ex, U, l);
  return true;
}

#if defined(GNMX_CPU_X86)
__attribute__((target("avx2,fma"))) inline bool eigh_ql_avx2(const double* A, int D, double* U,
                                                             double* l, double* work) {
  return eigh_ql_body(A, D, U, l, work);
}
#endif

inline bool eigh_ql(const double* A, int D, double* U, double* l, double* work) {
#if defined(GNMX_CPU_X86)
  if (cpu_has_avx2()) return eigh_ql_avx2(A, D, U, l, work);
#endif
  return eigh_ql_body(A, D, U, l, work);
}

}  // namespace dbn_small
}  // namespace gn_mx
