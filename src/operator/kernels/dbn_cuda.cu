/*
 * dbn_cuda.cu: CUDA twins of dbn_cpu.cc (Decorrelated BN, ZCA whitening per group; math in dbn.h,
 * backward derivation above BwdLayout in dbn_cpu.cc, D x D formulas in dbn_math.h).
 *
 * Group g is a D x m matrix (m = N*S columns j = n*S + s); column j of group g lives at
 * x + (n*C + g*D)*S + s with row stride S, so tiles are gathered straight from NCHW into shared
 * memory, widened to AccT, in dbn_gemm_cuda.cuh's tile order (consecutive threads along channels
 * for small S, S = 1 included; along s for large S) and multiplied with 4 x 4 register blocks.
 *
 * Forward:  channel sums (channel tiles x column chunks, fp64; a finalize kernel sums the
 *           chunks in order)                                -> mean (C,)
 *           gram kernel, grid (G x tile pairs, column splits): each block sums one TT x TT tile
 *           of Xc Xc^T (upper-triangle pairs, mirrored) over its columns in AccT registers,
 *           partials written as fp64 (summed first by gram_reduce_kernel when G is small)
 *           eig kernel, one block per group: Sigma = sum(partials)/m + eps I (fp64), parallel
 *           cyclic Jacobi (round-robin ordering: D/2 disjoint rotations per step, all threads
 *           applying them) on A and U^T in shared memory, ascending sort, then dbn_math.h's
 *           dbn_whitening_matrix (clamp, W = U diag(l^-1/2) U^T) and dbn_update_running run by
 *           BlockExec; for D beyond shared memory, the eig kernel in two halves around
 *           cusolverDnDsyevd per group (EigPath below, GNMX_DBN_CUDA_EIG)
 *           apply kernel, grid (G x row tiles, column blocks): y = W (x - mu), tiled product
 * Backward: gram kernel with dY: G_W = dY Xc^T and sum(dY)  -> fp64 partials
 *           small kernel, one block per group: dbn_math.h's dbn_bwd_small run by BlockExec
 *           (W, B = (2/m) G_S)
 *           apply kernel: dX = W (dY - mean(dY)) + B Xc
 * Inference (and its backward, P^T): prep kernel (running stats -> AccT), apply kernel.
 * IterNorm (whitening = kIterNorm): eig_kernel only forms Sigma, bwd_small_kernel only sums G_W;
 * iternorm_kernel runs dbn_math.h's iterations and back steps (the CPU's code) in launches of at
 * most two D x D products each, in fp32 or fp64 by dbn_iternorm_fp32.
 * Fused affine (gamma/beta given): the eig / prep kernels scale the rows of W / P by gamma and the
 * apply kernel adds beta; the backward's small kernel scales G_W's rows and W's columns by gamma
 * and writes dgamma (dbn_affine_dgamma) and dbeta from the sums it already has; the inference
 * backward adds the gram kernel on (dy, x - r_mean) and affine_grad_kernel.
 * Everything runs on `stream` with no host round trip: 3-6 launches (the mean finalize and
 * gram_reduce_kernel only when columns are split), plus per group one cusolverDnDsyevd on the
 * cuSOLVER path; IterNorm adds 2 T + 2 launches to the forward and 5 T + 3 to the backward.
 *
 * D x D matrices of the eig/small kernels live in the workspace (L1/L2-resident for D <= 64;
 * Jacobi's two in shared memory), their products go through shared-memory tiles (BlockExec::mm);
 * the CUDA path supports D = C/G <= 512. Every launch is followed by cudaGetLastError.
 *
 * Files (one translation unit; the headers are private to it, as dbn_cpu.cc's are):
 *   dbn_plan_cuda.cuh      launch plan (DbnCudaPlan, make_plan) and workspace layouts
 *   dbn_data_cuda.cuh      the kernels over the data: channel sums, gram, gram reduce, prep, apply
 *   dbn_gemm_cuda.cuh      their tile order, gathers and 4 x 4 register products
 *   dbn_small_cuda.cuh     the D x D work per group: BlockExec, Jacobi, eig / bwd_small / affine_grad
 *   dbn_iternorm_cuda.cuh  IterNorm's kernel and launch sequence
 *   dbn_cuda.cu            (here) the host side: plans, eigensolver choice, launchers, entry points
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>

#include "dbn.h"
#include "dbn_math.h"
#include "../common/carver.h"
#include "cuda_common.cuh"
#include "cusolver_loader.h"
#include "../common/dispatch.h"
#include "dbn_plan_cuda.cuh"
#include "dbn_data_cuda.cuh"
#include "dbn_small_cuda.cuh"
#include "dbn_iternorm_cuda.cuh"

namespace gn_mx {
namespace {

template <typename F>
const char* dispatch(DType t, F&& f) {
  return dispatch_data(t, f, "unsupported dtype");
}

// Occupancy waves of the kernels a plan chooses between, as launched (kBlock threads, their
// dynamic shared memory): gram kernel `kBwd` (when has_gram), apply kernel `kTwo`, channel sums.
template <typename T, bool kBwd, bool kTwo>
const char* plan_geo(int64_t N, int64_t C, int64_t G, int64_t S, bool has_gram, DbnCudaPlan* q) {
  const size_t A_ = sizeof(AccT<T>);
  DbnWaves wv;
  const char* e = nullptr;
  if (has_gram) {
    if (!e) e = wave_blocks(gram_kernel<T, kBwd, 16>, kBlock, gram_smem<16>(A_), &wv.gram[0]);
    if (!e) e = wave_blocks(gram_kernel<T, kBwd, 32>, kBlock, gram_smem<32>(A_), &wv.gram[1]);
    if (!e) e = wave_blocks(gram_kernel<T, kBwd, 64>, kBlock, gram_smem<64>(A_), &wv.gram[2]);
  }
  if (!e) e = wave_blocks(apply_kernel<T, kTwo, 16>, kBlock, apply_smem<16>(A_), &wv.apply[0]);
  if (!e) e = wave_blocks(apply_kernel<T, kTwo, 32>, kBlock, apply_smem<32>(A_), &wv.apply[1]);
  if (!e) e = wave_blocks(apply_kernel<T, kTwo, 64>, kBlock, apply_smem<64>(A_), &wv.apply[2]);
  if (!e) e = wave_blocks(channel_sum_kernel<T>, kBlock, 0, &wv.mean);
  int sms = 1;
  if (!e) e = sm_count(&sms);
  if (e) return e;
  wv.sms = sms;
  return make_plan(N, C, G, S, has_gram, kBwd, wv, q);
}
template <typename T>
const char* plan_for(const DbnFwdArgs& a, DbnCudaPlan* q) {
  return plan_geo<T, false, false>(a.dims.N, a.dims.C, a.dims.G, a.dims.S, true, q);
}
template <typename T>
const char* plan_for(const DbnBwdArgs& a, DbnCudaPlan* q) {
  return plan_geo<T, true, true>(a.dims.N, a.dims.C, a.dims.G, a.dims.S, true, q);
}
template <typename T>
const char* plan_for(const DbnInferenceArgs& a, DbnCudaPlan* q) {
  // the affine backward runs the training backward's gram kernel; otherwise no gram kernel
  return plan_geo<T, true, false>(a.dims.N, a.dims.C, a.dims.G, a.dims.S, a.dgamma != nullptr, q);
}

// mean = channel means of x (channel_sum_kernel; mean_finalize_kernel when chunked).
template <typename T>
const char* launch_mean(const DbnCudaPlan& q, const T* x, AccT<T>* mean, double* msum,
                        cudaStream_t st) {
  const dim3 grid(static_cast<unsigned>(ceil_div(q.C, q.mean_tc)),
                  static_cast<unsigned>(q.mean_chunks));
  channel_sum_kernel<T><<<grid, kBlock, 0, st>>>(x, q.C, q.S, q.m, q.mean_cols, q.mean_lsh, msum,
                                                 mean);
  GN_CUDA_CHECK_LAUNCH();
  if (q.mean_chunks > 1) {
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(q.C, kBlock), 4096));
    mean_finalize_kernel<AccT<T>><<<blocks, kBlock, 0, st>>>(msum, q.mean_chunks, q.C,
                                                             static_cast<double>(q.m), mean);
    GN_CUDA_CHECK_LAUNCH();
  }
  return nullptr;
}

// The gram kernel of the plan's tile: fp64 partials into part (G x gram_chunks x E), through
// split (G x gram_splits x E) and gram_reduce_kernel when the plan sums the splits first.
template <typename T, bool kBwd>
const char* launch_gram(const DbnCudaPlan& q, const T* x, const AccT<T>* mean, const T* dy,
                        double* part, double* split, cudaStream_t st) {
  using A = AccT<T>;
  const bool reduce = q.gram_chunks != q.gram_splits;
  double* out = reduce ? split : part;
  const dim3 grid(static_cast<unsigned>(q.G * q.gram_pairs), static_cast<unsigned>(q.gram_splits));
  const int D = static_cast<int>(q.D);
  switch (q.gram_tile) {
    case 16:
      gram_kernel<T, kBwd, 16><<<grid, kBlock, gram_smem<16>(sizeof(A)), st>>>(
          x, mean, dy, q.C, q.S, D, q.m, q.gram_cols, q.gram_tiles, q.gram_lsh, out);
      break;
    case 32:
      gram_kernel<T, kBwd, 32><<<grid, kBlock, gram_smem<32>(sizeof(A)), st>>>(
          x, mean, dy, q.C, q.S, D, q.m, q.gram_cols, q.gram_tiles, q.gram_lsh, out);
      break;
    default:
      gram_kernel<T, kBwd, 64><<<grid, kBlock, gram_smem<64>(sizeof(A)), st>>>(
          x, mean, dy, q.C, q.S, D, q.m, q.gram_cols, q.gram_tiles, q.gram_lsh, out);
  }
  GN_CUDA_CHECK_LAUNCH();
  if (reduce) {
    const int64_t E = q.D * q.D + (kBwd ? q.D : 0), total = q.G * E;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, kBlock), 4096));
    gram_reduce_kernel<<<blocks, kBlock, 0, st>>>(split, q.gram_splits, E, total, part);
    GN_CUDA_CHECK_LAUNCH();
  }
  return nullptr;
}

// ---- The eigensolver's plan (EigPath above) ----------------------------------------------------

// GNMX_DBN_CUDA_EIG: unset, "" or "auto" -> -1; "shared" / "global" / "cusolver" -> the EigPath;
// anything else -> -2.
int eig_path_env() {
  const char* v = std::getenv("GNMX_DBN_CUDA_EIG");
  if (!v || !*v || std::strcmp(v, "auto") == 0) return -1;
  if (std::strcmp(v, "shared") == 0) return static_cast<int>(EigPath::kShared);
  if (std::strcmp(v, "global") == 0) return static_cast<int>(EigPath::kGlobal);
  if (std::strcmp(v, "cusolver") == 0) return static_cast<int>(EigPath::kCusolver);
  return -2;
}
constexpr const char* kEigEnvError =
    "GNMX_DBN_CUDA_EIG must be auto, shared, global or cusolver (docs/dbn.md)";

// Dynamic shared memory eig_kernel<A> may use on the current device: the opt-in maximum per block
// (48 KB on sm_50/60/61, 64 KB on sm_75, up to 227 KB on sm_90) less the kernel's static shared
// memory. The kernel's cudaFuncAttributeMaxDynamicSharedMemorySize is raised to it once per device
// (needed above 48 KB; always this one value, so concurrent launches with different D never race
// on it).
template <typename A>
const char* eig_smem_limit(size_t* out) {
  constexpr int kDevs = 64;
  static std::mutex mu;
  static size_t set_to[kDevs] = {};
  int dev = 0, optin = 0;
  if (const char* e = cuda_error(cudaGetDevice(&dev))) return e;
  if (const char* e = cuda_error(
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)))
    return e;
  cudaFuncAttributes fa;
  if (const char* e = cuda_error(cudaFuncGetAttributes(&fa, eig_kernel<A>))) return e;
  const size_t limit = size_t(optin) > fa.sharedSizeBytes ? size_t(optin) - fa.sharedSizeBytes : 0;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= kDevs || set_to[dev] != limit) {
    if (const char* e = cuda_error(cudaFuncSetAttribute(
            eig_kernel<A>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit))))
      return e;
    if (dev >= 0 && dev < kDevs) set_to[dev] = limit;
  }
  *out = limit;
  return nullptr;
}

// The eigensolver of a forward with group size D (EigPath), its shared memory and cuSOLVER's
// workspace; nullptr or the error (bad GNMX_DBN_CUDA_EIG, "shared" asked for a D that does not
// fit, cuSOLVER missing).
template <typename A>
const char* eig_plan(int D, DbnWhitening wh, EigPlan* ep) {
  *ep = EigPlan{};
  ep->smem = eig_smem(D, false).bytes;
  if (wh == DbnWhitening::kIterNorm) return nullptr;  // products only
  const int want = eig_path_env();
  if (want == -2) return kEigEnvError;
  size_t limit = 0;
  if (const char* e = eig_smem_limit<A>(&limit)) return e;
  const size_t need = eig_smem(D, true).bytes;
  ep->path = want >= 0 ? static_cast<EigPath>(want)
                       : (need <= limit ? EigPath::kShared : EigPath::kCusolver);
  if (ep->path == EigPath::kShared && need > limit) {
    thread_local char buf[200];
    std::snprintf(buf, sizeof(buf),
                  "GNMX_DBN_CUDA_EIG=shared: group size %d needs %zu bytes of shared memory per "
                  "block, this GPU allows %zu",
                  D, need, limit);
    return buf;
  }
  ep->smem = eig_smem(D, ep->path == EigPath::kShared).bytes;
  if (ep->path == EigPath::kCusolver) return cusolver_syevd_lwork(D, &ep->lwork);
  return nullptr;
}

template <typename T, bool kTwo>
const char* launch_apply(const DbnCudaPlan& q, const T* in1, const AccT<T>* shift1, const AccT<T>* M1,
                         const T* in2, const AccT<T>* shift2, const AccT<T>* M2,
                         const AccT<T>* bias, T* out, cudaStream_t st) {
  using A = AccT<T>;
  const dim3 grid(static_cast<unsigned>(q.G * q.apply_tiles),
                  static_cast<unsigned>(q.apply_blocks));
  const int D = static_cast<int>(q.D);
  switch (q.apply_tile) {
    case 16:
      apply_kernel<T, kTwo, 16><<<grid, kBlock, apply_smem<16>(sizeof(A)), st>>>(
          in1, shift1, M1, in2, shift2, M2, bias, out, q.C, q.S, D, q.m, q.apply_cols,
          q.apply_tiles, q.apply_lsh);
      break;
    case 32:
      apply_kernel<T, kTwo, 32><<<grid, kBlock, apply_smem<32>(sizeof(A)), st>>>(
          in1, shift1, M1, in2, shift2, M2, bias, out, q.C, q.S, D, q.m, q.apply_cols,
          q.apply_tiles, q.apply_lsh);
      break;
    default:
      apply_kernel<T, kTwo, 64><<<grid, kBlock, apply_smem<64>(sizeof(A)), st>>>(
          in1, shift1, M1, in2, shift2, M2, bias, out, q.C, q.S, D, q.m, q.apply_cols,
          q.apply_tiles, q.apply_lsh);
  }
  GN_CUDA_CHECK_LAUNCH();
  return nullptr;
}

template <typename T>
const char* fwd_impl(const DbnFwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  DbnCudaPlan q;
  if (const char* e = plan_for<T>(a, &q)) return e;
  Carver cv{static_cast<char*>(a.workspace)};
  EigPlan ep;
  if (const char* e = eig_plan<A>(static_cast<int>(q.D), a.whitening, &ep)) return e;
  const FwdWs<A> w = fwd_ws<A>(&cv, q, a.whitening, ep, a.iterations);
  const T* x = static_cast<const T*>(a.x);
  A* mean = static_cast<A*>(a.mean);
  const int D = static_cast<int>(q.D);
  if (const char* e = launch_mean<T>(q, x, mean, w.msum, st)) return e;
  if (const char* e = launch_gram<T, false>(q, x, mean, nullptr, w.part, w.split, st)) return e;
  const int64_t spg = fwd_scratch(q.D, a.whitening, ep.path, a.iterations);
  auto eig = [&](EigPhase phase) -> const char* {
    eig_kernel<A><<<static_cast<unsigned>(q.G), kBlock, ep.smem, st>>>(
        w.part, q.gram_chunks, D, static_cast<double>(q.m), a.eps, a.momentum, mean,
        static_cast<A*>(a.eigvec), static_cast<A*>(a.eigval), w.W, w.scratch, a.stat_dtype,
        a.running_mean, a.running_proj, a.param_dtype, a.gamma, a.beta, w.bias, a.whitening,
        a.iterations, spg, ep.path, phase, w.evals, w.info);
    GN_CUDA_CHECK_LAUNCH();
    return nullptr;
  };
  if (a.whitening == DbnWhitening::kZca && ep.path == EigPath::kCusolver) {
    if (const char* e = eig(EigPhase::kPrepare)) return e;
    if (const char* e = cusolver_syevd_batch(st, w.scratch, spg, D, static_cast<int>(q.G),
                                             w.evals, w.info, w.work, ep.lwork))
      return e;
    if (const char* e = eig(EigPhase::kFinish)) return e;
  } else if (const char* e = eig(EigPhase::kAll)) {
    return e;
  }
  if (a.whitening == DbnWhitening::kIterNorm) {
    IterArgs<A> it = iter_args<A>(w.scratch, spg, D, a.iterations, false,
                                  static_cast<double>(q.m), w.W, a.param_dtype, a.gamma);
    it.momentum = a.momentum;
    it.eigvec = static_cast<A*>(a.eigvec);
    it.eigval = static_cast<A*>(a.eigval);
    it.mean = mean;
    it.stat_dtype = a.stat_dtype;
    it.running_mean = a.running_mean;
    it.running_proj = a.running_proj;
    it.bias = w.bias;
    it.beta = a.beta;
    if (const char* e = launch_iternorm(it, a.dtype, q.G, st)) return e;
  }
  return launch_apply<T, false>(q, x, mean, w.W, nullptr, nullptr, nullptr,
                                a.gamma ? w.bias : nullptr, static_cast<T*>(a.y), st);
}

template <typename T>
const char* bwd_impl(const DbnBwdArgs& a, cudaStream_t st) {
  using A = AccT<T>;
  DbnCudaPlan q;
  if (const char* e = plan_for<T>(a, &q)) return e;
  Carver cv{static_cast<char*>(a.workspace)};
  const BwdWs<A> w = bwd_ws<A>(&cv, q, a.whitening, a.iterations);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const A* mean = static_cast<const A*>(a.mean);
  const int D = static_cast<int>(q.D);
  if (const char* e = launch_gram<T, true>(q, x, mean, dy, w.part, w.split, st)) return e;
  // ZCA: one launch; IterNorm: the summed partials here, then launch_iternorm's launches
  const int64_t spg = bwd_scratch(q.D, a.whitening, a.iterations);
  bwd_small_kernel<A><<<static_cast<unsigned>(q.G), kBlock, kTileBytes, st>>>(
      w.part, q.gram_chunks, D, static_cast<double>(q.m), static_cast<const A*>(a.eigvec),
      static_cast<const A*>(a.eigval), w.W, w.B, w.dymean, w.scratch, a.param_dtype, a.gamma,
      a.dgamma, a.dbeta, a.whitening, a.iterations, spg);
  GN_CUDA_CHECK_LAUNCH();
  if (a.whitening == DbnWhitening::kIterNorm) {
    IterArgs<A> it = iter_args<A>(w.scratch, spg, D, a.iterations, true,
                                  static_cast<double>(q.m), w.W, a.param_dtype, a.gamma);
    it.Bout = w.B;
    it.dgamma = a.dgamma;
    if (const char* e = launch_iternorm(it, a.dtype, q.G, st)) return e;
  }
  return launch_apply<T, true>(q, dy, w.dymean, w.W, x, mean, w.B, nullptr, static_cast<T*>(a.dx),
                               st);
}

template <typename T>
const char* inference_impl(const DbnInferenceArgs& a, bool backward, cudaStream_t st) {
  using A = AccT<T>;
  DbnCudaPlan q;
  if (const char* e = plan_for<T>(a, &q)) return e;
  Carver cv{static_cast<char*>(a.workspace)};
  // the affine backward's dgamma / dbeta (the same test as the workspace size's and the plan's)
  const bool grads = backward && a.dgamma != nullptr;
  const InfWs<A> w = inf_ws<A>(&cv, q, grads);
  const int D = static_cast<int>(q.D);
  const int64_t total = q.G * q.D * q.D + q.C;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(total, kBlock), 4096));
  const void* beta = backward ? nullptr : a.beta;
  inference_prep_kernel<A><<<blocks, kBlock, 0, st>>>(
      a.stat_dtype, a.running_proj, (backward && !grads) ? nullptr : a.running_mean, q.G, D, q.C,
      backward, w.P, w.shift, a.param_dtype, a.gamma, beta, w.bias);
  GN_CUDA_CHECK_LAUNCH();
  if (grads) {
    if (const char* e = launch_gram<T, true>(q, static_cast<const T*>(a.data), w.shift,
                                             static_cast<const T*>(a.x), w.part, w.split, st))
      return e;
    affine_grad_kernel<A><<<static_cast<unsigned>(q.G), kBlock, 0, st>>>(
        w.part, q.gram_chunks, D, a.stat_dtype, a.running_proj, a.param_dtype, a.dgamma, a.dbeta,
        w.scratch);
    GN_CUDA_CHECK_LAUNCH();
  }
  return launch_apply<T, false>(q, static_cast<const T*>(a.x), backward ? nullptr : w.shift, w.P,
                                nullptr, nullptr, nullptr, (a.gamma && !backward) ? w.bias : nullptr,
                                static_cast<T*>(a.y), st);
}

const char* check_ws(const void* ws) {
  if (!ws) return "workspace is required";
  if (!aligned16(ws)) return "workspace must be 16-byte aligned";
  return nullptr;
}

// Workspace bytes of a call: the plan for the data dtype, then layout(tag, carver, plan) carves
// what the kernels take; 0 for an invalid call.
template <typename Args, typename F>
size_t ws_size(const Args& a, F&& layout) {
  if (check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return 0;
  Carver c;
  const char* err = dispatch(a.dtype, [&](auto tag) -> const char* {
    DbnCudaPlan q;
    if (const char* e = plan_for<decltype(tag)>(a, &q)) return e;
    layout(tag, &c, q);
    return nullptr;
  });
  return err ? 0 : c.off + kAlign;
}

// An entry point: the shape check, then the first non-null of `errors` (argument checks), then
// impl(tag) for the data dtype.
template <typename Args, typename F>
const char* checked_run(const Args& a, std::initializer_list<const char*> errors, F&& impl) {
  if (const char* e = check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return e;
  for (const char* e : errors)
    if (e) return e;
  return dispatch(a.dtype, [&](auto tag) { return impl(tag); });
}

}  // namespace

size_t dbn_fwd_workspace_cuda(const DbnFwdArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const DbnCudaPlan& q) {
    using A = AccT<decltype(tag)>;
    EigPlan ep;  // on an error the forward fails before using the workspace: size without it
    if (eig_plan<A>(static_cast<int>(q.D), a.whitening, &ep)) ep = EigPlan{};
    fwd_ws<A>(c, q, a.whitening, ep, a.iterations);
  });
}

size_t dbn_bwd_workspace_cuda(const DbnBwdArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const DbnCudaPlan& q) {
    bwd_ws<AccT<decltype(tag)>>(c, q, a.whitening, a.iterations);
  });
}

size_t dbn_inference_workspace_cuda(const DbnInferenceArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const DbnCudaPlan& q) {
    inf_ws<AccT<decltype(tag)>>(c, q, a.dgamma != nullptr);
  });
}

const char* dbn_fwd_cuda(const DbnFwdArgs& a, void* stream) {
  const bool stats = a.running_mean || a.running_proj;
  return checked_run(
      a,
      {(!a.x || !a.y || !a.mean || !a.eigvec || !a.eigval) ? "forward: null pointer" : nullptr,
       check_ws(a.workspace),
       (stats && !dbn_stat_dtype_ok(a.dtype, a.stat_dtype)) ? kDbnStatDtypeError : nullptr,
       !(a.eps > 0) ? "eps must be > 0" : nullptr, dbn_affine_fwd_error(a),
       dbn_whitening_error(a.whitening, a.iterations)},
      [&](auto tag) { return fwd_impl<decltype(tag)>(a, static_cast<cudaStream_t>(stream)); });
}

const char* dbn_bwd_cuda(const DbnBwdArgs& a, void* stream) {
  return checked_run(
      a,
      {(!a.dy || !a.x || !a.mean || !a.eigvec || !a.eigval || !a.dx) ? "backward: null pointer"
                                                                     : nullptr,
       check_ws(a.workspace), dbn_affine_bwd_error(a),
       dbn_whitening_error(a.whitening, a.iterations)},
      [&](auto tag) { return bwd_impl<decltype(tag)>(a, static_cast<cudaStream_t>(stream)); });
}

static const char* inference_dispatch(const DbnInferenceArgs& a, bool backward, void* stream) {
  return checked_run(
      a,
      {(!a.x || !a.y || !a.running_proj || (!backward && !a.running_mean))
           ? "inference: null pointer"
           : nullptr,
       check_ws(a.workspace),
       !dbn_stat_dtype_ok(a.dtype, a.stat_dtype) ? kDbnStatDtypeError : nullptr,
       dbn_affine_inf_error(a, backward),
       (backward && a.gamma && !a.running_mean) ? "inference: null pointer" : nullptr},
      [&](auto tag) {
        return inference_impl<decltype(tag)>(a, backward, static_cast<cudaStream_t>(stream));
      });
}

const char* dbn_inference_cuda(const DbnInferenceArgs& a, void* stream) {
  return inference_dispatch(a, false, stream);
}

const char* dbn_inference_bwd_cuda(const DbnInferenceArgs& a, void* stream) {
  return inference_dispatch(a, true, stream);
}

}  // namespace gn_mx
