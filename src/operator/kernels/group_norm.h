/*
 * group_norm.h: framework-free GroupNorm and group-moments kernels (no MXNet types).
 *
 * Layout (N, C, S) with S = prod(spatial) (S = 1 for 2-D data), G groups of D = C/G channels: every
 * Args struct embeds the one shape type GroupDims (common/group_shape.h), checked by check_group_dims().
 * With dims.channels_last the same tensors are (N, S, C) in memory (the ops' axis = -1): the shapes
 * written (N, C, S) below are then (N, S, C); statistics, parameters and formulas do not change.
 *   mean[n,g] = 1/(D*S) sum_{c in g, s} x[n,c,s]
 *   var[n,g]  = 1/(D*S) sum (x - mean)^2                      (population variance)
 *   rstd[n,g] = 1 / sqrt(var + eps)
 *   y[n,c,s]  = act((x - mean) * rstd * gamma[c] + beta[c])   (per-channel affine, optional fused
 *               activation act = identity | relu | silu(z) = z * sigmoid(z); mean/rstd stay the
 *               normalization statistics; backward recomputes the pre-activation from x, mean,
 *               rstd, gamma, beta, so nothing extra is saved)
 * Statistics are AccT (fp32 for fp16/fp32 data, fp64 for fp64 data). gamma/beta/dgamma/dbeta have
 * `param_dtype`, which is either the data dtype or fp32 (fp32 master parameters with fp16 data).
 *
 * Every entry point returns nullptr on success or a static error string. CPU entry points run on the
 * calling thread's OpenMP team; CUDA entry points enqueue on `stream` (a cudaStream_t passed as void*).
 * Each computation has the same shape on both devices: `X_cpu(args)` / `X_cuda(args, stream)`, and,
 * where scratch is needed, `X_workspace_cpu/cuda(args)` bytes passed in `args.workspace`.
 *
 * Numerical guarantees (both devices, forward and backward, every dtype, with or without the
 * activation; docs/numerics.md, checked on both by the one case list python/gn_mx/_edge_cases.py):
 * one-element groups exact (out = act(beta), dx = dmean); 2-4 element groups within float32
 * rounding of the float64 result at any offset; float32 data up to |x| = 3.4e38 normalized (its
 * statistics recomputed instead of overflowing to NaN); NaN/Inf confined to their group. Both get
 * them from the same float64 recomputation of the groups gn_exact_group (group_norm_math.h)
 * selects; gn_moments likewise by gn_exact_moments (2-4 element groups' mean and variance within
 * float32 rounding; |x| ~ 2e38: the right mean, variance inf, beyond float32). gn_moments' backward
 * uses the saved (accumulation-dtype) mean on both devices.
 *
 * CUDA workspace: the forward statistics of a large group are split across several blocks when N*G
 * alone cannot fill the GPU (Stable-Diffusion UNet: N=2, G=32 -> 64 groups on 132 SMs); the blocks'
 * partial Welford states live in the workspace. Its size depends on the current device's SM count
 * (query it on the device that runs the op); it must be 16-byte aligned. With workspace = nullptr
 * the statistics take one block per group (correct, slower for few large groups).
 */
#pragma once
#include <cstddef>
#include <cstdint>

#include "../common/acc_type.h"
#include "../common/group_shape.h"

namespace gn_mx {

// Error strings of these entry points: one wording per rule, the same on both devices, no prefix
// (the adapter adds the op name once). A parameter dtype other than the data dtype (or fp32 with
// fp16 data) gets dispatch.h's kBadParamDtype on both.
constexpr const char* kGnNeedsWorkspace = "backward needs a workspace";
constexpr const char* kGnWorkspaceAlign = "workspace must be 16-byte aligned";
constexpr const char* kGnActNeedsBeta = "backward with an activation needs beta";
// CUDA only: 32-bit offsets inside a group and a 32-bit grid of groups.
constexpr const char* kGnCudaGroupLimit =
    "the CUDA kernels need fewer than 2^31 elements per group (C/num_groups * spatial)";
constexpr const char* kGnCudaGroupsLimit = "the CUDA kernels need N * num_groups < 2^31";

// Fused activation of gn_group_norm (attribute act_type: 'none', 'relu', 'silu').
enum class Act : int { kNone = 0, kRelu = 1, kSilu = 2 };

struct MomentsArgs {
  DType dtype = DType::kFloat32;    // x dtype
  const void* x = nullptr;          // (N, C, S)
  void* mean = nullptr;             // (N, G) AccT
  void* var = nullptr;              // (N, G) AccT, population variance
  void* workspace = nullptr;        // CUDA: moments_workspace_cuda() bytes or nullptr; CPU: unused
  GroupDims dims;                   // (N, C, S) data in G groups of D channels
};

// Gradient of gn_moments: dx = dmean/(D*S) + dvar * 2 (x - mean)/(D*S).
struct MomentsBwdArgs {
  DType dtype = DType::kFloat32;    // x / dx dtype
  const void* dmean = nullptr;      // (N, G) AccT
  const void* dvar = nullptr;       // (N, G) AccT
  const void* x = nullptr;          // (N, C, S)
  const void* mean = nullptr;       // (N, G) AccT, forward output
  void* dx = nullptr;               // (N, C, S)
  GroupDims dims;                   // (N, C, S) data in G groups of D channels
};

struct GroupNormFwdArgs {
  DType dtype = DType::kFloat32;        // x / y dtype
  DType param_dtype = DType::kFloat32;  // gamma / beta dtype
  const void* x = nullptr;              // (N, C, S)
  const void* gamma = nullptr;          // (C,)
  const void* beta = nullptr;           // (C,)
  void* y = nullptr;                    // (N, C, S)
  void* mean = nullptr;                 // (N, G) AccT
  void* rstd = nullptr;                 // (N, G) AccT
  void* workspace = nullptr;            // CUDA: group_norm_fwd_workspace_cuda() bytes or nullptr;
                                        // CPU: unused
  GroupDims dims;                       // (N, C, S) data in G groups of D channels
  double eps = 1e-5;
  Act act = Act::kNone;
};

struct GroupNormBwdArgs {
  DType dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;
  const void* dy = nullptr;             // (N, C, S)
  const void* x = nullptr;              // (N, C, S)
  const void* mean = nullptr;           // (N, G) AccT, saved by forward
  const void* rstd = nullptr;           // (N, G) AccT, saved by forward
  const void* gamma = nullptr;          // (C,)
  const void* beta = nullptr;           // (C,), read only when act != kNone
  void* dx = nullptr;                   // (N, C, S)
  void* dgamma = nullptr;               // (C,) param_dtype
  void* dbeta = nullptr;                // (C,) param_dtype, nullptr = not needed
  // Optional (nullptr = zero) gradients flowing into the mean / rstd outputs, (N, G) AccT:
  // dx += dmean / m - drstd * rstd^3 (x - mean) / m, with m = D*S.
  const void* dmean = nullptr;
  const void* drstd = nullptr;
  void* workspace = nullptr;            // scratch of group_norm_bwd_workspace_*() bytes
  GroupDims dims;                       // (N, C, S) data in G groups of D channels
  double eps = 1e-5;                    // the forward's eps (groups the CPU recomputes exactly)
  Act act = Act::kNone;                 // the forward's activation; dy is the activated output's grad
};

// Scratch bytes the backward needs (0 allowed); the caller passes at least that much, 64-B aligned.
size_t group_norm_bwd_workspace_cpu(const GroupNormBwdArgs& a);

const char* moments_cpu(const MomentsArgs& a);
const char* moments_bwd_cpu(const MomentsBwdArgs& a);
const char* group_norm_fwd_cpu(const GroupNormFwdArgs& a);
const char* group_norm_bwd_cpu(const GroupNormBwdArgs& a);

#if defined(GNMX_WITH_CUDA)
size_t moments_workspace_cuda(const MomentsArgs& a);
size_t group_norm_fwd_workspace_cuda(const GroupNormFwdArgs& a);
size_t group_norm_bwd_workspace_cuda(const GroupNormBwdArgs& a);
const char* moments_cuda(const MomentsArgs& a, void* stream);
const char* moments_bwd_cuda(const MomentsBwdArgs& a, void* stream);
const char* group_norm_fwd_cuda(const GroupNormFwdArgs& a, void* stream);
const char* group_norm_bwd_cuda(const GroupNormBwdArgs& a, void* stream);
#endif

}  // namespace gn_mx
