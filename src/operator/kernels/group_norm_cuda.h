/*
 * group_norm_cuda.h: CUDA-only additions to group_norm.h (host-includable, no CUDA headers).
 *
 * The forward statistics of a large group are split across several blocks when N*G alone cannot fill
 * the GPU (Stable-Diffusion UNet: N=2, G=32 -> 64 groups on 132 SMs). The blocks' partial Welford
 * states need scratch, which MomentsArgs / GroupNormFwdArgs do not carry; these overloads take it.
 * The plain entry points in group_norm.h equal these with workspace = nullptr (one block per group:
 * correct, slower for few large groups).
 *
 * Workspace sizes depend on the current device's SM count: query them on the device that runs the op.
 * The workspace must be 16-byte aligned. A size of 0 means none is needed (nullptr is fine).
 */
#pragma once
#include <cstddef>

#include "group_norm.h"

namespace gn_mx {

#if defined(GNMX_WITH_CUDA)
size_t moments_workspace_cuda(const MomentsArgs& a);
const char* moments_cuda(const MomentsArgs& a, void* workspace, void* stream);

size_t group_norm_fwd_workspace_cuda(const GroupNormFwdArgs& a);
const char* group_norm_fwd_cuda(const GroupNormFwdArgs& a, void* workspace, void* stream);
#endif

}  // namespace gn_mx
