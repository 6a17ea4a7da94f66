/*
 * cusolver_loader.h: cuSOLVER's dense symmetric eigensolver (cusolverDnDsyevd), loaded at run time on
 * first use, never a link-time dependency of gn_mx (as dbn_blas_cpu.cc finds OpenBLAS). The DBN CUDA
 * forward calls it for group sizes too large for its shared-memory Jacobi (dbn_cuda.cu).
 *
 * Where the library comes from: GNMX_CUSOLVER_LIBRARY=<path or soname> if set (only that one);
 * else a copy already in the process (RTLD_NOLOAD: mxnet-cu112's libmxnet.so links
 * libcusolver.so.11), else dlopen of libcusolver.so.11, libcusolver.so.12, libcusolver.so in that
 * order. No CUDA headers: the few cuSOLVER types are declared here by value (int enums, opaque
 * handle), so the file builds with any toolkit and under the CPU emulator (tests/gpu/emu, whose
 * fake_cusolver.cc stands in for the library).
 * Handles: one per (device, stream), created and bound to its stream on first use, kept for the
 * process (never destroyed: a handle destroyed at exit may outlive the driver); calls on a handle
 * hold its lock, so ops on different streams (MXNet's GPU worker threads) run concurrently and
 * never share a handle.
 */
#pragma once
#include <cstddef>

namespace gn_mx {

// The one text of "cuSOLVER could not be loaded" (the dlopen errors and what to do), thread-local
// storage; the adapter adds the op name.
const char* cusolver_missing_message(const char* detail);

// Doubles of workspace cusolverDnDsyevd needs for one n x n matrix (eigenvectors wanted), on the
// current device; nullptr or the error (library missing, CUDA/cuSOLVER failure).
const char* cusolver_syevd_lwork(int n, int* lwork);

// For each of `count` n x n symmetric matrices a + k*stride (device, column-major = row-major:
// symmetric): eigenvalues ascending into w + k*n, orthonormal eigenvectors into the matrix (column
// j = eigenvector j in column-major, i.e. row j of the row-major view), cuSOLVER's info into
// info[k] (0: success); all enqueued on `stream`, one call per matrix, `work` (lwork doubles, from
// cusolver_syevd_lwork) reused in stream order. nullptr or the error.
const char* cusolver_syevd_batch(void* stream, double* a, long long stride, int n, int count,
                                 double* w, int* info, double* work, int lwork);

}  // namespace gn_mx
