// Reference kernels for the simulated-GPU benchmark (benchmarks/gpusim/bench_gpusim.py): built into
// the GPGPU-Sim harness only (tests/gpu/sim/gpgpusim.sh adds this file to the harness sources).
//   gnh_sim_copy: a float4 grid-stride copy of `bytes` (a multiple of 16), 8 blocks of 256 threads
//                 per SM: the bandwidth yardstick of the memory-bound rows;
//   gnh_sim_fma:  independent FMA chains in registers (no memory traffic but one store per
//                 thread): the simulated FMA peak for the DBN / IterNorm products.
#include <cuda_runtime.h>

#include <cstdint>

#define GNH_SIM_API extern "C" __attribute__((visibility("default")))

namespace {

__global__ void sim_copy_kernel(float4* __restrict__ dst, const float4* __restrict__ src,
                                int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = src[i];
}

constexpr int kChains = 8;  // independent FMA chains per thread (hide the FMA latency)

template <typename T>
__global__ void sim_fma_kernel(T* __restrict__ out, int iters) {
  T a[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) a[c] = T(threadIdx.x + c);
  const T b = T(0.999), d = T(1e-3);
  for (int k = 0; k < iters; ++k) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) a[c] = fma(a[c], b, d);
  }
  T s = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) s += a[c];
  out[int64_t(blockIdx.x) * blockDim.x + threadIdx.x] = s;
}

const char* result(cudaError_t e) {
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace

GNH_SIM_API const char* gnh_sim_copy(void* dst, const void* src, size_t bytes) {
  int sms = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (e != cudaSuccess) return result(e);
  sim_copy_kernel<<<8 * sms, 256>>>(static_cast<float4*>(dst), static_cast<const float4*>(src),
                                     int64_t(bytes / 16));
  return result(cudaGetLastError());
}

// FLOPs done: 2 * kChains * iters * blocks * 256 (out holds blocks * 256 elements of the dtype).
GNH_SIM_API const char* gnh_sim_fma(int fp64, void* out, int blocks, int iters) {
  if (fp64)
    sim_fma_kernel<double><<<blocks, 256>>>(static_cast<double*>(out), iters);
  else
    sim_fma_kernel<float><<<blocks, 256>>>(static_cast<float*>(out), iters);
  return result(cudaGetLastError());
}

GNH_SIM_API int gnh_sim_fma_chains() { return kChains; }
