/*
 * group_norm_cpu.cc: CPU kernels for gn_moments and gn_group_norm (forward and backward) on
 * channels-first data, and the CPU entry points (group_norm.h), which hand channels-last data
 * (GroupDims::channels_last) to group_norm_nsc_cpu.cc. What both share (the thread plan, exactly
 * recomputed groups, the backward workspace) is in group_norm_cpu_common.h.
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
 * Code layout: one job per computation (MomentsJob: statistics; FwdJob: statistics + y; BwdJob: the
 * input gradient + per-(n, c) sums; bwd_params: the parameter gradients), each a reduction and an
 * elementwise pass over a group; run_groups() alone decides how threads share them:
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
 * first element, so x - x0 is exact for nearby values): the groups gn_exact_group selects
 * (group_norm_math.h, the one rule of both twins): tiny groups (M <= 4, e.g. (N, C) data with
 * num_groups = C or C/2: one-element groups exact, 2-4 element groups within float32 rounding at
 * any offset) and float32/float16 groups whose statistics overflow (|x| ~ 1e19 .. 3e38), hold
 * NaN/Inf, have rstd < 1e-12 (rstd^3 would underflow) or |mean| rstd > 2^24.
 *   Backward of these groups recomputes the statistics from x (the fp32 mean is rounded), so it
 *   also needs eps. The common path pays a few compares per group. gn_moments recomputes the
 *   groups gn_exact_moments selects (tiny, non-finite statistics) the same way.
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
#include "group_norm_cpu_common.h"
#include "group_norm_nsc_cpu.h"
#include "group_norm_math.h"
#include "simd_cpu.h"
#include "../common/carver.h"
#include "../common/threads.h"
#include "../common/welford.h"

namespace gn_mx {
namespace {

// Statistics chunk: the moments primitive reads a chunk twice (mean, then centred M2), so a chunk must
// stay in L1: 2048 elements = 8 KB fp32 / 16 KB fp64 of a 32-48 KB L1d. Larger groups pay one Chan
// merge per chunk (a few flops per 2048 elements).
constexpr int64_t kChunk = 2048;
// Channels shorter than this (e.g. (N, C) data, S = 1) take the buffered path: per-channel
// primitive calls would each cover under two 8-float AVX2 vectors, all call and remainder overhead.
constexpr int64_t kSmallS = 16;
// AccT buffer of the buffered path: 512 elements = 2 KB fp32 (4 KB fp64) per buffer, L1-resident
// with two buffers, and long enough that each load/store call covers 64 AVX2 vectors.
constexpr int64_t kBuf = 512;
// Slice boundaries of a shared group fall on multiples of 64 elements (128 B fp16, 256 B fp32):
// whole cache lines, so two threads never write the same output line and slices start aligned.
constexpr int64_t kSliceAlign = 64;

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

// The buffered run of small spatial sizes (S < kSmallS): elements [lo, hi) of a group go through
// kBuf-long AccT buffers, f(v, g, d) is called per element with v = x (written back to `out` unless
// it is nullptr), g = dy (read only when kDy; 0 otherwise) and the element's channel d.
// Always inlined: inside its caller f's captured coefficients stay in registers (a separate copy
// reloaded them after every buffer store: +10% on (64, 1024) data, measured).
template <bool kDy, typename T, typename F>
inline __attribute__((always_inline)) void buffered_run(const simd::Prims<T>& P, const T* x, const T* dy, T* out, int64_t lo, int64_t hi,
                  int64_t S, F&& f) {
  using A = AccT<T>;
  alignas(64) A bx[kBuf];
  alignas(64) A bg[kDy ? kBuf : 1];
  for (int64_t i0 = lo; i0 < hi; i0 += kBuf) {
    const int64_t len = std::min(kBuf, hi - i0);
    P.load(x + i0, bx, len);
    if (kDy) P.load(dy + i0, bg, len);
    auto one = [&](int64_t j, int64_t d) { f(bx[j], kDy ? bg[j] : A(0), d); };
    if (S == 1) {
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) one(j, i0 + j);
    } else {
      for_elements(i0, len, S, one);
    }
    if (out) P.store(bx, out + i0, len);
  }
}

// ------------------------------------------------------------------------------------------------
// The thread schedule (see the header): the one owner of "per group" vs "cooperative".
//
// A group job is two passes over each of the NG groups of M elements: a reduction (statistics, or
// per-channel gradient sums) and an elementwise pass that uses coefficients derived from it. Its
// methods take the group's view q = group(ng) (offsets computed once per group: one division):
//   Part                 the partial result of one thread over part of a group (part_len() values)
//   kApply               whether there is a second pass (false: moments, a reduction only)
//   skip(q)              the group is recomputed exactly without a reduction (decided from inputs
//                        every thread sees alike)
//   reduce(q, lo, hi, part)    partial over the elements [lo, hi)
//   finish(q, parts, n, owner, &coef)    combines n partials in a fixed order; the owner (one thread
//                        per group) publishes the group's outputs; false: recompute it exactly
//   exact(q)             the exactly recomputed group (run by its owner)
//   apply(q, lo, hi, coef)     the second pass over [lo, hi);  end_thread()  after a thread's last group
// Per group, each thread owns whole groups. Cooperative, every thread takes the same slice of each
// group (so its second pass reads its own cache) and the partials meet after one barrier per group,
// double-buffered by the parity of a count of the shared groups; all threads combine them in the same
// order, so they derive identical coefficients. A reduction-only job keeps every group's partials and
// meets once.
template <class Job>
void run_groups(const Plan& pl, int64_t NG, int64_t M, const Job& job) {
  using Part = typename Job::Part;
  const size_t len = job.part_len(), nt = static_cast<size_t>(pl.nt);
  if (!pl.coop) {
    std::vector<Part> part(nt * len);
#pragma omp parallel num_threads(pl.nt) if (pl.nt > 1)
    {
      Part* mine = part.data() + thread_id() * len;
#pragma omp for schedule(static)
      for (int64_t ng = 0; ng < NG; ++ng) {
        typename Job::Coef cf;
        const auto q = job.group(ng);
        if (job.skip(q)) {
          job.exact(q);
          continue;
        }
        job.reduce(q, 0, M, mine);
        if (!job.finish(q, mine, 1, true, &cf))
          job.exact(q);
        else if (Job::kApply)
          job.apply(q, 0, M, cf);
      }
      job.end_thread();
    }
    return;
  }
  std::vector<Part> part((Job::kApply ? 2 : static_cast<size_t>(NG)) * nt * len);
#pragma omp parallel num_threads(pl.nt)
  {
    const int t = thread_id(), T_ = num_threads();
    int64_t lo, hi;
    slice(M, t, T_, &lo, &hi);
    if (!Job::kApply) {
      for (int64_t ng = 0; ng < NG; ++ng)
        job.reduce(job.group(ng), lo, hi, part.data() + (ng * nt + t) * len);
      barrier();
      typename Job::Coef cf;
#pragma omp for schedule(static)
      for (int64_t ng = 0; ng < NG; ++ng)
        job.finish(job.group(ng), part.data() + ng * nt * len, T_, true, &cf);
    } else {
      int64_t shared = 0;
      for (int64_t ng = 0; ng < NG; ++ng) {
        typename Job::Coef cf;
        const auto q = job.group(ng);
        if (job.skip(q)) {
          if (t == 0) job.exact(q);
          continue;
        }
        Part* base = part.data() + (shared++ & 1) * nt * len;
        job.reduce(q, lo, hi, base + t * len);
        barrier();
        if (!job.finish(q, base, T_, t == 0, &cf)) {  // every thread sees the same partials
          if (t == 0) job.exact(q);
          continue;
        }
        job.apply(q, lo, hi, cf);
      }
    }
    job.end_thread();
  }
}

// The one-pass schedule (no reduction): f(ng, lo, hi) over whole groups or over every thread's slice.
template <typename F>
void for_group_slices(const Plan& pl, int64_t NG, int64_t M, F&& f) {
  if (!pl.coop) {
#pragma omp parallel for schedule(static) num_threads(pl.nt) if (pl.nt > 1)
    for (int64_t ng = 0; ng < NG; ++ng) f(ng, 0, M);
    return;
  }
#pragma omp parallel num_threads(pl.nt)
  {
    int64_t lo, hi;
    slice(M, thread_id(), num_threads(), &lo, &hi);
    for (int64_t ng = 0; ng < NG; ++ng) f(ng, lo, hi);
  }
}

// Backward: the groups gn_exact_group selects, decided from the saved statistics (every thread sees
// the same values).
template <typename T>
bool bwd_needs_exact(AccT<T> mu, AccT<T> r, int64_t M) {
  return gn_exact_group<T>(mu, r, M);
}

// ------------------------------------------------------------------------------------------------
// Statistics (gn_moments forward, and the reduction of gn_group_norm's forward)

// mean/var (moments) of every group: reduction only.
template <typename T>
struct MomentsJob {
  using A = AccT<T>;
  using Part = Welford<A>;
  struct Coef {};
  static constexpr bool kApply = false;
  const simd::Prims<T>& P;
  const T* x;
  A* mean;
  A* var;
  int64_t M;

  int64_t group(int64_t ng) const { return ng; }
  size_t part_len() const { return 1; }
  bool skip(int64_t) const { return false; }
  void reduce(int64_t ng, int64_t lo, int64_t hi, Part* p) const {
    *p = range_moments(P, x + ng * M + lo, hi - lo);
  }
  bool finish(int64_t ng, const Part* parts, int n, bool owner, Coef*) const {
    Welford<A> w;
    for (int u = 0; u < n; ++u) w.merge(parts[u]);
    if (owner) {
      mean[ng] = w.mean;
      var[ng] = w.var();
      if (gn_exact_moments<T>(w.mean, w.var(), M))
        exact_moments(x + ng * M, GroupWalk{1, M, 0, 1}, mean + ng, var + ng);
    }
    return true;
  }
  void exact(int64_t) const {}
  void apply(int64_t, int64_t, int64_t, const Coef&) const {}
  void end_thread() const {}
};

template <typename T>
void moments_typed(const MomentsArgs& a) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, M = a.dims.D * a.dims.S;
  const MomentsJob<T> job{simd::prims<T>(), static_cast<const T*>(a.x), static_cast<A*>(a.mean),
                          static_cast<A*>(a.var), M};
  run_groups(make_plan(NG, M), NG, M, job);
}

// gn_moments backward, one pass: dx = c0 + c1 (x - mu), the dx primitive with a zero dy
// coefficient (it reads x as dy: cached).
template <typename T>
void moments_bwd_typed(const MomentsBwdArgs& a) {
  using A = AccT<T>;
  const simd::Prims<T>& P = simd::prims<T>();
  const T* x = static_cast<const T*>(a.x);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  const A* mean = static_cast<const A*>(a.mean);
  T* dx = static_cast<T*>(a.dx);
  const int64_t NG = a.dims.N * a.dims.G, M = a.dims.D * a.dims.S;
  const A inv_m = A(1) / static_cast<A>(M);
  for_group_slices(make_plan(NG, M), NG, M, [&](int64_t ng, int64_t lo, int64_t hi) {
    A c0, c1;
    gn_moments_bwd_coeffs<A>(dmean[ng], dvar[ng], inv_m, &c0, &c1);
    const T* xp = x + ng * M + lo;
    P.bwd_dx(xp, xp, dx + ng * M + lo, hi - lo, mean[ng], A(0), c1, c0);
  });
}

// ------------------------------------------------------------------------------------------------
// Forward

// y[lo, hi) of one group, given its statistics; gam/bet point at the group's D channels (AccT).
template <typename T, Act ACT>
void fwd_range(const simd::Prims<T>& P, const T* xg, T* yg, int64_t lo, int64_t hi, int64_t S,
               AccT<T> mu, AccT<T> r, const AccT<T>* gam, const AccT<T>* bet, bool nt) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto affine = P.act_affine[static_cast<int>(ACT)][nt ? 1 : 0];
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t s0, int64_t s1) {
      A a, b;
      gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      affine(xg + s0, yg + s0, s1 - s0, a, b);
    });
    return;
  }
  buffered_run<false>(P, xg, static_cast<const T*>(nullptr), yg, lo, hi, S, [&](A& v, A, int64_t d) {
    A a, b;
    gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
    v = gn_act<ACT>(v * a + b);
  });
}

// gn_group_norm forward: the statistics of each group, then y = act(x * a_c + b_c).
template <typename T, Act ACT>
struct FwdJob {
  using A = AccT<T>;
  using Part = Welford<A>;
  struct Coef {
    A mu, r;
  };
  static constexpr bool kApply = true;
  const simd::Prims<T>& P;
  const T* x;
  T* y;
  A* mean;
  A* rstd;
  const A* gam;  // (C,) AccT
  const A* bet;
  int64_t G, D, S, M;
  double eps;
  A eps_acc;     // eps in AccT, as the statistics use it
  bool nt;       // streaming stores

  struct Group {
    int64_t ng, c;  // the group and its first channel
  };
  Group group(int64_t ng) const { return {ng, (ng % G) * D}; }

  size_t part_len() const { return 1; }
  bool skip(const Group&) const { return M <= kGnExactGroup; }
  void reduce(const Group& q, int64_t lo, int64_t hi, Part* p) const {
    *p = range_moments(P, x + q.ng * M + lo, hi - lo);
  }
  bool finish(const Group& q, const Part* parts, int n, bool owner, Coef* cf) const {
    Welford<A> w;
    for (int u = 0; u < n; ++u) w.merge(parts[u]);
    const A r = gn_rstd<A>(w.var(), eps_acc);  // once: the exact-group rule needs it too
    if (gn_exact_group<T>(w.mean, r, M)) return false;
    cf->mu = w.mean;
    cf->r = r;
    if (owner) {
      mean[q.ng] = cf->mu;
      rstd[q.ng] = cf->r;
    }
    return true;
  }
  void exact(const Group& q) const {
    exact_fwd<T, ACT>(x + q.ng * M, y + q.ng * M, GroupWalk{D, S, S, 1}, eps, gam + q.c, bet + q.c,
                      mean + q.ng, rstd + q.ng);
  }
  void apply(const Group& q, int64_t lo, int64_t hi, const Coef& cf) const {
    fwd_range<T, ACT>(P, x + q.ng * M, y + q.ng * M, lo, hi, S, cf.mu, cf.r, gam + q.c, bet + q.c,
                      nt);
  }
  void end_thread() const {
    if (nt) P.fence();
  }
};

template <typename T, Act ACT>
void fwd_typed(const GroupNormFwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const int64_t NG = d.N * d.G, M = d.D * d.S;
  const FwdJob<T, ACT> job{simd::prims<T>(), static_cast<const T*>(a.x), static_cast<T*>(a.y),
                           static_cast<A*>(a.mean), static_cast<A*>(a.rstd), gam, bet, d.G, d.D,
                           d.S, M, a.eps, static_cast<A>(a.eps),
                           stream_output(NG * M, sizeof(T), kStreamBytesFwd)};
  run_groups(make_plan(NG, M), NG, M, job);
}

// ------------------------------------------------------------------------------------------------
// Backward

// s1[d] += sum g (x - mu), s2[d] += sum g over the elements [lo, hi) of one group, g = dy act'(z).
template <typename T, Act ACT>
void bwd_sums_range(const simd::Prims<T>& P, const T* xg, const T* dyg, int64_t lo, int64_t hi,
                    int64_t S, AccT<T> mu, AccT<T> r, const AccT<T>* gam, const AccT<T>* bet,
                    AccT<T>* s1, AccT<T>* s2) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto sums = P.act_sums[static_cast<int>(ACT)];
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t a0, int64_t a1) {
      A a = 1, b = 0;
      if (ACT != Act::kNone) gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      sums(xg + a0, dyg + a0, a1 - a0, mu, a, b, s1 + d, s2 + d);
    });
    return;
  }
  buffered_run<true>(P, xg, dyg, static_cast<T*>(nullptr), lo, hi, S, [&](A& v, A g, int64_t d) {
    if (ACT != Act::kNone) {
      A a, b;
      gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      g = gn_act_grad<ACT>(v * a + b, g);
    }
    s1[d] += g * (v - mu);
    s2[d] += g;
  });
}

// dx over [lo, hi) of one group: c1_d = r gam[d], shared c2, c3.
template <typename T, Act ACT>
void bwd_dx_range(const simd::Prims<T>& P, const T* xg, const T* dyg, T* dxg, int64_t lo,
                  int64_t hi, int64_t S, AccT<T> mu, AccT<T> r, const AccT<T>* gam,
                  const AccT<T>* bet, AccT<T> c2, AccT<T> c3, bool nt) {
  using A = AccT<T>;
  if (S >= kSmallS) {
    const auto bwd_dx = P.act_dx[static_cast<int>(ACT)][nt ? 1 : 0];
    for_channel_runs(lo, hi, S, [&](int64_t d, int64_t a0, int64_t a1) {
      A a = 1, b = 0;
      if (ACT != Act::kNone) gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      bwd_dx(xg + a0, dyg + a0, dxg + a0, a1 - a0, mu, a, b, r * gam[d], c2, c3);
    });
    return;
  }
  buffered_run<true>(P, xg, dyg, dxg, lo, hi, S, [&](A& v, A g, int64_t d) {
    if (ACT != Act::kNone) {
      A a, b;
      gn_fwd_coeffs<A>(mu, r, gam[d], bet[d], &a, &b);
      g = gn_act_grad<ACT>(v * a + b, g);
    }
    v = gn_bwd_dx<A>(r * gam[d], c2, c3, mu, g, v);
  });
}

// of a thread is 2*D sums: s1[d] = sum g (x - mu), s2[d] = sum g over its elements.
template <typename T, Act ACT>
struct BwdJob {
  using A = AccT<T>;
  using Part = A;
  struct Coef {
    A c2, c3;
  };
  struct Group {
    int64_t ng, c, row;  // the group, its first channel g*D, its first (N, C) sum n*C + g*D
    A mu, r;
  };
  static constexpr bool kApply = true;
  const simd::Prims<T>& P;
  const T* x;
  const T* dy;
  T* dx;
  const A* mean;
  const A* rstd;
  const A* dmean_o;  // (N, G) or nullptr (= 0)
  const A* drstd_o;
  const A* gam;      // (C,) AccT
  const A* bet;
  BwdSums<A> sums;
  int64_t C, G, D, S, M;
  double eps;
  bool nt;           // streaming stores

  Group group(int64_t ng) const {
    const int64_t n = ng / G, c = (ng - n * G) * D;
    return {ng, c, n * C + c, mean[ng], rstd[ng]};
  }
  A dmean(const Group& q) const { return dmean_o ? dmean_o[q.ng] : A(0); }
  A drstd(const Group& q) const { return drstd_o ? drstd_o[q.ng] : A(0); }

  size_t part_len() const { return 2 * static_cast<size_t>(D); }
  bool skip(const Group& q) const { return bwd_needs_exact<T>(q.mu, q.r, M); }
  void reduce(const Group& q, int64_t lo, int64_t hi, A* p) const {
    std::fill(p, p + 2 * D, A(0));
    bwd_sums_range<T, ACT>(P, x + q.ng * M, dy + q.ng * M, lo, hi, S, q.mu, q.r, gam + q.c,
                           bet + q.c, p, p + D);
  }
  // Sums the n partials per channel in thread order; the owner publishes dsc/db.
  bool finish(const Group& q, const A* parts, int n, bool owner, Coef* cf) const {
    const int64_t len = 2 * D;
    const A* gg = gam + q.c;
    A* dsc = sums.dsc + q.row;
    A* db = sums.db + q.row;
    A sum_a = 0, sum_b = 0;
    for (int64_t d = 0; d < D; ++d) {
      A p1 = parts[d], p2 = parts[D + d];
      for (int u = 1; u < n; ++u) {
        p1 += parts[u * len + d];
        p2 += parts[u * len + D + d];
      }
      if (owner) {
        dsc[d] = p1 * q.r;
        db[d] = p2;
      }
      sum_a += gg[d] * p1;
      sum_b += gg[d] * p2;
    }
    gn_bwd_coeffs<A>(sum_a, sum_b, q.r, A(1) / static_cast<A>(M), dmean(q), drstd(q), &cf->c2,
                     &cf->c3);
    return true;
  }
  void exact(const Group& q) const {
    exact_bwd<T, ACT>(x + q.ng * M, dy + q.ng * M, dx + q.ng * M, GroupWalk{D, S, S, 1}, eps,
                      gam + q.c, bet + q.c, dmean(q), drstd(q), sums.dsc + q.row, sums.db + q.row);
  }
  void apply(const Group& q, int64_t lo, int64_t hi, const Coef& cf) const {
    bwd_dx_range<T, ACT>(P, x + q.ng * M, dy + q.ng * M, dx + q.ng * M, lo, hi, S, q.mu, q.r,
                         gam + q.c, bet + q.c, cf.c2, cf.c3, nt);
  }
  void end_thread() const {
    if (nt) P.fence();
  }
};

template <typename T, Act ACT>
void bwd_input_typed(const GroupNormBwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const int64_t NG = d.N * d.G, M = d.D * d.S;
  const BwdJob<T, ACT> job{simd::prims<T>(),
                           static_cast<const T*>(a.x),
                           static_cast<const T*>(a.dy),
                           static_cast<T*>(a.dx),
                           static_cast<const A*>(a.mean),
                           static_cast<const A*>(a.rstd),
                           static_cast<const A*>(a.dmean),
                           static_cast<const A*>(a.drstd),
                           gam,
                           bet,
                           carve_bwd_sums<A>(a.workspace, d),
                           d.C, d.G, d.D, d.S, M,
                           a.eps,
                           stream_output(NG * M, sizeof(T), kStreamBytesBwd)};
  run_groups(make_plan(NG, M), NG, M, job);
}

// dgamma[c] = sum_n dsc[n, c], dbeta[c] = sum_n db[n, c] from the workspace sums.
template <typename T, typename P>
void bwd_params(const GroupNormBwdArgs& a) {
  using A = AccT<T>;
  P* dgamma = static_cast<P*>(a.dgamma);
  P* dbeta = static_cast<P*>(a.dbeta);
  if (dgamma == nullptr && dbeta == nullptr) return;
  const BwdSums<A> sums = carve_bwd_sums<A>(a.workspace, a.dims);
  const A* dsc = sums.dsc;
  const A* dbs = sums.db;
  const int64_t N = a.dims.N, C = a.dims.C;
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
        const A* dbn = dbs + n * C;
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
struct FwdRun {
  static void run(const GroupNormFwdArgs& a) {
    using A = AccT<T>;
    const std::vector<A> gam = widen<A, P>(a.gamma, a.dims.C), bet = widen<A, P>(a.beta, a.dims.C);
    if (a.dims.channels_last) {
      nsc_fwd_cpu<T>(a, gam.data(), bet.data());
      return;
    }
    dispatch_act(a.act, [&](auto act) { fwd_typed<T, decltype(act)::value>(a, gam.data(), bet.data()); });
  }
};

template <typename T, typename P>
struct BwdRun {
  static void run(const GroupNormBwdArgs& a) {
    using A = AccT<T>;
    const std::vector<A> gam = widen<A, P>(a.gamma, a.dims.C);
    // beta enters only through the pre-activation z (and the exactly recomputed groups' z).
    const std::vector<A> bet =
        a.beta ? widen<A, P>(a.beta, a.dims.C) : std::vector<A>(a.dims.C, A(0));
    if (a.dims.channels_last)
      nsc_bwd_input_cpu<T>(a, gam.data(), bet.data());
    else
      dispatch_act(a.act, [&](auto act) {
        bwd_input_typed<T, decltype(act)::value>(a, gam.data(), bet.data());
      });
    bwd_params<T, P>(a);
  }
};

}  // namespace

size_t group_norm_bwd_workspace_cpu(const GroupNormBwdArgs& a) {
  size_t bytes = 0;
  cpu::dispatch_data(a.dtype, [&](auto tag) {
    carve_bwd_sums<AccT<decltype(tag)>>(nullptr, a.dims, &bytes);
  });
  return bytes;
}

const char* moments_cpu(const MomentsArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return cpu::dispatch_data(a.dtype, [&](auto tag) {
    if (a.dims.channels_last)
      nsc_moments_cpu<decltype(tag)>(a);
    else
      moments_typed<decltype(tag)>(a);
  });
}

const char* moments_bwd_cpu(const MomentsBwdArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return cpu::dispatch_data(a.dtype, [&](auto tag) {
    if (a.dims.channels_last)
      nsc_moments_bwd_cpu<decltype(tag)>(a);
    else
      moments_bwd_typed<decltype(tag)>(a);
  });
}

const char* group_norm_fwd_cpu(const GroupNormFwdArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return cpu::dispatch_data_param<FwdRun>(a);
}

const char* group_norm_bwd_cpu(const GroupNormBwdArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  if (a.workspace == nullptr) return kGnNeedsWorkspace;
  if (a.act != Act::kNone && a.beta == nullptr) return kGnActNeedsBeta;
  return cpu::dispatch_data_param<BwdRun>(a);
}

}  // namespace gn_mx
