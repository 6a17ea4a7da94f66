/*
 * adapter_driver.cc: runs the lib_api adapter's "gpu" callbacks without a GPU.
 *
 * Linked with the adapter (src/operator/mx), lib_api.cc, the CPU kernels and the CUDA kernels built
 * for the CPU emulator (build_emu.py's rewrite; device pointers are host pointers there), it calls
 * every op's registered forward/backward for the "cpu" and the "gpu" context on the same inputs and
 * checks, per op:
 *   - both contexts are registered and succeed; every output element is written (outputs start as
 *     NaN bytes);
 *   - the gpu results equal the cpu ones to the dtype's rounding (the kernels themselves are checked
 *     against float64 references elsewhere: this checks the adapter's gpu path: device choice,
 *     workspace sizes from the CUDA kernels, argument filling, aux-gradient zeroing);
 *   - the per-device limits and context errors reach the caller as one message;
 *   - the GroupNorm / moments kernels' own error strings (calling both devices' entry points
 *     directly: the adapter never passes what they reject) are one text per rule on both devices,
 *     the group_norm.h / dispatch.h constants, with no prefix.
 * Prints one line per check; exit status 0 when all pass. Built and run by tests/test_adapter_emu.py.
 */
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "lib_api.h"
#include "common/acc_type.h"
#include "common/dispatch.h"
#include "kernels/group_norm.h"

using namespace mxnet::ext;
using Attrs = std::unordered_map<std::string, std::string>;

extern "C" int _msgSize();
extern "C" void _msgGet(int idx, const char** msg);

namespace {

int g_failures = 0;

void report(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

std::string last_error() {
  if (_msgSize() == 0) return "";
  const char* m = nullptr;
  _msgGet(0, &m);
  return m ? m : "";
}

size_t elem_size(int dt) { return dt == kFloat64 ? 8 : dt == kFloat16 ? 2 : 4; }

struct Buf {
  std::vector<int64_t> shape;
  int dtype = kFloat32;
  std::vector<unsigned char> bytes;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  double get(int64_t i) const {
    const void* p = bytes.data();
    if (dtype == kFloat64) return static_cast<const double*>(p)[i];
    if (dtype == kFloat32) return static_cast<const float*>(p)[i];
    return gn_mx::to_acc(static_cast<const gn_mx::Half*>(p)[i]);
  }
  void set(int64_t i, double v) {
    void* p = bytes.data();
    if (dtype == kFloat64) static_cast<double*>(p)[i] = v;
    else if (dtype == kFloat32) static_cast<float*>(p)[i] = static_cast<float>(v);
    else static_cast<gn_mx::Half*>(p)[i] = gn_mx::from_acc<gn_mx::Half>(static_cast<float>(v));
  }
};

Buf make(std::vector<int64_t> shape, int dtype, unsigned char fill) {
  Buf b;
  b.shape = std::move(shape);
  b.dtype = dtype;
  b.bytes.assign(static_cast<size_t>(b.numel()) * elem_size(dtype), fill);
  return b;
}

Buf random_buf(std::vector<int64_t> shape, int dtype, std::mt19937& rng, double lo, double hi) {
  Buf b = make(std::move(shape), dtype, 0);
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < b.numel(); ++i) b.set(i, u(rng));
  return b;
}

Buf nan_like(const std::vector<int64_t>& shape, int dtype) { return make(shape, dtype, 0xFF); }

void* host_alloc(void*, int size) {
  static std::vector<std::vector<unsigned char>> keep;  // freed at exit
  keep.emplace_back(static_cast<size_t>(size));
  return keep.back().data();
}

const CustomOp* find_op(const char* name) {
  auto* reg = Registry<CustomOp>::get();
  for (int i = 0; i < reg->size(); ++i)
    if (std::strcmp(reg->get(i).name, name) == 0) return &reg->get(i);
  return nullptr;
}

fcomp_t find_fcomp(CustomOp& op, bool backward, const char* ctx) {
  if (op.forward_ctx_cstr.empty()) op.mapToVector();
  const auto& names = backward ? op.backward_ctx_cstr : op.forward_ctx_cstr;
  const auto& fns = backward ? op.backward_fp : op.forward_fp;
  for (size_t i = 0; i < names.size(); ++i)
    if (std::strcmp(names[i], ctx) == 0) return fns[i];
  return nullptr;
}

std::vector<MXTensor> tensors(std::vector<Buf>& bufs, const char* ctx) {
  std::vector<MXTensor> t;
  for (Buf& b : bufs)
    t.emplace_back(b.bytes.data(), b.shape, static_cast<MXDType>(b.dtype), 0, MXContext(ctx, 0));
  return t;
}

// Output shapes/dtypes from the op's own inference.
bool infer_outputs(const CustomOp& op, const Attrs& attrs, const std::vector<Buf>& in,
                   std::vector<Buf>* out) {
  int num_in = 0, num_out = 0;
  if (op.parse_attrs(attrs, &num_in, &num_out) != MX_SUCCESS) return false;
  std::vector<int> it, ot(num_out, -1);
  std::vector<std::vector<unsigned>> is, os(num_out);
  for (const Buf& b : in) {
    it.push_back(b.dtype);
    is.emplace_back(b.shape.begin(), b.shape.end());
  }
  if (op.infer_type(attrs, &it, &ot) != MX_SUCCESS) return false;
  if (op.infer_shape(attrs, &is, &os) != MX_SUCCESS) return false;
  out->clear();
  for (int i = 0; i < num_out; ++i)
    out->push_back(nan_like(std::vector<int64_t>(os[i].begin(), os[i].end()), ot[i]));
  return true;
}

struct Run {
  bool ok = false;
  std::string error;
  std::vector<Buf> inputs;   // after the call (mutable inputs updated in place)
  std::vector<Buf> outputs;
  std::vector<Buf> grads;    // backward outputs, one per input
};

// Forward, then backward with head gradients `heads` (empty: forward only), on `ctx`.
// `tensor_ctx` (default: ctx) is the context the tensors claim to live in; `stream`: MXNet's.
Run run_op(const char* name, const Attrs& attrs, std::vector<Buf> inputs,
           const std::vector<Buf>& heads, const char* ctx, const char* tensor_ctx = nullptr,
           void* stream = nullptr) {
  if (!tensor_ctx) tensor_ctx = ctx;
  Run r;
  CustomOp* op = const_cast<CustomOp*>(find_op(name));
  if (!op) {
    r.error = "op not registered";
    return r;
  }
  std::vector<Buf> outputs;
  if (!infer_outputs(*op, attrs, inputs, &outputs)) {
    r.error = "inference failed: " + last_error();
    return r;
  }
  OpResource res(host_alloc, nullptr, host_alloc, nullptr, stream, nullptr, nullptr, nullptr,
                 nullptr);
  fcomp_t fwd = find_fcomp(*op, false, ctx);
  if (!fwd) {
    r.error = std::string("no forward for ") + ctx;
    return r;
  }
  std::vector<Buf> fwd_in = inputs;  // the callbacks see these
  {
    auto ti = tensors(fwd_in, tensor_ctx);
    auto to = tensors(outputs, tensor_ctx);
    if (fwd(attrs, &ti, &to, res) != MX_SUCCESS) {
      r.error = last_error();
      return r;
    }
  }
  if (!heads.empty()) {
    fcomp_t bwd = find_fcomp(*op, true, ctx);
    if (!bwd) {
      r.error = std::string("no backward for ") + ctx;
      return r;
    }
    std::vector<Buf> bin = heads;
    bin.insert(bin.end(), inputs.begin(), inputs.end());  // the forward's inputs, as MXNet saves them
    bin.insert(bin.end(), outputs.begin(), outputs.end());
    for (const Buf& b : inputs) r.grads.push_back(nan_like(b.shape, b.dtype));
    auto ti = tensors(bin, tensor_ctx);
    auto to = tensors(r.grads, tensor_ctx);
    if (bwd(attrs, &ti, &to, res) != MX_SUCCESS) {
      r.error = last_error();
      return r;
    }
  }
  r.ok = true;
  r.inputs = std::move(fwd_in);
  r.outputs = std::move(outputs);
  return r;
}

double tolerance(int dtype) { return dtype == kFloat64 ? 1e-9 : dtype == kFloat32 ? 2e-4 : 2e-2; }

// max |a - b| / max(1, max |a|) within the dtype's tolerance, and nothing left unwritten.
void compare(const std::string& what, const Buf& a, const Buf& b) {
  double diff = 0, amax = 0;
  bool unwritten = false, nonfinite = false;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) unwritten = true;
    if (!std::isfinite(x) || !std::isfinite(y)) nonfinite = true;
    diff = std::fmax(diff, std::fabs(x - y));
    amax = std::fmax(amax, std::fabs(x));
  }
  const double rel = diff / std::fmax(1.0, amax);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s: max diff %.3g (scale %.3g)%s", what.c_str(), diff, amax,
                unwritten ? " UNWRITTEN/NaN" : nonfinite ? " non-finite" : "");
  report(!unwritten && !nonfinite && rel <= tolerance(a.dtype), buf);
}

void all_zero(const std::string& what, const Buf& a) {
  bool ok = true;
  for (int64_t i = 0; i < a.numel(); ++i) ok = ok && a.get(i) == 0.0;
  report(ok, what + ": all zeros");
}

// One op on both contexts; `skip_out` lists outputs not comparable across devices.
void check_op(const std::string& label, const char* name, const Attrs& attrs,
              const std::vector<Buf>& inputs, std::mt19937& rng, bool backward,
              std::vector<int> skip_out = {}, std::vector<int> zero_grads = {}) {
  std::vector<Buf> heads;
  if (backward) {
    std::vector<Buf> outs;
    if (!infer_outputs(*find_op(name), attrs, inputs, &outs)) {
      report(false, label + ": inference failed: " + last_error());
      return;
    }
    for (const Buf& o : outs) heads.push_back(random_buf(o.shape, o.dtype, rng, -1, 1));
  }
  Run c = run_op(name, attrs, inputs, heads, "cpu");
  Run g = run_op(name, attrs, inputs, heads, "gpu");
  report(c.ok, label + " cpu runs" + (c.ok ? "" : ": " + c.error));
  report(g.ok, label + " gpu runs" + (g.ok ? "" : ": " + g.error));
  if (!c.ok || !g.ok) return;
  for (size_t i = 0; i < c.outputs.size(); ++i) {
    bool skip = false;
    for (int s : skip_out) skip = skip || s == static_cast<int>(i);
    if (!skip) compare(label + " out" + std::to_string(i), c.outputs[i], g.outputs[i]);
  }
  for (size_t i = 0; i < c.inputs.size(); ++i)  // mutable inputs (DBN running statistics)
    compare(label + " in" + std::to_string(i) + " after", c.inputs[i], g.inputs[i]);
  for (size_t i = 0; i < c.grads.size(); ++i) {
    bool zero = false;
    for (int z : zero_grads) zero = zero || z == static_cast<int>(i);
    if (zero) {
      all_zero(label + " cpu grad" + std::to_string(i), c.grads[i]);
      all_zero(label + " gpu grad" + std::to_string(i), g.grads[i]);
    } else {
      compare(label + " grad" + std::to_string(i), c.grads[i], g.grads[i]);
    }
  }
}

void expect_error(const std::string& label, const char* name, const Attrs& attrs,
                  const std::vector<Buf>& inputs, const char* ctx, const std::string& needle,
                  const char* tensor_ctx = nullptr) {
  Run r = run_op(name, attrs, inputs, {}, ctx, tensor_ctx);
  const bool ok = !r.ok && r.error.find(needle) != std::string::npos;
  report(ok, label + ": " + (r.ok ? std::string("no error") : r.error));
}

// One rule, both devices: the kernel entry points' texts equal `want` (the header's constant).
void same_message(const std::string& rule, const char* cpu, const char* gpu, const char* want) {
  const std::string c = cpu ? cpu : "(no error)", g = gpu ? gpu : "(no error)";
  report(cpu && gpu && c == want && g == want,
         "kernel message " + rule + ": cpu '" + c + "' gpu '" + g + "'");
}

void gpu_message(const std::string& rule, const char* gpu, const char* want) {
  const std::string g = gpu ? gpu : "(no error)";
  report(gpu && g == want, "kernel message " + rule + ": gpu '" + g + "'");
}

void check_kernel_messages() {
  using namespace gn_mx;
  const int64_t N = 2, C = 4, G = 2, S = 3;
  alignas(64) static float x[N * C * S], y[N * C * S], dx[N * C * S], gam[C], bet[C], dg[C], db[C],
      mean[N * G], rstd[N * G], ws[4096];
  alignas(64) static double gam64[C];
  for (float& v : x) v = 1.5f;
  for (float& v : gam) v = 1.0f;
  GroupNormFwdArgs f;
  f.x = x; f.gamma = gam; f.beta = bet; f.y = y; f.mean = mean; f.rstd = rstd;
  f.dims = group_dims(N, C, G, S);
  GroupNormBwdArgs b;
  b.dy = x; b.x = x; b.mean = mean; b.rstd = rstd; b.gamma = gam; b.beta = bet; b.dx = dx;
  b.dgamma = dg; b.dbeta = db; b.workspace = ws;
  b.dims = group_dims(N, C, G, S);
  MomentsArgs m;
  m.x = x; m.mean = mean; m.var = rstd;
  m.dims = group_dims(N, C, G, S);

  GroupNormBwdArgs nows = b;
  nows.workspace = nullptr;
  same_message("no workspace", group_norm_bwd_cpu(nows), group_norm_bwd_cuda(nows, nullptr),
               kGnNeedsWorkspace);
  GroupNormBwdArgs nobeta = b;
  nobeta.act = Act::kSilu;
  nobeta.beta = nullptr;
  same_message("activation without beta", group_norm_bwd_cpu(nobeta),
               group_norm_bwd_cuda(nobeta, nullptr), kGnActNeedsBeta);
  GroupNormFwdArgs fp = f;
  fp.param_dtype = DType::kFloat64;
  fp.gamma = fp.beta = gam64;
  same_message("param dtype (forward)", group_norm_fwd_cpu(fp), group_norm_fwd_cuda(fp, nullptr),
               kBadParamDtype);
  GroupNormBwdArgs bp = b;
  bp.param_dtype = DType::kFloat64;
  bp.gamma = bp.beta = gam64;
  same_message("param dtype (backward)", group_norm_bwd_cpu(bp), group_norm_bwd_cuda(bp, nullptr),
               kBadParamDtype);
  GroupNormFwdArgs fd = f;
  fd.dims = group_dims(N, C, 3, S);
  const char* cpu_dims = group_norm_fwd_cpu(fd);
  same_message("channels / num_groups", cpu_dims, group_norm_fwd_cuda(fd, nullptr),
               cpu_dims ? cpu_dims : "channels must be divisible");
  // CUDA-only rules.
  void* odd = reinterpret_cast<char*>(ws) + 4;
  GroupNormFwdArgs fw = f;
  fw.workspace = odd;
  gpu_message("forward workspace alignment", group_norm_fwd_cuda(fw, nullptr), kGnWorkspaceAlign);
  GroupNormBwdArgs bw = b;
  bw.workspace = odd;
  gpu_message("backward workspace alignment", group_norm_bwd_cuda(bw, nullptr), kGnWorkspaceAlign);
  MomentsArgs mw = m;
  mw.workspace = odd;
  gpu_message("moments workspace alignment", moments_cuda(mw, nullptr), kGnWorkspaceAlign);
  GroupNormFwdArgs big = f;
  big.dims = group_dims(N, int64_t(1) << 20, 1, int64_t(1) << 12);
  gpu_message("group size limit", group_norm_fwd_cuda(big, nullptr), kGnCudaGroupLimit);
  // And the valid calls succeed on both (the checks above are not always-failing).
  report(group_norm_fwd_cpu(f) == nullptr && group_norm_fwd_cuda(f, nullptr) == nullptr &&
             group_norm_bwd_cpu(b) == nullptr && group_norm_bwd_cuda(b, nullptr) == nullptr,
         "kernel message baseline: valid calls succeed on both devices");
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Robustness on hardware (device.h, cuda_util.h, cusolver_loader.h): `adapter_driver robustness
// <libfake_cusolver.so>` and `adapter_driver fault` (run with and without GNMX_CUDA_SYNC=1 and
// GNMX_EMU_KERNEL_FAULT by tests/test_adapter_emu.py; cuda_emu.h injects the errors).

std::vector<Buf> gn_inputs(std::mt19937& rng) {
  return {random_buf({2, 6, 5}, kFloat32, rng, -1, 1), random_buf({6}, kFloat32, rng, 0.5, 1.5),
          random_buf({6}, kFloat32, rng, -1, 1)};
}
const Attrs kGnAttrs = {{"num_groups", "3"}};

void expect_gpu_error(const std::string& label, std::mt19937& rng, const std::string& needle,
                      const std::string& needle2 = "") {
  Run r = run_op("gn_group_norm", kGnAttrs, gn_inputs(rng), {}, "gpu");
  const bool ok = !r.ok && r.error.find(needle) != std::string::npos &&
                  r.error.find(needle2) != std::string::npos;
  report(ok, label + ": " + (r.ok ? std::string("no error") : r.error));
}

void expect_gpu_ok(const std::string& label, std::mt19937& rng) {
  Run r = run_op("gn_group_norm", kGnAttrs, gn_inputs(rng), {}, "gpu");
  report(r.ok, label + (r.ok ? std::string(" runs") : ": " + r.error));
}

int robustness(const char* fake_cusolver) {
  std::mt19937 rng(7);
  expect_gpu_ok("gpu op before any injected error", rng);
  // The data's device against the current one.
  setenv("GNMX_EMU_DEVICE", "1", 1);
  expect_gpu_error("device mismatch", rng,
                   "gn_group_norm: the data is on gpu(0) but the current CUDA device is 1");
  unsetenv("GNMX_EMU_DEVICE");
  // An error an earlier call left unchecked: reported as earlier work's, cleared, not the op's.
  setenv("GNMX_EMU_PENDING_ERROR", "700", 1);
  expect_gpu_error("pending error from earlier work", rng,
                   "gn_group_norm: CUDA reported cudaErrorIllegalAddress (an illegal memory access "
                   "was encountered) before this op launched anything",
                   "not from gn_mx. It had been left unchecked by an earlier CUDA call (now cleared)");
  unsetenv("GNMX_EMU_PENDING_ERROR");
  expect_gpu_ok("gpu op after the pending error was reported", rng);
  // A sticky error (the context is unusable): named as such, whatever the op.
  setenv("GNMX_EMU_STICKY_ERROR", "700", 1);
  expect_gpu_error("sticky error from earlier work", rng,
                   "gn_group_norm: CUDA reported cudaErrorIllegalAddress",
                   "The error is sticky: the CUDA context is unusable until the process restarts");
  {
    std::vector<Buf> x = {random_buf({2, 6, 5}, kFloat32, rng, -1, 1)};
    Run r = run_op("gn_moments", {{"num_groups", "3"}}, x, {}, "gpu");
    report(!r.ok && r.error.find("gn_moments: CUDA reported cudaErrorIllegalAddress") == 0 &&
               r.error.find("before this op launched anything") != std::string::npos,
           "sticky error names the op that found it: " + r.error);
  }
  unsetenv("GNMX_EMU_STICKY_ERROR");
  // cuSOLVER: one handle per (device, stream), bound once; ops on two streams, alternating.
  setenv("GNMX_CUSOLVER_LIBRARY", fake_cusolver, 1);
  setenv("GNMX_DBN_CUDA_EIG", "cusolver", 1);
  {
    Buf x = random_buf({64, 8}, kFloat64, rng, -1, 1);
    Buf rm = make({8}, kFloat64, 0), rp = make({2, 4, 4}, kFloat64, 0);
    const Attrs at = {{"num_groups", "2"}, {"eps", "1e-3"}};
    static int stream_a, stream_b;  // two distinct stream values (the emulator runs in order)
    void* streams[] = {&stream_a, &stream_b, &stream_a, &stream_b};
    Run ref = run_op("gn_dbn", at, {x, rm, rp}, {}, "cpu");
    bool all_ok = ref.ok;
    std::string err = ref.error;
    for (void* st : streams) {
      Run g = run_op("gn_dbn", at, {x, rm, rp}, {}, "gpu", nullptr, st);
      all_ok = all_ok && g.ok;
      if (!g.ok) err = g.error;
      if (g.ok && ref.ok) compare("gn_dbn cusolver on stream", ref.outputs[0], g.outputs[0]);
    }
    report(all_ok, "gn_dbn with cuSOLVER on two streams" + (all_ok ? std::string(" runs") : ": " + err));
    void* lib = dlopen(fake_cusolver, RTLD_LAZY | RTLD_NOLOAD);
    using stats_t = void (*)(int*, int*, int*);
    stats_t stats = lib ? reinterpret_cast<stats_t>(dlsym(lib, "fake_cusolver_stats")) : nullptr;
    int handles = -1, rebinds = -1, bad = -1;
    if (stats) stats(&handles, &rebinds, &bad);
    // Streams a and b, plus the null stream's handle for the workspace-size query.
    char buf[160];
    std::snprintf(buf, sizeof buf, "cuSOLVER handles: %d created, %d re-bound, %d bad calls",
                  handles, rebinds, bad);
    report(stats && handles == 3 && rebinds == 0 && bad == 0, buf);
  }
  unsetenv("GNMX_DBN_CUDA_EIG");
  unsetenv("GNMX_CUSOLVER_LIBRARY");
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}

// One gn_group_norm forward and backward on the gpu; prints its outcome (OK or the error).
int fault() {
  if (initialize(10901) != MX_SUCCESS) return 2;
  std::mt19937 rng(3);
  std::vector<Buf> in = gn_inputs(rng);
  std::vector<Buf> heads = {random_buf({2, 6, 5}, kFloat32, rng, -1, 1),
                            make({2, 3}, kFloat32, 0), make({2, 3}, kFloat32, 0)};
  Run r = run_op("gn_group_norm", kGnAttrs, in, heads, "gpu");
  std::printf("OUTCOME %s\n", r.ok ? "OK" : r.error.c_str());
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "fault") == 0) return fault();
  if (argc >= 3 && std::strcmp(argv[1], "robustness") == 0) {
    if (initialize(10901) != MX_SUCCESS) report(false, "initialize: " + last_error());
    return robustness(argv[2]);
  }
  // lib_api's initialize() adds _backward_gn_group_norm (group_norm_grad2_ops.cc), as MXLoadLib's call does
  if (initialize(10901) != MX_SUCCESS) report(false, "initialize: " + last_error());
  check_kernel_messages();
  std::mt19937 rng(1234);
  for (int dt : {kFloat32, kFloat16, kFloat64}) {
    const std::string d = dt == kFloat32 ? "f32" : dt == kFloat16 ? "f16" : "f64";
    Buf x = random_buf({2, 8, 5, 3}, dt, rng, -2, 3);
    check_op("gn_moments " + d, "gn_moments", {{"num_groups", "4"}}, {x}, rng, true);
    for (const char* act : {"none", "relu", "silu"}) {
      const int pdt = dt == kFloat16 ? kFloat32 : dt;  // fp16 data with fp32 parameters
      std::vector<Buf> in = {x, random_buf({8}, pdt, rng, 0.5, 1.5), random_buf({8}, pdt, rng, -1, 1)};
      check_op(std::string("gn_group_norm ") + d + " " + act, "gn_group_norm",
               {{"num_groups", "2"}, {"eps", "1e-5"}, {"act_type", act}}, in, rng, true);
    }
    std::vector<Buf> aff = {x, random_buf({8}, dt, rng, 0.5, 1.5), random_buf({8}, dt, rng, -1, 1)};
    check_op("gn_channel_affine " + d, "gn_channel_affine", {}, aff, rng, true);

    // DBN: gn_dbn's eigenvectors (output 2) are defined up to sign: not compared. The aux-state
    // gradients (inputs 1, 2) must be zeros on both devices.
    Buf xd = random_buf({4, 6, 3, 3}, dt, rng, -1, 2);
    const int sdt = dt == kFloat16 ? kFloat32 : dt;
    Buf rmean = random_buf({6}, sdt, rng, -0.1, 0.1);
    Buf rproj = make({2, 3, 3}, sdt, 0);
    for (int g = 0; g < 2; ++g)
      for (int i = 0; i < 3; ++i) rproj.set(g * 9 + i * 4, 1.0);
    const Attrs dbn_attrs = {{"num_groups", "2"}, {"eps", "1e-3"}, {"momentum", "0.8"}};
    check_op("gn_dbn " + d, "gn_dbn", dbn_attrs, {xd, rmean, rproj}, rng, true, {2}, {1, 2});
    Buf rp = random_buf({2, 3, 3}, sdt, rng, -1, 1);
    check_op("gn_dbn_inference " + d, "gn_dbn_inference", {{"num_groups", "2"}}, {xd, rmean, rp},
             rng, true, {}, {1, 2});
    // The fused affine (inputs data, gamma, beta, running_mean, running_projection); float16 data
    // with float32 gamma/beta, as the Gluon block's multi-precision use.
    Buf gam = random_buf({6}, sdt, rng, -1.5, 1.5), bet = random_buf({6}, sdt, rng, -1, 1);
    Attrs dbn_aff = dbn_attrs;
    dbn_aff["affine"] = "True";
    check_op("gn_dbn affine " + d, "gn_dbn", dbn_aff, {xd, gam, bet, rmean, rproj}, rng, true, {2},
             {3, 4});
    Attrs dbn_it = dbn_aff;  // IterNorm (eigvec then holds Sigma: comparable across devices)
    dbn_it["whitening"] = "iternorm";
    dbn_it["iterations"] = "4";
    check_op("gn_dbn iternorm " + d, "gn_dbn", dbn_it, {xd, gam, bet, rmean, rproj}, rng, true, {},
             {3, 4});
    check_op("gn_dbn_inference affine " + d, "gn_dbn_inference",
             {{"num_groups", "2"}, {"affine", "True"}}, {xd, gam, bet, rmean, rp}, rng, true, {},
             {3, 4});
  }
  // gn_group_norm's double backward: the re-registered _backward_gn_group_norm, forward (= the first
  // order backward) and backward (group_norm_grad2_*), inputs [dout, dmean, drstd, data, gamma, beta,
  // out, mean, rstd]; the gradient of `out` (input 6) is zeros.
  for (int dt : {kFloat32, kFloat16, kFloat64}) {
    const std::string d = dt == kFloat32 ? "f32" : dt == kFloat16 ? "f16" : "f64";
    const int pdt = dt == kFloat16 ? kFloat32 : dt, sdt = dt == kFloat64 ? kFloat64 : kFloat32;
    for (const char* act : {"none", "relu", "silu"}) {
      std::vector<Buf> in = {random_buf({2, 6, 4, 3}, dt, rng, -1, 1), random_buf({2, 3}, sdt, rng, -1, 1),
                             random_buf({2, 3}, sdt, rng, -1, 1), random_buf({2, 6, 4, 3}, dt, rng, -2, 2),
                             random_buf({6}, pdt, rng, 0.5, 1.5), random_buf({6}, pdt, rng, -1, 1),
                             random_buf({2, 6, 4, 3}, dt, rng, -1, 1), random_buf({2, 3}, sdt, rng, -0.3, 0.3),
                             random_buf({2, 3}, sdt, rng, 0.5, 1.5)};
      check_op(std::string("_backward_gn_group_norm ") + d + " " + act, "_backward_gn_group_norm",
               {{"num_groups", "3"}, {"eps", "1e-5"}, {"act_type", act}}, in, rng, true, {}, {6});
    }
    std::vector<Buf> min = {random_buf({2, 3}, sdt, rng, -1, 1), random_buf({2, 3}, sdt, rng, -1, 1),
                            random_buf({2, 6, 4, 3}, dt, rng, -2, 2), random_buf({2, 3}, sdt, rng, -0.3, 0.3),
                            random_buf({2, 3}, sdt, rng, 0.5, 1.5)};
    check_op("_backward_gn_moments " + d, "_backward_gn_moments", {{"num_groups", "3"}}, min, rng, true,
             {}, {4});
  }
  // A group split across blocks: the CUDA forward statistics need their workspace.
  {
    Buf x = random_buf({1, 4, 64, 128}, kFloat32, rng, -1, 1);
    std::vector<Buf> in = {x, random_buf({4}, kFloat32, rng, 0.5, 1.5),
                           random_buf({4}, kFloat32, rng, -1, 1)};
    check_op("gn_group_norm one large group", "gn_group_norm", {{"num_groups", "1"}}, in, rng, true);
    check_op("gn_moments one large group", "gn_moments", {{"num_groups", "1"}}, {x}, rng, false);
  }
  // Parameter gradients reduced over several chunks of N (param_reduce.cuh): the CUDA kernels'
  // workspace sizes for their partial sums (gn_channel_affine's comes through the adapter's hook).
  {
    Buf x = random_buf({150, 6}, kFloat32, rng, -2, 2);
    std::vector<Buf> in = {x, random_buf({6}, kFloat32, rng, 0.5, 1.5),
                           random_buf({6}, kFloat32, rng, -1, 1)};
    check_op("gn_group_norm N=150", "gn_group_norm", {{"num_groups", "3"}}, in, rng, true);  // 3 chunks
    Buf xa = random_buf({300, 64}, kFloat32, rng, -2, 2);  // 3 chunks of 100 rows
    check_op("gn_channel_affine N=300", "gn_channel_affine", {},
             {xa, random_buf({64}, kFloat32, rng, 0.5, 1.5), random_buf({64}, kFloat32, rng, -1, 1)},
             rng, true);
    Buf xs = random_buf({150, 2, 33}, kFloat32, rng, -2, 2);  // long rows: 3 chunks of 50 rows
    check_op("gn_channel_affine N=150 S=33", "gn_channel_affine", {},
             {xs, random_buf({2}, kFloat32, rng, 0.5, 1.5), random_buf({2}, kFloat32, rng, -1, 1)},
             rng, true);
    std::vector<Buf> g2 = {random_buf({150, 6}, kFloat32, rng, -1, 1),
                           random_buf({150, 3}, kFloat32, rng, -1, 1),
                           random_buf({150, 3}, kFloat32, rng, -1, 1), x, in[1], in[2],
                           random_buf({150, 6}, kFloat32, rng, -1, 1),
                           random_buf({150, 3}, kFloat32, rng, -0.3, 0.3),
                           random_buf({150, 3}, kFloat32, rng, 0.5, 1.5)};
    check_op("_backward_gn_group_norm N=150", "_backward_gn_group_norm",
             {{"num_groups", "3"}, {"eps", "1e-5"}, {"act_type", "none"}}, g2, rng, true, {}, {6});
  }
  // Per-device limits and contexts.
  {
    Buf x = random_buf({2, 600, 1, 1}, kFloat32, rng, -1, 1);
    std::vector<Buf> in = {x, make({600}, kFloat32, 0), make({1, 600, 600}, kFloat32, 0)};
    expect_error("gn_dbn D=600 on gpu", "gn_dbn", {{"num_groups", "1"}}, in, "gpu",
                 "gn_dbn: group size C/num_groups = 600 exceeds the gpu limit 512");
    expect_error("gn_dbn_inference D=600 on gpu", "gn_dbn_inference", {{"num_groups", "1"}}, in,
                 "gpu", "gn_dbn_inference: group size C/num_groups = 600 exceeds the gpu limit 512");
    Buf y = random_buf({2, 4, 3}, kFloat32, rng, -1, 1);
    expect_error("gn_moments on an unknown context", "gn_moments", {{"num_groups", "2"}}, {y},
                 "cpu", "gn_moments: unsupported context 'opencl'", "opencl");
  }
  std::printf("%d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
