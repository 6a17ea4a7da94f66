/*
 * harness.cc: C ABI over the framework-free CUDA kernels, for the GPU test/benchmark harness
 * (tests/gpu/gnh.py drives it with ctypes on torch CUDA tensors). No MXNet, no torch headers.
 *
 * dtype codes are gn_mx::DType (0 float32, 1 float64, 2 float16). Pointers are raw device pointers,
 * `stream` a cudaStream_t (torch.cuda.current_stream().cuda_stream). Every function returns nullptr
 * on success or the kernel's error string; *_workspace return bytes.
 *
 * gnh_alloc / gnh_free / gnh_copy / gnh_synchronize let a driver without torch (tests/gpu/
 * harness_np.py: numpy arrays, the shared edge cases) move data to and from the device; in the CPU
 * emulator build device memory is host memory.
 */
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/affine.h"
#include "kernels/dbn.h"
#include "kernels/group_norm.h"
#include "kernels/group_norm_grad2.h"

using namespace gn_mx;

#define GNH_API extern "C" __attribute__((visibility("default")))

// ---- Device memory (drivers without torch) -------------------------------------------------------

static const char* cuda_result(cudaError_t e) {
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

GNH_API int gnh_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// nullptr (and the error string in *err) on failure.
GNH_API void* gnh_alloc(size_t bytes, const char** err) {
  void* p = nullptr;
  const char* e = cuda_result(cudaMalloc(&p, bytes > 0 ? bytes : 1));
  if (err) *err = e;
  return e ? nullptr : p;
}

GNH_API const char* gnh_free(void* p) { return cuda_result(cudaFree(p)); }

// to_device != 0: host src -> device dst; else device src -> host dst (synchronous).
GNH_API const char* gnh_copy(void* dst, const void* src, size_t bytes, int to_device) {
  return cuda_result(cudaMemcpy(dst, src, bytes,
                                to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
}

GNH_API const char* gnh_synchronize() { return cuda_result(cudaDeviceSynchronize()); }

// ---- Layout --------------------------------------------------------------------------------------
// The GroupNorm / moments entry points below take (N, C, G, S) data, channels first by default;
// gnh_set_channels_last(1) makes the following calls (on this thread) treat the same buffers as
// channels-last (N, S, C) data (GroupDims::channels_last, the ops' axis = -1).
static thread_local bool g_channels_last = false;

GNH_API void gnh_set_channels_last(int on) { g_channels_last = on != 0; }

static GroupDims gn_dims(int64_t N, int64_t C, int64_t G, int64_t S) {
  return group_dims(N, C, G, S, g_channels_last);
}

GNH_API size_t gnh_moments_workspace(int dtype, const void* x, int64_t N, int64_t C, int64_t G,
                                     int64_t S) {
  MomentsArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.x = x;
  a.dims = gn_dims(N, C, G, S);
  return moments_workspace_cuda(a);
}

GNH_API const char* gnh_moments(int dtype, const void* x, void* mean, void* var, int64_t N,
                                int64_t C, int64_t G, int64_t S, void* workspace, void* stream) {
  MomentsArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.x = x; a.mean = mean; a.var = var;
  a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  return moments_cuda(a, stream);
}

GNH_API const char* gnh_moments_bwd(int dtype, const void* dmean, const void* dvar, const void* x,
                                    const void* mean, void* dx, int64_t N, int64_t C, int64_t G,
                                    int64_t S, void* stream) {
  MomentsBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.dmean = dmean; a.dvar = dvar; a.x = x; a.mean = mean; a.dx = dx;
  a.dims = gn_dims(N, C, G, S);
  return moments_bwd_cuda(a, stream);
}

GNH_API size_t gnh_gn_fwd_workspace(int dtype, int param_dtype, const void* x, const void* y,
                                    int64_t N, int64_t C, int64_t G, int64_t S) {
  GroupNormFwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.x = x; a.y = const_cast<void*>(y);
  a.dims = gn_dims(N, C, G, S);
  return group_norm_fwd_workspace_cuda(a);
}

// GroupNorm with a fused activation (act: gn_mx::Act, 0 none, 1 relu, 2 silu); the backward reads
// beta to recompute the pre-activation.
GNH_API const char* gnh_gn_fwd_act(int dtype, int param_dtype, const void* x, const void* gamma,
                                   const void* beta, void* y, void* mean, void* rstd, int64_t N,
                                   int64_t C, int64_t G, int64_t S, double eps, int act,
                                   void* workspace, void* stream) {
  GroupNormFwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.x = x; a.gamma = gamma; a.beta = beta; a.y = y; a.mean = mean; a.rstd = rstd;
  a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  a.eps = eps;
  a.act = static_cast<Act>(act);
  return group_norm_fwd_cuda(a, stream);
}

GNH_API const char* gnh_gn_fwd(int dtype, int param_dtype, const void* x, const void* gamma,
                               const void* beta, void* y, void* mean, void* rstd, int64_t N,
                               int64_t C, int64_t G, int64_t S, double eps, void* workspace,
                               void* stream) {
  return gnh_gn_fwd_act(dtype, param_dtype, x, gamma, beta, y, mean, rstd, N, C, G, S, eps,
                        static_cast<int>(Act::kNone), workspace, stream);
}

static GroupNormBwdArgs bwd_args(int dtype, int param_dtype, const void* dy, const void* x,
                                 const void* mean, const void* rstd, const void* gamma, void* dx,
                                 void* dgamma, void* dbeta, const void* dmean, const void* drstd,
                                 void* workspace, int64_t N, int64_t C, int64_t G, int64_t S) {
  GroupNormBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.dy = dy; a.x = x; a.mean = mean; a.rstd = rstd; a.gamma = gamma;
  a.dx = dx; a.dgamma = dgamma; a.dbeta = dbeta; a.dmean = dmean; a.drstd = drstd;
  a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  return a;
}

GNH_API size_t gnh_gn_bwd_workspace(int dtype, int param_dtype, const void* dy, const void* x,
                                    void* dx, int64_t N, int64_t C, int64_t G, int64_t S) {
  return group_norm_bwd_workspace_cuda(bwd_args(dtype, param_dtype, dy, x, nullptr, nullptr, nullptr,
                                                dx, nullptr, nullptr, nullptr, nullptr, nullptr, N,
                                                C, G, S));
}

GNH_API const char* gnh_gn_bwd(int dtype, int param_dtype, const void* dy, const void* x,
                               const void* mean, const void* rstd, const void* gamma, void* dx,
                               void* dgamma, void* dbeta, const void* dmean, const void* drstd,
                               void* workspace, int64_t N, int64_t C, int64_t G, int64_t S,
                               void* stream) {
  return group_norm_bwd_cuda(bwd_args(dtype, param_dtype, dy, x, mean, rstd, gamma, dx, dgamma,
                                      dbeta, dmean, drstd, workspace, N, C, G, S),
                             stream);
}

GNH_API const char* gnh_gn_bwd_act(int dtype, int param_dtype, const void* dy, const void* x,
                                   const void* mean, const void* rstd, const void* gamma,
                                   const void* beta, void* dx, void* dgamma, void* dbeta,
                                   const void* dmean, const void* drstd, void* workspace, int64_t N,
                                   int64_t C, int64_t G, int64_t S, double eps, int act,
                                   void* stream) {
  GroupNormBwdArgs a = bwd_args(dtype, param_dtype, dy, x, mean, rstd, gamma, dx, dgamma, dbeta,
                                dmean, drstd, workspace, N, C, G, S);
  a.beta = beta;
  a.eps = eps;
  a.act = static_cast<Act>(act);
  return group_norm_bwd_cuda(a, stream);
}

// ---- Decorrelated BN -----------------------------------------------------------------------------

GNH_API size_t gnh_dbn_fwd_workspace(int dtype, int stat_dtype, int64_t N, int64_t C, int64_t G,
                                     int64_t S) {
  DbnFwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.dims = gn_dims(N, C, G, S);
  return dbn_fwd_workspace_cuda(a);
}

GNH_API const char* gnh_dbn_fwd(int dtype, int stat_dtype, const void* x, void* y, void* mean,
                                void* eigvec, void* eigval, void* running_mean, void* running_proj,
                                void* workspace, int64_t N, int64_t C, int64_t G, int64_t S,
                                double eps, double momentum, void* stream) {
  DbnFwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.x = x; a.y = y; a.mean = mean; a.eigvec = eigvec; a.eigval = eigval;
  a.running_mean = running_mean; a.running_proj = running_proj; a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  a.eps = eps;
  a.momentum = momentum;
  return dbn_fwd_cuda(a, stream);
}

GNH_API size_t gnh_dbn_bwd_workspace(int dtype, int64_t N, int64_t C, int64_t G, int64_t S) {
  DbnBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.dims = gn_dims(N, C, G, S);
  return dbn_bwd_workspace_cuda(a);
}

GNH_API const char* gnh_dbn_bwd(int dtype, const void* dy, const void* x, const void* mean,
                                const void* eigvec, const void* eigval, void* dx, void* workspace,
                                int64_t N, int64_t C, int64_t G, int64_t S, void* stream) {
  DbnBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.dy = dy; a.x = x; a.mean = mean; a.eigvec = eigvec; a.eigval = eigval; a.dx = dx;
  a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  return dbn_bwd_cuda(a, stream);
}

GNH_API size_t gnh_dbn_inference_workspace(int dtype, int stat_dtype, int64_t N, int64_t C,
                                           int64_t G, int64_t S) {
  DbnInferenceArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.dims = gn_dims(N, C, G, S);
  return dbn_inference_workspace_cuda(a);
}

// backward != 0: dx = P^T dy (x is dy, y is dx, running_mean ignored).
GNH_API const char* gnh_dbn_inference(int dtype, int stat_dtype, int backward, const void* x,
                                      const void* running_mean, const void* running_proj, void* y,
                                      void* workspace, int64_t N, int64_t C, int64_t G, int64_t S,
                                      void* stream) {
  DbnInferenceArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.x = x; a.running_mean = running_mean; a.running_proj = running_proj; a.y = y;
  a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  return backward ? dbn_inference_bwd_cuda(a, stream) : dbn_inference_cuda(a, stream);
}

// The inference workspace when the backward also gives dgamma / dbeta (the fused affine).
GNH_API size_t gnh_dbn_inference_affine_workspace(int dtype, int stat_dtype, int64_t N, int64_t C,
                                                  int64_t G, int64_t S) {
  DbnInferenceArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  static char dummy;
  a.dgamma = &dummy;  // only its presence sizes the workspace
  a.dims = gn_dims(N, C, G, S);
  return dbn_inference_workspace_cuda(a);
}

// With the fused affine (param_dtype gamma / beta): forward y = gamma P (x - r_mean) + beta;
// backward (x is dy, data the forward's input): dx = P^T (gamma dy), dgamma, dbeta
// (affine_grad_kernel).
GNH_API const char* gnh_dbn_inference_affine(int dtype, int stat_dtype, int param_dtype,
                                             int backward, const void* x, const void* data,
                                             const void* running_mean, const void* running_proj,
                                             const void* gamma, const void* beta, void* y,
                                             void* dgamma, void* dbeta, void* workspace, int64_t N,
                                             int64_t C, int64_t G, int64_t S, void* stream) {
  DbnInferenceArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.x = x; a.running_mean = running_mean; a.running_proj = running_proj; a.y = y;
  a.gamma = gamma; a.beta = beta; a.data = data; a.dgamma = dgamma; a.dbeta = dbeta;
  a.workspace = workspace;
  a.dims = gn_dims(N, C, G, S);
  return backward ? dbn_inference_bwd_cuda(a, stream) : dbn_inference_cuda(a, stream);
}

// IterNorm (whitening = iternorm, T iterations), no running statistics: workspace (fwd != 0: the
// forward's, else the backward's), forward (eigvec / eigval: Sigma and its diagonal) and backward.
GNH_API size_t gnh_dbn_it_workspace(int fwd, int dtype, int64_t N, int64_t C, int64_t G,
                                    int64_t S, int T) {
  if (fwd) {
    DbnFwdArgs a;
    a.dtype = a.stat_dtype = static_cast<DType>(dtype);
    a.dims = group_dims(N, C, G, S);
    a.whitening = DbnWhitening::kIterNorm;
    a.iterations = T;
    return dbn_fwd_workspace_cuda(a);
  }
  DbnBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.dims = group_dims(N, C, G, S);
  a.whitening = DbnWhitening::kIterNorm;
  a.iterations = T;
  return dbn_bwd_workspace_cuda(a);
}

GNH_API const char* gnh_dbn_it_fwd(int dtype, const void* x, void* y, void* mean, void* eigvec,
                                   void* eigval, void* workspace, int64_t N, int64_t C, int64_t G,
                                   int64_t S, double eps, int T, void* stream) {
  DbnFwdArgs a;
  a.dtype = a.stat_dtype = static_cast<DType>(dtype);
  a.x = x; a.y = y; a.mean = mean; a.eigvec = eigvec; a.eigval = eigval; a.workspace = workspace;
  a.dims = group_dims(N, C, G, S);
  a.eps = eps;
  a.whitening = DbnWhitening::kIterNorm;
  a.iterations = T;
  return dbn_fwd_cuda(a, stream);
}

GNH_API const char* gnh_dbn_it_bwd(int dtype, const void* dy, const void* x, const void* mean,
                                   const void* eigvec, const void* eigval, void* dx,
                                   void* workspace, int64_t N, int64_t C, int64_t G, int64_t S,
                                   int T, void* stream) {
  DbnBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.dy = dy; a.x = x; a.mean = mean; a.eigvec = eigvec; a.eigval = eigval; a.dx = dx;
  a.workspace = workspace;
  a.dims = group_dims(N, C, G, S);
  a.whitening = DbnWhitening::kIterNorm;
  a.iterations = T;
  return dbn_bwd_cuda(a, stream);
}

// ---- Per-channel affine (gn_channel_affine) ------------------------------------------------------

GNH_API const char* gnh_affine_fwd(int dtype, int param_dtype, const void* x, const void* gamma,
                                   const void* beta, void* y, int64_t N, int64_t C, int64_t S,
                                   void* stream) {
  AffineArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.x = x; a.gamma = gamma; a.beta = beta; a.y = y;
  a.dims = group_dims(N, C, 1, S);
  return affine_fwd_cuda(a, stream);
}

GNH_API size_t gnh_affine_bwd_workspace(int dtype, int param_dtype, int64_t N, int64_t C,
                                        int64_t S) {
  AffineBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.dims = group_dims(N, C, 1, S);
  return affine_bwd_workspace_cuda(a);
}

// workspace: gnh_affine_bwd_workspace() bytes, or nullptr (the kernels then do without).
GNH_API const char* gnh_affine_bwd(int dtype, int param_dtype, const void* dy, const void* x,
                                   const void* gamma, void* dx, void* dgamma, void* dbeta,
                                   void* workspace, int64_t N, int64_t C, int64_t S,
                                   void* stream) {
  AffineBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.dy = dy; a.x = x; a.gamma = gamma; a.dx = dx; a.dgamma = dgamma; a.dbeta = dbeta;
  a.workspace = workspace;
  a.dims = group_dims(N, C, 1, S);
  return affine_bwd_cuda(a, stream);
}

// ---- DBN with every option (whitening, IterNorm's T, fused affine) -------------------------------
// whitening: 0 ZCA, 1 IterNorm (DbnWhitening). gamma/beta (forward) and gamma/dgamma/dbeta
// (backward) are nullptr or all given, in param_dtype. The IterNorm forward saves Sigma as `eigvec`
// and its diagonal as `eigval` (dbn.h), which the backward reads.

GNH_API size_t gnh_dbn_fwd_workspace2(int dtype, int stat_dtype, int64_t N, int64_t C, int64_t G,
                                      int64_t S, int whitening, int iterations) {
  DbnFwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.dims = group_dims(N, C, G, S);
  a.whitening = static_cast<DbnWhitening>(whitening);
  a.iterations = iterations;
  return dbn_fwd_workspace_cuda(a);
}

GNH_API const char* gnh_dbn_fwd2(int dtype, int stat_dtype, int param_dtype, const void* x,
                                 const void* gamma, const void* beta, void* y, void* mean,
                                 void* eigvec, void* eigval, void* running_mean, void* running_proj,
                                 void* workspace, int64_t N, int64_t C, int64_t G, int64_t S,
                                 double eps, double momentum, int whitening, int iterations,
                                 void* stream) {
  DbnFwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.stat_dtype = static_cast<DType>(stat_dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.x = x; a.gamma = gamma; a.beta = beta; a.y = y; a.mean = mean; a.eigvec = eigvec;
  a.eigval = eigval; a.running_mean = running_mean; a.running_proj = running_proj;
  a.workspace = workspace;
  a.dims = group_dims(N, C, G, S);
  a.eps = eps;
  a.momentum = momentum;
  a.whitening = static_cast<DbnWhitening>(whitening);
  a.iterations = iterations;
  return dbn_fwd_cuda(a, stream);
}

GNH_API size_t gnh_dbn_bwd_workspace2(int dtype, int64_t N, int64_t C, int64_t G, int64_t S,
                                      int whitening, int iterations) {
  DbnBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.dims = group_dims(N, C, G, S);
  a.whitening = static_cast<DbnWhitening>(whitening);
  a.iterations = iterations;
  return dbn_bwd_workspace_cuda(a);
}

GNH_API const char* gnh_dbn_bwd2(int dtype, int param_dtype, const void* dy, const void* x,
                                 const void* mean, const void* eigvec, const void* eigval,
                                 const void* gamma, void* dx, void* dgamma, void* dbeta,
                                 void* workspace, int64_t N, int64_t C, int64_t G, int64_t S,
                                 int whitening, int iterations, void* stream) {
  DbnBwdArgs a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.dy = dy; a.x = x; a.mean = mean; a.eigvec = eigvec; a.eigval = eigval;
  a.gamma = gamma; a.dx = dx; a.dgamma = dgamma; a.dbeta = dbeta;
  a.workspace = workspace;
  a.dims = group_dims(N, C, G, S);
  a.whitening = static_cast<DbnWhitening>(whitening);
  a.iterations = iterations;
  return dbn_bwd_cuda(a, stream);
}

// ---- Double backward (group_norm_grad2.h) --------------------------------------------------------
// Inputs of the first-order backward (dy, dmean_o, drstd_o, x, gamma, beta, mean, rstd), the
// gradients arriving at its outputs (gdx, gdgamma, gdbeta; nullptr = 0), and the gradients into
// each input (ddy, ddmean_o, ddrstd_o, dx, dgamma, dbeta, dmean, drstd).

GNH_API size_t gnh_gn_grad2_workspace(int dtype, int param_dtype, int64_t N, int64_t C, int64_t G,
                                      int64_t S, int act) {
  GroupNormGrad2Args a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.dims = group_dims(N, C, G, S);
  a.act = static_cast<Act>(act);
  return group_norm_grad2_workspace_cuda(a);
}

GNH_API const char* gnh_gn_grad2(int dtype, int param_dtype, const void* dy, const void* dmean_o,
                                 const void* drstd_o, const void* x, const void* gamma,
                                 const void* beta, const void* mean, const void* rstd,
                                 const void* gdx, const void* gdgamma, const void* gdbeta,
                                 void* ddy, void* ddmean_o, void* ddrstd_o, void* dx, void* dgamma,
                                 void* dbeta, void* dmean, void* drstd, void* workspace, int64_t N,
                                 int64_t C, int64_t G, int64_t S, int act, void* stream) {
  GroupNormGrad2Args a;
  a.dtype = static_cast<DType>(dtype);
  a.param_dtype = static_cast<DType>(param_dtype);
  a.dy = dy; a.dmean_o = dmean_o; a.drstd_o = drstd_o; a.x = x; a.gamma = gamma; a.beta = beta;
  a.mean = mean; a.rstd = rstd; a.gdx = gdx; a.gdgamma = gdgamma; a.gdbeta = gdbeta;
  a.ddy = ddy; a.ddmean_o = ddmean_o; a.ddrstd_o = ddrstd_o; a.dx = dx; a.dgamma = dgamma;
  a.dbeta = dbeta; a.dmean = dmean; a.drstd = drstd; a.workspace = workspace;
  a.dims = group_dims(N, C, G, S);
  a.act = static_cast<Act>(act);
  return group_norm_grad2_cuda(a, stream);
}

GNH_API const char* gnh_moments_grad2(int dtype, const void* dmean_o, const void* dvar_o,
                                      const void* x, const void* mean, const void* gdx,
                                      void* ddmean_o, void* ddvar_o, void* dx, void* dmean,
                                      int64_t N, int64_t C, int64_t G, int64_t S, void* stream) {
  MomentsGrad2Args a;
  a.dtype = static_cast<DType>(dtype);
  a.dmean_o = dmean_o; a.dvar_o = dvar_o; a.x = x; a.mean = mean; a.gdx = gdx;
  a.ddmean_o = ddmean_o; a.ddvar_o = ddvar_o; a.dx = dx; a.dmean = dmean;
  a.dims = group_dims(N, C, G, S);
  return moments_grad2_cuda(a, stream);
}
