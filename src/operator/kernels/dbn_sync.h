/*
 * dbn_sync.h: the native pieces of synchronized DBN (python/gn_mx/sync.py strings them together):
 * each device's local sums and its local covariance about the global mean, the D x D whitening
 * step from a given covariance, the apply step out = gamma W (x - mu) + beta, each with its
 * backward, and the in-process sum of one float64 tensor across the devices of a key. No MXNet
 * types.
 *
 * Synchronized DBN over P devices (each with m_p = N_p * S columns per group):
 *   round 1: tot = sum_p [sum_cols(X_p) | m_p]                    (gn_dbn_local_sums, gn_sync_sum)
 *            mu = tot[:D] / m, m = tot[D]
 *   round 2: C  = sum_p (X_p - mu 1^T)(X_p - mu 1^T)^T / m         (gn_dbn_local_cov, gn_sync_sum)
 *   W = whitening(C + eps I) (gn_dbn_whiten), Y_p = W (X_p - mu 1^T), out = gamma Y_p + beta
 *   (gn_dbn_apply)
 * Two rounds instead of raw moments keep the exact two-pass covariance (no E[xx^T] - mu mu^T).
 * All of it runs in float64; the backward of each sum is the same sum of the gradients.
 *
 * Whitening step, per group g, from cov = C_g (D x D, row-major, symmetric, eps NOT included):
 *   Sigma = cov + eps I
 *   ZCA:      Sigma = U diag(l) U^T (dbn_eigen_cpu.h), l clamped to >= eps, W = U diag(l^-1/2) U^T;
 *             saved: eigvec = U, eigval = l
 *   IterNorm: W = P_T / sqrt(tr Sigma) (dbn_math.h, float64 iterations); saved: eigvec = Sigma,
 *             eigval = diag(Sigma)
 *   running_proj <- momentum running_proj + (1 - momentum) W, running_mean likewise from `mean`
 * A non-finite cov gives NaN W / eigvec / eigval for that group (as the fused op), never a crash.
 * Backward: dcov = sym(dL/dSigma) from dW through the same D x D math as the fused backward
 * (dbn_bwd_small / dbn_bwd_iternorm with m = 2: their B = (2/m) sym(dL/dSigma)).
 *
 * In-process sum (sync_sum_cpu): every call with the same key adds its n doubles to the key's
 * buffer; when num_devices calls have arrived, each gets the sum (added in arrival order). A key is
 * a barrier with a generation counter: the next round's calls wait until every caller of the
 * current round has copied the sum out. Errors end the round for every caller that arrived and
 * leave the key usable: a call still waiting after `timeout_s` ("timed out ... k of n arrived"),
 * or a call whose num_devices or size differs from the round's first call's.
 */
#pragma once
#include <cstdint>

#include "dbn.h"

namespace gn_mx {

struct DbnWhitenArgs {
  DType stat_dtype = DType::kFloat64;  // running_mean / running_projection dtype
  const double* cov = nullptr;         // (G, D, D), eps not included
  const double* mean = nullptr;        // (G * D,) batch mean (for the running mean only)
  double* W = nullptr;                 // (G, D, D)
  double* eigvec = nullptr;            // (G, D, D) saved for the backward
  double* eigval = nullptr;            // (G, D) saved for the backward
  void* running_mean = nullptr;        // (G * D,) stat_dtype, updated in place
  void* running_proj = nullptr;        // (G, D, D) stat_dtype, updated in place
  int64_t G = 1, D = 1;
  double eps = 1e-5;
  double momentum = 0.9;
  DbnWhitening whitening = DbnWhitening::kZca;
  int iterations = 5;
};

struct DbnWhitenBwdArgs {
  const double* dW = nullptr;      // (G, D, D)
  const double* cov = nullptr;     // (G, D, D), the forward's input
  const double* eigvec = nullptr;  // (G, D, D), the forward's output
  const double* eigval = nullptr;  // (G, D), the forward's output
  double* dcov = nullptr;          // (G, D, D), written in full
  int64_t G = 1, D = 1;
  double eps = 1e-5;
  DbnWhitening whitening = DbnWhitening::kZca;
  int iterations = 5;
};

const char* dbn_whiten_cpu(const DbnWhitenArgs& a);
const char* dbn_whiten_bwd_cpu(const DbnWhitenBwdArgs& a);

struct SyncSumArgs {
  const char* key = "";     // the barrier's name (the caller adds the direction)
  int num_devices = 1;      // callers per round, >= 1
  double timeout_s = 60.0;  // > 0
  const double* in = nullptr;
  double* out = nullptr;    // may alias `in`
  int64_t n = 0;
};

// Apply (gn_dbn_apply), per sample n, group g, position s, with the column xc = x[n, g, :, s] - mu_g
// (float64) and a = gamma dy (the whitening's output gradient):
//   forward   out[n, gD+i, s] = gamma_i (W_g xc)_i + beta_i                       (data dtype)
//   backward  dx = W_g^T a,  dW_g += a xc^T,  dmean_g -= W_g^T a,  dgamma_i += dy_i (W_g xc)_i,
//             dbeta_i += dy_i                   (the sums run over every (n, s) of this device)
// Layout (N, C, S); gamma / beta in param_dtype; mean (C,) and W (G, D, D) float64. Loops in
// float64: each group's columns gathered into a panel, the D x D products as BLAS gemms
// (dbn_sync_data_cpu.cc).
struct DbnApplyArgs {
  DType dtype = DType::kFloat32;        // x / y / dy / dx
  DType param_dtype = DType::kFloat32;  // gamma / beta / dgamma / dbeta
  const void* x = nullptr;
  const double* mean = nullptr;  // (C,)
  const double* W = nullptr;     // (G, D, D)
  const void* gamma = nullptr;
  const void* beta = nullptr;    // forward only
  void* y = nullptr;             // forward output
  const void* dy = nullptr;      // backward: the output gradient
  void* dx = nullptr;            // backward outputs, written in full
  double* dmean = nullptr;
  double* dW = nullptr;
  void* dgamma = nullptr;
  void* dbeta = nullptr;
  GroupDims dims;
};
const char* dbn_apply_cpu(const DbnApplyArgs& a);
const char* dbn_apply_bwd_cpu(const DbnApplyArgs& a);

// Local statistics of one device (layout (N, C, S), data in dtype; everything else float64):
//   sums:  tot[g, i] = sum over (n, s) of x[n, g D + i, s] (i < D), tot[g, D] = N S (the count);
//          backward dx[n, g D + i, s] = dtot[g, i].
//   cov:   from the global tot (summed over the devices): mean[g D + i] = tot[g, i] / tot[g, D],
//          cov[g] = (X_g - mean)(X_g - mean)^T / tot[g, D] over this device's columns;
//          backward (dcov, dmean -> dx, dtot) through both outputs, tot's count included.
struct DbnLocalArgs {
  DType dtype = DType::kFloat32;  // x / dx
  const void* x = nullptr;
  double* tot = nullptr;          // (G, D + 1): sums' output, cov's input
  double* mean = nullptr;         // (C,): cov's output
  double* cov = nullptr;          // (G, D, D): cov's output
  const double* dcov = nullptr;   // cov backward: output gradients (dmean may be null)
  const double* dmean = nullptr;
  double* dtot = nullptr;         // backward: sums' input gradient; cov's output
  void* dx = nullptr;             // backward output, written in full
  GroupDims dims;
};
const char* dbn_local_sums_cpu(const DbnLocalArgs& a);
const char* dbn_local_sums_bwd_cpu(const DbnLocalArgs& a);
const char* dbn_local_cov_cpu(const DbnLocalArgs& a);
const char* dbn_local_cov_bwd_cpu(const DbnLocalArgs& a);

// nullptr, or the error of this round (thread-local text, valid until the next call).
const char* sync_sum_cpu(const SyncSumArgs& a);

}  // namespace gn_mx
