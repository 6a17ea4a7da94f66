/*
 * dbn_eigen_cpu.h: the DBN CPU eigensolver (dbn_eigen_cpu.cc): cyclic Jacobi (dbn_math.h) for
 * D <= kJacobiMaxD, Householder + implicit QL (dbn_small_cpu.h) above, LAPACK dsyevd and Jacobi
 * as fallbacks. Private to the DBN CPU kernels.
 */
#pragma once
#include <cstddef>
#include <cstdint>

namespace gn_mx {
namespace dbn_cpu {

// ---- Eigendecomposition -----------------------------------------------------------------------
struct EigScratch {
  double* a;      // D*D
  double* work;   // lwork
  int* iwork;     // liwork
  int lwork, liwork;
};

inline size_t eig_lwork(int64_t D) {  // dsyevd's lwork; also >= dbn_small::eigh_ql_work(D)
  return 1 + 6 * D + 2 * D * D;
}
inline size_t eig_liwork(int64_t D) { return 3 + 5 * D; }

// Sigma (row-major, symmetric, finite) -> U (row-major, columns = eigenvectors), l ascending.
void eigh(const double* Sigma, int D, double* U, double* l, const EigScratch& s);

}  // namespace dbn_cpu
}  // namespace gn_mx
