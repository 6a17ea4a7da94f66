/*
 * dbn.h: framework-free Decorrelated Batch Normalization kernels (Huang et al., CVPR 2018,
 * arXiv 1804.08450), ZCA whitening with per-group statistics. No MXNet types.
 *
 * Layout (N, C, S) with S = prod(spatial) (S = 1 for 2-D data), G groups of D = C/G channels.
 * For group g the data is a D x m matrix X (m = N*S columns, one per (n, s)); for each sample n
 * it is the contiguous, row-major D x S block starting at x + (n*C + g*D)*S, so no transposes are
 * ever needed: kernels gather column panels of up to K columns straight from NCHW.
 *
 * Forward (training), per group, computed in AccT passes and fp64 small-matrix math:
 *   mu     = (1/m) X 1                                  (D,)       saved as `mean`   (AccT)
 *   Xc     = X - mu 1^T
 *   Sigma  = (1/m) Xc Xc^T + eps I                      (D, D)     fp64
 *   Sigma  = U diag(l) U^T                              fp64 eigensolver (below); l is clamped
 *                                                       to >= eps (exact Sigma has all
 *                                                       eigenvalues >= eps; rounding can break it)
 *   W      = U diag(l^-1/2) U^T = Sigma^{-1/2}          saved as `eigvec` U, `eigval` l (AccT)
 *   Y      = W Xc                                       (ZCA whitening; out = Y in x's dtype)
 *   running_mean       = momentum * running_mean       + (1 - momentum) * mu
 *   running_projection = momentum * running_projection + (1 - momentum) * W
 * A non-finite Sigma (NaN/inf input) skips the eigensolver and yields NaN eig/out; never a crash.
 *
 * Backward (training), given dY; derivation in dbn_cpu.cc above BwdLayout:
 *   G_W    = dY Xc^T,  Gs = (G_W + G_W^T)/2
 *   K_ij   = -1 / (sqrt(l_i) sqrt(l_j) (sqrt(l_i) + sqrt(l_j)))     (divided difference of l^-1/2,
 *                                                       diagonal = f'(l_i); no 1/(l_i - l_j) at all)
 *   G_S    = U (K o (U^T Gs U)) U^T                     (dL/dSigma, symmetric)
 *   dX     = W (dY - mean_cols(dY) 1^T) + (2/m) G_S Xc
 *
 * Inference: Y = P (X - r_mean 1^T) with the running statistics P = running_projection[g],
 * r_mean = running_mean[g*D : (g+1)*D].  Its backward: dX = P^T dY (aux-state grads are zeros and
 * are the adapter's business).
 *
 * Dtypes: x/y/dy/dx have `dtype` (fp16 -> AccT fp32, fp32 -> fp32, fp64 -> fp64). Saved
 * mean/eigvec/eigval are AccT. Running stats have `stat_dtype`, either `dtype` or AccT (fp32 running
 * stats with fp16 data). The eigensolver and the D x D math run in fp64 for every dtype, except
 * IterNorm's Newton iterations and their backward, which run in fp32 for fp16/fp32 data at
 * T <= kDbnIterNormFp32MaxT (dbn_math.h, docs/numerics.md), and three CUDA products (below).
 *
 * Forward statistics, CPU and CUDA differ on purpose (both exact two-pass quality, no
 * E[xx^T] - mu mu^T): the CPU reads x once, centring each column panel on its own mean while it
 * is in cache and merging per-thread fp64 (count, mean, M2) with Chan's update (dbn_cpu.cc),
 * because a separate mean pass costs a full read of x: measured 0.075 / 0.18 / 0.27 / 0.18 ms,
 * i.e. 13 / 16 / 4 / 11% of the forward, for bench_dbn.py's four fp32 shapes at 1 thread (Zen 4,
 * load ~1.3; tensors 2-8 MB, more when x is not cache-resident). The CUDA forward keeps the
 * mean kernel followed by a gram kernel on x - mu: its gram blocks accumulate matrix entries in
 * AccT registers spread over the threads (4 x 4 tiles per thread) and over column chunks, so with a
 * known mean the chunk partials merge by a plain fp64 sum in eig_kernel; the CPU's per-panel
 * centring would need every panel's mean in shared memory, a rank-one correction per entry and
 * (count, mean) partials merged with Chan's update. Whether that pays on a GPU (where the mean
 * pass reads x at HBM bandwidth) has not been measured: no GPU was available to this change.
 *
 * Eigensolver, CPU and CUDA differ on purpose: the CPU uses cyclic Jacobi (dbn_math.h) for D <= 8
 * and Householder tridiagonalization + implicit QL (dbn_small_cpu.h) above, because QL costs
 * O(D^3) once where Jacobi costs O(D^3) per sweep (~8 sweeps), and beats OpenBLAS dsyevd 3-6x at
 * D = 16..64 (dsyevd stays as a fallback); the CUDA forward runs a block-parallel Jacobi per group
 * with A and U^T in shared memory while 2 D (D + 1) doubles fit the GPU's opt-in shared memory per
 * block (D <= 53 on sm_50/60/61 (48 KB), 62 on sm_75 (64 KB), 76 on sm_70, 78 on sm_86/89, 100 on
 * sm_80, 118 on sm_90), and cuSOLVER's dsyevd per group above (loaded at run time on first use,
 * cusolver_loader.h; a clear error when it is missing); GNMX_DBN_CUDA_EIG=auto|shared|global|
 * cusolver forces a path (global: the same Jacobi in the workspace, slow; docs/dbn.md). All return
 * ascending eigenvalues with orthonormal eigenvectors to fp64 rounding, so the outputs agree to
 * rounding; eigenvector signs (and bases of repeated eigenvalues) may differ, which leaves W,
 * y and dx unchanged (they depend on U only through U f(l) U^T). A cuSOLVER failure (info != 0)
 * gives NaN outputs for that group, like a non-finite Sigma (no host round trip to report it).
 *
 * Precision of the CUDA D x D products (dbn_cuda.cu's BlockExec, shared-memory tiles, every entry
 * summed over k in ascending order as on the CPU):
 *   fp32 accumulation (fp16/fp32 data only) in the products with an orthogonal factor whose result
 *     is stored in fp32 anyway (dbn_math.h's ex.mm_orth): W = (U diag(l^-1/2)) U^T (forward and
 *     backward), U (K o H) and (U (K o H)) U^T (backward). Multiplying by an orthogonal U keeps
 *     norms, so the error is <= D 2^-24 ||C|| normwise (<= 3e-5 at D = 512, ~sqrt(D) 2^-24 in
 *     practice), below the fp32 outputs' own. On slow-fp64 GPUs (T4/L4: fp64 = 1/32-1/64 of
 *     fp32) this takes 3 of the ZCA backward's 5 products and the forward's one off the fp64
 *     pipes (~40 ms each at D = 512 on a T4 in fp64; estimates, docs/design/dbn.md, "GPU: the
 *     eigensolver and the D x D products").
 *   fp64 where it must be: U^T sym(G_W) U in the backward (its entries are then scaled by
 *     K_ij ~ l^-3/2, up to cond(Sigma)^{3/2} times the largest: a normwise fp32 error there is
 *     amplified), IterNorm's Newton iterations and their backward above T = 5 (their rounding
 *     errors grow by up to ~2e4 at T = 6: dbn_math.h, kDbnIterNormFp32MaxT), and every product
 *     for fp64 data. IterNorm at T <= 5 with fp16/fp32 data: fp32 on both devices.
 * So for fp64 data the CUDA and CPU W / B agree to FMA contraction, for fp16/fp32 data to fp32
 * rounding (normwise); the CPU sums every product in fp64.
 * Every D x D step after the eigensolver (clamp, W = U diag(l^-1/2) U^T, running statistics,
 * the backward's W and B) is written once, in dbn_math.h, over an executor: the CPU runs it with
 * plain loops and dbn_small_cpu.h's register-blocked AVX2 product (CpuExec), the CUDA kernels with
 * one thread block per group (dbn_cuda.cu's BlockExec). Both sum every product in the same order,
 * so the same U, l give the same W and B up to FMA contraction (fp64 data; fp16/fp32 data: the
 * precision paragraph above). The Jacobi rotation, scaling and
 * stopping rule (kDbnJacobiTol, kDbnJacobiMaxSweeps) are dbn_math.h's too; only the order of the
 * rotations differs (serial cyclic on the CPU, round-robin parallel on the GPU).
 *
 * Every entry point returns nullptr on success or an error string without an op prefix (the adapter
 * adds the op name once). CPU entry points use
 * `num_threads` OpenMP threads (0: omp_get_max_threads()); the workspace size depends on it, so
 * query the size with the same args you run with. Workspace must be 64-byte aligned.
 * CUDA twins take a cudaStream_t as `void* stream` and have their own workspace-size functions.
 */
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "../common/acc_type.h"
#include "../common/group_shape.h"

namespace gn_mx {

// The whitening of the training op. ZCA: W = Sigma^{-1/2} by eigendecomposition (above). IterNorm
// (Huang et al., CVPR 2019): W = P_T / sqrt(tr(Sigma)) after T Newton iterations on the
// trace-normalized Sigma (dbn_math.h); the forward then saves Sigma (eps included) as `eigvec` and
// its diagonal as `eigval`, which the backward reads. Running statistics and the inference op are
// the same for both (running_projection averages W).
enum class DbnWhitening { kZca = 0, kIterNorm = 1 };

struct DbnFwdArgs {
  DType dtype = DType::kFloat32;       // x / y dtype
  DType stat_dtype = DType::kFloat32;  // running_mean / running_projection dtype (dtype or AccT)
  const void* x = nullptr;             // (N, C, S)
  void* y = nullptr;                   // (N, C, S)
  void* mean = nullptr;                // (C,) AccT, batch mean (saved for backward)
  void* eigvec = nullptr;              // (G, D, D) AccT, row-major U: column j = eigenvector j
  void* eigval = nullptr;              // (G, D) AccT, eigenvalues of Sigma (eps included), >= eps
  void* running_mean = nullptr;        // (C,) stat_dtype, updated in place; nullptr: no update
  void* running_proj = nullptr;        // (G, D, D) stat_dtype, updated in place; nullptr: no update
  // Fused affine (optional): y = gamma[c] * (W (x - mu))[c] + beta[c]. Both or neither; the running
  // and saved statistics are those of the whitening alone.
  DType param_dtype = DType::kFloat32; // gamma / beta dtype (dtype or AccT)
  const void* gamma = nullptr;         // (C,) param_dtype
  const void* beta = nullptr;          // (C,) param_dtype
  void* workspace = nullptr;           // dbn_fwd_workspace_*() bytes
  GroupDims dims;  // common/group_shape.h (the adapter fills it from the data shape)
  double eps = 1e-5;
  double momentum = 0.9;
  DbnWhitening whitening = DbnWhitening::kZca;
  int iterations = 5;                  // IterNorm's T, in [1, kDbnMaxIterations]
  int num_threads = 0;                 // CPU only; 0 = omp_get_max_threads()
};

struct DbnBwdArgs {
  DType dtype = DType::kFloat32;
  const void* dy = nullptr;            // (N, C, S)
  const void* x = nullptr;             // (N, C, S)
  const void* mean = nullptr;          // (C,) AccT, from forward
  const void* eigvec = nullptr;        // (G, D, D) AccT, from forward
  const void* eigval = nullptr;        // (G, D) AccT, from forward
  void* dx = nullptr;                  // (N, C, S)
  // Fused affine (optional, all three or none): dy is the gradient of y = gamma xhat + beta;
  // dgamma = sum(dy xhat), dbeta = sum(dy) per channel are written (overwritten).
  DType param_dtype = DType::kFloat32;
  const void* gamma = nullptr;         // (C,) param_dtype
  void* dgamma = nullptr;              // (C,) param_dtype
  void* dbeta = nullptr;               // (C,) param_dtype
  void* workspace = nullptr;           // dbn_bwd_workspace_*() bytes
  GroupDims dims;  // common/group_shape.h (the adapter fills it from the data shape)
  DbnWhitening whitening = DbnWhitening::kZca;  // as the forward's
  int iterations = 5;
  int num_threads = 0;
};

// Inference forward (y = P (x - r_mean)) and its backward (dx = P^T dy) share one struct:
// forward reads `x` and writes `y`; backward reads `x` as dy and writes `y` as dx, ignoring mean.
struct DbnInferenceArgs {
  DType dtype = DType::kFloat32;
  DType stat_dtype = DType::kFloat32;
  const void* x = nullptr;             // (N, C, S)  (dy for the backward)
  const void* running_mean = nullptr;  // (C,) stat_dtype
  const void* running_proj = nullptr;  // (G, D, D) stat_dtype
  void* y = nullptr;                   // (N, C, S)  (dx for the backward)
  // Fused affine (optional): y = gamma P (x - r_mean) + beta; its backward dx = P^T (gamma dy) and,
  // from the forward's input `data`, dgamma = sum(dy P (data - r_mean)), dbeta = sum(dy).
  DType param_dtype = DType::kFloat32;
  const void* gamma = nullptr;         // (C,) param_dtype
  const void* beta = nullptr;          // (C,) param_dtype (forward)
  const void* data = nullptr;          // (N, C, S) the forward's x (backward)
  void* dgamma = nullptr;              // (C,) param_dtype (backward)
  void* dbeta = nullptr;               // (C,) param_dtype (backward)
  void* workspace = nullptr;           // dbn_inference_workspace_*() bytes
  GroupDims dims;  // common/group_shape.h (the adapter fills it from the data shape)
  int num_threads = 0;
};

size_t dbn_fwd_workspace_cpu(const DbnFwdArgs& a);
size_t dbn_bwd_workspace_cpu(const DbnBwdArgs& a);
size_t dbn_inference_workspace_cpu(const DbnInferenceArgs& a);  // forward and backward alike

const char* dbn_fwd_cpu(const DbnFwdArgs& a);
const char* dbn_bwd_cpu(const DbnBwdArgs& a);
const char* dbn_inference_cpu(const DbnInferenceArgs& a);
const char* dbn_inference_bwd_cpu(const DbnInferenceArgs& a);

// ---- Limits and validation shared by the adapter, the CPU and the CUDA kernels ---------------
// Largest group size D = C/num_groups per device. CPU: the D x D eigendecomposition per group
// (O(D^3)) and the int-indexed D x D / panel buffers; CUDA: per-group arrays in static shared
// memory (bwd_small_kernel) and the time of one block per group (estimated on an H200 at D = 512:
// ~2 ms per D x D product, ~10 ms for the ZCA backward's small kernel; IterNorm's launches hold
// at most two products: ~4 ms, ~84 ms on a T4's fp64; docs/performance/gpu.md). The adapter checks the CPU limit at shape inference (lib_api shape
// inference does not know the device); the GPU path checks the CUDA limit before any launch.
constexpr int64_t kDbnMaxGroupSizeCpu = 4096;
constexpr int64_t kDbnMaxGroupSizeCuda = 512;

// nullptr when D fits `limit`; otherwise the one message format for this limit on every device,
// e.g. "group size C/num_groups = 1024 exceeds the gpu limit 512" (thread-local storage, valid
// until the next call on this thread; the adapter adds the op name).
inline const char* dbn_group_size_error(int64_t D, int64_t limit, const char* device) {
  if (D <= limit) return nullptr;
  thread_local char buf[128];
  std::snprintf(buf, sizeof(buf), "group size C/num_groups = %lld exceeds the %s limit %lld",
                static_cast<long long>(D), device, static_cast<long long>(limit));
  return buf;
}

// The shape of a call: G groups of D = C/G channels, each group a D x m matrix (m = N*S columns).
// The CPU's panel geometry (PanelGeo) and the CUDA launch plan (DbnCudaPlan) extend it.
// GroupDims plus the number of samples per channel m = N * S (the covariance's divisor).
struct DbnShape : GroupDims {
  int64_t m = 0;
};
inline DbnShape dbn_shape(int64_t N, int64_t C, int64_t G, int64_t S) {
  DbnShape q;
  static_cast<GroupDims&>(q) = group_dims(N, C, G, S);
  q.m = N * S;
  return q;
}

// nullptr for a valid shape (group_shape.h's one check and wording) whose group size fits the
// device's `limit`; else the error.
inline const char* dbn_check_shape(int64_t N, int64_t C, int64_t G, int64_t S, int64_t limit,
                                   const char* device) {
  if (const char* e = check_group_dims(group_dims(N, C, G, S))) return e;
  return dbn_group_size_error(C / G, limit, device);
}

// Running statistics have the data dtype or its accumulation dtype.
inline bool dbn_stat_dtype_ok(DType data, DType stat) {
  return stat == data || stat == acc_dtype(data);
}
constexpr const char* kDbnStatDtypeError =
    "running statistics must have the data dtype or its accumulation dtype";
// gamma / beta follow the same dtype rule; given together (both pointers, or neither).
constexpr const char* kDbnParamDtypeError =
    "gamma and beta must have the data dtype or its accumulation dtype";
constexpr const char* kDbnAffineError = "gamma and beta (and their gradients) go together";
// IterNorm's iteration count T: in [1, kDbnMaxIterations]. The paper's iteration (uncoupled
// Newton-Schulz, P^3 Sigma_N) amplifies rounding errors, the faster the worse Sigma is conditioned
// (Higham's analysis of the Newton square root): measured with the float64 numpy reference of the
// paper's algorithm (the op's fp64 D x D math follows it), ||cov(y) - I||_F / sqrt(D) stays
// bounded up to T = 11 and blows up (8 .. 1e5, then inf/NaN) from T = 12-13 for cond(Sigma) =
// 2e4 .. 1e9 (D = 16 .. 128), from T = 25 for cond 14; docs/dbn.md has the table. The paper uses
// T = 5; 10 leaves a margin below the blow-up.
constexpr int kDbnMaxIterations = 10;
constexpr const char* kDbnIterationsError = "iterations must be in [1, 10]";
static_assert(kDbnMaxIterations == 10, "kDbnIterationsError names the limit");
inline const char* dbn_whitening_error(DbnWhitening w, int iterations) {
  if (w != DbnWhitening::kZca && w != DbnWhitening::kIterNorm) return "unknown whitening";
  if (w == DbnWhitening::kIterNorm && (iterations < 1 || iterations > kDbnMaxIterations))
    return kDbnIterationsError;
  return nullptr;
}
inline const char* dbn_affine_fwd_error(const DbnFwdArgs& a) {
  if (!a.gamma != !a.beta) return kDbnAffineError;
  return (a.gamma && !dbn_stat_dtype_ok(a.dtype, a.param_dtype)) ? kDbnParamDtypeError : nullptr;
}
inline const char* dbn_affine_bwd_error(const DbnBwdArgs& a) {
  if (!a.gamma != !a.dgamma || !a.gamma != !a.dbeta) return kDbnAffineError;
  return (a.gamma && !dbn_stat_dtype_ok(a.dtype, a.param_dtype)) ? kDbnParamDtypeError : nullptr;
}
inline const char* dbn_affine_inf_error(const DbnInferenceArgs& a, bool backward) {
  const bool bad = backward ? (!a.gamma != !a.dgamma || !a.gamma != !a.dbeta || !a.gamma != !a.data)
                            : !a.gamma != !a.beta;
  if (bad) return kDbnAffineError;
  return (a.gamma && !dbn_stat_dtype_ok(a.dtype, a.param_dtype)) ? kDbnParamDtypeError : nullptr;
}

// The one load/store of a running-statistics element of dtype `t`, widened to / narrowed from
// fp64 (host and device).
GN_INLINE double dbn_load_stat(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kFloat16: return static_cast<double>(to_acc(static_cast<const Half*>(p)[i]));
    case DType::kFloat32: return static_cast<double>(static_cast<const float*>(p)[i]);
    default: return static_cast<const double*>(p)[i];
  }
}
GN_INLINE void dbn_store_stat(DType t, void* p, int64_t i, double v) {
  switch (t) {
    case DType::kFloat16: static_cast<Half*>(p)[i] = from_acc<Half>(static_cast<float>(v)); break;
    case DType::kFloat32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    default: static_cast<double*>(p)[i] = v; break;
  }
}

#if defined(GNMX_WITH_CUDA)
size_t dbn_fwd_workspace_cuda(const DbnFwdArgs& a);
size_t dbn_bwd_workspace_cuda(const DbnBwdArgs& a);
size_t dbn_inference_workspace_cuda(const DbnInferenceArgs& a);
const char* dbn_fwd_cuda(const DbnFwdArgs& a, void* stream);
const char* dbn_bwd_cuda(const DbnBwdArgs& a, void* stream);
const char* dbn_inference_cuda(const DbnInferenceArgs& a, void* stream);
const char* dbn_inference_bwd_cuda(const DbnInferenceArgs& a, void* stream);
#endif

}  // namespace gn_mx
