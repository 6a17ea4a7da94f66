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
#include "group_norm_math.h"
#include "simd_cpu.h"
#include "simd_rows_cpu.h"
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
constexpr int64_t kMinParallel = 1 << 14;  // fewer elements than this: no OpenMP fork
// Smallest group that threads share: sharing costs one barrier per group (about a microsecond),
// which 8192 elements (32 KB fp32, a few microseconds of one thread's work) still pay for.
constexpr int64_t kMinCoopGroup = 1 << 13;
// Slice boundaries of a shared group fall on multiples of 64 elements (128 B fp16, 256 B fp32):
// whole cache lines, so two threads never write the same output line and slices start aligned.
constexpr int64_t kSliceAlign = 64;
// Groups split statically over threads are "balanced" when every thread gets the same count, or at
// least this many groups each: the last, partly idle, round then costs at most 1/8 of the time.
constexpr int64_t kMinGroupsPerThread = 8;
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
  const bool balanced =
      NG >= nt && (NG % nt == 0 || NG >= kMinGroupsPerThread * static_cast<int64_t>(nt));
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

// ------------------------------------------------------------------------------------------------
// Exactly recomputed groups (see the header comment)

// A group's elements in either layout: element (d, s) (channel d of the group, position s) lies at
// xg[d*cs + s*ps] from the group's first element: (cs, ps) = (S, 1) channels first, (1, C)
// channels last (group_shape.h gn_elem_strides).
struct GroupWalk {
  int64_t D, S, cs, ps;
  int64_t at(int64_t d, int64_t s) const { return d * cs + s * ps; }
  int64_t size() const { return D * S; }
};
GroupWalk group_walk(const GroupDims& dims) {
  const ElemStrides e = gn_elem_strides(dims);
  return {dims.D, dims.S, e.chan, e.pos};
}
// The group (n, g)'s first element.
int64_t group_offset(const GroupDims& dims, int64_t n, int64_t g) {
  const ElemStrides e = gn_elem_strides(dims);
  return n * e.sample + g * dims.D * e.chan;
}

// Group statistics in float64 around x0 = xg[0]: *d = mean - x0, *r = rstd (and *var).
template <typename T>
void exact_stats(const T* xg, const GroupWalk& w, double eps, double* x0, double* d, double* r,
                 double* var = nullptr) {
  const int64_t M = w.size();
  *x0 = static_cast<double>(to_acc(xg[0]));
  double s = 0;
  for (int64_t c = 0; c < w.D; ++c)
    for (int64_t i = 0; i < w.S; ++i) s += static_cast<double>(to_acc(xg[w.at(c, i)])) - *x0;
  *d = s / static_cast<double>(M);
  double q = 0;
  for (int64_t c = 0; c < w.D; ++c)
    for (int64_t i = 0; i < w.S; ++i) {
      const double v = (static_cast<double>(to_acc(xg[w.at(c, i)])) - *x0) - *d;
      q += v * v;
    }
  *r = 1.0 / std::sqrt(q / static_cast<double>(M) + eps);
  if (var) *var = q / static_cast<double>(M);
}

// gn_moments of a group gn_exact_moments selects.
template <typename T>
void exact_moments(const T* xg, const GroupWalk& w, AccT<T>* mean, AccT<T>* var) {
  double x0, d, r, v;
  exact_stats(xg, w, 0.0, &x0, &d, &r, &v);
  *mean = static_cast<AccT<T>>(x0 + d);
  *var = static_cast<AccT<T>>(v);
}

template <typename T, Act ACT>
void exact_fwd(const T* xg, T* yg, const GroupWalk& w, double eps, const AccT<T>* gam,
               const AccT<T>* bet, AccT<T>* mean, AccT<T>* rstd) {
  using A = AccT<T>;
  double x0, d, r;
  exact_stats(xg, w, eps, &x0, &d, &r);
  *mean = static_cast<A>(x0 + d);
  *rstd = static_cast<A>(r);
  const double sc = gn_exact_xhat_scale(r, w.size());
  for (int64_t c = 0; c < w.D; ++c) {
    const double ga = gam[c], be = bet[c];
    for (int64_t i = 0; i < w.S; ++i) {
      const int64_t s = w.at(c, i);
      // exactly 0 when M == 1
      const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[s])), x0, d);
      yg[s] = from_acc<T>(static_cast<A>(gn_act<ACT>(gn_exact_z(xc, sc, ga, be))));
    }
  }
}

// dx of one group and its per-channel sums dgs[c] = sum g xhat, db[c] = sum g.
template <typename T, Act ACT>
void exact_bwd(const T* xg, const T* dyg, T* dxg, const GroupWalk& w, double eps,
               const AccT<T>* gam, const AccT<T>* bet, double dmean_o, double drstd_o, AccT<T>* dgs,
               AccT<T>* db) {
  using A = AccT<T>;
  const int64_t M = w.size();
  double x0, d, r;
  exact_stats(xg, w, eps, &x0, &d, &r);
  const double sc = gn_exact_xhat_scale(r, M);
  auto grad = [&](int64_t s, double xc, double ga, double be) {
    const double dy = static_cast<double>(to_acc(dyg[s]));
    return gn_act_grad<ACT>(gn_exact_z(xc, sc, ga, be), dy);
  };
  if (M == 1) {  // x - mean = 0: out = act(beta), d out/dx = 0; only mean (= x) passes dmean on
    dgs[0] = A(0);
    db[0] = static_cast<A>(grad(0, 0.0, gam[0], bet[0]));
    dxg[0] = from_acc<T>(static_cast<A>(dmean_o));
    return;
  }
  double sa = 0, sb = 0;
  for (int64_t c = 0; c < w.D; ++c) {
    const double ga = gam[c], be = bet[c];
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < w.S; ++i) {
      const int64_t s = w.at(c, i);
      const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[s])), x0, d);
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
  for (int64_t c = 0; c < w.D; ++c) {
    const double ga = gam[c], be = bet[c];
    for (int64_t i = 0; i < w.S; ++i) {
      const int64_t s = w.at(c, i);
      const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[s])), x0, d);
      dxg[s] = from_acc<T>(static_cast<A>(r * ga * grad(s, xc, ga, be) + c2 * xc + c3));
    }
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

// The backward workspace, one layout (WorkspaceCarver: with ws == nullptr it only measures):
// per-(n, c) sums dsc = sum g xhat (= r sum g (x - mu)) and db = sum g, (N, C) AccT each, written
// per group by the input gradient and reduced over n into dgamma / dbeta by bwd_params.
template <typename A>
struct BwdSums {
  A* dsc;
  A* db;
};
template <typename A>
BwdSums<A> carve_bwd_sums(void* ws, const GroupDims& d, size_t* bytes = nullptr) {
  WorkspaceCarver<64> w{static_cast<char*>(ws)};
  const size_t nc = static_cast<size_t>(d.N) * static_cast<size_t>(d.C);
  BwdSums<A> s;
  s.dsc = w.take<A>(nc);
  s.db = w.take<A>(nc);
  if (bytes) *bytes = w.off;
  return s;
}

// gn_group_norm's input gradient (and the per-(n, c) sums of the parameter gradients). The partial
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

// ------------------------------------------------------------------------------------------------
// Channels-last data (N, S, C): dims.channels_last (see the header comment's last section).
//
// A group is D contiguous channels at each of S positions, so the kernels walk rows (positions) of C
// channels with per-channel coefficients (simd_rows_cpu.h) instead of runs of one group:
//   forward:  statistics of all G groups of a sample in one read of its rows, in chunks of
//             kRowChunk elements (whole rows, L1-resident): per chunk the column sums give every
//             group's chunk mean, a second (cached) read the centred column M2, merged per group with
//             Chan's update (welford.h): the chunked, exact-centred statistics of the channels-first
//             path. Then y = act(x * a_c + b_c) in a second read of the sample's rows.
//   backward: the per-(n, c) sums dsc_c = sum g (x - mu), db_c = sum g (one read of x and dy per
//             sample, chunk by chunk), then dx in a second read; bwd_params as channels first.
// The forward's second read walks a thread's rows backwards (last chunk first): every group needs
// the whole sample's statistics, so rows cannot be applied while the reduction holds them, but it
// starts on the rows the reduction left in L2; outputs of kStreamBytesFwd and more (fp32 / fp64)
// are computed into an L1 chunk buffer and streamed out (RowPrims::stream), as channels first
// writes them. The backward's dx pass stays forwards with cached stores: with both changes it
// timed 1.0-1.35x slower in two interleaved A/B runs on the loaded machine (inconclusive, not kept). (Blocks of whole groups read down all rows, rows C apart, so that a block could be
// applied from L2 like a channels-first group, were tried: blocks narrow enough for L2 (16-20
// channels at S = 4096-16384) ran 2-5x slower than whole rows, in scalar column loops and strided
// lines; not kept.)
// Threads (run_samples): per sample, or, when N is small or uneven for the team, each thread takes
// the same row slice of every sample and the partials meet after one barrier per sample, combined in
// thread order (identical coefficients in every thread), as run_groups does for groups.
// Exactly recomputed groups: the same gn_exact_group / gn_exact_moments rule; their values are
// rewritten by exact_fwd / exact_bwd (strided GroupWalk) after the fast pass has written the whole
// rows (a barrier first when threads share a sample). Samples whose groups have at most
// kGnExactGroup elements are recomputed whole, without the fast pass.

constexpr int64_t kRowChunk = 4096;  // elements per statistics chunk (16 KB fp32): fits L1
// Rows per chunk at most: each column sum runs sequentially down the rows, so its rounding grows
// with their count; 64 keeps a constant group's mean within the edge cases' 16 ulp (576 rows of
// 0.37 in one sum: 20 ulp) at one merge of C values per 64 rows.
constexpr int64_t kRowChunkMaxRows = 64;

// Rows per chunk for C channels: whole rows, at least one.
int64_t chunk_rows(int64_t C) {
  return std::max<int64_t>(1, std::min(kRowChunkMaxRows, kRowChunk / C));
}

// Rows [lo, hi) of thread t of T over S positions.
void row_slice(int64_t S, int t, int T, int64_t* lo, int64_t* hi) {
  const int64_t per = (S + T - 1) / T;
  *lo = std::min(S, per * t);
  *hi = std::min(S, *lo + per);
}

// Whether the channels-last output of data dims is streamed: fp32 / fp64 data (fp16 rows are
// narrowed through RowIo's cached stores) of at least threshold bytes.
template <typename T>
bool stream_rows(const GroupDims& d, int64_t threshold) {
  return std::is_same<T, AccT<T>>::value && stream_output(d.N * d.S * d.C, sizeof(T), threshold);
}

// AccT rows of data of dtype T: the data itself when T is AccT (fp32 / fp64), else widened into
// (or narrowed from) a buffer of the thread.
template <typename T>
struct RowIo {
  using A = AccT<T>;
  static constexpr bool kSame = std::is_same<T, A>::value;
  const simd::Prims<T>& P;
  const A* in(const T* p, A* buf, int64_t n) const {
    if (kSame) return reinterpret_cast<const A*>(p);
    P.load(p, buf, n);
    return buf;
  }
  A* out(T* p, A* buf) const { return kSame ? reinterpret_cast<A*>(p) : buf; }
  void flush(const A* buf, T* p, int64_t n) const {
    if (!kSame) P.store(buf, p, n);
  }
};

// The channels-last schedule: a job is a reduction over each sample's rows, a combination of the
// threads' partials, an elementwise pass over the rows and the rewrite of exactly recomputed groups.
//   Scratch            per-thread buffers (constructed by each thread from the job)
//   part_len()         values of one thread's partial of one sample
//   begin(n, sc)       per-sample set-up of the thread's scratch (before reduce)
//   reduce(n, lo, hi, part, sc)    partial over the rows [lo, hi)
//   finish(n, parts, k, owner, sc) combines k partials in thread order into sc's coefficients, the
//                      owner publishes the sample's outputs; returns whether any group is exact
//   apply(n, lo, hi, sc)           the elementwise pass (kApply)
//   exact(n, g, sc)    rewrites group g if sc marks it exact
template <class Job>
void run_samples(const Job& job, int64_t N, int64_t S, int64_t C) {
  using Part = typename Job::Part;
  const Plan pl = make_plan(N, S * C);
  const size_t len = job.part_len(), nt = static_cast<size_t>(pl.nt);
  if (!pl.coop) {
    std::vector<Part> part(nt * len);
#pragma omp parallel num_threads(pl.nt) if (pl.nt > 1)
    {
      typename Job::Scratch sc(job);
      Part* mine = part.data() + thread_id() * len;
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        job.begin(n, sc);
        job.reduce(n, 0, S, mine, sc);
        const bool any_exact = job.finish(n, mine, 1, true, sc);
        if (Job::kApply) job.apply(n, 0, S, sc);
        if (any_exact)
          for (int64_t g = 0; g < job.G; ++g) job.exact(n, g, sc);
      }
      job.end_thread();
    }
    return;
  }
  std::vector<Part> part(2 * nt * len);
#pragma omp parallel num_threads(pl.nt)
  {
    typename Job::Scratch sc(job);
    const int t = thread_id(), T_ = num_threads();
    int64_t lo, hi;
    row_slice(S, t, T_, &lo, &hi);
    for (int64_t n = 0; n < N; ++n) {
      Part* base = part.data() + (n & 1) * nt * len;
      job.begin(n, sc);
      job.reduce(n, lo, hi, base + t * len, sc);
      barrier();
      const bool any_exact = job.finish(n, base, T_, t == 0, sc);  // same partials in every thread
      if (Job::kApply) job.apply(n, lo, hi, sc);
      if (any_exact) {
        if (Job::kApply) barrier();  // the fast pass has written every row of the sample
        for (int64_t g = t; g < job.G; g += T_) job.exact(n, g, sc);
      }
    }
    job.end_thread();
  }
}

// Per-group statistics of rows of C channels in G groups of D: the reduction of the channels-last
// forward and gn_moments. Per chunk of rows, every channel's exact (mean, M2) (column sums, then
// the centred column M2 in a second read of the L1-resident chunk), merged into per-channel running
// states with Chan's update (all channels hold the same count: vector loops, one division per
// chunk); at the end the D channel states of each group merge into w[g]: the rows [lo, hi) of
// sample n. Rows lie ld apart (ld > C: x is a block of C channels of wider rows; fp32 / fp64 only).
template <typename T>
struct RowStats {
  using A = AccT<T>;
  const simd::Prims<T>& P;
  const simd::RowPrims<A>& R;
  const T* x;
  int64_t S, C, G, D, ld;

  struct Buffers {
    std::vector<A> buf, col, mu, mean, m2;
    Buffers(int64_t C)
        : buf(RowIo<T>::kSame ? 0 : chunk_rows(C) * C), col(C), mu(C), mean(C), m2(C) {}
  };

  void reduce(int64_t n, int64_t lo, int64_t hi, Welford<A>* w, Buffers& b) const {
    const RowIo<T> io{P};
    const int64_t rows = chunk_rows(C);
    int64_t have = 0;  // rows merged into b.mean / b.m2
    for (int64_t r0 = lo; r0 < hi; r0 += rows) {
      const int64_t rr = std::min(rows, hi - r0);
      const A* xr = io.in(x + (n * S + r0) * ld, b.buf.data(), rr * C);
      A* cm = have ? b.mu.data() : b.mean.data();  // the first chunk is the state
      A* cm2 = have ? b.col.data() : b.m2.data();
      R.col_sum(xr, rr, C, ld, A(1) / static_cast<A>(rr), cm);
      R.col_m2(xr, rr, C, ld, cm, cm2);
      if (have) {
        const A na = static_cast<A>(have), nb = static_cast<A>(rr), tot = na + nb;
        R.chan_merge(b.mean.data(), b.m2.data(), cm, cm2, C, nb / tot, na * nb / tot);
      }
      have += rr;
    }
    const A cnt = static_cast<A>(have);
    for (int64_t g = 0; g < G; ++g) {
      w[g] = Welford<A>();
      if (have == 0) continue;
      for (int64_t c = g * D; c < (g + 1) * D; ++c)
        w[g].merge(make_welford<A>(cnt, b.mean[c], b.m2[c]));
    }
  }
};

// gn_moments on channels-last data: reduction only.
template <typename T>
struct MomentsRowsJob {
  using A = AccT<T>;
  using Part = Welford<A>;
  static constexpr bool kApply = false;
  RowStats<T> st;
  A* mean;
  A* var;
  int64_t G;
  GroupDims dims;

  struct Scratch : RowStats<T>::Buffers {
    explicit Scratch(const MomentsRowsJob& j) : RowStats<T>::Buffers(j.st.C) {}
  };
  size_t part_len() const { return static_cast<size_t>(G); }
  void begin(int64_t, Scratch&) const {}
  void reduce(int64_t n, int64_t lo, int64_t hi, Part* p, Scratch& sc) const {
    st.reduce(n, lo, hi, p, sc);
  }
  bool finish(int64_t n, const Part* parts, int k, bool owner, Scratch&) const {
    if (!owner) return false;
    const int64_t M = dims.D * dims.S;
    for (int64_t g = 0; g < G; ++g) {
      Welford<A> w;
      for (int u = 0; u < k; ++u) w.merge(parts[u * G + g]);
      const int64_t ng = n * G + g;
      mean[ng] = w.mean;
      var[ng] = w.var();
      if (gn_exact_moments<T>(w.mean, w.var(), M))
        exact_moments(st.x + group_offset(dims, n, g), group_walk(dims), mean + ng, var + ng);
    }
    return false;
  }
  void apply(int64_t, int64_t, int64_t, Scratch&) const {}
  void exact(int64_t, int64_t, Scratch&) const {}
  void end_thread() const {}
};

// gn_group_norm forward on channels-last data.
template <typename T, Act ACT>
struct FwdRowsJob {
  using A = AccT<T>;
  using Part = Welford<A>;
  static constexpr bool kApply = true;
  RowStats<T> st;
  T* y;
  A* mean;
  A* rstd;
  const A* gam;
  const A* bet;
  int64_t G;
  GroupDims dims;
  double eps;
  A eps_acc;
  bool nt;  // streaming stores (fp32 / fp64 data only: stream_rows)

  struct Scratch : RowStats<T>::Buffers {
    std::vector<A> a, b, ob;  // ob: the chunk streamed out (nt)
    std::vector<char> ex;     // group is recomputed exactly
    explicit Scratch(const FwdRowsJob& j)
        : RowStats<T>::Buffers(j.st.C),
          a(j.st.C),
          b(j.st.C),
          ob(j.nt ? chunk_rows(j.st.C) * j.st.C : 0),
          ex(j.G) {}
  };
  size_t part_len() const { return static_cast<size_t>(G); }
  void begin(int64_t, Scratch&) const {}
  void reduce(int64_t n, int64_t lo, int64_t hi, Part* p, Scratch& sc) const {
    st.reduce(n, lo, hi, p, sc);
  }
  bool finish(int64_t n, const Part* parts, int k, bool owner, Scratch& sc) const {
    const int64_t D = dims.D, M = D * dims.S;
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      Welford<A> w;
      for (int u = 0; u < k; ++u) w.merge(parts[u * G + g]);
      const A r = gn_rstd<A>(w.var(), eps_acc);
      const bool ex = gn_exact_group<T>(w.mean, r, M);
      sc.ex[g] = ex;
      any = any || ex;
      if (owner && !ex) {
        mean[n * G + g] = w.mean;
        rstd[n * G + g] = r;
      }
      for (int64_t c = g * D; c < (g + 1) * D; ++c) gn_fwd_coeffs<A>(w.mean, r, gam[c], bet[c], &sc.a[c], &sc.b[c]);
    }
    return any;
  }
  void apply(int64_t n, int64_t lo, int64_t hi, Scratch& sc) const {
    const RowIo<T> io{st.P};
    const int64_t C = st.C, rows = chunk_rows(C);
    for (int64_t k = (hi - lo + rows - 1) / rows - 1; k >= 0; --k) {  // backwards: L2 first
      const int64_t r0 = lo + k * rows, rr = std::min(rows, hi - r0), off = (n * st.S + r0) * C;
      const A* xr = io.in(st.x + off, sc.buf.data(), rr * C);
      A* yr = nt ? sc.ob.data() : io.out(y + off, sc.buf.data());
      st.R.affine[static_cast<int>(ACT)](xr, yr, rr, C, C, sc.a.data(), sc.b.data());
      if (nt)
        st.R.stream(yr, reinterpret_cast<A*>(y + off), rr * C);
      else
        io.flush(yr, y + off, rr * C);
    }
    if (nt) st.P.fence();  // before the barrier that precedes exact rewrites and the caller
  }
  void exact(int64_t n, int64_t g, Scratch& sc) const {
    if (!sc.ex[g]) return;
    const int64_t off = group_offset(dims, n, g);
    exact_fwd<T, ACT>(st.x + off, y + off, group_walk(dims), eps, gam + g * dims.D,
                      bet + g * dims.D, mean + n * G + g, rstd + n * G + g);
  }
  void end_thread() const {}
};

// gn_group_norm's input gradient (and the per-(n, c) sums of the parameter gradients) on
// channels-last data. The partial of a thread is 2*C sums: s1[c] = sum g (x - mu), s2[c] = sum g.
template <typename T, Act ACT>
struct BwdRowsJob {
  using A = AccT<T>;
  using Part = A;
  static constexpr bool kApply = true;
  const simd::Prims<T>& P;
  const simd::RowPrims<A>& R;
  const T* x;
  const T* dy;
  T* dx;
  const A* mean;
  const A* rstd;
  const A* dmean_o;  // (N, G) or nullptr (= 0)
  const A* drstd_o;
  const A* gam;
  const A* bet;
  BwdSums<A> sums;
  int64_t G;
  GroupDims dims;
  double eps;

  struct Scratch {
    std::vector<A> bx, bg, mu, a, b, c1, c2, c3, t1, t2;
    std::vector<char> ex;
    explicit Scratch(const BwdRowsJob& j) {
      const int64_t C = j.dims.C, buf = RowIo<T>::kSame ? 0 : chunk_rows(C) * C;
      bx.resize(buf);
      bg.resize(buf);
      for (auto* v : {&mu, &a, &b, &c1, &c2, &c3, &t1, &t2}) v->resize(C);
      ex.resize(j.G);
    }
  };
  size_t part_len() const { return 2 * static_cast<size_t>(dims.C); }
  // The per-channel mean and pre-activation coefficients from the saved statistics.
  void begin(int64_t n, Scratch& sc) const {
    const int64_t D = dims.D;
    for (int64_t g = 0; g < G; ++g) {
      const A mu = mean[n * G + g], r = rstd[n * G + g];
      sc.ex[g] = gn_exact_group<T>(mu, r, D * dims.S);
      for (int64_t c = g * D; c < (g + 1) * D; ++c) {
        sc.mu[c] = mu;
        gn_fwd_coeffs<A>(mu, r, gam[c], bet[c], &sc.a[c], &sc.b[c]);
      }
    }
  }
  void reduce(int64_t n, int64_t lo, int64_t hi, A* p, Scratch& sc) const {
    const RowIo<T> io{P};
    const int64_t C = dims.C, rows = chunk_rows(C);
    std::fill(p, p + 2 * C, A(0));
    for (int64_t r0 = lo; r0 < hi; r0 += rows) {
      const int64_t rr = std::min(rows, hi - r0), off = (n * dims.S + r0) * C;
      const A* xr = io.in(x + off, sc.bx.data(), rr * C);
      const A* gr = io.in(dy + off, sc.bg.data(), rr * C);
      // each chunk's sums first, then added: shorter running sums over long sequences of rows
      std::fill(sc.t1.begin(), sc.t1.end(), A(0));
      std::fill(sc.t2.begin(), sc.t2.end(), A(0));
      R.sums[static_cast<int>(ACT)](xr, gr, rr, C, C, sc.mu.data(), sc.a.data(), sc.b.data(),
                                     sc.t1.data(), sc.t2.data());
      for (int64_t c = 0; c < C; ++c) {
        p[c] += sc.t1[c];
        p[C + c] += sc.t2[c];
      }
    }
  }
  bool finish(int64_t n, const A* parts, int k, bool owner, Scratch& sc) const {
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      finish_group(n, g, parts, k, owner, sc);
      any = any || sc.ex[g];
    }
    return any;
  }
  // Group g's dx coefficients from k partials (each 2*C sums, channels of all groups).
  void finish_group(int64_t n, int64_t g, const A* parts, int k, bool owner, Scratch& sc) const {
    const int64_t C = dims.C, D = dims.D, M = D * dims.S;
    {
      const A r = rstd[n * G + g];
      A sum_a = 0, sum_b = 0;
      for (int64_t c = g * D; c < (g + 1) * D; ++c) {
        A p1 = parts[c], p2 = parts[C + c];
        for (int u = 1; u < k; ++u) {
          p1 += parts[u * 2 * C + c];
          p2 += parts[u * 2 * C + C + c];
        }
        if (owner && !sc.ex[g]) {
          sums.dsc[n * C + c] = p1 * r;
          sums.db[n * C + c] = p2;
        }
        sum_a += gam[c] * p1;
        sum_b += gam[c] * p2;
      }
      A c2, c3;
      const A dmo = dmean_o ? dmean_o[n * G + g] : A(0), dro = drstd_o ? drstd_o[n * G + g] : A(0);
      gn_bwd_coeffs<A>(sum_a, sum_b, r, A(1) / static_cast<A>(M), dmo, dro, &c2, &c3);
      for (int64_t c = g * D; c < (g + 1) * D; ++c) {
        sc.c1[c] = r * gam[c];
        sc.c2[c] = c2;
        sc.c3[c] = c3;
      }
    }
  }
  void apply(int64_t n, int64_t lo, int64_t hi, Scratch& sc) const {
    const RowIo<T> io{P};
    const int64_t C = dims.C, rows = chunk_rows(C);
    for (int64_t r0 = lo; r0 < hi; r0 += rows) {
      const int64_t rr = std::min(rows, hi - r0), off = (n * dims.S + r0) * C;
      const A* xr = io.in(x + off, sc.bx.data(), rr * C);
      const A* gr = io.in(dy + off, sc.bg.data(), rr * C);
      A* dr = io.out(dx + off, sc.bg.data());
      R.dx[static_cast<int>(ACT)](xr, gr, dr, rr, C, C, sc.mu.data(), sc.a.data(), sc.b.data(),
                                   sc.c1.data(), sc.c2.data(), sc.c3.data());
      io.flush(dr, dx + off, rr * C);
    }
  }
  void exact(int64_t n, int64_t g, Scratch& sc) const {
    if (!sc.ex[g]) return;
    const int64_t off = group_offset(dims, n, g), ng = n * G + g, c = g * dims.D;
    exact_bwd<T, ACT>(x + off, dy + off, dx + off, group_walk(dims), eps, gam + c, bet + c,
                      dmean_o ? dmean_o[ng] : A(0), drstd_o ? drstd_o[ng] : A(0),
                      sums.dsc + n * dims.C + c, sums.db + n * dims.C + c);
  }
  void end_thread() const {}
};

// Samples whose groups all have at most kGnExactGroup elements: every group recomputed exactly.
template <typename F>
void for_all_groups(int64_t NG, F&& f) {
  const int nt = NG * kGnExactGroup >= kMinParallel ? team_size() : 1;
  (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t ng = 0; ng < NG; ++ng) f(ng);
}

template <typename T>
void moments_rows(const MomentsArgs& a) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const MomentsRowsJob<T> job{{simd::prims<T>(), simd::rows<A>(), static_cast<const T*>(a.x), d.S,
                               d.C, d.G, d.D, d.C},
                              static_cast<A*>(a.mean), static_cast<A*>(a.var), d.G, d};
  run_samples(job, d.N, d.S, d.C);
}

template <typename T>
void moments_bwd_rows(const MomentsBwdArgs& a) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const simd::Prims<T>& P = simd::prims<T>();
  const simd::RowPrims<A>& R = simd::rows<A>();
  const T* x = static_cast<const T*>(a.x);
  T* dx = static_cast<T*>(a.dx);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  const A* mean = static_cast<const A*>(a.mean);
  const A inv_m = A(1) / static_cast<A>(d.D * d.S);
  const int64_t C = d.C, rows = chunk_rows(C), chunks = (d.S + rows - 1) / rows;
  const int nt = d.N * d.S * C >= kMinParallel ? team_size() : 1;
  (void)nt;  // read by the pragma only
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const RowIo<T> io{P};
    std::vector<A> buf(RowIo<T>::kSame ? 0 : rows * C), mu(C), c0(C), c1(C), zero(C, A(0));
    int64_t last = -1;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < d.N * chunks; ++k) {
      const int64_t n = k / chunks, r0 = (k % chunks) * rows, rr = std::min(rows, d.S - r0);
      if (n != last) {  // dx = c0 + c1 (x - mu): the dx loop with a zero dy coefficient
        for (int64_t g = 0; g < d.G; ++g) {
          A k0, k1;
          gn_moments_bwd_coeffs<A>(dmean[n * d.G + g], dvar[n * d.G + g], inv_m, &k0, &k1);
          for (int64_t c = g * d.D; c < (g + 1) * d.D; ++c) {
            mu[c] = mean[n * d.G + g];
            c0[c] = k0;
            c1[c] = k1;
          }
        }
        last = n;
      }
      const int64_t off = (n * d.S + r0) * C;
      const A* xr = io.in(x + off, buf.data(), rr * C);
      A* dr = io.out(dx + off, buf.data());
      R.dx[0](xr, xr, dr, rr, C, C, mu.data(), nullptr, nullptr, zero.data(), c1.data(), c0.data());
      io.flush(dr, dx + off, rr * C);
    }
  }
}

template <typename T, Act ACT>
void fwd_rows(const GroupNormFwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const FwdRowsJob<T, ACT> job{{simd::prims<T>(), simd::rows<A>(), static_cast<const T*>(a.x), d.S,
                                d.C, d.G, d.D, d.C},
                               static_cast<T*>(a.y), static_cast<A*>(a.mean),
                               static_cast<A*>(a.rstd), gam, bet, d.G, d, a.eps,
                               static_cast<A>(a.eps),
                               stream_rows<T>(d, kStreamBytesFwd)};
  if (d.D * d.S <= kGnExactGroup) {
    for_all_groups(d.N * d.G, [&](int64_t ng) {
      const int64_t off = group_offset(d, ng / d.G, ng % d.G), c = (ng % d.G) * d.D;
      exact_fwd<T, ACT>(job.st.x + off, job.y + off, group_walk(d), a.eps, gam + c, bet + c,
                        job.mean + ng, job.rstd + ng);
    });
    return;
  }
  run_samples(job, d.N, d.S, d.C);
}

template <typename T, Act ACT>
void bwd_input_rows(const GroupNormBwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const BwdRowsJob<T, ACT> job{simd::prims<T>(),
                               simd::rows<A>(),
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
                               d.G,
                               d,
                               a.eps};
  if (d.D * d.S <= kGnExactGroup) {
    for_all_groups(d.N * d.G, [&](int64_t ng) {
      const int64_t off = group_offset(d, ng / d.G, ng % d.G), c = (ng % d.G) * d.D;
      exact_bwd<T, ACT>(job.x + off, job.dy + off, job.dx + off, group_walk(d), a.eps, gam + c,
                        bet + c, job.dmean_o ? job.dmean_o[ng] : A(0),
                        job.drstd_o ? job.drstd_o[ng] : A(0), job.sums.dsc + (ng / d.G) * d.C + c,
                        job.sums.db + (ng / d.G) * d.C + c);
    });
    return;
  }
  run_samples(job, d.N, d.S, d.C);
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
    dispatch_act(a.act, [&](auto act) {
      if (a.dims.channels_last)
        fwd_rows<T, decltype(act)::value>(a, gam.data(), bet.data());
      else
        fwd_typed<T, decltype(act)::value>(a, gam.data(), bet.data());
    });
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
    dispatch_act(a.act, [&](auto act) {
      if (a.dims.channels_last)
        bwd_input_rows<T, decltype(act)::value>(a, gam.data(), bet.data());
      else
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
      moments_rows<decltype(tag)>(a);
    else
      moments_typed<decltype(tag)>(a);
  });
}

const char* moments_bwd_cpu(const MomentsBwdArgs& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return cpu::dispatch_data(a.dtype, [&](auto tag) {
    if (a.dims.channels_last)
      moments_bwd_rows<decltype(tag)>(a);
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
