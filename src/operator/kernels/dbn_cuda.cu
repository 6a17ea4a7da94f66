/*
 * dbn_cuda.cu: CUDA twins of dbn_cpu.cc (Decorrelated BN, ZCA whitening per group; math in dbn.h,
 * backward derivation above BwdLayout in dbn_cpu.cc, D x D formulas in dbn_math.h).
 *
 * Group g is a D x m matrix (m = N*S columns j = n*S + s); column j of group g lives at
 * x + (n*C + g*D)*S + s with row stride S, so tiles are gathered straight from NCHW into shared
 * memory, widened to AccT, in dbn_gemm_cuda.cuh's tile order (consecutive threads along channels
 * for small S, S = 1 included; along s for large S) and multiplied with 4 x 4 register blocks.
 *
 * Forward:  channel sums (channel tiles x column chunks, fp64; a finalize kernel sums the
 *           chunks in order)                                -> mean (C,)
 *           gram kernel, grid (G x tile pairs, column splits): each block sums one TT x TT tile
 *           of Xc Xc^T (upper-triangle pairs, mirrored) over its columns in AccT registers,
 *           partials written as fp64 (summed first by gram_reduce_kernel when G is small)
 *           eig kernel, one block per group: Sigma = sum(partials)/m + eps I (fp64), parallel
 *           cyclic Jacobi (round-robin ordering: D/2 disjoint rotations per step, all threads
 *           applying them) on A and U^T in shared memory, ascending sort, then dbn_math.h's
 *           dbn_whitening_matrix (clamp, W = U diag(l^-1/2) U^T) and dbn_update_running run by
 *           BlockExec; for D beyond shared memory, the eig kernel in two halves around
 *           cusolverDnDsyevd per group (EigPath below, GNMX_DBN_CUDA_EIG)
 *           apply kernel, grid (G x row tiles, column blocks): y = W (x - mu), tiled product
 * Backward: gram kernel with dY: G_W = dY Xc^T and sum(dY)  -> fp64 partials
 *           small kernel, one block per group: dbn_math.h's dbn_bwd_small run by BlockExec
 *           (W, B = (2/m) G_S)
 *           apply kernel: dX = W (dY - mean(dY)) + B Xc
 * Inference (and its backward, P^T): prep kernel (running stats -> AccT), apply kernel.
 * IterNorm (whitening = kIterNorm): eig_kernel only forms Sigma, bwd_small_kernel only sums G_W;
 * iternorm_kernel runs dbn_math.h's iterations and back steps (the CPU's code) in launches of at
 * most two D x D products each, in fp32 or fp64 by dbn_iternorm_fp32.
 * Fused affine (gamma/beta given): the eig / prep kernels scale the rows of W / P by gamma and the
 * apply kernel adds beta; the backward's small kernel scales G_W's rows and W's columns by gamma
 * and writes dgamma (dbn_affine_dgamma) and dbeta from the sums it already has; the inference
 * backward adds the gram kernel on (dy, x - r_mean) and affine_grad_kernel.
 * Everything runs on `stream` with no host round trip: 3-6 launches (the mean finalize and
 * gram_reduce_kernel only when columns are split), plus per group one cusolverDnDsyevd on the
 * cuSOLVER path; IterNorm adds 2 T + 2 launches to the forward and 5 T + 3 to the backward.
 *
 * D x D matrices of the eig/small kernels live in the workspace (L1/L2-resident for D <= 64;
 * Jacobi's two in shared memory), their products go through shared-memory tiles (BlockExec::mm);
 * the CUDA path supports D = C/G <= 512. Every launch is followed by cudaGetLastError.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>

#include "dbn.h"
#include "dbn_math.h"
#include "../common/carver.h"
#include "cuda_common.cuh"
#include "cusolver_loader.h"
#include "../common/dispatch.h"
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

// ------------------------------------------------------------------------------------------------
// Kernels

// Grid (ceil(C / tc), chunks), tc = 32 >> lsh channels per block: lane = (channel d, kl < L =
// 1 << lsh), warp kh; a thread sums x[c, j] in fp64 over j = j_begin + kh*L + kl + i*kMeanRows*L
// (a warp reads L consecutive columns of 32/L consecutive channels: contiguous for S = 1 and for
// power-of-two S <= 32; runs of 32 along s above). (n, s) advance incrementally: no division per
// element. One chunk: mean[c] = sum / m; else psum[chunk*C + c] = the chunk's sum.
template <typename T>
__global__ void __launch_bounds__(kBlock)
channel_sum_kernel(const T* __restrict__ x, int64_t C, int64_t S, int64_t m, int64_t cols, int lsh,
                   double* __restrict__ psum, AccT<T>* __restrict__ mean) {
  __shared__ double red[kMeanRows][32];
  const int L = 1 << lsh, tc = 32 >> lsh;
  const int lane = threadIdx.x & 31, kh = threadIdx.x >> 5;
  const int64_t c = int64_t(blockIdx.x) * tc + (lane >> lsh);
  const int64_t j_begin = blockIdx.y * cols;
  const int64_t j_end = j_begin + cols < m ? j_begin + cols : m;
  double sum = 0.0;
  int64_t j = j_begin + (int64_t(kh) << lsh) + (lane & (L - 1));
  if (c < C && j < j_end) {
    const int64_t CS = C * S, step = int64_t(kMeanRows) << lsh, dn = step / S, ds = step - dn * S;
    int64_t n = j / S, s = j - n * S, off = n * CS + c * S + s;
    for (; j < j_end; j += step) {
      sum += static_cast<double>(to_acc(x[off]));
      s += ds;
      off += dn * CS + ds;
      if (s >= S) {
        s -= S;
        off += CS - S;
      }
    }
  }
  red[kh][lane] = sum;
  __syncthreads();
  if (threadIdx.x < tc) {
    const int64_t cc = int64_t(blockIdx.x) * tc + threadIdx.x;
    double t = 0.0;
    for (int r = 0; r < kMeanRows; ++r)
      for (int k = 0; k < L; ++k) t += red[r][(threadIdx.x << lsh) + k];
    if (cc < C) {
      if (gridDim.y == 1) mean[cc] = static_cast<AccT<T>>(t / static_cast<double>(m));
      else psum[blockIdx.y * C + cc] = t;
    }
  }
}

// mean[c] = (sum over chunks, in order, of psum[chunk*C + c]) / m.
template <typename A>
__global__ void __launch_bounds__(kBlock)
mean_finalize_kernel(const double* __restrict__ psum, int64_t chunks, int64_t C, double m,
                     A* __restrict__ mean) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < C;
       c += int64_t(gridDim.x) * blockDim.x) {
    double t = 0.0;
    for (int64_t k = 0; k < chunks; ++k) t += psum[k * C + c];
    mean[c] = static_cast<A>(t / m);
  }
}

template <int TT>
size_t gram_smem(size_t acc) {
  constexpr int bk = gram_bk(TT);
  return bk * sizeof(int64_t) + 2 * size_t(bk) * (TT + dbn_tiles::kPad) * acc;
}

// Grid (G * pairs, chunks): block (g, tile pair (ti, tj), chunk) sums the TT x TT output tile over
// the chunk's columns, panel by panel (BK columns gathered into shared memory, k-major, widened to
// AccT), 4 x 4 outputs per thread in AccT registers; KS > 1 slices of threads take every KS-th
// column of a panel and are summed in slice order at the end. Partials go out as fp64:
// Forward (kBwd = false): part[g][chunk][i*D + j] = sum_cols Xc_i Xc_j, upper-triangle tile pairs
// (ti <= tj), each off-diagonal tile written to both (i, j) and (j, i).
// Backward (kBwd = true): entries i*D + j = sum dY_i Xc_j (G_W, every tile pair), entries DD + i
// = sum dY_i (by the tj = 0 blocks).
template <typename T, bool kBwd, int TT>
__global__ void __launch_bounds__(kBlock)
gram_kernel(const T* __restrict__ x, const AccT<T>* __restrict__ mean, const T* __restrict__ dy,
            int64_t C, int64_t S, int D, int64_t m, int64_t cols, int tiles, int lsh,
            double* __restrict__ part) {
  using A = AccT<T>;
  constexpr int BK = gram_bk(TT), KS = gram_slices(TT), LD = TT + dbn_tiles::kPad;
  constexpr int kPerSlice = kBlock / KS, TW = TT / 4;
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* colbase = reinterpret_cast<int64_t*>(smem);
  A* Pa = reinterpret_cast<A*>(smem + BK * sizeof(int64_t));
  A* Pb = Pa + BK * LD;
  const int pairs = kBwd ? tiles * tiles : tiles * (tiles + 1) / 2;
  const int64_t g = blockIdx.x / pairs;
  int p = static_cast<int>(blockIdx.x - g * pairs), ti = 0, tj = 0;
  if (kBwd) {
    ti = p / tiles;
    tj = p - ti * tiles;
  } else {
    while (p >= tiles - ti) {
      p -= tiles - ti;
      ++ti;
    }
    tj = ti + p;
  }
  const int r0 = ti * TT, c0 = tj * TT;
  const int rows_a = D - r0 < TT ? D - r0 : TT, rows_b = D - c0 < TT ? D - c0 : TT;
  const bool same = !kBwd && ti == tj;
  const bool sums = kBwd && tj == 0;
  const int slice = threadIdx.x / kPerSlice, lt = threadIdx.x - slice * kPerSlice;
  const int ty = lt / TW, tx = lt - ty * TW;
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  const int64_t j_begin = chunk * cols;
  const int64_t j_end = j_begin + cols < m ? j_begin + cols : m;
  const int64_t row0 = g * D;
  const A* sh = mean + row0;
  A acc[4][4], rs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    rs[i] = A(0);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = A(0);
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += BK) {
    const int kc = static_cast<int>(j_end - j0 < BK ? j_end - j0 : BK);
    __syncthreads();
    dbn_tiles::panel_columns(colbase, j0, kc, C, S);
    __syncthreads();
    if (kBwd)
      dbn_tiles::load_tile<TT, BK>(dy, colbase, row0 + r0, S, rows_a, kc,
                                   static_cast<const A*>(nullptr), Pa, 1, LD, lsh);
    else
      dbn_tiles::load_tile<TT, BK>(x, colbase, row0 + r0, S, rows_a, kc, sh + r0, Pa, 1, LD, lsh);
    if (!same)
      dbn_tiles::load_tile<TT, BK>(x, colbase, row0 + c0, S, rows_b, kc, sh + c0, Pb, 1, LD, lsh);
    __syncthreads();
    dbn_tiles::mma4x4<KS>(Pa + 4 * ty, LD, (same ? Pa : Pb) + 4 * tx, LD, slice, BK, acc);
    if (sums && tx == 0)
      for (int k = slice; k < BK; k += KS)
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[i] += Pa[k * LD + 4 * ty + i];
  }
  if (KS > 1) {  // slice s > 0 hands its sums to slice 0, one slice at a time (fixed order)
    A* red = Pa;  // kPerSlice x 20 values, within the panels
    for (int s = 1; s < KS; ++s) {
      __syncthreads();
      if (slice == s)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          red[lt * 20 + 16 + i] = rs[i];
#pragma unroll
          for (int j = 0; j < 4; ++j) red[lt * 20 + 4 * i + j] = acc[i][j];
        }
      __syncthreads();
      if (slice == 0)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          rs[i] += red[lt * 20 + 16 + i];
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] += red[lt * 20 + 4 * i + j];
        }
    }
  }
  if (slice != 0) return;
  const int DD = D * D;
  double* out = part + (g * chunks + chunk) * (DD + (kBwd ? D : 0));
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + 4 * ty + i;
    if (r >= D) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = c0 + 4 * tx + j;
      if (c >= D) continue;
      out[r * D + c] = static_cast<double>(acc[i][j]);
      if (!kBwd && !same) out[c * D + r] = static_cast<double>(acc[i][j]);
    }
    if (sums && tx == 0) out[DD + r] = static_cast<double>(rs[i]);
  }
}

// The device executor of dbn_math.h's D x D steps: the thread block of one group strides over
// every range. mm is C = A B tiled through shared memory (`tile`, kTileBytes of the kernel's
// dynamic shared memory): 64 x 64 output tiles, k-panels of 16 columns of A / rows of B staged
// in shared memory (coalesced global reads), each of the 16 x 16 threads keeping a 4 x 4 block of
// outputs in registers (rows ty + 16 r, columns tx + 16 c: B reads consecutive, A reads broadcast).
// Every output is summed over k in ascending order, one multiply-add per k: in fp64 as the CPU's
// dmm_nn (the same values up to FMA contraction), or, for mm_orth with `fp32_orth` (fp16/fp32
// data), staged and summed in fp32 (dbn_math.h's executor contract, dbn.h "Precision").
constexpr int kTile = 64, kTileK = 16, kTileLdA = kTileK + 1;
constexpr size_t kTileBytes = size_t(kTile * kTileLdA + kTileK * kTile) * sizeof(double);
static_assert(kBlock == 256, "BlockExec::mm maps 16 x 16 threads onto 4 x 4 outputs each");

struct BlockExec {
  double* tile = nullptr;  // kTileBytes of shared memory (products only)
  bool fp32_orth = false;  // mm_orth sums in fp32
  template <class F> __device__ void each(int n, F&& f) const {
    for (int e = threadIdx.x; e < n; e += blockDim.x) f(e);
  }
  template <class F> __device__ void each_ij(int D, F&& f) const {
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
      const int i = e / D;
      f(i, e - i * D);
    }
  }
  template <class F> __device__ void each_lower(int D, F&& f) const {
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
      const int i = e / D, j = e - i * D;
      if (j <= i) f(i, j);
    }
  }
  __device__ void sync() const { __syncthreads(); }
  __device__ void mm(const double* A, const double* B, double* Cm, int D) const {
    mm_tiled<double>(A, B, Cm, D);
  }
  __device__ void mm_orth(const double* A, const double* B, double* Cm, int D) const {
    if (fp32_orth)
      mm_tiled<float>(A, B, Cm, D);
    else
      mm_tiled<double>(A, B, Cm, D);
  }
  // S: the type the tiles are staged and the products summed in.
  template <typename S>
  __device__ void mm_tiled(const double* __restrict__ A, const double* __restrict__ B,
                           double* __restrict__ Cm, int D) const {
    S* As = reinterpret_cast<S*>(tile);  // [kTile][kTileLdA]: A(i0 + r, k0 + k)
    S* Bs = As + kTile * kTileLdA;       // [kTileK][kTile]:   B(k0 + k, j0 + c)
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int i0 = 0; i0 < D; i0 += kTile)
      for (int j0 = 0; j0 < D; j0 += kTile) {
        S acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] = S(0);
        for (int k0 = 0; k0 < D; k0 += kTileK) {
          __syncthreads();  // the previous panel is no longer read
          for (int e = threadIdx.x; e < kTile * kTileK; e += blockDim.x) {
            const int r = e / kTileK, k = e - r * kTileK;  // A: consecutive threads along k
            As[r * kTileLdA + k] =
                (i0 + r < D && k0 + k < D) ? static_cast<S>(A[(i0 + r) * D + k0 + k]) : S(0);
            const int kb = e / kTile, c = e - kb * kTile;  // B: along j
            Bs[kb * kTile + c] =
                (k0 + kb < D && j0 + c < D) ? static_cast<S>(B[(k0 + kb) * D + j0 + c]) : S(0);
          }
          __syncthreads();
          const int kc = D - k0 < kTileK ? D - k0 : kTileK;
          for (int k = 0; k < kc; ++k) {
            S a[4], b[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) a[r] = As[(ty + 16 * r) * kTileLdA + k];
#pragma unroll
            for (int c = 0; c < 4; ++c) b[c] = Bs[k * kTile + tx + 16 * c];
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
              for (int c = 0; c < 4; ++c) acc[r][c] += a[r] * b[c];
          }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int i = i0 + ty + 16 * r, j = j0 + tx + 16 * c;
            if (i < D && j < D) Cm[i * D + j] = static_cast<double>(acc[r][c]);
          }
      }
    __syncthreads();
  }
  // IterNorm's products (dbn_math.h), S = float or double: C = A B, C += A B. The same tiles,
  // summed as the CPU's mm_square (dbn_small_cpu.h): per k-block of kDbnIterKb, a partial from
  // zero in ascending k, added to the running total, which starts at C (acc) or at the first
  // partial; the CPU and CUDA values agree up to FMA contraction.
  template <typename S>
  __device__ void mm_it(const S* A, const S* B, S* Cm, int D) const {
    mm_it_tiled(A, B, Cm, D, false);
  }
  template <typename S>
  __device__ void mm_it_acc(const S* A, const S* B, S* Cm, int D) const {
    mm_it_tiled(A, B, Cm, D, true);
  }
  // A symmetric result (dbn_math.h): tiles reaching the upper triangle, then C_ij = C_ji (i > j),
  // as the CPU's mm_square with sym.
  template <typename S>
  __device__ void mm_it_sym(const S* A, const S* B, S* Cm, int D) const {
    mm_it_tiled(A, B, Cm, D, false, true);
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
      const int i = e / D, j = e - i * D;
      if (i > j) Cm[e] = Cm[j * D + i];
    }
    __syncthreads();
  }
  template <typename S>
  __device__ void mm_it_tiled(const S* __restrict__ A, const S* __restrict__ B, S* Cm, int D,
                              bool acc, bool sym = false) const {
    static_assert(kDbnIterKb % kTileK == 0, "k-blocks of whole panels");
    S* As = reinterpret_cast<S*>(tile);
    S* Bs = As + kTile * kTileLdA;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int i0 = 0; i0 < D; i0 += kTile)
      for (int j0 = sym ? i0 : 0; j0 < D; j0 += kTile) {
        S tot[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int i = i0 + ty + 16 * r, j = j0 + tx + 16 * c;
            tot[r][c] = (acc && i < D && j < D) ? Cm[i * D + j] : S(0);
          }
        for (int kb = 0; kb < D; kb += kDbnIterKb) {
          const int kend = D - kb < kDbnIterKb ? D : kb + kDbnIterKb;
          S part[4][4];
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) part[r][c] = S(0);
          for (int k0 = kb; k0 < kend; k0 += kTileK) {
            __syncthreads();  // the previous panel is no longer read
            for (int e = threadIdx.x; e < kTile * kTileK; e += blockDim.x) {
              const int r = e / kTileK, k = e - r * kTileK;
              As[r * kTileLdA + k] = (i0 + r < D && k0 + k < D) ? A[(i0 + r) * D + k0 + k] : S(0);
              const int kk = e / kTile, c = e - kk * kTile;
              Bs[kk * kTile + c] = (k0 + kk < D && j0 + c < D) ? B[(k0 + kk) * D + j0 + c] : S(0);
            }
            __syncthreads();
            const int kc = kend - k0 < kTileK ? kend - k0 : kTileK;
            for (int k = 0; k < kc; ++k) {
              S a[4], b[4];
#pragma unroll
              for (int r = 0; r < 4; ++r) a[r] = As[(ty + 16 * r) * kTileLdA + k];
#pragma unroll
              for (int c = 0; c < 4; ++c) b[c] = Bs[k * kTile + tx + 16 * c];
#pragma unroll
              for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) part[r][c] += a[r] * b[c];
            }
          }
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c)
              tot[r][c] = (kb == 0 && !acc) ? part[r][c] : tot[r][c] + part[r][c];
        }
        __syncthreads();  // every thread has read its C entries before any is written (acc)
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int i = i0 + ty + 16 * r, j = j0 + tx + 16 * c;
            if (i < D && j < D) Cm[i * D + j] = tot[r][c];
          }
      }
    __syncthreads();
  }
};

// Round-robin (circle method) pair k of round r for Dp (even) players; p < q.
__device__ __forceinline__ void rr_pair(int k, int r, int Dp, int* p, int* q) {
  const int M = Dp - 1;
  const int a = k == 0 ? 0 : ((k - 1 + r) % M) + 1;
  const int b = ((Dp - 1 - k - 1 + r) % M) + 1;
  *p = a < b ? a : b;
  *q = a < b ? b : a;
}

// Leading dimension of a D x D matrix in shared memory: odd, so that the 16 doubles a half-warp
// reads down a column (consecutive rows) fall into 16 different bank pairs.
__host__ __device__ inline int smem_ld(int D) { return (D + 1) | 1; }

// eig_kernel's dynamic shared memory (byte offsets): the per-group vectors (a round's rotations
// c, s; eigenvalues, sorted eigenvalues, their ranks), then `mats`: Jacobi's A and U^T
// (smem_ld(D) each row) on the shared path, or BlockExec::mm's tiles, which reuse the same bytes
// there (the products start after Jacobi's matrices are copied out).
struct EigSmem {
  size_t c, s, l, ls, rank, pq, mats, bytes;
};
__host__ __device__ inline EigSmem eig_smem(int D, bool shared_mats) {
  EigSmem o;
  const size_t npairs = size_t(D + 1) / 2, d8 = size_t(D) * sizeof(double);
  o.c = 0;
  o.s = npairs * sizeof(double);
  o.l = o.s + npairs * sizeof(double);
  o.ls = o.l + d8;
  o.rank = o.ls + d8;
  o.pq = o.rank + size_t(D) * sizeof(int);  // a round's pairs p[k], q[k]
  o.mats = (o.pq + 2 * npairs * sizeof(int) + 15) / 16 * 16;
  const size_t mats = shared_mats ? 2 * size_t(D) * smem_ld(D) * sizeof(double) : 0;
  o.bytes = o.mats + (mats > kTileBytes ? mats : kTileBytes);
  return o;
}

// Parallel cyclic Jacobi on the block: A (lda; destroyed) -> eigenvalues diag(A), eigenvectors as
// the ROWS of Ut (ldu; row k = eigenvector k = column k of U). Same rotation formula, stopping
// rule and sweep limit as dbn_jacobi_eigh; only the order of the rotations differs (D/2 disjoint
// rotations at a time, round-robin). U <- U J is Ut <- J^T Ut: rows p, q, contiguous.
// Like dbn_jacobi_eigh, A is scaled by 2^-e (max|A_ij| in [0.5, 1)) first and diag(A) scaled back
// at the end, so the stopping rule holds for entries up to the float64 range.
// s_c, s_s (doubles), s_p, s_q (ints): (D + 1) / 2 each of shared memory, a round's rotations.
// A and Ut live in shared memory (the default path, lda = ldu = smem_ld(D): conflict-free
// columns) or in the workspace (lda = ldu = D).
__device__ void block_jacobi(double* A, int lda, double* Ut, int ldu, int D, double* s_c,
                             double* s_s, int* s_p, int* s_q) {
  const int DD = D * D;
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    const int i = e / D, j = e - i * D;
    Ut[i * ldu + j] = i == j ? 1.0 : 0.0;
  }
  double part = 0.0;
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    const int i = e / D, j = e - i * D;
    part = fmax(part, fabs(A[i * lda + j]));
  }
  const int ex = dbn_jacobi_scale_exponent(block_max<kBlock>(part));  // also syncs A
  GN_ASSERT_UNIFORM(kBlock, ex);
  if (ex != 0)
    for (int e = threadIdx.x; e < DD; e += blockDim.x) {
      const int i = e / D, j = e - i * D;
      A[i * lda + j] = ldexp(A[i * lda + j], -ex);
    }
  __syncthreads();
  part = 0.0;
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    const int i = e / D, j = e - i * D;
    part += A[i * lda + j] * A[i * lda + j];
  }
  const double fro2 = block_sum<kBlock>(part);  // also syncs Ut / A
  const int Dp = D + (D & 1), npairs = Dp / 2;
  for (int sweep = 0; sweep < kDbnJacobiMaxSweeps; ++sweep) {
    part = 0.0;
    for (int e = threadIdx.x; e < DD; e += blockDim.x) {
      const int i = e / D, j = e - i * D;
      if (i < j) part += A[i * lda + j] * A[i * lda + j];
    }
    const double off = block_sum<kBlock>(part);
    GN_ASSERT_UNIFORM(kBlock, (Pair<double>{off, fro2}));
    if (dbn_jacobi_converged(off, fro2)) break;
    for (int r = 0; r < Dp - 1; ++r) {
      for (int k = threadIdx.x; k < npairs; k += blockDim.x) {
        int p, q;
        rr_pair(k, r, Dp, &p, &q);
        double c = 1.0, s = 0.0;
        if (q < D) {
          const double apq = A[p * lda + q];
          if (apq != 0.0) dbn_jacobi_rotation(A[p * lda + p], A[q * lda + q], apq, &c, &s);
        }
        s_c[k] = c;
        s_s[k] = s;
        s_p[k] = p;
        s_q[k] = q;
      }
      __syncthreads();
      // f(p, q, c, s, i) for every rotation of the round that is not the identity and every
      // row / column i, spread over the block (consecutive threads: consecutive i).
      auto each_rotation = [&](auto f) {
        for (int idx = threadIdx.x; idx < npairs * D; idx += blockDim.x) {
          const int k = idx / D;
          if (s_s[k] == 0.0) continue;
          f(s_p[k], s_q[k], s_c[k], s_s[k], idx - k * D);
        }
        __syncthreads();
      };
      each_rotation([&](int p, int q, double c, double s, int i) {  // A <- A J, U <- U J
        dbn_rotate(&A[i * lda + p], &A[i * lda + q], c, s);
        dbn_rotate(&Ut[p * ldu + i], &Ut[q * ldu + i], c, s);
      });
      each_rotation([&](int p, int q, double c, double s, int i) {  // A <- J^T A
        dbn_rotate(&A[p * lda + i], &A[q * lda + i], c, s);
      });
      for (int k = threadIdx.x; k < npairs; k += blockDim.x) {
        if (s_s[k] == 0.0) continue;
        const int p = s_p[k], q = s_q[k];
        A[p * lda + q] = A[q * lda + p] = 0.0;
      }
      __syncthreads();
    }
  }
  if (ex != 0) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) A[i * lda + i] = ldexp(A[i * lda + i], ex);
    __syncthreads();
  }
}

// Sigma = (sum of the group's gram partials) / m + eps I into A (row stride ld). Returns 1 when
// every entry is finite, 0 otherwise (the same on every thread of the block).
__device__ int eig_load_sigma(const double* __restrict__ part, int64_t chunks, int64_t g, int D,
                              double m, double eps, double* A, int ld) {
  const int DD = D * D;
  int finite = 1;
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += part[(g * chunks + c) * DD + e];
    s /= m;
    const int i = e / D, j = e - i * D;
    if (i == j) s += eps;
    A[i * ld + j] = s;
    finite &= isfinite(s) ? 1 : 0;
  }
  return __syncthreads_and(finite);
}

// The eigenpairs (values l, vectors as the rows of Ut, row stride ld) sorted by a stable ascending
// rank: values into ls, vectors into the columns of Us (D x D). A failed group (finite == 0) gets
// NaN in both. Ends with a barrier.
__device__ void eig_sort(int finite, const double* l, const double* Ut, int ld, int D, int* rank,
                         double* ls, double* Us) {
  const int DD = D * D;
  if (finite) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      int r = 0;
      for (int j = 0; j < D; ++j) r += (l[j] < l[i] || (l[j] == l[i] && j < i)) ? 1 : 0;
      rank[i] = r;
      ls[r] = l[i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < DD; e += blockDim.x) {  // Us[i][rank k] = U[i][k] = Ut[k][i]
      const int k = e / D, i = e - k * D;
      Us[i * D + rank[k]] = Ut[k * ld + i];
    }
  } else {
    const double nan = __longlong_as_double(0x7ff8000000000000LL);
    for (int e = threadIdx.x; e < DD; e += blockDim.x) Us[e] = nan;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ls[i] = nan;
  }
  __syncthreads();
}

// One block per group, dynamic shared memory eig_smem(D, path == kShared). ZCA: Sigma -> eigh
// (block_jacobi in shared memory or the workspace; or, in two launches around
// cusolver_syevd_batch, Sigma into the workspace (kPrepare: a non-finite Sigma is replaced by I
// for the library and flagged) and the library's eigenpairs back (kFinish)) -> stable ascending
// rank sort -> dbn_whitening_matrix (clamp, W), outputs and dbn_update_running. A non-finite
// Sigma, or cuSOLVER's info != 0, gives NaN eigenpairs and outputs.
template <typename A>
__global__ void __launch_bounds__(kBlock, kOneBlockPerSm)
eig_kernel(const double* __restrict__ part, int64_t chunks, int D, double m, double eps,
           double momentum, const A* __restrict__ mean, A* __restrict__ eigvec,
           A* __restrict__ eigval, A* __restrict__ Wout, double* __restrict__ scratch,
           DType stat_dtype, void* running_mean, void* running_proj, DType param_dtype,
           const void* gamma, const void* beta, A* __restrict__ bias, DbnWhitening wh, int T,
           int64_t scratch_per_group, EigPath path, EigPhase phase,
           const double* __restrict__ evals, const int* __restrict__ info) {
  extern __shared__ __align__(16) unsigned char smem[];
  const bool in_smem = wh == DbnWhitening::kZca && path == EigPath::kShared;
  const EigSmem L = eig_smem(D, in_smem);
  double* s_c = reinterpret_cast<double*>(smem + L.c);
  double* s_s = reinterpret_cast<double*>(smem + L.s);
  double* s_l = reinterpret_cast<double*>(smem + L.l);
  double* s_ls = reinterpret_cast<double*>(smem + L.ls);
  int* s_rank = reinterpret_cast<int*>(smem + L.rank);
  int* s_p = reinterpret_cast<int*>(smem + L.pq);
  int* s_q = s_p + (D + 1) / 2;
  double* mats = reinterpret_cast<double*>(smem + L.mats);
  const BlockExec ex{mats, sizeof(A) == sizeof(float)};
  const int64_t g = blockIdx.x;
  const int DD = D * D;
  double* Am = scratch + g * scratch_per_group;     // Sigma (workspace paths), then U^T
  double* U = Am + DD;                              // Jacobi's U^T (kGlobal), then V
  double* Us = U + DD;                              // sorted U, then W
  double* flag = Us + DD;                           // kCusolver: Sigma finite (1) or not (0)
  // Where the solver's matrices are: A (lda; Sigma in, diagonal out) and U^T (ldu).
  const int ld = in_smem ? smem_ld(D) : D;
  double* Aw = in_smem ? mats : Am;
  double* Ut = in_smem ? mats + D * ld : (path == EigPath::kCusolver ? Am : U);
  int finite = 1;
  if (phase == EigPhase::kFinish) {
    finite = (flag[0] != 0.0 && info[g] == 0) ? 1 : 0;  // uniform over the block
    for (int i = threadIdx.x; i < D; i += blockDim.x) s_l[i] = evals[g * D + i];
  } else {
    finite = eig_load_sigma(part, chunks, g, D, m, eps, Aw, ld);
    if (wh == DbnWhitening::kIterNorm) {  // Sigma stays in the scratch for iternorm_kernel
      if (threadIdx.x == 0) iter_scratch(Am, D, T, false).flag[0] = finite ? 1.0 : 0.0;
      return;
    }
    if (phase == EigPhase::kPrepare) {
      if (!finite)
        for (int e = threadIdx.x; e < DD; e += blockDim.x) Am[e] = (e / D == e % D) ? 1.0 : 0.0;
      if (threadIdx.x == 0) flag[0] = finite ? 1.0 : 0.0;
      return;
    }
    if (finite) {
      block_jacobi(Aw, ld, Ut, ld, D, s_c, s_s, s_p, s_q);
      for (int i = threadIdx.x; i < D; i += blockDim.x) s_l[i] = Aw[i * ld + i];
    }
  }
  __syncthreads();
  eig_sort(finite, s_l, Ut, ld, D, s_rank, s_ls, Us);
  // eigvec is written before dbn_whitening_matrix's first barrier, so W may overwrite Us; the
  // products' tiles may overwrite the shared-memory matrices (copied out above).
  for (int e = threadIdx.x; e < DD; e += blockDim.x) eigvec[g * DD + e] = static_cast<A>(Us[e]);
  dbn_whitening_matrix(ex, Us, s_ls, D, eps, /*W=*/Us, /*Ut=*/Am, /*V=*/U, /*r=*/s_l);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    eigval[g * D + i] = static_cast<A>(s_ls[i]);
    if (gamma) bias[g * D + i] = static_cast<A>(dbn_load_stat(param_dtype, beta, g * D + i));
  }
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    const double gi = gamma ? dbn_load_stat(param_dtype, gamma, g * D + e / D) : 1.0;
    Wout[g * DD + e] = static_cast<A>(gamma ? gi * Us[e] : Us[e]);
  }
  dbn_update_running(ex, stat_dtype, running_proj, running_mean, g, D, Us, mean, momentum);
}

// ---- IterNorm: the Newton iterations and their backward, in launches of at most two products ---
// The per-group state lives in the scratch (IterScratch; the iteration's matrices in S: float when
// dbn_iternorm_fp32, else double). Forward: eig_kernel (Sigma, flag) -> kStart -> kIter (k, part)
// for k < T, parts < kDbnIterFwdParts -> kFwdFinish (W, saved Sigma / diag, running statistics).
// Backward: bwd_small_kernel stage 0 (G_W, Sigma, dymean, dbeta) -> kStart -> kIter ... ->
// kHeadFinish (W, dgamma, G) -> kBack (k, part) for k = T-1 .. 0, parts < kDbnIterBwdParts ->
// kTail (B; W and B out). At D = 512 a launch is then <= 2 products (docs/performance/gpu.md).
enum class IterStage : int { kStart, kIter, kFwdFinish, kHeadFinish, kBack, kTail };

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

template <typename A, typename S>
__global__ void __launch_bounds__(kBlock, kOneBlockPerSm)
iternorm_kernel(IterArgs<A> a, IterStage stage, int k, int part) {
  __shared__ double s_gam[kMaxD], s_dgam[kMaxD];
  extern __shared__ __align__(16) unsigned char smem[];  // kTileBytes: BlockExec's tiles
  const BlockExec ex{reinterpret_cast<double*>(smem), false};
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
const char* launch_iternorm_s(const IterArgs<A>& a, int64_t G, cudaStream_t st) {
  auto run = [&](IterStage stage, int k, int part) -> const char* {
    iternorm_kernel<A, S><<<static_cast<unsigned>(G), kBlock, kTileBytes, st>>>(a, stage, k, part);
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  };
  const char* e = run(IterStage::kStart, 0, 0);
  for (int k = 0; k < a.T && !e; ++k)
    for (int p = 0; p < kDbnIterFwdParts && !e; ++p) e = run(IterStage::kIter, k, p);
  if (e || !a.bwd) return e ? e : run(IterStage::kFwdFinish, 0, 0);
  e = run(IterStage::kHeadFinish, 0, 0);
  for (int k = a.T - 1; k >= 0 && !e; --k)
    for (int p = 0; p < kDbnIterBwdParts && !e; ++p) e = run(IterStage::kBack, k, p);
  return e ? e : run(IterStage::kTail, 0, 0);
}
template <typename A>
const char* launch_iternorm(const IterArgs<A>& a, DType dtype, int64_t G, cudaStream_t st) {
  return dbn_iternorm_fp32(dtype, a.T) ? launch_iternorm_s<A, float>(a, G, st)
                                       : launch_iternorm_s<A, double>(a, G, st);
}

// One block per group, dynamic shared memory kTileBytes. ZCA: dbn_bwd_small (W, B = (2/m) G_S) on
// the summed gram partials. IterNorm: the summed partials (G_W), the forward's Sigma and the
// finite flag into the group's IterScratch; iternorm_kernel's launches do the rest.
template <typename A>
__global__ void __launch_bounds__(kBlock, kOneBlockPerSm)
bwd_small_kernel(const double* __restrict__ part, int64_t chunks, int D, double m,
                 const A* __restrict__ eigvec, const A* __restrict__ eigval, A* __restrict__ Wout,
                 A* __restrict__ Bout, A* __restrict__ dymean, double* __restrict__ scratch,
                 DType param_dtype, const void* gamma, void* dgamma, void* dbeta, DbnWhitening wh,
                 int T, int64_t scratch_per_group) {
  __shared__ double s_l[kMaxD], s_sq[kMaxD], s_r[kMaxD], s_gam[kMaxD], s_dgam[kMaxD];
  extern __shared__ __align__(16) unsigned char smem[];  // kTileBytes: BlockExec::mm's tiles
  const BlockExec ex{reinterpret_cast<double*>(smem), sizeof(A) == sizeof(float)};
  const int64_t g = blockIdx.x;
  const int DD = D * D, E = DD + D;
  const bool iter = wh == DbnWhitening::kIterNorm;
  const IterScratch z = iter_scratch(scratch + g * scratch_per_group, D, T, true);
  double* GW = iter ? z.GW : scratch + g * scratch_per_group;  // G_W, then B
  double* H = GW + DD;
  double* Tm = H + DD;
  double* U = iter ? z.sig : Tm + DD;               // U (ZCA) or Sigma (IterNorm)
  double* Ut = Tm + 2 * DD;
  double* W = Ut + DD;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += part[(g * chunks + c) * E + e];
    if (e < DD) {
      GW[e] = s;
      U[e] = static_cast<double>(eigvec[g * DD + e]);
    } else {
      dymean[g * D + (e - DD)] = static_cast<A>(s / m);
      if (gamma) dbn_store_stat(param_dtype, dbeta, g * D + (e - DD), s);
    }
  }
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    s_l[i] = static_cast<double>(eigval[g * D + i]);
    if (gamma) s_gam[i] = dbn_load_stat(param_dtype, gamma, g * D + i);
  }
  __syncthreads();
  if (iter) {  // U holds the forward's Sigma
    if (threadIdx.x == 0) z.flag[0] = 1.0;
    return;
  }
  dbn_bwd_small(ex, U, s_l, GW, D, m, gamma ? s_gam : nullptr, s_dgam, W, /*B=*/GW,
                DbnBwdScratch{H, Tm, Ut, s_sq, s_r});
  if (gamma)
    for (int i = threadIdx.x; i < D; i += blockDim.x)
      dbn_store_stat(param_dtype, dgamma, g * D + i, s_dgam[i]);
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    Bout[g * DD + e] = static_cast<A>(GW[e]);
    Wout[g * DD + e] = static_cast<A>(gamma ? W[e] * s_gam[e % D] : W[e]);
  }
}

// Affine inference backward, one block per group: dgamma = dbn_affine_dgamma(P, sum dy (x -
// r_mean)^T), dbeta = sum(dy), from the gram kernel's partials (scratch: 2 D x D per group).
template <typename A>
__global__ void __launch_bounds__(kBlock)
affine_grad_kernel(const double* __restrict__ part, int64_t chunks, int D, DType stat_dtype,
                   const void* running_proj, DType param_dtype, void* dgamma, void* dbeta,
                   double* __restrict__ scratch) {
  __shared__ double s_dg[kMaxD];
  const BlockExec ex{};  // no products
  const int64_t g = blockIdx.x;
  const int DD = D * D, E = DD + D;
  double* P = scratch + g * 2 * DD;
  double* Gs = P + DD;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double s = 0.0;
    for (int64_t c = 0; c < chunks; ++c) s += part[(g * chunks + c) * E + e];
    if (e < DD) {
      Gs[e] = s;
      P[e] = dbn_load_stat(stat_dtype, running_proj, g * DD + e);
    } else {
      dbn_store_stat(param_dtype, dbeta, g * D + (e - DD), s);
    }
  }
  __syncthreads();
  dbn_affine_dgamma(ex, P, Gs, D, s_dg);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    dbn_store_stat(param_dtype, dgamma, g * D + i, s_dg[i]);
}

// P[g] (AccT) = running_proj[g] (transposed for the backward); shift = running_mean.
template <typename A>
__global__ void __launch_bounds__(kBlock)
inference_prep_kernel(DType stat_dtype, const void* running_proj, const void* running_mean,
                      int64_t G, int D, int64_t C, bool transpose, A* __restrict__ P,
                      A* __restrict__ shift, DType param_dtype, const void* gamma,
                      const void* beta, A* __restrict__ bias) {
  const int64_t DD = int64_t(D) * D;
  const int64_t total = G * DD;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total + C;
       e += int64_t(gridDim.x) * blockDim.x) {
    if (e < total) {
      const int64_t g = e / DD, r = e - g * DD, i = r / D, j = r - i * D;
      const double p = dbn_load_stat(stat_dtype, running_proj, e);
      P[g * DD + (transpose ? j * D + i : i * D + j)] =
          static_cast<A>(gamma ? dbn_load_stat(param_dtype, gamma, g * D + i) * p : p);
    } else {
      const int64_t c = e - total;
      if (running_mean) shift[c] = static_cast<A>(dbn_load_stat(stat_dtype, running_mean, c));
      if (beta) bias[c] = static_cast<A>(dbn_load_stat(param_dtype, beta, c));
    }
  }
}

// part[g*E + e] = sum over splits, in order, of split[(g*splits + c)*E + e].
__global__ void __launch_bounds__(kBlock)
gram_reduce_kernel(const double* __restrict__ split, int64_t splits, int64_t E, int64_t total,
                   double* __restrict__ part) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i / E, e = i - g * E;
    double t = 0.0;
    for (int64_t c = 0; c < splits; ++c) t += split[(g * splits + c) * E + e];
    part[i] = t;
  }
}

template <int TT>
size_t apply_smem(size_t acc) {
  constexpr int bn = apply_bn(TT), ldx = bn + dbn_tiles::kPad;
  const size_t panels = size_t(apply_kstep(TT)) * (TT + dbn_tiles::kPad + ldx);
  const size_t staged = size_t(TT) * ldx;
  return bn * sizeof(int64_t) + (panels > staged ? panels : staged) * acc;
}

// Grid (G * tiles, blocks): output rows r0 .. r0 + TT - 1 of group g over the block's columns, in
// panels of BN: out[:, j] = M1[g] (in1[:, j] - shift1) (+ M2[g] (in2[:, j] - shift2))
// (+ bias[g*D:], the affine's beta; may be null). A tiled product: per step, BKd columns of
// M (transposed into shared memory) times BKd rows of the data panel, 4 x 4 outputs per
// thread in AccT; the output tile is staged in shared memory and stored in the tile order
// (channel-contiguous for small S, dbn_gemm_cuda.cuh).
template <typename T, bool kTwo, int TT>
__global__ void __launch_bounds__(kBlock)
apply_kernel(const T* __restrict__ in1, const AccT<T>* __restrict__ shift1,
             const AccT<T>* __restrict__ M1, const T* __restrict__ in2,
             const AccT<T>* __restrict__ shift2, const AccT<T>* __restrict__ M2,
             const AccT<T>* __restrict__ bias, T* __restrict__ out, int64_t C, int64_t S, int D,
             int64_t m, int64_t cols, int tiles, int lsh) {
  using A = AccT<T>;
  constexpr int BN = apply_bn(TT), BKd = apply_kstep(TT);
  constexpr int LDM = TT + dbn_tiles::kPad, LDX = BN + dbn_tiles::kPad, TW = BN / 4;
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* colbase = reinterpret_cast<int64_t*>(smem);
  A* Ms = reinterpret_cast<A*>(smem + BN * sizeof(int64_t));  // BKd x LDM: M^T step
  A* Xs = Ms + BKd * LDM;                                        // BKd x LDX: data step
  A* O = Ms;                                                     // TT x LDX: staged output
  const int64_t g = blockIdx.x / tiles;
  const int r0 = static_cast<int>(blockIdx.x - g * tiles) * TT;
  const int rows = D - r0 < TT ? D - r0 : TT;
  const int ty = threadIdx.x / TW, tx = threadIdx.x - ty * TW;
  const int64_t j_begin = blockIdx.y * cols;
  const int64_t j_end = j_begin + cols < m ? j_begin + cols : m;
  const int64_t row0 = g * D, DD = int64_t(D) * D;
  for (int64_t jb = j_begin; jb < j_end; jb += BN) {
    const int kc = static_cast<int>(j_end - jb < BN ? j_end - jb : BN);
    __syncthreads();
    dbn_tiles::panel_columns(colbase, jb, kc, C, S);
    A acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = A(0);
#pragma unroll
    for (int pr = 0; pr < (kTwo ? 2 : 1); ++pr) {
      const T* in = pr ? in2 : in1;
      const A* Mg = (pr ? M2 : M1) + g * DD + int64_t(r0) * D;
      const A* sh = pr ? shift2 : shift1;
      if (sh) sh += row0;
      for (int t0 = 0; t0 < D; t0 += BKd) {
        const int tk = D - t0 < BKd ? D - t0 : BKd;
        __syncthreads();
        for (int idx = threadIdx.x; idx < TT * BKd; idx += kBlock) {
          const int d = idx / BKd, t = idx - d * BKd;  // threads along M's rows: coalesced
          Ms[t * LDM + d] = (d < rows && t < tk) ? Mg[d * D + t0 + t] : A(0);
        }
        dbn_tiles::load_tile<BKd, BN>(in, colbase, row0 + t0, S, tk, kc, sh ? sh + t0 : nullptr,
                                      Xs, LDX, 1, lsh);
        __syncthreads();
        dbn_tiles::mma4x4<1>(Ms + 4 * ty, LDM, Xs + 4 * tx, LDX, 0, BKd, acc);
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * ty + i;
      const A b = (bias && r < rows) ? bias[row0 + r0 + r] : A(0);
#pragma unroll
      for (int j = 0; j < 4; ++j) O[r * LDX + 4 * tx + j] = acc[i][j] + b;
    }
    __syncthreads();
    dbn_tiles::store_tile<TT, BN>(out, colbase, row0 + r0, S, rows, kc, O, LDX, lsh);
  }
}

// ------------------------------------------------------------------------------------------------
// Host side

template <typename F>
const char* dispatch(DType t, F&& f) {
  return dispatch_data(t, f, "unsupported dtype");
}

// Occupancy waves of the kernels a plan chooses between, as launched (kBlock threads, their
// dynamic shared memory): gram kernel `kBwd` (when has_gram), apply kernel `kTwo`, channel sums.
template <typename T, bool kBwd, bool kTwo>
const char* plan_geo(int64_t N, int64_t C, int64_t G, int64_t S, bool has_gram, DbnCudaPlan* q) {
  const size_t A_ = sizeof(AccT<T>);
  DbnWaves wv;
  const char* e = nullptr;
  if (has_gram) {
    if (!e) e = wave_blocks(gram_kernel<T, kBwd, 16>, kBlock, gram_smem<16>(A_), &wv.gram[0]);
    if (!e) e = wave_blocks(gram_kernel<T, kBwd, 32>, kBlock, gram_smem<32>(A_), &wv.gram[1]);
    if (!e) e = wave_blocks(gram_kernel<T, kBwd, 64>, kBlock, gram_smem<64>(A_), &wv.gram[2]);
  }
  if (!e) e = wave_blocks(apply_kernel<T, kTwo, 16>, kBlock, apply_smem<16>(A_), &wv.apply[0]);
  if (!e) e = wave_blocks(apply_kernel<T, kTwo, 32>, kBlock, apply_smem<32>(A_), &wv.apply[1]);
  if (!e) e = wave_blocks(apply_kernel<T, kTwo, 64>, kBlock, apply_smem<64>(A_), &wv.apply[2]);
  if (!e) e = wave_blocks(channel_sum_kernel<T>, kBlock, 0, &wv.mean);
  int sms = 1;
  if (!e) e = sm_count(&sms);
  if (e) return e;
  wv.sms = sms;
  return make_plan(N, C, G, S, has_gram, kBwd, wv, q);
}
template <typename T>
const char* plan_for(const DbnFwdArgs& a, DbnCudaPlan* q) {
  return plan_geo<T, false, false>(a.dims.N, a.dims.C, a.dims.G, a.dims.S, true, q);
}
template <typename T>
const char* plan_for(const DbnBwdArgs& a, DbnCudaPlan* q) {
  return plan_geo<T, true, true>(a.dims.N, a.dims.C, a.dims.G, a.dims.S, true, q);
}
template <typename T>
const char* plan_for(const DbnInferenceArgs& a, DbnCudaPlan* q) {
  // the affine backward runs the training backward's gram kernel; otherwise no gram kernel
  return plan_geo<T, true, false>(a.dims.N, a.dims.C, a.dims.G, a.dims.S, a.dgamma != nullptr, q);
}

// mean = channel means of x (channel_sum_kernel; mean_finalize_kernel when chunked).
template <typename T>
const char* launch_mean(const DbnCudaPlan& q, const T* x, AccT<T>* mean, double* msum,
                        cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(ceil_div(q.C, q.mean_tc)),
                  static_cast<unsigned>(q.mean_chunks));
  channel_sum_kernel<T><<<grid, kBlock, 0, st>>>(x, q.C, q.S, q.m, q.mean_cols, q.mean_lsh, msum,
                                                 mean);
  GN_CUDA_CHECK_LAUNCH();
  if (q.mean_chunks > 1) {
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(q.C, kBlock), 4096));
    mean_finalize_kernel<AccT<T>><<<blocks, kBlock, 0, st>>>(msum, q.mean_chunks, q.C,
                                                             static_cast<double>(q.m), mean);
    GN_CUDA_CHECK_LAUNCH();
  }
  return nullptr;
}

// The gram kernel of the plan's tile: fp64 partials into part (G x gram_chunks x E), through
// split (G x gram_splits x E) and gram_reduce_kernel when the plan sums the splits first.
template <typename T, bool kBwd>
const char* launch_gram(const DbnCudaPlan& q, const T* x, const AccT<T>* mean, const T* dy,
                        double* part, double* split, cudaStream_t st) {
  using A = AccT<T>;
  const bool reduce = q.gram_chunks != q.gram_splits;
  double* out = reduce ? split : part;
  const dim3 grid(static_cast<unsigned>(q.G * q.gram_pairs), static_cast<unsigned>(q.gram_splits));
  const int D = static_cast<int>(q.D);
  switch (q.gram_tile) {
    case 16:
      gram_kernel<T, kBwd, 16><<<grid, kBlock, gram_smem<16>(sizeof(A)), st>>>(
          x, mean, dy, q.C, q.S, D, q.m, q.gram_cols, q.gram_tiles, q.gram_lsh, out);
      break;
    case 32:
      gram_kernel<T, kBwd, 32><<<grid, kBlock, gram_smem<32>(sizeof(A)), st>>>(
          x, mean, dy, q.C, q.S, D, q.m, q.gram_cols, q.gram_tiles, q.gram_lsh, out);
      break;
    default:
      gram_kernel<T, kBwd, 64><<<grid, kBlock, gram_smem<64>(sizeof(A)), st>>>(
          x, mean, dy, q.C, q.S, D, q.m, q.gram_cols, q.gram_tiles, q.gram_lsh, out);
  }
  GN_CUDA_CHECK_LAUNCH();
  if (reduce) {
    const int64_t E = q.D * q.D + (kBwd ? q.D : 0), total = q.G * E;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, kBlock), 4096));
    gram_reduce_kernel<<<blocks, kBlock, 0, st>>>(split, q.gram_splits, E, total, part);
    GN_CUDA_CHECK_LAUNCH();
  }
  return nullptr;
}

// ---- The eigensolver's plan (EigPath above) ----------------------------------------------------

// GNMX_DBN_CUDA_EIG: unset, "" or "auto" -> -1; "shared" / "global" / "cusolver" -> the EigPath;
// anything else -> -2.
int eig_path_env() {
  const char* v = std::getenv("GNMX_DBN_CUDA_EIG");
  if (!v || !*v || std::strcmp(v, "auto") == 0) return -1;
  if (std::strcmp(v, "shared") == 0) return static_cast<int>(EigPath::kShared);
  if (std::strcmp(v, "global") == 0) return static_cast<int>(EigPath::kGlobal);
  if (std::strcmp(v, "cusolver") == 0) return static_cast<int>(EigPath::kCusolver);
  return -2;
}
constexpr const char* kEigEnvError =
    "GNMX_DBN_CUDA_EIG must be auto, shared, global or cusolver (docs/dbn.md)";

// Dynamic shared memory eig_kernel<A> may use on the current device: the opt-in maximum per block
// (48 KB on sm_50/60/61, 64 KB on sm_75, up to 227 KB on sm_90) less the kernel's static shared
// memory. The kernel's cudaFuncAttributeMaxDynamicSharedMemorySize is raised to it once per device
// (needed above 48 KB; always this one value, so concurrent launches with different D never race
// on it).
template <typename A>
const char* eig_smem_limit(size_t* out) {
  constexpr int kDevs = 64;
  static std::mutex mu;
  static size_t set_to[kDevs] = {};
  int dev = 0, optin = 0;
  if (const char* e = cuda_error(cudaGetDevice(&dev))) return e;
  if (const char* e = cuda_error(
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)))
    return e;
  cudaFuncAttributes fa;
  if (const char* e = cuda_error(cudaFuncGetAttributes(&fa, eig_kernel<A>))) return e;
  const size_t limit = size_t(optin) > fa.sharedSizeBytes ? size_t(optin) - fa.sharedSizeBytes : 0;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= kDevs || set_to[dev] != limit) {
    if (const char* e = cuda_error(cudaFuncSetAttribute(
            eig_kernel<A>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit))))
      return e;
    if (dev >= 0 && dev < kDevs) set_to[dev] = limit;
  }
  *out = limit;
  return nullptr;
}

// The eigensolver of a forward with group size D (EigPath), its shared memory and cuSOLVER's
// workspace; nullptr or the error (bad GNMX_DBN_CUDA_EIG, "shared" asked for a D that does not
// fit, cuSOLVER missing).
template <typename A>
const char* eig_plan(int D, DbnWhitening wh, EigPlan* ep) {
  *ep = EigPlan{};
  ep->smem = eig_smem(D, false).bytes;
  if (wh == DbnWhitening::kIterNorm) return nullptr;  // products only
  const int want = eig_path_env();
  if (want == -2) return kEigEnvError;
  size_t limit = 0;
  if (const char* e = eig_smem_limit<A>(&limit)) return e;
  const size_t need = eig_smem(D, true).bytes;
  ep->path = want >= 0 ? static_cast<EigPath>(want)
                       : (need <= limit ? EigPath::kShared : EigPath::kCusolver);
  if (ep->path == EigPath::kShared && need > limit) {
    thread_local char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "GNMX_DBN_CUDA_EIG=shared: group size %d needs %zu bytes of shared memory per "
                  "block, this GPU allows %zu",
                  D, need, limit);
    return buf;
  }
  ep->smem = eig_smem(D, ep->path == EigPath::kShared).bytes;
  if (ep->path == EigPath::kCusolver) return cusolver_syevd_lwork(D, &ep->lwork);
  return nullptr;
}

template <typename T, bool kTwo>
const char* launch_apply(const DbnCudaPlan& q, const T* in1, const AccT<T>* shift1, const AccT<T>* M1,
                         const T* in2, const AccT<T>* shift2, const AccT<T>* M2,
                         const AccT<T>* bias, T* out, cudaStream_t st) {
  using A = AccT<T>;
  const dim3 grid(static_cast<unsigned>(q.G * q.apply_tiles),
                  static_cast<unsigned>(q.apply_blocks));
  const int D = static_cast<int>(q.D);
  switch (q.apply_tile) {
    case 16:
      apply_kernel<T, kTwo, 16><<<grid, kBlock, apply_smem<16>(sizeof(A)), st>>>(
          in1, shift1, M1, in2, shift2, M2, bias, out, q.C, q.S, D, q.m, q.apply_cols,
          q.apply_tiles, q.apply_lsh);
      break;
    case 32:
      apply_kernel<T, kTwo, 32><<<grid, kBlock, apply_smem<32>(sizeof(A)), st>>>(
          in1, shift1, M1, in2, shift2, M2, bias, out, q.C, q.S, D, q.m, q.apply_cols,
          q.apply_tiles, q.apply_lsh);
      break;
    default:
      apply_kernel<T, kTwo, 64><<<grid, kBlock, apply_smem<64>(sizeof(A)), st>>>(
          in1, shift1, M1, in2, shift2, M2, bias, out, q.C, q.S, D, q.m, q.apply_cols,
          q.apply_tiles, q.apply_lsh);
  }
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
const char* fwd_impl(const DbnFwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  DbnCudaPlan q;
  if (const char* e = plan_for<T>(a, &q)) return e;
  Carver cv{static_cast<char*>(a.workspace)};
  EigPlan ep;
  if (const char* e = eig_plan<A>(static_cast<int>(q.D), a.whitening, &ep)) return e;
  const FwdWs<A> w = fwd_ws<A>(&cv, q, a.whitening, ep, a.iterations);
  const T* x = static_cast<const T*>(a.x);
  A* mean = static_cast<A*>(a.mean);
  const int D = static_cast<int>(q.D);
  if (const char* e = launch_mean<T>(q, x, mean, w.msum, st)) return e;
  if (const char* e = launch_gram<T, false>(q, x, mean, nullptr, w.part, w.split, st)) return e;
  const int64_t spg = fwd_scratch(q.D, a.whitening, ep.path, a.iterations);
  auto eig = [&](EigPhase phase) -> const char* {
    eig_kernel<A><<<static_cast<unsigned>(q.G), kBlock, ep.smem, st>>>(
        w.part, q.gram_chunks, D, static_cast<double>(q.m), a.eps, a.momentum, mean,
        static_cast<A*>(a.eigvec), static_cast<A*>(a.eigval), w.W, w.scratch, a.stat_dtype,
        a.running_mean, a.running_proj, a.param_dtype, a.gamma, a.beta, w.bias, a.whitening,
        a.iterations, spg, ep.path, phase, w.evals, w.info);
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  };
  if (a.whitening == DbnWhitening::kZca && ep.path == EigPath::kCusolver) {
    if (const char* e = eig(EigPhase::kPrepare)) return e;
    if (const char* e = cusolver_syevd_batch(st, w.scratch, spg, D, static_cast<int>(q.G),
                                             w.evals, w.info, w.work, ep.lwork))
      return e;
    if (const char* e = eig(EigPhase::kFinish)) return e;
  } else if (const char* e = eig(EigPhase::kAll)) {
    return e;
  }
  if (a.whitening == DbnWhitening::kIterNorm) {
    IterArgs<A> it{};
    it.scratch = w.scratch;
    it.spg = spg;
    it.D = D;
    it.T = a.iterations;
    it.bwd = false;
    it.m = static_cast<double>(q.m);
    it.momentum = a.momentum;
    it.eigvec = static_cast<A*>(a.eigvec);
    it.eigval = static_cast<A*>(a.eigval);
    it.mean = mean;
    it.stat_dtype = a.stat_dtype;
    it.running_mean = a.running_mean;
    it.running_proj = a.running_proj;
    it.bias = w.bias;
    it.beta = a.beta;
    it.Wout = w.W;
    it.param_dtype = a.param_dtype;
    it.gamma = a.gamma;
    if (const char* e = launch_iternorm(it, a.dtype, q.G, st)) return e;
  }
  return launch_apply<T, false>(q, x, mean, w.W, nullptr, nullptr, nullptr,
                                a.gamma ? w.bias : nullptr, static_cast<T*>(a.y), st);
}

template <typename T>
const char* bwd_impl(const DbnBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  DbnCudaPlan q;
  if (const char* e = plan_for<T>(a, &q)) return e;
  Carver cv{static_cast<char*>(a.workspace)};
  const BwdWs<A> w = bwd_ws<A>(&cv, q, a.whitening, a.iterations);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const A* mean = static_cast<const A*>(a.mean);
  const int D = static_cast<int>(q.D);
  if (const char* e = launch_gram<T, true>(q, x, mean, dy, w.part, w.split, st)) return e;
  // ZCA: one launch; IterNorm: the summed partials here, then launch_iternorm's launches
  const int64_t spg = bwd_scratch(q.D, a.whitening, a.iterations);
  bwd_small_kernel<A><<<static_cast<unsigned>(q.G), kBlock, kTileBytes, st>>>(
      w.part, q.gram_chunks, D, static_cast<double>(q.m), static_cast<const A*>(a.eigvec),
      static_cast<const A*>(a.eigval), w.W, w.B, w.dymean, w.scratch, a.param_dtype, a.gamma,
      a.dgamma, a.dbeta, a.whitening, a.iterations, spg);
  GN_CUDA_CHECK_LAUNCH();
  if (a.whitening == DbnWhitening::kIterNorm) {
    IterArgs<A> it{};
    it.scratch = w.scratch;
    it.spg = spg;
    it.D = D;
    it.T = a.iterations;
    it.bwd = true;
    it.m = static_cast<double>(q.m);
    it.Wout = w.W;
    it.param_dtype = a.param_dtype;
    it.gamma = a.gamma;
    it.Bout = w.B;
    it.dgamma = a.dgamma;
    if (const char* e = launch_iternorm(it, a.dtype, q.G, st)) return e;
  }
  return launch_apply<T, true>(q, dy, w.dymean, w.W, x, mean, w.B, nullptr, static_cast<T*>(a.dx),
                               st);
}

template <typename T>
const char* inference_impl(const DbnInferenceArgs& a, bool backward, cudaStream_t st) {
  using A = AccT<T>;
  DbnCudaPlan q;
  if (const char* e = plan_for<T>(a, &q)) return e;
  Carver cv{static_cast<char*>(a.workspace)};
  // the affine backward's dgamma / dbeta (the same test as the workspace size's and the plan's)
  const bool grads = backward && a.dgamma != nullptr;
  const InfWs<A> w = inf_ws<A>(&cv, q, grads);
  const int D = static_cast<int>(q.D);
  const int64_t total = q.G * q.D * q.D + q.C;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, kBlock), 4096));
  const void* beta = backward ? nullptr : a.beta;
  inference_prep_kernel<A><<<blocks, kBlock, 0, st>>>(
      a.stat_dtype, a.running_proj, (backward && !grads) ? nullptr : a.running_mean, q.G, D, q.C,
      backward, w.P, w.shift, a.param_dtype, a.gamma, beta, w.bias);
  GN_CUDA_CHECK_LAUNCH();
  if (grads) {
    if (const char* e = launch_gram<T, true>(q, static_cast<const T*>(a.data), w.shift,
                                             static_cast<const T*>(a.x), w.part, w.split, st))
      return e;
    affine_grad_kernel<A><<<static_cast<unsigned>(q.G), kBlock, 0, st>>>(
        w.part, q.gram_chunks, D, a.stat_dtype, a.running_proj, a.param_dtype, a.dgamma, a.dbeta,
        w.scratch);
    GN_CUDA_CHECK_LAUNCH();
  }
  return launch_apply<T, false>(q, static_cast<const T*>(a.x), backward ? nullptr : w.shift, w.P,
                                nullptr, nullptr, nullptr, (a.gamma && !backward) ? w.bias : nullptr,
                                static_cast<T*>(a.y), st);
}

const char* check_ws(const void* ws) {
  if (!ws) return "workspace is required";
  if (!aligned16(ws)) return "workspace must be 16-byte aligned";
  return nullptr;
}

// Workspace bytes of a call: the plan for the data dtype, then layout(tag, carver, plan) carves
// what the kernels take; 0 for an invalid call.
template <typename Args, typename F>
size_t ws_size(const Args& a, F&& layout) {
  if (check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return 0;
  Carver c;
  const char* err = dispatch(a.dtype, [&](auto tag) -> const char* {
    DbnCudaPlan q;
    if (const char* e = plan_for<decltype(tag)>(a, &q)) return e;
    layout(tag, &c, q);
    return nullptr;
  });
  return err ? 0 : c.off + kAlign;
}

// An entry point: the shape check, then the first non-null of `errors` (argument checks), then
// impl(tag) for the data dtype.
template <typename Args, typename F>
const char* checked_run(const Args& a, std::initializer_list<const char*> errors, F&& impl) {
  if (const char* e = check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return e;
  for (const char* e : errors)
    if (e) return e;
  return dispatch(a.dtype, [&](auto tag) { return impl(tag); });
}

}  // namespace

size_t dbn_fwd_workspace_cuda(const DbnFwdArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const DbnCudaPlan& q) {
    using A = AccT<decltype(tag)>;
    EigPlan ep;  // on an error the forward fails before using the workspace: size without it
    if (eig_plan<A>(static_cast<int>(q.D), a.whitening, &ep)) ep = EigPlan{};
    fwd_ws<A>(c, q, a.whitening, ep, a.iterations);
  });
}

size_t dbn_bwd_workspace_cuda(const DbnBwdArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const DbnCudaPlan& q) {
    bwd_ws<AccT<decltype(tag)>>(c, q, a.whitening, a.iterations);
  });
}

size_t dbn_inference_workspace_cuda(const DbnInferenceArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const DbnCudaPlan& q) {
    inf_ws<AccT<decltype(tag)>>(c, q, a.dgamma != nullptr);
  });
}

const char* dbn_fwd_cuda(const DbnFwdArgs& a, void* stream) {
  const bool stats = a.running_mean || a.running_proj;
  return checked_run(
      a,
      {(!a.x || !a.y || !a.mean || !a.eigvec || !a.eigval) ? "forward: null pointer" : nullptr,
       check_ws(a.workspace),
       (stats && !dbn_stat_dtype_ok(a.dtype, a.stat_dtype)) ? kDbnStatDtypeError : nullptr,
       !(a.eps > 0) ? "eps must be > 0" : nullptr, dbn_affine_fwd_error(a),
       dbn_whitening_error(a.whitening, a.iterations)},
      [&](auto tag) { return fwd_impl<decltype(tag)>(a, static_cast<cudaStream_t>(stream)); });
}

const char* dbn_bwd_cuda(const DbnBwdArgs& a, void* stream) {
  return checked_run(
      a,
      {(!a.dy || !a.x || !a.mean || !a.eigvec || !a.eigval || !a.dx) ? "backward: null pointer"
                                                                     : nullptr,
       check_ws(a.workspace), dbn_affine_bwd_error(a),
       dbn_whitening_error(a.whitening, a.iterations)},
      [&](auto tag) { return bwd_impl<decltype(tag)>(a, static_cast<cudaStream_t>(stream)); });
}

static const char* inference_dispatch(const DbnInferenceArgs& a, bool backward, void* stream) {
  return checked_run(
      a,
      {(!a.x || !a.y || !a.running_proj || (!backward && !a.running_mean))
           ? "inference: null pointer"
           : nullptr,
       check_ws(a.workspace),
       !dbn_stat_dtype_ok(a.dtype, a.stat_dtype) ? kDbnStatDtypeError : nullptr,
       dbn_affine_inf_error(a, backward),
       (backward && a.gamma && !a.running_mean) ? "inference: null pointer" : nullptr},
      [&](auto tag) {
        return inference_impl<decltype(tag)>(a, backward, static_cast<cudaStream_t>(stream));
      });
}

const char* dbn_inference_cuda(const DbnInferenceArgs& a, void* stream) {
  return inference_dispatch(a, false, stream);
}

const char* dbn_inference_bwd_cuda(const DbnInferenceArgs& a, void* stream) {
  return inference_dispatch(a, true, stream);
}

}  // namespace gn_mx
