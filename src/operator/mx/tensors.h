/*
 * tensors.h: what the adapter knows about lib_api's tensors: dtype numbers (MXNet's MXDType names)
 * and their mapping to the kernels' gn_mx::DType, shapes (unknown dims, conversion), storage types,
 * and the dtype check on incoming head gradients.
 * Related: errors.h (guarded callbacks, fail()), attributes.h (the strict attribute parser),
 * device.h (the device a callback runs on, its workspace, and the one way every op runs a kernel).
 */
#pragma once
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "lib_api.h"
#include "attributes.h"
#include "errors.h"
#include "../common/acc_type.h"
#include "../common/group_shape.h"

namespace gn_mx {
namespace mxa {

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;

using mxnet::ext::kFloat16;
using mxnet::ext::kFloat32;
using mxnet::ext::kFloat64;

// A dtype MXNet has not inferred yet (inferType passes -1).
constexpr int kDtypeUnknown = -1;

// The kernels' DType values are MXNet's, so a float dtype converts with a cast.
static_assert(static_cast<int>(DType::kFloat32) == kFloat32 &&
                  static_cast<int>(DType::kFloat64) == kFloat64 &&
                  static_cast<int>(DType::kFloat16) == kFloat16,
              "gn_mx::DType must equal mxnet::ext::MXDType");

inline bool is_float_dtype(int t) { return t == kFloat32 || t == kFloat64 || t == kFloat16; }

inline const char* mx_dtype_name(int t) {
  switch (t) {
    case kFloat32: return "float32";
    case kFloat64: return "float64";
    case kFloat16: return "float16";
    case mxnet::ext::kUint8: return "uint8";
    case mxnet::ext::kInt32: return "int32";
    case mxnet::ext::kInt8: return "int8";
    case mxnet::ext::kInt64: return "int64";
    case kDtypeUnknown: return "unknown";
  }
  return "unsupported";
}

inline DType to_dtype(int t) { return static_cast<DType>(t); }
inline int mx_dtype(DType t) { return static_cast<int>(t); }
// The dtype of the statistics a kernel accumulates for data of dtype `t` (float32 for float16).
inline int mx_acc_dtype(int t) { return mx_dtype(acc_dtype(to_dtype(t))); }

inline std::vector<int64_t> to_i64(const std::vector<unsigned int>& s) {
  return std::vector<int64_t>(s.begin(), s.end());
}

// "(2, 30, 8)", "(6,)": a shape as messages print it.
inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  if (s.size() == 1) os << ",";
  os << ")";
  return os.str();
}

// A shape MXNet has not inferred yet: no dims (ndim unknown), or an unknown dim, which arrives as 0
// under legacy shape semantics and as -1 (UINT_MAX after lib_api's unsigned cast) under Gluon's
// numpy-style semantics.
inline bool dim_unknown(unsigned int d) { return d == 0 || d == 0xFFFFFFFFu; }
inline bool shape_unknown(const std::vector<unsigned int>& s) {
  if (s.empty()) return true;
  for (unsigned d : s)
    if (dim_unknown(d)) return true;
  return false;
}

// inferSType of every op: inputs and outputs are dense. MXNet's default (no callback) rejects
// inputs whose storage type is still undefined, which is what Module.bind / simple_bind pass for
// the running statistics (mutable inputs) of gn_dbn / gn_dbn_inference; here undefined inputs
// become dense and a sparse input is a clear error. Used for the backward ops too (any arity).
// `kOp` is the op's name (a namespace-scope char array), so the callback is a plain function.
template <const char* kOp>
MXReturnValue dense_storage(const AttrMap&, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kOp, [&] {
    for (size_t i = 0; i < in->size(); ++i) {
      int& st = (*in)[i];
      if (st == -1) st = mxnet::ext::kDefaultStorage;
      if (st != mxnet::ext::kDefaultStorage)
        fail(kOp, ": input ", i, " is a sparse array (storage type ", st,
             "); gn_mx ops take dense arrays only (use .tostype('default'))");
    }
    for (int& st : *out) st = mxnet::ext::kDefaultStorage;
    return mxnet::ext::MX_SUCCESS;
  });
}

// Head gradients reach a backward unchecked by MXNet: a float32 gradient for a float64 output
// would be read with the wrong element size. `what` names the output.
inline void check_grad_dtype(const char* op, const MXTensor& grad, int expected, const char* what) {
  if (static_cast<int>(grad.dtype) != expected)
    fail(op, ": the gradient of output '", what, "' must be ", mx_dtype_name(expected), "; got ",
         mx_dtype_name(static_cast<int>(grad.dtype)));
}

}  // namespace mxa
}  // namespace gn_mx
