/*
 * validate.h: the checks several ops share, so each message exists once.
 *
 * - data_groups(): the (N, C, *spatial) data shape against num_groups (group_shape.h's rules).
 * - check_float_data(): data dtype float16/float32/float64.
 * - The (data, gamma (C,), beta (C,)) parameter rules of gn_group_norm and gn_channel_affine:
 *   gamma/beta in the data dtype, or float32 with float16 data (multi-precision); unknown dtypes and
 *   shapes filled in from data (Gluon's deferred initialization); tensors re-checked at run time.
 * - data_shape_unknown(): the data shape an inferShape starts from; a zero-size array under the
 *   NumPy interface is refused there (see below).
 * - gn_bwd_args(): the checked kernel arguments of a backward on the GroupNorm kernels.
 * Shape and type inference run these, so a bad call fails at the call site; forward/backward
 * re-check only what they index with.
 */
#pragma once
#include <dlfcn.h>

#include <string>
#include <vector>

#include "tensors.h"
#include "../kernels/group_norm.h"

namespace gn_mx {
namespace mxa {

// The data shape in `G` groups, channels on `axis`: 1 (the default: (N, C, *spatial)) or the last
// axis (-1 or ndim - 1: channels-last (N, *spatial, C), GroupDims::channels_last); a negative axis
// counts from the end. Throws the op's message (group_shape.h's wording, then the data shape) when
// the rank is below 2, the axis is neither, or check_group_dims() rejects it.
inline GroupDims data_groups(const char* op, const std::vector<int64_t>& shape, int64_t G,
                             int64_t axis = 1) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (nd < 2)
    fail(op, ": data must have at least 2 dims ", axis == 1 ? "(N, C, *spatial)" : "(N, *spatial, C)",
         "; got shape ", shape_str(shape));
  const int64_t a = axis < 0 ? axis + nd : axis;
  if (a != 1 && a != nd - 1)  // the wording's home: python/gn_mx/_validate.py AXIS_RULE (a test
                              // checks this text against it)
    fail(op, ": axis must be 1 (channels first, (N, C, *spatial)) or the last axis (-1 or ",
         nd - 1, ", channels last, (N, *spatial, C)); got axis=", axis, " for data shape ",
         shape_str(shape));
  const bool last = a != 1;  // nd == 2: the two are the same axis and the same memory
  int64_t S = 1;
  for (int64_t i = last ? 1 : 2; i < (last ? nd - 1 : nd); ++i) S *= shape[i];
  const GroupDims d = group_dims(shape[0], shape[a], G, S, last);
  if (const char* e = check_group_dims(d)) fail(op, ": ", e, "; data shape ", shape_str(shape));
  return d;
}

// Whether MXNet's NumPy shape semantics are on for the calling thread (npx.set_np(), np_shape):
// lib_api passes shapes without saying so, and a 0 dim means "unknown" under the legacy semantics
// but "zero-size" under NumPy's. Asked from libmxnet.so itself (MXIsNumpyShape of its C API, found
// by soname without loading anything); false when that is not found (a renamed libmxnet).
inline bool numpy_shape_semantics() {
  using IsNp = int (*)(int*);
  static const IsNp is_np = [] {
    void* h = dlopen("libmxnet.so", RTLD_LAZY | RTLD_NOLOAD);
    return h ? reinterpret_cast<IsNp>(dlsym(h, "MXIsNumpyShape")) : static_cast<IsNp>(nullptr);
  }();
  int on = 0;
  return is_np != nullptr && is_np(&on) == 0 && on != 0;
}

// An inferShape's data shape: true while MXNet has not inferred it yet (the callback returns and is
// called again). Under NumPy shape semantics a fully known shape with a 0 dim is a zero-size array:
// the ops cannot run on one (lib_api hands them no usable tensor and MXNet would leave the outputs
// shapeless, i.e. a silent shape-() result and an error at the next synchronization), so it is
// refused here, at the call. The gn_mx blocks and gn_mx.ops give an empty batch an empty output
// without calling the op (docs/reference/ops.md).
inline bool data_shape_unknown(const char* op, const std::vector<unsigned int>& ds) {
  if (ds.empty()) return true;
  bool zero = false;
  for (unsigned d : ds) {
    if (d == 0xFFFFFFFFu) return true;  // unknown under NumPy semantics
    zero = zero || d == 0;
  }
  if (!zero) return false;
  if (!numpy_shape_semantics()) return true;  // legacy semantics: 0 = not inferred yet
  fail(op, ": data of shape ", shape_str(to_i64(ds)),
       " is empty; the op needs at least one element per (sample, group). For an empty batch "
       "(N = 0) use the gn_mx blocks or gn_mx.ops.group_norm / dbn_inference, which return an "
       "empty output");
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

// The GroupNormBwdArgs of a backward on the GroupNorm kernels (gn_group_norm's, gn_weight_
// standardize's), whose inputs are [d out, d mean, d rstd, data, gamma, ...] with the forward's mean
// and rstd at in[mean_at], in[mean_at + 1], and whose outputs start [d data, d gamma]: the output
// gradients' dtypes checked (the op's messages). beta / dbeta / eps / act are the caller's.
inline GroupNormBwdArgs gn_bwd_args(const char* op, const std::vector<MXTensor>& in,
                                    const std::vector<MXTensor>& out, int mean_at,
                                    const GroupDims& dims) {
  enum { kdOut = 0, kdMean, kdRstd, kData, kGamma };
  const MXTensor& x = in[kData];
  const int acc = mx_acc_dtype(x.dtype);
  check_grad_dtype(op, in[kdOut], x.dtype, "out");
  check_grad_dtype(op, in[kdMean], acc, "mean");
  check_grad_dtype(op, in[kdRstd], acc, "rstd");
  GroupNormBwdArgs a;
  a.dtype = to_dtype(x.dtype);
  a.param_dtype = to_dtype(in[kGamma].dtype);
  a.dy = in[kdOut].data_ptr;
  a.dmean = in[kdMean].data_ptr;
  a.drstd = in[kdRstd].data_ptr;
  a.x = x.data_ptr;
  a.mean = in[mean_at].data_ptr;
  a.rstd = in[mean_at + 1].data_ptr;
  a.gamma = in[kGamma].data_ptr;
  a.dx = out[0].data_ptr;
  a.dgamma = out[1].data_ptr;
  a.dims = dims;
  return a;
}

}  // namespace mxa
}  // namespace gn_mx
