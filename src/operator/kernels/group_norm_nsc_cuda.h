/*
 * group_norm_nsc_cuda.h: the channels-last CUDA kernels (group_norm_nsc_cuda.cu), called by
 * group_norm_cuda.cu's entry points (group_norm.h) for GroupDims::channels_last data. Same Args,
 * same contracts; each needs its *_workspace_cuda() bytes (16-byte aligned) in args.workspace.
 */
#pragma once
#include <cstddef>

#include "group_norm.h"

namespace gn_mx {

size_t nsc_moments_workspace_cuda(const MomentsArgs& a);
size_t nsc_fwd_workspace_cuda(const GroupNormFwdArgs& a);
size_t nsc_bwd_workspace_cuda(const GroupNormBwdArgs& a);
const char* nsc_moments_cuda(const MomentsArgs& a, void* stream);
const char* nsc_moments_bwd_cuda(const MomentsBwdArgs& a, void* stream);
const char* nsc_fwd_cuda(const GroupNormFwdArgs& a, void* stream);
const char* nsc_bwd_cuda(const GroupNormBwdArgs& a, void* stream);

}  // namespace gn_mx
