/*
 * dbn_blas_cpu.h: the BLAS / LAPACK the DBN CPU kernels use, found at run time (dbn_blas_cpu.cc),
 * and the column-major gemm / syrk wrappers with naive fallbacks. Private to the DBN CPU kernels.
 */
#pragma once
#include <cstddef>

// Fortran BLAS/LAPACK prototypes. gfortran passes the lengths of CHARACTER arguments as trailing
// hidden size_t arguments; LAPACK (compiled Fortran) gets them explicitly.
extern "C" {
typedef void (*sgemm_t)(const char*, const char*, const int*, const int*, const int*, const float*,
                        const float*, const int*, const float*, const int*, const float*, float*,
                        const int*);
typedef void (*dgemm_t)(const char*, const char*, const int*, const int*, const int*,
                        const double*, const double*, const int*, const double*, const int*,
                        const double*, double*, const int*);
typedef void (*ssyrk_t)(const char*, const char*, const int*, const int*, const float*,
                        const float*, const int*, const float*, float*, const int*);
typedef void (*dsyrk_t)(const char*, const char*, const int*, const int*, const double*,
                        const double*, const int*, const double*, double*, const int*);
typedef void (*dsyevd_t)(const char* jobz, const char* uplo, const int* n, double* a,
                         const int* lda, double* w, double* work, const int* lwork, int* iwork,
                         const int* liwork, int* info, size_t jobz_len, size_t uplo_len);
}
namespace gn_mx {
namespace dbn_cpu {

// BLAS/LAPACK entry points, resolved once. libgn_mx.so does not have to link OpenBLAS: in an
// MXNet process the wheel's libopenblas.so.0 is already loaded (by libmxnet.so, RTLD_LOCAL), and
// dlopen(RTLD_NOLOAD) finds it by soname without loading anything new. Outside MXNet (a plain
// kernel test) the same soname is tried on the normal search path. Missing symbols fall back to
// a naive gemm/syrk and the Jacobi eigensolver, which are correct but slow.
struct Blas {
  sgemm_t sgemm = nullptr;
  dgemm_t dgemm = nullptr;
  ssyrk_t ssyrk = nullptr;
  dsyrk_t dsyrk = nullptr;
  dsyevd_t dsyevd = nullptr;
};
const Blas& blas();

// ---- BLAS wrappers (column-major), with naive fallbacks -------------------------------------
template <typename A>
void gemm_naive(char ta, char tb, int m, int n, int k, A alpha, const A* a, int lda, const A* b,
                int ldb, A beta, A* c, int ldc) {
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < m; ++i) {
      A s = 0;
      for (int p = 0; p < k; ++p) {
        const A av = ta == 'N' ? a[i + p * lda] : a[p + i * lda];
        const A bv = tb == 'N' ? b[p + j * ldb] : b[j + p * ldb];
        s += av * bv;
      }
      c[i + j * ldc] = alpha * s + (beta == A(0) ? A(0) : beta * c[i + j * ldc]);
    }
}

inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (blas().sgemm) blas().sgemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
  else gemm_naive(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  if (blas().dgemm) blas().dgemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
  else gemm_naive(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
// Upper triangle (column-major) of C = A^T A, A is k x n with leading dimension lda.
inline void syrk_t(int n, int k, const float* a, int lda, float* c) {
  const float one = 1.f, zero = 0.f;
  if (blas().ssyrk) blas().ssyrk("U", "T", &n, &k, &one, a, &lda, &zero, c, &n);
  else gemm_naive('T', 'N', n, n, k, one, a, lda, a, lda, zero, c, n);
}
inline void syrk_t(int n, int k, const double* a, int lda, double* c) {
  const double one = 1.0, zero = 0.0;
  if (blas().dsyrk) blas().dsyrk("U", "T", &n, &k, &one, a, &lda, &zero, c, &n);
  else gemm_naive('T', 'N', n, n, k, one, a, lda, a, lda, zero, c, n);
}

}  // namespace dbn_cpu
}  // namespace gn_mx
