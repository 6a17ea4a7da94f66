/*
 * gpu_ops.cc: see gpu_ops.h. Workspace: one alloc_gpu per callback (lib_api's temp space is a single
 * buffer), sized by the kernels' *_workspace_cuda() for the current device.
 */
#include "gpu_ops.h"

#if defined(GNMX_WITH_CUDA)
#include "../kernels/cuda_util.h"
#include "../kernels/group_norm_cuda.h"
#endif

namespace gn_mx {
namespace mxa {

#if defined(GNMX_WITH_CUDA)

namespace {
void* gpu_workspace(size_t bytes, const OpResource& res, const char* op, Workspace* ws) {
  const size_t off = ws->reserve(bytes);
  ws->commit(res, true, op);
  return ws->at(off);
}

// The CUDA group-size limit, checked before any workspace or launch.
const char* dbn_cuda_limit(int64_t C, int64_t G) {
  return G > 0 ? dbn_group_size_error(C / G, kDbnMaxGroupSizeCuda, "gpu") : nullptr;
}
}  // namespace

const char* moments_gpu(const MomentsArgs& a, const OpResource& res) {
  Workspace ws;
  void* w = gpu_workspace(moments_workspace_cuda(a), res, "gn_moments", &ws);
  return moments_cuda(a, w, res.get_cuda_stream());
}

const char* moments_bwd_gpu(const MomentsBwdArgs& a, const OpResource& res) {
  return moments_bwd_cuda(a, res.get_cuda_stream());
}

const char* group_norm_fwd_gpu(const GroupNormFwdArgs& a, const OpResource& res) {
  Workspace ws;
  void* w = gpu_workspace(group_norm_fwd_workspace_cuda(a), res, "gn_group_norm", &ws);
  return group_norm_fwd_cuda(a, w, res.get_cuda_stream());
}

const char* group_norm_bwd_gpu(GroupNormBwdArgs a, const OpResource& res) {
  Workspace ws;
  a.workspace = gpu_workspace(group_norm_bwd_workspace_cuda(a), res, "gn_group_norm", &ws);
  return group_norm_bwd_cuda(a, res.get_cuda_stream());
}

static const char* zero_gpu(MXTensor* t, const OpResource& res) {
  if (t == nullptr || t->data_ptr == nullptr || t->size() <= 0) return nullptr;
  return zero_cuda(t->data_ptr, static_cast<size_t>(t->size()) * dtype_size(to_dtype(t->dtype)),
                   res.get_cuda_stream());
}

const char* dbn_fwd_gpu(DbnFwdArgs a, const OpResource& res) {
  if (const char* e = dbn_cuda_limit(a.C, a.G)) return e;
  Workspace ws;
  a.workspace = gpu_workspace(dbn_fwd_workspace_cuda(a), res, "gn_dbn", &ws);
  return dbn_fwd_cuda(a, res.get_cuda_stream());
}

const char* dbn_bwd_gpu(DbnBwdArgs a, const OpResource& res, MXTensor* zero1, MXTensor* zero2) {
  if (const char* e = dbn_cuda_limit(a.C, a.G)) return e;
  Workspace ws;
  a.workspace = gpu_workspace(dbn_bwd_workspace_cuda(a), res, "gn_dbn", &ws);
  if (const char* e = dbn_bwd_cuda(a, res.get_cuda_stream())) return e;
  if (const char* e = zero_gpu(zero1, res)) return e;
  return zero_gpu(zero2, res);
}

const char* dbn_inference_gpu(DbnInferenceArgs a, bool backward, const OpResource& res,
                              MXTensor* zero1, MXTensor* zero2) {
  if (const char* e = dbn_cuda_limit(a.C, a.G)) return e;
  Workspace ws;
  a.workspace = gpu_workspace(dbn_inference_workspace_cuda(a), res, "gn_dbn_inference", &ws);
  const char* e = backward ? dbn_inference_bwd_cuda(a, res.get_cuda_stream())
                           : dbn_inference_cuda(a, res.get_cuda_stream());
  if (e) return e;
  if (const char* z = zero_gpu(zero1, res)) return z;
  return zero_gpu(zero2, res);
}

const char* affine_fwd_gpu(const AffineArgs& a, const OpResource& res) {
  return affine_fwd_cuda(a, res.get_cuda_stream());
}

const char* affine_bwd_gpu(const AffineBwdArgs& a, const OpResource& res) {
  return affine_bwd_cuda(a, res.get_cuda_stream());
}

#else

namespace {
const char* kNoCuda = "gn_mx was built without CUDA (rebuild with GNMX_CUDA=1)";
}  // namespace

const char* moments_gpu(const MomentsArgs&, const OpResource&) { return kNoCuda; }
const char* moments_bwd_gpu(const MomentsBwdArgs&, const OpResource&) { return kNoCuda; }
const char* group_norm_fwd_gpu(const GroupNormFwdArgs&, const OpResource&) { return kNoCuda; }
const char* group_norm_bwd_gpu(GroupNormBwdArgs, const OpResource&) { return kNoCuda; }
const char* affine_fwd_gpu(const AffineArgs&, const OpResource&) { return kNoCuda; }
const char* affine_bwd_gpu(const AffineBwdArgs&, const OpResource&) { return kNoCuda; }
const char* dbn_fwd_gpu(DbnFwdArgs, const OpResource&) { return kNoCuda; }
const char* dbn_bwd_gpu(DbnBwdArgs, const OpResource&, MXTensor*, MXTensor*) { return kNoCuda; }
const char* dbn_inference_gpu(DbnInferenceArgs, bool, const OpResource&, MXTensor*, MXTensor*) {
  return kNoCuda;
}

#endif

}  // namespace mxa
}  // namespace gn_mx
