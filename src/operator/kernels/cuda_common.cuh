/*
 * cuda_common.cuh: host-side helpers shared by the .cu kernels (never included by host-compiled
 * files). sm_count() caches the multiprocessor count per device: launch plans size their grids to
 * fill the GPU once ("waves"), and cudaDeviceGetAttribute is too slow to ask on every launch.
 */
#pragma once
#include <cuda_runtime.h>

namespace gn_mx {

// SM count of the current device into *out; nullptr or the CUDA error string.
inline const char* sm_count(int* out) {
  static int cache[64] = {0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (dev >= 0 && dev < 64 && cache[dev] > 0) {
    *out = cache[dev];
    return nullptr;
  }
  int n = 0;
  e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (n <= 0) n = 1;
  if (dev >= 0 && dev < 64) cache[dev] = n;
  *out = n;
  return nullptr;
}

}  // namespace gn_mx
