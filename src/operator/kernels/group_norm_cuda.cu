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
 * Launch plans by group size (plan_team, kThreadMaxBytes / kWarpMaxBytes): every kernel over
 * groups (statistics, apply, gn_moments backward, dx) gives a group to a team of threads: one thread
 * for groups of <= 64 bytes (256 groups per block: (N, C) data with G = C or C/4), a warp for
 * groups of <= 4 KiB (8 per block), else the block (split across blocks, below). Teams are
 * uniform: a team's exact decision, reductions and early exits never involve another team.
 *
 * Vectors (cut16): any group length, any misalignment: a scalar head up to the output's (or, for
 * reductions, x's) first 16-byte boundary, 16-byte vectors, a scalar tail. An input at another
 * offset modulo 16 (e.g. an x view at +1 element and a fresh y) is loaded element by element
 * inside those vectors (load_vec: coalesced across the warp, stores stay whole vectors). The
 * channel of an element is walked (ChannelWalk), never divided out per element.
 *
 * Statistics (one read of x): every thread folds 16-byte vectors into a Welford state (each vector's
 * exact mean/M2 merged with Chan's update, one division per vector; scalar head/tail elements one
 * each), then warps merge with shuffles and the block through shared memory. A fixed merge tree:
 * results are deterministic.
 * NB: when N*G cannot fill the GPU, a group is split across `splits` blocks that write partial
 * (count, mean, M2) states; the consumer (the apply kernel, or a finalize kernel for gn_moments) merges
 * them in one warp. No atomics, no E[x^2] - E[x]^2.
 *
 * Forward of a group that fits in its team's registers (fwd_resident_kernel, plan_resident: 16-byte
 * aligned x and y, whole vectors, <= 32 KiB for the block): one launch, x read once, statistics
 * as a sum and then a sum of squares around the mean from the registers. Larger or misaligned
 * groups: stats kernel, then an apply kernel over (group, chunk) blocks: y = x * a_c + b_c. For the
 * SD-UNet shapes x (<= 21 MB) stays in the H200's 50 MB L2 between the two kernels, so DRAM sees about
 * one read of x and one write of y.
 * Backward of a group that fits (bwd_resident_kernel, plan_resident_bwd: aligned x, dy, dx, S a
 * multiple of the vector width, <= 16 KiB for the block): one launch writes the row sums and dx
 * from x and dy held in registers. Otherwise:
 *
 * Backward: kernel 1 reduces each row (n, c) to dsc = sum dy (x - mu) and db = sum dy (a row split
 * across blocks when rows are few and long; partial sums in the workspace); kernel 2 has one team
 * (or set of blocks) per group that folds gamma into the group sums A, B (cheap: D * splits
 * values), then writes dx = c1_c dy + c2 (x - mu) + c3 over its chunk. dgamma/dbeta (when asked
 * for) reduce the same row sums over n in parallel: bwd_param_kernel over (channel tile, n chunk)
 * blocks, then, with several chunks, param_finalize_kernel sums the chunks (param_reduce.cuh: fixed
 * order, chunking from N alone). Two launches, two more for the parameter gradients.
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
 * The team plans and cut16 changed the block-per-group variants (same ptxas): fp32 stats 40 -> 45,
 * fp16 stats 44 -> 44, fp16 apply 43 -> 47, fp16 dx 40 -> 64 (6 -> 4 resident blocks per SM, still
 * 128 KB of loads in flight per SM), fp32 dx 44 -> 46, fp32 silu apply 48 -> 56, fp32 silu dx 76
 * -> 76. Unmeasured.
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
#include <initializer_list>
#include <type_traits>

#include "group_norm.h"
#include "group_norm_math.h"
#include "group_norm_nsc_cuda.h"
#include "cuda_common.cuh"
#include "param_reduce.cuh"
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
// Group plans (plan_team): the team of threads per group (n, g) of L elements, by its bytes
// Lb = L * sizeof(T), for the statistics, apply, gn_moments backward and dx kernels alike:
//   Lb <= kThreadMaxBytes (64 B = kUnroll 16-byte vectors): a thread per group, 256 groups per
//     block. A warp would leave >= 28 of its 32 lanes idle ((N, C) data: G = C/4 fp32 is 4
//     elements, one vector), and its shuffles would cost more than the loads; one thread's
//     loads are at most one unrolled round, and consecutive threads read consecutive groups, so
//     a warp's loads are contiguous.
//   Lb <= kWarpMaxBytes (4 KiB = kBlock 16-byte vectors): a warp per group, 8 groups per block:
//     a block per group would leave most of its 256 threads without a single vector; a warp's
//     lanes get 1..8 vectors and reduce with shuffles only.
//   above: a block per group (split across blocks when N*G cannot fill the GPU: plan_stats /
//     plan_map).
// Derived from lane and byte counts (occupancy is the same 256-thread block in every plan), not
// measured: no GPU was available to this change. Before it, every group took a block: (4096,
// 512) with G = 128 launched 524K blocks with 1 of 256 threads busy in each (one fp32 vector).
constexpr int64_t kThreadMaxBytes = 16 * kUnroll;
constexpr int64_t kWarpMaxBytes = 16 * kBlock;
// Workspace records (carve_stats / carve_rows own the layouts): a split group's piece stores its
// Welford state (count, mean, M2); a split row's piece stores its sums (dsc, db).
constexpr int kStatsPart = 3;
constexpr int kRowPart = 2;

// ------------------------------------------------------------------------------------------------
// Device helpers

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

// Teams (plan_team): kTeam consecutive threads of a block (1, a warp or the block) work on one
// group or row; team_lane is a thread's rank in its team, team_rank its team's rank in the block.
template <int kTeam>
__device__ __forceinline__ uint32_t team_lane() {
  return kTeam == 1 ? 0u : threadIdx.x % kTeam;
}
template <int kTeam>
__device__ __forceinline__ uint32_t team_rank() {
  return threadIdx.x / kTeam;
}

// [begin, end) of a run that starts at p, cut at 16-byte boundaries (V elements of T): a scalar
// head [begin, a0) of < V elements, whole aligned vectors [a0, a1), a scalar tail [a1, end). p must
// be element-aligned; the plans vectorize only when every pointer of a kernel has the same offset
// modulo 16 bytes, so the cut found from one of them is aligned for all.
struct Cut {
  uint32_t a0, a1;
};
template <typename T, int V>
__device__ __forceinline__ Cut cut16(const T* p, uint32_t begin, uint32_t end) {
  const uint32_t mis =
      static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p + begin) / sizeof(T)) & (V - 1);
  const uint32_t a0 = imin(end, begin + ((V - mis) & (V - 1)));
  return Cut{a0, a0 + ((end - a0) & ~uint32_t(V - 1))};
}

// Vector i of the run at p: a 16-byte load when p is 16-byte aligned, else V element loads (an
// input at another offset modulo 16 than the buffer whose alignment cut16 followed). `vec` is
// uniform over the team, so the branch does not diverge.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* __restrict__ p, bool vec, uint32_t i) {
  if (vec) return reinterpret_cast<const Vec<T, V>*>(p)[i];
  Vec<T, V> r;
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = p[i * V + k];
  return r;
}

template <typename T>
__device__ __forceinline__ bool is_aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// The channel c = i / S and offset s = i % S of element i of a group, stepped by a fixed `step`
// elements with no division (two per thread, at construction).
struct ChannelWalk {
  uint32_t c, s, dc, ds, S;
  __device__ __forceinline__ ChannelWalk(uint32_t i, uint32_t step, uint32_t S_) : S(S_) {
    c = i / S;
    s = i - c * S;
    dc = step / S;
    ds = step - dc * S;
  }
  __device__ __forceinline__ void next() {
    c += dc;
    s += ds;
    if (s >= S) {
      s -= S;
      ++c;
    }
  }
};

// Welford state of this lane's share of elements [begin, end) of a group (team of kTeam lanes):
// with V > 1 the scalar head, the 16-byte vectors (kUnroll in flight), the scalar tail (cut16).
template <typename T, int V, typename A, int kTeam>
__device__ __forceinline__ Welford<A> thread_moments(const T* __restrict__ xg, uint32_t begin,
                                                     uint32_t end) {
  Welford<A> w;
  const uint32_t lane = team_lane<kTeam>();
  if (V > 1) {
    using VT = Vec<T, V>;
    const Cut cut = cut16<T, V>(xg, begin, end);
    for (uint32_t i = begin + lane; i < cut.a0; i += kTeam) w.push(to_acc(xg[i]));
    const VT* p = reinterpret_cast<const VT*>(xg + cut.a0);
    const uint32_t e = (cut.a1 - cut.a0) / V;
    uint32_t i = lane;
    for (; i + (kUnroll - 1) * kTeam < e; i += kUnroll * kTeam) {
      VT r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) r[u] = p[i + u * kTeam];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) push_vec<T, V, A>(w, r[u]);
    }
    for (; i < e; i += kTeam) push_vec<T, V, A>(w, p[i]);
    for (uint32_t k = cut.a1 + lane; k < end; k += kTeam) w.push(to_acc(xg[k]));
  } else {
    for (uint32_t i = begin + lane; i < end; i += kTeam) w.push(to_acc(xg[i]));
  }
  return w;
}

template <int kTeam, typename A>
__device__ __forceinline__ Welford<A> team_welford(Welford<A> w) {
  if constexpr (kTeam == 1) {
    return w;
  } else if constexpr (kTeam == kWarp) {
    return warp_welford(w);
  } else {
    static_assert(kTeam == kBlock, "team: 1, a warp or the block");
    return block_welford<kBlock>(w);
  }
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

// Forward of elements [begin, end) of an exactly recomputed group (its team of kTeam threads).
template <int kTeam, Act ACT, typename T, typename P>
__device__ __forceinline__ void exact_fwd_range(const T* __restrict__ xg, T* __restrict__ yg,
                                                const P* __restrict__ gamma,
                                                const P* __restrict__ beta, const ExactStats& st,
                                                uint32_t begin, uint32_t end, uint32_t S) {
  for (uint32_t i = begin + team_lane<kTeam>(); i < end; i += kTeam) {
    const double ga = static_cast<double>(to_acc(gamma[i / S]));
    const double be = static_cast<double>(to_acc(beta[i / S]));
    const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[i])), st.x0, st.d);
    yg[i] = from_acc<T>(static_cast<AccT<T>>(gn_act<ACT>(gn_exact_z(xc, st.s, ga, be))));
  }
}

// Backward dx over [begin, end) of an exactly recomputed group of L elements (its team of kTeam
// threads): the group sums sum gamma_c g xc and sum gamma_c g over all of it, then dx (= dmean
// when L = 1).
template <int kTeam, Act ACT, typename T, typename P>
__device__ __forceinline__ void exact_bwd_range(const T* __restrict__ xg,
                                                const T* __restrict__ dyg, T* __restrict__ dxg,
                                                const P* __restrict__ gamma,
                                                const P* __restrict__ beta, double dmean_o,
                                                double drstd_o, double eps, uint32_t L, uint32_t S,
                                                uint32_t begin, uint32_t end) {
  const uint32_t lane = team_lane<kTeam>();
  const ExactStats st = exact_stats<kTeam>(xg, L, eps);
  Pair<double> ab{0.0, 0.0};
  for (uint32_t i = lane; i < L; i += kTeam) {
    double xc, ga;
    const double g = exact_grad<ACT>(xg, dyg, gamma, beta, st, i, S, &xc, &ga);
    ab.a += ga * g * xc;
    ab.b += ga * g;
  }
  ab = team_sum<kTeam>(ab);
  double c2, c3;
  gn_bwd_coeffs<double>(ab.a, ab.b, st.r, 1.0 / static_cast<double>(L), dmean_o, drstd_o, &c2,
                        &c3);
  for (uint32_t i = begin + lane; i < end; i += kTeam) {
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

// kTeam == kBlock: grid (N*G, splits), block (ng, k) covers elements [k*chunk, (k+1)*chunk) of
// group ng. kTeam < kBlock (a thread or a warp per group, splits = 1): grid ceil(N*G / (kBlock /
// kTeam)), the team's rank in the grid is its group.
// kStatsMeanRstd / kStatsMeanVar (splits = 1) write the exact statistics of the groups that
// gn_exact_group / gn_exact_moments select (the apply kernel recomputes those groups' y).
template <typename T, int V, int kTeam>
__global__ void __launch_bounds__(kBlock)
stats_kernel(const T* __restrict__ x, int64_t NG, int64_t L, uint32_t chunk, int mode, double eps,
             AccT<T>* __restrict__ mean, AccT<T>* __restrict__ second, AccT<T>* __restrict__ part) {
  using A = AccT<T>;
  const int64_t ng = int64_t(blockIdx.x) * (kBlock / kTeam) + team_rank<kTeam>();
  if (kTeam != kBlock && ng >= NG) return;  // whole teams leave together
  const uint32_t begin = blockIdx.y * chunk;
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  Welford<A> w = thread_moments<T, V, A, kTeam>(x + ng * L, begin, end);
  w = team_welford<kTeam>(w);  // every lane gets it bitwise: the exact decision is team-uniform
  GN_ASSERT_UNIFORM(kTeam, w);
  const bool exact =
      (mode == kStatsMeanRstd &&
       gn_exact_group<T>(w.mean, gn_rstd(w.var(), static_cast<A>(eps)), L)) ||
      (mode == kStatsMeanVar && gn_exact_moments<T>(w.mean, w.var(), L));
  if (exact) {
    const ExactStats st = exact_stats<kTeam>(x + ng * L, static_cast<uint32_t>(L), eps);
    if (team_lane<kTeam>() == 0) {
      mean[ng] = static_cast<A>(st.x0 + st.d);
      second[ng] = static_cast<A>(mode == kStatsMeanVar ? st.var : st.r);
    }
    return;
  }
  if (team_lane<kTeam>() != 0) return;
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
  GN_ASSERT_UNIFORM(kWarp, w);
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

// Elementwise map, out[e] = op(op.coef(channel(e)), in0[e], in1[e]), over this lane's share of
// elements [begin, end) of one group (team of kTeam lanes). The pieces below walk the channel
// (ChannelWalk): no division per element.

// Scalar elements [lo, hi), lane-strided.
template <typename T, int NIn, int kTeam, typename Op>
__device__ __forceinline__ void map_scalar(const T* __restrict__ in0, const T* __restrict__ in1,
                                           T* __restrict__ out, uint32_t lo, uint32_t hi,
                                           uint32_t S, const Op& op) {
  using A = AccT<T>;
  uint32_t i = lo + team_lane<kTeam>();
  if (i >= hi) return;
  ChannelWalk cw(i, kTeam, S);
  uint32_t c = cw.c;
  typename Op::Coef cf = op.coef(c);
  for (; i < hi; i += kTeam, cw.next()) {
    if (cw.c != c) cf = op.coef(c = cw.c);
    out[i] = from_acc<T>(op(cf, to_acc(in0[i]), NIn > 1 ? to_acc(in1[i]) : A(0)));
  }
}

// 16-byte vectors [lo, hi) (out + lo 16-byte aligned, V | hi - lo; inputs at out's offset are
// loaded as vectors, others element by element). The common case (every input aligned too, no
// vector crossing a channel: V | S and V | lo) keeps kUnroll vectors in flight with one
// coefficient per vector; otherwise one vector at a time, its channel tracked element by element
// (a separate loop, so the common one keeps its registers).
template <typename T, int V, int NIn, int kTeam, typename Op>
__device__ __forceinline__ void map_vectors(const T* __restrict__ in0, const T* __restrict__ in1,
                                            T* __restrict__ out, uint32_t lo, uint32_t hi,
                                            uint32_t S, const Op& op) {
  using A = AccT<T>;
  using VT = Vec<T, V>;
  using Coef = typename Op::Coef;
  const uint32_t lane = team_lane<kTeam>();
  const uint32_t e = (hi - lo) / V;
  if (lane >= e) return;
  const T* q0 = in0 + lo;
  const T* q1 = NIn > 1 ? in1 + lo : nullptr;
  const bool v0 = is_aligned16(q0), v1 = NIn > 1 && is_aligned16(q1);
  VT* po = reinterpret_cast<VT*>(out + lo);
  ChannelWalk cw(lo + lane * V, kTeam * V, S);
  uint32_t i = lane;
  if (S % V == 0 && lo % V == 0 && v0 && (NIn < 2 || v1)) {  // the common case: all aligned
    const VT* p0 = reinterpret_cast<const VT*>(q0);
    const VT* p1 = reinterpret_cast<const VT*>(q1);
    for (; i + (kUnroll - 1) * kTeam < e; i += kUnroll * kTeam) {
      VT r0[kUnroll], r1[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        r0[u] = p0[i + u * kTeam];
        if (NIn > 1) r1[u] = p1[i + u * kTeam];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const Coef cf = op.coef(cw.c);
        cw.next();
        VT o;
#pragma unroll
        for (int k = 0; k < V; ++k)
          o.v[k] = from_acc<T>(op(cf, to_acc(r0[u].v[k]), NIn > 1 ? to_acc(r1[u].v[k]) : A(0)));
        po[i + u * kTeam] = o;
      }
    }
    for (; i < e; i += kTeam, cw.next()) {
      const VT r0 = p0[i];
      VT r1;
      if (NIn > 1) r1 = p1[i];
      const Coef cf = op.coef(cw.c);
      VT o;
#pragma unroll
      for (int k = 0; k < V; ++k)
        o.v[k] = from_acc<T>(op(cf, to_acc(r0.v[k]), NIn > 1 ? to_acc(r1.v[k]) : A(0)));
      po[i] = o;
    }
  } else {  // vectors across channels, or an input at another offset: one vector at a time
    for (; i < e; i += kTeam, cw.next()) {
      const VT r0 = load_vec<T, V>(q0, v0, i);
      VT r1;
      if (NIn > 1) r1 = load_vec<T, V>(q1, v1, i);
      uint32_t c = cw.c, sk = cw.s;
      Coef cf = op.coef(c);
      VT o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (sk == S) {
          sk = 0;
          cf = op.coef(++c);
        }
        o.v[k] = from_acc<T>(op(cf, to_acc(r0.v[k]), NIn > 1 ? to_acc(r1.v[k]) : A(0)));
        ++sk;
      }
      po[i] = o;
    }
  }
}

// The whole map: with V > 1 the scalar head, the vectors and the scalar tail of cut16 (cut at
// out's 16-byte boundaries: stores are always whole vectors); V = 1: all scalar.
template <typename T, int V, int NIn, int kTeam, typename Op>
__device__ __forceinline__ void map_group(const T* __restrict__ in0, const T* __restrict__ in1,
                                          T* __restrict__ out, uint32_t begin, uint32_t end,
                                          uint32_t S, const Op& op) {
  if (V > 1) {
    const Cut cut = cut16<T, V>(out, begin, end);
    map_scalar<T, NIn, kTeam>(in0, in1, out, begin, cut.a0, S, op);
    map_vectors<T, V, NIn, kTeam>(in0, in1, out, cut.a0, cut.a1, S, op);
    map_scalar<T, NIn, kTeam>(in0, in1, out, cut.a1, end, S, op);
  } else {
    map_scalar<T, NIn, kTeam>(in0, in1, out, begin, end, S, op);
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
  __device__ __forceinline__ Coef coef_of(P gm, P bt) const {
    Coef cf;
    gn_fwd_coeffs<A>(mu, r, static_cast<A>(to_acc(gm)), static_cast<A>(to_acc(bt)), &cf.a, &cf.b);
    return cf;
  }
  __device__ __forceinline__ Coef coef(uint32_t c) const { return coef_of(gamma[c], beta[c]); }
  __device__ __forceinline__ A operator()(const Coef& cf, A x, A) const {
    return gn_act<ACT>(x * cf.a + cf.b);
  }
};

// The group of this thread's team in a grid of groups taken in reverse (the last group first):
// blocks then run in reverse of the kernel before them, and the first ones find the data that it
// read last still in L2 (helps tensors larger than L2). -1 for a team past the last group.
template <int kTeam>
__device__ __forceinline__ int64_t reverse_group(int64_t first_block, int64_t NG) {
  const int64_t t = (int64_t(blockIdx.x) - first_block) * (kBlock / kTeam) + team_rank<kTeam>();
  return t < NG ? NG - 1 - t : -1;
}

// Grid (N*G / groups per block, chunks). With splits > 1 (kTeam == kBlock only) the block first
// merges the group's partial states (and the chunk-0 block publishes mean/rstd); otherwise the
// stats kernel already wrote them (exact ones for the groups gn_exact_group selects, which it then
// selects again here: see group_norm_math.h).
template <typename T, typename P, int V, Act ACT, int kTeam>
__global__ void __launch_bounds__(kBlock)
fwd_apply_kernel(const T* __restrict__ x, const P* __restrict__ gamma, const P* __restrict__ beta,
                 T* __restrict__ y, AccT<T>* __restrict__ mean, AccT<T>* __restrict__ rstd,
                 const AccT<T>* __restrict__ part, int splits, double eps, int64_t NG, int64_t L,
                 uint32_t S, int64_t G, uint32_t D, uint32_t chunk) {
  using A = AccT<T>;
  __shared__ A s_mu, s_r;
  const int64_t ng = reverse_group<kTeam>(0, NG);
  if (kTeam != kBlock && ng < 0) return;  // whole teams leave together
  const uint32_t piece = gridDim.y - 1 - blockIdx.y;
  if (kTeam == kBlock) {  // smaller teams: splits == 1, every lane reads mean/rstd itself
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
  }
  const A mu = kTeam == kBlock ? s_mu : mean[ng], r = kTeam == kBlock ? s_r : rstd[ng];
  const bool publish = splits > 1 && piece == 0 && threadIdx.x == 0;
  const int64_t g = ng % G;
  const uint32_t begin = piece * chunk;
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  GN_ASSERT_UNIFORM(kTeam, (Pair<A>{mu, r}));
  if (gn_exact_group<T>(mu, r, L)) {  // team-uniform
    const ExactStats st = exact_stats<kTeam>(x + ng * L, static_cast<uint32_t>(L), eps);
    if (publish) {
      mean[ng] = static_cast<A>(st.x0 + st.d);
      rstd[ng] = static_cast<A>(st.r);
    }
    exact_fwd_range<kTeam, ACT>(x + ng * L, y + ng * L, gamma + g * D, beta + g * D, st, begin,
                                end, S);
    return;
  }
  if (publish) {
    mean[ng] = mu;
    rstd[ng] = r;
  }
  FwdOp<P, A, ACT> op{gamma + g * D, beta + g * D, mu, r};
  map_group<T, V, 1, kTeam>(x + ng * L, nullptr, y + ng * L, begin, end, S, op);
}

// ------------------------------------------------------------------------------------------------
// Forward in one pass: resident groups (plan_resident)
//
// A group of at most kResidentVecs 16-byte vectors per lane of its team (plan_team: 64 B for a
// thread, 4 KiB for a warp, 32 KiB for the block) is loaded into registers once; its sum, then its
// sum of squares around that mean (two team reductions, no division per element), then y from the
// same registers. One launch and one read of x, where the two-kernel path (stats_kernel +
// fwd_apply_kernel) launches twice and reads x twice, and spends a Welford merge (a division) per
// vector. Taken when x and y are 16-byte aligned and L is a whole number of vectors; every other
// group keeps the two-kernel path. Simulated V100 (benchmarks/results/gpusim_v100.md): see
// docs/performance/gpu.md.
constexpr int kResidentVecs = 8;

template <typename T, int V, int kTeam, int K>
__device__ __forceinline__ void load_resident(const T* __restrict__ xg, uint32_t e,
                                              Vec<T, V> (&r)[K]) {
  const Vec<T, V>* p = reinterpret_cast<const Vec<T, V>*>(xg);
  const uint32_t lane = team_lane<kTeam>();
#pragma unroll
  for (int u = 0; u < K; ++u)
    if (lane + u * kTeam < e) r[u] = p[lane + u * kTeam];
}

// gamma and beta at the first channel of each of a lane's resident vectors, loaded next to x (so
// their latency hides behind the statistics instead of following them).
template <typename P, int V, int kTeam, int K = kResidentVecs>
struct VecParams {
  P g[K], b[K];  // b: 0 without beta
  __device__ __forceinline__ void load(const P* __restrict__ gamma, const P* __restrict__ beta,
                                       uint32_t e, uint32_t S) {
    const uint32_t lane = team_lane<kTeam>();
    if (lane >= e) return;
    ChannelWalk cw(lane * V, kTeam * V, S);
#pragma unroll
    for (int u = 0; u < K; ++u, cw.next())
      if (lane + u * kTeam < e) {
        g[u] = gamma[cw.c];
        b[u] = beta ? beta[cw.c] : P(0);
      }
  }
};

// (mean, rstd) of a resident group of L elements (e vectors): every lane of the team gets them
// bitwise (team_sum), so the exact decision is team-uniform.
template <typename T, int V, int kTeam>
__device__ __forceinline__ Pair<AccT<T>> resident_stats(const Vec<T, V> (&r)[kResidentVecs],
                                                        uint32_t e, uint32_t L, double eps) {
  using A = AccT<T>;
  const uint32_t lane = team_lane<kTeam>();
  A s = 0;
#pragma unroll
  for (int u = 0; u < kResidentVecs; ++u)
    if (lane + u * kTeam < e)
#pragma unroll
      for (int k = 0; k < V; ++k) s += to_acc(r[u].v[k]);
  const A mu = team_sum<kTeam>(s) / static_cast<A>(L);
  A q = 0;
#pragma unroll
  for (int u = 0; u < kResidentVecs; ++u)
    if (lane + u * kTeam < e)
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A d = to_acc(r[u].v[k]) - mu;
        q += d * d;
      }
  const A var = team_sum<kTeam>(q) / static_cast<A>(L);
  return Pair<A>{mu, gn_rstd(var, static_cast<A>(eps))};
}

// y of a resident group from its registers; a vector that crosses a channel (S % V != 0) takes its
// coefficients element by element.
template <typename T, int V, int kTeam, typename Op, typename Prm>
__device__ __forceinline__ void store_resident(const Vec<T, V> (&r)[kResidentVecs], uint32_t e,
                                               uint32_t S, T* __restrict__ yg, const Op& op,
                                               const Prm& prm) {
  using A = AccT<T>;
  const uint32_t lane = team_lane<kTeam>();
  if (lane >= e) return;
  Vec<T, V>* po = reinterpret_cast<Vec<T, V>*>(yg);
  const bool whole = S % V == 0;
  ChannelWalk cw(lane * V, kTeam * V, S);
#pragma unroll
  for (int u = 0; u < kResidentVecs; ++u, cw.next()) {
    if (lane + u * kTeam >= e) break;
    uint32_t c = cw.c, sk = cw.s;
    typename Op::Coef cf = op.coef_of(prm.g[u], prm.b[u]);
    Vec<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k, ++sk) {
      if (!whole && sk == S) {
        sk = 0;
        cf = op.coef(++c);
      }
      o.v[k] = from_acc<T>(op(cf, to_acc(r[u].v[k]), A(0)));
    }
    po[lane + u * kTeam] = o;
  }
}

// Grid ceil(N*G / (kBlock / kTeam)): team t of the grid normalizes group t (writes y, mean, rstd);
// exactly recomputed groups (gn_exact_group) take the float64 path from x.
template <typename T, typename P, int V, Act ACT, int kTeam>
__global__ void __launch_bounds__(kBlock)
fwd_resident_kernel(const T* __restrict__ x, const P* __restrict__ gamma,
                    const P* __restrict__ beta, T* __restrict__ y, AccT<T>* __restrict__ mean,
                    AccT<T>* __restrict__ rstd, double eps, int64_t NG, uint32_t L, uint32_t S,
                    int64_t G, uint32_t D) {
  using A = AccT<T>;
  const int64_t ng = int64_t(blockIdx.x) * (kBlock / kTeam) + team_rank<kTeam>();
  if (kTeam != kBlock && ng >= NG) return;  // whole teams leave together
  const T* xg = x + ng * L;
  const uint32_t e = L / V;
  const int64_t g = ng % G;
  Vec<T, V> r[kResidentVecs];
  load_resident<T, V, kTeam>(xg, e, r);
  VecParams<P, V, kTeam> prm;
  prm.load(gamma + g * D, beta + g * D, e, S);
  const Pair<A> st = resident_stats<T, V, kTeam>(r, e, L, eps);
  GN_ASSERT_UNIFORM(kTeam, st);
  const bool lead = team_lane<kTeam>() == 0;
  if (gn_exact_group<T>(st.a, st.b, L)) {  // team-uniform
    const ExactStats ex = exact_stats<kTeam>(xg, L, eps);
    if (lead) {
      mean[ng] = static_cast<A>(ex.x0 + ex.d);
      rstd[ng] = static_cast<A>(ex.r);
    }
    exact_fwd_range<kTeam, ACT>(xg, y + ng * L, gamma + g * D, beta + g * D, ex, 0, L, S);
    return;
  }
  if (lead) {
    mean[ng] = st.a;
    rstd[ng] = st.b;
  }
  store_resident<T, V, kTeam>(r, e, S, y + ng * L,
                              FwdOp<P, A, ACT>{gamma + g * D, beta + g * D, st.a, st.b}, prm);
}

template <typename A>
struct MomentsBwdOp {
  struct Coef {};
  A mu, c0, c1;
  __device__ __forceinline__ Coef coef(uint32_t) const { return Coef{}; }
  __device__ __forceinline__ A operator()(const Coef&, A x, A) const { return c0 + c1 * (x - mu); }
};

// Grid (N*G / groups per block, chunks): dx = dmean / L + dvar * 2 (x - mean) / L.
template <typename T, int V, int kTeam>
__global__ void __launch_bounds__(kBlock)
moments_bwd_kernel(const T* __restrict__ x, const AccT<T>* __restrict__ mean,
                   const AccT<T>* __restrict__ dmean, const AccT<T>* __restrict__ dvar,
                   T* __restrict__ dx, int64_t NG, int64_t L, uint32_t S, uint32_t chunk) {
  using A = AccT<T>;
  const int64_t ng = int64_t(blockIdx.x) * (kBlock / kTeam) + team_rank<kTeam>();
  if (ng >= NG) return;
  MomentsBwdOp<A> op;
  op.mu = mean[ng];
  gn_moments_bwd_coeffs<A>(dmean ? dmean[ng] : A(0), dvar ? dvar[ng] : A(0), A(1) / A(L), &op.c0,
                           &op.c1);
  const uint32_t begin = blockIdx.y * chunk;
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  map_group<T, V, 1, kTeam>(x + ng * L, nullptr, dx + ng * L, begin, end, S, op);
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
  GN_ASSERT_UNIFORM(kTeam, exact);
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
    auto add = [&](A xv, A d) {
      const A g = gn_act_grad<ACT>(xv * ca + cb, d);
      acc.a += g * (xv - mu);
      acc.b += g;
    };
    // V > 1: scalar head, 16-byte vectors, scalar tail (cut16 at x's boundaries; dy is loaded
    // as vectors where it shares x's offset modulo 16, element by element where it does not)
    const Cut cut = V > 1 ? cut16<T, V>(xr, begin, end) : Cut{end, end};
    for (uint32_t i = begin + lane; i < cut.a0; i += kTeam) add(to_acc(xr[i]), to_acc(dyr[i]));
    if (V > 1) {
      using VT = Vec<T, V>;
      const T* qd = dyr + cut.a0;
      const bool dv = is_aligned16(qd);
      const VT* px = reinterpret_cast<const VT*>(xr + cut.a0);
      for (uint32_t i = lane; i < (cut.a1 - cut.a0) / V; i += kTeam) {
        const VT d = load_vec<T, V>(qd, dv, i);
        const VT v = px[i];
#pragma unroll
        for (int k = 0; k < V; ++k) add(to_acc(v.v[k]), to_acc(d.v[k]));
      }
    }
    for (uint32_t i = cut.a1 + lane; i < end; i += kTeam) add(to_acc(xr[i]), to_acc(dyr[i]));
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
  // bt is read only with an activation (the backward gets no beta without one)
  __device__ __forceinline__ Coef coef_of(P gm_p, P bt) const {
    Coef cf;
    const A gm = static_cast<A>(to_acc(gm_p));
    cf.c1 = r * gm;
    cf.a = A(1);
    cf.b = A(0);
    if (ACT != Act::kNone) gn_fwd_coeffs<A>(mu, r, gm, static_cast<A>(to_acc(bt)), &cf.a, &cf.b);
    return cf;
  }
  __device__ __forceinline__ Coef coef(uint32_t c) const {
    return coef_of(gamma[c], ACT != Act::kNone ? beta[c] : P(0));
  }
  __device__ __forceinline__ A grad(const Coef& cf, A dy, A x) const {  // g = dy * act'(z)
    return gn_act_grad<ACT>(x * cf.a + cf.b, dy);
  }
  __device__ __forceinline__ A operator()(const Coef& cf, A dy, A x) const {
    return gn_bwd_dx<A>(cf.c1, c2, c3, mu, grad(cf, dy, x), x);
  }
};

// Backward kernel 2. Grid (N*G / groups per block, chunks): each team of kTeam threads writes dx
// for a chunk of its group (exactly recomputed groups: exact_bwd_range, from x and dy alone).
// dgamma/dbeta: bwd_param_kernel.
template <typename T, typename P, int V, Act ACT, int kTeam>
__global__ void __launch_bounds__(kBlock)
bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const AccT<T>* __restrict__ mean,
              const AccT<T>* __restrict__ rstd, const AccT<T>* __restrict__ dmean_o,
              const AccT<T>* __restrict__ drstd_o, const P* __restrict__ gamma,
              const P* __restrict__ beta,
              const AccT<T>* __restrict__ part, int rsplits, T* __restrict__ dx, int64_t N,
              int64_t G, uint32_t D, uint32_t S, uint32_t chunk, double eps) {
  using A = AccT<T>;
  const int64_t L = int64_t(D) * S;
  const int64_t NG = N * G;
  // Groups in reverse of the row-sum kernel's order: the first blocks find dy and x in L2.
  const int64_t ng = reverse_group<kTeam>(0, NG);
  if (kTeam != kBlock && ng < 0) return;  // whole teams leave together
  const int64_t g = ng % G;
  const int64_t row0 = ng * D;  // (n*C + g*D)
  const P* gg = gamma + g * D;
  const uint32_t begin = (gridDim.y - 1 - blockIdx.y) * chunk;  // reverse order: L2 reuse
  const uint32_t end = static_cast<uint32_t>(imin<int64_t>(L, int64_t(begin) + chunk));
  const A dmean_g = dmean_o ? dmean_o[ng] : A(0), drstd_g = drstd_o ? drstd_o[ng] : A(0);
  GN_ASSERT_UNIFORM(kTeam, (Pair<A>{mean[ng], rstd[ng]}));
  if (gn_exact_group<T>(mean[ng], rstd[ng], L)) {  // team-uniform
    exact_bwd_range<kTeam, ACT>(x + ng * L, dy + ng * L, dx + ng * L, gg, beta + g * D, dmean_g,
                                drstd_g, eps, static_cast<uint32_t>(L), S, begin, end);
    return;
  }
  Pair<A> ab{A(0), A(0)};
  for (uint32_t d = team_lane<kTeam>(); d < D; d += kTeam) {
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
  ab = team_sum<kTeam>(ab);
  BwdOp<P, A, ACT> op;
  op.gamma = gg;
  op.beta = beta + g * D;
  op.mu = mean[ng];
  op.r = rstd[ng];
  gn_bwd_coeffs<A>(ab.a, ab.b, op.r, A(1) / A(L), dmean_g, drstd_g, &op.c2, &op.c3);
  map_group<T, V, 2, kTeam>(dy + ng * L, x + ng * L, dx + ng * L, begin, end, S, op);
}

// ------------------------------------------------------------------------------------------------
// Backward in one pass: resident groups (plan_resident_bwd)
//
// x and dy of a group of at most kResidentBwdVecs 16-byte vectors per lane of its team (16 KiB for
// the block team) are loaded once into registers; each vector's (sum g (x - mu), sum g) goes to
// shared memory, the team sums each row (n, c) from there (the row sums bwd_param_kernel reads,
// one split), folds gamma into the group's A, B, and writes dx from the registers. One launch and
// one read of x and dy, where the two-kernel path (bwd_row_sums_kernel + bwd_dx_kernel) launches
// twice and reads them twice. Vectors stay inside a channel (S % V == 0).
constexpr int kResidentBwdVecs = 4;

// (sum g (x - mu), sum g) of each of this lane's resident vectors into slots[vector].
template <typename T, int V, int kTeam, typename Op, typename Prm>
__device__ __forceinline__ void bwd_vector_sums(const Vec<T, V> (&xr)[kResidentBwdVecs],
                                                const Vec<T, V> (&dr)[kResidentBwdVecs],
                                                uint32_t e, const Op& op, const Prm& prm,
                                                Pair<AccT<T>>* slots) {
  using A = AccT<T>;
  const uint32_t lane = team_lane<kTeam>();
#pragma unroll
  for (int u = 0; u < kResidentBwdVecs; ++u) {
    if (lane + u * kTeam >= e) break;
    const typename Op::Coef cf = op.coef_of(prm.g[u], prm.b[u]);
    Pair<A> p{A(0), A(0)};
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const A xv = to_acc(xr[u].v[k]);
      const A g = op.grad(cf, to_acc(dr[u].v[k]), xv);
      p.a += g * (xv - op.mu);
      p.b += g;
    }
    slots[lane + u * kTeam] = p;
  }
}

// Where the resident backward puts a row's sums (sum g (x - mu) or, for an exactly recomputed
// group, sum g xhat; and sum g): the row-sum layout bwd_param_kernel reads (one split), or, when
// the batch is one sample (direct), dgamma_c / dbeta_c themselves (bwd_param_kernel's sum over n
// of one term: rstd * dsc, db), which saves that launch.
template <typename A, typename P>
struct RowSink {
  A* part;
  P* dgamma;  // nullptr: not wanted (direct only)
  P* dbeta;
  bool direct;
  __device__ __forceinline__ void put(int64_t row, int64_t c, A ds, A db, A r) const {
    if (!direct) {
      part[row * kRowPart] = ds;
      part[row * kRowPart + 1] = db;
      return;
    }
    if (dgamma) dgamma[c] = from_acc<P>(ds * r);
    if (dbeta) dbeta[c] = from_acc<P>(db);
  }
};

// Rows d = 0..D-1 of group ng (channels g*D + d) from the per-vector slots (S / V each), each put
// in the sink; returns the group's (sum gamma_d dsc_d, sum gamma_d db_d) on every lane of the
// team. Warps of the team take rows in turn (a thread team: all of them).
template <int kTeam, typename A, typename P>
__device__ __forceinline__ Pair<A> bwd_rows_from_slots(const Pair<A>* slots, uint32_t per,
                                                       uint32_t D, int64_t ng, int64_t g,
                                                       const P* __restrict__ gamma, A r,
                                                       const RowSink<A, P>& sink) {
  constexpr int kSub = kTeam < kWarp ? kTeam : kWarp;
  const uint32_t lane = team_lane<kTeam>(), sub = lane / kSub, sl = lane % kSub;
  Pair<A> ab{A(0), A(0)};
  for (uint32_t d = sub; d < D; d += kTeam / kSub) {
    Pair<A> rs{A(0), A(0)};
    for (uint32_t j = sl; j < per; j += kSub) {
      rs.a += slots[d * per + j].a;
      rs.b += slots[d * per + j].b;
    }
    rs = warp_sum<kSub>(rs);
    if (sl == 0) {
      sink.put(ng * D + d, g * D + d, rs.a, rs.b, r);
      const A gm = static_cast<A>(to_acc(gamma[d]));
      ab.a += gm * rs.a;
      ab.b += gm * rs.b;
    }
  }
  return team_sum<kTeam>(ab);
}

// Exactly recomputed group ng (gn_exact_group): its rows' sums (sum g xhat, sum g) and dx in
// float64 from x and dy (exact_row_sums, exact_bwd_range).
template <int kTeam, Act ACT, typename T, typename P>
__device__ __forceinline__ void bwd_resident_exact(const T* __restrict__ dy,
                                                   const T* __restrict__ x,
                                                   const P* __restrict__ gamma,
                                                   const P* __restrict__ beta,
                                                   const RowSink<AccT<T>, P>& sink,
                                                   T* __restrict__ dx, int64_t ng, int64_t G,
                                                   uint32_t D, uint32_t S, double dmean_g,
                                                   double drstd_g, double eps) {
  const int64_t C = G * D, g = ng % G;
  const uint32_t L = D * S;
  for (uint32_t d = 0; d < D; ++d) {
    const Pair<AccT<T>> e =
        exact_row_sums<kTeam, ACT>(dy, x, gamma, beta, ng * D + d, C, S, D, 0, S, eps);
    if (team_lane<kTeam>() == 0) sink.put(ng * D + d, g * D + d, e.a, e.b, AccT<T>(1));
  }
  exact_bwd_range<kTeam, ACT>(x + ng * L, dy + ng * L, dx + ng * L, gamma + g * D, beta + g * D,
                              dmean_g, drstd_g, eps, L, S, 0, L);
}

// Grid ceil(N*G / (kBlock / kTeam)): team t of the grid writes dx and the row sums of group t.
template <typename T, typename P, int V, Act ACT, int kTeam>
__global__ void __launch_bounds__(kBlock)
bwd_resident_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                    const AccT<T>* __restrict__ mean, const AccT<T>* __restrict__ rstd,
                    const AccT<T>* __restrict__ dmean_o, const AccT<T>* __restrict__ drstd_o,
                    const P* __restrict__ gamma, const P* __restrict__ beta,
                    const RowSink<AccT<T>, P> sink, T* __restrict__ dx, int64_t NG, int64_t G,
                    uint32_t D, uint32_t S, double eps) {
  using A = AccT<T>;
  __shared__ RawSlots<Pair<A>, kBlock * kResidentBwdVecs> s_raw;
  Pair<A>* slots = s_raw.get() + team_rank<kTeam>() * (kTeam * kResidentBwdVecs);
  const int64_t ng = int64_t(blockIdx.x) * (kBlock / kTeam) + team_rank<kTeam>();
  const bool live = kTeam == kBlock || ng < NG;  // teams past the last group: the barrier only
  const uint32_t L = D * S, e = L / V;
  const int64_t g = live ? ng % G : 0;
  const A mu = live ? mean[ng] : A(0), r = live ? rstd[ng] : A(1);
  const bool exact = live && gn_exact_group<T>(mu, r, L);  // team-uniform
  BwdOp<P, A, ACT> op{gamma + g * D, beta ? beta + g * D : nullptr, mu, r, A(0), A(0)};
  Vec<T, V> xr[kResidentBwdVecs], dr[kResidentBwdVecs];
  VecParams<P, V, kTeam, kResidentBwdVecs> prm;
  if (live && !exact) {
    load_resident<T, V, kTeam>(x + ng * L, e, xr);
    load_resident<T, V, kTeam>(dy + ng * L, e, dr);
    prm.load(op.gamma, ACT != Act::kNone ? op.beta : nullptr, e, S);
    bwd_vector_sums<T, V, kTeam>(xr, dr, e, op, prm, slots);
  }
  __syncthreads();  // every thread of the block, once: the slots are written
  if (!live) return;  // whole teams leave together
  const A dmean_g = dmean_o ? dmean_o[ng] : A(0), drstd_g = drstd_o ? drstd_o[ng] : A(0);
  if (exact) {
    bwd_resident_exact<kTeam, ACT>(dy, x, gamma, beta, sink, dx, ng, G, D, S, dmean_g, drstd_g,
                                   eps);
    return;
  }
  const Pair<A> ab = bwd_rows_from_slots<kTeam>(slots, S / V, D, ng, g, op.gamma, r, sink);
  gn_bwd_coeffs<A>(ab.a, ab.b, r, A(1) / A(L), dmean_g, drstd_g, &op.c2, &op.c3);
  Vec<T, V>* po = reinterpret_cast<Vec<T, V>*>(dx + ng * L);
  const uint32_t lane = team_lane<kTeam>();
#pragma unroll
  for (int u = 0; u < kResidentBwdVecs; ++u) {
    if (lane + u * kTeam >= e) break;
    const typename BwdOp<P, A, ACT>::Coef cf = op.coef_of(prm.g[u], prm.b[u]);
    Vec<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k)
      o.v[k] = from_acc<T>(op(cf, to_acc(dr[u].v[k]), to_acc(xr[u].v[k])));
    po[lane + u * kTeam] = o;
  }
}

// Backward parameter gradients, stage 1 of param_reduce.cuh's two-stage reduction over n (stage 2:
// param_finalize_kernel). Grid (ceil(C / kParamTile), chunks); block (t, k) sums channels
// [t*kParamTile, ...) over rows [k*chunk_rows, ...): dgamma_c = sum_n rstd_ng dsc_nc and
// dbeta_c = sum_n db_nc from the row sums in `part` (each row's rsplits pieces summed first).
// Exactly recomputed groups' rows already hold sum g xhat (see bwd_row_sums_kernel): no rstd.
template <typename T, typename P>
__global__ void __launch_bounds__(kParamThreads)
bwd_param_kernel(const AccT<T>* __restrict__ part, int rsplits, const AccT<T>* __restrict__ mean,
                 const AccT<T>* __restrict__ rstd, int64_t N, int64_t C, int64_t G, uint32_t D,
                 int64_t L, int64_t chunk_rows, AccT<T>* __restrict__ ppart, P* __restrict__ dgamma,
                 P* __restrict__ dbeta) {
  using A = AccT<T>;
  const int64_t c = int64_t(blockIdx.x) * kParamTile + threadIdx.x % kParamTile;
  const int64_t n0 = int64_t(blockIdx.y) * chunk_rows, n1 = imin<int64_t>(N, n0 + chunk_rows);
  Pair<A> s{A(0), A(0)};
  if (c < C) {
    const int64_t g = c / D;  // once per thread
#pragma unroll 2
    for (int64_t n = n0 + threadIdx.x / kParamTile; n < n1; n += kParamLanes) {
      const A* p = part + (n * C + c) * rsplits * kRowPart;
      A ds = p[0], db = p[1];
      for (int k = 1; k < rsplits; ++k) {
        ds += p[kRowPart * k];
        db += p[kRowPart * k + 1];
      }
      const A r = rstd[n * G + g];
      s.a += gn_exact_group<T>(mean[n * G + g], r, L) ? ds : ds * r;
      s.b += db;
    }
  }
  s = param_lane_sum(s);
  if (threadIdx.x < kParamTile && c < C)
    param_store<A, P>(s.a, s.b, c, C, blockIdx.y, gridDim.y, ppart, dgamma, dbeta);
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

// The team of threads per group of L elements of `elem` bytes (see kThreadMaxBytes): the one
// place that picks it, for every kernel over groups (statistics, apply, gn_moments backward, dx).
int plan_team(int64_t L, size_t elem) {
  const int64_t bytes = L * static_cast<int64_t>(elem);
  return bytes <= kThreadMaxBytes ? 1 : bytes <= kWarpMaxBytes ? kWarp : kBlock;
}

// Whether a kernel over these buffers (nullptr ones ignored) may use 16-byte vectors: every
// pointer element-aligned (always, for real allocations and views). cut16 then aligns one buffer
// per run (the output, or x), and the others are loaded as vectors where they share its offset
// modulo 16, element by element where they do not (load_vec).
template <typename T>
bool vectorizable(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) return false;
  return true;
}

template <int kTeam>
struct TeamTag {
  static constexpr int value = kTeam;
};
// f(TeamTag<team>{}) for the teams plan_team picks.
template <typename F>
void dispatch_team(int team, F&& f) {
  if (team == 1)
    f(TeamTag<1>{});
  else if (team == kWarp)
    f(TeamTag<kWarp>{});
  else
    f(TeamTag<kBlock>{});
}

// The launch plan of a kernel over groups: grid (blocks(NG), pieces), kBlock threads.
struct GroupPlan {
  int team = kBlock;    // threads per group (plan_team)
  int V = 1;            // vector width (1: the scalar path)
  int64_t pieces = 1;   // blocks per group (team == kBlock only)
  int64_t chunk = 0;    // elements per piece (a multiple of V)
  int64_t blocks(int64_t NG) const { return ceil_div(NG, kBlock / team); }
};

// One piece per group; team and vector width from the group's size and the buffers' alignment.
template <typename T>
GroupPlan plan_group(int64_t L, std::initializer_list<const void*> ptrs) {
  GroupPlan p;
  p.team = plan_team(L, sizeof(T));
  p.V = vectorizable<T>(ptrs) ? vec_width<T>() : 1;
  p.chunk = L;
  return p;
}

// Splits each group of a block-per-group plan into pieces of >= min_vecs vectors, aiming at `want`
// pieces, at most max_pieces (smaller teams: one piece).
void split_groups(int64_t L, int64_t want, int64_t min_vecs, int64_t max_pieces, GroupPlan* p) {
  if (p->team != kBlock) return;
  const int64_t cu = plan_chunks(ceil_div(L, p->V), want, min_vecs, max_pieces, &p->pieces);
  p->chunk = cu * p->V;
}

// The statistics kernel's plan (it reads x only). Split groups are sized by one wave of the
// block-per-group stats kernel that will run (occupancy API).
template <typename T>
const char* plan_stats(const void* x, int64_t NG, int64_t L, bool can_split, GroupPlan* p) {
  *p = plan_group<T>(L, {x});
  int64_t want = 1;
  if (can_split && p->team == kBlock) {
    int64_t wave = 1;
    if (const char* e = wave_blocks(p->V > 1 ? stats_kernel<T, vec_width<T>(), kBlock>
                                             : stats_kernel<T, 1, kBlock>,
                                    kBlock, 0, &wave))
      return e;
    want = ceil_div(wave, NG);
  }
  split_groups(L, want, int64_t(kBlock) * 4, kMaxSplits, p);
  return nullptr;
}

// Pieces for the elementwise kernel `k` (block per group): about two waves of its blocks, >= 4
// vectors per thread.
template <typename K>
const char* plan_map(K* k, int64_t NG, int64_t L, GroupPlan* p) {
  if (p->team != kBlock) return nullptr;
  int64_t wave = 1;
  if (const char* e = wave_blocks(k, kBlock, 0, &wave)) return e;
  split_groups(L, ceil_div(2 * wave, NG), int64_t(kBlock) * kUnroll, kMaxGridY, p);
  return nullptr;
}

dim3 group_grid(const GroupPlan& p, int64_t NG) {
  return dim3(static_cast<unsigned>(p.blocks(NG)), static_cast<unsigned>(p.pieces));
}

// group_shape.h's rules, then the CUDA kernels' 32-bit limits.
const char* check_dims(const GroupDims& d) {
  if (const char* e = check_group_dims(d)) return e;
  if (d.D * d.S > kMaxGroup) return kGnCudaGroupLimit;
  if (d.N * d.G > kMaxGroup) return kGnCudaGroupsLimit;
  return nullptr;
}

// The one layout of the split statistics' workspace: kStatsPart values (count, mean, M2) for each
// of the p.pieces pieces of every group, none when groups are not split. With ws == nullptr it only
// measures: stats_workspace() sizes the buffer with the same code that finds `part` in it.
template <typename T>
AccT<T>* carve_stats(void* ws, int64_t NG, const GroupPlan& p, size_t* bytes = nullptr) {
  WorkspaceCarver<16> w{static_cast<char*>(ws)};
  AccT<T>* part = nullptr;
  if (p.pieces > 1) part = w.take<AccT<T>>(static_cast<size_t>(NG * p.pieces * kStatsPart));
  if (bytes) *bytes = w.off;
  return part;
}

template <typename T>
size_t stats_workspace(const void* x, const GroupDims& d) {
  if (check_dims(d)) return 0;
  GroupPlan p;
  if (plan_stats<T>(x, d.N * d.G, d.D * d.S, true, &p)) return 0;
  size_t bytes = 0;
  carve_stats<T>(nullptr, d.N * d.G, p, &bytes);
  return bytes;
}

template <typename T>
const char* launch_stats(const T* x, int64_t NG, int64_t L, const GroupPlan& p, int mode,
                         double eps, AccT<T>* mean, AccT<T>* second, AccT<T>* part,
                         cudaStream_t st) {
  dispatch_team(p.team, [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    auto* k = p.V > 1 ? stats_kernel<T, vec_width<T>(), kTeam> : stats_kernel<T, 1, kTeam>;
    k<<<group_grid(p, NG), kBlock, 0, st>>>(x, NG, L, static_cast<uint32_t>(p.chunk), mode, eps,
                                             mean, second, part);
  });
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
const char* moments_impl(const MomentsArgs& a, void* ws, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, L = (a.dims.C / a.dims.G) * a.dims.S;
  GroupPlan p;
  if (const char* e = plan_stats<T>(a.x, NG, L, ws != nullptr, &p)) return e;
  A* mean = static_cast<A*>(a.mean);
  A* var = static_cast<A*>(a.var);
  if (p.pieces <= 1)
    return launch_stats<T>(static_cast<const T*>(a.x), NG, L, p, kStatsMeanVar, 0.0, mean, var,
                           nullptr, st);
  A* part = carve_stats<T>(ws, NG, p);
  if (const char* e = launch_stats<T>(static_cast<const T*>(a.x), NG, L, p, kStatsPartial, 0.0,
                                      nullptr, nullptr, part, st))
    return e;
  moments_finalize_kernel<T><<<static_cast<unsigned>(ceil_div(NG, kNumWarps)), kBlock, 0, st>>>(
      part, static_cast<int>(p.pieces), NG, mean, var, static_cast<const T*>(a.x), L);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

// Whether the forward takes fwd_resident_kernel: 16-byte aligned x and y, whole vectors per
// group, at most kResidentVecs of them per lane of the group's team (plan_team).
template <typename T>
bool plan_resident(const void* x, const void* y, int64_t L) {
  const int64_t V = vec_width<T>();
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return al16(x) && al16(y) && L % V == 0 &&
         L / V <= int64_t(plan_team(L, sizeof(T))) * kResidentVecs;
}

template <typename T, typename P>
const char* launch_resident(const GroupNormFwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, D = a.dims.C / a.dims.G, L = D * a.dims.S;
  dispatch_act(a.act, [&](auto act) {
    dispatch_team(plan_team(L, sizeof(T)), [&](auto team) {
      constexpr int kTeam = decltype(team)::value;
      auto* k = fwd_resident_kernel<T, P, vec_width<T>(), decltype(act)::value, kTeam>;
      k<<<static_cast<unsigned>(ceil_div(NG, kBlock / kTeam)), kBlock, 0, st>>>(
          static_cast<const T*>(a.x), static_cast<const P*>(a.gamma),
          static_cast<const P*>(a.beta), static_cast<T*>(a.y), static_cast<A*>(a.mean),
          static_cast<A*>(a.rstd), a.eps, NG, static_cast<uint32_t>(L),
          static_cast<uint32_t>(a.dims.S), a.dims.G, static_cast<uint32_t>(D));
    });
  });
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T, typename P>
const char* fwd_impl(const GroupNormFwdArgs& a, void* ws, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, D = a.dims.C / a.dims.G, L = D * a.dims.S;
  if (plan_resident<T>(a.x, a.y, L)) return launch_resident<T, P>(a, st);
  GroupPlan sp;
  if (const char* e = plan_stats<T>(a.x, NG, L, ws != nullptr, &sp)) return e;
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  A* mean = static_cast<A*>(a.mean);
  A* rstd = static_cast<A*>(a.rstd);
  A* part = carve_stats<T>(ws, NG, sp);
  const double eps = a.eps;
  if (const char* e = launch_stats<T>(x, NG, L, sp, sp.pieces > 1 ? kStatsPartial : kStatsMeanRstd,
                                      eps, mean, rstd, part, st))
    return e;
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  const int splits = static_cast<int>(sp.pieces);
  GroupPlan p = plan_group<T>(L, {a.x, a.y});  // the same team as the statistics (plan_team)
  const char* err = nullptr;
  dispatch_act(a.act, [&](auto act) {
    constexpr Act ACT = decltype(act)::value;
    dispatch_team(p.team, [&](auto team) {
      constexpr int kTeam = decltype(team)::value;
      auto* k = p.V > 1 ? fwd_apply_kernel<T, P, vec_width<T>(), ACT, kTeam>
                        : fwd_apply_kernel<T, P, 1, ACT, kTeam>;
      if ((err = plan_map(k, NG, L, &p))) return;
      k<<<group_grid(p, NG), kBlock, 0, st>>>(x, gamma, beta, y, mean, rstd, part, splits, eps,
                                               NG, L, static_cast<uint32_t>(a.dims.S), a.dims.G,
                                               static_cast<uint32_t>(D),
                                               static_cast<uint32_t>(p.chunk));
    });
  });
  if (err) return err;
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
const char* moments_bwd_impl(const MomentsBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, L = (a.dims.C / a.dims.G) * a.dims.S;
  GroupPlan p = plan_group<T>(L, {a.x, a.dx});
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  T* dx = static_cast<T*>(a.dx);
  const char* err = nullptr;
  dispatch_team(p.team, [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    auto* k = p.V > 1 ? moments_bwd_kernel<T, vec_width<T>(), kTeam>
                      : moments_bwd_kernel<T, 1, kTeam>;
    if ((err = plan_map(k, NG, L, &p))) return;
    k<<<group_grid(p, NG), kBlock, 0, st>>>(x, mean, dmean, dvar, dx, NG, L,
                                             static_cast<uint32_t>(a.dims.S),
                                             static_cast<uint32_t>(p.chunk));
  });
  if (err) return err;
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
  p.V = vectorizable<T>({a.dy, a.x}) ? Vw : 1;  // rows of any S and offset: cut16 / load_vec
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
    const int64_t units = ceil_div(S, p.V);
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

// The parameter gradients' stage-1 partials (param_reduce.cuh), after the row sums (`offset`: the
// bytes carve_rows measures): kParamPart values per (n chunk, channel), none with one chunk. With
// ws == nullptr it only measures.
template <typename T>
AccT<T>* carve_params(void* ws, size_t offset, int64_t C, int64_t chunks, size_t* bytes = nullptr) {
  WorkspaceCarver<16> w{static_cast<char*>(ws), offset};
  AccT<T>* part = nullptr;
  if (chunks > 1) part = w.take<AccT<T>>(static_cast<size_t>(chunks * C * kParamPart));
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
  int64_t chunks = 1;
  param_chunks(a.dims.N, kParamMinRows, &chunks);
  carve_params<T>(nullptr, bytes, a.dims.C, chunks, &bytes);
  return bytes;
}

// dgamma/dbeta from the row sums: bwd_param_kernel, then (several n chunks) param_finalize_kernel.
template <typename T, typename P>
const char* launch_params(const GroupNormBwdArgs& a, const RowPlan& rp, const AccT<T>* part,
                          cudaStream_t st) {
  using A = AccT<T>;
  P* dgamma = static_cast<P*>(a.dgamma);
  P* dbeta = static_cast<P*>(a.dbeta);
  if (dgamma == nullptr && dbeta == nullptr) return nullptr;
  const int64_t N = a.dims.N, C = a.dims.C, D = C / a.dims.G;
  int64_t chunks = 1;
  const int64_t rows = param_chunks(N, kParamMinRows, &chunks);
  size_t offset = 0;
  carve_rows<T>(nullptr, N * C, rp, &offset);
  A* ppart = carve_params<T>(a.workspace, offset, C, chunks);
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kParamTile)), static_cast<unsigned>(chunks));
  bwd_param_kernel<T, P><<<grid, kParamThreads, 0, st>>>(
      part, static_cast<int>(rp.splits), static_cast<const A*>(a.mean),
      static_cast<const A*>(a.rstd), N, C, a.dims.G, static_cast<uint32_t>(D), D * a.dims.S, rows,
      ppart, dgamma, dbeta);
  GN_CUDA_CHECK_LAUNCH();
  return launch_param_finalize(ppart, chunks, C, dgamma, dbeta, st);
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

// Whether the backward takes bwd_resident_kernel: 16-byte aligned x, dy and dx, vectors inside a
// channel (S a multiple of V), at most kResidentBwdVecs per lane of the group's team (plan_team).
template <typename T>
bool plan_resident_bwd(const GroupNormBwdArgs& a) {
  const int64_t V = vec_width<T>(), S = a.dims.S, L = (a.dims.C / a.dims.G) * S;
  const auto al16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return al16(a.x) && al16(a.dy) && al16(a.dx) && S % V == 0 &&
         L / V <= int64_t(plan_team(L, sizeof(T))) * kResidentBwdVecs;
}

// bwd_resident_kernel, then the parameter gradients from its row sums (one split per row); a batch
// of one sample gets them from the kernel itself (RowSink::direct).
template <typename T, typename P, Act ACT>
const char* bwd_resident(const GroupNormBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  const int64_t NG = a.dims.N * a.dims.G, D = a.dims.C / a.dims.G;
  RowPlan rp;  // splits = 1: the row-sum layout carve_rows / bwd_param_kernel read
  A* part = carve_rows<T>(a.workspace, a.dims.N * a.dims.C, rp);
  const bool direct = a.dims.N == 1;
  const RowSink<A, P> sink{part, static_cast<P*>(a.dgamma), static_cast<P*>(a.dbeta), direct};
  dispatch_team(plan_team(D * a.dims.S, sizeof(T)), [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    auto* k = bwd_resident_kernel<T, P, vec_width<T>(), ACT, kTeam>;
    k<<<static_cast<unsigned>(ceil_div(NG, kBlock / kTeam)), kBlock, 0, st>>>(
        static_cast<const T*>(a.dy), static_cast<const T*>(a.x), static_cast<const A*>(a.mean),
        static_cast<const A*>(a.rstd), static_cast<const A*>(a.dmean),
        static_cast<const A*>(a.drstd), static_cast<const P*>(a.gamma),
        static_cast<const P*>(a.beta), sink, static_cast<T*>(a.dx), NG, a.dims.G,
        static_cast<uint32_t>(D), static_cast<uint32_t>(a.dims.S), a.eps);
  });
  GN_CUDA_CHECK_LAUNCH();
  return direct ? nullptr : launch_params<T, P>(a, rp, part, st);
}

template <typename T, typename P, Act ACT>
const char* bwd_impl_act(const GroupNormBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  if (a.workspace == nullptr) return kGnNeedsWorkspace;
  if (!aligned16(a.workspace)) return kGnWorkspaceAlign;
  if (plan_resident_bwd<T>(a)) return bwd_resident<T, P, ACT>(a, st);
  RowPlan rp;
  if (const char* e = plan_rows<T, P, ACT>(a, &rp)) return e;
  A* part = carve_rows<T>(a.workspace, a.dims.N * a.dims.C, rp);
  const char* e = rp.V > 1 ? launch_row_sums<T, P, vec_width<T>(), ACT>(a, rp, part, st)
                           : launch_row_sums<T, P, 1, ACT>(a, rp, part, st);
  if (e) return e;

  const int64_t NG = a.dims.N * a.dims.G, D = a.dims.C / a.dims.G, L = D * a.dims.S;
  GroupPlan p = plan_group<T>(L, {a.dy, a.x, a.dx});
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  const A* dmean_o = static_cast<const A*>(a.dmean);
  const A* drstd_o = static_cast<const A*>(a.drstd);
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  T* dx = static_cast<T*>(a.dx);
  const int rs = static_cast<int>(rp.splits);
  const uint32_t D32 = static_cast<uint32_t>(D), S32 = static_cast<uint32_t>(a.dims.S);
  const char* err = nullptr;
  dispatch_team(p.team, [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    auto* k = p.V > 1 ? bwd_dx_kernel<T, P, vec_width<T>(), ACT, kTeam>
                      : bwd_dx_kernel<T, P, 1, ACT, kTeam>;
    if ((err = plan_map(k, NG, L, &p))) return;
    k<<<group_grid(p, NG), kBlock, 0, st>>>(dy, x, mean, rstd, dmean_o, drstd_o, gamma, beta,
                                              part, rs, dx, a.dims.N, a.dims.G, D32, S32,
                                              static_cast<uint32_t>(p.chunk), a.eps);
  });
  if (err) return err;
  GN_CUDA_CHECK_LAUNCH();
  return launch_params<T, P>(a, rp, part, st);
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

// Channels-last data (GroupDims::channels_last) goes to group_norm_nsc_cuda.cu.

size_t moments_workspace_cuda(const MomentsArgs& a) {
  if (a.dims.channels_last) return nsc_moments_workspace_cuda(a);
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto tag) -> const char* {
    n = stats_workspace<decltype(tag)>(a.x, a.dims);
    return nullptr;
  });
  return n;
}

size_t group_norm_fwd_workspace_cuda(const GroupNormFwdArgs& a) {
  if (a.dims.channels_last) return nsc_fwd_workspace_cuda(a);
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto tag) -> const char* {
    n = stats_workspace<decltype(tag)>(a.x, a.dims);
    return nullptr;
  });
  return n;
}

size_t group_norm_bwd_workspace_cuda(const GroupNormBwdArgs& a) {
  if (a.dims.channels_last) return nsc_bwd_workspace_cuda(a);
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
  if (a.dims.channels_last) {
    if (const char* e = check_group_dims(a.dims)) return e;
    return nsc_moments_cuda(a, stream);
  }
  if (const char* e = check_dims(a.dims)) return e;
  if (a.workspace && !aligned16(a.workspace)) return kGnWorkspaceAlign;
  return dispatch_data(a.dtype, [&](auto tag) {
    return moments_impl<decltype(tag)>(a, a.workspace, as_stream(stream));
  });
}

const char* moments_bwd_cuda(const MomentsBwdArgs& a, void* stream) {
  if (a.dims.channels_last) {
    if (const char* e = check_group_dims(a.dims)) return e;
    return nsc_moments_bwd_cuda(a, stream);
  }
  if (const char* e = check_dims(a.dims)) return e;
  return dispatch_data(a.dtype, [&](auto tag) {
    return moments_bwd_impl<decltype(tag)>(a, as_stream(stream));
  });
}

const char* group_norm_fwd_cuda(const GroupNormFwdArgs& a, void* stream) {
  if (a.dims.channels_last) {
    if (const char* e = check_group_dims(a.dims)) return e;
    return nsc_fwd_cuda(a, stream);
  }
  if (const char* e = check_dims(a.dims)) return e;
  if (a.workspace && !aligned16(a.workspace)) return kGnWorkspaceAlign;
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    return fwd_impl<decltype(t), decltype(p)>(a, a.workspace, as_stream(stream));
  });
}

const char* group_norm_bwd_cuda(const GroupNormBwdArgs& a, void* stream) {
  if (a.dims.channels_last) {
    if (const char* e = check_group_dims(a.dims)) return e;
  if (a.act != Act::kNone && a.beta == nullptr) return kGnActNeedsBeta;
    return nsc_bwd_cuda(a, stream);
  }
  if (const char* e = check_dims(a.dims)) return e;
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    return bwd_impl<decltype(t), decltype(p)>(a, as_stream(stream));
  });
}

}  // namespace gn_mx
