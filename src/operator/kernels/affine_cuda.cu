/*
 * affine_cuda.cu: CUDA per-channel affine (see affine.h), twin of affine_cpu.cc.
 * Forward: a grid-stride loop over all elements, channel = (i / S) % C.
 * Backward: one block per channel; the block walks the channel's N rows of S elements, writes dx and
 * reduces sum dy*x / sum dy in AccT (warp shuffles, then shared memory), so dgamma/dbeta need no
 * workspace and no atomics.
 */
#include <cuda_runtime.h>

#include "affine.h"
#include "cuda_common.cuh"
#include "../common/dispatch.h"

namespace gn_mx {
namespace {

constexpr int kMaxBwdThreads = 512;  // backward block size for S >= 512

template <typename T, typename P>
__global__ void affine_fwd_kernel(const T* __restrict__ x, const P* __restrict__ gamma,
                                  const P* __restrict__ beta, T* __restrict__ y, int64_t total,
                                  int64_t C, int64_t S) {
  using A = AccT<T>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (i / S) % C;
    y[i] = from_acc<T>(to_acc(x[i]) * static_cast<A>(to_acc(gamma[c])) +
                       static_cast<A>(to_acc(beta[c])));
  }
}

template <typename T, typename P>
__global__ void affine_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                  const P* __restrict__ gamma, T* __restrict__ dx,
                                  P* __restrict__ dgamma, P* __restrict__ dbeta, int64_t N,
                                  int64_t C, int64_t S) {
  using A = AccT<T>;
  const int64_t c = blockIdx.x;
  const A g = static_cast<A>(to_acc(gamma[c]));
  A sg = 0, sb = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t off = (n * C + c) * S;
    for (int64_t s = threadIdx.x; s < S; s += blockDim.x) {
      const A go = to_acc(dy[off + s]);
      sg += go * to_acc(x[off + s]);
      sb += go;
      dx[off + s] = from_acc<T>(go * g);
    }
  }
  const Pair<A> sums = block_sum<kMaxBwdThreads>(Pair<A>{sg, sb});
  if (threadIdx.x == 0) {
    if (dgamma) dgamma[c] = from_acc<P>(sums.a);
    if (dbeta) dbeta[c] = from_acc<P>(sums.b);
  }
}

template <typename T, typename P>
const char* fwd_typed(const AffineArgs& a, cudaStream_t stream) {
  const int64_t total = a.dims.N * a.dims.C * a.dims.S;
  const int threads = 256;
  const int64_t blocks = ceil_div(total, threads);
  affine_fwd_kernel<T, P><<<static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8),
                              threads, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const P*>(a.gamma),
      static_cast<const P*>(a.beta), static_cast<T*>(a.y), total, a.dims.C, a.dims.S);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T, typename P>
const char* bwd_typed(const AffineBwdArgs& a, cudaStream_t stream) {
  const int threads = a.dims.S >= kMaxBwdThreads ? kMaxBwdThreads : (a.dims.S >= 128 ? 128 : 32);
  affine_bwd_kernel<T, P><<<static_cast<unsigned>(a.dims.C), threads, 0, stream>>>(
      static_cast<const T*>(a.dy), static_cast<const T*>(a.x), static_cast<const P*>(a.gamma),
      static_cast<T*>(a.dx), static_cast<P*>(a.dgamma), static_cast<P*>(a.dbeta), a.dims.N, a.dims.C,
      a.dims.S);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
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

const char* affine_bwd_cuda(const AffineBwdArgs& a, void* stream) {
  return dispatch(a, [&](auto t, auto p) {
    return bwd_typed<decltype(t), decltype(p)>(a, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace gn_mx
