/*
 * dbn_ops.cc: MXNet registration of gn_dbn (training) and gn_dbn_inference (contract: docs/reference/ops.md).
 * Math lives in ../kernels/dbn.h (framework-free); this file validates and maps tensors.
 *
 * gn_dbn:           inputs  data (N, C, *spatial), running_mean (C,), running_projection (G, D, D)
 *                   outputs out (data dtype), mean (C,), eigvec (G, D, D), eigval (G, D)  [AccT]
 *                   The last three exist only for the backward; gradients arriving for them are
 *                   ignored (they are not differentiable outputs).
 * gn_dbn_inference: inputs  the same three;  output out.
 * Attributes whitening ('zca' default | 'iternorm') and iterations (IterNorm's T, default 5, in
 *                   [1, kDbnMaxIterations = 10]; gn_dbn only): the training whitening (dbn.h); the running statistics
 *                   and gn_dbn_inference are the same for both.
 * Attribute affine (default False; both ops): the per-channel affine fused into the op,
 *                   out = gamma[c] * xhat + beta[c], with gamma (C,), beta (C,) as inputs 1 and 2
 *                   (data, gamma, beta, running_mean, running_projection, as BatchNorm orders them);
 *                   their gradients come from the same passes. Without it (the symbols exported
 *                   before it existed) the ops are unchanged and the graph applies gn_channel_affine.
 * Both ops declare running_mean / running_projection as mutable inputs (setMutateInputs), so they
 * are auxiliary states of any graph (exported symbols included), like BatchNorm's moving stats.
 * gn_dbn updates them in place; gn_dbn_inference only reads them.
 *
 * Backward inputs (lib_api): [grad of every output, every forward input, every forward output];
 * backward outputs: one gradient per forward input. Aux-state gradients are written as zeros.
 * MXNet gives library ops no is_train flag: the Gluon block picks the op (python/gn_mx/nn.py).
 * Callbacks validate, fill the kernel's Args and run() it on their device (device.h), the same way
 * on cpu and gpu; the group-size limit is the device's (kDbnMaxGroupSize*, dbn.h).
 */
#include <cmath>
#include <string>
#include <vector>

#include "device.h"
#include "validate.h"
#include "../kernels/dbn.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

constexpr char kDbn[] = "gn_dbn";
constexpr char kDbnInf[] = "gn_dbn_inference";

const Kernel<DbnFwdArgs> kFwdKernel{dbn_fwd_cpu, dbn_fwd_workspace_cpu,
                                    GNMX_CUDA_ENTRY(dbn_fwd_cuda),
                                    GNMX_CUDA_ENTRY(dbn_fwd_workspace_cuda)};
const Kernel<DbnBwdArgs> kBwdKernel{dbn_bwd_cpu, dbn_bwd_workspace_cpu,
                                    GNMX_CUDA_ENTRY(dbn_bwd_cuda),
                                    GNMX_CUDA_ENTRY(dbn_bwd_workspace_cuda)};
const Kernel<DbnInferenceArgs> kInfFwdKernel{dbn_inference_cpu, dbn_inference_workspace_cpu,
                                             GNMX_CUDA_ENTRY(dbn_inference_cuda),
                                             GNMX_CUDA_ENTRY(dbn_inference_workspace_cuda)};
const Kernel<DbnInferenceArgs> kInfBwdKernel{dbn_inference_bwd_cpu, dbn_inference_workspace_cpu,
                                             GNMX_CUDA_ENTRY(dbn_inference_bwd_cuda),
                                             GNMX_CUDA_ENTRY(dbn_inference_workspace_cuda)};

enum DbnOut { kOut = 0, kMean, kEigvec, kEigval, kNumOut };

// The inputs' positions: data, [gamma, beta,] running_mean, running_projection.
// Backward inputs (lib_api): gn_dbn [dout, dmean, deigvec, deigval, inputs..., out, mean, eigvec,
// eigval]; gn_dbn_inference [dout, inputs..., out]. Backward outputs: one per input.
struct DbnInputs {
  int data = 0, gamma = -1, beta = -1, rmean = 1, rproj = 2, num = 3;
};
DbnInputs dbn_inputs(bool affine) {
  DbnInputs i;
  if (affine) {
    i.gamma = 1; i.beta = 2; i.rmean = 3; i.rproj = 4; i.num = 5;
  }
  return i;
}

struct DbnParams {
  int64_t num_groups = 1;
  double eps = 1e-5;
  double momentum = 0.9;
  bool affine = false;
  DbnWhitening whitening = DbnWhitening::kZca;
  int iterations = 5;
  DbnInputs in;
};

// A boolean attribute: True/False/1/0 (Python's str(bool) or an int), any case.
bool get_bool(const char* op, const AttrMap& attrs, const char* key, bool dflt) {
  auto it = attrs.find(key);
  if (it == attrs.end()) return dflt;
  std::string t;
  for (char c : it->second)
    if (c != ' ') t += static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (t == "true" || t == "1") return true;
  if (t == "false" || t == "0") return false;
  fail(op, ": attribute ", key, " must be True or False; got '", it->second, "'");
  return dflt;
}

DbnParams parse_dbn(const char* op, const AttrMap& attrs, bool training) {
  DbnParams p;
  if (training) {
    Attrs a(op, attrs, {"num_groups", "eps", "momentum", "affine", "whitening", "iterations"});
    p.num_groups = a.get_int("num_groups", 1);
    p.eps = a.get_float("eps", 1e-5);
    p.momentum = a.get_float("momentum", 0.9);
    const auto w = attrs.find("whitening");
    const std::string wn = w == attrs.end() ? "zca" : w->second;
    if (wn == "zca") {
      p.whitening = DbnWhitening::kZca;
    } else if (wn == "iternorm") {
      p.whitening = DbnWhitening::kIterNorm;
    } else {
      fail(op, ": whitening must be 'zca' or 'iternorm'; got '", wn, "'");
    }
    const int64_t it = a.get_int("iterations", 5);
    if (it < 1 || it > kDbnMaxIterations)
      fail(op, ": iterations must be in [1, ", kDbnMaxIterations, "]; got ", it);
    p.iterations = static_cast<int>(it);
  } else {
    Attrs a(op, attrs, {"num_groups", "affine"});
    p.num_groups = a.get_int("num_groups", 1);
  }
  p.affine = get_bool(op, attrs, "affine", false);
  p.in = dbn_inputs(p.affine);
  if (p.num_groups <= 0) fail(op, ": num_groups must be positive; got ", p.num_groups);
  // eps > 0 keeps Sigma = cov + eps I positive definite even when N * spatial <= group size.
  if (!(p.eps > 0) || !std::isfinite(p.eps))
    fail(op, ": eps must be a finite number > 0; got ", p.eps);
  if (!(p.momentum >= 0 && p.momentum <= 1))
    fail(op, ": momentum must be in [0, 1]; got ", p.momentum);
  return p;
}

// eps against the dtypes it meets: Sigma = cov + eps I is whitened in float64, but the whitening
// matrix (up to 1/sqrt(eps) in a direction without variance: m = 1, constant channels) is stored in
// the accumulation dtype and in the running statistics' dtype.
void check_dbn_eps(const char* op, double eps, int data_dtype, int stat_dtype) {
  check_eps_in_acc(op, eps, data_dtype == kFloat64, mx_dtype_name(data_dtype));
  if (stat_dtype == kFloat16 && eps < limits::kMinEpsFloat16Stats)
    fail(op, ": eps=", eps, " is too small for float16 running statistics (the running projection "
         "can reach 1/sqrt(eps), float16 holds at most 65504): use eps >= ",
         limits::kMinEpsFloat16Stats, " or float32 running statistics");
}

std::vector<unsigned> mean_shape(const GroupDims& gs) { return {static_cast<unsigned>(gs.C)}; }
std::vector<unsigned> proj_shape(const GroupDims& gs) {
  return {static_cast<unsigned>(gs.G), static_cast<unsigned>(gs.D), static_cast<unsigned>(gs.D)};
}

const char* stat_name(bool mean) { return mean ? "running_mean" : "running_projection"; }

// ---- shared inferShape / inferType for both ops ----------------------------------------------
MXReturnValue dbn_shape_common(const char* op, bool training, const AttrMap& attrs,
                               std::vector<std::vector<unsigned>>* in,
                               std::vector<std::vector<unsigned>>* out) {
  const DbnParams p = parse_dbn(op, attrs, training);
  const auto& ds = (*in)[p.in.data];
  if (data_shape_unknown(op, ds)) return MX_SUCCESS;
  const GroupDims gs = data_groups(op, to_i64(ds), p.num_groups);
  // lib_api shape inference does not know the device: the CPU limit here, the CUDA one (smaller)
  // first thing in the callbacks (tensor_groups); one message format (dbn_group_size_error).
  if (const char* e = dbn_group_size_error(gs.D, kDbnMaxGroupSizeCpu, "cpu")) fail(op, ": ", e);
  if (p.affine) infer_affine_param_shapes(op, in, gs);  // data, gamma, beta at kAff* positions
  for (int i : {p.in.rmean, p.in.rproj}) {
    const bool is_mean = i == p.in.rmean;
    const std::vector<unsigned> want = is_mean ? mean_shape(gs) : proj_shape(gs);
    auto& s = (*in)[i];
    if (shape_unknown(s)) {
      s = want;  // deferred init: running-statistics shapes come from data
    } else if (s != want) {
      fail(op, ": ", stat_name(is_mean), " must have shape ", shape_str(to_i64(want)),
           " for data shape ", shape_str(to_i64(ds)), " and num_groups=", p.num_groups, "; got ",
           shape_str(to_i64(s)));
    }
  }
  (*out)[kOut] = ds;
  if (training) {
    (*out)[kMean] = mean_shape(gs);
    (*out)[kEigvec] = proj_shape(gs);
    (*out)[kEigval] = {static_cast<unsigned>(gs.G), static_cast<unsigned>(gs.D)};
  }
  return MX_SUCCESS;
}

MXReturnValue dbn_type_common(const char* op, bool training, const AttrMap& attrs,
                              std::vector<int>* in, std::vector<int>* out) {
  const DbnParams p = parse_dbn(op, attrs, training);
  const int t = p.affine ? infer_affine_param_types(op, in) : (*in)[p.in.data];
  check_float_data(op, t);
  const int rm = p.in.rmean, rp = p.in.rproj;
  for (int i : {rm, rp}) {
    const int st = (*in)[i];
    const char* name = stat_name(i == rm);
    if (st == kDtypeUnknown) continue;
    if (!is_float_dtype(st))
      fail(op, ": ", name, " must be a float type; got ", mx_dtype_name(st));
    if (t != kDtypeUnknown && st != t && st != mx_acc_dtype(t))
      fail(op, ": ", name, " dtype must equal the data dtype (or be float32 with float16 "
           "data); got ", name, " ", mx_dtype_name(st), " with data ", mx_dtype_name(t));
  }
  if (t == kDtypeUnknown) return MX_SUCCESS;
  // Unknown running-statistics dtypes default to the data dtype (Gluon deferred init).
  if ((*in)[rm] == kDtypeUnknown) (*in)[rm] = (*in)[rp] != kDtypeUnknown ? (*in)[rp] : t;
  if ((*in)[rp] == kDtypeUnknown) (*in)[rp] = (*in)[rm];
  if ((*in)[rm] != (*in)[rp])
    fail(op, ": running_mean and running_projection must have the same dtype; got ",
         mx_dtype_name((*in)[rm]), " and ", mx_dtype_name((*in)[rp]));
  if (training) check_dbn_eps(op, p.eps, t, (*in)[rp]);
  (*out)[kOut] = t;
  if (training) (*out)[kMean] = (*out)[kEigvec] = (*out)[kEigval] = mx_acc_dtype(t);
  return MX_SUCCESS;
}

MXReturnValue dbn_mutate(const AttrMap& attrs, std::vector<int>* idx) {
  return guarded(kDbn, [&] {
    const DbnInputs in = dbn_inputs(get_bool(kDbn, attrs, "affine", false));
    idx->push_back(in.rmean);
    idx->push_back(in.rproj);
    return MX_SUCCESS;
  });
}

// Forward/backward re-check what they index with: the data shape, the statistics' sizes, gamma /
// beta with the affine, and the device's group-size limit (checked before any workspace or launch).
// `ins` points at the forward inputs (data first) inside the callback's tensor list.
GroupDims tensor_groups(const char* op, const Device& dev, const DbnParams& p,
                         const MXTensor* ins) {
  const MXTensor& x = ins[p.in.data];
  const GroupDims gs = data_groups(op, x.shape, p.num_groups);
  if (ins[p.in.rmean].size() != gs.C || ins[p.in.rproj].size() != gs.G * gs.D * gs.D)
    fail(op, ": running statistics do not match data shape ", shape_str(x.shape));
  if (p.affine) {
    check_param_tensor(op, ins[p.in.gamma], gs, kAffGamma);
    check_param_tensor(op, ins[p.in.beta], gs, kAffBeta);
  }
  const int64_t limit = dev.gpu ? kDbnMaxGroupSizeCuda : kDbnMaxGroupSizeCpu;
  if (const char* e = dbn_group_size_error(gs.D, limit, dev.name())) fail(op, ": ", e);
  return gs;
}

// ---- parseAttrs / inferShape / inferType of both ops (kTraining: gn_dbn) ------------------------
template <const char* kOp, bool kTraining>
MXReturnValue dbn_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kOp, [&] {
    const DbnParams p = parse_dbn(kOp, attrs, kTraining);
    *num_in = p.in.num;
    *num_out = kTraining ? kNumOut : 1;
    return MX_SUCCESS;
  });
}

template <const char* kOp, bool kTraining>
MXReturnValue dbn_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                        std::vector<std::vector<unsigned>>* out) {
  return guarded(kOp, [&] { return dbn_shape_common(kOp, kTraining, attrs, in, out); });
}

template <const char* kOp, bool kTraining>
MXReturnValue dbn_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kOp, [&] { return dbn_type_common(kOp, kTraining, attrs, in, out); });
}

// The backward's tensor count: (gradients of the outputs, the inputs, the outputs) in, one
// gradient per input out.
void check_bwd_arity(const char* op, const DbnParams& p, int num_out,
                     const std::vector<MXTensor>* in, const std::vector<MXTensor>* out) {
  const size_t want_in = 2 * num_out + p.in.num;
  if (in->size() != want_in || out->size() != static_cast<size_t>(p.in.num))
    fail(op, ": backward expected ", want_in, " inputs and ", p.in.num, " outputs; got ",
         in->size(), " and ", out->size());
}

// ---- gn_dbn -------------------------------------------------------------------------------------
MXReturnValue dbn_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbn, [&] {
    const DbnParams p = parse_dbn(kDbn, attrs, true);
    const MXTensor* ins = in->data();
    const MXTensor& x = ins[p.in.data];
    const Device dev = device_of(kDbn, x, res);
    const GroupDims gs = tensor_groups(kDbn, dev, p, ins);
    DbnFwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.stat_dtype = to_dtype(ins[p.in.rmean].dtype);
    a.x = x.data_ptr;
    a.y = (*out)[kOut].data_ptr;
    a.mean = (*out)[kMean].data_ptr;
    a.eigvec = (*out)[kEigvec].data_ptr;
    a.eigval = (*out)[kEigval].data_ptr;
    a.running_mean = ins[p.in.rmean].data_ptr;
    a.running_proj = ins[p.in.rproj].data_ptr;
    if (p.affine) {
      a.param_dtype = to_dtype(ins[p.in.gamma].dtype);
      a.gamma = ins[p.in.gamma].data_ptr;
      a.beta = ins[p.in.beta].data_ptr;
    }
    a.dims = gs;
    a.eps = p.eps;
    a.momentum = p.momentum;
    a.whitening = p.whitening;
    a.iterations = p.iterations;
    run(kDbn, dev, kFwdKernel, a);
    return MX_SUCCESS;
  });
}

MXReturnValue dbn_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbn, [&] {
    const DbnParams p = parse_dbn(kDbn, attrs, true);
    check_bwd_arity(kDbn, p, kNumOut, in, out);
    const MXTensor* ins = in->data() + kNumOut;           // the forward inputs
    const MXTensor* outs = ins + p.in.num;                // the forward outputs
    const MXTensor& x = ins[p.in.data];
    const Device dev = device_of(kDbn, x, res);
    const GroupDims gs = tensor_groups(kDbn, dev, p, ins);
    check_grad_dtype(kDbn, (*in)[kOut], x.dtype, "out");
    DbnBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.dy = (*in)[kOut].data_ptr;
    a.x = x.data_ptr;
    a.mean = outs[kMean].data_ptr;
    a.eigvec = outs[kEigvec].data_ptr;
    a.eigval = outs[kEigval].data_ptr;
    a.dx = (*out)[p.in.data].data_ptr;
    if (p.affine) {
      a.param_dtype = to_dtype(ins[p.in.gamma].dtype);
      a.gamma = ins[p.in.gamma].data_ptr;
      a.dgamma = (*out)[p.in.gamma].data_ptr;
      a.dbeta = (*out)[p.in.beta].data_ptr;
    }
    a.dims = gs;
    a.whitening = p.whitening;
    a.iterations = p.iterations;
    run(kDbn, dev, kBwdKernel, a, {&(*out)[p.in.rmean], &(*out)[p.in.rproj]});
    return MX_SUCCESS;
  });
}

// ---- gn_dbn_inference -----------------------------------------------------------------------------
DbnInferenceArgs inference_args(const DbnParams& p, const MXTensor* ins, const GroupDims& gs) {
  DbnInferenceArgs a;
  a.dtype = to_dtype(ins[p.in.data].dtype);
  a.stat_dtype = to_dtype(ins[p.in.rproj].dtype);
  a.running_mean = ins[p.in.rmean].data_ptr;
  a.running_proj = ins[p.in.rproj].data_ptr;
  if (p.affine) {
    a.param_dtype = to_dtype(ins[p.in.gamma].dtype);
    a.gamma = ins[p.in.gamma].data_ptr;
  }
  a.dims = gs;
  return a;
}

MXReturnValue inf_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbnInf, [&] {
    const DbnParams p = parse_dbn(kDbnInf, attrs, false);
    const MXTensor* ins = in->data();
    const MXTensor& x = ins[p.in.data];
    const Device dev = device_of(kDbnInf, x, res);
    const GroupDims gs = tensor_groups(kDbnInf, dev, p, ins);
    DbnInferenceArgs a = inference_args(p, ins, gs);
    a.x = x.data_ptr;
    a.y = (*out)[kOut].data_ptr;
    if (p.affine) a.beta = ins[p.in.beta].data_ptr;
    run(kDbnInf, dev, kInfFwdKernel, a);
    return MX_SUCCESS;
  });
}

// dx = P^T dy per group (the running statistics are constants of this op); with the affine
// dx = P^T (gamma dy), dgamma = sum(dy xhat), dbeta = sum(dy).
MXReturnValue inf_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbnInf, [&] {
    const DbnParams p = parse_dbn(kDbnInf, attrs, false);
    check_bwd_arity(kDbnInf, p, 1, in, out);
    const MXTensor* ins = in->data() + 1;
    const MXTensor& x = ins[p.in.data];
    const Device dev = device_of(kDbnInf, x, res);
    const GroupDims gs = tensor_groups(kDbnInf, dev, p, ins);
    check_grad_dtype(kDbnInf, (*in)[0], x.dtype, "out");
    DbnInferenceArgs a = inference_args(p, ins, gs);
    a.x = (*in)[0].data_ptr;
    a.y = (*out)[p.in.data].data_ptr;
    if (p.affine) {
      a.data = x.data_ptr;
      a.dgamma = (*out)[p.in.gamma].data_ptr;
      a.dbeta = (*out)[p.in.beta].data_ptr;
    }
    run(kDbnInf, dev, kInfBwdKernel, a, {&(*out)[p.in.rmean], &(*out)[p.in.rproj]});
    return MX_SUCCESS;
  });
}

}  // namespace
}  // namespace mxa
}  // namespace gn_mx

REGISTER_OP(gn_dbn)
    .setParseAttrs(gn_mx::mxa::dbn_parse<gn_mx::mxa::kDbn, true>)
    .setInferType(gn_mx::mxa::dbn_type<gn_mx::mxa::kDbn, true>)
    .setInferShape(gn_mx::mxa::dbn_shape<gn_mx::mxa::kDbn, true>)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kDbn>)
    .setMutateInputs(gn_mx::mxa::dbn_mutate)
    .setForward(gn_mx::mxa::dbn_fwd, "cpu")
    .setBackward(gn_mx::mxa::dbn_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::dbn_fwd, "gpu")
    .setBackward(gn_mx::mxa::dbn_bwd, "gpu")
#endif
    ;

REGISTER_OP(gn_dbn_inference)
    .setParseAttrs(gn_mx::mxa::dbn_parse<gn_mx::mxa::kDbnInf, false>)
    .setInferType(gn_mx::mxa::dbn_type<gn_mx::mxa::kDbnInf, false>)
    .setInferShape(gn_mx::mxa::dbn_shape<gn_mx::mxa::kDbnInf, false>)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kDbnInf>)
    .setMutateInputs(gn_mx::mxa::dbn_mutate)
    .setForward(gn_mx::mxa::inf_fwd, "cpu")
    .setBackward(gn_mx::mxa::inf_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::inf_fwd, "gpu")
    .setBackward(gn_mx::mxa::inf_bwd, "gpu")
#endif
    ;
