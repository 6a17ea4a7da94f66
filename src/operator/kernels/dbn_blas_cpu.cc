/*
 * dbn_blas_cpu.cc: finds OpenBLAS at run time for the DBN CPU kernels (see dbn_blas_cpu.h).
 */
#include "dbn_blas_cpu.h"

#include <dlfcn.h>

namespace gn_mx {
namespace dbn_cpu {

const Blas& blas() {
  static const Blas b = [] {
    Blas r;
    void* h = dlopen("libopenblas.so.0", RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen("libopenblas.so.0", RTLD_LAZY);
    if (!h) return r;
    r.sgemm = reinterpret_cast<sgemm_t>(dlsym(h, "sgemm_"));
    r.dgemm = reinterpret_cast<dgemm_t>(dlsym(h, "dgemm_"));
    r.ssyrk = reinterpret_cast<ssyrk_t>(dlsym(h, "ssyrk_"));
    r.dsyrk = reinterpret_cast<dsyrk_t>(dlsym(h, "dsyrk_"));
    r.dsyevd = reinterpret_cast<dsyevd_t>(dlsym(h, "dsyevd_"));
    return r;  // the handle stays open for the life of the process
  }();
  return b;
}

}  // namespace dbn_cpu
}  // namespace gn_mx
