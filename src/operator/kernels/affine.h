/*
 * affine.h: framework-free per-channel affine, y[n,c,s] = x[n,c,s] * gamma[c] + beta[c].
 *
 * DecorrelatedBatchNorm applies its learnable gamma/beta after the whitening ops with this kernel:
 * one read of x and one write of y, AccT arithmetic, and gamma/beta either in the data dtype or fp32
 * with fp16 data (multi-precision), so no broadcast ops and no dtype casts appear in the graph.
 *
 * Backward: dx = dy * gamma[c], dgamma[c] = sum_{n,s} dy * x, dbeta[c] = sum_{n,s} dy
 * (dgamma/dbeta in param dtype, accumulated in AccT; either may be nullptr). The CUDA backward takes
 * an optional workspace of affine_bwd_workspace_cuda() bytes (16-byte aligned) for its partial sums
 * over chunks of N; without one it still runs, parallel over channels only.
 */
#pragma once
#include <cstddef>
#include <cstdint>

#include "../common/acc_type.h"
#include "../common/group_shape.h"

namespace gn_mx {

struct AffineArgs {
  DType dtype = DType::kFloat32;        // x / y dtype
  DType param_dtype = DType::kFloat32;  // gamma / beta dtype
  const void* x = nullptr;              // (N, C, S)
  const void* gamma = nullptr;          // (C,)
  const void* beta = nullptr;           // (C,)
  void* y = nullptr;                    // (N, C, S)
  GroupDims dims;                       // (N, C, S) data; G = 1, D = C (no groups)
};

struct AffineBwdArgs {
  DType dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;
  const void* dy = nullptr;             // (N, C, S)
  const void* x = nullptr;              // (N, C, S)
  const void* gamma = nullptr;          // (C,)
  void* dx = nullptr;                   // (N, C, S)
  void* dgamma = nullptr;               // (C,) or nullptr
  void* dbeta = nullptr;                // (C,) or nullptr
  void* workspace = nullptr;            // CUDA: affine_bwd_workspace_cuda() bytes (or nullptr)
  GroupDims dims;                       // (N, C, S) data; G = 1, D = C (no groups)
};

const char* affine_fwd_cpu(const AffineArgs& a);
const char* affine_bwd_cpu(const AffineBwdArgs& a);

#if defined(GNMX_WITH_CUDA)
const char* affine_fwd_cuda(const AffineArgs& a, void* stream);
size_t affine_bwd_workspace_cuda(const AffineBwdArgs& a);
const char* affine_bwd_cuda(const AffineBwdArgs& a, void* stream);
#endif

}  // namespace gn_mx
