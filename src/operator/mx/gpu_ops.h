/*
 * gpu_ops.h: "gpu" FCompute bodies for the lib_api adapter (host-compiled: no CUDA headers).
 * Each takes the kernel args filled exactly as for the CPU twin, adds MXNet's CUDA stream
 * (OpResource::get_cuda_stream(), a void* under g++) and one alloc_gpu workspace, and returns the
 * kernel's error string (nullptr on success). In a build without CUDA no "gpu" context is registered,
 * so these are never called; they then return an error instead of launching anything.
 */
#pragma once
#include "tensor_view.h"
#include "../kernels/affine.h"
#include "../kernels/dbn.h"
#include "../kernels/group_norm.h"

namespace gn_mx {
namespace mxa {

inline bool on_gpu(const MXTensor& t) { return t.ctx.dev_type == "gpu"; }

// fail()s with "<op>: <err>" when err is set; MX_SUCCESS otherwise.
inline MXReturnValue gpu_result(const char* op, const char* err) {
  if (err) fail(op, ": ", err);
  return mxnet::ext::MX_SUCCESS;
}

const char* moments_gpu(const MomentsArgs& a, const OpResource& res);
const char* moments_bwd_gpu(const MomentsBwdArgs& a, const OpResource& res);
const char* group_norm_fwd_gpu(const GroupNormFwdArgs& a, const OpResource& res);
const char* group_norm_bwd_gpu(GroupNormBwdArgs a, const OpResource& res);

const char* affine_fwd_gpu(const AffineArgs& a, const OpResource& res);
const char* affine_bwd_gpu(const AffineBwdArgs& a, const OpResource& res);

// DBN. The backward ones also zero the aux-state gradients `zero1`, `zero2` (may be null).
const char* dbn_fwd_gpu(DbnFwdArgs a, const OpResource& res);
const char* dbn_bwd_gpu(DbnBwdArgs a, const OpResource& res, MXTensor* zero1, MXTensor* zero2);
const char* dbn_inference_gpu(DbnInferenceArgs a, bool backward, const OpResource& res,
                              MXTensor* zero1 = nullptr, MXTensor* zero2 = nullptr);

}  // namespace mxa
}  // namespace gn_mx
