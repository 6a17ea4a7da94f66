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
 * Handles are distinct and remember their stream; fake_cusolver_stats() reports how many were
 * created, how often one was re-bound to another stream, and calls on a handle not created here
 * (cusolver_loader.cu keeps one handle per (device, stream): tests/test_adapter_emu.py).
 */
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "kernels/dbn_math.h"

namespace {
struct FakeHandle {
  void* stream = nullptr;
  bool bound = false;
};
std::mutex g_mu;
std::vector<FakeHandle*> g_handles;
int g_rebinds = 0, g_bad_calls = 0;

bool known(void* h) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (FakeHandle* f : g_handles)
    if (f == h) return true;
  ++g_bad_calls;
  return false;
}
}  // namespace

extern "C" {

int cusolverDnCreate(void** h) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_handles.push_back(new FakeHandle);  // kept: handles live for the process
  *h = g_handles.back();
  return 0;
}

int cusolverDnSetStream(void* h, void* stream) {
  if (!known(h)) return 1;  // CUSOLVER_STATUS_NOT_INITIALIZED
  std::lock_guard<std::mutex> lock(g_mu);
  FakeHandle* f = static_cast<FakeHandle*>(h);
  if (f->bound && f->stream != stream) ++g_rebinds;
  f->stream = stream;
  f->bound = true;
  return 0;
}

void fake_cusolver_stats(int* handles, int* rebinds, int* bad_calls) {
  std::lock_guard<std::mutex> lock(g_mu);
  *handles = static_cast<int>(g_handles.size());
  *rebinds = g_rebinds;
  *bad_calls = g_bad_calls;
}

int cusolverDnDsyevd_bufferSize(void* h, int jobz, int, int n, const double*, int lda, const double*,
                                int* lwork) {
  if (!known(h)) return 1;
  if (jobz != 1 || n < 0 || lda < n) return 3;  // CUSOLVER_STATUS_INVALID_VALUE
  *lwork = 2 * n * n + 7;
  return 0;
}

int cusolverDnDsyevd(void* h, int jobz, int uplo, int n, double* A, int lda, double* W, double* work,
                     int lwork, int* info) {
  if (!known(h)) return 1;
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
