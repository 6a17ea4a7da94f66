/*
 * gpu_ops.cc: see gpu_ops.h. Workspace: one alloc_gpu per callback (lib_api's temp space is a single
 * buffer), sized by the kernels' *_workspace_cuda() for the current device.
 */
#include "gpu_ops.h"

#if defined(GNMX_WITH_CUDA)
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

#else

namespace {
const char* kNoCuda = "gn_mx was built without CUDA (rebuild with GNMX_CUDA=1)";
}  // namespace

const char* moments_gpu(const MomentsArgs&, const OpResource&) { return kNoCuda; }
const char* moments_bwd_gpu(const MomentsBwdArgs&, const OpResource&) { return kNoCuda; }
const char* group_norm_fwd_gpu(const GroupNormFwdArgs&, const OpResource&) { return kNoCuda; }
const char* group_norm_bwd_gpu(GroupNormBwdArgs, const OpResource&) { return kNoCuda; }

#endif

}  // namespace mxa
}  // namespace gn_mx
