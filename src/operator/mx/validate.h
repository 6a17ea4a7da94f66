/*
 * validate.h: the checks several ops share, so each message exists once.
 *
 * - data_groups(): the (N, C, *spatial) data shape against num_groups (group_shape.h's rules).
 * - check_float_data(): data dtype float16/float32/float64.
 * - The (data, gamma (C,), beta (C,)) parameter rules of gn_group_norm and gn_channel_affine:
 *   gamma/beta in the data dtype, or float32 with float16 data (multi-precision); unknown dtypes and
 *   shapes filled in from data (Gluon's deferred initialization); tensors re-checked at run time.
 * Shape and type inference run these, so a bad call fails at the call site; forward/backward
 * re-check only what they index with.
 */
#pragma once
#include <string>
#include <vector>

#include "tensors.h"

namespace gn_mx {
namespace mxa {

// The (N, C, *spatial) data shape in `G` groups; throws the op's message (group_shape.h's wording,
// then the data shape) when the rank is below 2 or check_group_dims() rejects it.
inline GroupDims data_groups(const char* op, const std::vector<int64_t>& shape, int64_t G) {
  if (shape.size() < 2)
    fail(op, ": data must have at least 2 dims (N, C, *spatial); got shape ", shape_str(shape));
  int64_t S = 1;
  for (size_t i = 2; i < shape.size(); ++i) S *= shape[i];
  const GroupDims d = group_dims(shape[0], shape[1], G, S);
  if (const char* e = check_group_dims(d)) fail(op, ": ", e, "; data shape ", shape_str(shape));
  return d;
}

inline void check_float_data(const char* op, int t) {
  if (t != kDtypeUnknown && !is_float_dtype(t))
    fail(op, ": data must be float16, float32 or float64; got ", mx_dtype_name(t));
}

// Positions of (data, gamma, beta) among the inputs of the ops with per-channel parameters.
enum AffineIn { kAffData = 0, kAffGamma, kAffBeta, kAffNumIn };

inline const char* affine_input_name(int i) {
  return i == kAffData ? "data" : i == kAffGamma ? "gamma" : "beta";
}

// Checks the dtypes, defaults unknown parameter dtypes to the data dtype and returns the data dtype
// (kDtypeUnknown while unknown).
inline int infer_affine_param_types(const char* op, std::vector<int>* in) {
  const int t = (*in)[kAffData];
  check_float_data(op, t);
  for (int i : {kAffGamma, kAffBeta}) {
    const int pt = (*in)[i];
    if (pt == kDtypeUnknown) continue;
    const char* name = affine_input_name(i);
    if (!is_float_dtype(pt)) fail(op, ": ", name, " must be a float type; got ", mx_dtype_name(pt));
    if (t != kDtypeUnknown && pt != t && !(t == kFloat16 && pt == kFloat32))
      fail(op, ": ", name, " dtype must equal the data dtype (or be float32 with float16 data); got ",
           name, " ", mx_dtype_name(pt), " with data ", mx_dtype_name(t));
  }
  if (t == kDtypeUnknown) return t;
  if ((*in)[kAffGamma] == kDtypeUnknown) (*in)[kAffGamma] = t;
  if ((*in)[kAffBeta] == kDtypeUnknown) (*in)[kAffBeta] = t;
  if ((*in)[kAffGamma] != (*in)[kAffBeta])
    fail(op, ": gamma and beta must have the same dtype; got ", mx_dtype_name((*in)[kAffGamma]),
         " and ", mx_dtype_name((*in)[kAffBeta]));
  return t;
}

// Fills unknown gamma/beta shapes with (C,) from data (deferred init) and checks known ones.
inline void infer_affine_param_shapes(const char* op, std::vector<std::vector<unsigned>>* in,
                                      const GroupDims& gs) {
  const std::vector<unsigned> cshape = {static_cast<unsigned>(gs.C)};
  for (int i : {kAffGamma, kAffBeta}) {
    auto& s = (*in)[i];
    if (shape_unknown(s)) {
      s = cshape;
    } else if (s != cshape) {
      fail(op, ": ", affine_input_name(i), " must have shape (", gs.C, ",) for data shape ",
           shape_str(to_i64((*in)[kAffData])), "; got ", shape_str(to_i64(s)));
    }
  }
}

// Run-time check of a gamma/beta tensor against the data's channels.
inline void check_param_tensor(const char* op, const MXTensor& t, const GroupDims& gs, int i) {
  if (t.shape.size() != 1 || t.shape[0] != gs.C)
    fail(op, ": ", affine_input_name(i), " must have shape (", gs.C, ",); got ", shape_str(t.shape));
}

}  // namespace mxa
}  // namespace gn_mx
