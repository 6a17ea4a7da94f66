/*
 * dispatch_cpu.h: the CPU kernels' entry-point spelling of the one dtype dispatch
 * (../common/dispatch.h). Supported (data, param) pairs: (T, T) for fp16/fp32/fp64 and (fp16, fp32)
 * (fp32 master params); on the host fp16 is `Half`.
 */
#pragma once
#include "../common/dispatch.h"

namespace gn_mx {
namespace cpu {

// Calls f(T{}) for the storage type of `t`; nullptr on success.
template <typename F>
const char* dispatch_data(DType t, F&& f) {
  return gn_mx::dispatch_data(t, f);
}

// Calls Impl<T, P>::run(a) for a's (dtype, param_dtype) pair.
template <template <typename, typename> class Impl, typename Args>
const char* dispatch_data_param(const Args& a) {
  return gn_mx::dispatch_data_param(a.dtype, a.param_dtype, [&](auto t, auto p) {
    Impl<decltype(t), decltype(p)>::run(a);
  });
}

}  // namespace cpu
}  // namespace gn_mx
