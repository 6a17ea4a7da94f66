/*
 * group_norm_grad2_cuda.cu: CUDA double backward of gn_group_norm, twin of group_norm_grad2_cpu.cc
 * (formulas: group_norm_grad2.h / group_norm_grad2_math.h).
 *
 * grad2_group_kernel: one block per group (n, g), two passes over the group like the CPU twin; the
 * per-channel sums are block reductions, the per-(n, c) partials of d gamma / d beta go to the
 * workspace (pg (N, C), pb (N, 2C), AccT), reduced over n by grad2_param_kernel over (channel tile,
 * n chunk) blocks and, with several chunks, param_finalize_kernel (param_reduce.cuh: fixed order,
 * no atomics, chunking from N alone; the chunks' partials follow pb in the workspace). Simple
 * rather than fast: it runs only for second derivatives.
 */
#include <cuda_runtime.h>

#include "group_norm_grad2.h"
#include "cuda_common.cuh"
#include "group_norm_grad2_math.h"
#include "param_reduce.cuh"
#include "../common/dispatch.h"

namespace gn_mx {
namespace {

constexpr int kThreads = 256;

template <typename V, typename A>
__device__ __forceinline__ A ld(const void* p, int64_t i) {
  return p ? static_cast<A>(to_acc(static_cast<const V*>(p)[i])) : A(0);
}

// Either layout (group_shape.h): the first element of row (n, c), the distance between its
// positions, and the j-th element of group ng (channels first: the contiguous run; channels last:
// position j / D, channel j % D of the group, so consecutive j stay coalesced).
__device__ __forceinline__ int64_t chan_base(const GroupDims& d, int64_t n, int64_t c) {
  return d.channels_last ? n * d.S * d.C + c : (n * d.C + c) * d.S;
}
__device__ __forceinline__ int64_t pos_stride(const GroupDims& d) {
  return d.channels_last ? d.C : 1;
}
__device__ __forceinline__ int64_t group_elem(const GroupDims& d, int64_t ng, int64_t j, int64_t D) {
  if (!d.channels_last) return ng * D * d.S + j;
  const int64_t n = ng / d.G, g = ng % d.G;
  return (n * d.S + j / D) * d.C + g * D + j % D;
}

// __launch_bounds__(kThreads, 1): the block size for tests/cuda_resource_audit.py (and the
// emulator's launch check) without an occupancy target: a plain (kThreads) made ptxas cap the
// fp64 SiLU instance at 80 registers and spill 24 bytes on sm_80 (86 registers, no spill unbounded).
template <typename T, typename P, Act ACT>
__global__ void __launch_bounds__(kThreads, 1) grad2_group_kernel(GroupNormGrad2Args a) {
  using A = AccT<T>;
  const int64_t ng = blockIdx.x;
  const int64_t n = ng / a.dims.G, g = ng % a.dims.G;
  const int64_t D = a.dims.C / a.dims.G, S = a.dims.S;
  const A mu = ld<A, A>(a.mean, ng), r = ld<A, A>(a.rstd, ng);
  const A dmo = ld<A, A>(a.dmean_o, ng), dro = ld<A, A>(a.drstd_o, ng);
  const A inv_m = A(1) / static_cast<A>(D * S);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  A* pg = static_cast<A*>(a.workspace) + n * a.dims.C;
  A* pb = static_cast<A*>(a.workspace) + a.dims.N * a.dims.C + n * 2 * a.dims.C;
  Grad2Sums<A> s;
  A tP = 0, tQ = 0;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t c = g * D + d, off = chan_base(a.dims, n, c), ps = pos_stride(a.dims);
    const A gam = ld<P, A>(a.gamma, c), bet = ld<P, A>(a.beta, c);
    const A ggam = ld<P, A>(a.gdgamma, c);
    A gxg = 0, dsc = 0, db = 0;
    for (int64_t i = off + threadIdx.x * ps; i < off + S * ps; i += blockDim.x * ps) {
      const A u = to_acc(x[i]) - mu;
      const A gv = gn_act_grad<ACT>(u * r * gam + bet, static_cast<A>(to_acc(dy[i])));
      const A gx = ld<T, A>(a.gdx, i);
      gxg += gx * gv;
      dsc += gv * u;
      db += gv;
      tP += gx * u;
      tQ += gx;
    }
    const Pair<A> p1 = block_sum<kThreads>(Pair<A>{gxg, dsc});
    db = block_sum<kThreads>(db);
    s.sa += gam * p1.b;
    s.sb += gam * db;
    s.t1 += gam * p1.a + ggam * p1.b;
    if (threadIdx.x == 0) {
      pg[c] = p1.a;
      pb[c] = p1.b;
      pb[a.dims.C + c] = db;
    }
  }
  const Pair<A> pq = block_sum<kThreads>(Pair<A>{tP, tQ});
  s.P = pq.a;
  s.Q = pq.b;
  const Grad2Coeffs<A> k = gn_grad2_coeffs(s, r, inv_m, dmo, dro);
  T* ddy = static_cast<T*>(a.ddy);
  T* dx = static_cast<T*>(a.dx);
  A sdx = 0, shug = 0;
  for (int64_t d = 0; d < D; ++d) {
    const int64_t c = g * D + d, off = chan_base(a.dims, n, c), ps = pos_stride(a.dims);
    const A gam = ld<P, A>(a.gamma, c), bet = ld<P, A>(a.beta, c);
    const A ggam = ld<P, A>(a.gdgamma, c), gbet = ld<P, A>(a.gdbeta, c);
    A hu = 0, hs = 0;
    for (int64_t i = off + threadIdx.x * ps; i < off + S * ps; i += blockDim.x * ps) {
      const A u = to_acc(x[i]) - mu;
      const A z = u * r * gam + bet;
      A vddy, vdx, h;
      gn_grad2_elem(k, r, u, static_cast<A>(to_acc(dy[i])), gn_act_d1<ACT>(z), gn_act_d2<ACT>(z),
                    ld<T, A>(a.gdx, i), gam, ggam, gbet, &vddy, &vdx, &h);
      ddy[i] = from_acc<T>(vddy);
      dx[i] = from_acc<T>(vdx);
      sdx += vdx;
      shug += h * u * gam;
      hu += h * u;
      hs += h;
    }
    const Pair<A> p2 = block_sum<kThreads>(Pair<A>{hu, hs});
    if (threadIdx.x == 0) {
      pg[c] = r * pg[c] + k.e2 * pb[c] + k.e3 * pb[a.dims.C + c] + r * p2.a;
      pb[c] = p2.b;
    }
  }
  const Pair<A> fin = block_sum<kThreads>(Pair<A>{sdx, shug});
  if (threadIdx.x == 0) {
    static_cast<A*>(a.dmean)[ng] = -fin.a;
    static_cast<A*>(a.drstd)[ng] = gn_grad2_drstd(s, r, inv_m, dro, fin.b);
    static_cast<A*>(a.ddmean_o)[ng] = s.Q * inv_m;
    static_cast<A*>(a.ddrstd_o)[ng] = k.e2;
  }
}

// The workspace (AccT): pg (N, C), pb (N, 2C), then the n chunks' partials (param_reduce.cuh).
GN_INLINE int64_t grad2_ws_rows(const GroupNormGrad2Args& a) { return 3 * a.dims.N * a.dims.C; }

// Stage 1 of the reduction over n of pg (dgamma) and pb's first half (dbeta). Grid
// (ceil(C / kParamTile), chunks); block (t, k) sums channels [t*kParamTile, ...) over rows
// [k*chunk_rows, ...).
template <typename T, typename P>
__global__ void __launch_bounds__(kParamThreads)
grad2_param_kernel(GroupNormGrad2Args a, int64_t chunk_rows) {
  using A = AccT<T>;
  A* ws = static_cast<A*>(a.workspace);
  const int64_t N = a.dims.N, C = a.dims.C;
  const int64_t c = int64_t(blockIdx.x) * kParamTile + threadIdx.x % kParamTile;
  const int64_t n0 = int64_t(blockIdx.y) * chunk_rows;
  const int64_t n1 = n0 + chunk_rows < N ? n0 + chunk_rows : N;
  Pair<A> s{A(0), A(0)};
  if (c < C)
    for (int64_t n = n0 + threadIdx.x / kParamTile; n < n1; n += kParamLanes) {
      s.a += ws[n * C + c];
      s.b += ws[N * C + n * 2 * C + c];
    }
  s = param_lane_sum(s);
  if (threadIdx.x < kParamTile && c < C)
    param_store<A, P>(s.a, s.b, c, C, blockIdx.y, gridDim.y, ws + grad2_ws_rows(a),
                      static_cast<P*>(a.dgamma), static_cast<P*>(a.dbeta));
}

template <typename T, typename P>
const char* grad2_typed(const GroupNormGrad2Args& a, cudaStream_t st) {
  const int64_t NG = a.dims.N * a.dims.G;
  if (NG > 2147483647) return "too many groups (N * num_groups >= 2^31)";
  dispatch_act(a.act, [&](auto act) {
    constexpr Act ACT = decltype(act)::value;
    grad2_group_kernel<T, P, ACT><<<static_cast<unsigned>(NG), kThreads, 0, st>>>(a);
  });
  GN_CUDA_CHECK_LAUNCH();
  int64_t chunks = 1;
  const int64_t rows = param_chunks(a.dims.N, kParamMinRows, &chunks);
  const dim3 grid(static_cast<unsigned>(ceil_div(a.dims.C, kParamTile)),
                  static_cast<unsigned>(chunks));
  grad2_param_kernel<T, P><<<grid, kParamThreads, 0, st>>>(a, rows);
  GN_CUDA_CHECK_LAUNCH();
  using A = AccT<T>;
  return launch_param_finalize(static_cast<const A*>(a.workspace) + grad2_ws_rows(a), chunks,
                                     a.dims.C, static_cast<P*>(a.dgamma),
                                     static_cast<P*>(a.dbeta), st);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) moments_grad2_kernel(MomentsGrad2Args a) {
  using A = AccT<T>;
  const int64_t ng = blockIdx.x, D = a.dims.C / a.dims.G, M = D * a.dims.S;
  const T* x = static_cast<const T*>(a.x);
  T* dx = static_cast<T*>(a.dx);
  const A inv_m = A(1) / static_cast<A>(M);
  const A mu = static_cast<const A*>(a.mean)[ng];
  const A dvo = ld<A, A>(a.dvar_o, ng);
  A P = 0, Q = 0;
  for (int64_t j = threadIdx.x; j < M; j += blockDim.x) {
    const int64_t i = group_elem(a.dims, ng, j, D);
    const A g = ld<T, A>(a.gdx, i);
    P += g * (to_acc(x[i]) - mu);
    Q += g;
    dx[i] = from_acc<T>(A(2) * dvo * g * inv_m);
  }
  const Pair<A> pq = block_sum<kThreads>(Pair<A>{P, Q});
  if (threadIdx.x == 0) {
    static_cast<A*>(a.ddmean_o)[ng] = pq.b * inv_m;
    static_cast<A*>(a.ddvar_o)[ng] = A(2) * pq.a * inv_m;
    static_cast<A*>(a.dmean)[ng] = -A(2) * dvo * pq.b * inv_m;
  }
}

}  // namespace

const char* moments_grad2_cuda(const MomentsGrad2Args& a, void* stream) {
  if (const char* e = check_group_dims(a.dims)) return e;
  if (!a.x || !a.mean || !a.ddmean_o || !a.ddvar_o || !a.dx || !a.dmean) return "null pointer";
  if (a.dims.N * a.dims.G > 2147483647) return "too many groups (N * num_groups >= 2^31)";
  return dispatch_data(a.dtype, [&](auto t) -> const char* {
    moments_grad2_kernel<decltype(t)><<<static_cast<unsigned>(a.dims.N * a.dims.G), kThreads, 0,
                                        static_cast<cudaStream_t>(stream)>>>(a);
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  });
}

size_t group_norm_grad2_workspace_cuda(const GroupNormGrad2Args& a) {
  int64_t chunks = 1;
  param_chunks(a.dims.N, kParamMinRows, &chunks);
  const int64_t parts = chunks > 1 ? chunks * a.dims.C * kParamPart : 0;
  return static_cast<size_t>(grad2_ws_rows(a) + parts) * dtype_size(acc_dtype(a.dtype));
}

const char* group_norm_grad2_cuda(const GroupNormGrad2Args& a, void* stream) {
  if (const char* e = check_group_dims(a.dims)) return e;
  if (!a.dy || !a.x || !a.gamma || !a.beta || !a.mean || !a.rstd || !a.ddy || !a.ddmean_o ||
      !a.ddrstd_o || !a.dx || !a.dgamma || !a.dbeta || !a.dmean || !a.drstd || !a.workspace)
    return "null pointer";
  return dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    return grad2_typed<decltype(t), decltype(p)>(a, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace gn_mx
