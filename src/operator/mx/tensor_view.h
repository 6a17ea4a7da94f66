/*
 * tensor_view.h: the thin layer between lib_api.h and the framework-free kernels.
 *
 * - errors.h: guarded() (every lib_api callback runs inside it: exception -> one MXNetError message,
 *   lib_api's error list emptied per call), OpError, fail(), require().
 * - attributes.h: Attrs, the strict attribute parser of all ops; eps checks against dtypes.
 * - dtype mapping between MXDType and gn_mx::DType, shape conversion.
 * - Workspace: one alloc_cpu/alloc_gpu per callback (a second allocation may alias the first),
 *   carved into 64-byte aligned slices.
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

// MXDType values 0/1/2 are float32/float64/float16 and equal gn_mx::DType.
inline bool is_float_dtype(int t) { return t == 0 || t == 1 || t == 2; }

inline const char* mx_dtype_name(int t) {
  switch (t) {
    case 0: return "float32";
    case 1: return "float64";
    case 2: return "float16";
    case 3: return "uint8";
    case 4: return "int32";
    case 5: return "int8";
    case 6: return "int64";
    case -1: return "unknown";
  }
  return "unsupported";
}

inline DType to_dtype(int t) { return static_cast<DType>(t); }

inline std::vector<int64_t> to_i64(const std::vector<unsigned int>& s) {
  return std::vector<int64_t>(s.begin(), s.end());
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

// One workspace allocation carved into aligned slices. Sizes are summed first (reserve), then the
// buffer is allocated once (commit) and handed out in the same order (take).
class Workspace {
 public:
  static constexpr size_t kAlign = 64;
  size_t reserve(size_t bytes) {
    const size_t off = total_;
    total_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return off;
  }
  size_t total() const { return total_; }
  // Allocates through MXNet's temp space (cpu or gpu); returns the base pointer (nullptr if empty).
  char* commit(const OpResource& res, bool gpu, const char* op) {
    if (total_ == 0) return nullptr;
    // lib_api sizes are int; ask for the alignment slack too.
    const size_t want = total_ + kAlign;
    if (want > static_cast<size_t>(INT32_MAX))
      fail(op, ": workspace of ", want, " bytes exceeds lib_api's int allocation limit");
    void* p = gpu ? res.alloc_gpu(static_cast<int>(want)) : res.alloc_cpu(static_cast<int>(want));
    if (!p) fail(op, ": could not allocate ", want, " bytes of workspace");
    uintptr_t u = reinterpret_cast<uintptr_t>(p);
    u = (u + kAlign - 1) / kAlign * kAlign;
    base_ = reinterpret_cast<char*>(u);
    return base_;
  }
  void* at(size_t offset) const { return base_ ? base_ + offset : nullptr; }

 private:
  size_t total_ = 0;
  char* base_ = nullptr;
};

// inferSType of every op: inputs and outputs are dense. MXNet's default (no callback) rejects
// inputs whose storage type is still undefined, which is what Module.bind / simple_bind pass for
// the running statistics (mutable inputs) of gn_dbn / gn_dbn_inference; here undefined inputs
// become dense and a sparse input is a clear error. Used for the backward ops too (any arity).
inline MXReturnValue dense_storage(const char* op, std::vector<int>* in, std::vector<int>* out) {
  return guarded(op, [&] {
    for (size_t i = 0; i < in->size(); ++i) {
      int& st = (*in)[i];
      if (st == -1) st = mxnet::ext::kDefaultStorage;
      if (st != mxnet::ext::kDefaultStorage)
        fail(op, ": input ", i, " is a sparse array (storage type ", st,
             "); gn_mx ops take dense arrays only (use .tostype('default'))");
    }
    for (int& st : *out) st = mxnet::ext::kDefaultStorage;
    return mxnet::ext::MX_SUCCESS;
  });
}

inline const char* ctx_of(const MXTensor& t) { return t.ctx.dev_type.c_str(); }

// Head gradients reach a backward unchecked by MXNet: a float32 gradient for a float64 output
// would be read with the wrong element size. `what` names the output.
inline void check_grad_dtype(const char* op, const MXTensor& grad, int expected, const char* what) {
  if (static_cast<int>(grad.dtype) != expected)
    fail(op, ": the gradient of output '", what, "' must be ", mx_dtype_name(expected), "; got ",
         mx_dtype_name(static_cast<int>(grad.dtype)));
}

}  // namespace mxa
}  // namespace gn_mx
