/*
 * dbn_small_cuda.cuh: the D x D work of the DBN CUDA kernels, one thread block per group
 * (dbn_cuda.cu): BlockExec, the device executor of dbn_math.h's steps (the role dbn_small_cpu.h
 * plays on the CPU), the block-parallel Jacobi eigensolver, and the one-block-per-group kernels
 * eig_kernel (forward), bwd_small_kernel (backward) and affine_grad_kernel (affine inference
 * backward). IterNorm's kernel is in dbn_iternorm_cuda.cuh. Private to dbn_cuda.cu (internal linkage).
 */
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "dbn_plan_cuda.cuh"

namespace gn_mx {
namespace {

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

// Which 64 x 64 output tiles of a D x D result a block works on (IterNorm's product stages,
// dbn_iternorm_cuda.cuh: a group's tiles spread over gridDim.y blocks). Owner p < 0: all of them
// (one block per group). Otherwise the unit is a tile (I, J), p = I nt + J (nt = tiles per side),
// or, for symmetric results (mm_it_sym computes the upper tile and mirrors it), the pair of tiles
// (I, J) and (J, I), p = its rank among the pairs I <= J in row order.
struct TileOwner {
  int p = -1;
  bool pairs = false;
  __host__ __device__ static int tiles(int D) { return (D + kTile - 1) / kTile; }
  __host__ __device__ static int owners(int D, bool pairs) {
    const int nt = tiles(D);
    return pairs ? nt * (nt + 1) / 2 : nt * nt;
  }
  __device__ bool owns(int I, int J, int nt) const {
    if (p < 0) return true;
    if (!pairs) return I * nt + J == p;
    const int a = I < J ? I : J, b = I < J ? J : I;
    return a * nt - a * (a - 1) / 2 + (b - a) == p;
  }
};

struct BlockExec {
  double* tile = nullptr;  // kTileBytes of shared memory (products only)
  bool fp32_orth = false;  // mm_orth sums in fp32
  TileOwner own{};         // the tiles mm_it* and each_ij cover (each, each_lower, mm: all)
  template <class F> __device__ void each(int n, F&& f) const {
    for (int e = threadIdx.x; e < n; e += blockDim.x) f(e);
  }
  template <class F> __device__ void each_ij(int D, F&& f) const {
    if (own.p < 0) {
      for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
        const int i = e / D;
        f(i, e - i * D);
      }
      return;
    }
    const int nt = TileOwner::tiles(D);
    for (int I = 0; I < nt; ++I)
      for (int J = 0; J < nt; ++J) {
        if (!own.owns(I, J, nt)) continue;
        const int i0 = I * kTile, j0 = J * kTile;
        const int h = D - i0 < kTile ? D - i0 : kTile, w = D - j0 < kTile ? D - j0 : kTile;
        for (int e = threadIdx.x; e < h * w; e += blockDim.x) {
          const int r = e / w;
          f(i0 + r, j0 + e - r * w);
        }
      }
  }
  template <class F> __device__ void each_lower(int D, F&& f) const {
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
      const int i = e / D, j = e - i * D;
      if (j <= i) f(i, j);
    }
  }
  // Whole-matrix stages only (own.p < 0): every thread of the block calls it.
  template <class F> __device__ double sum(int n, F&& f) const {
    double v = 0.0;
    for (int e = threadIdx.x; e < n; e += blockDim.x) v += f(e);
    return block_sum<kBlock>(v);
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
    for (int i0 = 0; i0 < D; i0 += kTile)
      for (int j0 = 0; j0 < D; j0 += kTile) {
        S acc[4][4];
        zero4x4(acc);
        for (int k0 = 0; k0 < D; k0 += kTileK) tile_step(A, B, D, i0, j0, k0, D, acc);
        store4x4(Cm, D, i0, j0, acc);
      }
    __syncthreads();
  }
  // The one k-panel step of both tiled products: the kTile x kTileK panel of A (rows i0.., columns
  // k0..) and the kTileK x kTile panel of B (rows k0.., columns j0..) staged in shared memory as S
  // (zeros outside the D x D matrices), then, for k = k0 .. min(k0 + kTileK, kend) - 1 in
  // ascending order, acc[r][c] += A(i, k) B(k, j) with (i, j) = (i0 + ty + 16 r, j0 + tx + 16 c).
  template <typename S, typename In>
  __device__ void tile_step(const In* __restrict__ A, const In* __restrict__ B, int D, int i0,
                            int j0, int k0, int kend, S (&acc)[4][4]) const {
    S* As = reinterpret_cast<S*>(tile);  // [kTile][kTileLdA]: A(i0 + r, k0 + k)
    S* Bs = As + kTile * kTileLdA;       // [kTileK][kTile]:   B(k0 + k, j0 + c)
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
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
    const int kc = kend - k0 < kTileK ? kend - k0 : kTileK;
    // A whole panel unrolled: the shared loads of later k issue ahead of earlier k's FMAs (one
    // block per SM has too few warps to hide their latency otherwise); same FMAs, same order.
    if (kc == kTileK) {
#pragma unroll
      for (int k = 0; k < kTileK; ++k) panel_k(As, Bs, k, tx, ty, acc);
    } else {
      for (int k = 0; k < kc; ++k) panel_k(As, Bs, k, tx, ty, acc);
    }
  }
  template <typename S>
  __device__ __forceinline__ static void panel_k(const S* As, const S* Bs, int k, int tx,
                                                 int ty, S (&acc)[4][4]) {
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
  template <typename S>
  __device__ static void zero4x4(S (&v)[4][4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) v[r][c] = S(0);
  }
  // The thread's 4 x 4 outputs of the tile (i0, j0) into C (D x D), inside the matrix only.
  template <typename S, typename Out>
  __device__ static void store4x4(Out* Cm, int D, int i0, int j0, const S (&v)[4][4]) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = i0 + ty + 16 * r, j = j0 + tx + 16 * c;
        if (i < D && j < D) Cm[i * D + j] = static_cast<Out>(v[r][c]);
      }
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
    each_ij(D, [&](int i, int j) {  // a pair owner wrote (min, max) of both tiles it mirrors
      if (i > j) Cm[i * D + j] = Cm[j * D + i];
    });
    __syncthreads();
  }
  template <typename S>
  __device__ void mm_it_tiled(const S* __restrict__ A, const S* __restrict__ B, S* Cm, int D,
                              bool acc, bool sym = false) const {
    static_assert(kDbnIterKb % kTileK == 0, "k-blocks of whole panels");
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, nt = TileOwner::tiles(D);
    for (int i0 = 0; i0 < D; i0 += kTile)
      for (int j0 = sym ? i0 : 0; j0 < D; j0 += kTile) {
        if (!own.owns(i0 / kTile, j0 / kTile, nt)) continue;  // uniform over the block
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
          zero4x4(part);
          for (int k0 = kb; k0 < kend; k0 += kTileK) tile_step(A, B, D, i0, j0, k0, kend, part);
#pragma unroll
          for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c)
              tot[r][c] = (kb == 0 && !acc) ? part[r][c] : tot[r][c] + part[r][c];
        }
        __syncthreads();  // every thread has read its C entries before any is written (acc)
        store4x4(Cm, D, i0, j0, tot);
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

// Jacobi's start: Ut = I, and A scaled by 2^-ex (max|A_ij| in [0.5, 1); ex = 0 leaves A as it
// is). Returns ex, the same on every thread; ends with a barrier.
__device__ int jacobi_start(double* A, int lda, double* Ut, int ldu, int D) {
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
  return ex;
}

// The block's sum of A_ij^2 over the whole matrix, or over the strict upper triangle (upper: the
// off-diagonal measure of the stopping rule). The same on every thread (block_sum syncs).
__device__ double jacobi_sum_sq(const double* A, int lda, int D, bool upper) {
  double part = 0.0;
  for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
    const int i = e / D, j = e - i * D;
    if (!upper || i < j) part += A[i * lda + j] * A[i * lda + j];
  }
  return block_sum<kBlock>(part);
}

// Round r of a sweep over Dp (even) indices: the npairs disjoint rotations (p, q) of the round
// (rr_pair; c, s from dbn_jacobi_rotation, the identity for a zero A_pq or a padding index q = D)
// into s_c, s_s, s_p, s_q, then applied by the whole block: A <- J^T A J, U <- U J.
__device__ void jacobi_round(double* A, int lda, double* Ut, int ldu, int D, int r, int Dp,
                             double* s_c, double* s_s, int* s_p, int* s_q) {
  const int npairs = Dp / 2;
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
  const int ex = jacobi_start(A, lda, Ut, ldu, D);
  const double fro2 = jacobi_sum_sq(A, lda, D, false);  // also syncs Ut / A
  const int Dp = D + (D & 1);
  for (int sweep = 0; sweep < kDbnJacobiMaxSweeps; ++sweep) {
    const double off = jacobi_sum_sq(A, lda, D, true);
    GN_ASSERT_UNIFORM(kBlock, (Pair<double>{off, fro2}));
    if (dbn_jacobi_converged(off, fro2)) break;
    for (int r = 0; r < Dp - 1; ++r) jacobi_round(A, lda, Ut, ldu, D, r, Dp, s_c, s_s, s_p, s_q);
  }
  if (ex != 0) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) A[i * lda + i] = ldexp(A[i * lda + i], ex);
    __syncthreads();
  }
}

// Entry e (of E per group) of group g's gram partials, summed over its `chunks` in chunk order.
__device__ __forceinline__ double sum_chunks(const double* __restrict__ part, int64_t chunks,
                                             int64_t g, int E, int e) {
  double s = 0.0;
  for (int64_t c = 0; c < chunks; ++c) s += part[(g * chunks + c) * E + e];
  return s;
}

// Sigma = (sum of the group's gram partials) / m + eps I into A (row stride ld). Returns 1 when
// every entry is finite, 0 otherwise (the same on every thread of the block).
__device__ int eig_load_sigma(const double* __restrict__ part, int64_t chunks, int64_t g, int D,
                              double m, double eps, double* A, int ld) {
  const int DD = D * D;
  int finite = 1;
  for (int e = threadIdx.x; e < DD; e += blockDim.x) {
    double s = sum_chunks(part, chunks, g, DD, e) / m;
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
    const double s = sum_chunks(part, chunks, g, E, e);
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
    const double s = sum_chunks(part, chunks, g, E, e);
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

}  // namespace
}  // namespace gn_mx
