/*
 * dbn_data_cuda.cuh: the DBN CUDA kernels that stream the data (dbn_cuda.cu): channel sums and
 * their finalize (the mean), the gram kernel (fp64 partials of Xc Xc^T, or of dY Xc^T and sum(dY))
 * and its split reduction, the inference prep kernel and the apply kernel (out = M (in - shift)
 * ...), all tiled through dbn_gemm_cuda.cuh. Grids and shared memory: dbn_plan_cuda.cuh. Private to
 * dbn_cuda.cu (internal linkage).
 */
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "dbn_plan_cuda.cuh"

namespace gn_mx {
namespace {

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

// The block's place in gram_kernel's grid (G * pairs, chunks): group g, tile pair (ti, tj) as
// rows r0 .. r0 + rows_a - 1 against rows c0 .. c0 + rows_b - 1 of the group, its thread's slice
// and 4 x 4 output block (ty, tx). Backward: every pair, row-major; forward: the upper triangle
// ti <= tj, a diagonal pair (same) reading one tile; `sums`: the tj = 0 blocks of the backward,
// which also sum dY's rows.
struct GramTile {
  int64_t g;
  int r0, c0, rows_a, rows_b, slice, lt, ty, tx;
  bool same, sums;
};
template <bool kBwd, int TT>
__device__ __forceinline__ GramTile gram_tile(int tiles, int D) {
  constexpr int kPerSlice = kBlock / gram_slices(TT), TW = TT / 4;
  const int pairs = kBwd ? tiles * tiles : tiles * (tiles + 1) / 2;
  GramTile t;
  t.g = blockIdx.x / pairs;
  int p = static_cast<int>(blockIdx.x - t.g * pairs), ti = 0, tj = 0;
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
  t.r0 = ti * TT;
  t.c0 = tj * TT;
  t.rows_a = D - t.r0 < TT ? D - t.r0 : TT;
  t.rows_b = D - t.c0 < TT ? D - t.c0 : TT;
  t.same = !kBwd && ti == tj;
  t.sums = kBwd && tj == 0;
  t.slice = threadIdx.x / kPerSlice;
  t.lt = threadIdx.x - t.slice * kPerSlice;
  t.ty = t.lt / TW;
  t.tx = t.lt - t.ty * TW;
  return t;
}

// The tile's sums over columns [j_begin, j_end), panel by panel: BK columns gathered into shared
// memory (colbase, then the panels Pa / Pb, k-major, widened to AccT), acc += the slice's columns'
// products, rs += dY's rows (sums blocks, tx == 0 threads).
template <typename T, bool kBwd, int TT>
__device__ __forceinline__ void gram_panels(const T* __restrict__ x, const AccT<T>* sh,
                                            const T* __restrict__ dy, int64_t C, int64_t S,
                                            int64_t row0, int64_t j_begin, int64_t j_end, int lsh,
                                            const GramTile& t, unsigned char* smem,
                                            AccT<T> (&acc)[4][4], AccT<T> (&rs)[4]) {
  using A = AccT<T>;
  constexpr int BK = gram_bk(TT), KS = gram_slices(TT), LD = TT + dbn_tiles::kPad;
  int64_t* colbase = reinterpret_cast<int64_t*>(smem);
  A* Pa = reinterpret_cast<A*>(smem + BK * sizeof(int64_t));
  A* Pb = Pa + BK * LD;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += BK) {
    const int kc = static_cast<int>(j_end - j0 < BK ? j_end - j0 : BK);
    __syncthreads();
    dbn_tiles::panel_columns(colbase, j0, kc, C, S);
    __syncthreads();
    if (kBwd)
      dbn_tiles::load_tile<TT, BK>(dy, colbase, row0 + t.r0, S, t.rows_a, kc,
                                   static_cast<const A*>(nullptr), Pa, 1, LD, lsh);
    else
      dbn_tiles::load_tile<TT, BK>(x, colbase, row0 + t.r0, S, t.rows_a, kc, sh + t.r0, Pa, 1, LD,
                                   lsh);
    if (!t.same)
      dbn_tiles::load_tile<TT, BK>(x, colbase, row0 + t.c0, S, t.rows_b, kc, sh + t.c0, Pb, 1, LD,
                                   lsh);
    __syncthreads();
    dbn_tiles::mma4x4<KS>(Pa + 4 * t.ty, LD, (t.same ? Pa : Pb) + 4 * t.tx, LD, t.slice, BK, acc);
    if (t.sums && t.tx == 0)
      for (int k = t.slice; k < BK; k += KS)
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[i] += Pa[k * LD + 4 * t.ty + i];
  }
}

// KS > 1 slices: slice s > 0 hands its acc / rs to slice 0 through red (kPerSlice x 20 values of
// shared memory), one slice at a time, so slice 0 sums them in slice order.
template <int KS, typename A>
__device__ __forceinline__ void gram_slice_sum(A* red, const GramTile& t, A (&acc)[4][4],
                                               A (&rs)[4]) {
  for (int s = 1; s < KS; ++s) {
    __syncthreads();
    if (t.slice == s)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        red[t.lt * 20 + 16 + i] = rs[i];
#pragma unroll
        for (int j = 0; j < 4; ++j) red[t.lt * 20 + 4 * i + j] = acc[i][j];
      }
    __syncthreads();
    if (t.slice == 0)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        rs[i] += red[t.lt * 20 + 16 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += red[t.lt * 20 + 4 * i + j];
      }
  }
}

// Slice 0's 4 x 4 block (and rs) as fp64 into the block's partials `out` (DD (+ D) entries):
// entry r*D + c; forward off-diagonal tiles also at c*D + r (the mirror); rs at DD + r.
template <bool kBwd, typename A>
__device__ __forceinline__ void gram_store(double* out, int D, const GramTile& t,
                                           const A (&acc)[4][4], const A (&rs)[4]) {
  const int DD = D * D;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = t.r0 + 4 * t.ty + i;
    if (r >= D) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = t.c0 + 4 * t.tx + j;
      if (c >= D) continue;
      out[r * D + c] = static_cast<double>(acc[i][j]);
      if (!kBwd && !t.same) out[c * D + r] = static_cast<double>(acc[i][j]);
    }
    if (t.sums && t.tx == 0) out[DD + r] = static_cast<double>(rs[i]);
  }
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
  extern __shared__ __align__(16) unsigned char smem[];
  const GramTile t = gram_tile<kBwd, TT>(tiles, D);
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  const int64_t j_begin = chunk * cols;
  const int64_t j_end = j_begin + cols < m ? j_begin + cols : m;
  const int64_t row0 = t.g * D;
  A acc[4][4], rs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    rs[i] = A(0);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = A(0);
  }
  gram_panels<T, kBwd, TT>(x, mean + row0, dy, C, S, row0, j_begin, j_end, lsh, t, smem, acc, rs);
  // the slices meet within the panels (Pa), after the last one is read
  if (gram_slices(TT) > 1)
    gram_slice_sum<gram_slices(TT)>(reinterpret_cast<A*>(smem + gram_bk(TT) * sizeof(int64_t)), t,
                                    acc, rs);
  if (t.slice != 0) return;
  gram_store<kBwd>(part + (t.g * chunks + chunk) * (D * D + (kBwd ? D : 0)), D, t, acc, rs);
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

}  // namespace
}  // namespace gn_mx
