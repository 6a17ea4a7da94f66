/*
 * group_norm_cpu.cc: CPU kernels for gn_moments and gn_group_norm (forward and backward).
 *
 * A group of sample n is the contiguous block x[(n*C + g*D)*S ...] of M = D*S elements; the N*G
 * groups are independent. Formulas come from group_norm_math.h (shared with the CUDA twin); the inner
 * loops are the runtime-dispatched primitives of simd_cpu.h (AVX2/FMA/F16C when the CPU has them,
 * portable loops otherwise).
 *
 * Statistics: a group (or a thread's slice of it) is read in chunks of kChunk elements (L1-resident);
 * each chunk's moments are exact around the chunk's own mean (two passes over cached data) and merged
 * with Chan's update (welford.h): one read of x from memory, no E[x^2]-E[x]^2 cancellation.
 *
 * Memory traffic per group: forward reads x for the statistics, then reads it again for y = x*a_c + b_c
 * while it is still in L2 (a group of the benchmark shapes is 25-160 KB), and writes y once. Backward
 * reads x and dy once for the per-(n,c) sums dsc_c = sum dy (x - mu), db_c = sum dy, then again
 * (L2-hot) for dx; dgamma/dbeta come from those per-(n,c) sums, so there is no extra pass over dy.
 *
 * Threads (OpenMP; the team size is omp_get_max_threads(), i.e. OMP_NUM_THREADS or what MXNet sets):
 *   - per-group: the N*G groups are split statically over the team (used when they divide evenly or
 *     are many);
 *   - cooperative: when N*G is smaller than the team, or few and uneven, every thread takes the same
 *     contiguous slice of each group in both passes (so its second read stays in its own cache); the
 *     partial Welford states / per-channel sums are combined after one barrier per group, in a fixed
 *     order, so every thread derives identical coefficients.
 *   - tiny inputs (< kMinParallel elements) run on the calling thread: a fork costs more than the work.
 * Small spatial sizes (S < kSmallS, e.g. (N, C) data) go through short AccT buffers with per-element
 * channel coefficients instead of one primitive call per channel.
 *
 * Exactly recomputed groups (exact_fwd / exact_bwd: scalar, float64, moments around the group's
 * first element, so x - x0 is exact for nearby values):
 *   - tiny groups (M <= kTinyGroup elements, e.g. (N, C) data with num_groups = C or C/2): a
 *     one-element group outputs exactly act(beta) with dx = dmean (x - mean = 0), and 2-4 element
 *     groups with |mean| >> spread are within float32 rounding of the float64 result;
 *   - float32/float16 groups whose fp32 statistics overflow (|x| ~ 1e19 .. 3e38: sum or sum of
 *     squares is inf, so var = inf and rstd = 0 would silently output beta) and, in backward, groups
 *     with rstd < kMinRstd (rstd^3 would underflow in fp32).
 *   Backward of these groups recomputes the statistics from x (the fp32 mean is rounded), so it
 *   also needs eps. The common path pays one compare per group.
 * Fused activation (act_type): the primitives' act_* tables; the forward writes act(z), the backward
 * recomputes z = x * a_c + b_c and g = dy * act'(z) in registers in both of its passes.
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "group_norm.h"
#include "dispatch_cpu.h"
#include "group_norm_math.h"
#include "simd_cpu.h"
#include "../common/threads.h"
#include "../common/welford.h"

namespace gn_mx {
namespace {

constexpr int64_t kChunk = 2048;           // elements per exact moments chunk
constexpr int64_t kSmallS = 16;            // spatial sizes below this take the buffered path
constexpr int64_t kBuf = 512;              // AccT buffer length of the buffered path
constexpr int64_t kMinParallel = 1 << 14;  // fewer elements than this: no OpenMP fork
constexpr int64_t kMinCoopGroup = 1 << 13; // smallest group that threads share
constexpr int64_t kSliceAlign = 64;        // slice boundaries (elements) of a shared group
constexpr int64_t kTinyGroup = 4;          // groups of at most this many elements: exact path
constexpr double kMinRstd = 1e-12;         // backward: smaller rstd (var > 1e24) takes the exact path
// Outputs of at least this many bytes are written with streaming stores: they cannot stay in cache
// anyway, and streaming saves the read-for-ownership of every output line (1/3 of the traffic).
// Forward keeps y cached up to 8 MB (the next layer reads it; x + y fit a typical L3); backward's
// working set is three tensors (x, dy, dx), so it streams dx from 4 MB. Measured on a Zen 4 with a
// 32 MB L3: 8x256x28x28 fp32 backward 1.07 -> 0.50 ms with streaming, its forward 0.33 -> 0.43 ms.
constexpr int64_t kStreamBytesFwd = int64_t(8) << 20;
constexpr int64_t kStreamBytesBwd = int64_t(4) << 20;

bool stream_output(int64_t elems, size_t elem_size, int64_t threshold) {
  return elems * static_cast<int64_t>(elem_size) >= threshold;
}

using threads::barrier;
using threads::num_threads;
using threads::team_size;
using threads::thread_id;

struct Plan {
  int nt = 1;         // threads to request
  bool coop = false;  // threads share each group
};

Plan make_plan(int64_t NG, int64_t M) {
  Plan p;
  const int nt = team_size();
  if (nt <= 1 || NG * M < kMinParallel) return p;
  p.nt = nt;
  const bool balanced = NG >= nt && (NG % nt == 0 || NG >= 8 * static_cast<int64_t>(nt));
  p.coop = !balanced && M >= kMinCoopGroup;
  // Static schedules only: with schedule(dynamic) inside MXNet (after MXNet's own OpenMP ops ran)
  // a 1.5 MB forward on 2 threads took 12 ms instead of 0.12 ms, the threads spinning in libgomp.
  return p;
}

// [lo, hi) of thread t of T over a group of M elements.
void slice(int64_t M, int t, int T, int64_t* lo, int64_t* hi) {
  int64_t per = (M + T - 1) / T;
  per = (per + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  *lo = std::min(M, per * t);
  *hi = std::min(M, *lo + per);
}

template <typename T>
Welford<AccT<T>> range_moments(const simd::Prims<T>& P, const T* x, int64_t n) {
  using A = AccT<T>;
  Welford<A> w;
  if (n > 0 && n <= kChunk) {  // one chunk: its exact moments are the result
    A cm, m2;
    P.moments(x, n, &cm, &m2);
    return make_welford<A>(static_cast<A>(n), cm, m2);
  }
  for (int64_t off = 0; off < n; off += kChunk) {
    const int64_t len = std::min(kChunk, n - off);
    A cm, m2;
    P.moments(x + off, len, &cm, &m2);
    w.merge(make_welford<A>(static_cast<A>(len), cm, m2));
  }
  return w;
}

// Calls f(d, s0, s1) for each channel d of a group whose elements [s0, s1) intersect [lo, hi).
template <typename F>
inline void for_channel_runs(int64_t lo, int64_t hi, int64_t S, F&& f) {
  if (lo >= hi) return;
  for (int64_t d = lo / S; d * S < hi; ++d) f(d, std::max(lo, d * S), std::min(hi, (d + 1) * S));
}

// Calls f(buf_offset, d) for elements [i0, i0 + len) of a group with channel size S (small S).
template <typename F>
inline void for_elements(int64_t i0, int64_t len, int64_t S, F&& f) {
  if (S == 1) {
    for (int64_t j = 0; j < len; ++j) f(j, i0 + j);
    return;
  }
  int64_t d = i0 / S, s = i0 % S;
  for (int64_t j = 0; j < len; ++j) {
    f(j, d);
    if (++s == S) { s = 0; ++d; }
  }
}

// ------------------------------------------------------------------------------------------------
// Exactly recomputed groups (see the header comment)

// Group statistics in float64 around x0 = xg[0]: *d = mean - x0, *r = rstd.
template <typename T>
void exact_stats(const T* xg, int64_t M, double eps, double* x0, double* d, double* r) {
  *x0 = static_cast<double>(to_acc(xg[0]));
  double s = 0;
  for (int64_t i = 0; i < M; ++i) s += static_cast<double>(to_acc(xg[i])) - *x0;
  *d = s / static_cast<double>(M);
  double q = 0;
  for (int64_t i = 0; i < M; ++i) {
    const double c = (static_cast<double>(to_acc(xg[i])) - *x0) - *d;
    q += c * c;
  }
  *r = 1.0 / std::sqrt(q / static_cast<double>(M) + eps);
}

template <typename T, int ACT>
void exact_fwd(const T* xg, T* yg, int64_t D, int64_t S, double eps, const AccT<T>* gam,
               const AccT<T>* bet, AccT<T>* mean, AccT<T>* rstd) {
  using A = AccT<T>;
  double x0, d, r;
  exact_stats(xg, D * S, eps, &x0, &d, &r);
  *mean = static_cast<A>(x0 + d);
  *rstd = static_cast<A>(r);
  const bool single = D * S == 1;  // xhat = 0 exactly, also for eps = 0 (r = inf, 0 * inf = nan)
  for (int64_t c = 0; c < D; ++c) {
    const double ga = gam[c], be = bet[c];
    for (int64_t s = c * S; s < (c + 1) * S; ++s) {
      const double xc = (static_cast<double>(to_acc(xg[s])) - x0) - d;  // exactly 0 when M == 1
      yg[s] = from_acc<T>(static_cast<A>(gn_act<ACT>((single ? 0.0 : xc * r) * ga + be)));
    }
  }
}

// dx of one group and its per-channel sums dgs[c] = sum g xhat, db[c] = sum g.
template <typename T, int ACT>
void exact_bwd(const T* xg, const T* dyg, T* dxg, int64_t D, int64_t S, double eps,
               const AccT<T>* gam, const AccT<T>* bet, double dmean_o, double drstd_o, AccT<T>* dgs,
               AccT<T>* db) {
  using A = AccT<T>;
  const int64_t M = D * S;
  double x0, d, r;
  exact_stats(xg, M, eps, &x0, &d, &r);
  auto grad = [&](int64_t s, double xc, double ga, double be) {
    const double dy = static_cast<double>(to_acc(dyg[s]));
    return gn_act_grad<ACT>((xc * r) * ga + be, dy);
  };
  if (M == 1) {  // x - mean = 0: out = act(beta), d out/dx = 0; only mean (= x) passes dmean on
    dgs[0] = A(0);
    db[0] = static_cast<A>(grad(0, 0.0, gam[0], bet[0]));
    dxg[0] = from_acc<T>(static_cast<A>(dmean_o));
    return;
  }
  double sa = 0, sb = 0;
  for (int64_t c = 0; c < D; ++c) {
    const double ga = gam[c], be = bet[c];
    double s1 = 0, s2 = 0;
    for (int64_t s = c * S; s < (c + 1) * S; ++s) {
      const double xc = (static_cast<double>(to_acc(xg[s])) - x0) - d;
      const double g = grad(s, xc, ga, be);
      s1 += g * xc;
      s2 += g;
    }
    dgs[c] = static_cast<A>(s1 * r);
    db[c] = static_cast<A>(s2);
    sa += ga * s1;
    sb += ga * s2;
  }
  double c2, c3;
  gn_bwd_coeffs<double>(sa, sb, r, 1.0 / static_cast<double>(M), dmean_o, drstd_o, &c2, &c3);
  for (int64_t c = 0; c < D; ++c) {
    const double ga = gam[c], be = bet[c];
    for (int64_t s = c * S; s < (c + 1) * S; ++s) {
      const double xc = (static_cast<double>(to_acc(xg[s])) - x0) - d;
      dxg[s] = from_acc<T>(static_cast<A>(r * ga * grad(s, xc, ga, be) + c2 * xc + c3));
    }
  }
}

// Forward statistics that overflowed the fp32 accumulators (or any group of a tiny size).
template <typename T>
bool fwd_needs_exact(const Welford<AccT<T>>& w, int64_t M) {
  if (M <= kTinyGroup) return true;
  if (std::is_same<T, double>::value) return false;
  return !(std::isfinite(w.m2) && std::isfinite(w.mean));
}
template <typename T>
bool bwd_needs_exact(AccT<T> r, int64_t M) {
  if (M <= kTinyGroup) return true;
  if (std::is_same<T, double>::value) return false;
  return !(r >= static_cast<AccT<T>>(kMinRstd) && std::isfinite(r));
}

// ------------------------------------------------------------------------------------------------
// Forward

// y[lo, hi) of one group, given its statistics; gam/bet point at the group's D channels (AccT).
template <typename T, int ACT>
void fwd_range(const simd::Prims<T>& P, const T* xg, T* yg, int64_t lo, int64_t hi, int64_t S,
               AccT<T> mu, AccT<T> r, const AccT<T>* gam, const AccT<T>* bet, bool nt) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto affine = P.act_affine[ACT][nt ? 1 : 0];
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t s0, int64_t s1) {
      A a, b;
      gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      affine(xg + s0, yg + s0, s1 - s0, a, b);
    });
    return;
  }
  alignas(64) A buf[kBuf];
  for (int64_t i0 = lo; i0 < hi; i0 += kBuf) {
    const int64_t len = std::min(kBuf, hi - i0);
    P.load(xg + i0, buf, len);
    if (S == 1) {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        A a, b;
        gn_fwd_coeffs<A>(mu, r, gam[i0 + j], bet[i0 + j], &a, &b);
        buf[j] = gn_act<ACT>(buf[j] * a + b);
      }
    } else {
      for_elements(i0, len, S, [&](int64_t j, int64_t d) {
        A a, b;
        gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
        buf[j] = gn_act<ACT>(buf[j] * a + b);
      });
    }
    P.store(buf, yg + i0, len);
  }
}

template <typename T, int ACT>
void fwd_typed(const GroupNormFwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const simd::Prims<T>& P = simd::prims<T>();
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  A* mean = static_cast<A*>(a.mean);
  A* rstd = static_cast<A*>(a.rstd);
  const int64_t G = a.G, D = a.C / a.G, S = a.S, NG = a.N * G, M = D * S;
  const A eps = static_cast<A>(a.eps);
  const Plan pl = make_plan(NG, M);
  const bool nt = stream_output(NG * M, sizeof(T), kStreamBytesFwd);

  if (!pl.coop) {
#pragma omp parallel num_threads(pl.nt) if (pl.nt > 1)
    {
#pragma omp for schedule(static)
      for (int64_t ng = 0; ng < NG; ++ng) {
        const int64_t g = ng % G;
        const T* xg = x + ng * M;
        const Welford<A> w = M <= kTinyGroup ? Welford<A>() : range_moments(P, xg, M);
        if (fwd_needs_exact<T>(w, M)) {
          exact_fwd<T, ACT>(xg, y + ng * M, D, S, a.eps, gam + g * D, bet + g * D, mean + ng,
                            rstd + ng);
          continue;
        }
        const A r = gn_rstd<A>(w.var(), eps);
        mean[ng] = w.mean;
        rstd[ng] = r;
        fwd_range<T, ACT>(P, xg, y + ng * M, 0, M, S, w.mean, r, gam + g * D, bet + g * D, nt);
      }
      if (nt) P.fence();
    }
    return;
  }
  std::vector<Welford<A>> part(2 * static_cast<size_t>(pl.nt));
#pragma omp parallel num_threads(pl.nt)
  {
    const int t = thread_id(), T_ = num_threads();
    int64_t lo, hi;
    slice(M, t, T_, &lo, &hi);
    for (int64_t ng = 0; ng < NG; ++ng) {
      const int64_t g = ng % G;
      const T* xg = x + ng * M;
      Welford<A>* pp = part.data() + (ng & 1) * pl.nt;
      pp[t] = range_moments(P, xg + lo, hi - lo);
      barrier();
      Welford<A> w;
      for (int u = 0; u < T_; ++u) w.merge(pp[u]);
      if (fwd_needs_exact<T>(w, M)) {  // every thread sees the same w: thread 0 does the group
        if (t == 0)
          exact_fwd<T, ACT>(xg, y + ng * M, D, S, a.eps, gam + g * D, bet + g * D, mean + ng,
                            rstd + ng);
        continue;
      }
      const A r = gn_rstd<A>(w.var(), eps);
      if (t == 0) {
        mean[ng] = w.mean;
        rstd[ng] = r;
      }
      fwd_range<T, ACT>(P, xg, y + ng * M, lo, hi, S, w.mean, r, gam + g * D, bet + g * D, nt);
    }
    if (nt) P.fence();
  }
}

// ------------------------------------------------------------------------------------------------
// Moments

template <typename T>
void moments_typed(const MomentsArgs& a) {
  using A = AccT<T>;
  const simd::Prims<T>& P = simd::prims<T>();
  const T* x = static_cast<const T*>(a.x);
  A* mean = static_cast<A*>(a.mean);
  A* var = static_cast<A*>(a.var);
  const int64_t NG = a.N * a.G, M = (a.C / a.G) * a.S;
  const Plan pl = make_plan(NG, M);
  if (!pl.coop) {
#pragma omp parallel for schedule(static) num_threads(pl.nt) if (pl.nt > 1)
    for (int64_t ng = 0; ng < NG; ++ng) {
      const Welford<A> w = range_moments(P, x + ng * M, M);
      mean[ng] = w.mean;
      var[ng] = w.var();
    }
    return;
  }
  std::vector<Welford<A>> part(static_cast<size_t>(pl.nt) * static_cast<size_t>(NG));
#pragma omp parallel num_threads(pl.nt)
  {
    const int t = thread_id(), T_ = num_threads();
    int64_t lo, hi;
    slice(M, t, T_, &lo, &hi);
    for (int64_t ng = 0; ng < NG; ++ng) part[ng * pl.nt + t] = range_moments(P, x + ng * M + lo, hi - lo);
    barrier();
#pragma omp for schedule(static)
    for (int64_t ng = 0; ng < NG; ++ng) {
      Welford<A> w;
      for (int u = 0; u < T_; ++u) w.merge(part[ng * pl.nt + u]);
      mean[ng] = w.mean;
      var[ng] = w.var();
    }
  }
}

template <typename T>
void moments_bwd_typed(const MomentsBwdArgs& a) {
  using A = AccT<T>;
  const simd::Prims<T>& P = simd::prims<T>();
  const T* x = static_cast<const T*>(a.x);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  const A* mean = static_cast<const A*>(a.mean);
  T* dx = static_cast<T*>(a.dx);
  const int64_t NG = a.N * a.G, M = (a.C / a.G) * a.S;
  const A inv_m = A(1) / static_cast<A>(M);
  const Plan pl = make_plan(NG, M);
  // dx = c0 + c1 (x - mu): the dx primitive with a zero dy coefficient (it reads x as dy: cached).
  auto run = [&](int64_t ng, int64_t lo, int64_t hi) {
    A c0, c1;
    gn_moments_bwd_coeffs<A>(dmean[ng], dvar[ng], inv_m, &c0, &c1);
    const T* xp = x + ng * M + lo;
    P.bwd_dx(xp, xp, dx + ng * M + lo, hi - lo, mean[ng], A(0), c1, c0);
  };
  if (!pl.coop) {
#pragma omp parallel for schedule(static) num_threads(pl.nt) if (pl.nt > 1)
    for (int64_t ng = 0; ng < NG; ++ng) run(ng, 0, M);
    return;
  }
#pragma omp parallel num_threads(pl.nt)
  {
    int64_t lo, hi;
    slice(M, thread_id(), num_threads(), &lo, &hi);
    for (int64_t ng = 0; ng < NG; ++ng) run(ng, lo, hi);
  }
}

// ------------------------------------------------------------------------------------------------
// Backward

// s1[d] += sum g (x - mu), s2[d] += sum g over the elements [lo, hi) of one group, g = dy act'(z).
template <typename T, int ACT>
void bwd_sums_range(const simd::Prims<T>& P, const T* xg, const T* dyg, int64_t lo, int64_t hi,
                    int64_t S, AccT<T> mu, AccT<T> r, const AccT<T>* gam, const AccT<T>* bet,
                    AccT<T>* s1, AccT<T>* s2) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto sums = P.act_sums[ACT];
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t a0, int64_t a1) {
      A a = 1, b = 0;
      if (ACT != kActNone) gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      sums(xg + a0, dyg + a0, a1 - a0, mu, a, b, s1 + d, s2 + d);
    });
    return;
  }
  alignas(64) A bx[kBuf];
  alignas(64) A bg[kBuf];
  for (int64_t i0 = lo; i0 < hi; i0 += kBuf) {
    const int64_t len = std::min(kBuf, hi - i0);
    P.load(xg + i0, bx, len);
    P.load(dyg + i0, bg, len);
    if (S == 1) {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        A g = bg[j];
        if (ACT != kActNone) {
          A a, b;
          gn_fwd_coeffs<A>(mu, r, gam[i0 + j], bet[i0 + j], &a, &b);
          g = gn_act_grad<ACT>(bx[j] * a + b, g);
        }
        s1[i0 + j] += g * (bx[j] - mu);
        s2[i0 + j] += g;
      }
    } else {
      for_elements(i0, len, S, [&](int64_t j, int64_t d) {
        A g = bg[j];
        if (ACT != kActNone) {
          A a, b;
          gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
          g = gn_act_grad<ACT>(bx[j] * a + b, g);
        }
        s1[d] += g * (bx[j] - mu);
        s2[d] += g;
      });
    }
  }
}

// dx over [lo, hi) of one group: c1_d = r gam[d], shared c2, c3.
template <typename T, int ACT>
void bwd_dx_range(const simd::Prims<T>& P, const T* xg, const T* dyg, T* dxg, int64_t lo,
                  int64_t hi, int64_t S, AccT<T> mu, AccT<T> r, const AccT<T>* gam,
                  const AccT<T>* bet, AccT<T> c2, AccT<T> c3, bool nt) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto bwd_dx = P.act_dx[ACT][nt ? 1 : 0];
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t a0, int64_t a1) {
      A a = 1, b = 0;
      if (ACT != kActNone) gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      bwd_dx(xg + a0, dyg + a0, dxg + a0, a1 - a0, mu, a, b, r * gam[d], c2, c3);
    });
    return;
  }
  alignas(64) A bx[kBuf];
  alignas(64) A bg[kBuf];
  for (int64_t i0 = lo; i0 < hi; i0 += kBuf) {
    const int64_t len = std::min(kBuf, hi - i0);
    P.load(xg + i0, bx, len);
    P.load(dyg + i0, bg, len);
    auto one = [&](int64_t j, int64_t d) {
      A g = bg[j];
      if (ACT != kActNone) {
        A a, b;
        gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
        g = gn_act_grad<ACT>(bx[j] * a + b, g);
      }
      bx[j] = gn_bwd_dx<A>(r * gam[d], c2, c3, mu, g, bx[j]);
    };
    if (S == 1) {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) one(j, i0 + j);
    } else {
      for_elements(i0, len, S, one);
    }
    P.store(bx, dxg + i0, len);
  }
}

// Workspace: per-(n, c) sums dgs = sum g xhat (= r sum g (x - mu)) and db = sum g, reduced over n
// into dgamma / dbeta by bwd_params.
template <typename T, int ACT>
void bwd_typed(const GroupNormBwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const simd::Prims<T>& P = simd::prims<T>();
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  T* dx = static_cast<T*>(a.dx);
  const int64_t N = a.N, C = a.C, G = a.G, D = C / G, S = a.S, NG = N * G, M = D * S;
  A* dsc = static_cast<A*>(a.workspace);
  A* db = dsc + N * C;
  const A* dmean_o = static_cast<const A*>(a.dmean);
  const A* drstd_o = static_cast<const A*>(a.drstd);
  const A inv_m = A(1) / static_cast<A>(M);
  const Plan pl = make_plan(NG, M);
  const bool nt = stream_output(NG * M, sizeof(T), kStreamBytesBwd);
  auto dmean_of = [&](int64_t ng) { return dmean_o ? dmean_o[ng] : A(0); };
  auto drstd_of = [&](int64_t ng) { return drstd_o ? drstd_o[ng] : A(0); };
  auto exact = [&](int64_t ng) {
    const int64_t n = ng / G, g = ng % G;
    exact_bwd<T, ACT>(x + ng * M, dy + ng * M, dx + ng * M, D, S, a.eps, gam + g * D, bet + g * D,
                      dmean_of(ng), drstd_of(ng), dsc + n * C + g * D, db + n * C + g * D);
  };

  if (!pl.coop) {
#pragma omp parallel num_threads(pl.nt) if (pl.nt > 1)
    {
#pragma omp for schedule(static)
      for (int64_t ng = 0; ng < NG; ++ng) {
        const int64_t n = ng / G, g = ng % G;
        const A mu = mean[ng], r = rstd[ng];
        if (bwd_needs_exact<T>(r, M)) {
          exact(ng);
          continue;
        }
        const T* xg = x + ng * M;
        const T* dyg = dy + ng * M;
        const A* gg = gam + g * D;
        const A* bg = bet + g * D;
        A* s1 = dsc + n * C + g * D;
        A* s2 = db + n * C + g * D;
        std::fill(s1, s1 + D, A(0));
        std::fill(s2, s2 + D, A(0));
        bwd_sums_range<T, ACT>(P, xg, dyg, 0, M, S, mu, r, gg, bg, s1, s2);
        A sum_a = 0, sum_b = 0;
        for (int64_t d = 0; d < D; ++d) {
          sum_a += gg[d] * s1[d];
          sum_b += gg[d] * s2[d];
          s1[d] *= r;
        }
        A c2, c3;
        gn_bwd_coeffs<A>(sum_a, sum_b, r, inv_m, dmean_of(ng), drstd_of(ng), &c2, &c3);
        bwd_dx_range<T, ACT>(P, xg, dyg, dx + ng * M, 0, M, S, mu, r, gg, bg, c2, c3, nt);
      }
      if (nt) P.fence();
    }
  } else {
    // part[(parity, thread)] holds 2*D partial sums; double-buffered by the parity of a count of
    // the shared groups (exactly recomputed groups have no barrier) so one barrier per group suffices.
    std::vector<A> part(2 * static_cast<size_t>(pl.nt) * 2 * static_cast<size_t>(D));
#pragma omp parallel num_threads(pl.nt)
    {
      const int t = thread_id(), T_ = num_threads();
      int64_t lo, hi;
      slice(M, t, T_, &lo, &hi);
      int64_t shared = 0;
      for (int64_t ng = 0; ng < NG; ++ng) {
        const int64_t n = ng / G, g = ng % G;
        const A mu = mean[ng], r = rstd[ng];
        if (bwd_needs_exact<T>(r, M)) {  // decided from saved values: the same on every thread
          if (t == 0) exact(ng);
          continue;
        }
        const T* xg = x + ng * M;
        const T* dyg = dy + ng * M;
        const A* gg = gam + g * D;
        const A* bg = bet + g * D;
        A* base = part.data() + (shared++ & 1) * pl.nt * 2 * D;
        A* mine = base + t * 2 * D;
        std::fill(mine, mine + 2 * D, A(0));
        bwd_sums_range<T, ACT>(P, xg, dyg, lo, hi, S, mu, r, gg, bg, mine, mine + D);
        barrier();
        A* s1 = dsc + n * C + g * D;
        A* s2 = db + n * C + g * D;
        // Every thread sums the partials in the same order; thread 0 publishes them.
        A sum_a = 0, sum_b = 0;
        for (int64_t d = 0; d < D; ++d) {
          A p1 = 0, p2 = 0;
          for (int u = 0; u < T_; ++u) {
            p1 += base[u * 2 * D + d];
            p2 += base[u * 2 * D + D + d];
          }
          if (t == 0) {
            s1[d] = p1 * r;
            s2[d] = p2;
          }
          sum_a += gg[d] * p1;
          sum_b += gg[d] * p2;
        }
        A c2, c3;
        gn_bwd_coeffs<A>(sum_a, sum_b, r, inv_m, dmean_of(ng), drstd_of(ng), &c2, &c3);
        bwd_dx_range<T, ACT>(P, xg, dyg, dx + ng * M, lo, hi, S, mu, r, gg, bg, c2, c3, nt);
      }
      if (nt) P.fence();
    }
  }
}

template <typename T, typename P>
void bwd_params(const GroupNormBwdArgs& a) {
  using A = AccT<T>;
  P* dgamma = static_cast<P*>(a.dgamma);
  P* dbeta = static_cast<P*>(a.dbeta);
  if (dgamma == nullptr && dbeta == nullptr) return;
  const A* dgs = static_cast<const A*>(a.workspace);
  const int64_t N = a.N, C = a.C;
  const A* db = dgs + N * C;
  // Row order (n outer, c inner): contiguous reads of the (N, C) sums; threads own channel ranges.
  const int nt = N * C >= kMinParallel ? team_size() : 1;
  (void)nt;  // read by the pragma only
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = thread_id(), T_ = num_threads();
    const int64_t per = (C + T_ - 1) / T_;
    const int64_t c0 = std::min(C, per * t), c1 = std::min(C, c0 + per);
    if (c0 < c1) {
      std::vector<A> sg(static_cast<size_t>(c1 - c0), A(0)), sb(static_cast<size_t>(c1 - c0), A(0));
      for (int64_t n = 0; n < N; ++n) {
        const A* ds = dgs + n * C;
        const A* dbn = db + n * C;
#pragma omp simd
        for (int64_t k = c0; k < c1; ++k) {
          sg[k - c0] += ds[k];
          sb[k - c0] += dbn[k];
        }
      }
      for (int64_t c = c0; c < c1; ++c) {
        if (dgamma) dgamma[c] = from_acc<P>(sg[c - c0]);
        if (dbeta) dbeta[c] = from_acc<P>(sb[c - c0]);
      }
    }
  }
}

template <typename A, typename P>
std::vector<A> widen(const void* p, int64_t n) {
  std::vector<A> v(static_cast<size_t>(n));
  const P* q = static_cast<const P*>(p);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<A>(to_acc(q[i]));
  return v;
}

template <typename T, typename P>
void fwd_impl(const GroupNormFwdArgs& a) {
  using A = AccT<T>;
  const std::vector<A> gam = widen<A, P>(a.gamma, a.C), bet = widen<A, P>(a.beta, a.C);
  dispatch_act(a.act, [&](auto act) { fwd_typed<T, decltype(act)::value>(a, gam.data(), bet.data()); });
}

template <typename T, typename P>
void bwd_impl(const GroupNormBwdArgs& a) {
  using A = AccT<T>;
  const std::vector<A> gam = widen<A, P>(a.gamma, a.C);
  // beta enters only through the pre-activation z (and the exactly recomputed groups' z).
  const std::vector<A> bet = a.beta ? widen<A, P>(a.beta, a.C) : std::vector<A>(a.C, A(0));
  dispatch_act(a.act, [&](auto act) { bwd_typed<T, decltype(act)::value>(a, gam.data(), bet.data()); });
  bwd_params<T, P>(a);
}

const char* check_dims(int64_t N, int64_t C, int64_t G, int64_t S) {
  if (N <= 0 || C <= 0 || S <= 0) return "empty tensors are not supported";
  if (G <= 0 || C % G != 0) return "channels must be divisible by num_groups > 0";
  return nullptr;
}

template <typename T, typename P> struct FwdRun { static void run(const GroupNormFwdArgs& a) { fwd_impl<T, P>(a); } };
template <typename T, typename P> struct BwdRun { static void run(const GroupNormBwdArgs& a) { bwd_impl<T, P>(a); } };

}  // namespace

size_t group_norm_bwd_workspace_cpu(const GroupNormBwdArgs& a) {
  const size_t acc = dtype_size(acc_dtype(a.dtype));
  return 2 * static_cast<size_t>(a.N) * static_cast<size_t>(a.C) * acc;
}

const char* moments_cpu(const MomentsArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  return cpu::dispatch_data(a.dtype, [&](auto tag) { moments_typed<decltype(tag)>(a); });
}

const char* moments_bwd_cpu(const MomentsBwdArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  return cpu::dispatch_data(a.dtype, [&](auto tag) { moments_bwd_typed<decltype(tag)>(a); });
}

const char* group_norm_fwd_cpu(const GroupNormFwdArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  return cpu::dispatch_data_param<FwdRun>(a);
}

const char* group_norm_bwd_cpu(const GroupNormBwdArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  if (a.workspace == nullptr) return "backward needs a workspace";
  if (a.act != Act::kNone && a.beta == nullptr)
    return "backward with an activation needs beta";
  return cpu::dispatch_data_param<BwdRun>(a);
}

}  // namespace gn_mx
