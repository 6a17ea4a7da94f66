/*
 * cuda_util.cu: see cuda_util.h.
 */
#include <cuda_runtime.h>

#include "cuda_common.cuh"
#include "cuda_util.h"

namespace gn_mx {

const char* zero_cuda(void* p, size_t bytes, void* stream) {
  if (p == nullptr || bytes == 0) return nullptr;
  return cuda_error(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)));
}

}  // namespace gn_mx
