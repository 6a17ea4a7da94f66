/*
 * dbn_small_cpu.h: CPU versions of the per-group fp64 D x D steps of Decorrelated BN (W =
 * Sigma^{-1/2} from the eigendecomposition, and the backward's dbn_bwd_group), computed with
 * register-blocked fp64 products instead of dbn_math.h's plain loops.
 *
 * Same formulas and contracts as dbn_inv_sqrt / dbn_bwd_group in dbn_math.h (which the CUDA kernel
 * mirrors): only the order of the fp64 additions differs. Why a CPU copy: dbn_math.h's
 * dbn_matmul_bt is a chain of dependent scalar FMAs (latency-bound, ~1 GFLOP/s), which made the
 * D x D steps ~20% of a D = 64 forward+backward. Here every product is C = A B with B row-major,
 * so the inner loop runs along contiguous rows of B and C (transposes are explicit D x D copies).
 *
 * dmm_nn has an AVX2+FMA kernel (4 x 8 doubles of C in registers) chosen at run time like the
 * float panel kernels of dbn_cpu.cc (GNMX_CPU_ISA=generic forces the portable loop).
 */
#pragma once
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "dbn_math.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GNMX_DBN_SMALL_AVX2 1
#endif

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

#if defined(GNMX_DBN_SMALL_AVX2)
__attribute__((target("avx2,fma"))) inline void dmm_nn_avx2(const double* A, int lda,
                                                            const double* B, int ldb, double* C,
                                                            int ldc, int M, int N, int K) {
  int i = 0;
  for (; i + 4 <= M; i += 4) {
    const double* a0 = A + static_cast<long>(i) * lda;
    const double* a1 = a0 + lda;
    const double* a2 = a1 + lda;
    const double* a3 = a2 + lda;
    int j = 0;
    for (; j + 8 <= N; j += 8) {
      __m256d c00 = _mm256_setzero_pd(), c01 = c00, c10 = c00, c11 = c00;
      __m256d c20 = c00, c21 = c00, c30 = c00, c31 = c00;
      const double* b = B + j;
      for (int k = 0; k < K; ++k, b += ldb) {
        const __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
        __m256d w = _mm256_broadcast_sd(a0 + k);
        c00 = _mm256_fmadd_pd(w, b0, c00);
        c01 = _mm256_fmadd_pd(w, b1, c01);
        w = _mm256_broadcast_sd(a1 + k);
        c10 = _mm256_fmadd_pd(w, b0, c10);
        c11 = _mm256_fmadd_pd(w, b1, c11);
        w = _mm256_broadcast_sd(a2 + k);
        c20 = _mm256_fmadd_pd(w, b0, c20);
        c21 = _mm256_fmadd_pd(w, b1, c21);
        w = _mm256_broadcast_sd(a3 + k);
        c30 = _mm256_fmadd_pd(w, b0, c30);
        c31 = _mm256_fmadd_pd(w, b1, c31);
      }
      double* c = C + static_cast<long>(i) * ldc + j;
      _mm256_storeu_pd(c, c00);
      _mm256_storeu_pd(c + 4, c01);
      _mm256_storeu_pd(c + ldc, c10);
      _mm256_storeu_pd(c + ldc + 4, c11);
      _mm256_storeu_pd(c + 2 * ldc, c20);
      _mm256_storeu_pd(c + 2 * ldc + 4, c21);
      _mm256_storeu_pd(c + 3 * ldc, c30);
      _mm256_storeu_pd(c + 3 * ldc + 4, c31);
    }
    if (j < N)  // remaining columns of these 4 rows
      for (int r = 0; r < 4; ++r) {
        double* c = C + static_cast<long>(i + r) * ldc;
        const double* a = A + static_cast<long>(i + r) * lda;
        for (int jj = j; jj < N; ++jj) c[jj] = 0.0;
        for (int k = 0; k < K; ++k) {
          const double av = a[k];
          const double* b = B + static_cast<long>(k) * ldb;
          for (int jj = j; jj < N; ++jj) c[jj] += av * b[jj];
        }
      }
  }
  if (i < M)
    dmm_nn_generic(A + static_cast<long>(i) * lda, lda, B, ldb, C + static_cast<long>(i) * ldc,
                   ldc, M - i, N, K);
}

inline bool use_avx2() {
  static const bool ok = [] {
    const char* isa = std::getenv("GNMX_CPU_ISA");
    if (isa && std::strcmp(isa, "generic") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}
#endif

inline void dmm_nn(const double* A, int lda, const double* B, int ldb, double* C, int ldc, int M,
                   int N, int K) {
#if defined(GNMX_DBN_SMALL_AVX2)
  if (use_avx2()) return dmm_nn_avx2(A, lda, B, ldb, C, ldc, M, N, K);
#endif
  dmm_nn_generic(A, lda, B, ldb, C, ldc, M, N, K);
}

inline void transpose(const double* A, int D, double* At) {
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) At[j * D + i] = A[i * D + j];
}

// W = U diag(l^-1/2) U^T (= dbn_inv_sqrt). tmp: 2*D*D doubles.
inline void inv_sqrt(const double* U, const double* l, int D, double* W, double* tmp) {
  double* V = tmp;          // U diag(l^-1/2)
  double* Ut = tmp + D * D;
  for (int i = 0; i < D; ++i)
    for (int k = 0; k < D; ++k) {
      V[i * D + k] = U[i * D + k] / std::sqrt(l[k]);
      Ut[k * D + i] = U[i * D + k];
    }
  dmm_nn(V, D, Ut, D, W, D, D, D, D);
  for (int i = 0; i < D; ++i)  // symmetric in exact arithmetic
    for (int j = i + 1; j < D; ++j) W[i * D + j] = W[j * D + i] = 0.5 * (W[i * D + j] + W[j * D + i]);
}

// The backward D x D step (= dbn_bwd_group): W = Sigma^{-1/2} and B = (2/m) U (K o (U^T sym(GW)
// U)) U^T. tmp: 4*D*D doubles.
inline void bwd_group(const double* U, const double* l, const double* GW, int D, double m,
                      double* W, double* B, double* tmp) {
  double* H = tmp;
  double* T = tmp + D * D;
  double* Ut = tmp + 2 * D * D;
  double* V = tmp + 3 * D * D;
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) {
      H[i * D + j] = 0.5 * (GW[i * D + j] + GW[j * D + i]);
      Ut[i * D + j] = U[j * D + i];
    }
  dmm_nn(H, D, U, D, T, D, D, D, D);   // T = sym(GW) U
  dmm_nn(Ut, D, T, D, H, D, D, D, D);  // H = U^T sym(GW) U
  for (int i = 0; i < D; ++i)
    for (int j = 0; j < D; ++j) H[i * D + j] *= dbn_inv_sqrt_divdiff(l[i], l[j]);
  dmm_nn(U, D, H, D, T, D, D, D, D);   // T = U H
  dmm_nn(T, D, Ut, D, B, D, D, D, D);  // B = T U^T
  const double two_over_m = 2.0 / m;
  for (int i = 0; i < D; ++i)
    for (int j = i; j < D; ++j) {
      const double b = 0.5 * (B[i * D + j] + B[j * D + i]) * two_over_m;
      B[i * D + j] = B[j * D + i] = b;
    }
  for (int i = 0; i < D; ++i)
    for (int k = 0; k < D; ++k) V[i * D + k] = U[i * D + k] / std::sqrt(l[k]);
  dmm_nn(V, D, Ut, D, W, D, D, D, D);  // W = U diag(l^-1/2) U^T
  for (int i = 0; i < D; ++i)
    for (int j = i + 1; j < D; ++j) W[i * D + j] = W[j * D + i] = 0.5 * (W[i * D + j] + W[j * D + i]);
}

}  // namespace dbn_small
}  // namespace gn_mx
