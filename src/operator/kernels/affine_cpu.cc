/*
 * affine_cpu.cc: CPU per-channel affine (see affine.h) on the runtime-dispatched primitives of
 * simd_cpu.h. Rows (n, c) are contiguous runs of S elements. The forward splits over all N*C rows;
 * the backward splits over channels, so each thread owns its dgamma/dbeta sums (no workspace, no
 * atomics) and writes dx = gamma * dy in the same pass (from dy alone: a NaN/Inf in x stays out
 * of dx, as in the CUDA twin).
 */
#include "affine.h"

#include "dispatch_cpu.h"
#include "simd_cpu.h"

namespace gn_mx {
namespace {

template <typename T, typename P>
struct AffineFwd {
  static void run(const AffineArgs& a) {
    using A = AccT<T>;
    const auto& p = simd::prims<T>();
    const T* x = static_cast<const T*>(a.x);
    const P* gamma = static_cast<const P*>(a.gamma);
    const P* beta = static_cast<const P*>(a.beta);
    T* y = static_cast<T*>(a.y);
    const int64_t C = a.dims.C, S = a.dims.S, rows = a.dims.N * C;
#pragma omp parallel for schedule(static) if (rows * S > 32768)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = r % C;
      p.affine(x + r * S, y + r * S, S, static_cast<A>(to_acc(gamma[c])),
               static_cast<A>(to_acc(beta[c])));
    }
  }
};

template <typename T, typename P>
struct AffineBwd {
  static void run(const AffineBwdArgs& a) {
    using A = AccT<T>;
    const auto& p = simd::prims<T>();
    const T* dy = static_cast<const T*>(a.dy);
    const T* x = static_cast<const T*>(a.x);
    const P* gamma = static_cast<const P*>(a.gamma);
    T* dx = static_cast<T*>(a.dx);
    P* dgamma = static_cast<P*>(a.dgamma);
    P* dbeta = static_cast<P*>(a.dbeta);
    const int64_t N = a.dims.N, C = a.dims.C, S = a.dims.S;
#pragma omp parallel for schedule(static) if (N * C * S > 32768)
    for (int64_t c = 0; c < C; ++c) {
      const A g = static_cast<A>(to_acc(gamma[c]));
      A sg = 0, sb = 0;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t off = (n * C + c) * S;
        p.bwd_sums(x + off, dy + off, S, A(0), &sg, &sb);
        p.affine(dy + off, dx + off, S, g, A(0));  // dx = gamma * dy: x must not reach dx
      }
      if (dgamma) dgamma[c] = from_acc<P>(sg);
      if (dbeta) dbeta[c] = from_acc<P>(sb);
    }
  }
};

}  // namespace

const char* affine_fwd_cpu(const AffineArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return cpu::dispatch_data_param<AffineFwd>(a);
}

const char* affine_bwd_cpu(const AffineBwdArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return cpu::dispatch_data_param<AffineBwd>(a);
}

}  // namespace gn_mx
