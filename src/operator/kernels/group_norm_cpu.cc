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
 */
#include <algorithm>
#include <cmath>
#include <cstdint>
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
// Forward

// y[lo, hi) of one group, given its statistics; gam/bet point at the group's D channels (AccT).
template <typename T>
void fwd_range(const simd::Prims<T>& P, const T* xg, T* yg, int64_t lo, int64_t hi, int64_t S,
               AccT<T> mu, AccT<T> r, const AccT<T>* gam, const AccT<T>* bet, bool nt) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto affine = nt ? P.affine_nt : P.affine;
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
        buf[j] = buf[j] * a + b;
      }
    } else {
      for_elements(i0, len, S, [&](int64_t j, int64_t d) {
        A a, b;
        gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
        buf[j] = buf[j] * a + b;
      });
    }
    P.store(buf, yg + i0, len);
  }
}

template <typename T>
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
        const Welford<A> w = range_moments(P, xg, M);
        const A r = gn_rstd<A>(w.var(), eps);
        mean[ng] = w.mean;
        rstd[ng] = r;
        fwd_range(P, xg, y + ng * M, 0, M, S, w.mean, r, gam + g * D, bet + g * D, nt);
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
      const A r = gn_rstd<A>(w.var(), eps);
      if (t == 0) {
        mean[ng] = w.mean;
        rstd[ng] = r;
      }
      fwd_range(P, xg, y + ng * M, lo, hi, S, w.mean, r, gam + g * D, bet + g * D, nt);
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

// s1[d] += sum dy (x - mu), s2[d] += sum dy over the elements [lo, hi) of one group.
template <typename T>
void bwd_sums_range(const simd::Prims<T>& P, const T* xg, const T* dyg, int64_t lo, int64_t hi,
                    int64_t S, AccT<T> mu, AccT<T>* s1, AccT<T>* s2) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t a0, int64_t a1) {
      P.bwd_sums(xg + a0, dyg + a0, a1 - a0, mu, s1 + d, s2 + d);
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
        s1[i0 + j] += bg[j] * (bx[j] - mu);
        s2[i0 + j] += bg[j];
      }
    } else {
      for_elements(i0, len, S, [&](int64_t j, int64_t d) {
        s1[d] += bg[j] * (bx[j] - mu);
        s2[d] += bg[j];
      });
    }
  }
}

// dx over [lo, hi) of one group: c1_d = r gam[d], shared c2, c3.
template <typename T>
void bwd_dx_range(const simd::Prims<T>& P, const T* xg, const T* dyg, T* dxg, int64_t lo,
                  int64_t hi, int64_t S, AccT<T> mu, AccT<T> r, const AccT<T>* gam, AccT<T> c2,
                  AccT<T> c3, bool nt) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto bwd_dx = nt ? P.bwd_dx_nt : P.bwd_dx;
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t a0, int64_t a1) {
      bwd_dx(xg + a0, dyg + a0, dxg + a0, a1 - a0, mu, r * gam[d], c2, c3);
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
      for (int64_t j = 0; j < len; ++j) bx[j] = gn_bwd_dx<A>(r * gam[i0 + j], c2, c3, mu, bg[j], bx[j]);
    } else {
      for_elements(i0, len, S, [&](int64_t j, int64_t d) {
        bx[j] = gn_bwd_dx<A>(r * gam[d], c2, c3, mu, bg[j], bx[j]);
      });
    }
    P.store(bx, dxg + i0, len);
  }
}

template <typename T>
void bwd_typed(const GroupNormBwdArgs& a, const AccT<T>* gam) {
  using A = AccT<T>;
  const simd::Prims<T>& P = simd::prims<T>();
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  T* dx = static_cast<T*>(a.dx);
  const int64_t N = a.N, C = a.C, G = a.G, D = C / G, S = a.S, NG = N * G, M = D * S;
  // Per-(n, c) sums, kept for the dgamma/dbeta reduction over n.
  A* dsc = static_cast<A*>(a.workspace);
  A* db = dsc + N * C;
  const A* dmean_o = static_cast<const A*>(a.dmean);
  const A* drstd_o = static_cast<const A*>(a.drstd);
  const A inv_m = A(1) / static_cast<A>(M);
  const Plan pl = make_plan(NG, M);
  const bool nt = stream_output(NG * M, sizeof(T), kStreamBytesBwd);

  auto coeffs = [&](int64_t ng, const A* s1, const A* s2, const A* gg, A* c2, A* c3) {
    A sum_a = 0, sum_b = 0;
    for (int64_t d = 0; d < D; ++d) {
      sum_a += gg[d] * s1[d];
      sum_b += gg[d] * s2[d];
    }
    gn_bwd_coeffs<A>(sum_a, sum_b, rstd[ng], inv_m, dmean_o ? dmean_o[ng] : A(0),
                     drstd_o ? drstd_o[ng] : A(0), c2, c3);
  };

  if (!pl.coop) {
#pragma omp parallel num_threads(pl.nt) if (pl.nt > 1)
    {
#pragma omp for schedule(static)
      for (int64_t ng = 0; ng < NG; ++ng) {
        const int64_t n = ng / G, g = ng % G;
        const A mu = mean[ng];
        const T* xg = x + ng * M;
        const T* dyg = dy + ng * M;
        A* s1 = dsc + n * C + g * D;
        A* s2 = db + n * C + g * D;
        std::fill(s1, s1 + D, A(0));
        std::fill(s2, s2 + D, A(0));
        bwd_sums_range(P, xg, dyg, 0, M, S, mu, s1, s2);
        A c2, c3;
        coeffs(ng, s1, s2, gam + g * D, &c2, &c3);
        bwd_dx_range(P, xg, dyg, dx + ng * M, 0, M, S, mu, rstd[ng], gam + g * D, c2, c3, nt);
      }
      if (nt) P.fence();
    }
  } else {
    // part[(parity, thread)] holds 2*D partial sums; double-buffered by group parity so one
    // barrier per group suffices.
    std::vector<A> part(2 * static_cast<size_t>(pl.nt) * 2 * static_cast<size_t>(D));
#pragma omp parallel num_threads(pl.nt)
    {
      const int t = thread_id(), T_ = num_threads();
      int64_t lo, hi;
      slice(M, t, T_, &lo, &hi);
      for (int64_t ng = 0; ng < NG; ++ng) {
        const int64_t n = ng / G, g = ng % G;
        const A mu = mean[ng];
        const T* xg = x + ng * M;
        const T* dyg = dy + ng * M;
        A* base = part.data() + (ng & 1) * pl.nt * 2 * D;
        A* mine = base + t * 2 * D;
        std::fill(mine, mine + 2 * D, A(0));
        bwd_sums_range(P, xg, dyg, lo, hi, S, mu, mine, mine + D);
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
            s1[d] = p1;
            s2[d] = p2;
          }
          sum_a += gam[g * D + d] * p1;
          sum_b += gam[g * D + d] * p2;
        }
        A c2, c3;
        gn_bwd_coeffs<A>(sum_a, sum_b, rstd[ng], inv_m, dmean_o ? dmean_o[ng] : A(0),
                         drstd_o ? drstd_o[ng] : A(0), &c2, &c3);
        bwd_dx_range(P, xg, dyg, dx + ng * M, lo, hi, S, mu, rstd[ng], gam + g * D, c2, c3, nt);
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
  const A* rstd = static_cast<const A*>(a.rstd);
  const A* dsc = static_cast<const A*>(a.workspace);
  const int64_t N = a.N, C = a.C, G = a.G, D = C / G;
  const A* db = dsc + N * C;
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
        const A* ds = dsc + n * C;
        const A* dbn = db + n * C;
        const A* rn = rstd + n * G;
        for (int64_t c = c0; c < c1;) {
          const int64_t g = c / D, ce = std::min(c1, (g + 1) * D);
          const A r = rn[g];
#pragma omp simd
          for (int64_t k = c; k < ce; ++k) {
            sg[k - c0] += ds[k] * r;
            sb[k - c0] += dbn[k];
          }
          c = ce;
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
  fwd_typed<T>(a, gam.data(), bet.data());
}

template <typename T, typename P>
void bwd_impl(const GroupNormBwdArgs& a) {
  using A = AccT<T>;
  const std::vector<A> gam = widen<A, P>(a.gamma, a.C);
  bwd_typed<T>(a, gam.data());
  bwd_params<T, P>(a);
}

const char* check_dims(int64_t N, int64_t C, int64_t G, int64_t S) {
  if (N <= 0 || C <= 0 || S <= 0) return "gn_mx: empty tensors are not supported";
  if (G <= 0 || C % G != 0) return "gn_mx: channels must be divisible by num_groups > 0";
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
  if (a.workspace == nullptr) return "gn_mx: group_norm backward needs a workspace";
  return cpu::dispatch_data_param<BwdRun>(a);
}

}  // namespace gn_mx
