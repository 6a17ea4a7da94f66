/*
 * dbn_sync_ops.cc: MXNet registration of synchronized DBN's native ops (contract:
 * docs/reference/ops.md; math: ../kernels/dbn_sync.h). CPU only: no "gpu" registration yet.
 *
 * gn_sync_sum:   input data (any shape, float64); output the sum of data over the num_devices calls
 *                with the same key (an in-process barrier). Backward: the same sum of the output
 *                gradients (d/d data_p of sum_q data_q read by every device). Attributes: key
 *                (required), num_devices (>= 1), timeout (seconds, > 0, default 60). Forward and
 *                backward use the barriers "<key>/fwd" and "<key>/bwd".
 * gn_dbn_whiten: inputs cov (G, D, D) float64 (the batch covariance, eps not included), mean (G*D,)
 *                float64 (for the running mean only), running_mean (G*D,), running_projection
 *                (G, D, D) (mutable: auxiliary states, updated in place);
 *                outputs W (G, D, D), eigvec (G, D, D), eigval (G, D), all float64 (the last two
 *                exist for the backward). Attributes eps, momentum, whitening, iterations as gn_dbn.
 *                Backward: d cov from dW; zeros for mean and the running statistics.
 * gn_dbn_apply:  inputs data (N, C, *spatial), gamma (C,), beta (C,) (data dtype, or float32 with
 *                float16 data), mean (C,) float64, W (G, D, D) float64; attribute num_groups;
 *                output out = gamma[c] (W_g (x - mean))[c] + beta[c] in the data dtype.
 *                Backward: gradients of all five inputs (dbn_sync.h).
 * gn_dbn_local_sums: input data (N, C, *spatial); attribute num_groups; output (G, D + 1) float64:
 *                per group the channel sums over this device's (sample, position) columns and
 *                their count. Backward: d data (each element gets its channel's sum gradient).
 * gn_dbn_local_cov: inputs data, tot (G, D + 1) float64 (gn_dbn_local_sums summed over the
 *                devices); attribute num_groups; outputs cov (G, D, D) (this device's columns'
 *                outer products about the global mean, divided by the global count) and mean (C,),
 *                float64. Backward: d data and d tot (count included).
 */
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "device.h"
#include "validate.h"
#include "../kernels/dbn_sync.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

constexpr char kSum[] = "gn_sync_sum";
constexpr char kWhiten[] = "gn_dbn_whiten";
constexpr char kApply[] = "gn_dbn_apply";
constexpr char kSums[] = "gn_dbn_local_sums";
constexpr char kLocalCov[] = "gn_dbn_local_cov";

// ---- gn_sync_sum --------------------------------------------------------------------------------
struct SumParams {
  std::string key;
  int num_devices = 1;
  double timeout = 60.0;
};

SumParams parse_sum(const AttrMap& attrs) {
  Attrs a(kSum, attrs, {"key", "num_devices", "timeout"});
  SumParams p;
  const auto k = attrs.find("key");
  if (k == attrs.end() || k->second.empty()) fail(kSum, ": attribute key is required");
  p.key = k->second;
  const int64_t n = a.get_int("num_devices", 1);
  if (n < 1 || n > 4096) fail(kSum, ": num_devices must be in [1, 4096]; got ", n);
  p.num_devices = static_cast<int>(n);
  p.timeout = a.get_float("timeout", 60.0);
  if (!(p.timeout > 0) || !std::isfinite(p.timeout))
    fail(kSum, ": timeout must be a finite number of seconds > 0; got ", p.timeout);
  return p;
}

MXReturnValue sum_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kSum, [&] {
    parse_sum(attrs);
    *num_in = *num_out = 1;
    return MX_SUCCESS;
  });
}

MXReturnValue sum_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                        std::vector<std::vector<unsigned>>* out) {
  return guarded(kSum, [&] {
    parse_sum(attrs);
    // A 0 dim is "not inferred yet" under MXNet's legacy shapes: passing it on would make MXNet
    // allocate an output of 2^32-1 rows (and fail the next op); forward reports an empty tensor.
    if (!shape_unknown((*in)[0])) (*out)[0] = (*in)[0];
    return MX_SUCCESS;
  });
}

// Run-time check of an input the kernels index with (inferShape leaves 0 dims unknown).
void check_nonempty(const char* op, const char* name, const MXTensor& t) {
  if (t.size() == 0) fail(op, ": ", kEmptyTensorRule, "; ", name, " shape ", shape_str(t.shape));
}

// The first num_in inputs are float64 (an unknown one becomes float64: a Module binding variables
// without a dtype), as are all outputs.
MXReturnValue f64_type(const char* op, std::vector<int>* in, std::vector<int>* out, size_t num_in) {
  for (size_t i = 0; i < num_in; ++i) {
    int& t = (*in)[i];
    if (t != kDtypeUnknown && t != kFloat64)
      fail(op, ": input ", i, " must be float64; got ", mx_dtype_name(t));
    t = kFloat64;
  }
  for (int& t : *out) t = kFloat64;
  return MX_SUCCESS;
}

MXReturnValue sum_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kSum, [&] {
    parse_sum(attrs);
    return f64_type(kSum, in, out, 1);
  });
}

// The CPU resource pools, named in a cpu timeout's message: every lib_api op holds one slot of each
// (MXNet gives library ops kTempSpace and kParallelRandom), the slots are shared by all cpu(i) and
// handed out round-robin, so a device waiting here can hold the slot another device's op needs
// before it arrives (issue 42's probe; docs/guide/dbn_sync.md). The sizes that avoid it: python's
// gn_mx.sync.cpu_pool_environment (their one home).
std::string pool_hint() {
  std::string h = "; on cpu contexts a device can be stuck behind a resource slot or the worker "
                  "thread of a waiting device when these are too small:";
  for (const char* var :
       {"MXNET_CPU_TEMP_COPY", "MXNET_CPU_PARALLEL_RAND_COPY", "MXNET_CPU_WORKER_NTHREADS"}) {
    const char* v = std::getenv(var);
    h += std::string(" ") + var + "=" + (v ? v : "unset");
  }
  return h + " (gn_mx.sync.cpu_pool_environment(num_devices) gives the values to set before "
             "importing mxnet)";
}

// One barrier call over `t_in` into `t_out` (same size); dir: "fwd" or "bwd".
void sum_call(const SumParams& p, const char* dir, const MXTensor& t_in, MXTensor* t_out,
              const OpResource& res) {
  const Device dev = device_of(kSum, t_in, res);
  if (dev.gpu) fail(kSum, ": gpu contexts are not supported yet (cpu only)");
  check_nonempty(kSum, "data", t_in);
  if (t_in.dtype != kFloat64 || t_out->dtype != kFloat64 || t_in.size() != t_out->size())
    fail(kSum, ": expected float64 tensors of one size");
  const std::string key = p.key + "/" + dir;
  SyncSumArgs a;
  a.key = key.c_str();
  a.num_devices = p.num_devices;
  a.timeout_s = p.timeout;
  a.in = static_cast<const double*>(t_in.data_ptr);
  a.out = static_cast<double*>(t_out->data_ptr);
  a.n = t_in.size();
  if (const char* e = sync_sum_cpu(a)) {
    const std::string m(e);
    fail(kSum, ": ", m, m.find("timed out after") != std::string::npos ? pool_hint() : "");
  }
}

MXReturnValue sum_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kSum, [&] {
    sum_call(parse_sum(attrs), "fwd", (*in)[0], &(*out)[0], res);
    return MX_SUCCESS;
  });
}

// Backward inputs: [dout, data, out]; output: ddata.
MXReturnValue sum_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kSum, [&] {
    if (in->size() != 3 || out->size() != 1)
      fail(kSum, ": backward expected 3 inputs and 1 output; got ", in->size(), " and ",
           out->size());
    sum_call(parse_sum(attrs), "bwd", (*in)[0], &(*out)[0], res);
    return MX_SUCCESS;
  });
}

// ---- gn_dbn_whiten ------------------------------------------------------------------------------
enum WhitenIn { kCov = 0, kMean, kRMean, kRProj, kWhitenNumIn };
enum WhitenOut { kW = 0, kEigvec, kEigval, kWhitenNumOut };

struct WhitenParams {
  double eps = 1e-5, momentum = 0.9;
  DbnWhitening whitening = DbnWhitening::kZca;
  int iterations = 5;
};

WhitenParams parse_whiten(const AttrMap& attrs) {
  Attrs a(kWhiten, attrs, {"eps", "momentum", "whitening", "iterations"});
  WhitenParams p;
  p.eps = a.get_float("eps", 1e-5);
  p.momentum = a.get_float("momentum", 0.9);
  const auto w = attrs.find("whitening");
  const std::string wn = w == attrs.end() ? "zca" : w->second;
  if (wn == "iternorm") {
    p.whitening = DbnWhitening::kIterNorm;
  } else if (wn != "zca") {
    fail(kWhiten, ": whitening must be 'zca' or 'iternorm'; got '", wn, "'");
  }
  const int64_t it = a.get_int("iterations", 5);
  if (it < 1 || it > kDbnMaxIterations)
    fail(kWhiten, ": iterations must be in [1, ", kDbnMaxIterations, "]; got ", it);
  p.iterations = static_cast<int>(it);
  if (!(p.eps > 0) || !std::isfinite(p.eps))
    fail(kWhiten, ": eps must be a finite number > 0; got ", p.eps);
  if (!(p.momentum >= 0 && p.momentum <= 1))
    fail(kWhiten, ": momentum must be in [0, 1]; got ", p.momentum);
  return p;
}

MXReturnValue whiten_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kWhiten, [&] {
    parse_whiten(attrs);
    *num_in = kWhitenNumIn;
    *num_out = kWhitenNumOut;
    return MX_SUCCESS;
  });
}

MXReturnValue whiten_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                           std::vector<std::vector<unsigned>>* out) {
  return guarded(kWhiten, [&] {
    parse_whiten(attrs);
    const auto& cs = (*in)[kCov];
    if (shape_unknown(cs)) return MX_SUCCESS;
    if (cs.size() != 3 || cs[1] != cs[2] || cs[1] > kDbnMaxGroupSizeCpu)
      fail(kWhiten, ": cov must have shape (G, D, D) with D <= ", kDbnMaxGroupSizeCpu, "; got ",
           shape_str(to_i64(cs)));
    const std::vector<unsigned> mean{cs[0] * cs[1]};
    for (int i : {kMean, kRMean, kRProj}) {
      const std::vector<unsigned> want = i == kRProj ? cs : mean;
      auto& s = (*in)[i];
      if (shape_unknown(s)) {
        s = want;
      } else if (s != want) {
        fail(kWhiten, ": input ", i, " must have shape ", shape_str(to_i64(want)),
             " for cov shape ", shape_str(to_i64(cs)), "; got ", shape_str(to_i64(s)));
      }
    }
    (*out)[kW] = (*out)[kEigvec] = cs;
    (*out)[kEigval] = {cs[0], cs[1]};
    return MX_SUCCESS;
  });
}

MXReturnValue whiten_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kWhiten, [&] {
    parse_whiten(attrs);
    for (int i : {kRMean, kRProj})
      if ((*in)[i] != kDtypeUnknown && !is_float_dtype((*in)[i]))
        fail(kWhiten, ": running statistics must be a float type; got ", mx_dtype_name((*in)[i]));
    if ((*in)[kRMean] == kDtypeUnknown) (*in)[kRMean] = (*in)[kRProj];
    if ((*in)[kRProj] == kDtypeUnknown) (*in)[kRProj] = (*in)[kRMean];
    if ((*in)[kRMean] != (*in)[kRProj])
      fail(kWhiten, ": running_mean and running_projection must have the same dtype");
    return f64_type(kWhiten, in, out, 2);
  });
}

MXReturnValue whiten_mutate(const AttrMap&, std::vector<int>* idx) {
  idx->push_back(kRMean);
  idx->push_back(kRProj);
  return MX_SUCCESS;
}

const Kernel<DbnWhitenArgs> kWhitenKernel{dbn_whiten_cpu, nullptr, nullptr, nullptr};
const Kernel<DbnWhitenBwdArgs> kWhitenBwdKernel{dbn_whiten_bwd_cpu, nullptr, nullptr, nullptr};

// The device of a call on the forward inputs `ins`, after the run-time checks of what the kernels
// index with: inferShape leaves a 0 dim unknown (MXNet's legacy shapes), so a zero-size or
// mismatched input can reach the kernels (a zero-size mean read past its end, a SIGSEGV).
Device whiten_device(const MXTensor* ins, const OpResource& res) {
  const MXTensor& cov = ins[kCov];
  const Device dev = device_of(kWhiten, cov, res);
  if (dev.gpu) fail(kWhiten, ": gpu contexts are not supported yet (cpu only)");
  if (cov.shape.size() != 3 || cov.shape[1] != cov.shape[2])
    fail(kWhiten, ": cov must have shape (G, D, D); got ", shape_str(cov.shape));
  check_nonempty(kWhiten, "cov", cov);
  const char* names[kWhitenNumIn] = {"cov", "mean", "running_mean", "running_projection"};
  for (int i : {kMean, kRMean, kRProj}) {
    const int64_t want = i == kRProj ? cov.size() : cov.shape[0] * cov.shape[1];
    if (ins[i].size() != want)
      fail(kWhiten, ": ", names[i], " must have ", want, " elements for cov shape ",
           shape_str(cov.shape), "; got shape ", shape_str(ins[i].shape));
  }
  return dev;
}

MXReturnValue whiten_fwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                         std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kWhiten, [&] {
    const WhitenParams p = parse_whiten(attrs);
    const MXTensor& cov = (*in)[kCov];
    const Device dev = whiten_device(in->data(), res);
    DbnWhitenArgs a;
    a.stat_dtype = to_dtype((*in)[kRProj].dtype);
    a.cov = static_cast<const double*>(cov.data_ptr);
    a.mean = static_cast<const double*>((*in)[kMean].data_ptr);
    a.W = static_cast<double*>((*out)[kW].data_ptr);
    a.eigvec = static_cast<double*>((*out)[kEigvec].data_ptr);
    a.eigval = static_cast<double*>((*out)[kEigval].data_ptr);
    a.running_mean = (*in)[kRMean].data_ptr;
    a.running_proj = (*in)[kRProj].data_ptr;
    a.G = cov.shape[0];
    a.D = cov.shape[1];
    a.eps = p.eps;
    a.momentum = p.momentum;
    a.whitening = p.whitening;
    a.iterations = p.iterations;
    run(kWhiten, dev, kWhitenKernel, a);
    return MX_SUCCESS;
  });
}

// Backward inputs: [dW, deigvec, deigval, cov, mean, running_mean, running_projection, W, eigvec,
// eigval]; outputs: one gradient per input (zeros but for cov).
MXReturnValue whiten_bwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                         std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kWhiten, [&] {
    const WhitenParams p = parse_whiten(attrs);
    if (in->size() != 2 * kWhitenNumOut + kWhitenNumIn || out->size() != kWhitenNumIn)
      fail(kWhiten, ": backward expected ", 2 * kWhitenNumOut + kWhitenNumIn, " inputs and ",
           int(kWhitenNumIn), " outputs; got ", in->size(), " and ", out->size());
    const MXTensor* ins = in->data() + kWhitenNumOut;
    const MXTensor* outs = ins + kWhitenNumIn;
    const Device dev = whiten_device(ins, res);
    check_grad_dtype(kWhiten, (*in)[kW], kFloat64, "W");
    DbnWhitenBwdArgs a;
    a.dW = static_cast<const double*>((*in)[kW].data_ptr);
    a.cov = static_cast<const double*>(ins[kCov].data_ptr);
    a.eigvec = static_cast<const double*>(outs[kEigvec].data_ptr);
    a.eigval = static_cast<const double*>(outs[kEigval].data_ptr);
    a.dcov = static_cast<double*>((*out)[kCov].data_ptr);
    a.G = ins[kCov].shape[0];
    a.D = ins[kCov].shape[1];
    a.eps = p.eps;
    a.whitening = p.whitening;
    a.iterations = p.iterations;
    run(kWhiten, dev, kWhitenBwdKernel, a, {&(*out)[kMean], &(*out)[kRMean], &(*out)[kRProj]});
    return MX_SUCCESS;
  });
}

// ---- gn_dbn_apply -------------------------------------------------------------------------------
enum ApplyIn { kApMean = kAffNumIn, kApW, kApNumIn };

// The num_groups attribute of the data-pass ops (their only one).
int64_t groups_attr(const char* op, const AttrMap& attrs) {
  Attrs a(op, attrs, {"num_groups"});
  const int64_t G = a.get_int("num_groups", 1);
  if (G <= 0) fail(op, ": num_groups must be positive; got ", G);
  return G;
}

int64_t apply_groups(const AttrMap& attrs) { return groups_attr(kApply, attrs); }

MXReturnValue apply_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kApply, [&] {
    apply_groups(attrs);
    *num_in = kApNumIn;
    *num_out = 1;
    return MX_SUCCESS;
  });
}

MXReturnValue apply_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                          std::vector<std::vector<unsigned>>* out) {
  return guarded(kApply, [&] {
    const auto& ds = (*in)[kAffData];
    if (data_shape_unknown(kApply, ds)) return MX_SUCCESS;
    const GroupDims gs = data_groups(kApply, to_i64(ds), apply_groups(attrs));
    infer_affine_param_shapes(kApply, in, gs);
    const std::vector<unsigned> want[] = {
        {static_cast<unsigned>(gs.C)},
        {static_cast<unsigned>(gs.G), static_cast<unsigned>(gs.D), static_cast<unsigned>(gs.D)}};
    for (int i : {kApMean, kApW}) {
      auto& sh = (*in)[i];
      if (shape_unknown(sh)) {
        sh = want[i - kApMean];
      } else if (sh != want[i - kApMean]) {
        fail(kApply, ": ", i == kApMean ? "mean" : "W", " must have shape ",
             shape_str(to_i64(want[i - kApMean])), " for data shape ", shape_str(to_i64(ds)),
             "; got ", shape_str(to_i64(sh)));
      }
    }
    (*out)[0] = ds;
    return MX_SUCCESS;
  });
}

MXReturnValue apply_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kApply, [&] {
    apply_groups(attrs);
    const int t = infer_affine_param_types(kApply, in);
    for (int i : {kApMean, kApW}) {
      if ((*in)[i] != kDtypeUnknown && (*in)[i] != kFloat64)
        fail(kApply, ": ", i == kApMean ? "mean" : "W", " must be float64; got ",
             mx_dtype_name((*in)[i]));
      (*in)[i] = kFloat64;  // unknown: the one dtype they take
    }
    (*out)[0] = t;
    return MX_SUCCESS;
  });
}

// Args of both directions from the forward inputs `ins` (data, gamma, beta, mean, W).
DbnApplyArgs apply_args(const AttrMap& attrs, const MXTensor* ins, const OpResource& res) {
  if (device_of(kApply, ins[kAffData], res).gpu)
    fail(kApply, ": gpu contexts are not supported yet (cpu only)");
  DbnApplyArgs a;
  a.dims = data_groups(kApply, ins[kAffData].shape, apply_groups(attrs));
  check_param_tensor(kApply, ins[kAffGamma], a.dims, kAffGamma);
  check_param_tensor(kApply, ins[kAffBeta], a.dims, kAffBeta);
  if (ins[kApMean].size() != a.dims.C || ins[kApW].size() != a.dims.G * a.dims.D * a.dims.D)
    fail(kApply, ": mean / W do not match data shape ", shape_str(ins[kAffData].shape));
  a.dtype = to_dtype(ins[kAffData].dtype);
  a.param_dtype = to_dtype(ins[kAffGamma].dtype);
  a.x = ins[kAffData].data_ptr;
  a.gamma = ins[kAffGamma].data_ptr;
  a.beta = ins[kAffBeta].data_ptr;
  a.mean = static_cast<const double*>(ins[kApMean].data_ptr);
  a.W = static_cast<const double*>(ins[kApW].data_ptr);
  return a;
}

MXReturnValue apply_fwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                        std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kApply, [&] {
    DbnApplyArgs a = apply_args(attrs, in->data(), res);
    a.y = (*out)[0].data_ptr;
    if (const char* e = dbn_apply_cpu(a)) fail(kApply, ": ", e);
    return MX_SUCCESS;
  });
}

// Backward inputs: [dout, data, gamma, beta, mean, W, out]; outputs: one gradient per input.
MXReturnValue apply_bwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                        std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kApply, [&] {
    if (in->size() != 2 + kApNumIn || out->size() != kApNumIn)
      fail(kApply, ": backward expected ", 2 + kApNumIn, " inputs and ", int(kApNumIn),
           " outputs; got ", in->size(), " and ", out->size());
    DbnApplyArgs a = apply_args(attrs, in->data() + 1, res);
    check_grad_dtype(kApply, (*in)[0], (*in)[1].dtype, "out");
    a.dy = (*in)[0].data_ptr;
    a.dx = (*out)[kAffData].data_ptr;
    a.dgamma = (*out)[kAffGamma].data_ptr;
    a.dbeta = (*out)[kAffBeta].data_ptr;
    a.dmean = static_cast<double*>((*out)[kApMean].data_ptr);
    a.dW = static_cast<double*>((*out)[kApW].data_ptr);
    if (const char* e = dbn_apply_bwd_cpu(a)) fail(kApply, ": ", e);
    return MX_SUCCESS;
  });
}


// ---- gn_dbn_local_sums, gn_dbn_local_cov ----------------------------------------------------------
enum CovIn { kCovData = 0, kCovTot, kCovNumIn };
enum CovOut { kCovCov = 0, kCovMean, kCovNumOut };

template <const char* Op, int NumIn, int NumOut>
MXReturnValue local_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(Op, [&] {
    groups_attr(Op, attrs);
    *num_in = NumIn;
    *num_out = NumOut;
    return MX_SUCCESS;
  });
}

// (G, D + 1): the shape of the sums (and of gn_dbn_local_cov's tot) for data in dims d.
std::vector<unsigned> tot_shape(const GroupDims& d) {
  return {static_cast<unsigned>(d.G), static_cast<unsigned>(d.D + 1)};
}

// Data dims from the data input; the D limit of the whitening step (gn_dbn_whiten) for cov.
GroupDims local_dims(const char* op, const std::vector<int64_t>& shape, const AttrMap& attrs) {
  const GroupDims d = data_groups(op, shape, groups_attr(op, attrs));
  if (op == kLocalCov && d.D > kDbnMaxGroupSizeCpu)
    fail(op, ": group size C / num_groups must be <= ", kDbnMaxGroupSizeCpu, "; got ", d.D,
         " for data shape ", shape_str(shape));
  return d;
}

MXReturnValue sums_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                         std::vector<std::vector<unsigned>>* out) {
  return guarded(kSums, [&] {
    const auto& ds = (*in)[0];
    if (data_shape_unknown(kSums, ds)) return MX_SUCCESS;
    (*out)[0] = tot_shape(local_dims(kSums, to_i64(ds), attrs));
    return MX_SUCCESS;
  });
}

MXReturnValue cov_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                        std::vector<std::vector<unsigned>>* out) {
  return guarded(kLocalCov, [&] {
    const auto& ds = (*in)[kCovData];
    if (data_shape_unknown(kLocalCov, ds)) return MX_SUCCESS;
    const GroupDims d = local_dims(kLocalCov, to_i64(ds), attrs);
    const std::vector<unsigned> want = tot_shape(d);
    auto& ts = (*in)[kCovTot];
    if (shape_unknown(ts)) {
      ts = want;
    } else if (ts != want) {
      fail(kLocalCov, ": tot must have shape ", shape_str(to_i64(want)), " for data shape ",
           shape_str(to_i64(ds)), "; got ", shape_str(to_i64(ts)));
    }
    const unsigned G = static_cast<unsigned>(d.G), D = static_cast<unsigned>(d.D);
    (*out)[kCovCov] = {G, D, D};
    (*out)[kCovMean] = {static_cast<unsigned>(d.C)};
    return MX_SUCCESS;
  });
}

// data: any float dtype; the other inputs (tot) and every output float64.
template <const char* Op>
MXReturnValue local_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(Op, [&] {
    groups_attr(Op, attrs);
    check_float_data(Op, (*in)[0]);
    for (size_t i = 1; i < in->size(); ++i) {
      int& t = (*in)[i];
      if (t != kDtypeUnknown && t != kFloat64)
        fail(Op, ": tot must be float64; got ", mx_dtype_name(t));
      t = kFloat64;
    }
    for (int& t : *out) t = kFloat64;
    return MX_SUCCESS;
  });
}

// Args from the forward inputs (data[, tot]) after the run-time checks (cpu, sizes).
DbnLocalArgs local_args(const char* op, const AttrMap& attrs, const MXTensor* ins, int num_in,
                        const OpResource& res) {
  if (device_of(op, ins[0], res).gpu) fail(op, ": gpu contexts are not supported yet (cpu only)");
  DbnLocalArgs a;
  a.dims = local_dims(op, ins[0].shape, attrs);
  a.dtype = to_dtype(ins[0].dtype);
  a.x = ins[0].data_ptr;
  if (num_in > kCovTot) {
    if (ins[kCovTot].size() != a.dims.G * (a.dims.D + 1) || ins[kCovTot].dtype != kFloat64)
      fail(op, ": tot must be float64 of shape (", a.dims.G, ", ", a.dims.D + 1,
           ") for data shape ", shape_str(ins[0].shape), "; got ", shape_str(ins[kCovTot].shape));
    a.tot = static_cast<double*>(ins[kCovTot].data_ptr);
  }
  return a;
}

MXReturnValue sums_fwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                       std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kSums, [&] {
    DbnLocalArgs a = local_args(kSums, attrs, in->data(), 1, res);
    a.tot = static_cast<double*>((*out)[0].data_ptr);
    if (const char* e = dbn_local_sums_cpu(a)) fail(kSums, ": ", e);
    return MX_SUCCESS;
  });
}

// Backward inputs: [dtot, data, tot]; output: ddata.
MXReturnValue sums_bwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                       std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kSums, [&] {
    if (in->size() != 3 || out->size() != 1)
      fail(kSums, ": backward expected 3 inputs and 1 output; got ", in->size(), " and ",
           out->size());
    DbnLocalArgs a = local_args(kSums, attrs, in->data() + 1, 1, res);
    check_grad_dtype(kSums, (*in)[0], kFloat64, "tot");
    a.dtot = static_cast<double*>((*in)[0].data_ptr);
    a.dx = (*out)[0].data_ptr;
    if (const char* e = dbn_local_sums_bwd_cpu(a)) fail(kSums, ": ", e);
    return MX_SUCCESS;
  });
}

MXReturnValue cov_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kLocalCov, [&] {
    DbnLocalArgs a = local_args(kLocalCov, attrs, in->data(), kCovNumIn, res);
    a.cov = static_cast<double*>((*out)[kCovCov].data_ptr);
    a.mean = static_cast<double*>((*out)[kCovMean].data_ptr);
    if (const char* e = dbn_local_cov_cpu(a)) fail(kLocalCov, ": ", e);
    return MX_SUCCESS;
  });
}

// Backward inputs: [dcov, dmean, data, tot, cov, mean]; outputs: ddata, dtot.
MXReturnValue cov_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kLocalCov, [&] {
    if (in->size() != 2 * kCovNumOut + kCovNumIn || out->size() != kCovNumIn)
      fail(kLocalCov, ": backward expected ", 2 * kCovNumOut + kCovNumIn, " inputs and ",
           int(kCovNumIn), " outputs; got ", in->size(), " and ", out->size());
    const MXTensor* ins = in->data() + kCovNumOut;
    const MXTensor* outs = ins + kCovNumIn;
    DbnLocalArgs a = local_args(kLocalCov, attrs, ins, kCovNumIn, res);
    check_grad_dtype(kLocalCov, (*in)[kCovCov], kFloat64, "cov");
    check_grad_dtype(kLocalCov, (*in)[kCovMean], kFloat64, "mean");
    a.cov = static_cast<double*>(outs[kCovCov].data_ptr);
    a.mean = static_cast<double*>(outs[kCovMean].data_ptr);
    a.dcov = static_cast<const double*>((*in)[kCovCov].data_ptr);
    a.dmean = static_cast<const double*>((*in)[kCovMean].data_ptr);
    a.dx = (*out)[kCovData].data_ptr;
    a.dtot = static_cast<double*>((*out)[kCovTot].data_ptr);
    if (const char* e = dbn_local_cov_bwd_cpu(a)) fail(kLocalCov, ": ", e);
    return MX_SUCCESS;
  });
}

}  // namespace
}  // namespace mxa
}  // namespace gn_mx

REGISTER_OP(gn_dbn_apply)
    .setParseAttrs(gn_mx::mxa::apply_parse)
    .setInferType(gn_mx::mxa::apply_type)
    .setInferShape(gn_mx::mxa::apply_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kApply>)
    .setForward(gn_mx::mxa::apply_fwd, "cpu")
    .setBackward(gn_mx::mxa::apply_bwd, "cpu");

REGISTER_OP(gn_sync_sum)
    .setParseAttrs(gn_mx::mxa::sum_parse)
    .setInferType(gn_mx::mxa::sum_type)
    .setInferShape(gn_mx::mxa::sum_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kSum>)
    .setForward(gn_mx::mxa::sum_fwd, "cpu")
    .setBackward(gn_mx::mxa::sum_bwd, "cpu");

REGISTER_OP(gn_dbn_whiten)
    .setParseAttrs(gn_mx::mxa::whiten_parse)
    .setInferType(gn_mx::mxa::whiten_type)
    .setInferShape(gn_mx::mxa::whiten_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kWhiten>)
    .setMutateInputs(gn_mx::mxa::whiten_mutate)
    .setForward(gn_mx::mxa::whiten_fwd, "cpu")
    .setBackward(gn_mx::mxa::whiten_bwd, "cpu");

REGISTER_OP(gn_dbn_local_sums)
    .setParseAttrs(gn_mx::mxa::local_parse<gn_mx::mxa::kSums, 1, 1>)
    .setInferType(gn_mx::mxa::local_type<gn_mx::mxa::kSums>)
    .setInferShape(gn_mx::mxa::sums_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kSums>)
    .setForward(gn_mx::mxa::sums_fwd, "cpu")
    .setBackward(gn_mx::mxa::sums_bwd, "cpu");

REGISTER_OP(gn_dbn_local_cov)
    .setParseAttrs(gn_mx::mxa::local_parse<gn_mx::mxa::kLocalCov, gn_mx::mxa::kCovNumIn,
                                           gn_mx::mxa::kCovNumOut>)
    .setInferType(gn_mx::mxa::local_type<gn_mx::mxa::kLocalCov>)
    .setInferShape(gn_mx::mxa::cov_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kLocalCov>)
    .setForward(gn_mx::mxa::cov_fwd, "cpu")
    .setBackward(gn_mx::mxa::cov_bwd, "cpu");
