/*
 * fake_cusolver.cc: a stand-in for libcusolver under the CPU emulator (device memory is host
 * memory there), so that the DBN forward's cuSOLVER path (dbn_cuda.cu: Sigma into the workspace,
 * cusolverDnDsyevd per group through cusolver_loader.cu, the eigenpairs back) runs in the tests:
 * point GNMX_CUSOLVER_LIBRARY at the libfake_cusolver.so that build_emu.py builds.
 * cusolverDnDsyevd here follows the real contract for jobz = vectors: reads the `uplo` triangle of
 * the column-major n x n matrix, returns ascending eigenvalues in W and orthonormal eigenvectors in
 * the columns of A, info = 0; it fills its whole workspace with NaN first (a workspace that
 * overlaps other data shows up as NaN in the tests). The eigensolver is dbn_math.h's serial
 * Jacobi (the CPU's, not the device Jacobi the other paths use).
 * GNMX_FAKE_CUSOLVER_INFO=<k>: every call reports info = k (a failed decomposition).
 */
#include <cmath>
#include <cstdlib>
#include <vector>

#include "kernels/dbn_math.h"

extern "C" {

int cusolverDnCreate(void** h) {
  static int token;
  *h = &token;
  return 0;
}

int cusolverDnSetStream(void*, void*) { return 0; }

int cusolverDnDsyevd_bufferSize(void*, int jobz, int, int n, const double*, int lda, const double*,
                                int* lwork) {
  if (jobz != 1 || n < 0 || lda < n) return 3;  // CUSOLVER_STATUS_INVALID_VALUE
  *lwork = 2 * n * n + 7;
  return 0;
}

int cusolverDnDsyevd(void*, int jobz, int uplo, int n, double* A, int lda, double* W, double* work,
                     int lwork, int* info) {
  if (jobz != 1 || n < 0 || lda < n || lwork < 2 * n * n + 7) return 3;
  for (int i = 0; i < lwork; ++i) work[i] = std::nan("");
  std::vector<double> a(size_t(n) * n), u(size_t(n) * n);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < n; ++i) {
      const bool in_tri = uplo == 0 ? i >= j : i <= j;  // CUBLAS_FILL_MODE_LOWER = 0
      const double v = in_tri ? A[i + size_t(j) * lda] : A[j + size_t(i) * lda];
      a[size_t(i) * n + j] = v;
    }
  gn_mx::dbn_jacobi_eigh(a.data(), u.data(), W, n);
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < n; ++i) A[i + size_t(j) * lda] = u[size_t(i) * n + j];
  const char* e = std::getenv("GNMX_FAKE_CUSOLVER_INFO");
  *info = e ? std::atoi(e) : 0;
  return 0;
}

}  // extern "C"
