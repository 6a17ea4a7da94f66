/*
 * group_norm_grad2.h: framework-free double backward of gn_group_norm (no MXNet types).
 *
 * The first-order backward (group_norm.h, GroupNormBwdArgs) is a function of nine inputs
 *   f(dy, dmean_o, drstd_o, x, gamma, beta, out, mu, r) = (dx, dgamma, dbeta)
 * with mu = mean, r = rstd taken as given inputs (the forward's outputs). This kernel computes the
 * vector-Jacobian product of f: given the gradients Gx, Ggamma, Gbeta arriving at (dx, dgamma,
 * dbeta), the gradient of L = <Gx, dx> + <Ggamma, dgamma> + <Gbeta, dbeta> with respect to each of
 * the nine inputs, holding the other eight fixed. Composed with gn_group_norm's own backward (which
 * carries the mu/r gradients back into x through the forward's mean/rstd outputs) this is the
 * exact second derivative.
 *
 * Per group (n, g) with m = D*S, u = x - mu, z = u r gamma_c + beta_c, g = dy act'(z)
 * (first order: dx = r gamma_c g + c2 u + c3, c2 = -(A + drstd_o) r^3/m, c3 = (dmean_o - B r)/m,
 * A = sum gamma_c g u, B = sum gamma_c g, dgamma_c = sum_n,s g u r, dbeta_c = sum_n,s g):
 *   P = sum Gx u,  Q = sum Gx,  e2 = -P r^3/m,  e3 = -Q r/m
 *   Lg   = gamma_c (r Gx + e2 u + e3) + r Ggamma_c u + Gbeta_c       (dL/dg, per element)
 *   h    = Lg dy act''(z)                                             (0 for none / relu)
 *   d dy       = Lg act'(z)
 *   d dmean_o  = Q/m,   d drstd_o = e2
 *   d x        = c2 Gx + g (e2 gamma_c + r Ggamma_c) + h r gamma_c
 *   d mu       = -sum d x   (everything depends on mu through u)
 *   d r        = sum_c gamma_c sum_s Gx g - 3 (A + drstd_o) r^2 P/m - B Q/m
 *                + sum_c Ggamma_c sum_s g u + sum h u gamma_c
 *   d gamma_c  = sum_n [ r sum_s Gx g + e2 sum_s g u + e3 sum_s g + r sum_s h u ]
 *   d beta_c   = sum_n sum_s h
 *   d out      = 0      (the backward never reads out)
 * act''(z): relu 0 (almost everywhere), silu s (1 - s) (2 + z (1 - 2 s)), s = sigmoid(z).
 *
 * Limit: groups of at most 4 elements (and fp32 groups whose statistics overflow) are recomputed
 * from x by the first-order backward on either device (gn_exact_group, group_norm_math.h), so there the first-order
 * op reads mu/r from x, not from its inputs; the composed second derivative is still the same
 * (the values agree), only the split between the x and mu/r partials differs.
 *
 * Types: data-shaped tensors in `dtype`, gamma/beta and their gradients in `param_dtype`, (N, G)
 * statistics and their gradients in AccT (fp32 for fp16/fp32 data, fp64 for fp64); math in AccT.
 * Null incoming gradients (gdx, gdgamma, gdbeta) count as zeros. Entry points return nullptr or a
 * static error string; `workspace` holds grad2_workspace_*() bytes (64-B aligned).
 */
#pragma once
#include <cstddef>
#include <cstdint>

#include "group_norm.h"

namespace gn_mx {

struct GroupNormGrad2Args {
  DType dtype = DType::kFloat32;        // dy / x / gdx / ddy / dx dtype
  DType param_dtype = DType::kFloat32;  // gamma / beta / gdgamma / gdbeta / dgamma / dbeta dtype
  // inputs of the first-order backward
  const void* dy = nullptr;       // (N, C, S)
  const void* dmean_o = nullptr;  // (N, G) AccT, nullptr = 0
  const void* drstd_o = nullptr;  // (N, G) AccT, nullptr = 0
  const void* x = nullptr;        // (N, C, S)
  const void* gamma = nullptr;    // (C,)
  const void* beta = nullptr;     // (C,)
  const void* mean = nullptr;     // (N, G) AccT
  const void* rstd = nullptr;     // (N, G) AccT
  // gradients arriving at its outputs (nullptr = 0)
  const void* gdx = nullptr;      // (N, C, S)
  const void* gdgamma = nullptr;  // (C,)
  const void* gdbeta = nullptr;   // (C,)
  // results: gradients into each input
  void* ddy = nullptr;            // (N, C, S)
  void* ddmean_o = nullptr;       // (N, G) AccT
  void* ddrstd_o = nullptr;       // (N, G) AccT
  void* dx = nullptr;             // (N, C, S)
  void* dgamma = nullptr;         // (C,)
  void* dbeta = nullptr;          // (C,)
  void* dmean = nullptr;          // (N, G) AccT
  void* drstd = nullptr;          // (N, G) AccT
  void* workspace = nullptr;
  GroupDims dims;  // group_shape.h
  Act act = Act::kNone;
};

// Double backward of gn_moments. Its first-order backward, as a function of its five inputs
// f(dmean_o, dvar_o, x, mu, var) = dx = dmean_o/m + 2 dvar_o (x - mu)/m, has the vector-Jacobian
// product, for an incoming gradient Gx of dx (per group: Q = sum Gx, P = sum Gx (x - mu)):
//   d dmean_o = Q/m,  d dvar_o = 2P/m,  d x = 2 dvar_o Gx/m,  d mu = -2 dvar_o Q/m,  d var = 0.
struct MomentsGrad2Args {
  DType dtype = DType::kFloat32;  // x / gdx / dx dtype
  const void* dmean_o = nullptr;  // (N, G) AccT
  const void* dvar_o = nullptr;   // (N, G) AccT
  const void* x = nullptr;        // (N, C, S)
  const void* mean = nullptr;     // (N, G) AccT
  const void* gdx = nullptr;      // (N, C, S), nullptr = 0
  void* ddmean_o = nullptr;       // (N, G) AccT
  void* ddvar_o = nullptr;        // (N, G) AccT
  void* dx = nullptr;             // (N, C, S)
  void* dmean = nullptr;          // (N, G) AccT
  GroupDims dims;  // group_shape.h
};

size_t group_norm_grad2_workspace_cpu(const GroupNormGrad2Args& a);
const char* group_norm_grad2_cpu(const GroupNormGrad2Args& a);
const char* moments_grad2_cpu(const MomentsGrad2Args& a);
#if defined(GNMX_WITH_CUDA)
const char* moments_grad2_cuda(const MomentsGrad2Args& a, void* stream);
size_t group_norm_grad2_workspace_cuda(const GroupNormGrad2Args& a);
const char* group_norm_grad2_cuda(const GroupNormGrad2Args& a, void* stream);
#endif

}  // namespace gn_mx
