/*
 * welford.h: mergeable (count, mean, M2) moment state, host and device.
 *
 * Variance is never formed as E[x^2] - E[x]^2: partial results (per chunk, per thread, per warp,
 * per block) are each exact-centred and merged with Chan et al.'s pairwise update
 *   delta = mean_b - mean_a;  n = n_a + n_b
 *   mean  = mean_a + delta * n_b / n;  M2 = M2_a + M2_b + delta^2 * n_a * n_b / n
 * which keeps fp32 accurate for data with |mean| >> std (x = 1000 + unit noise).
 */
#pragma once
#include "acc_type.h"

namespace gn_mx {

template <typename AccT_>
struct Welford {
  AccT_ mean = 0;
  AccT_ m2 = 0;
  AccT_ count = 0;   // kept in AccT so merges need no int->float conversions on device

  GN_INLINE void push(AccT_ x) {
    count += 1;
    const AccT_ delta = x - mean;
    mean += delta / count;
    m2 += delta * (x - mean);
  }

  GN_INLINE void merge(const Welford& o) {
    if (o.count == 0) return;
    if (count == 0) { *this = o; return; }
    const AccT_ n = count + o.count;
    const AccT_ delta = o.mean - mean;
    const AccT_ wb = o.count / n;
    mean += delta * wb;
    m2 += o.m2 + delta * delta * count * wb;
    count = n;
  }

  // Population variance (divide by count), as the API specifies.
  GN_INLINE AccT_ var() const { return count > 0 ? m2 / count : AccT_(0); }
};

// Build a state from a chunk's exact (count, mean, M2).
template <typename AccT_>
GN_INLINE Welford<AccT_> make_welford(AccT_ count, AccT_ mean, AccT_ m2) {
  Welford<AccT_> w;
  w.count = count;
  w.mean = mean;
  w.m2 = m2;
  return w;
}

}  // namespace gn_mx
