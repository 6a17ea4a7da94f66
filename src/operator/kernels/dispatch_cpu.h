/*
 * dispatch_cpu.h: dtype dispatch shared by the CPU kernels' entry points.
 * Supported (data, param) pairs: (T, T) for fp16/fp32/fp64 and (fp16, fp32) (fp32 master params).
 */
#pragma once
#include "../common/acc_type.h"

namespace gn_mx {
namespace cpu {

// Calls f(T{}) for the storage type of `t`; nullptr on success.
template <typename F>
const char* dispatch_data(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(float{}); return nullptr;
    case DType::kFloat64: f(double{}); return nullptr;
    case DType::kFloat16: f(Half{}); return nullptr;
  }
  return "unsupported data dtype";
}

// Calls Impl<T, P>::run(a) for a's (dtype, param_dtype) pair.
template <template <typename, typename> class Impl, typename Args>
const char* dispatch_data_param(const Args& a) {
  if (a.param_dtype == a.dtype) {
    return dispatch_data(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      Impl<T, T>::run(a);
    });
  }
  if (a.dtype == DType::kFloat16 && a.param_dtype == DType::kFloat32) {
    Impl<Half, float>::run(a);
    return nullptr;
  }
  return "parameter dtype must equal the data dtype (or be float32 with float16 data)";
}

}  // namespace cpu
}  // namespace gn_mx
