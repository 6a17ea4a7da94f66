/*
 * dbn_ops.cc: MXNet registration of gn_dbn (training) and gn_dbn_inference (see shared API.md).
 * Math lives in ../kernels/dbn.h (framework-free); this file validates and maps tensors.
 *
 * gn_dbn:           inputs  data (N, C, *spatial), running_mean (C,), running_projection (G, D, D)
 *                   outputs out (data dtype), mean (C,), eigvec (G, D, D), eigval (G, D)  [AccT]
 *                   The last three exist only for the backward; gradients arriving for them are
 *                   ignored (they are not differentiable outputs).
 * gn_dbn_inference: inputs  the same three;  output out.
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

enum DbnIn { kData = 0, kRunMean, kRunProj, kNumIn };
enum DbnOut { kOut = 0, kMean, kEigvec, kEigval, kNumOut };
// gn_dbn backward inputs: [dout, dmean, deigvec, deigval, data, running_mean, running_projection,
//                          out, mean, eigvec, eigval]
enum DbnBwdIn {
  kBdOut = 0, kBdMean, kBdEigvec, kBdEigval,
  kBData, kBRunMean, kBRunProj,
  kBOut, kBMean, kBEigvec, kBEigval, kBNumIn
};
// gn_dbn_inference backward inputs: [dout, data, running_mean, running_projection, out]
enum DbnInfBwdIn { kIBdOut = 0, kIBData, kIBRunMean, kIBRunProj, kIBOut, kIBNumIn };

struct DbnParams {
  int64_t num_groups = 1;
  double eps = 1e-5;
  double momentum = 0.9;
};

DbnParams parse_dbn(const char* op, const AttrMap& attrs, bool training) {
  DbnParams p;
  if (training) {
    Attrs a(op, attrs, {"num_groups", "eps", "momentum"});
    p.num_groups = a.get_int("num_groups", 1);
    p.eps = a.get_float("eps", 1e-5);
    p.momentum = a.get_float("momentum", 0.9);
  } else {
    Attrs a(op, attrs, {"num_groups"});
    p.num_groups = a.get_int("num_groups", 1);
  }
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

std::vector<unsigned> mean_shape(const GroupShape& gs) { return {static_cast<unsigned>(gs.C)}; }
std::vector<unsigned> proj_shape(const GroupShape& gs) {
  return {static_cast<unsigned>(gs.G), static_cast<unsigned>(gs.D), static_cast<unsigned>(gs.D)};
}

const char* stat_name(int i) { return i == kRunMean ? "running_mean" : "running_projection"; }

// ---- shared inferShape / inferType for both ops ----------------------------------------------
MXReturnValue dbn_shape_common(const char* op, bool training, const AttrMap& attrs,
                               std::vector<std::vector<unsigned>>* in,
                               std::vector<std::vector<unsigned>>* out) {
  const DbnParams p = parse_dbn(op, attrs, training);
  const auto& ds = (*in)[kData];
  if (shape_unknown(ds)) return MX_SUCCESS;
  const GroupShape gs = data_groups(op, to_i64(ds), p.num_groups);
  // lib_api shape inference does not know the device: the CPU limit here, the CUDA one (smaller)
  // first thing in the callbacks (tensor_groups); one message format (dbn_group_size_error).
  if (const char* e = dbn_group_size_error(gs.D, kDbnMaxGroupSizeCpu, "cpu")) fail(op, ": ", e);
  for (int i : {kRunMean, kRunProj}) {
    const std::vector<unsigned> want = i == kRunMean ? mean_shape(gs) : proj_shape(gs);
    auto& s = (*in)[i];
    if (shape_unknown(s)) {
      s = want;  // deferred init: running-statistics shapes come from data
    } else if (s != want) {
      fail(op, ": ", stat_name(i), " must have shape ", shape_str(to_i64(want)),
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
  const int t = (*in)[kData];
  check_float_data(op, t);
  for (int i : {kRunMean, kRunProj}) {
    const int st = (*in)[i];
    if (st == kDtypeUnknown) continue;
    if (!is_float_dtype(st))
      fail(op, ": ", stat_name(i), " must be a float type; got ", mx_dtype_name(st));
    if (t != kDtypeUnknown && st != t && st != mx_acc_dtype(t))
      fail(op, ": ", stat_name(i), " dtype must equal the data dtype (or be float32 with float16 "
           "data); got ", stat_name(i), " ", mx_dtype_name(st), " with data ", mx_dtype_name(t));
  }
  if (t == kDtypeUnknown) return MX_SUCCESS;
  // Unknown running-statistics dtypes default to the data dtype (Gluon deferred init).
  if ((*in)[kRunMean] == kDtypeUnknown)
    (*in)[kRunMean] = (*in)[kRunProj] != kDtypeUnknown ? (*in)[kRunProj] : t;
  if ((*in)[kRunProj] == kDtypeUnknown) (*in)[kRunProj] = (*in)[kRunMean];
  if ((*in)[kRunMean] != (*in)[kRunProj])
    fail(op, ": running_mean and running_projection must have the same dtype; got ",
         mx_dtype_name((*in)[kRunMean]), " and ", mx_dtype_name((*in)[kRunProj]));
  if (training) check_dbn_eps(op, p.eps, t, (*in)[kRunProj]);
  (*out)[kOut] = t;
  if (training) (*out)[kMean] = (*out)[kEigvec] = (*out)[kEigval] = mx_acc_dtype(t);
  return MX_SUCCESS;
}

MXReturnValue dbn_mutate(const AttrMap& attrs, std::vector<int>* idx) {
  return guarded(kDbn, [&] {
    idx->push_back(kRunMean);
    idx->push_back(kRunProj);
    return MX_SUCCESS;
  });
}

// Forward/backward re-check what they index with: the data shape, the statistics' sizes and the
// device's group-size limit (checked before any workspace or launch).
GroupShape tensor_groups(const char* op, const Device& dev, const MXTensor& x,
                         const MXTensor& rmean, const MXTensor& rproj, int64_t G) {
  const GroupShape gs = data_groups(op, x.shape, G);
  if (rmean.size() != gs.C || rproj.size() != gs.G * gs.D * gs.D)
    fail(op, ": running statistics do not match data shape ", shape_str(x.shape));
  const int64_t limit = dev.gpu ? kDbnMaxGroupSizeCuda : kDbnMaxGroupSizeCpu;
  if (const char* e = dbn_group_size_error(gs.D, limit, dev.name())) fail(op, ": ", e);
  return gs;
}

// ---- parseAttrs / inferShape / inferType of both ops (kTraining: gn_dbn) ------------------------
template <const char* kOp, bool kTraining>
MXReturnValue dbn_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kOp, [&] {
    parse_dbn(kOp, attrs, kTraining);
    *num_in = kNumIn;
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

// ---- gn_dbn -------------------------------------------------------------------------------------
MXReturnValue dbn_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbn, [&] {
    const DbnParams p = parse_dbn(kDbn, attrs, true);
    const MXTensor& x = (*in)[kData];
    const Device dev = device_of(kDbn, x, res);
    const GroupShape gs =
        tensor_groups(kDbn, dev, x, (*in)[kRunMean], (*in)[kRunProj], p.num_groups);
    DbnFwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.stat_dtype = to_dtype((*in)[kRunMean].dtype);
    a.x = x.data_ptr;
    a.y = (*out)[kOut].data_ptr;
    a.mean = (*out)[kMean].data_ptr;
    a.eigvec = (*out)[kEigvec].data_ptr;
    a.eigval = (*out)[kEigval].data_ptr;
    a.running_mean = (*in)[kRunMean].data_ptr;
    a.running_proj = (*in)[kRunProj].data_ptr;
    a.N = gs.N; a.C = gs.C; a.G = gs.G; a.S = gs.S;
    a.eps = p.eps;
    a.momentum = p.momentum;
    run(kDbn, dev, kFwdKernel, a);
    return MX_SUCCESS;
  });
}

MXReturnValue dbn_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbn, [&] {
    const DbnParams p = parse_dbn(kDbn, attrs, true);
    if (in->size() != kBNumIn || out->size() != kNumIn)
      fail(kDbn, ": backward expected ", int(kBNumIn), " inputs and ", int(kNumIn),
           " outputs; got ", in->size(), " and ", out->size());
    const MXTensor& x = (*in)[kBData];
    const Device dev = device_of(kDbn, x, res);
    const GroupShape gs =
        tensor_groups(kDbn, dev, x, (*in)[kBRunMean], (*in)[kBRunProj], p.num_groups);
    check_grad_dtype(kDbn, (*in)[kBdOut], x.dtype, "out");
    DbnBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.dy = (*in)[kBdOut].data_ptr;
    a.x = x.data_ptr;
    a.mean = (*in)[kBMean].data_ptr;
    a.eigvec = (*in)[kBEigvec].data_ptr;
    a.eigval = (*in)[kBEigval].data_ptr;
    a.dx = (*out)[kData].data_ptr;
    a.N = gs.N; a.C = gs.C; a.G = gs.G; a.S = gs.S;
    run(kDbn, dev, kBwdKernel, a, {&(*out)[kRunMean], &(*out)[kRunProj]});
    return MX_SUCCESS;
  });
}

// ---- gn_dbn_inference -----------------------------------------------------------------------------
DbnInferenceArgs inference_args(const MXTensor& x, const MXTensor& rmean, const MXTensor& rproj,
                                const GroupShape& gs) {
  DbnInferenceArgs a;
  a.dtype = to_dtype(x.dtype);
  a.stat_dtype = to_dtype(rproj.dtype);
  a.running_mean = rmean.data_ptr;
  a.running_proj = rproj.data_ptr;
  a.N = gs.N; a.C = gs.C; a.G = gs.G; a.S = gs.S;
  return a;
}

MXReturnValue inf_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbnInf, [&] {
    const DbnParams p = parse_dbn(kDbnInf, attrs, false);
    const MXTensor& x = (*in)[kData];
    const Device dev = device_of(kDbnInf, x, res);
    const GroupShape gs =
        tensor_groups(kDbnInf, dev, x, (*in)[kRunMean], (*in)[kRunProj], p.num_groups);
    DbnInferenceArgs a = inference_args(x, (*in)[kRunMean], (*in)[kRunProj], gs);
    a.x = x.data_ptr;
    a.y = (*out)[kOut].data_ptr;
    run(kDbnInf, dev, kInfFwdKernel, a);
    return MX_SUCCESS;
  });
}

// dx = P^T dy per group (the running statistics are constants of this op).
MXReturnValue inf_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kDbnInf, [&] {
    const DbnParams p = parse_dbn(kDbnInf, attrs, false);
    if (in->size() != kIBNumIn || out->size() != kNumIn)
      fail(kDbnInf, ": backward expected ", int(kIBNumIn), " inputs and ", int(kNumIn),
           " outputs; got ", in->size(), " and ", out->size());
    const MXTensor& x = (*in)[kIBData];
    const Device dev = device_of(kDbnInf, x, res);
    const GroupShape gs =
        tensor_groups(kDbnInf, dev, x, (*in)[kIBRunMean], (*in)[kIBRunProj], p.num_groups);
    check_grad_dtype(kDbnInf, (*in)[kIBdOut], x.dtype, "out");
    DbnInferenceArgs a = inference_args(x, (*in)[kIBRunMean], (*in)[kIBRunProj], gs);
    a.x = (*in)[kIBdOut].data_ptr;
    a.y = (*out)[kData].data_ptr;
    run(kDbnInf, dev, kInfBwdKernel, a, {&(*out)[kRunMean], &(*out)[kRunProj]});
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
