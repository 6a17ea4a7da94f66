/*
 * dispatch.h: the one dtype dispatch of gn_mx, for host (.cc) and CUDA (.cu) code.
 *
 * dispatch_data(t, f) calls f(T{}) with a tag of t's storage type: float, double, and fp16 as
 * `Half` on the host or `__half` under __CUDACC__ (StorageHalf). dispatch_data_param(t, p, f)
 * calls f(T{}, P{}) for the supported (data, param) pairs: (T, T) for every dtype and
 * (fp16, fp32) (fp32 master parameters). f may return void (success) or const char* (nullptr or an
 * error string); the dispatcher returns nullptr, f's result, or the error string for an
 * unsupported dtype / pair (callers pass their own wording where it differs). Kernel error
 * strings carry no prefix: the adapter adds the op name once.
 */
#pragma once
#include <type_traits>

#include "acc_type.h"

namespace gn_mx {

#if defined(__CUDACC__)
using StorageHalf = __half;
#else
using StorageHalf = Half;
#endif

constexpr const char* kBadDataDtype = "unsupported data dtype";
constexpr const char* kBadParamDtype =
    "parameter dtype must equal the data dtype (or be float32 with float16 data)";

namespace detail {
// f(args...) as a const char*: nullptr when f returns void.
template <typename F, typename... Tags>
inline const char* call_tagged(F&& f, Tags... tags) {
  if constexpr (std::is_void_v<decltype(f(tags...))>) {
    f(tags...);
    return nullptr;
  } else {
    return f(tags...);
  }
}
}  // namespace detail

template <typename F>
inline const char* dispatch_data(DType t, F&& f, const char* bad_dtype = kBadDataDtype) {
  switch (t) {
    case DType::kFloat32: return detail::call_tagged(f, float{});
    case DType::kFloat64: return detail::call_tagged(f, double{});
    case DType::kFloat16: return detail::call_tagged(f, StorageHalf{});
  }
  return bad_dtype;
}

template <typename F>
inline const char* dispatch_data_param(DType data, DType param, F&& f,
                                       const char* bad_pair = kBadParamDtype) {
  if (param == data) {
    return dispatch_data(data, [&](auto tag) { return detail::call_tagged(f, tag, tag); });
  }
  if (data == DType::kFloat16 && param == DType::kFloat32)
    return detail::call_tagged(f, StorageHalf{}, float{});
  return bad_pair;
}

}  // namespace gn_mx
