/*
 * group_norm_grad2_math.h: the per-group / per-element formulas of gn_group_norm's double backward
 * (derivation in group_norm_grad2.h), shared by the CPU and CUDA twins (GN_INLINE: host and device).
 */
#pragma once
#include "group_norm_math.h"

namespace gn_mx {

// act'(z) and act''(z) of the fused activation (relu'' = 0 almost everywhere).
template <Act ACT, typename A>
GN_INLINE A gn_act_d1(A z) {
  return gn_act_grad<ACT>(z, A(1));
}
template <Act ACT, typename A>
GN_INLINE A gn_act_d2(A z) {
  if (ACT == Act::kSilu) {
    const A s = gn_sigmoid(z);
    return s * (A(1) - s) * (A(2) + z * (A(1) - A(2) * s));
  }
  return A(0);
}

// Sums of the first pass over one group: per channel gxg = sum Gx g, dsc = sum g u, db = sum g;
// per group P = sum Gx u, Q = sum Gx, sa = sum gamma dsc, sb = sum gamma db,
// t1 = sum gamma gxg + Ggamma dsc.
template <typename A>
struct Grad2Sums {
  A P = 0, Q = 0, sa = 0, sb = 0, t1 = 0;
};

template <typename A>
struct Grad2Coeffs {
  A c2, c3, e2, e3;
};

template <typename A>
GN_INLINE Grad2Coeffs<A> gn_grad2_coeffs(const Grad2Sums<A>& s, A r, A inv_m, A dmean_o,
                                         A drstd_o) {
  const A r3 = r * r * r;
  Grad2Coeffs<A> k;
  k.c2 = -(s.sa + drstd_o) * r3 * inv_m;
  k.c3 = (dmean_o - s.sb * r) * inv_m;
  k.e2 = -s.P * r3 * inv_m;
  k.e3 = -s.Q * r * inv_m;
  return k;
}

// d r of the group, given the second pass's shug = sum h u gamma.
template <typename A>
GN_INLINE A gn_grad2_drstd(const Grad2Sums<A>& s, A r, A inv_m, A drstd_o, A shug) {
  return s.t1 - A(3) * (s.sa + drstd_o) * r * r * s.P * inv_m - s.sb * s.Q * inv_m + shug;
}

// Second pass, one element: u = x - mu, ap = act'(z), app = act''(z); gam/ggam/gbet the channel's
// gamma and incoming dgamma/dbeta gradients. Writes d dy, d x and h.
template <typename A>
GN_INLINE void gn_grad2_elem(const Grad2Coeffs<A>& k, A r, A u, A dy, A ap, A app, A gx, A gam,
                             A ggam, A gbet, A* ddy, A* dx, A* h) {
  const A g = dy * ap;
  const A lg = gam * (r * gx + k.e2 * u + k.e3) + r * ggam * u + gbet;
  *ddy = lg * ap;
  *h = lg * dy * app;
  *dx = k.c2 * gx + g * (k.e2 * gam + r * ggam) + *h * r * gam;
}

}  // namespace gn_mx
