/*
 * param_reduce.cu: stage 2 of the two-stage parameter-gradient reduction (param_reduce.cuh): per
 * channel, the sum of the n chunks' partial (sum_g, sum_b) pairs, in a fixed order.
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "param_reduce.cuh"

namespace gn_mx {
namespace {

// Grid ceil(C / kParamTile) blocks of kParamThreads; lane l sums chunks l, l + kParamLanes, ...,
// then param_lane_sum adds the lanes in order.
template <typename A, typename P>
__global__ void __launch_bounds__(kParamThreads)
param_finalize_kernel(const A* __restrict__ part, int64_t chunks, int64_t C,
                      P* __restrict__ dgamma, P* __restrict__ dbeta) {
  const int64_t c = int64_t(blockIdx.x) * kParamTile + threadIdx.x % kParamTile;
  const int lane = threadIdx.x / kParamTile;
  Pair<A> s{A(0), A(0)};
  if (c < C)
    for (int64_t k = lane; k < chunks; k += kParamLanes) {
      s.a += part[(k * C + c) * kParamPart];
      s.b += part[(k * C + c) * kParamPart + 1];
    }
  s = param_lane_sum(s);
  if (lane == 0 && c < C) param_store<A, P>(s.a, s.b, c, C, 0, 1, nullptr, dgamma, dbeta);
}

template <typename A, typename P>
const char* finalize(const A* part, int64_t chunks, int64_t C, P* dgamma, P* dbeta,
                     cudaStream_t st) {
  if (chunks <= 1 || (dgamma == nullptr && dbeta == nullptr)) return nullptr;
  param_finalize_kernel<A, P><<<static_cast<unsigned>(ceil_div(C, kParamTile)), kParamThreads, 0,
                                st>>>(part, chunks, C, dgamma, dbeta);
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

}  // namespace

const char* launch_param_finalize(const float* part, int64_t chunks, int64_t C, float* dgamma,
                                  float* dbeta, cudaStream_t st) {
  return finalize(part, chunks, C, dgamma, dbeta, st);
}
const char* launch_param_finalize(const float* part, int64_t chunks, int64_t C, __half* dgamma,
                                  __half* dbeta, cudaStream_t st) {
  return finalize(part, chunks, C, dgamma, dbeta, st);
}
const char* launch_param_finalize(const double* part, int64_t chunks, int64_t C, double* dgamma,
                                  double* dbeta, cudaStream_t st) {
  return finalize(part, chunks, C, dgamma, dbeta, st);
}

}  // namespace gn_mx
