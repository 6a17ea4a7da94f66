/*
 * dbn_gemm_cuda.cuh: the tile helpers of dbn_cuda.cu's data-side kernels (gram, apply, channel
 * sums): the element order in which a block gathers a tile of a group's D x m matrix from NCHW
 * (and stores one back), and the register-blocked product step. Included by dbn_cuda.cu only.
 *
 * Element (d, k) of a tile (row d = channel row0 + d of the group, column k = flattened
 * j = j0 + k = n*S + s) lives at src[colbase[k] + (row0 + d)*S], colbase[k] = n*C*S + s.
 * Tile order with run length L (a power of two, L <= S, L divides the panel width, panels start
 * at multiples of the panel width):
 *   idx -> kl = idx % L, d = (idx / L) % R, k = (idx / (L*R))*L + kl.
 * A warp then reads L consecutive columns (contiguous in memory within one sample when L <= S)
 * of 32/L consecutive channels:
 *   S = 1 (fully connected, N x C data): L = 1, consecutive threads along channels (contiguous);
 *   S a power of two below the panel width: the panel covers whole samples and each sample's R x S
 *     block is contiguous in NCHW, read in memory order;
 *   S >= panel width: runs of the panel width along s.
 *   other S: runs of the largest power of two <= S (partly contiguous).
 * The shared-memory tiles are k-major (P[k*ld + d]) for the gram kernel and d-major for the apply
 * kernel's data panel; rows are padded by kPad elements (16-byte aligned rows, staggered banks).
 *
 * Product step (mma4x4): each thread owns a 4 x 4 block of outputs, acc[i][j] += a[k][r+i] *
 * b[k][c+j] over its k, reading 4 + 4 values from shared memory per 16 multiply-adds (float4 /
 * double2 loads on the device). k runs in a fixed order: results are deterministic for a plan.
 */
#pragma once
#include <cstdint>

#include "../common/acc_type.h"

namespace gn_mx {
namespace dbn_tiles {

constexpr int kThreads = 256;  // block size of every tiled kernel
constexpr int kPad = 4;        // shared-memory row padding (elements)

// Run length L of the tile order for S and a panel width `width` (a power of two).
__host__ __device__ inline int run_length(int64_t S, int width) {
  int L = 1;
  while (L * 2 <= width && L * 2 <= S) L *= 2;
  return L;
}
__host__ __device__ inline int log2_pow2(int v) {
  int l = 0;
  while ((1 << l) < v) ++l;
  return l;
}

// Offsets colbase[k] = n*C*S + s of panel columns j0 .. j0 + kc - 1 (j = n*S + s).
__device__ __forceinline__ void panel_columns(int64_t* colbase, int64_t j0, int kc, int64_t C,
                                              int64_t S) {
  for (int k = threadIdx.x; k < kc; k += blockDim.x) {
    const int64_t j = j0 + k, n = j / S;
    colbase[k] = n * C * S + (j - n * S);
  }
}

// P[d*sd + k*sk] = src(d, k) - shift[d] (shift may be null) for d < rows, k < kc; 0 elsewhere in
// the R x K tile. lsh = log2(L).
template <int R, int K, typename T, typename A>
__device__ __forceinline__ void load_tile(const T* __restrict__ src, const int64_t* colbase,
                                          int64_t row0, int64_t S, int rows, int kc,
                                          const A* __restrict__ shift, A* P, int sd, int sk,
                                          int lsh) {
  const int lmask = (1 << lsh) - 1;
  for (int idx = threadIdx.x; idx < R * K; idx += kThreads) {
    const int r = idx >> lsh, d = r % R, k = ((r / R) << lsh) + (idx & lmask);
    A v = A(0);
    if (d < rows && k < kc) {
      v = to_acc(src[colbase[k] + (row0 + d) * S]);
      if (shift) v -= shift[d];
    }
    P[d * sd + k * sk] = v;
  }
}

// dst(d, k) = O[d*ld + k] for d < rows, k < kc of an R x K tile, in the tile order (the stores of
// a warp contiguous as the loads above).
template <int R, int K, typename T, typename A>
__device__ __forceinline__ void store_tile(T* __restrict__ dst, const int64_t* colbase,
                                           int64_t row0, int64_t S, int rows, int kc, const A* O,
                                           int ld, int lsh) {
  const int lmask = (1 << lsh) - 1;
  for (int idx = threadIdx.x; idx < R * K; idx += kThreads) {
    const int r = idx >> lsh, d = r % R, k = ((r / R) << lsh) + (idx & lmask);
    if (d < rows && k < kc) dst[colbase[k] + (row0 + d) * S] = from_acc<T>(O[d * ld + k]);
  }
}

__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
#if defined(__CUDA_ARCH__)
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
#else
  for (int i = 0; i < 4; ++i) v[i] = p[i];
#endif
}
__device__ __forceinline__ void load4(const double* p, double (&v)[4]) {
#if defined(__CUDA_ARCH__)
  const double2 t0 = reinterpret_cast<const double2*>(p)[0];
  const double2 t1 = reinterpret_cast<const double2*>(p)[1];
  v[0] = t0.x; v[1] = t0.y; v[2] = t1.x; v[3] = t1.y;
#else
  for (int i = 0; i < 4; ++i) v[i] = p[i];
#endif
}

// acc[i][j] += sum over k = k0, k0 + kstep, ... < k1 of a[k*lda + i] * b[k*ldb + j]
// (a, b 16-byte aligned; lda, ldb multiples of 4).
template <int kStep, typename A>
__device__ __forceinline__ void mma4x4(const A* a, int lda, const A* b, int ldb, int k0, int k1,
                                       A (&acc)[4][4]) {
#pragma unroll 4
  for (int k = k0; k < k1; k += kStep) {
    A av[4], bv[4];
    load4(a + k * lda, av);
    load4(b + k * ldb, bv);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
  }
}

}  // namespace dbn_tiles
}  // namespace gn_mx
