/*
 * dbn_eigen_cpu.cc: the DBN CPU eigensolver dispatch (see dbn_eigen_cpu.h).
 */
#include "dbn_eigen_cpu.h"

#include <cstring>

#include "dbn_blas_cpu.h"
#include "dbn_math.h"
#include "dbn_small_cpu.h"

namespace gn_mx {
namespace dbn_cpu {

constexpr int kJacobiMaxD = 8;          // eigh: Jacobi up to this group size, eigh_ql above

void eigh(const double* Sigma, int D, double* U, double* l, const EigScratch& s) {
  if (D == 1) {
    U[0] = 1.0;
    l[0] = Sigma[0];
    return;
  }
  // NB: for tiny matrices a few Jacobi sweeps beat dsyevd's setup (measured: 1 us vs 11 us at
  // D = 4, equal at D = 16, 6x slower at D = 64), and groups of 2-8 channels come in large numbers.
  // Above that, dbn_small::eigh_ql (Householder + implicit QL, vectorized) beats OpenBLAS's
  // dsyevd (measured at D = 16 / 32 / 64 / 128: 11 / 43 / 206 / 1400 us against 65 / 210 / 560 /
  // 2200 us on a Zen 4); dsyevd and Jacobi remain as fallbacks should it not converge.
  if (D > kJacobiMaxD && dbn_small::eigh_ql(Sigma, D, U, l, s.work)) return;
  if (blas().dsyevd && D > kJacobiMaxD) {
    std::memcpy(s.a, Sigma, sizeof(double) * D * D);
    int info = 0;
    blas().dsyevd("V", "U", &D, s.a, &D, l, s.work, &s.lwork, s.iwork, &s.liwork, &info, 1, 1);
    if (info == 0) {
      for (int i = 0; i < D; ++i)
        for (int j = 0; j < D; ++j) U[i * D + j] = s.a[i + j * D];  // column-major -> row-major
      return;
    }
  }
  std::memcpy(s.a, Sigma, sizeof(double) * D * D);
  dbn_jacobi_eigh(s.a, U, l, D);
}

}  // namespace dbn_cpu
}  // namespace gn_mx
