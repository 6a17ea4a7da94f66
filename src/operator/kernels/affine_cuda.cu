/*
 * affine_cuda.cu: CUDA per-channel affine (see affine.h), twin of affine_cpu.cc.
 *
 * Forward: a grid-stride loop over 16-byte vectors (scalars when x or y is unaligned); each thread
 * finds the channel of its first element with one pair of divisions and then moves a ChannelCursor
 * by its fixed stride (no division per element); one gamma/beta load per vector when S is a
 * multiple of the vector width.
 *
 * Backward: dx = dy * gamma_c and the sums dgamma_c = sum dy*x, dbeta_c = sum dy over (n, s), parallel
 * over n in two stages (param_reduce.cuh): stage-1 blocks cover (channels, n chunk) and, with several
 * chunks, write partial sums to the workspace that param_finalize_kernel adds up. Two stage-1 forms:
 *   - short rows (S <= kTileMaxS, S = 1 is the fully-connected case): affine_bwd_tile_kernel, a block
 *     per (tile of tc channels, n chunk); a row's tile is tc*S contiguous elements, read by pt threads
 *     (V elements each, so each thread keeps the same channels for every row: no division in the
 *     loop) in `lanes` rows side by side; lanes then channels are summed in shared memory;
 *   - long rows: affine_bwd_rows_kernel, a block per (channel, n chunk) walking the chunk's rows of
 *     the channel as one run of vectors (row and offset tracked incrementally), then a block sum.
 * Deterministic: fixed summation orders, no atomics, chunking from the shape (and whether the
 * pointers allow vectors) only, never from the GPU's size. Without a workspace (affine_bwd_cuda
 * called with none) every block takes all N rows: the same results in a different summation order.
 */
#include <cuda_runtime.h>

#include <algorithm>

#include "affine.h"
#include "cuda_common.cuh"
#include "param_reduce.cuh"
#include "../common/carver.h"
#include "../common/dispatch.h"

namespace gn_mx {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTileMaxS = 32;      // rows of at most this many elements: the tile kernel
constexpr int64_t kFwdUnits = 4;       // forward: vectors per thread before the grid is enlarged
constexpr int64_t kMaxFwdBlocks = int64_t(65535) * 8;
constexpr int64_t kRowsUnitsPerThread = 8;  // long-row backward: vectors per thread per block

// Channel c = (e / S) % C and offset s = e % S of element e of (N, C, S) data, moved by a fixed
// stride of elements without divisions (two at construction).
struct ChannelCursor {
  int64_t C, S, c, s, dc, ds;
  __device__ ChannelCursor(int64_t e, int64_t stride, int64_t C_, int64_t S_) : C(C_), S(S_) {
    const int64_t q = e / S;
    s = e - q * S;
    c = q % C;
    const int64_t qs = stride / S;
    ds = stride - qs * S;
    dc = qs % C;
  }
  __device__ __forceinline__ void advance() {  // by the stride
    s += ds;
    c += dc;
    if (s >= S) {
      s -= S;
      ++c;
    }
    if (c >= C) c -= C;
  }
  __device__ __forceinline__ void next() {  // by one element
    if (++s == S) {
      s = 0;
      if (++c == C) c = 0;
    }
  }
};

template <typename T, typename P>
__device__ __forceinline__ T affine_elem(T x, const P* __restrict__ gamma,
                                         const P* __restrict__ beta, int64_t c) {
  using A = AccT<T>;
  return from_acc<T>(to_acc(x) * static_cast<A>(to_acc(gamma[c])) +
                     static_cast<A>(to_acc(beta[c])));
}

// y = x * gamma_c + beta_c over `units` vectors of V elements (V > 1: x and y 16-byte aligned), then
// the total % V tail elements (block 0).
template <typename T, typename P, int V>
__global__ void __launch_bounds__(kThreads)
affine_fwd_kernel(const T* __restrict__ x, const P* __restrict__ gamma, const P* __restrict__ beta,
                  T* __restrict__ y, int64_t total, int64_t C, int64_t S) {
  using VT = Vec<T, V>;
  const int64_t units = total / V;
  const int64_t t0 = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  if (t0 < units) {
    ChannelCursor cur(t0 * V, stride * V, C, S);
    const bool one_channel = S % V == 0;  // a vector never straddles two channels
    for (int64_t i = t0; i < units; i += stride, cur.advance()) {
      const VT in = reinterpret_cast<const VT*>(x)[i];
      VT out;
      if (one_channel) {
#pragma unroll
        for (int k = 0; k < V; ++k) out.v[k] = affine_elem(in.v[k], gamma, beta, cur.c);
      } else {
        ChannelCursor e = cur;
#pragma unroll
        for (int k = 0; k < V; ++k, e.next()) out.v[k] = affine_elem(in.v[k], gamma, beta, e.c);
      }
      reinterpret_cast<VT*>(y)[i] = out;
    }
  }
  if (V > 1 && blockIdx.x == 0 && int64_t(threadIdx.x) < total - units * V) {
    const int64_t i = units * V + threadIdx.x;
    y[i] = affine_elem(x[i], gamma, beta, (i / S) % C);
  }
}

// Backward stage 1, short rows. Grid (ceil(C / tc), chunks); block (b, k): channels
// [b*tc, b*tc + tcb), rows [k*chunk_rows, ...). Thread t = lane * pt + p handles elements
// [p*V, p*V + V) of the tile's tcb*S elements (a multiple of V) in rows lane, lane + lanes, ...;
// lanes is a power of two and lanes * pt <= kThreads.
template <typename T, typename P, int V>
__global__ void __launch_bounds__(kThreads)
affine_bwd_tile_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                       const P* __restrict__ gamma, T* __restrict__ dx, int64_t N, int64_t C,
                       int S, int tc, int pt, int lanes, int64_t chunk_rows,
                       AccT<T>* __restrict__ part, P* __restrict__ dgamma,
                       P* __restrict__ dbeta) {
  using A = AccT<T>;
  using VT = Vec<T, V>;
  __shared__ A s_g[kThreads * V], s_b[kThreads * V];
  const int64_t c0 = int64_t(blockIdx.x) * tc;
  const int tcb = static_cast<int>(imin<int64_t>(tc, C - c0));
  const int E = tcb * S;  // the tile's elements per row
  const int lane = threadIdx.x / pt, p = threadIdx.x % pt;
  const bool active = lane < lanes && p * V < E;
  A g[V], sg[V], sb[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    sg[k] = sb[k] = A(0);
    g[k] = active ? static_cast<A>(to_acc(gamma[c0 + (p * V + k) / S])) : A(0);
  }
  const int64_t n0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t n1 = imin<int64_t>(N, n0 + chunk_rows);
  if (active) {
    const int64_t base = (c0 * S) / V + p, row = (C * S) / V;  // in vectors (exact: see the plan)
#pragma unroll 2
    for (int64_t n = n0 + lane; n < n1; n += lanes) {
      const int64_t u = n * row + base;
      const VT d = reinterpret_cast<const VT*>(dy)[u];
      const VT v = reinterpret_cast<const VT*>(x)[u];
      VT o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A go = to_acc(d.v[k]);
        sg[k] += go * to_acc(v.v[k]);
        sb[k] += go;
        o.v[k] = from_acc<T>(go * g[k]);
      }
      reinterpret_cast<VT*>(dx)[u] = o;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      s_g[lane * E + p * V + k] = sg[k];
      s_b[lane * E + p * V + k] = sb[k];
    }
  }
  __syncthreads();
  for (int h = lanes / 2; h > 0; h /= 2) {  // lanes: a fixed pairwise tree
    if (active && lane < h) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int e = lane * E + p * V + k;
        s_g[e] += s_g[e + h * E];
        s_b[e] += s_b[e + h * E];
      }
    }
    __syncthreads();
  }
  for (int j = threadIdx.x; j < tcb; j += kThreads) {  // a channel's S elements, in order
    A a = 0, b = 0;
    for (int s = 0; s < S; ++s) {
      a += s_g[j * S + s];
      b += s_b[j * S + s];
    }
    param_store<A, P>(a, b, c0 + j, C, blockIdx.y, gridDim.y, part, dgamma, dbeta);
  }
}

// Backward stage 1, long rows. Grid (C, chunks); block (c, k) walks the vectors of channel c in rows
// [k*chunk_rows, ...) as one run: unit j of the run is vector j % Su of row n0 + j / Su, whose
// offset moves by a fixed step (plus a row change on wrap-around) as j grows by kThreads.
template <typename T, typename P, int V>
__global__ void __launch_bounds__(kThreads)
affine_bwd_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                       const P* __restrict__ gamma, T* __restrict__ dx, int64_t N, int64_t C,
                       int64_t S, int64_t chunk_rows, AccT<T>* __restrict__ part,
                       P* __restrict__ dgamma, P* __restrict__ dbeta) {
  using A = AccT<T>;
  using VT = Vec<T, V>;
  const int64_t c = blockIdx.x;
  const int64_t Su = S / V, row = C * Su;  // vectors per row; between rows n and n + 1
  const int64_t n0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t units = (imin<int64_t>(N, n0 + chunk_rows) - n0) * Su;
  const A g = static_cast<A>(to_acc(gamma[c]));
  Pair<A> acc{A(0), A(0)};
  int64_t j = threadIdx.x;
  if (j < units) {
    int64_t s = j % Su;
    int64_t off = ((n0 + j / Su) * C + c) * Su + s;
    const int64_t dn = kThreads / Su, ds = kThreads % Su;
    for (; j < units; j += kThreads) {
      const VT d = reinterpret_cast<const VT*>(dy)[off];
      const VT v = reinterpret_cast<const VT*>(x)[off];
      VT o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A go = to_acc(d.v[k]);
        acc.a += go * to_acc(v.v[k]);
        acc.b += go;
        o.v[k] = from_acc<T>(go * g);
      }
      reinterpret_cast<VT*>(dx)[off] = o;
      s += ds;
      off += dn * row + ds;
      if (s >= Su) {
        s -= Su;
        off += row - Su;
      }
    }
  }
  acc = block_sum<kThreads>(acc);
  if (threadIdx.x == 0) param_store<A, P>(acc.a, acc.b, c, C, blockIdx.y, gridDim.y, part, dgamma,
                                          dbeta);
}

// ------------------------------------------------------------------------------------------------
// Host side

template <typename T, typename P>
const char* fwd_typed(const AffineArgs& a, cudaStream_t stream) {
  const int64_t total = a.dims.N * a.dims.C * a.dims.S;
  constexpr int Vw = vec_width<T>();
  const int V = aligned16(a.x) && aligned16(a.y) ? Vw : 1;
  const int64_t blocks =
      std::min(kMaxFwdBlocks, std::max<int64_t>(1, ceil_div(total / V, kThreads * kFwdUnits)));
  const T* x = static_cast<const T*>(a.x);
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  T* y = static_cast<T*>(a.y);
  if (V > 1)
    affine_fwd_kernel<T, P, Vw><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, gamma, beta, y, total, a.dims.C, a.dims.S);
  else
    affine_fwd_kernel<T, P, 1><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, gamma, beta, y, total, a.dims.C, a.dims.S);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

// The backward's stage-1 plan (see the kernels): shape, vector width and workspace only.
struct BwdPlan {
  bool tile = true;
  int V = 1;
  int tc = 1, pt = 1, lanes = 1;  // tile kernel
  int64_t blocks_x = 1;           // channel tiles (tile kernel) or channels (rows kernel)
  int64_t chunk_rows = 1, chunks = 1;
};

// `vectors`: whether dy, x and dx allow 16-byte loads; `chunked`: whether a workspace takes partials.
template <typename T>
BwdPlan plan_bwd(const GroupDims& d, bool vectors, bool chunked) {
  const int Vw = vec_width<T>();
  const int64_t N = d.N, C = d.C, S = d.S;
  BwdPlan p;
  p.tile = S <= kTileMaxS;
  int64_t min_rows = 1;
  if (p.tile) {
    p.V = vectors && (C * S) % Vw == 0 ? Vw : 1;
    int64_t tc = std::min<int64_t>(C, int64_t(kThreads) * p.V / S);
    if (tc < C) tc -= tc % p.V;  // tiles of a multiple of V elements
    p.tc = static_cast<int>(tc);
    p.pt = static_cast<int>(tc * S / p.V);
    p.lanes = 1;
    while (p.lanes * 2 * p.pt <= kThreads) p.lanes *= 2;
    p.blocks_x = ceil_div(C, tc);
    min_rows = int64_t(8) * p.lanes;  // >= 8 rows per thread
  } else {
    p.V = vectors && S % Vw == 0 ? Vw : 1;
    p.blocks_x = C;
    min_rows = ceil_div(int64_t(kThreads) * kRowsUnitsPerThread, S / p.V);
  }
  p.chunk_rows = N;
  if (chunked) p.chunk_rows = param_chunks(N, min_rows, &p.chunks);
  return p;
}

// The one layout of the backward workspace: kParamPart values per (n chunk, channel), none with one
// chunk. With ws == nullptr it only measures.
template <typename T>
AccT<T>* carve_bwd(void* ws, int64_t C, const BwdPlan& p, size_t* bytes = nullptr) {
  WorkspaceCarver<16> w{static_cast<char*>(ws)};
  AccT<T>* part = nullptr;
  if (p.chunks > 1) part = w.take<AccT<T>>(static_cast<size_t>(p.chunks * C * kParamPart));
  if (bytes) *bytes = w.off;
  return part;
}

template <typename T>
size_t bwd_workspace(const AffineBwdArgs& a) {
  if (check_group_dims(a.dims)) return 0;
  size_t most = 0;
  for (bool vectors : {false, true}) {  // whatever the pointers turn out to be
    size_t bytes = 0;
    carve_bwd<T>(nullptr, a.dims.C, plan_bwd<T>(a.dims, vectors, true), &bytes);
    most = std::max(most, bytes);
  }
  return most;
}

template <typename T, typename P, int V>
void launch_bwd_stage1(const AffineBwdArgs& a, const BwdPlan& p, AccT<T>* part,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.blocks_x), static_cast<unsigned>(p.chunks));
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const P* gamma = static_cast<const P*>(a.gamma);
  T* dx = static_cast<T*>(a.dx);
  P* dgamma = static_cast<P*>(a.dgamma);
  P* dbeta = static_cast<P*>(a.dbeta);
  if (p.tile)
    affine_bwd_tile_kernel<T, P, V><<<grid, kThreads, 0, stream>>>(
        dy, x, gamma, dx, a.dims.N, a.dims.C, static_cast<int>(a.dims.S), p.tc, p.pt, p.lanes,
        p.chunk_rows, part, dgamma, dbeta);
  else
    affine_bwd_rows_kernel<T, P, V><<<grid, kThreads, 0, stream>>>(
        dy, x, gamma, dx, a.dims.N, a.dims.C, a.dims.S, p.chunk_rows, part, dgamma, dbeta);
}

template <typename T, typename P>
const char* bwd_typed(const AffineBwdArgs& a, cudaStream_t stream) {
  using A = AccT<T>;
  if (a.workspace && !aligned16(a.workspace)) return "workspace must be 16-byte aligned";
  const bool vectors = aligned16(a.dy) && aligned16(a.x) && aligned16(a.dx);
  const BwdPlan p = plan_bwd<T>(a.dims, vectors, a.workspace != nullptr);
  A* part = carve_bwd<T>(a.workspace, a.dims.C, p);
  if (p.V > 1)
    launch_bwd_stage1<T, P, vec_width<T>()>(a, p, part, stream);
  else
    launch_bwd_stage1<T, P, 1>(a, p, part, stream);
  GN_CUDA_CHECK_LAUNCH();
  return launch_param_finalize(part, p.chunks, a.dims.C, static_cast<P*>(a.dgamma),
                                     static_cast<P*>(a.dbeta), stream);
}

template <typename Args, typename F>
const char* dispatch(const Args& a, F&& f) {
  if (const char* e = check_group_dims(a.dims)) return e;
  return dispatch_data_param(a.dtype, a.param_dtype, f);
}

}  // namespace

const char* affine_fwd_cuda(const AffineArgs& a, void* stream) {
  return dispatch(a, [&](auto t, auto p) {
    return fwd_typed<decltype(t), decltype(p)>(a, static_cast<cudaStream_t>(stream));
  });
}

size_t affine_bwd_workspace_cuda(const AffineBwdArgs& a) {
  size_t n = 0;
  dispatch_data(a.dtype, [&](auto t) -> const char* {
    n = bwd_workspace<decltype(t)>(a);
    return nullptr;
  });
  return n;
}

const char* affine_bwd_cuda(const AffineBwdArgs& a, void* stream) {
  return dispatch(a, [&](auto t, auto p) {
    return bwd_typed<decltype(t), decltype(p)>(a, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace gn_mx
