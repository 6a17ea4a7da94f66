/*
 * group_norm_ops.cc: MXNet registration of gn_moments and gn_group_norm (contract: docs/reference/ops.md).
 * Validation: attributes in parseAttrs, shapes in inferShape, dtypes in inferType, so a bad call
 * raises MXNetError synchronously at the call site; forward/backward re-check only what they index
 * with, fill the kernel's Args and run() it on the callback's device (device.h). Math lives in
 * ../kernels/group_norm.h (framework-free).
 *
 * Backward inputs (lib_api): [grad of every output, every forward input, every forward output].
 * Backward outputs: one gradient per forward input. lib_api passes no `req`: every output is written.
 */
#include <cmath>
#include <string>
#include <vector>

#include "device.h"
#include "group_norm_grad2_ops.h"
#include "validate.h"
#include "../kernels/group_norm.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

constexpr char kMoments[] = "gn_moments";
constexpr char kGroupNorm[] = "gn_group_norm";

const Kernel<MomentsArgs> kMomentsFwdKernel{moments_cpu, nullptr, GNMX_CUDA_ENTRY(moments_cuda),
                                            GNMX_CUDA_ENTRY(moments_workspace_cuda)};
const Kernel<MomentsBwdArgs> kMomentsBwdKernel{moments_bwd_cpu, nullptr,
                                               GNMX_CUDA_ENTRY(moments_bwd_cuda), nullptr};
const Kernel<GroupNormFwdArgs> kGnFwdKernel{group_norm_fwd_cpu, nullptr,
                                            GNMX_CUDA_ENTRY(group_norm_fwd_cuda),
                                            GNMX_CUDA_ENTRY(group_norm_fwd_workspace_cuda)};
const Kernel<GroupNormBwdArgs> kGnBwdKernel{group_norm_bwd_cpu, group_norm_bwd_workspace_cpu,
                                            GNMX_CUDA_ENTRY(group_norm_bwd_cuda),
                                            GNMX_CUDA_ENTRY(group_norm_bwd_workspace_cuda)};

struct GnParams {
  int64_t num_groups = 1;
  int64_t axis = 1;  // the channel axis: 1 or the last (data_groups() checks it against the rank)
  double eps = 1e-5;
  Act act = Act::kNone;
};

// gn_group_norm's optional act_type attribute (added after the first release: absent = 'none', so
// older symbols load unchanged).
Act parse_act(const char* op, const AttrMap& attrs) {
  auto it = attrs.find("act_type");
  if (it == attrs.end() || it->second == "none") return Act::kNone;
  if (it->second == "relu") return Act::kRelu;
  if (it->second == "silu") return Act::kSilu;
  fail(op, ": attribute act_type must be one of 'none', 'relu', 'silu'; got '", it->second, "'");
}

int64_t parse_num_groups(const char* op, const Attrs& a) {
  const int64_t G = a.get_int("num_groups", 1);
  if (const char* e = num_groups_error(G)) fail(op, ": ", e);
  return G;
}

// The optional axis attribute of gn_moments and gn_group_norm (added after act_type: absent = 1,
// channels first, so older symbols load unchanged; -1 / ndim-1 = channels last). Any integer parses;
// data_groups() accepts only 1 or the last axis of the data, once the rank is known.
int64_t parse_axis(const Attrs& a) { return a.get_int("axis", 1); }

// gn_moments' attributes: num_groups, axis.
GnParams parse_moments(const char* op, const AttrMap& attrs) {
  GnParams p;
  Attrs a(op, attrs, {"num_groups", "axis"});
  p.num_groups = parse_num_groups(op, a);
  p.axis = parse_axis(a);
  return p;
}

// gn_group_norm's attributes: num_groups, eps, act_type, axis (`op` names the op in messages).
GnParams parse_gn(const char* op, const AttrMap& attrs) {
  GnParams p;
  Attrs a(op, attrs, {"num_groups", "eps", "act_type", "axis"});
  p.num_groups = parse_num_groups(op, a);
  p.axis = parse_axis(a);
  p.eps = a.get_float("eps", 1e-5);
  p.act = parse_act(op, attrs);
  if (!(p.eps >= 0) || !std::isfinite(p.eps))
    fail(op, ": eps must be a finite number >= 0; got ", p.eps);
  return p;
}

std::vector<unsigned> stat_shape(const GroupDims& gs) {
  return {static_cast<unsigned>(gs.N), static_cast<unsigned>(gs.G)};
}

template <const char* kOp, GnParams (*kParse)(const char*, const AttrMap&), int kNumIn, int kNumOut>
MXReturnValue parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kOp, [&] {
    kParse(kOp, attrs);
    *num_in = kNumIn;
    *num_out = kNumOut;
    return MX_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// gn_moments: data -> mean (N, G), var (N, G)

enum MomentsOut { kMMean = 0, kMVar, kMNumOut };
// backward inputs: [dmean, dvar, data, mean, var]
enum MomentsBwdIn { kMBdMean = 0, kMBdVar, kMBData, kMBMean, kMBVar };

MXReturnValue moments_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kMoments, [&] {
    const int t = (*in)[kAffData];
    check_float_data(kMoments, t);
    if (t == kDtypeUnknown) return MX_SUCCESS;
    (*out)[kMMean] = (*out)[kMVar] = mx_acc_dtype(t);
    return MX_SUCCESS;
  });
}

MXReturnValue moments_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                            std::vector<std::vector<unsigned>>* out) {
  return guarded(kMoments, [&] {
    const GnParams p = parse_moments(kMoments, attrs);
    const auto& ds = (*in)[kAffData];
    if (data_shape_unknown(kMoments, ds)) return MX_SUCCESS;
    const GroupDims gs = data_groups(kMoments, to_i64(ds), p.num_groups, p.axis);
    (*out)[kMMean] = (*out)[kMVar] = stat_shape(gs);
    return MX_SUCCESS;
  });
}

MXReturnValue moments_fwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kMoments, [&] {
    const GnParams p = parse_moments(kMoments, attrs);
    const MXTensor& x = (*in)[kAffData];
    const Device dev = device_of(kMoments, x, res);
    const GroupDims gs = data_groups(kMoments, x.shape, p.num_groups, p.axis);
    MomentsArgs a;
    a.dtype = to_dtype(x.dtype);
    a.x = x.data_ptr;
    a.mean = (*out)[kMMean].data_ptr;
    a.var = (*out)[kMVar].data_ptr;
    a.dims = gs;
    run(kMoments, dev, kMomentsFwdKernel, a);
    return MX_SUCCESS;
  });
}

MXReturnValue moments_bwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kMoments, [&] {
    const GnParams p = parse_moments(kMoments, attrs);
    const MXTensor& x = (*in)[kMBData];
    const Device dev = device_of(kMoments, x, res);
    const GroupDims gs = data_groups(kMoments, x.shape, p.num_groups, p.axis);
    const int acc = mx_acc_dtype(x.dtype);
    check_grad_dtype(kMoments, (*in)[kMBdMean], acc, "mean");
    check_grad_dtype(kMoments, (*in)[kMBdVar], acc, "var");
    MomentsBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.dmean = (*in)[kMBdMean].data_ptr;
    a.dvar = (*in)[kMBdVar].data_ptr;
    a.x = x.data_ptr;
    a.mean = (*in)[kMBMean].data_ptr;
    a.dx = (*out)[kAffData].data_ptr;
    a.dims = gs;
    run(kMoments, dev, kMomentsBwdKernel, a);
    return MX_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// gn_group_norm: data, gamma (C,), beta (C,) -> out, mean (N, G), rstd (N, G)

enum GnOut { kOut = 0, kMean, kRstd, kGnNumOut };
// backward inputs: [dout, dmean, drstd, data, gamma, beta, out, mean, rstd]
enum GnBwdIn { kBdOut = 0, kBdMean, kBdRstd, kBData, kBGamma, kBBeta, kBOut, kBMean, kBRstd };

MXReturnValue gn_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs);
    const int t = infer_affine_param_types(kGroupNorm, in);
    if (t == kDtypeUnknown) return MX_SUCCESS;
    check_eps_in_acc(kGroupNorm, p.eps, t == kFloat64, mx_dtype_name(t));
    (*out)[kOut] = t;
    (*out)[kMean] = (*out)[kRstd] = mx_acc_dtype(t);
    return MX_SUCCESS;
  });
}

MXReturnValue gn_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                       std::vector<std::vector<unsigned>>* out) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs);
    const auto& ds = (*in)[kAffData];
    if (data_shape_unknown(kGroupNorm, ds)) return MX_SUCCESS;
    const GroupDims gs = data_groups(kGroupNorm, to_i64(ds), p.num_groups, p.axis);
    infer_affine_param_shapes(kGroupNorm, in, gs);
    (*out)[kOut] = ds;
    (*out)[kMean] = (*out)[kRstd] = stat_shape(gs);
    return MX_SUCCESS;
  });
}

MXReturnValue gn_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                     const OpResource& res) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs);
    const MXTensor& x = (*in)[kAffData];
    const Device dev = device_of(kGroupNorm, x, res);
    const GroupDims gs = data_groups(kGroupNorm, x.shape, p.num_groups, p.axis);
    check_param_tensor(kGroupNorm, (*in)[kAffGamma], gs, kAffGamma);
    check_param_tensor(kGroupNorm, (*in)[kAffBeta], gs, kAffBeta);
    GroupNormFwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kAffGamma].dtype);
    a.x = x.data_ptr;
    a.gamma = (*in)[kAffGamma].data_ptr;
    a.beta = (*in)[kAffBeta].data_ptr;
    a.y = (*out)[kOut].data_ptr;
    a.mean = (*out)[kMean].data_ptr;
    a.rstd = (*out)[kRstd].data_ptr;
    a.dims = gs;
    a.eps = p.eps;
    a.act = p.act;
    run(kGroupNorm, dev, kGnFwdKernel, a);
    return MX_SUCCESS;
  });
}

MXReturnValue gn_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                     const OpResource& res) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs);
    const MXTensor& x = (*in)[kBData];
    const Device dev = device_of(kGroupNorm, x, res);
    const GroupDims gs = data_groups(kGroupNorm, x.shape, p.num_groups, p.axis);
    static_assert(kBdOut == 0 && kBdMean == 1 && kBdRstd == 2 && kBData == 3 && kBGamma == 4 &&
                      kBRstd == kBMean + 1 && kAffData == 0 && kAffGamma == 1,
                  "gn_bwd_args's input / output order");
    GroupNormBwdArgs a = gn_bwd_args(kGroupNorm, *in, *out, kBMean, gs);
    a.beta = (*in)[kBBeta].data_ptr;
    a.dbeta = (*out)[kAffBeta].data_ptr;
    a.eps = p.eps;
    a.act = p.act;
    run(kGroupNorm, dev, kGnBwdKernel, a);
    return MX_SUCCESS;
  });
}

}  // namespace

// For the re-registered _backward_gn_group_norm / _backward_gn_moments (group_norm_grad2_ops.cc).
GroupNormAttrs group_norm_attrs(const AttrMap& attrs) {
  const GnParams p = parse_gn(kGroupNorm, attrs);
  return GroupNormAttrs{p.num_groups, p.act, p.axis};
}
MXReturnValue group_norm_backward(const AttrMap& attrs, std::vector<MXTensor>* in,
                                  std::vector<MXTensor>* out, const OpResource& res) {
  return gn_bwd(attrs, in, out, res);
}
GroupNormAttrs moments_attrs(const AttrMap& attrs) {
  const GnParams p = parse_moments(kMoments, attrs);
  return GroupNormAttrs{p.num_groups, Act::kNone, p.axis};
}
MXReturnValue moments_backward(const AttrMap& attrs, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource& res) {
  return moments_bwd(attrs, in, out, res);
}

}  // namespace mxa
}  // namespace gn_mx

REGISTER_OP(gn_moments)
    .setParseAttrs(gn_mx::mxa::parse<gn_mx::mxa::kMoments, gn_mx::mxa::parse_moments, 1,
                                     gn_mx::mxa::kMNumOut>)
    .setInferType(gn_mx::mxa::moments_type)
    .setInferShape(gn_mx::mxa::moments_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kMoments>)
    .setForward(gn_mx::mxa::moments_fwd, "cpu")
    .setBackward(gn_mx::mxa::moments_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::moments_fwd, "gpu")
    .setBackward(gn_mx::mxa::moments_bwd, "gpu")
#endif
    ;

REGISTER_OP(gn_group_norm)
    .setParseAttrs(gn_mx::mxa::parse<gn_mx::mxa::kGroupNorm, gn_mx::mxa::parse_gn,
                                     gn_mx::mxa::kAffNumIn, gn_mx::mxa::kGnNumOut>)
    .setInferType(gn_mx::mxa::gn_type)
    .setInferShape(gn_mx::mxa::gn_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kGroupNorm>)
    .setForward(gn_mx::mxa::gn_fwd, "cpu")
    .setBackward(gn_mx::mxa::gn_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::gn_fwd, "gpu")
    .setBackward(gn_mx::mxa::gn_bwd, "gpu")
#endif
    ;
