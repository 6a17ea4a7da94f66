/*
 * cuda_util.h: small CUDA helpers for the host-compiled adapter (which includes no CUDA headers).
 */
#pragma once
#include <cstddef>

namespace gn_mx {

#if defined(GNMX_WITH_CUDA)
// cudaMemsetAsync(p, 0, bytes) on `stream` (a cudaStream_t as void*); nullptr or the error string.
const char* zero_cuda(void* p, size_t bytes, void* stream);
#endif

}  // namespace gn_mx
