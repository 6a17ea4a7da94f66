/*
 * group_norm_cuda.cu: CUDA kernels for gn_moments and gn_group_norm (forward and backward).
 * Twins of group_norm_cpu.cc: same entry points (plus a stream), same Args (with GroupDims) and the
 * per-element formulas of group_norm_math.h. NB, what differs from the CPU twin:
 *   - no exactly recomputed groups: the CPU recomputes groups of <= 4 elements and fp32/fp16 groups
 *     whose fp32 statistics overflow (or whose rstd^3 underflows in backward) in float64 around
 *     the first element (group_norm_cpu.cc exact_fwd / exact_bwd); here every group takes the AccT
 *     path, except one-element groups, whose output act(beta) and dx = dmean are taken exactly
 *     (FwdOp::single, BwdOp::single);
 *   - the reduction order: 16-byte vectors folded per thread, then warp / block / split merges here;
 *     L1-sized chunks of 2048 elements merged per thread, then per-thread partials, on the CPU. So
 *     the twins agree to AccT rounding, not bitwise;
 *   - no streaming-store thresholds (the CPU's kStreamBytesFwd/Bwd): the L2 keeps x between the two
 *     forward kernels instead.
 *
 * Layout (N, C, S): the group (n, g) is the contiguous run of L = D*S elements at x + (n*G + g)*L, and
 * row (n, c) is the run of S elements at x + (n*C + c)*S. Offsets inside a group are 32-bit (L < 2^31
 * is checked), group bases are 64-bit.
 *
 * Statistics (one read of x): every thread folds 16-byte vectors into a Welford state (each vector's
 * exact mean/M2 merged with Chan's update, one division per vector), then warps merge with shuffles and
 * the block through shared memory. A fixed merge tree: results are deterministic.
 * NB: when N*G cannot fill the GPU, a group is split across `splits` blocks that write partial
 * (count, mean, M2) states; the consumer (the apply kernel, or a finalize kernel for gn_moments) merges
 * them in one warp. No atomics, no E[x^2] - E[x]^2.
 *
 * Forward: stats kernel, then an apply kernel over (group, chunk) blocks: y = x * a_c + b_c. For the
 * SD-UNet shapes x (<= 21 MB) stays in the H200's 50 MB L2 between the two kernels, so DRAM sees about
 * one read of x and one write of y.
 *
 * Backward: kernel 1 reduces each row (n, c) to dsc = sum dy (x - mu) and db = sum dy (a row split
 * across blocks when rows are few and long; partial sums in the workspace); kernel 2 has one set of
 * blocks per group that fold gamma into the group sums A, B (cheap: D * splits values), then write
 * dx = c1_c dy + c2 (x - mu) + c3 over their chunk, and C/256 extra blocks that reduce dgamma/dbeta
 * over n from the same row sums. Two launches.
 *
 * Exactly recomputed groups (gn_exact_group: 1-4 elements; fp16/fp32 statistics that overflowed or
 * are not finite, rstd < 1e-12, |mean| rstd > 2^24): their float64 mean/rstd are the outputs
 * (written by the stats kernel, or by the apply kernel's first chunk for split groups), and every
 * block that meets such a group (decided again from the saved statistics) recomputes them from x in
 * float64 (exact_stats) and takes the float64 path of group_norm_cpu.cc's exact_fwd / exact_bwd;
 * rows of such groups hand dgamma their sum g xhat instead of sum g (x - mu). gn_moments: the same
 * for the groups gn_exact_moments selects (stats kernel or split-finalize kernel).
 * NB: the float64 path lives in the same kernels (no extra launch), which raised their register
 * counts (ptxas, sm_80, nvcc 13: bwd_row_sums 29-32 -> 38-48, fwd_apply 27-32 -> 32-44, stats 26 ->
 * 39 for the scalar variants; at 256 threads, more than 32 registers means fewer than 8 resident
 * blocks per SM). Not yet measured on a GPU; moving it to __noinline__ helpers measured worse.
 *
 * Fused activation (act_type, template ACT of group_norm_math.h): the apply kernel writes act(z),
 * z = x * a_c + b_c; both backward kernels recompute z from x, mean, rstd, gamma, beta and use
 * g = dy * act'(z) in place of dy (same formulas as the CPU twin; nothing extra is saved).
 *
 * fp16 is read as __half (8 per 16-byte load), widened in registers, accumulated in fp32; statistics
 * are always AccT. Every entry point returns nullptr or a static error string (cudaGetErrorString), and
 * checks cudaGetLastError after every launch. No lib_api.h here.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "group_norm.h"
#include "group_norm_math.h"
#include "cuda_common.cuh"
#include "../common/carver.h"
#include "../common/dispatch.h"
#include "../common/welford.h"

namespace gn_mx {
namespace {

constexpr int kBlock = 256;
constexpr int kWarp = kWarpSize;
constexpr int kNumWarps = kBlock / kWarp;
constexpr int kMaxSplits = 64;      // partial states per group, merged by one warp (2 per lane)
constexpr int kUnroll = 4;          // 16-byte loads in flight per thread
// The largest gridDim.y (and z) CUDA allows: the chunks of one group of an elementwise kernel.
constexpr int64_t kMaxGridY = 65535;
// Backward row sums: the team per row (n, c) of S elements. A row of at most kRowThreadMaxS
// elements is one thread's job (a warp would leave at least half its lanes idle on a 16-element
// row, and the row's reduction would cost more shuffles than loads); below kRowWarpMaxS a warp per
// row gives each lane < 64 elements (16 fp32 vectors), enough to hide load latency without a block
// reduction; longer rows take a block (and split across blocks when rows are too few for the GPU).
// Chosen by these load/lane counts, not measured on a GPU (none was available to this change).
constexpr int64_t kRowThreadMaxS = 16;
constexpr int64_t kRowWarpMaxS = 2048;
constexpr int64_t kMaxGroup = (int64_t(1) << 31) - 1;
// Workspace records (carve_stats / carve_rows own the layouts): a split group's piece stores its
// Welford state (count, mean, M2); a split row's piece stores its sums (dsc, db).
constexpr int kStatsPart = 3;
constexpr int kRowPart = 2;

// ------------------------------------------------------------------------------------------------
// Device helpers

template <typename I>
__device__ __forceinline__ I imin(I a, I b) {
  return a < b ? a : b;
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

// Folds V stored values into a Welford state: the vector's exact mean/M2, then one Chan merge.
template <typename T, int V, typename A>
__device__ __forceinline__ void push_vec(Welford<A>& w, const Vec<T, V>& in) {
  A v[V];
  A sum = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    v[k] = to_acc(in.v[k]);
    sum += v[k];
  }
  const A mv = sum * (A(1) / A(V));  // V is a power of two: exact
  A m2 = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const A d = v[k] - mv;
    m2 += d * d;
  }
  w.merge(make_welford<A>(A(V), mv, m2));
}

// Welford state of elements [begin, end) of a group; V > 1 needs 16-byte aligned xg and V | begin, end.
template <typename T, int V, typename A>
__device__ __forceinline__ Welford<A> thread_moments(const T* __restrict__ xg, uint32_t begin,
                                                     uint32_t end) {
  Welford<A> w;
  if (V > 1) {
    using VT = Vec<T, V>;
    const VT* p = reinterpret_cast<const VT*>(xg);
    uint32_t i = begin / V + threadIdx.x;
    const uint32_t e = end / V;
    for (; i + (kUnroll - 1) * kBlock < e; i += kUnroll * kBlock) {
      VT r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = p[i + u * kBlock];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) push_vec<T, V, A>(w, r[u]);
    }
    for (; i < e; i += kBlock) push_vec<T, V, A>(w, p[i]);
  } else {
    for (uint32_t i = begin + threadIdx.x; i < end; i += kBlock) w.push(to_acc(xg[i]));
  }
  return w;
}

// Merges the `splits` partial states of group ng in one warp (all 32 lanes must call it).
template <typename A>
__device__ __forceinline__ Welford<A> warp_merge_partials(const A* __restrict__ part, int64_t ng,
                                                          int splits) {
  Welford<A> w;
  const int lane = threadIdx.x % kWarp;
  for (int k = lane; k < splits; k += kWarp) {
    const A* p = part + (ng * splits + k) * kStatsPart;
    w.merge(make_welford<A>(p[0], p[1], p[2]));
  }
  return warp_welford(w);
}

// ------------------------------------------------------------------------------------------------
// Exactly recomputed groups (gn_exact_group, group_norm_math.h): the twin of group_norm_cpu.cc's
// exact_fwd / exact_bwd, same float64 formulas. The rare path (tiny groups, float32 statistics that
// overflowed, NaN/Inf): scalar loads, sums over a team of kTeam consecutive threads (1, a warp or
// the block) with a fixed tree (deterministic). Every block or team that needs a group's exact
// statistics recomputes them from x, so kernels need no extra workspace or launch for them.

template <int kTeam, typename V>
__device__ __forceinline__ V team_sum(V v) {
  if constexpr (kTeam == 1) {
    return v;
  } else if constexpr (kTeam == kWarp) {
    return warp_sum<kWarp>(v);
  } else {
    static_assert(kTeam == kBlock, "team: 1, a warp or the block");
    return block_sum<kBlock>(v);
  }
}

struct ExactStats {
  double x0, d, r, var;  // mean = x0 + d, rstd = r = 1 / sqrt(var + eps)
  double s;              // xhat = xc * s (gn_exact_xhat_scale: 0 for a one-element group)
};

// Statistics of the L elements at xg around xg[0]; every thread of the team gets them.
template <int kTeam, typename T>
__device__ __forceinline__ ExactStats exact_stats(const T* __restrict__ xg, uint32_t L,
                                                  double eps) {
  const uint32_t lane = threadIdx.x % kTeam;
  ExactStats st;
  st.x0 = static_cast<double>(to_acc(xg[0]));
  double s = 0;
  for (uint32_t i = lane; i < L; i += kTeam) s += static_cast<double>(to_acc(xg[i])) - st.x0;
  st.d = team_sum<kTeam>(s) / static_cast<double>(L);
  double q = 0;
  for (uint32_t i = lane; i < L; i += kTeam) {
    const double c = gn_exact_xc(static_cast<double>(to_acc(xg[i])), st.x0, st.d);
    q += c * c;
  }
  st.var = team_sum<kTeam>(q) / static_cast<double>(L);
  st.r = 1.0 / gn_sqrt(st.var + eps);
  st.s = gn_exact_xhat_scale(st.r, L);
  return st;
}

// gamma_c, beta_c of an exactly recomputed group in float64 (beta is read only with an activation:
// the backward gets no beta without one).
template <Act ACT, typename P>
__device__ __forceinline__ void exact_params(const P* __restrict__ gamma,
                                             const P* __restrict__ beta, uint32_t c, double* ga,
                                             double* be) {
  *ga = static_cast<double>(to_acc(gamma[c]));
  *be = ACT != Act::kNone ? static_cast<double>(to_acc(beta[c])) : 0.0;
}

// g = dy * act'(z) of element i (channel i / S) of an exactly recomputed group, and its xc.
template <Act ACT, typename T, typename P>
__device__ __forceinline__ double exact_grad(const T* __restrict__ xg, const T* __restrict__ dyg,
                                             const P* __restrict__ gamma,
                                             const P* __restrict__ beta, const ExactStats& st,
                                             uint32_t i, uint32_t S, double* xc, double* ga) {
  double be;
  exact_params<ACT>(gamma, beta, i / S, ga, &be);
  *xc = gn_exact_xc(static_cast<double>(to_acc(xg[i])), st.x0, st.d);
  return gn_act_grad<ACT>(gn_exact_z(*xc, st.s, *ga, be), static_cast<double>(to_acc(dyg[i])));
}

// Forward of elements [begin, end) of an exactly recomputed group (the whole block).
template <Act ACT, typename T, typename P>
__device__ __forceinline__ void exact_fwd_range(const T* __restrict__ xg, T* __restrict__ yg,
                                                const P* __restrict__ gamma,
                                                const P* __restrict__ beta, const ExactStats& st,
                                                uint32_t begin, uint32_t end, uint32_t S) {
  for (uint32_t i = begin + threadIdx.x; i < end; i += kBlock) {
    const double ga = static_cast<double>(to_acc(gamma[i / S]));
    const double be = static_cast<double>(to_acc(beta[i / S]));
    const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[i])), st.x0, st.d);
    yg[i] = from_acc<T>(static_cast<AccT<T>>(gn_act<ACT>(gn_exact_z(xc, st.s, ga, be))));
  }
}

// Backward dx over [begin, end) of an exactly recomputed group of L elements (the whole block):
// the group sums sum gamma_c g xc and sum gamma_c g over all of it, then dx (= dmean when L = 1).
template <Act ACT, typename T, typename P>
__device__ __forceinline__ void exact_bwd_range(const T* __restrict__ xg,
                                                const T* __restrict__ dyg, T* __restrict__ dxg,
                                                const P* __restrict__ gamma,
                                                const P* __restrict__ beta, double dmean_o,
                                                double drstd_o, double eps, uint32_t L, uint32_t S,
                                                uint32_t begin, uint32_t end) {
  const ExactStats st = exact_stats<kBlock>(xg, L, eps);
  Pair<double> ab{0.0, 0.0};
  for (uint32_t i = threadIdx.x; i < L; i += kBlock) {
    double xc, ga;
    const double g = exact_grad<ACT>(xg, dyg, gamma, beta, st, i, S, &xc, &ga);
    ab.a += ga * g * xc;
    ab.b += ga * g;
  }
  ab = block_sum<kBlock>(ab);
  double c2, c3;
  gn_bwd_coeffs<double>(ab.a, ab.b, st.r, 1.0 / static_cast<double>(L), dmean_o, drstd_o, &c2,
                        &c3);
  for (uint32_t i = begin + threadIdx.x; i < end; i += kBlock) {
    double xc, ga;
    const double g = exact_grad<ACT>(xg, dyg, gamma, beta, st, i, S, &xc, &ga);
    // one element: x - mean = 0, out = act(beta): only the mean output passes dmean on
    const double dx = L == 1 ? dmean_o : gn_bwd_dx<double>(st.r * ga, c2, c3, 0.0, g, xc);
    dxg[i] = from_acc<T>(static_cast<AccT<T>>(dx));
  }
}

// ------------------------------------------------------------------------------------------------
// Forward statistics

enum StatsMode : int { kStatsPartial = 0, kStatsMeanVar = 1, kStatsMeanRstd = 2 };

// Grid (N*G, splits). Block (ng, k) covers elements [k*chunk, (k+1)*chunk) of group ng.
// kStatsMeanRstd / kStatsMeanVar (splits = 1) write the exact statistics of the groups that
// gn_exact_group / gn_exact_moments select (the apply kernel recomputes those groups' y).
template <typename T, int V>
__global__ void __launch_bounds__(kBlock)
stats_kernel(const T* __restrict__ x, int64_t L, uint32_t chunk, int mode, double eps,
             AccT<T>* __restrict__ mean, AccT<T>* __restrict__ second, AccT<T>* __restrict__ part) {
  using A = AccT<T>;
  const int64_t ng = blockIdx.x;
  const uint32_t begin = blockIdx.y * chunk;
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  Welford<A> w = thread_moments<T, V, A>(x + ng * L, begin, end);
  w = block_welford<kBlock>(w);  // every thread gets it: the exact decision is block-uniform
  const bool exact =
      (mode == kStatsMeanRstd &&
       gn_exact_group<T>(w.mean, gn_rstd(w.var(), static_cast<A>(eps)), L)) ||
      (mode == kStatsMeanVar && gn_exact_moments<T>(w.mean, w.var(), L));
  if (exact) {
    const ExactStats st = exact_stats<kBlock>(x + ng * L, static_cast<uint32_t>(L), eps);
    if (threadIdx.x == 0) {
      mean[ng] = static_cast<A>(st.x0 + st.d);
      second[ng] = static_cast<A>(mode == kStatsMeanVar ? st.var : st.r);
    }
    return;
  }
  if (threadIdx.x != 0) return;
  if (mode == kStatsPartial) {
    A* p = part + (ng * gridDim.y + blockIdx.y) * kStatsPart;
    p[0] = w.count;
    p[1] = w.mean;
    p[2] = w.m2;
  } else {
    mean[ng] = w.mean;
    second[ng] = mode == kStatsMeanVar ? w.var() : gn_rstd(w.var(), static_cast<A>(eps));
  }
}

// gn_moments with split groups: one warp per group merges the partial states (and recomputes the
// groups gn_exact_moments selects from x).
template <typename T>
__global__ void __launch_bounds__(kBlock)
moments_finalize_kernel(const AccT<T>* __restrict__ part, int splits, int64_t NG,
                        AccT<T>* __restrict__ mean, AccT<T>* __restrict__ var,
                        const T* __restrict__ x, int64_t L) {
  using A = AccT<T>;
  const int64_t ng = int64_t(blockIdx.x) * kNumWarps + threadIdx.x / kWarp;
  if (ng >= NG) return;  // whole warps leave together
  const Welford<A> w = warp_merge_partials(part, ng, splits);
  A m = w.mean, v = w.var();
  if (gn_exact_moments<T>(m, v, L)) {  // warp-uniform
    const ExactStats st = exact_stats<kWarp>(x + ng * L, static_cast<uint32_t>(L), 0.0);
    m = static_cast<A>(st.x0 + st.d);
    v = static_cast<A>(st.var);
  }
  if (threadIdx.x % kWarp == 0) {
    mean[ng] = m;
    var[ng] = v;
  }
}

// Elementwise map over elements [begin, end) of one group: out[e] = op(op.coef(channel(e)), in0[e],
// in1[e]). Vectorized when V > 1 (16-byte aligned pointers, V | begin, end); one coefficient lookup
// per vector when V | S, else the channel is tracked element by element without divisions.
template <typename T, int V, int NIn, typename Op>
__device__ __forceinline__ void map_group(const T* __restrict__ in0, const T* __restrict__ in1,
                                          T* __restrict__ out, uint32_t begin, uint32_t end,
                                          uint32_t S, const Op& op) {
  using A = AccT<T>;
  using Coef = typename Op::Coef;
  if (V > 1) {
    using VT = Vec<T, V>;
    const VT* p0 = reinterpret_cast<const VT*>(in0);
    const VT* p1 = reinterpret_cast<const VT*>(in1);
    VT* po = reinterpret_cast<VT*>(out);
    const uint32_t e = end / V;
    uint32_t i = begin / V + threadIdx.x;
    if (S % V == 0) {
      for (; i + (kUnroll - 1) * kBlock < e; i += kUnroll * kBlock) {
        VT r0[kUnroll], r1[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          r0[u] = p0[i + u * kBlock];
          if (NIn > 1) r1[u] = p1[i + u * kBlock];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const Coef cf = op.coef((i + u * kBlock) * V / S);
          VT o;
#pragma unroll
          for (int k = 0; k < V; ++k)
            o.v[k] = from_acc<T>(op(cf, to_acc(r0[u].v[k]), NIn > 1 ? to_acc(r1[u].v[k]) : A(0)));
          po[i + u * kBlock] = o;
        }
      }
      for (; i < e; i += kBlock) {
        const VT r0 = p0[i];
        VT r1;
        if (NIn > 1) r1 = p1[i];
        const Coef cf = op.coef(i * V / S);
        VT o;
#pragma unroll
        for (int k = 0; k < V; ++k)
          o.v[k] = from_acc<T>(op(cf, to_acc(r0.v[k]), NIn > 1 ? to_acc(r1.v[k]) : A(0)));
        po[i] = o;
      }
    } else {
      for (; i < e; i += kBlock) {
        const VT r0 = p0[i];
        VT r1;
        if (NIn > 1) r1 = p1[i];
        uint32_t c = i * V / S;
        uint32_t s = i * V - c * S;
        Coef cf = op.coef(c);
        VT o;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (s == S) {
            s = 0;
            cf = op.coef(++c);
          }
          o.v[k] = from_acc<T>(op(cf, to_acc(r0.v[k]), NIn > 1 ? to_acc(r1.v[k]) : A(0)));
          ++s;
        }
        po[i] = o;
      }
    }
  } else {
    for (uint32_t i = begin + threadIdx.x; i < end; i += kBlock) {
      const Coef cf = op.coef(i / S);
      out[i] = from_acc<T>(op(cf, to_acc(in0[i]), NIn > 1 ? to_acc(in1[i]) : A(0)));
    }
  }
}

template <typename P, typename A, Act ACT>
struct FwdOp {
  struct Coef {
    A a, b;
  };
  const P* gamma;  // this group's D channels
  const P* beta;
  A mu, r;
  __device__ __forceinline__ Coef coef(uint32_t c) const {
    Coef cf;
    gn_fwd_coeffs<A>(mu, r, static_cast<A>(to_acc(gamma[c])), static_cast<A>(to_acc(beta[c])),
                     &cf.a, &cf.b);
    return cf;
  }
  __device__ __forceinline__ A operator()(const Coef& cf, A x, A) const {
    return gn_act<ACT>(x * cf.a + cf.b);
  }
};

// Grid (N*G, chunks). With splits > 1 the block first merges the group's partial states (and the
// chunk-0 block publishes mean/rstd); otherwise the stats kernel already wrote them (exact ones for
// the groups gn_exact_group selects, which it then selects again here: see group_norm_math.h).
template <typename T, typename P, int V, Act ACT>
__global__ void __launch_bounds__(kBlock)
fwd_apply_kernel(const T* __restrict__ x, const P* __restrict__ gamma, const P* __restrict__ beta,
                 T* __restrict__ y, AccT<T>* __restrict__ mean, AccT<T>* __restrict__ rstd,
                 const AccT<T>* __restrict__ part, int splits, double eps, int64_t L, uint32_t S,
                 int64_t G, uint32_t D, uint32_t chunk) {
  using A = AccT<T>;
  __shared__ A s_mu, s_r;
  // NB: blocks run in reverse of the stats kernel's order, so the first ones find the x that the
  // stats kernel read last still in L2 (helps tensors larger than L2).
  const int64_t ng = gridDim.x - 1 - blockIdx.x;
  const uint32_t piece = gridDim.y - 1 - blockIdx.y;
  if (splits > 1) {
    if (threadIdx.x < kWarp) {
      const Welford<A> w = warp_merge_partials(part, ng, splits);
      if (threadIdx.x == 0) {
        s_mu = w.mean;
        s_r = gn_rstd(w.var(), static_cast<A>(eps));
      }
    }
  } else if (threadIdx.x == 0) {
    s_mu = mean[ng];
    s_r = rstd[ng];
  }
  __syncthreads();
  const A mu = s_mu, r = s_r;
  const bool publish = splits > 1 && piece == 0 && threadIdx.x == 0;
  const int64_t g = ng % G;
  const uint32_t begin = piece * chunk;
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  if (gn_exact_group<T>(mu, r, L)) {  // block-uniform
    const ExactStats st = exact_stats<kBlock>(x + ng * L, static_cast<uint32_t>(L), eps);
    if (publish) {
      mean[ng] = static_cast<A>(st.x0 + st.d);
      rstd[ng] = static_cast<A>(st.r);
    }
    exact_fwd_range<ACT>(x + ng * L, y + ng * L, gamma + g * D, beta + g * D, st, begin, end, S);
    return;
  }
  if (publish) {
    mean[ng] = mu;
    rstd[ng] = r;
  }
  FwdOp<P, A, ACT> op{gamma + g * D, beta + g * D, mu, r};
  map_group<T, V, 1>(x + ng * L, nullptr, y + ng * L, begin, end, S, op);
}

template <typename A>
struct MomentsBwdOp {
  struct Coef {};
  A mu, c0, c1;
  __device__ __forceinline__ Coef coef(uint32_t) const { return Coef{}; }
  __device__ __forceinline__ A operator()(const Coef&, A x, A) const { return c0 + c1 * (x - mu); }
};

template <typename T, int V>
__global__ void __launch_bounds__(kBlock)
moments_bwd_kernel(const T* __restrict__ x, const AccT<T>* __restrict__ mean,
                   const AccT<T>* __restrict__ dmean, const AccT<T>* __restrict__ dvar,
                   T* __restrict__ dx, int64_t L, uint32_t S, uint32_t chunk) {
  using A = AccT<T>;
  const int64_t ng = blockIdx.x;
  MomentsBwdOp<A> op;
  op.mu = mean[ng];
  gn_moments_bwd_coeffs<A>(dmean ? dmean[ng] : A(0), dvar ? dvar[ng] : A(0), A(1) / A(L), &op.c0,
                           &op.c1);
  const uint32_t begin = blockIdx.y * chunk;
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  map_group<T, V, 1>(x + ng * L, nullptr, dx + ng * L, begin, end, S, op);
}

// Row sums of an exactly recomputed group's row (n, c) over elements [begin, end), for backward
// kernel 1: (sum g xhat, sum g) on the team's lane 0 (kernel 2 then takes dgamma's share without
// multiplying by rstd), zeros on the other lanes. Every lane of the team calls it.
template <int kTeam, Act ACT, typename T, typename P>
__device__ __forceinline__ Pair<AccT<T>> exact_row_sums(const T* __restrict__ dy,
                                                        const T* __restrict__ x,
                                                        const P* __restrict__ gamma,
                                                        const P* __restrict__ beta, int64_t row,
                                                        int64_t C, uint32_t S, uint32_t D,
                                                        uint32_t begin, uint32_t end, double eps) {
  using A = AccT<T>;
  const uint32_t lane = threadIdx.x % kTeam;
  const uint32_t L = D * S, cl = static_cast<uint32_t>(row % D);  // channel within the group
  const int64_t base = (row / D) * L;                              // row / D = n*G + g
  const int64_t c0 = row % C - cl;                                 // the group's first channel
  const ExactStats st = exact_stats<kTeam>(x + base, L, eps);
  Pair<double> e{0.0, 0.0};
  for (uint32_t i = begin + lane; i < end; i += kTeam) {
    double xc, ga;
    const double g = exact_grad<ACT>(x + base, dy + base, gamma + c0, beta + c0, st, cl * S + i, S,
                                     &xc, &ga);
    e.a += g * xc;
    e.b += g;
  }
  e = team_sum<kTeam>(e);
  if (lane != 0) return Pair<A>{A(0), A(0)};
  return Pair<A>{static_cast<A>(e.a * st.s), static_cast<A>(e.b)};
}

// Backward kernel 1. Rows (n, c) of S elements, kTeam threads per row (1, 32 or kBlock), rows split
// into gridDim.y pieces of `chunk` elements. Writes part[(row*splits + k)*2 + {0, 1}] = (dsc, db).
// With an activation, g = dy * act'(x * a_c + b_c) replaces dy (gamma, beta, rstd, C are read only
// then). Rows of exactly recomputed groups (gn_exact_group; team-uniform) write (sum g xhat, sum g).
template <typename T, typename P, int V, int kTeam, Act ACT>
__global__ void __launch_bounds__(kBlock)
bwd_row_sums_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                    const AccT<T>* __restrict__ mean, const AccT<T>* __restrict__ rstd,
                    const P* __restrict__ gamma, const P* __restrict__ beta,
                    AccT<T>* __restrict__ part, int64_t rows, int64_t C, uint32_t S, uint32_t D,
                    uint32_t chunk, double eps) {
  using A = AccT<T>;
  constexpr int kRowsPerBlock = kBlock / kTeam;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kTeam;
  const uint32_t lane = threadIdx.x % kTeam;
  Pair<A> acc{A(0), A(0)};
  const bool exact =
      row < rows && gn_exact_group<T>(mean[row / D], rstd[row / D], int64_t(D) * S);
  if (exact) {
    const uint32_t begin = blockIdx.y * chunk;
    const uint32_t end = static_cast<uint32_t>(imin<int64_t>(S, int64_t(begin) + chunk));
    acc = exact_row_sums<kTeam, ACT>(dy, x, gamma, beta, row, C, S, D, begin, end, eps);
  }
  if (row < rows && !exact) {
    const A mu = mean[row / D];  // row = n*C + c, so row / D = n*G + g
    A ca = A(1), cb = A(0);
    if (ACT != Act::kNone) {
      const int64_t c = row % C;
      gn_fwd_coeffs<A>(mu, rstd[row / D], static_cast<A>(to_acc(gamma[c])),
                       static_cast<A>(to_acc(beta[c])), &ca, &cb);
    }
    const T* dyr = dy + row * S;
    const T* xr = x + row * S;
    const uint32_t begin = blockIdx.y * chunk;
    const uint32_t end = static_cast<uint32_t>(imin<int64_t>(S, int64_t(begin) + chunk));
    if (V > 1) {
      using VT = Vec<T, V>;
      const VT* pd = reinterpret_cast<const VT*>(dyr);
      const VT* px = reinterpret_cast<const VT*>(xr);
      for (uint32_t i = begin / V + lane; i < end / V; i += kTeam) {
        const VT d = pd[i];
        const VT v = px[i];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A xv = to_acc(v.v[k]);
          const A g = gn_act_grad<ACT>(xv * ca + cb, to_acc(d.v[k]));
          acc.a += g * (xv - mu);
          acc.b += g;
        }
      }
    } else {
      for (uint32_t i = begin + lane; i < end; i += kTeam) {
        const A xv = to_acc(xr[i]);
        const A g = gn_act_grad<ACT>(xv * ca + cb, to_acc(dyr[i]));
        acc.a += g * (xv - mu);
        acc.b += g;
      }
    }
  }
  if (kTeam == kBlock) {
    acc = block_sum<kBlock>(acc);
    if (threadIdx.x == 0) {
      A* p = part + (row * gridDim.y + blockIdx.y) * kRowPart;
      p[0] = acc.a;
      p[1] = acc.b;
    }
  } else {
    acc = warp_sum<(kTeam < kWarp ? kTeam : kWarp)>(acc);
    if (lane == 0 && row < rows) {
      A* p = part + (row * gridDim.y + blockIdx.y) * kRowPart;
      p[0] = acc.a;
      p[1] = acc.b;
    }
  }
}

template <typename P, typename A, Act ACT>
struct BwdOp {
  struct Coef {
    A c1, a, b;  // a, b: the forward's z = x * a + b (ACT != Act::kNone only)
  };
  const P* gamma;  // this group's D channels
  const P* beta;
  A mu, r, c2, c3;
  __device__ __forceinline__ Coef coef(uint32_t c) const {
    Coef cf;
    const A gm = static_cast<A>(to_acc(gamma[c]));
    cf.c1 = r * gm;
    cf.a = A(1);
    cf.b = A(0);
    if (ACT != Act::kNone) gn_fwd_coeffs<A>(mu, r, gm, static_cast<A>(to_acc(beta[c])), &cf.a, &cf.b);
    return cf;
  }
  __device__ __forceinline__ A operator()(const Coef& cf, A dy, A x) const {
    return gn_bwd_dx<A>(cf.c1, c2, c3, mu, gn_act_grad<ACT>(x * cf.a + cf.b, dy), x);
  }
};

// Backward kernel 2. Grid (param_blocks + N*G, chunks): blocks x < param_blocks (y == 0 only) reduce
// dgamma/dbeta for kBlock channels each; the others write dx for a chunk of their group (exactly
// recomputed groups: exact_bwd_range, from x and dy alone).
template <typename T, typename P, int V, Act ACT>
__global__ void __launch_bounds__(kBlock)
bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const AccT<T>* __restrict__ mean,
              const AccT<T>* __restrict__ rstd, const AccT<T>* __restrict__ dmean_o,
              const AccT<T>* __restrict__ drstd_o, const P* __restrict__ gamma,
              const P* __restrict__ beta,
              const AccT<T>* __restrict__ part, int rsplits, T* __restrict__ dx,
              P* __restrict__ dgamma, P* __restrict__ dbeta, int64_t N, int64_t C, int64_t G,
              uint32_t D, uint32_t S, uint32_t chunk, double eps) {
  using A = AccT<T>;
  const int64_t L = int64_t(D) * S;
  const int64_t NG = N * G;
  const int64_t pblocks = int64_t(gridDim.x) - NG;
  if (int64_t(blockIdx.x) < pblocks) {
    if (blockIdx.y != 0) return;
    const int64_t c = int64_t(blockIdx.x) * kBlock + threadIdx.x;
    if (c >= C) return;
    const int64_t g = c / D;
    A sg = 0, sb = 0;
    for (int64_t n = 0; n < N; ++n) {
      const A* p = part + (n * C + c) * rsplits * kRowPart;
      A ds = 0, db = 0;
      for (int k = 0; k < rsplits; ++k) {
        ds += p[kRowPart * k];
        db += p[kRowPart * k + 1];
      }
      // exactly recomputed groups' rows already hold sum g xhat (see bwd_row_sums_kernel)
      const A r = rstd[n * G + g];
      sg += gn_exact_group<T>(mean[n * G + g], r, L) ? ds : ds * r;
      sb += db;
    }
    if (dgamma) dgamma[c] = from_acc<P>(sg);
    if (dbeta) dbeta[c] = from_acc<P>(sb);
    return;
  }
  // Groups in reverse of the row-sum kernel's order: the first blocks find dy and x in L2.
  const int64_t ng = NG - 1 - (int64_t(blockIdx.x) - pblocks);
  const int64_t g = ng % G;
  const int64_t row0 = ng * D;  // (n*C + g*D)
  const P* gg = gamma + g * D;
  const uint32_t begin = (gridDim.y - 1 - blockIdx.y) * chunk;  // reverse order: L2 reuse
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  const A dmean_g = dmean_o ? dmean_o[ng] : A(0), drstd_g = drstd_o ? drstd_o[ng] : A(0);
  if (gn_exact_group<T>(mean[ng], rstd[ng], L)) {  // block-uniform
    exact_bwd_range<ACT>(x + ng * L, dy + ng * L, dx + ng * L, gg, beta + g * D, dmean_g, drstd_g,
                         eps, static_cast<uint32_t>(L), S, begin, end);
    return;
  }
  Pair<A> ab{A(0), A(0)};
  for (uint32_t d = threadIdx.x; d < D; d += kBlock) {
    const A* p = part + (row0 + d) * rsplits * kRowPart;
    A ds = 0, db = 0;
    for (int k = 0; k < rsplits; ++k) {
      ds += p[kRowPart * k];
      db += p[kRowPart * k + 1];
    }
    const A gm = static_cast<A>(to_acc(gg[d]));
    ab.a += gm * ds;
    ab.b += gm * db;
  }
  ab = block_sum<kBlock>(ab);
  BwdOp<P, A, ACT> op;
  op.gamma = gg;
  op.beta = beta + g * D;
  op.mu = mean[ng];
  op.r = rstd[ng];
  gn_bwd_coeffs<A>(ab.a, ab.b, op.r, A(1) / A(L), dmean_g, drstd_g, &op.c2, &op.c3);
  map_group<T, V, 2>(dy + ng * L, x + ng * L, dx + ng * L, begin, end, S, op);
}

// ------------------------------------------------------------------------------------------------
// Host side: launch plans

// Splits a group of `units` work units (vectors or scalars) into pieces of >= min_units, aiming at
// `want` pieces, at most max_pieces. Returns the chunk length in units; *pieces = ceil(units/chunk).
int64_t plan_chunks(int64_t units, int64_t want, int64_t min_units, int64_t max_pieces,
                    int64_t* pieces) {
  int64_t p = std::max<int64_t>(1, std::min(want, units / std::max<int64_t>(1, min_units)));
  p = std::min(p, max_pieces);
  const int64_t chunk = ceil_div(units, p);
  *pieces = ceil_div(units, chunk);
  return chunk;
}

struct StatsPlan {
  int V = 1;              // vector width used (1 = scalar path)
  int64_t splits = 1;     // blocks per group
  int64_t chunk = 0;      // elements per block (multiple of V)
};

// Sizes split groups by one wave of the stats kernel that will run (occupancy API).
template <typename T>
const char* plan_stats(const void* x, const void* y, int64_t NG, int64_t L, bool can_split,
                       StatsPlan* p) {
  const int Vw = vec_width<T>();
  p->V = (L % Vw == 0 && aligned16(x) && (y == nullptr || aligned16(y))) ? Vw : 1;
  int64_t want = 1;
  if (can_split) {
    int64_t wave = 1;
    if (const char* e = wave_blocks(p->V > 1 ? stats_kernel<T, vec_width<T>()> : stats_kernel<T, 1>,
                                    kBlock, 0, &wave))
      return e;
    want = ceil_div(wave, NG);
  }
  const int64_t units = L / p->V;
  const int64_t cu = plan_chunks(units, want, int64_t(kBlock) * 4, kMaxSplits, &p->splits);
  p->chunk = cu * p->V;
  return nullptr;
}

// Chunks for the elementwise kernel `k`: about two waves of its blocks, >= 4 vectors per thread.
template <typename K>
const char* plan_map(K* k, int64_t NG, int64_t L, int V, int64_t* chunk, int64_t* chunks) {
  int64_t wave = 1;
  if (const char* e = wave_blocks(k, kBlock, 0, &wave)) return e;
  const int64_t units = L / V;
  const int64_t want = ceil_div(2 * wave, NG);
  const int64_t cu = plan_chunks(units, want, int64_t(kBlock) * kUnroll, kMaxGridY, chunks);
  *chunk = cu * V;
  return nullptr;
}

// group_shape.h's rules, then the CUDA kernels' 32-bit limits.
const char* check_dims(const GroupDims& d) {
  if (const char* e = check_group_dims(d)) return e;
  if (d.D * d.S > kMaxGroup) return kGnCudaGroupLimit;
  if (d.N * d.G > kMaxGroup) return kGnCudaGroupsLimit;
  return nullptr;
}

// The one layout of the split statistics' workspace: kStatsPart values (count, mean, M2) for each
// of the p.splits pieces of every group, none when groups are not split. With ws == nullptr it only
// measures: stats_workspace() sizes the buffer with the same code that finds `part` in it.
template <typename T>
AccT<T>* carve_stats(void* ws, int64_t NG, const StatsPlan& p, size_t* bytes = nullptr) {
  WorkspaceCarver<16> w{static_cast<char*>(ws)};
  AccT<T>* part = nullptr;
  if (p.splits > 1) part = w.take<AccT<T>>(static_cast<size_t>(NG * p.splits * kStatsPart));
  if (bytes) *bytes = w.off;
  return part;
}

template <typename T>
size_t stats_workspace(const void* x, const void* y, const GroupDims& d) {
  if (check_dims(d)) return 0;
  StatsPlan p;
  if (plan_stats<T>(x, y, d.N * d.G, d.D * d.S, true, &p)) return 0;
  size_t bytes = 0;
  carve_stats<T>(nullptr, d.N * d.G, p, &bytes);
  return bytes;
}

template <typename T>
const char* launch_stats(const T* x, int64_t NG, int64_t L, const StatsPlan& p, int mode,
                         double eps, AccT<T>* mean, AccT<T>* second, AccT<T>* part,
                         cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(NG), static_cast<unsigned>(p.splits));
  if (p.V > 1)
    stats_kernel<T, vec_width<T>()><<<grid, kBlock, 0, st>>>(
        x, L, static_cast<uint32_t>(p.chunk), mode, eps, mean, second, part);
  else
    stats_kernel<T, 1><<<grid, kBlock, 0, st>>>(x, L, static_cast<uint32_t>(p.chunk), mode, eps,
                                                 mean, second, part);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
const char* moments_impl(const MomentsArgs& a, void* ws, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, L = (a.dims.C / a.dims.G) * a.dims.S;
  StatsPlan p;
  if (const char* e = plan_stats<T>(a.x, nullptr, NG, L, ws != nullptr, &p)) return e;
  A* mean = static_cast<A*>(a.mean);
  A* var = static_cast<A*>(a.var);
  if (p.splits <= 1)
    return launch_stats<T>(static_cast<const T*>(a.x), NG, L, p, kStatsMeanVar, 0.0, mean, var,
                           nullptr, st);
  A* part = carve_stats<T>(ws, NG, p);
  if (const char* e = launch_stats<T>(static_cast<const T*>(a.x), NG, L, p, kStatsPartial, 0.0,
                                      nullptr, nullptr, part, st))
    return e;
  moments_finalize_kernel<T><<<static_cast<unsigned>(ceil_div(NG, kNumWarps)), kBlock, 0, st>>>(
      part, static_cast<int>(p.splits), NG, mean, var, static_cast<const T*>(a.x), L);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T, typename P>
const char* fwd_impl(const GroupNormFwdArgs& a, void* ws, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, D = a.dims.C / a.dims.G, L = D * a.dims.S;
  StatsPlan p;
  if (const char* e = plan_stats<T>(a.x, a.y, NG, L, ws != nullptr, &p)) return e;
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  A* mean = static_cast<A*>(a.mean);
  A* rstd = static_cast<A*>(a.rstd);
  A* part = carve_stats<T>(ws, NG, p);
  const double eps = a.eps;
  if (const char* e = launch_stats<T>(x, NG, L, p, p.splits > 1 ? kStatsPartial : kStatsMeanRstd,
                                      eps, mean, rstd, part, st))
    return e;
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  const int splits = static_cast<int>(p.splits);
  const char* err = nullptr;
  dispatch_act(a.act, [&](auto act) {
    constexpr Act ACT = decltype(act)::value;
    auto* k = p.V > 1 ? fwd_apply_kernel<T, P, vec_width<T>(), ACT> : fwd_apply_kernel<T, P, 1, ACT>;
    int64_t chunk = 0, chunks = 1;
    if ((err = plan_map(k, NG, L, p.V, &chunk, &chunks))) return;
    const dim3 grid(static_cast<unsigned>(NG), static_cast<unsigned>(chunks));
    k<<<grid, kBlock, 0, st>>>(x, gamma, beta, y, mean, rstd, part, splits, eps, L,
                               static_cast<uint32_t>(a.dims.S), a.dims.G, static_cast<uint32_t>(D),
                               static_cast<uint32_t>(chunk));
  });
  if (err) return err;
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
const char* moments_bwd_impl(const MomentsBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, L = (a.dims.C / a.dims.G) * a.dims.S;
  const int Vw = vec_width<T>();
  const int V = (L % Vw == 0 && aligned16(a.x) && aligned16(a.dx)) ? Vw : 1;
  auto* k = V > 1 ? moments_bwd_kernel<T, vec_width<T>()> : moments_bwd_kernel<T, 1>;
  int64_t chunk = 0, chunks = 1;
  if (const char* e = plan_map(k, NG, L, V, &chunk, &chunks)) return e;
  const dim3 grid(static_cast<unsigned>(NG), static_cast<unsigned>(chunks));
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  T* dx = static_cast<T*>(a.dx);
  k<<<grid, kBlock, 0, st>>>(x, mean, dmean, dvar, dx, L, static_cast<uint32_t>(a.dims.S),
                             static_cast<uint32_t>(chunk));
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

struct RowPlan {
  int V = 1;
  int team = kWarp;       // threads per row: 1, kWarp or kBlock
  int64_t splits = 1;     // blocks per row (team == kBlock only)
  int64_t chunk = 0;      // elements per split
};

// Row plan of the backward sums; split rows are sized by one wave of the block-per-row kernel.
template <typename T, typename P, Act ACT>
const char* plan_rows(const GroupNormBwdArgs& a, RowPlan* out) {
  RowPlan& p = *out;
  const int Vw = vec_width<T>();
  const int64_t S = a.dims.S, rows = a.dims.N * a.dims.C;
  p.V = (S % Vw == 0 && aligned16(a.dy) && aligned16(a.x)) ? Vw : 1;
  if (S <= kRowThreadMaxS) {
    p.team = 1;
    p.V = 1;
  } else if (S < kRowWarpMaxS) {
    p.team = kWarp;
  } else {
    p.team = kBlock;
  }
  p.chunk = S;
  if (p.team == kBlock) {
    int64_t wave = 1;
    if (const char* e = wave_blocks(p.V > 1 ? bwd_row_sums_kernel<T, P, vec_width<T>(), kBlock, ACT>
                                            : bwd_row_sums_kernel<T, P, 1, kBlock, ACT>,
                                    kBlock, 0, &wave))
      return e;
    const int64_t units = S / p.V;
    const int64_t cu = plan_chunks(units, ceil_div(wave, rows), int64_t(kBlock) * 4, kMaxSplits,
                                   &p.splits);
    p.chunk = cu * p.V;
  }
  return nullptr;
}

// The one layout of the backward workspace: kRowPart values (dsc, db) for each of the p.splits pieces
// of every row (n, c). With ws == nullptr it only measures (bwd_workspace()).
template <typename T>
AccT<T>* carve_rows(void* ws, int64_t rows, const RowPlan& p, size_t* bytes = nullptr) {
  WorkspaceCarver<16> w{static_cast<char*>(ws)};
  AccT<T>* part = w.take<AccT<T>>(static_cast<size_t>(rows * p.splits * kRowPart));
  if (bytes) *bytes = w.off;
  return part;
}

template <typename T, typename P, Act ACT>
size_t bwd_workspace(const GroupNormBwdArgs& a) {
  if (check_dims(a.dims)) return 0;
  RowPlan p;
  if (plan_rows<T, P, ACT>(a, &p)) return 0;
  size_t bytes = 0;
  carve_rows<T>(nullptr, a.dims.N * a.dims.C, p, &bytes);
  return bytes;
}

template <typename T, typename P, int V, Act ACT>
const char* launch_row_sums(const GroupNormBwdArgs& a, const RowPlan& p, AccT<T>* part,
                            cudaStream_t st) {
  using A = AccT<T>;
  const int64_t rows = a.dims.N * a.dims.C, C = a.dims.C;
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  const uint32_t S = static_cast<uint32_t>(a.dims.S), D = static_cast<uint32_t>(a.dims.C / a.dims.G);
  const uint32_t chunk = static_cast<uint32_t>(p.chunk);
  const int rpb = kBlock / p.team;
  const dim3 grid(static_cast<unsigned>(ceil_div(rows, rpb)), static_cast<unsigned>(p.splits));
  if (p.team == 1)
    bwd_row_sums_kernel<T, P, 1, 1, ACT><<<grid, kBlock, 0, st>>>(dy, x, mean, rstd, gamma, beta,
                                                                 part, rows, C, S, D, chunk, a.eps);
  else if (p.team == kWarp)
    bwd_row_sums_kernel<T, P, V, kWarp, ACT><<<grid, kBlock, 0, st>>>(
        dy, x, mean, rstd, gamma, beta, part, rows, C, S, D, chunk, a.eps);
  else
    bwd_row_sums_kernel<T, P, V, kBlock, ACT><<<grid, kBlock, 0, st>>>(
        dy, x, mean, rstd, gamma, beta, part, rows, C, S, D, chunk, a.eps);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T, typename P, Act ACT>
const char* bwd_impl_act(const GroupNormBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  if (a.workspace == nullptr) return kGnNeedsWorkspace;
  if (!aligned16(a.workspace)) return kGnWorkspaceAlign;
  RowPlan rp;
  if (const char* e = plan_rows<T, P, ACT>(a, &rp)) return e;
  A* part = carve_rows<T>(a.workspace, a.dims.N * a.dims.C, rp);
  const char* e = rp.V > 1 ? launch_row_sums<T, P, vec_width<T>(), ACT>(a, rp, part, st)
                           : launch_row_sums<T, P, 1, ACT>(a, rp, part, st);
  if (e) return e;

  const int64_t NG = a.dims.N * a.dims.G, D = a.dims.C / a.dims.G, L = D * a.dims.S;
  const int Vw = vec_width<T>();
  const int V = (L % Vw == 0 && aligned16(a.dy) && aligned16(a.x) && aligned16(a.dx)) ? Vw : 1;
  auto* k = V > 1 ? bwd_dx_kernel<T, P, vec_width<T>(), ACT> : bwd_dx_kernel<T, P, 1, ACT>;
  int64_t chunk = 0, chunks = 1;
  if (const char* e = plan_map(k, NG, L, V, &chunk, &chunks)) return e;
  const int64_t pblocks = (a.dgamma || a.dbeta) ? ceil_div(a.dims.C, kBlock) : 0;
  const dim3 grid(static_cast<unsigned>(NG + pblocks), static_cast<unsigned>(chunks));
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  const A* dmean_o = static_cast<const A*>(a.dmean);
  const A* drstd_o = static_cast<const A*>(a.drstd);
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  T* dx = static_cast<T*>(a.dx);
  P* dgamma = static_cast<P*>(a.dgamma);
  P* dbeta = static_cast<P*>(a.dbeta);
  const int rs = static_cast<int>(rp.splits);
  const uint32_t D32 = static_cast<uint32_t>(D), S32 = static_cast<uint32_t>(a.dims.S),
                 ch32 = static_cast<uint32_t>(chunk);
  k<<<grid, kBlock, 0, st>>>(dy, x, mean, rstd, dmean_o, drstd_o, gamma, beta, part, rs, dx,
                             dgamma, dbeta, a.dims.N, a.dims.C, a.dims.G, D32, S32, ch32, a.eps);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T, typename P>
const char* bwd_impl(const GroupNormBwdArgs& a, cudaStream_t st) {
  if (a.act != Act::kNone && a.beta == nullptr) return kGnActNeedsBeta;
  const char* e = nullptr;
  dispatch_act(a.act, [&](auto act) { e = bwd_impl_act<T, P, decltype(act)::value>(a, st); });
  return e;
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

size_t moments_workspace_cuda(const MomentsArgs& a) {
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto tag) -> const char* {
    n = stats_workspace<decltype(tag)>(a.x, nullptr, a.dims);
    return nullptr;
  });
  return n;
}

size_t group_norm_fwd_workspace_cuda(const GroupNormFwdArgs& a) {
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto tag) -> const char* {
    n = stats_workspace<decltype(tag)>(a.x, a.y, a.dims);
    return nullptr;
  });
  return n;
}

size_t group_norm_bwd_workspace_cuda(const GroupNormBwdArgs& a) {
  size_t n = 0;
  // The split plan follows the occupancy of the kernel for each activation; callers may ask for the
  // workspace without naming the activation they launch with, so size it for the largest.
  dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    using T = decltype(t);
    using P = decltype(p);
    n = std::max({bwd_workspace<T, P, Act::kNone>(a), bwd_workspace<T, P, Act::kRelu>(a),
                  bwd_workspace<T, P, Act::kSilu>(a)});
  });
  return n;
}

const char* moments_cuda(const MomentsArgs& a, void* stream) {
  if (const char* e = check_dims(a.dims)) return e;
  if (a.workspace && !aligned16(a.workspace)) return kGnWorkspaceAlign;
  return dispatch_data(a.dtype, [&](auto tag) {
    return moments_impl<decltype(tag)>(a, a.workspace, as_stream(stream));
  });
}

const char* moments_bwd_cuda(const MomentsBwdArgs& a, void* stream) {
  if (const char* e = check_dims(a.dims)) return e;
  return dispatch_data(a.dtype, [&](auto tag) {
    return moments_bwd_impl<decltype(tag)>(a, as_stream(stream));
  });
}

const char* group_norm_fwd_cuda(const GroupNormFwdArgs& a, void* stream) {
  if (const char* e = check_dims(a.dims)) return e;
  if (a.workspace && !aligned16(a.workspace)) return kGnWorkspaceAlign;
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    return fwd_impl<decltype(t), decltype(p)>(a, a.workspace, as_stream(stream));
  });
}

const char* group_norm_bwd_cuda(const GroupNormBwdArgs& a, void* stream) {
  if (const char* e = check_dims(a.dims)) return e;
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    return bwd_impl<decltype(t), decltype(p)>(a, as_stream(stream));
  });
}

}  // namespace gn_mx
