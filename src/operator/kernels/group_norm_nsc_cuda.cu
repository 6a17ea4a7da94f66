/*
 * group_norm_nsc_cuda.cu: CUDA kernels of gn_moments and gn_group_norm for channels-last data
 * (GroupDims::channels_last: (N, S, C) memory, the ops' axis = -1); group_norm_cuda.cu's entry
 * points hand such data here. The twin of group_norm_nsc_cpu.cc: the formulas of
 * group_norm_math.h, the same exact-group rule (gn_exact_group / gn_exact_moments) with the same
 * float64 path, per element.
 *
 * A group (n, g) is D contiguous channels at each of S positions. The reductions run along channels
 * of rows instead of along groups: the work item of the reduction kernels is (sample n, row chunk k,
 * channel c), one thread each, consecutive threads on consecutive channels of a row (coalesced
 * loads of whole rows); K row chunks per sample (nsc_plan: enough items for two waves of threads,
 * at least kMinRows rows each).
 *   Statistics (gn_moments, forward): the thread's rows of its channel, exact-centred (sum, then
 *     the centred M2 in a second, cached read) -> a (count, mean, M2) state per item in the
 *     workspace; a warp per group merges its K*D states (Chan's update, fixed lane order, shuffles)
 *     and writes mean/rstd (mean/var). Groups gn_exact_group selects are recomputed by that warp in
 *     float64 around their first element (x0, d = mean - x0, rstd: the CPU's exact_stats), kept in
 *     the workspace for the elementwise kernel.
 *   Forward output: elementwise, y = act(x * a_c + b_c) from the group's statistics, or the float64
 *     path for an exact group.
 *   Backward: a warp per group re-makes the exact decision from the saved statistics (and
 *     recomputes those groups' float64 statistics); per item the sums s1 = sum g (x - mu),
 *     s2 = sum g (float64, around x0, for exact groups); a warp per group adds them over K into the
 *     per-(n, c) sums (dsc = s1 r, db = s2: the parameter gradients' rows) and the group's c2, c3;
 *     then dx elementwise; dgamma / dbeta sum the (n, c) rows over n, one thread per channel, in
 *     order (deterministic).
 * Warp decisions are taken on values every lane holds bit-identically (bcast_lane0: lane 0's value,
 * added to zeros), so a warp never diverges on an exact-group decision.
 * Launches: forward 3 (statistics, merge, apply), backward 5 (+1 for the parameter gradients),
 * gn_moments 2, its backward 1. Offsets are 64-bit. No shared memory, no atomics.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "group_norm.h"
#include "group_norm_math.h"
#include "group_norm_nsc_cuda.h"
#include "cuda_common.cuh"
#include "../common/carver.h"
#include "../common/dispatch.h"
#include "../common/welford.h"

namespace gn_mx {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr int64_t kMinRows = 8;  // rows per reduction item at least (amortizes the item's merge)

// K row chunks of R rows per sample: about two waves of threads (2048 resident per SM) of items.
struct NscPlan {
  int64_t K = 1, R = 1;
};

const char* nsc_plan(const GroupDims& d, NscPlan* p) {
  int sms = 1;
  if (const char* e = sm_count(&sms)) return e;
  const int64_t want = int64_t(2) * sms * 2048;
  const int64_t items = d.N * d.C;
  int64_t K = std::max<int64_t>(1, ceil_div(want, items));
  K = std::min(K, std::max<int64_t>(1, d.S / kMinRows));
  p->R = ceil_div(d.S, K);
  p->K = ceil_div(d.S, p->R);
  return nullptr;
}

// Float64 statistics of the exactly recomputed groups: x0, d = mean - x0, r (rstd), flag (1: exact).
constexpr int kExactVals = 4;

// The workspace, one layout (WorkspaceCarver: with ws == nullptr it only measures):
//   part   N*K*C items: statistics (count, mean, M2) in AccT, or backward sums (s1, s2) in float64
//          (an exact group's float64 sums, up to 1e38 * rows, must not be rounded to float32)
//   exact  N*G groups of kExactVals doubles
//   coef   N*G groups of (c2, c3) doubles (backward)
//   dsc, db  (N, C) AccT each: the parameter gradients' per-sample rows (backward)
template <typename A>
struct NscWs {
  void* part;
  double* exact;
  double* coef;
  A* dsc;
  A* db;
};
template <typename A>
NscWs<A> carve_nsc(void* ws, const GroupDims& d, const NscPlan& p, size_t* bytes = nullptr) {
  WorkspaceCarver<16> w{static_cast<char*>(ws)};
  NscWs<A> s;
  s.part = w.take<double>(static_cast<size_t>(d.N * p.K * d.C * 3));
  s.exact = w.take<double>(static_cast<size_t>(d.N * d.G * kExactVals));
  s.coef = w.take<double>(static_cast<size_t>(d.N * d.G * 2));
  s.dsc = w.take<A>(static_cast<size_t>(d.N * d.C));
  s.db = w.take<A>(static_cast<size_t>(d.N * d.C));
  if (bytes) *bytes = w.off;
  return s;
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }

// Lane 0's value in every lane, bit-identical (added to the other lanes' zeros).
template <typename V>
__device__ __forceinline__ V bcast_lane0(V v) {
  return warp_sum(lane_id() == 0 ? v : V(0));
}
template <typename A>
__device__ __forceinline__ Welford<A> bcast_lane0(const Welford<A>& w) {
  return make_welford<A>(bcast_lane0(w.count), bcast_lane0(w.mean), bcast_lane0(w.m2));
}

// Element (n, c, s) of (N, S, C) data.
__device__ __forceinline__ int64_t at(int64_t n, int64_t s, int64_t c, int64_t S, int64_t C) {
  return (n * S + s) * C + c;
}

// The warp's float64 statistics of group (n, g) around its first element
// (group_norm_cpu_common.h's exact_stats): every lane gets x0, d, r (and the variance),
// bit-identical.
template <typename T>
__device__ void warp_exact_stats(const T* x, int64_t n, int64_t g, const GroupDims& dm, double eps,
                                 double* x0, double* d, double* r, double* var) {
  const int64_t D = dm.D, M = D * dm.S;
  const double first = static_cast<double>(to_acc(x[at(n, 0, g * D, dm.S, dm.C)]));
  double s = 0;
  for (int64_t i = lane_id(); i < M; i += kWarpSize)
    s += static_cast<double>(to_acc(x[at(n, i / D, g * D + i % D, dm.S, dm.C)])) - first;
  const double dd = bcast_lane0(warp_sum(s)) / static_cast<double>(M);
  double q = 0;
  for (int64_t i = lane_id(); i < M; i += kWarpSize) {
    const double v =
        (static_cast<double>(to_acc(x[at(n, i / D, g * D + i % D, dm.S, dm.C)])) - first) - dd;
    q += v * v;
  }
  const double v = bcast_lane0(warp_sum(q)) / static_cast<double>(M);
  *x0 = first;
  *d = dd;
  *var = v;
  *r = 1.0 / sqrt(v + eps);
}

// ------------------------------------------------------------------------------------------------
// Statistics

// One item (n, k, c): the exact (count, mean, M2) of rows [k R, min(S, (k+1) R)) of channel c.
template <typename T>
__global__ void __launch_bounds__(kThreads) nsc_stats_kernel(const T* __restrict__ x, GroupDims dm, NscPlan p,
                                 AccT<T>* __restrict__ part) {
  using A = AccT<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= dm.N * p.K * dm.C) return;
  const int64_t c = i % dm.C, nk = i / dm.C, k = nk % p.K, n = nk / p.K;
  const int64_t s0 = k * p.R, s1 = s0 + p.R < dm.S ? s0 + p.R : dm.S;
  A sum = 0;
  for (int64_t s = s0; s < s1; ++s) sum += to_acc(x[at(n, s, c, dm.S, dm.C)]);
  const A cnt = static_cast<A>(s1 - s0), mu = sum / cnt;
  A m2 = 0;
  for (int64_t s = s0; s < s1; ++s) {
    const A v = to_acc(x[at(n, s, c, dm.S, dm.C)]) - mu;
    m2 += v * v;
  }
  A* o = part + i * 3;
  o[0] = cnt;
  o[1] = mu;
  o[2] = m2;
}

// kMoments: mean/var (gn_moments) else mean/rstd. A warp per group (n, g): merges the group's K*D
// item states, decides whether it is recomputed in float64 and writes its statistics (and, for
// the forward, its exact record).
template <typename T, bool kMoments>
__global__ void __launch_bounds__(kThreads) nsc_merge_kernel(const T* __restrict__ x, GroupDims dm, NscPlan p,
                                 const AccT<T>* __restrict__ part, double eps, AccT<T>* mean,
                                 AccT<T>* second, double* exact) {
  using A = AccT<T>;
  const int64_t ng = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (ng >= dm.N * dm.G) return;  // whole warps leave together
  const int64_t n = ng / dm.G, g = ng % dm.G, D = dm.D, M = D * dm.S;
  Welford<A> w;
  for (int64_t j = lane_id(); j < p.K * D; j += kWarpSize) {
    const int64_t k = j / D, c = g * D + j % D;
    const A* q = part + ((n * p.K + k) * dm.C + c) * 3;
    w.merge(make_welford<A>(q[0], q[1], q[2]));
  }
  w = bcast_lane0(warp_welford(w));
  const A var = w.var(), r = gn_rstd<A>(var, static_cast<A>(eps));
  const bool ex = kMoments ? gn_exact_moments<T>(w.mean, var, M) : gn_exact_group<T>(w.mean, r, M);
  double x0 = 0, d = 0, rr = 0, v = 0;
  if (ex) warp_exact_stats(x, n, g, dm, kMoments ? 0.0 : eps, &x0, &d, &rr, &v);
  if (lane_id() != 0) return;
  mean[ng] = ex ? static_cast<A>(x0 + d) : w.mean;
  if (kMoments) {
    second[ng] = ex ? static_cast<A>(v) : var;
  } else {
    second[ng] = ex ? static_cast<A>(rr) : r;
    double* e = exact + ng * kExactVals;
    e[0] = x0;
    e[1] = d;
    e[2] = rr;
    e[3] = ex ? 1.0 : 0.0;
  }
}

// ------------------------------------------------------------------------------------------------
// Forward output

template <typename T, typename P, Act ACT>
__global__ void __launch_bounds__(kThreads) nsc_apply_kernel(const T* __restrict__ x, const P* __restrict__ gamma,
                                 const P* __restrict__ beta, const AccT<T>* __restrict__ mean,
                                 const AccT<T>* __restrict__ rstd, const double* __restrict__ exact,
                                 GroupDims dm, T* __restrict__ y) {
  using A = AccT<T>;
  const int64_t total = dm.N * dm.S * dm.C, step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t c = i % dm.C, n = i / (dm.S * dm.C), ng = n * dm.G + c / dm.D;
    const double* e = exact + ng * kExactVals;
    if (e[3] != 0.0) {  // the float64 path (group_norm_cpu_common.h exact_fwd)
      const double xc = gn_exact_xc(static_cast<double>(to_acc(x[i])), e[0], e[1]);
      const double sc = gn_exact_xhat_scale(e[2], dm.D * dm.S);
      y[i] = from_acc<T>(static_cast<A>(gn_act<ACT>(gn_exact_z(
          xc, sc, static_cast<double>(to_acc(gamma[c])), static_cast<double>(to_acc(beta[c]))))));
      continue;
    }
    A a, b;
    gn_fwd_coeffs<A>(mean[ng], rstd[ng], static_cast<A>(to_acc(gamma[c])),
                     static_cast<A>(to_acc(beta[c])), &a, &b);
    y[i] = from_acc<T>(gn_act<ACT>(to_acc(x[i]) * a + b));
  }
}

// ------------------------------------------------------------------------------------------------
// Backward

// A warp per group: the exact decision from the saved statistics and, for those groups, the
// float64 statistics recomputed from x (as the CPU's exact_bwd).
template <typename T>
__global__ void __launch_bounds__(kThreads) nsc_bwd_exact_kernel(const T* __restrict__ x, const AccT<T>* __restrict__ mean,
                                     const AccT<T>* __restrict__ rstd, GroupDims dm, double eps,
                                     double* exact) {
  const int64_t ng = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (ng >= dm.N * dm.G) return;
  const bool ex = gn_exact_group<T>(mean[ng], rstd[ng], dm.D * dm.S);
  double x0 = 0, d = 0, r = 0, v = 0;
  if (ex) warp_exact_stats(x, ng / dm.G, ng % dm.G, dm, eps, &x0, &d, &r, &v);
  if (lane_id() != 0) return;
  double* e = exact + ng * kExactVals;
  e[0] = x0;
  e[1] = d;
  e[2] = r;
  e[3] = ex ? 1.0 : 0.0;
}

// One item (n, k, c): s1 = sum g (x - mu), s2 = sum g over its rows, g = dy act'(z); exact groups
// in float64 around x0 (s1 = sum g xc).
template <typename T, typename P, Act ACT>
__global__ void __launch_bounds__(kThreads) nsc_bwd_sums_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                    const AccT<T>* __restrict__ mean,
                                    const AccT<T>* __restrict__ rstd, const P* __restrict__ gamma,
                                    const P* __restrict__ beta, const double* __restrict__ exact,
                                    GroupDims dm, NscPlan p, double* __restrict__ part) {
  using A = AccT<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= dm.N * p.K * dm.C) return;
  const int64_t c = i % dm.C, nk = i / dm.C, k = nk % p.K, n = nk / p.K, ng = n * dm.G + c / dm.D;
  const int64_t s0 = k * p.R, s1 = s0 + p.R < dm.S ? s0 + p.R : dm.S;
  const double* e = exact + ng * kExactVals;
  double* o = part + i * 2;
  if (e[3] != 0.0) {
    const double sc = gn_exact_xhat_scale(e[2], dm.D * dm.S);
    const double ga = static_cast<double>(to_acc(gamma[c])), be = static_cast<double>(to_acc(beta[c]));
    double t1 = 0, t2 = 0;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t j = at(n, s, c, dm.S, dm.C);
      const double xc = gn_exact_xc(static_cast<double>(to_acc(x[j])), e[0], e[1]);
      const double gv = gn_act_grad<ACT>(gn_exact_z(xc, sc, ga, be),
                                         static_cast<double>(to_acc(dy[j])));
      t1 += gv * xc;
      t2 += gv;
    }
    o[0] = t1;
    o[1] = t2;
    return;
  }
  const A mu = mean[ng], r = rstd[ng];
  A a = 1, b = 0;
  if (ACT != Act::kNone)
    gn_fwd_coeffs<A>(mu, r, static_cast<A>(to_acc(gamma[c])), static_cast<A>(to_acc(beta[c])), &a, &b);
  A t1 = 0, t2 = 0;
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t j = at(n, s, c, dm.S, dm.C);
    const A xv = to_acc(x[j]);
    const A gv = gn_act_grad<ACT>(xv * a + b, static_cast<A>(to_acc(dy[j])));
    t1 += gv * (xv - mu);
    t2 += gv;
  }
  o[0] = t1;
  o[1] = t2;
}

// A warp per group: the per-(n, c) sums over the K items (dsc = s1 r, db = s2, written to the
// (N, C) rows of the parameter gradients) and the group's c2, c3 (float64 for exact groups).
template <typename T, typename P>
__global__ void __launch_bounds__(kThreads) nsc_bwd_coef_kernel(const double* __restrict__ part, const P* __restrict__ gamma,
                                    const AccT<T>* __restrict__ rstd,
                                    const AccT<T>* __restrict__ dmean_o,
                                    const AccT<T>* __restrict__ drstd_o,
                                    const double* __restrict__ exact, GroupDims dm, NscPlan p,
                                    AccT<T>* dsc, AccT<T>* db, double* coef) {
  using A = AccT<T>;
  const int64_t ng = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (ng >= dm.N * dm.G) return;
  const int64_t n = ng / dm.G, g = ng % dm.G, D = dm.D, M = D * dm.S;
  const double* e = exact + ng * kExactVals;
  const bool ex = e[3] != 0.0;
  const double r = ex ? e[2] : static_cast<double>(rstd[ng]);
  double sa = 0, sb = 0;
  for (int64_t d = lane_id(); d < D; d += kWarpSize) {
    const int64_t c = g * D + d;
    double p1 = 0, p2 = 0;  // in order of k
    for (int64_t k = 0; k < p.K; ++k) {
      const double* q = part + ((n * p.K + k) * dm.C + c) * 2;
      p1 += q[0];
      p2 += q[1];
    }
    const double ga = static_cast<double>(to_acc(gamma[c]));
    if (M == 1) {  // x - mean = 0: d out/dx = 0 (the CPU's exact_bwd)
      dsc[n * dm.C + c] = A(0);
      db[n * dm.C + c] = static_cast<A>(p2);
      continue;
    }
    dsc[n * dm.C + c] = ex ? static_cast<A>(p1 * r) : static_cast<A>(p1) * static_cast<A>(r);
    db[n * dm.C + c] = static_cast<A>(p2);
    sa += ga * p1;
    sb += ga * p2;
  }
  sa = bcast_lane0(warp_sum(sa));
  sb = bcast_lane0(warp_sum(sb));
  if (lane_id() != 0) return;
  const double dmo = dmean_o ? static_cast<double>(dmean_o[ng]) : 0.0;
  const double dro = drstd_o ? static_cast<double>(drstd_o[ng]) : 0.0;
  double c2, c3;
  if (ex) {
    gn_bwd_coeffs<double>(sa, sb, r, 1.0 / static_cast<double>(M), dmo, dro, &c2, &c3);
  } else {
    A k2, k3;
    gn_bwd_coeffs<A>(static_cast<A>(sa), static_cast<A>(sb), static_cast<A>(r),
                     A(1) / static_cast<A>(M), static_cast<A>(dmo), static_cast<A>(dro), &k2, &k3);
    c2 = k2;
    c3 = k3;
  }
  coef[ng * 2] = c2;
  coef[ng * 2 + 1] = c3;
}

template <typename T, typename P, Act ACT>
__global__ void __launch_bounds__(kThreads) nsc_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                  const AccT<T>* __restrict__ mean,
                                  const AccT<T>* __restrict__ rstd,
                                  const AccT<T>* __restrict__ dmean_o, const P* __restrict__ gamma,
                                  const P* __restrict__ beta, const double* __restrict__ exact,
                                  const double* __restrict__ coef, GroupDims dm,
                                  T* __restrict__ dx) {
  using A = AccT<T>;
  const int64_t total = dm.N * dm.S * dm.C, step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t M = dm.D * dm.S;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t c = i % dm.C, n = i / (dm.S * dm.C), ng = n * dm.G + c / dm.D;
    const double* e = exact + ng * kExactVals;
    if (e[3] != 0.0) {  // group_norm_cpu_common.h exact_bwd
      if (M == 1) {
        dx[i] = from_acc<T>(static_cast<A>(dmean_o ? static_cast<double>(dmean_o[ng]) : 0.0));
        continue;
      }
      const double ga = static_cast<double>(to_acc(gamma[c]));
      const double be = static_cast<double>(to_acc(beta[c]));
      const double xc = gn_exact_xc(static_cast<double>(to_acc(x[i])), e[0], e[1]);
      const double gv = gn_act_grad<ACT>(gn_exact_z(xc, e[2], ga, be),
                                         static_cast<double>(to_acc(dy[i])));
      dx[i] = from_acc<T>(static_cast<A>(e[2] * ga * gv + coef[ng * 2] * xc + coef[ng * 2 + 1]));
      continue;
    }
    const A mu = mean[ng], r = rstd[ng], ga = static_cast<A>(to_acc(gamma[c]));
    A a = 1, b = 0;
    if (ACT != Act::kNone) gn_fwd_coeffs<A>(mu, r, ga, static_cast<A>(to_acc(beta[c])), &a, &b);
    const A xv = to_acc(x[i]);
    const A gv = gn_act_grad<ACT>(xv * a + b, static_cast<A>(to_acc(dy[i])));
    dx[i] = from_acc<T>(gn_bwd_dx<A>(r * ga, static_cast<A>(coef[ng * 2]),
                                     static_cast<A>(coef[ng * 2 + 1]), mu, gv, xv));
  }
}

// dgamma[c] = sum_n dsc[n, c], dbeta[c] = sum_n db[n, c], in order of n.
template <typename A, typename P>
__global__ void __launch_bounds__(kThreads) nsc_params_kernel(const A* __restrict__ dsc, const A* __restrict__ db, int64_t N,
                                  int64_t C, P* dgamma, P* dbeta) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  A sg = 0, sb = 0;
  for (int64_t n = 0; n < N; ++n) {
    sg += dsc[n * C + c];
    sb += db[n * C + c];
  }
  if (dgamma) dgamma[c] = from_acc<P>(sg);
  if (dbeta) dbeta[c] = from_acc<P>(sb);
}

// gn_moments backward: dx = c0 + c1 (x - mu).
template <typename T>
__global__ void __launch_bounds__(kThreads) nsc_moments_bwd_kernel(const T* __restrict__ x, const AccT<T>* __restrict__ mean,
                                       const AccT<T>* __restrict__ dmean,
                                       const AccT<T>* __restrict__ dvar, GroupDims dm,
                                       T* __restrict__ dx) {
  using A = AccT<T>;
  const int64_t total = dm.N * dm.S * dm.C, step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const A inv_m = A(1) / static_cast<A>(dm.D * dm.S);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t c = i % dm.C, n = i / (dm.S * dm.C), ng = n * dm.G + c / dm.D;
    A c0, c1;
    gn_moments_bwd_coeffs<A>(dmean[ng], dvar[ng], inv_m, &c0, &c1);
    dx[i] = from_acc<T>(c0 + c1 * (to_acc(x[i]) - mean[ng]));
  }
}

// ------------------------------------------------------------------------------------------------
// Launches

unsigned blocks_for(int64_t threads) { return static_cast<unsigned>(ceil_div(threads, kThreads)); }
unsigned warp_blocks(int64_t warps) { return static_cast<unsigned>(ceil_div(warps, kWarpsPerBlock)); }
// Elementwise kernels: grid-stride, at most 2^20 blocks.
unsigned map_blocks(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), int64_t(1) << 20));
}

template <typename T>
const char* stats(const T* x, const GroupDims& d, const NscPlan& p, const NscWs<AccT<T>>& w,
                  double eps,
                  bool moments, AccT<T>* mean, AccT<T>* second, cudaStream_t st) {
  using A = AccT<T>;
  A* part = static_cast<A*>(w.part);
  nsc_stats_kernel<T><<<blocks_for(d.N * p.K * d.C), kThreads, 0, st>>>(x, d, p, part);
  GN_CUDA_CHECK_LAUNCH();
  if (moments)
    nsc_merge_kernel<T, true><<<warp_blocks(d.N * d.G), kThreads, 0, st>>>(x, d, p, part, 0.0, mean,
                                                                           second, w.exact);
  else
    nsc_merge_kernel<T, false><<<warp_blocks(d.N * d.G), kThreads, 0, st>>>(x, d, p, part, eps,
                                                                            mean, second, w.exact);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
size_t workspace(const GroupDims& d) {
  NscPlan p;
  if (check_group_dims(d) || nsc_plan(d, &p)) return 0;
  size_t bytes = 0;
  carve_nsc<AccT<T>>(nullptr, d, p, &bytes);
  return bytes;
}

// Common checks of the entry points; *p gets the plan.
const char* prepare(const GroupDims& d, const void* ws, NscPlan* p) {
  if (ws == nullptr) return kGnNeedsWorkspace;
  if (!aligned16(ws)) return kGnWorkspaceAlign;
  return nsc_plan(d, p);
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

size_t nsc_moments_workspace_cuda(const MomentsArgs& a) {
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto t) { n = workspace<decltype(t)>(a.dims); });
  return n;
}
size_t nsc_fwd_workspace_cuda(const GroupNormFwdArgs& a) {
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto t) { n = workspace<decltype(t)>(a.dims); });
  return n;
}
size_t nsc_bwd_workspace_cuda(const GroupNormBwdArgs& a) {
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto t) { n = workspace<decltype(t)>(a.dims); });
  return n;
}

const char* nsc_moments_cuda(const MomentsArgs& a, void* stream) {
  NscPlan p;
  if (const char* e = prepare(a.dims, a.workspace, &p)) return e;
  return dispatch_data(a.dtype, [&](auto t) {
    using T = decltype(t);
    using A = AccT<T>;
    const NscWs<A> w = carve_nsc<A>(a.workspace, a.dims, p);
    return stats<T>(static_cast<const T*>(a.x), a.dims, p, w, 0.0, true, static_cast<A*>(a.mean),
                    static_cast<A*>(a.var), as_stream(stream));
  });
}

const char* nsc_moments_bwd_cuda(const MomentsBwdArgs& a, void* stream) {
  return dispatch_data(a.dtype, [&](auto t) -> const char* {
    using T = decltype(t);
    using A = AccT<T>;
    const GroupDims& d = a.dims;
    nsc_moments_bwd_kernel<T><<<map_blocks(d.N * d.S * d.C), kThreads, 0, as_stream(stream)>>>(
        static_cast<const T*>(a.x), static_cast<const A*>(a.mean), static_cast<const A*>(a.dmean),
        static_cast<const A*>(a.dvar), d, static_cast<T*>(a.dx));
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  });
}

const char* nsc_fwd_cuda(const GroupNormFwdArgs& a, void* stream) {
  NscPlan p;
  if (const char* e = prepare(a.dims, a.workspace, &p)) return e;
  const cudaStream_t st = as_stream(stream);
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto pt) -> const char* {
    using T = decltype(t);
    using P = decltype(pt);
    using A = AccT<T>;
    const GroupDims& d = a.dims;
    const NscWs<A> w = carve_nsc<A>(a.workspace, d, p);
    const T* x = static_cast<const T*>(a.x);
    A* mean = static_cast<A*>(a.mean);
    A* rstd = static_cast<A*>(a.rstd);
    if (const char* e = stats<T>(x, d, p, w, a.eps, false, mean, rstd, st)) return e;
    dispatch_act(a.act, [&](auto act) {
      nsc_apply_kernel<T, P, decltype(act)::value><<<map_blocks(d.N * d.S * d.C), kThreads, 0, st>>>(
          x, static_cast<const P*>(a.gamma), static_cast<const P*>(a.beta), mean, rstd, w.exact,
          d, static_cast<T*>(a.y));
    });
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  });
}

const char* nsc_bwd_cuda(const GroupNormBwdArgs& a, void* stream) {
  NscPlan p;
  if (const char* e = prepare(a.dims, a.workspace, &p)) return e;
  const cudaStream_t st = as_stream(stream);
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto pt) -> const char* {
    using T = decltype(t);
    using P = decltype(pt);
    using A = AccT<T>;
    const GroupDims& d = a.dims;
    const NscWs<A> w = carve_nsc<A>(a.workspace, d, p);
    const T* x = static_cast<const T*>(a.x);
    const T* dy = static_cast<const T*>(a.dy);
    const A* mean = static_cast<const A*>(a.mean);
    const A* rstd = static_cast<const A*>(a.rstd);
    const P* gamma = static_cast<const P*>(a.gamma);
    const P* beta = static_cast<const P*>(a.beta);
    double* part = static_cast<double*>(w.part);
    nsc_bwd_exact_kernel<T><<<warp_blocks(d.N * d.G), kThreads, 0, st>>>(x, mean, rstd, d, a.eps,
                                                                        w.exact);
    GN_CUDA_CHECK_LAUNCH();
    const char* err = nullptr;
    dispatch_act(a.act, [&](auto act) {
      constexpr Act ACT = decltype(act)::value;
      nsc_bwd_sums_kernel<T, P, ACT><<<blocks_for(d.N * p.K * d.C), kThreads, 0, st>>>(
          dy, x, mean, rstd, gamma, beta, w.exact, d, p, part);
      if ((err = cuda_error(cudaGetLastError()))) return;
      nsc_bwd_coef_kernel<T, P><<<warp_blocks(d.N * d.G), kThreads, 0, st>>>(
          part, gamma, rstd, static_cast<const A*>(a.dmean), static_cast<const A*>(a.drstd),
          w.exact, d, p, w.dsc, w.db, w.coef);
      if ((err = cuda_error(cudaGetLastError()))) return;
      nsc_bwd_dx_kernel<T, P, ACT><<<map_blocks(d.N * d.S * d.C), kThreads, 0, st>>>(
          dy, x, mean, rstd, static_cast<const A*>(a.dmean), gamma, beta, w.exact, w.coef, d,
          static_cast<T*>(a.dx));
      err = cuda_error(cudaGetLastError());
    });
    if (err) return err;
    if (a.dgamma || a.dbeta) {
      nsc_params_kernel<A, P><<<blocks_for(d.C), kThreads, 0, st>>>(
          w.dsc, w.db, d.N, d.C,
          static_cast<P*>(a.dgamma), static_cast<P*>(a.dbeta));
      GN_CUDA_CHECK_LAUNCH();
    }
    return nullptr;
  });
}

}  // namespace gn_mx
