/*
 * dbn_iternorm_cuda.cuh: IterNorm on CUDA (dbn_cuda.cu): iternorm_kernel runs dbn_math.h's Newton
 * iterations and their backward through BlockExec (dbn_small_cuda.cuh), launch_iternorm issues its
 * launches of at most two D x D products each. Private to dbn_cuda.cu (internal linkage).
 */
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dbn_small_cuda.cuh"

namespace gn_mx {
namespace {

// ---- IterNorm: the Newton iterations and their backward, in launches of at most two products ---
// The per-group state lives in the scratch (IterScratch; the iteration's matrices in S: float when
// dbn_iternorm_fp32, else double). Forward: eig_kernel (Sigma, flag) -> kStart -> kIter (k, part)
// for k < T, parts < dbn_iternorm_iter_parts(k) -> kFwdFinish (W, saved Sigma / diag, running
// statistics). Backward: bwd_small_kernel stage 0 (G_W, Sigma, dymean, dbeta) -> kStart -> kIter
// ... -> kHeadFinish (W, dgamma, G) -> kBack (k, part) for k = T-1 .. 0, parts <
// dbn_bwd_iternorm_step_parts(k) -> kTail (B; W and B out). At D = 512 a launch is then <= 2
// products (docs/performance/gpu.md).
// Grid: blockIdx.x is the group. The product stages (kIter, kBack) spread a group's 64 x 64 output
// tiles over gridDim.y = iter_owners(...) blocks (TileOwner: tile pairs for kIter's symmetric
// products, tiles for kBack's), which dbn_math.h's parts allow with no barrier between blocks; a
// block computes each of its entries exactly as the one block per group did, so the results do not
// depend on the split (GNMX_DBN_CUDA_ITER_SPLIT=0 keeps one block per group). The other stages
// (traces, sums over whole matrices) run one block per group.
enum class IterStage : int { kStart, kIter, kFwdFinish, kHeadFinish, kBack, kTail };

// GNMX_DBN_CUDA_ITER_SPLIT: unset, "" or "1" -> split the product stages (the default); "0" -> one
// block per group; anything else -> -1 (an error).
inline int iter_split_env() {
  const char* v = std::getenv("GNMX_DBN_CUDA_ITER_SPLIT");
  if (!v || !*v || std::strcmp(v, "1") == 0) return 1;
  return std::strcmp(v, "0") == 0 ? 0 : -1;
}
constexpr const char* kIterSplitEnvError =
    "GNMX_DBN_CUDA_ITER_SPLIT must be 0 or 1 (docs/dbn.md)";

// The blocks per group of a stage's launch (gridDim.y) and the owner unit of its blocks.
__host__ __device__ inline bool iter_stage_pairs(IterStage stage) {
  return stage == IterStage::kIter;
}
inline int iter_owners(IterStage stage, int D, bool split) {
  const bool products = stage == IterStage::kIter || stage == IterStage::kBack;
  return split && products ? TileOwner::owners(D, iter_stage_pairs(stage)) : 1;
}

template <typename A>
struct IterArgs {
  double* scratch;
  int64_t spg;  // scratch doubles per group
  int D, T;
  bool bwd;
  double m, momentum;
  // forward
  A* eigvec;
  A* eigval;
  const A* mean;
  DType stat_dtype;
  void* running_mean;
  void* running_proj;
  A* bias;
  const void* beta;
  // both (W: diag(gamma) W in the forward, W diag(gamma) in the backward)
  A* Wout;
  DType param_dtype;
  const void* gamma;
  // backward
  A* Bout;
  void* dgamma;
};

// The fields both directions set (the groups' scratch, sizes, W's output, gamma); the forward adds
// its outputs and running statistics, the backward Bout and dgamma.
template <typename A>
IterArgs<A> iter_args(double* scratch, int64_t spg, int D, int T, bool bwd, double m, A* Wout,
                      DType param_dtype, const void* gamma) {
  IterArgs<A> it{};
  it.scratch = scratch;
  it.spg = spg;
  it.D = D;
  it.T = T;
  it.bwd = bwd;
  it.m = m;
  it.Wout = Wout;
  it.param_dtype = param_dtype;
  it.gamma = gamma;
  return it;
}

template <typename A, typename S>
__global__ void __launch_bounds__(kBlock, kOneBlockPerSm)
iternorm_kernel(IterArgs<A> a, IterStage stage, int k, int part) {
  __shared__ double s_gam[kMaxD], s_dgam[kMaxD];
  extern __shared__ __align__(16) unsigned char smem[];  // kTileBytes: BlockExec's tiles
  const TileOwner own{gridDim.y > 1 ? static_cast<int>(blockIdx.y) : -1, iter_stage_pairs(stage)};
  const BlockExec ex{reinterpret_cast<double*>(smem), false, own};
  const int64_t g = blockIdx.x;
  const int D = a.D, DD = D * D, T = a.T;
  const IterScratch z = iter_scratch(a.scratch + g * a.spg, D, T, a.bwd);
  const DbnIterScratch<S> L =
      dbn_iternorm_layout(reinterpret_cast<S*>(z.mats), z.dbl, D, T, a.bwd);
  const bool finite = z.flag[0] != 0.0;  // uniform over the block
  if (a.gamma)
    for (int i = threadIdx.x; i < D; i += blockDim.x)
      s_gam[i] = dbn_load_stat(a.param_dtype, a.gamma, g * D + i);
  __syncthreads();
  switch (stage) {
    case IterStage::kStart:
      if (finite) dbn_iternorm_start(ex, z.sig, D, L);
      return;
    case IterStage::kIter:
      if (finite) dbn_iternorm_iter(ex, D, k, a.bwd, L, part);
      return;
    case IterStage::kFwdFinish: {
      if (finite) {
        dbn_iternorm_w(ex, L.Q + int64_t(T % 2) * DD, D, *L.tr, z.W);
      } else {
        const double nan = __longlong_as_double(0x7ff8000000000000LL);
        for (int e = threadIdx.x; e < DD; e += blockDim.x) z.W[e] = nan;
        __syncthreads();
      }
      for (int e = threadIdx.x; e < DD; e += blockDim.x) {
        a.eigvec[g * DD + e] = static_cast<A>(z.sig[e]);
        a.Wout[g * DD + e] = static_cast<A>(a.gamma ? s_gam[e / D] * z.W[e] : z.W[e]);
      }
      for (int i = threadIdx.x; i < D; i += blockDim.x) {
        a.eigval[g * D + i] = static_cast<A>(z.sig[i * D + i]);
        if (a.gamma)
          a.bias[g * D + i] = static_cast<A>(dbn_load_stat(a.param_dtype, a.beta, g * D + i));
      }
      dbn_update_running(ex, a.stat_dtype, a.running_proj, a.running_mean, g, D, z.W, a.mean,
                         a.momentum);
      return;
    }
    case IterStage::kHeadFinish:
      dbn_bwd_iternorm_head_finish(ex, z.GW, D, T, a.gamma ? s_gam : nullptr, s_dgam, z.W, L);
      if (a.gamma)
        for (int i = threadIdx.x; i < D; i += blockDim.x)
          dbn_store_stat(a.param_dtype, a.dgamma, g * D + i, s_dgam[i]);
      return;
    case IterStage::kBack:
      dbn_bwd_iternorm_step(ex, D, k, L, part);
      return;
    case IterStage::kTail:
      dbn_bwd_iternorm_tail(ex, z.sig, D, a.m, /*B=*/z.GW, L);
      for (int e = threadIdx.x; e < DD; e += blockDim.x) {
        a.Bout[g * DD + e] = static_cast<A>(z.GW[e]);
        a.Wout[g * DD + e] = static_cast<A>(a.gamma ? z.W[e] * s_gam[e % D] : z.W[e]);
      }
      return;
  }
}

// The launches of one IterNorm forward (bwd = false: from kStart to kFwdFinish) or backward (from
// kStart to kTail), S chosen by dbn_iternorm_fp32.
template <typename A, typename S>
const char* launch_iternorm_s(const IterArgs<A>& a, int64_t G, bool split, cudaStream_t st) {
  auto run = [&](IterStage stage, int k, int part) -> const char* {
    const dim3 grid(static_cast<unsigned>(G),
                    static_cast<unsigned>(iter_owners(stage, a.D, split)));
    iternorm_kernel<A, S><<<grid, kBlock, kTileBytes, st>>>(a, stage, k, part);
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  };
  const char* e = run(IterStage::kStart, 0, 0);
  for (int k = 0; k < a.T && !e; ++k)
    for (int p = 0; p < dbn_iternorm_iter_parts(k) && !e; ++p) e = run(IterStage::kIter, k, p);
  if (e || !a.bwd) return e ? e : run(IterStage::kFwdFinish, 0, 0);
  e = run(IterStage::kHeadFinish, 0, 0);
  for (int k = a.T - 1; k >= 0 && !e; --k)
    for (int p = 0; p < dbn_bwd_iternorm_step_parts(k) && !e; ++p)
      e = run(IterStage::kBack, k, p);
  return e ? e : run(IterStage::kTail, 0, 0);
}
template <typename A>
const char* launch_iternorm(const IterArgs<A>& a, DType dtype, int64_t G, cudaStream_t st) {
  const int split = iter_split_env();
  if (split < 0) return kIterSplitEnvError;
  return dbn_iternorm_fp32(dtype, a.T) ? launch_iternorm_s<A, float>(a, G, split != 0, st)
                                       : launch_iternorm_s<A, double>(a, G, split != 0, st);
}

}  // namespace
}  // namespace gn_mx
