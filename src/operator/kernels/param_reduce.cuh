/*
 * param_reduce.cuh: the two-stage reduction over n of per-channel parameter gradients (dgamma,
 * dbeta), shared by group_norm_cuda.cu, group_norm_grad2_cuda.cu and affine_cuda.cu.
 *
 * Stage 1 (the caller's kernel): a grid (channel tiles, n chunks); each block sums its channels over
 * the rows n of its chunk. With one chunk it writes dgamma/dbeta itself; otherwise it writes the
 * pair (sum_g, sum_b) per (chunk, channel) to a workspace `part` laid out [chunk][channel][2] (AccT),
 * and stage 2 (launch_param_finalize, param_reduce.cu) sums the chunks of each channel.
 * Deterministic: every sum runs in a fixed order (per thread over a fixed set of rows, then fixed
 * trees in shared memory), no atomics, and the chunking depends on the shape only (param_chunks:
 * N and a per-kernel minimum of rows), never on the GPU's SM count, so every GPU gives the same bits.
 *
 * The common block shape (kParamTile channels x kParamLanes row lanes, param_lane_sum): a warp
 * reads 32 consecutive channels of one row, so per-(n, c) partials are read coalesced.
 */
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_common.cuh"

namespace gn_mx {

constexpr int kParamThreads = 256;
constexpr int kParamTile = kWarpSize;                          // channels per block (one per lane)
constexpr int kParamLanes = kParamThreads / kParamTile;        // rows summed side by side
constexpr int64_t kMaxParamChunks = 256;                       // stage 2 sums at most this many
constexpr int64_t kParamMinRows = 8 * kParamLanes;             // rows per chunk (8 per thread)
constexpr int kParamPart = 2;                                  // (sum_g, sum_b) per partial

// Rows per n chunk for a stage-1 grid: chunks of at least min_rows rows, at most kMaxParamChunks,
// balanced (lengths differ by < 1 chunk's rounding). *chunks = the number of chunks. Shape-only.
inline int64_t param_chunks(int64_t N, int64_t min_rows, int64_t* chunks) {
  const int64_t want = std::max<int64_t>(1, std::min(ceil_div(N, std::max<int64_t>(1, min_rows)),
                                                     kMaxParamChunks));
  const int64_t rows = ceil_div(N, want);
  *chunks = ceil_div(N, rows);
  return rows;
}

// Stores one channel's result of chunk `chunk` of `chunks`: the final dgamma/dbeta (either may be
// nullptr) with one chunk, else the pair in part[chunk][c].
template <typename A, typename P>
__device__ __forceinline__ void param_store(A sg, A sb, int64_t c, int64_t C, int64_t chunk,
                                            int64_t chunks, A* __restrict__ part,
                                            P* __restrict__ dgamma, P* __restrict__ dbeta) {
  if (chunks == 1) {
    if (dgamma) dgamma[c] = from_acc<P>(sg);
    if (dbeta) dbeta[c] = from_acc<P>(sb);
  } else {
    A* p = part + (chunk * C + c) * kParamPart;
    p[0] = sg;
    p[1] = sb;
  }
}

// In a kParamThreads block of kParamTile channels x kParamLanes lanes (threadIdx.x = lane *
// kParamTile + channel): the sums of the lanes, in lane order, on the lane-0 threads (their own
// column's); the other threads get zeros. Every thread of the block must call it.
template <typename A>
__device__ __forceinline__ Pair<A> param_lane_sum(Pair<A> v) {
  __shared__ A s_g[kParamLanes][kParamTile], s_b[kParamLanes][kParamTile];
  const int col = threadIdx.x % kParamTile, lane = threadIdx.x / kParamTile;
  __syncthreads();  // a previous call's slots may still be read
  s_g[lane][col] = v.a;
  s_b[lane][col] = v.b;
  __syncthreads();
  Pair<A> r{A(0), A(0)};
  if (lane == 0) {
#pragma unroll
    for (int l = 0; l < kParamLanes; ++l) {
      r.a += s_g[l][col];
      r.b += s_b[l][col];
    }
  }
  return r;
}

// Stage 2 (param_reduce.cu): dgamma[c] = sum over chunks of part[k][c][0], dbeta[c] of
// part[k][c][1], when stage 1 wrote partials (chunks > 1; else nothing to do); either output may
// be nullptr. One overload per (AccT, param type) pair. nullptr or the CUDA error string.
const char* launch_param_finalize(const float* part, int64_t chunks, int64_t C, float* dgamma,
                                  float* dbeta, cudaStream_t st);
const char* launch_param_finalize(const float* part, int64_t chunks, int64_t C, __half* dgamma,
                                  __half* dbeta, cudaStream_t st);
const char* launch_param_finalize(const double* part, int64_t chunks, int64_t C, double* dgamma,
                                  double* dbeta, cudaStream_t st);

}  // namespace gn_mx
