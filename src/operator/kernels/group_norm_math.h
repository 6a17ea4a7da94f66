/*
 * group_norm_math.h: the per-group / per-channel GroupNorm formulas, shared by the CPU and CUDA
 * kernels (GN_INLINE: host and device). Loops differ between the twins; these formulas may not.
 *
 * Forward (per group n,g with mean mu and rstd r; per channel c):
 *   r = 1 / sqrt(var + eps);   a_c = r * gamma_c;   b_c = beta_c - a_c * mu;   y = x * a_c + b_c
 * Backward, with m = D*S, per-(n,c) sums dsc_c = sum_s dy (x - mu), db_c = sum_s dy and per group
 *   A = sum_c gamma_c dsc_c,  B = sum_c gamma_c db_c:
 *   dx = c1_c dy + c2 (x - mu) + c3,  c1_c = r gamma_c,  c2 = -A r^3 / m,  c3 = -B r / m
 * plus the gradients arriving at the mean/rstd outputs (d mean/dx = 1/m,
 * d rstd/dx = -r^3 (x - mu) / m): c3 += dmean / m, c2 -= drstd r^3 / m.
 *   dgamma_c = sum_n dsc_c r,  dbeta_c = sum_n db_c.
 * Moments backward (mean, population var): dx = dmean / m + 2 dvar / m (x - mu).
 * Products are centred at the mean (dsc, not sum dy x) so |mean| >> std loses no precision.
 *
 * Fused activation (act_type): out = act(z), z = x * a_c + b_c. Backward first turns the incoming
 * gradient into the pre-activation gradient g = dy * act'(z) (z recomputed with the forward's
 * coefficients) and then applies the formulas above with g in place of dy.
 *   relu(z) = z > 0 ? z : 0,  relu'(z) = z > 0 ? 1 : 0   (0 at z = 0, as MXNet's relu)
 *   silu(z) = z * s,  s = sigmoid(z) = 1 / (1 + exp(-z)),  silu'(z) = s * (1 + z * (1 - s))
 *
 * Exactly recomputed groups (gn_exact_group; both twins, forward and backward): scalar float64
 * statistics around the group's first element x0 (x - x0 is exact for nearby values),
 *   d = mean - x0 = sum (x - x0) / m,  xc = (x - x0) - d,  r = 1 / sqrt(sum xc^2 / m + eps),
 *   y = act((xc r) gamma_c + beta_c),  dx = r gamma_c g + c2 xc + c3 (the formulas above in float64,
 *   c2 / c3 from sum gamma_c g xc and sum gamma_c g), dx = dmean for a one-element group.
 * Which groups: see gn_exact_group.
 */
#pragma once
#include <cmath>
#include <type_traits>

#include "../common/acc_type.h"
#include "group_norm.h"

namespace gn_mx {

GN_INLINE float gn_sqrt(float v) {
#if defined(__CUDA_ARCH__)
  return sqrtf(v);
#else
  return std::sqrt(v);
#endif
}
GN_INLINE double gn_sqrt(double v) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(v);
#else
  return std::sqrt(v);
#endif
}

GN_INLINE float gn_exp(float v) {
#if defined(__CUDA_ARCH__)
  return expf(v);
#else
  return std::exp(v);
#endif
}
GN_INLINE double gn_exp(double v) {
#if defined(__CUDA_ARCH__)
  return ::exp(v);
#else
  return std::exp(v);
#endif
}

// Calls f(std::integral_constant<Act, ACT>{}) for the activation (host side of both twins); kernels
// take the activation as a template parameter `Act ACT`.
template <typename F>
inline void dispatch_act(Act act, F&& f) {
  switch (act) {
    case Act::kRelu: f(std::integral_constant<Act, Act::kRelu>{}); return;
    case Act::kSilu: f(std::integral_constant<Act, Act::kSilu>{}); return;
    default: f(std::integral_constant<Act, Act::kNone>{}); return;
  }
}

template <typename A>
GN_INLINE A gn_sigmoid(A z) {
  return A(1) / (A(1) + gn_exp(-z));
}

template <Act ACT, typename A>
GN_INLINE A gn_act(A z) {
  if (ACT == Act::kRelu) return z > A(0) ? z : A(0);
  if (ACT == Act::kSilu) return z * gn_sigmoid(z);
  return z;
}

// g = dy * act'(z).
template <Act ACT, typename A>
GN_INLINE A gn_act_grad(A z, A dy) {
  if (ACT == Act::kRelu) return z > A(0) ? dy : A(0);
  if (ACT == Act::kSilu) {
    const A s = gn_sigmoid(z);
    return dy * (s * (A(1) + z * (A(1) - s)));
  }
  return dy;
}

template <typename A>
GN_INLINE A gn_rstd(A var, A eps) {
  return A(1) / gn_sqrt(var + eps);
}

// y = x * a + b for channel c of a group with (mu, r).
template <typename A>
GN_INLINE void gn_fwd_coeffs(A mu, A r, A gamma_c, A beta_c, A* a, A* b) {
  *a = r * gamma_c;
  *b = beta_c - *a * mu;
}

// Per-group backward coefficients c2, c3 (see header). dmean_o / drstd_o are the incoming gradients of
// the mean / rstd outputs (0 when absent).
template <typename A>
GN_INLINE void gn_bwd_coeffs(A sum_a, A sum_b, A r, A inv_m, A dmean_o, A drstd_o, A* c2, A* c3) {
  const A r3 = r * r * r;
  *c2 = -sum_a * r3 * inv_m - drstd_o * r3 * inv_m;
  *c3 = -sum_b * r * inv_m + dmean_o * inv_m;
}

template <typename A>
GN_INLINE A gn_bwd_dx(A c1, A c2, A c3, A mu, A dy, A x) {
  return c1 * dy + c2 * (x - mu) + c3;
}

GN_INLINE bool gn_isfinite(float v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}
GN_INLINE bool gn_isfinite(double v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

// Groups that both twins recompute in float64 (see the header), decided from the group's
// accumulation-dtype statistics (mean, rstd = 1/sqrt(var + eps)) and size m:
//   - m <= kGnExactGroup: one-element groups are then exact (x - mean = 0: out = act(beta),
//     dx = dmean) and 2-4 element groups at any |mean| >> spread are within float32 rounding of the
//     float64 result (the fp32 mean alone is off by up to ulp(mean)/2, all of the spread at offset
//     300 with spread 1e-3);
//   - float32/float16 data only (float64 statistics are kept):
//       statistics that overflowed (sum or sum of squares inf: mean non-finite or rstd = 0, which
//       would silently output beta) or NaN/Inf in the group (the result stays NaN, confined to it);
//       rstd < kGnExactMinRstd (var > 1e24): backward's rstd^3 would underflow in float32;
//       |mean| rstd > kGnExactMaxOffset: x * (rstd gamma) + (beta - mean rstd gamma) in float32
//       cancels every digit (and a fp32-overflowed group recomputed to a moderate rstd, e.g. a
//       constant group at 3e38, lands here, so a decision re-made from saved statistics agrees).
// The CUDA kernels re-make the decision from saved statistics in later kernels; the listed
// conditions are chosen so that the recomputed statistics of a group still select it.
constexpr int64_t kGnExactGroup = 4;
constexpr double kGnExactMinRstd = 1e-12;
constexpr double kGnExactMaxOffset = 16777216.0;  // 2^24: float32's 24-bit significand

// The float32 test is one expression of three compares (no branches, no isfinite calls): NaN
// compares false (NaN mean or rstd: exact); |mean| = inf gives inf > 2^24 (rstd >= 1e-12 > 0);
// rstd = inf fails rstd <= FLT_MAX; rstd = 0 fails rstd >= 1e-12. The same truth table as the
// conditions listed above.
template <typename T, typename A>
GN_INLINE bool gn_exact_group(A mean, A rstd, int64_t m) {
  if (m <= kGnExactGroup) return true;
  if (std::is_same<T, double>::value) return false;
  const A am = mean < A(0) ? -mean : mean;
  const bool ordinary = (rstd >= A(kGnExactMinRstd)) & (rstd <= A(3.4028234663852886e38)) &
                        (am * rstd <= A(kGnExactMaxOffset));
  return !ordinary;
}

// gn_moments' groups recomputed in float64 on both devices (its outputs are mean and var, no rstd):
// m <= kGnExactGroup, and for float32/float16 data a non-finite mean or variance (overflowed
// statistics: the mean is then right and the variance, beyond float32, inf; or NaN/Inf in the
// group, which stays confined to it).
template <typename T, typename A>
GN_INLINE bool gn_exact_moments(A mean, A var, int64_t m) {
  if (m <= kGnExactGroup) return true;
  if (std::is_same<T, double>::value) return false;
  return !(gn_isfinite(mean) && gn_isfinite(var));
}

// The exact path's per-element forms (float64): centred value and pre-activation. `s` scales xc
// to xhat: rstd, except 0 for a one-element group (x - mean = 0 for every x, so xhat = 0 exactly,
// also with eps = 0 where rstd = inf and 0 * inf would be NaN; larger constant groups with eps = 0
// stay NaN, as the formula says).
GN_INLINE double gn_exact_xc(double x, double x0, double d) { return (x - x0) - d; }
GN_INLINE double gn_exact_xhat_scale(double rstd, int64_t m) { return m == 1 ? 0.0 : rstd; }
GN_INLINE double gn_exact_z(double xc, double s, double gamma_c, double beta_c) {
  return (xc * s) * gamma_c + beta_c;
}

// Moments backward: dx = c0 + c1 (x - mu), c0 = dmean / m, c1 = 2 dvar / m.
template <typename A>
GN_INLINE void gn_moments_bwd_coeffs(A dmean, A dvar, A inv_m, A* c0, A* c1) {
  *c0 = dmean * inv_m;
  *c1 = A(2) * dvar * inv_m;
}

}  // namespace gn_mx
