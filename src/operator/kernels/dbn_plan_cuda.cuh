/*
 * dbn_plan_cuda.cuh: the launch plan and the workspace layouts of the DBN CUDA kernels (dbn_cuda.cu):
 * the kernels' block and tile constants, DbnCudaPlan / make_plan (grids of the mean, gram and
 * apply kernels), the eigensolver paths (EigPath), the small kernels' fp64 scratch (IterScratch,
 * fwd_scratch / bwd_scratch) and the workspaces FwdWs / BwdWs / InfWs. Private to dbn_cuda.cu
 * (internal linkage, an unnamed namespace), like dbn_panels_cpu.h for dbn_cpu.cc.
 */
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "dbn.h"
#include "dbn_math.h"
#include "../common/carver.h"
#include "cuda_common.cuh"
#include "dbn_gemm_cuda.cuh"

namespace gn_mx {
namespace {

constexpr int kBlock = 256;
constexpr int kMaxD = static_cast<int>(kDbnMaxGroupSizeCuda);  // static shared-memory arrays
constexpr size_t kAlign = 256;
constexpr int64_t kMaxPartialDoubles = int64_t(2) << 20;  // 16 MiB of gram partials
constexpr int kApplyTileElems = 4096;  // outputs per apply panel: TT x BN, 16 per thread
constexpr int kMeanRows = kBlock / 32; // channel_sum_kernel: warps, each a row of columns
// The one-block-per-group kernels (eig_kernel, bwd_small_kernel, iternorm_kernel: grid = G groups,
// D x D products or Jacobi sweeps per block) declare a minimum of one resident block per SM, so
// ptxas may give them up to 255 registers: with the plain bound it capped them at 64-128 and
// spilled 8-312 bytes (CUDA 11.8 and nvcc 13, sm_50..sm_90) inside their product loops, to keep a
// second block resident that a grid of G <= SM-count blocks never has (eig_kernel's shared path is
// one block per SM by its shared memory anyway). With it: 112-211 registers, no spills (CUDA 11.8,
// sm_50 / 75 / 90). A grid of more groups than SMs runs in more waves; not measured on a GPU.
constexpr int kOneBlockPerSm = 1;
constexpr int64_t kMaxMeanChunks = 64;
// gram_reduce_kernel runs for G below the SM count when a group's split partials reach this many
// doubles (512 KiB: below it, one block reads them in about the reduction's launch time).
constexpr int64_t kReduceMinDoubles = int64_t(1) << 16;
static_assert(kBlock == dbn_tiles::kThreads, "the tile helpers assume kBlock threads");

// Gram tile TT in {16, 32, 64}: TT x TT outputs per block, 4 x 4 per thread, so KS = 4096 / TT^2
// slices of threads split each panel's columns; panel width BK = 1024 / TT columns.
__host__ __device__ constexpr int gram_bk(int tt) { return 1024 / tt; }
__host__ __device__ constexpr int gram_slices(int tt) { return 4096 / (tt * tt); }
// Apply tile: TT output channels x BN = 4096 / TT columns; per step, apply_kstep(TT) columns of M
// and rows of the data panel (32 for the 64-tile: two L2 round trips per 1024 FMAs per thread).
__host__ __device__ constexpr int apply_bn(int tt) { return kApplyTileElems / tt; }
__host__ __device__ constexpr int apply_kstep(int tt) { return tt == 64 ? 32 : 16; }
// The smallest tile that covers D (64 above).
inline int tile_for(int64_t D) { return D <= 16 ? 16 : D <= 32 ? 32 : 64; }


// ------------------------------------------------------------------------------------------------
// Launch plan and workspace

// The shape plus the launch plan of the mean, gram and apply kernels; the CPU's PanelGeo is the
// same shape with its own panel plan.
struct DbnCudaPlan : DbnShape {
  // gram_kernel: grid (G * gram_pairs, gram_splits); splits of gram_cols columns (a multiple of
  // the panel width), each writing its own fp64 partials. gram_chunks: the partials per group that
  // the small kernels sum (part[(g*gram_chunks + chunk)*E + e]): gram_splits, or 1 when
  // gram_reduce_kernel has summed the splits first (G below the SM count and large partials: the
  // small kernels' one block per group would read every split at one SM's bandwidth).
  int gram_tile = 64;
  int gram_tiles = 1;        // ceil(D / gram_tile)
  int64_t gram_pairs = 1;    // tile pairs per group (upper triangle in the forward)
  int64_t gram_cols = 1;
  int64_t gram_splits = 1;
  int64_t gram_chunks = 1;
  int gram_lsh = 0;          // log2 of the tile order's run length (dbn_gemm_cuda.cuh)
  // apply_kernel: grid (G * apply_tiles, apply_blocks), apply_cols columns per block.
  int apply_tile = 64;
  int apply_tiles = 1;
  int64_t apply_cols = 1;
  int64_t apply_blocks = 1;
  int apply_lsh = 0;
  // channel_sum_kernel: grid (ceil(C / mean_tc), mean_chunks), mean_cols columns per chunk.
  int mean_lsh = 0;
  int mean_tc = 32;
  int64_t mean_cols = 1;
  int64_t mean_chunks = 1;
};

const char* check_geo(int64_t N, int64_t C, int64_t G, int64_t S) {
  if (const char* e = dbn_check_shape(N, C, G, S, kMaxD, "gpu")) return e;
  if (G > INT_MAX || N * S > (int64_t(1) << 40)) return "tensor too large";
  return nullptr;
}

int64_t gram_pairs_of(int64_t tiles, bool bwd) {
  return bwd ? tiles * tiles : tiles * (tiles + 1) / 2;
}

// Blocks of each kernel that fill the GPU once (SMs x resident blocks): gram[i] / apply[i] for
// tile 16 << i; gram unused when the call runs no gram kernel (has_gram false).
struct DbnWaves {
  int64_t gram[3] = {1, 1, 1};
  int64_t apply[3] = {1, 1, 1};
  int64_t mean = 1;
  int64_t sms = 1;
};

inline int tile_index(int tt) { return tt == 16 ? 0 : tt == 32 ? 1 : 2; }

// Gram: for tiles from the smallest covering D down to 16, the column chunks that make about one
// wave of blocks (at least two panels per chunk, at most kMaxPartialDoubles partials); the first
// tile whose grid fills a wave, else the one with the most blocks (small tiles trade L2 reads of x
// for blocks: G = 1, D = 512 gets 36 pairs of 64-tiles or 136 of 32-tiles per chunk).
// Apply: the tile covering D, columns for two waves. Mean: channel blocks x chunks for two waves.
const char* make_plan(int64_t N, int64_t C, int64_t G, int64_t S, bool has_gram, bool bwd,
                      const DbnWaves& wv, DbnCudaPlan* out) {
  DbnCudaPlan q;
  static_cast<DbnShape&>(q) = dbn_shape(N, C, G, S);
  if (has_gram) {
    const int64_t E = q.D * q.D + (bwd ? q.D : 0);
    int64_t best = -1;
    for (int tt = tile_for(q.D); tt >= 16; tt /= 2) {
      const int bk = gram_bk(tt);
      const int64_t tiles = ceil_div(q.D, tt), pairs = gram_pairs_of(tiles, bwd);
      const int64_t wave = wv.gram[tile_index(tt)];
      int64_t want = std::max<int64_t>(1, ceil_div(wave, G * pairs));
      want = std::min(want, std::max<int64_t>(1, q.m / (2 * bk)));
      want = std::min(want, std::max<int64_t>(1, kMaxPartialDoubles / (G * E)));
      want = std::min<int64_t>(want, 65535);
      const int64_t cols = ceil_div(ceil_div(q.m, want), bk) * bk;
      const int64_t chunks = ceil_div(q.m, cols), blocks = G * pairs * chunks;
      if (blocks > best) {
        best = blocks;
        q.gram_tile = tt;
        q.gram_tiles = static_cast<int>(tiles);
        q.gram_pairs = pairs;
        q.gram_cols = cols;
        q.gram_splits = chunks;
        q.gram_lsh = dbn_tiles::log2_pow2(dbn_tiles::run_length(S, bk));
      }
      if (blocks >= wave) break;
    }
    if (G * q.gram_pairs > INT_MAX) return "tensor too large";
    const bool reduce = q.gram_splits > 1 && G < wv.sms && q.gram_splits * E >= kReduceMinDoubles;
    q.gram_chunks = reduce ? 1 : q.gram_splits;
  }
  q.apply_tile = tile_for(q.D);
  const int bn = apply_bn(q.apply_tile);
  q.apply_tiles = static_cast<int>(ceil_div(q.D, q.apply_tile));
  const int64_t apply_wave = wv.apply[tile_index(q.apply_tile)];
  int64_t ab = std::max<int64_t>(1, ceil_div(2 * apply_wave, G * q.apply_tiles));
  ab = std::min<int64_t>(std::min(ab, ceil_div(q.m, bn)), 65535);
  q.apply_cols = ceil_div(ceil_div(q.m, ab), bn) * bn;
  q.apply_blocks = ceil_div(q.m, q.apply_cols);
  q.apply_lsh = dbn_tiles::log2_pow2(dbn_tiles::run_length(S, bn));
  if (G * q.apply_tiles > INT_MAX) return "tensor too large";
  const int L = dbn_tiles::run_length(S, 32);
  q.mean_lsh = dbn_tiles::log2_pow2(L);
  q.mean_tc = 32 / L;
  const int64_t cblocks = ceil_div(C, q.mean_tc), row = int64_t(kMeanRows) * L;
  if (cblocks > INT_MAX) return "tensor too large";
  int64_t mc = std::max<int64_t>(1, ceil_div(2 * wv.mean, cblocks));
  mc = std::min(std::min(mc, kMaxMeanChunks), std::max<int64_t>(1, q.m / (8 * row)));
  q.mean_cols = ceil_div(ceil_div(q.m, mc), row) * row;
  q.mean_chunks = ceil_div(q.m, q.mean_cols);
  *out = q;
  return nullptr;
}

using Carver = WorkspaceCarver<kAlign>;

constexpr int kFwdScratchMats = 3;  // eig_kernel's D x D fp64 matrices per group (ZCA)
constexpr int kBwdScratchMats = 6;  // bwd_small_kernel's (ZCA)

// ------------------------------------------------------------------------------------------------
// The ZCA forward's eigensolver (eig_kernel), by group size and GNMX_DBN_CUDA_EIG (docs/dbn.md):
//   kShared:   block-parallel Jacobi with A and U^T in shared memory (padded rows), the default
//              while eig_smem(D, true) fits the device's opt-in shared memory per block (D <= 53
//              .. 118 by architecture: the list is in dbn.h);
//   kCusolver: cusolverDnDsyevd per group (cusolver_loader.h), the default above that;
//   kGlobal:   the same Jacobi on matrices in the workspace (only when asked for: O(D^3) global
//              traffic per sweep, seconds at D = 512).
// IterNorm needs no eigensolver (its path is kGlobal: products only).
enum class EigPath : int { kShared = 0, kGlobal = 1, kCusolver = 2 };
// What an eig_kernel launch does: the whole forward step (Jacobi), or cuSOLVER's two halves
// around the library call (Sigma into the workspace; then sort, W, outputs).
enum class EigPhase : int { kAll = 0, kPrepare = 1, kFinish = 2 };

struct EigPlan {
  EigPath path = EigPath::kGlobal;
  size_t smem = 0;  // eig_kernel's dynamic shared memory
  int lwork = 0;    // cusolverDnDsyevd's workspace (doubles)
};

// fp64 scratch doubles per group of the forward / backward small kernels, IterNorm included
// (IterScratch below). T is clamped so that an invalid count (rejected before any launch) sizes
// nothing odd. The cuSOLVER path adds one double per group: whether Sigma was finite.
// IterNorm's per-group scratch, in doubles: Sigma, W, G_W (then B; backward only), the
// iteration's matrices (dbn_iternorm_mats of them, float or double: sized as doubles), its
// doubles (dbn_iternorm_doubles), and a flag (Sigma finite).
struct IterScratch {
  double *sig, *W, *GW, *mats, *dbl, *flag;
};
__host__ __device__ inline int64_t iter_scratch_doubles(int64_t D, int T, bool bwd) {
  return (bwd ? 3 : 2) * D * D + dbn_iternorm_mats(T, bwd) * D * D +
         dbn_iternorm_doubles(static_cast<int>(D), bwd) + 1;
}
__host__ __device__ inline IterScratch iter_scratch(double* base, int D, int T, bool bwd) {
  const int64_t DD = int64_t(D) * D;
  IterScratch z;
  z.sig = base;
  z.W = z.sig + DD;
  z.GW = bwd ? z.W + DD : nullptr;
  z.mats = z.W + (bwd ? 2 : 1) * DD;
  z.dbl = z.mats + dbn_iternorm_mats(T, bwd) * DD;
  z.flag = z.dbl + dbn_iternorm_doubles(D, bwd);
  return z;
}
int64_t fwd_scratch(int64_t D, DbnWhitening w, EigPath path, int T = 1) {
  if (w == DbnWhitening::kIterNorm)
    return iter_scratch_doubles(D, std::max(1, std::min(T, kDbnMaxIterations)), false);
  return kFwdScratchMats * D * D + (path == EigPath::kCusolver ? 1 : 0);
}
int64_t bwd_scratch(int64_t D, DbnWhitening w, int T) {
  if (w != DbnWhitening::kIterNorm) return kBwdScratchMats * D * D;
  return iter_scratch_doubles(D, std::max(1, std::min(T, kDbnMaxIterations)), true);
}

// Doubles of the gram kernel's split partials before gram_reduce_kernel (0 without it).
int64_t split_doubles(const DbnCudaPlan& q, int64_t E) {
  return q.gram_chunks != q.gram_splits ? q.G * q.gram_splits * E : 0;
}

template <typename A>
struct FwdWs {
  double* part;     // G x chunks x DD
  A* W;             // G x DD (diag(gamma) W with the affine)
  A* bias;          // C, beta in AccT (affine)
  double* scratch;  // G x fwd_scratch
  // cuSOLVER path only (empty otherwise):
  double* evals;    // G x D eigenvalues
  int* info;        // G, cuSOLVER's info
  double* work;     // lwork
  double* msum;     // mean_chunks x C channel sums (only with mean_chunks > 1)
  double* split;    // G x gram_splits x DD (only when gram_reduce_kernel runs)
};
template <typename A>
FwdWs<A> fwd_ws(Carver* c, const DbnCudaPlan& q, DbnWhitening wh, const EigPlan& ep, int T) {
  const size_t DD = q.D * q.D;
  const bool cus = wh == DbnWhitening::kZca && ep.path == EigPath::kCusolver;
  FwdWs<A> w;
  w.part = c->take<double>(q.G * q.gram_chunks * DD);
  w.W = c->take<A>(q.G * DD);
  w.bias = c->take<A>(q.C);
  w.scratch = c->take<double>(q.G * fwd_scratch(q.D, wh, ep.path, T));
  w.evals = c->take<double>(cus ? q.G * q.D : 0);
  w.info = c->take<int>(cus ? q.G : 0);
  w.work = c->take<double>(cus ? ep.lwork : 0);
  w.msum = c->take<double>(q.mean_chunks > 1 ? q.mean_chunks * q.C : 0);
  w.split = c->take<double>(split_doubles(q, DD));
  return w;
}

template <typename A>
struct BwdWs {
  double* part;     // G x chunks x (DD + D)
  A* W;             // G x DD
  A* B;             // G x DD
  A* dymean;        // C
  double* scratch;  // G x kBwdScratchMats x DD
  double* split;    // G x gram_splits x (DD + D) (only when gram_reduce_kernel runs)
};
template <typename A>
BwdWs<A> bwd_ws(Carver* c, const DbnCudaPlan& q, DbnWhitening wh, int T) {
  const size_t DD = q.D * q.D;
  BwdWs<A> w;
  w.part = c->take<double>(q.G * q.gram_chunks * (DD + q.D));
  w.W = c->take<A>(q.G * DD);
  w.B = c->take<A>(q.G * DD);
  w.dymean = c->take<A>(q.C);
  w.scratch = c->take<double>(q.G * bwd_scratch(q.D, wh, T));
  w.split = c->take<double>(split_doubles(q, DD + q.D));
  return w;
}

template <typename A>
struct InfWs {
  A* P;          // G x DD
  A* shift;      // C
  A* bias;       // C (affine forward)
  // affine backward only (empty otherwise):
  double* part;     // G x chunks x (DD + D): dy (x - r_mean)^T and sum(dy)
  double* scratch;  // G x 2 x DD, affine_grad_kernel's P and summed partials
  double* split;    // G x gram_splits x (DD + D) (affine backward, gram_reduce_kernel only)
};
template <typename A>
InfWs<A> inf_ws(Carver* c, const DbnCudaPlan& q, bool grads) {
  InfWs<A> w;
  w.P = c->take<A>(q.G * q.D * q.D);
  w.shift = c->take<A>(q.C);
  w.bias = c->take<A>(q.C);
  w.part = c->take<double>(grads ? q.G * q.gram_chunks * (q.D * q.D + q.D) : 0);
  w.scratch = c->take<double>(grads ? q.G * 2 * q.D * q.D : 0);
  w.split = c->take<double>(grads ? split_doubles(q, q.D * q.D + q.D) : 0);
  return w;
}

}  // namespace
}  // namespace gn_mx
