/*
 * ops.cc: MXNet registration of gn_moments and gn_group_norm (see shared API.md), and the library's
 * initialize(). Validation lives here: attributes in parseAttrs, shapes in inferShape, dtypes in
 * inferType, so a bad call raises MXNetError synchronously at the call site; forward/backward re-check
 * only what they index with. Math lives in ../kernels (framework-free).
 *
 * Backward inputs (lib_api): [grad of every output, every forward input, every forward output].
 * Backward outputs: one gradient per forward input. lib_api passes no `req`: every output is written.
 */
#include <cmath>
#include <string>
#include <vector>

#include "tensor_view.h"
#include "../kernels/affine.h"
#include "../kernels/group_norm.h"
#include "gpu_ops.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

// ---------------------------------------------------------------------------------------------
// Shared checks

struct GnParams {
  int64_t num_groups = 1;
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

GnParams parse_gn(const char* op, const AttrMap& attrs, bool has_eps) {
  GnParams p;
  if (has_eps) {
    Attrs a(op, attrs, {"num_groups", "eps", "act_type"});
    p.num_groups = a.get_int("num_groups", 1);
    p.eps = a.get_float("eps", 1e-5);
    p.act = parse_act(op, attrs);
  } else {
    Attrs a(op, attrs, {"num_groups"});
    p.num_groups = a.get_int("num_groups", 1);
  }
  if (p.num_groups <= 0) fail(op, ": num_groups must be positive; got ", p.num_groups);
  if (!(p.eps >= 0) || !std::isfinite(p.eps))
    fail(op, ": eps must be a finite number >= 0; got ", p.eps);
  return p;
}

GroupShape check_data_shape(const char* op, const std::vector<int64_t>& shape, int64_t G) {
  GroupShape gs;
  const std::string msg = check_group_shape(op, shape, G, &gs);
  if (!msg.empty()) throw OpError(msg);
  return gs;
}

void check_float_data(const char* op, int t) {
  if (t != -1 && !is_float_dtype(t))
    fail(op, ": data must be float16, float32 or float64; got ", mx_dtype_name(t));
}

GroupShape tensor_groups(const char* op, const MXTensor& t, int64_t G) {
  return check_data_shape(op, t.shape, G);
}

// ---------------------------------------------------------------------------------------------
// gn_moments: data -> mean (N, G), var (N, G)

enum MomentsIn { kMData = 0, kMNumIn };
enum MomentsOut { kMMean = 0, kMVar, kMNumOut };
// backward inputs: [dmean, dvar, data, mean, var]
enum MomentsBwdIn { kMBdMean = 0, kMBdVar, kMBData, kMBMean, kMBVar };

const char* kMoments = "gn_moments";

MXReturnValue moments_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kMoments, [&] {
    parse_gn(kMoments, attrs, false);
    *num_in = kMNumIn;
    *num_out = kMNumOut;
    return MX_SUCCESS;
  });
}

MXReturnValue moments_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kMoments, [&] {
    const int t = (*in)[kMData];
    check_float_data(kMoments, t);
    if (t == -1) return MX_SUCCESS;
    const int acc = static_cast<int>(acc_dtype(to_dtype(t)));
    (*out)[kMMean] = acc;
    (*out)[kMVar] = acc;
    return MX_SUCCESS;
  });
}

MXReturnValue moments_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                            std::vector<std::vector<unsigned>>* out) {
  return guarded(kMoments, [&] {
    const GnParams p = parse_gn(kMoments, attrs, false);
    const auto& ds = (*in)[kMData];
    if (shape_unknown(ds)) return MX_SUCCESS;
    const GroupShape gs = check_data_shape(kMoments, to_i64(ds), p.num_groups);
    const std::vector<unsigned> stat = {static_cast<unsigned>(gs.N), static_cast<unsigned>(gs.G)};
    (*out)[kMMean] = stat;
    (*out)[kMVar] = stat;
    return MX_SUCCESS;
  });
}

MXReturnValue moments_fwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kMoments, [&] {
    const GnParams p = parse_gn(kMoments, attrs, false);
    const MXTensor& x = (*in)[kMData];
    const GroupShape gs = tensor_groups(kMoments, x, p.num_groups);
    MomentsArgs a;
    a.dtype = to_dtype(x.dtype);
    a.x = x.data_ptr;
    a.mean = (*out)[kMMean].data_ptr;
    a.var = (*out)[kMVar].data_ptr;
    a.N = gs.N; a.C = gs.C; a.G = gs.G; a.S = gs.S;
    if (on_gpu(x)) return gpu_result(kMoments, moments_gpu(a, res));
    const char* err = moments_cpu(a);
    if (err) fail(kMoments, ": ", err);
    return MX_SUCCESS;
  });
}

MXReturnValue moments_bwd(const AttrMap& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource& res) {
  return guarded(kMoments, [&] {
    const GnParams p = parse_gn(kMoments, attrs, false);
    const MXTensor& x = (*in)[kMBData];
    const GroupShape gs = tensor_groups(kMoments, x, p.num_groups);
    const int acc = static_cast<int>(acc_dtype(to_dtype(x.dtype)));
    check_grad_dtype(kMoments, (*in)[kMBdMean], acc, "mean");
    check_grad_dtype(kMoments, (*in)[kMBdVar], acc, "var");
    MomentsBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.dmean = (*in)[kMBdMean].data_ptr;
    a.dvar = (*in)[kMBdVar].data_ptr;
    a.x = x.data_ptr;
    a.mean = (*in)[kMBMean].data_ptr;
    a.dx = (*out)[kMData].data_ptr;
    a.N = gs.N; a.C = gs.C; a.G = gs.G; a.S = gs.S;
    if (on_gpu(x)) return gpu_result(kMoments, moments_bwd_gpu(a, res));
    const char* err = moments_bwd_cpu(a);
    if (err) fail(kMoments, ": ", err);
    return MX_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// gn_group_norm: data, gamma (C,), beta (C,) -> out, mean (N, G), rstd (N, G)

enum GnIn { kData = 0, kGamma, kBeta, kGnNumIn };
enum GnOut { kOut = 0, kMean, kRstd, kGnNumOut };
// backward inputs: [dout, dmean, drstd, data, gamma, beta, out, mean, rstd]
enum GnBwdIn { kBdOut = 0, kBdMean, kBdRstd, kBData, kBGamma, kBBeta, kBOut, kBMean, kBRstd };

const char* kGroupNorm = "gn_group_norm";
const char* kParamNames[] = {"data", "gamma", "beta"};

MXReturnValue gn_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kGroupNorm, [&] {
    parse_gn(kGroupNorm, attrs, true);
    *num_in = kGnNumIn;
    *num_out = kGnNumOut;
    return MX_SUCCESS;
  });
}

// Shared by ops with (data, gamma (C,), beta (C,)) inputs at positions 0, 1, 2: checks the
// dtypes, defaults unknown parameter dtypes to the data dtype (what Gluon's deferred init expects)
// and returns the data dtype (-1 while unknown).
int infer_affine_param_types(const char* op, std::vector<int>* in) {
  const int t = (*in)[kData];
  check_float_data(op, t);
  for (int i : {kGamma, kBeta}) {
    const int pt = (*in)[i];
    if (pt == -1) continue;
    if (!is_float_dtype(pt))
      fail(op, ": ", kParamNames[i], " must be a float type; got ", mx_dtype_name(pt));
    if (t != -1 && pt != t && !(t == 2 && pt == 0))
      fail(op, ": ", kParamNames[i], " dtype must equal the data dtype (or be float32 "
           "with float16 data); got ", kParamNames[i], " ", mx_dtype_name(pt), " with data ",
           mx_dtype_name(t));
  }
  if (t == -1) return t;
  if ((*in)[kGamma] == -1) (*in)[kGamma] = t;
  if ((*in)[kBeta] == -1) (*in)[kBeta] = t;
  if ((*in)[kGamma] != (*in)[kBeta])
    fail(op, ": gamma and beta must have the same dtype; got ", mx_dtype_name((*in)[kGamma]),
         " and ", mx_dtype_name((*in)[kBeta]));
  return t;
}

// Fills unknown gamma/beta shapes with (C,) from data (deferred init) and checks known ones.
void infer_affine_param_shapes(const char* op, std::vector<std::vector<unsigned>>* in,
                               const GroupShape& gs) {
  const std::vector<unsigned> cshape = {static_cast<unsigned>(gs.C)};
  for (int i : {kGamma, kBeta}) {
    auto& s = (*in)[i];
    if (shape_unknown(s)) {
      s = cshape;
    } else if (s != cshape) {
      fail(op, ": ", kParamNames[i], " must have shape (", gs.C, ",) for data shape ",
           shape_str(to_i64((*in)[kData])), "; got ", shape_str(to_i64(s)));
    }
  }
}

MXReturnValue gn_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs, true);
    const int t = infer_affine_param_types(kGroupNorm, in);
    if (t == -1) return MX_SUCCESS;
    check_eps_in_acc(kGroupNorm, p.eps, t == 1, mx_dtype_name(t));
    const int acc = static_cast<int>(acc_dtype(to_dtype(t)));
    (*out)[kOut] = t;
    (*out)[kMean] = acc;
    (*out)[kRstd] = acc;
    return MX_SUCCESS;
  });
}

MXReturnValue gn_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                       std::vector<std::vector<unsigned>>* out) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs, true);
    const auto& ds = (*in)[kData];
    if (shape_unknown(ds)) return MX_SUCCESS;
    const GroupShape gs = check_data_shape(kGroupNorm, to_i64(ds), p.num_groups);
    infer_affine_param_shapes(kGroupNorm, in, gs);
    const std::vector<unsigned> stat = {static_cast<unsigned>(gs.N), static_cast<unsigned>(gs.G)};
    (*out)[kOut] = ds;
    (*out)[kMean] = stat;
    (*out)[kRstd] = stat;
    return MX_SUCCESS;
  });
}

void fill_gn_dims(const GroupShape& gs, int64_t* N, int64_t* C, int64_t* G, int64_t* S) {
  *N = gs.N; *C = gs.C; *G = gs.G; *S = gs.S;
}

void check_param_tensor(const MXTensor& t, const GroupShape& gs, int idx, const char* op = kGroupNorm) {
  if (t.shape.size() != 1 || t.shape[0] != gs.C)
    fail(op, ": ", kParamNames[idx], " must have shape (", gs.C, ",); got ", shape_str(t.shape));
}

MXReturnValue gn_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                     const OpResource& res) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs, true);
    const MXTensor& x = (*in)[kData];
    const GroupShape gs = tensor_groups(kGroupNorm, x, p.num_groups);
    check_param_tensor((*in)[kGamma], gs, kGamma);
    check_param_tensor((*in)[kBeta], gs, kBeta);
    GroupNormFwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kGamma].dtype);
    a.x = x.data_ptr;
    a.gamma = (*in)[kGamma].data_ptr;
    a.beta = (*in)[kBeta].data_ptr;
    a.y = (*out)[kOut].data_ptr;
    a.mean = (*out)[kMean].data_ptr;
    a.rstd = (*out)[kRstd].data_ptr;
    fill_gn_dims(gs, &a.N, &a.C, &a.G, &a.S);
    a.eps = p.eps;
    a.act = p.act;
    if (on_gpu(x)) return gpu_result(kGroupNorm, group_norm_fwd_gpu(a, res));
    const char* err = group_norm_fwd_cpu(a);
    if (err) fail(kGroupNorm, ": ", err);
    return MX_SUCCESS;
  });
}

MXReturnValue gn_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                     const OpResource& res) {
  return guarded(kGroupNorm, [&] {
    const GnParams p = parse_gn(kGroupNorm, attrs, true);
    const MXTensor& x = (*in)[kBData];
    const GroupShape gs = tensor_groups(kGroupNorm, x, p.num_groups);
    const int acc = static_cast<int>(acc_dtype(to_dtype(x.dtype)));
    check_grad_dtype(kGroupNorm, (*in)[kBdOut], x.dtype, "out");
    check_grad_dtype(kGroupNorm, (*in)[kBdMean], acc, "mean");
    check_grad_dtype(kGroupNorm, (*in)[kBdRstd], acc, "rstd");
    GroupNormBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kBGamma].dtype);
    a.dy = (*in)[kBdOut].data_ptr;
    a.dmean = (*in)[kBdMean].data_ptr;
    a.drstd = (*in)[kBdRstd].data_ptr;
    a.x = x.data_ptr;
    a.mean = (*in)[kBMean].data_ptr;
    a.rstd = (*in)[kBRstd].data_ptr;
    a.gamma = (*in)[kBGamma].data_ptr;
    a.beta = (*in)[kBBeta].data_ptr;
    a.dx = (*out)[kData].data_ptr;
    a.dgamma = (*out)[kGamma].data_ptr;
    a.dbeta = (*out)[kBeta].data_ptr;
    fill_gn_dims(gs, &a.N, &a.C, &a.G, &a.S);
    a.eps = p.eps;
    a.act = p.act;
    if (on_gpu(x)) return gpu_result(kGroupNorm, group_norm_bwd_gpu(a, res));
    Workspace ws;
    const size_t off = ws.reserve(group_norm_bwd_workspace_cpu(a));
    ws.commit(res, false, kGroupNorm);
    a.workspace = ws.at(off);
    const char* err = group_norm_bwd_cpu(a);
    if (err) fail(kGroupNorm, ": ", err);
    return MX_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// gn_channel_affine: data, gamma (C,), beta (C,) -> out = data * gamma[c] + beta[c]
// The per-channel affine that DecorrelatedBatchNorm applies after whitening, fused into one pass
// (multi-precision like gn_group_norm: float32 gamma/beta with float16 data).

enum AffOut { kAffOut = 0, kAffNumOut };
// backward inputs: [dout, data, gamma, beta, out]
enum AffBwdIn { kAffBdOut = 0, kAffBData, kAffBGamma, kAffBBeta, kAffBOut };

const char* kAffine = "gn_channel_affine";

GroupShape affine_shape(const std::vector<int64_t>& shape) {
  return check_data_shape(kAffine, shape, 1);
}

MXReturnValue aff_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kAffine, [&] {
    Attrs a(kAffine, attrs, {});
    *num_in = kGnNumIn;
    *num_out = kAffNumOut;
    return MX_SUCCESS;
  });
}

MXReturnValue aff_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kAffine, [&] {
    const int t = infer_affine_param_types(kAffine, in);
    if (t != -1) (*out)[kAffOut] = t;
    return MX_SUCCESS;
  });
}

MXReturnValue aff_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                        std::vector<std::vector<unsigned>>* out) {
  return guarded(kAffine, [&] {
    const auto& ds = (*in)[kData];
    if (shape_unknown(ds)) return MX_SUCCESS;
    infer_affine_param_shapes(kAffine, in, affine_shape(to_i64(ds)));
    (*out)[kAffOut] = ds;
    return MX_SUCCESS;
  });
}

MXReturnValue aff_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kAffine, [&] {
    const MXTensor& x = (*in)[kData];
    const GroupShape gs = affine_shape(x.shape);
    check_param_tensor((*in)[kGamma], gs, kGamma, kAffine);
    check_param_tensor((*in)[kBeta], gs, kBeta, kAffine);
    AffineArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kGamma].dtype);
    a.x = x.data_ptr;
    a.gamma = (*in)[kGamma].data_ptr;
    a.beta = (*in)[kBeta].data_ptr;
    a.y = (*out)[kAffOut].data_ptr;
    a.N = gs.N; a.C = gs.C; a.S = gs.S;
    if (on_gpu(x)) return gpu_result(kAffine, affine_fwd_gpu(a, res));
    const char* err = affine_fwd_cpu(a);
    if (err) fail(kAffine, ": ", err);
    return MX_SUCCESS;
  });
}

MXReturnValue aff_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kAffine, [&] {
    const MXTensor& x = (*in)[kAffBData];
    const GroupShape gs = affine_shape(x.shape);
    check_grad_dtype(kAffine, (*in)[kAffBdOut], x.dtype, "out");
    AffineBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kAffBGamma].dtype);
    a.dy = (*in)[kAffBdOut].data_ptr;
    a.x = x.data_ptr;
    a.gamma = (*in)[kAffBGamma].data_ptr;
    a.dx = (*out)[kData].data_ptr;
    a.dgamma = (*out)[kGamma].data_ptr;
    a.dbeta = (*out)[kBeta].data_ptr;
    a.N = gs.N; a.C = gs.C; a.S = gs.S;
    if (on_gpu(x)) return gpu_result(kAffine, affine_bwd_gpu(a, res));
    const char* err = affine_bwd_cpu(a);
    if (err) fail(kAffine, ": ", err);
    return MX_SUCCESS;
  });
}

MXReturnValue moments_stype(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return dense_storage(kMoments, in, out);
}
MXReturnValue gn_stype(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return dense_storage(kGroupNorm, in, out);
}
MXReturnValue aff_stype(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return dense_storage(kAffine, in, out);
}

}  // namespace
}  // namespace mxa
}  // namespace gn_mx

REGISTER_OP(gn_moments)
    .setParseAttrs(gn_mx::mxa::moments_parse)
    .setInferType(gn_mx::mxa::moments_type)
    .setInferShape(gn_mx::mxa::moments_shape)
    .setInferSType(gn_mx::mxa::moments_stype)
    .setForward(gn_mx::mxa::moments_fwd, "cpu")
    .setBackward(gn_mx::mxa::moments_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::moments_fwd, "gpu")
    .setBackward(gn_mx::mxa::moments_bwd, "gpu")
#endif
    ;

REGISTER_OP(gn_group_norm)
    .setParseAttrs(gn_mx::mxa::gn_parse)
    .setInferType(gn_mx::mxa::gn_type)
    .setInferShape(gn_mx::mxa::gn_shape)
    .setInferSType(gn_mx::mxa::gn_stype)
    .setForward(gn_mx::mxa::gn_fwd, "cpu")
    .setBackward(gn_mx::mxa::gn_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::gn_fwd, "gpu")
    .setBackward(gn_mx::mxa::gn_bwd, "gpu")
#endif
    ;

REGISTER_OP(gn_channel_affine)
    .setParseAttrs(gn_mx::mxa::aff_parse)
    .setInferType(gn_mx::mxa::aff_type)
    .setInferShape(gn_mx::mxa::aff_shape)
    .setInferSType(gn_mx::mxa::aff_stype)
    .setForward(gn_mx::mxa::aff_fwd, "cpu")
    .setBackward(gn_mx::mxa::aff_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::aff_fwd, "gpu")
    .setBackward(gn_mx::mxa::aff_bwd, "gpu")
#endif
    ;

MXReturnValue initialize(int version) {
  if (version >= 10900) return MX_SUCCESS;
  gn_mx::mxa::ErrorList::set("gn_mx: needs MXNet >= 1.9.0 (got version code " +
                             std::to_string(version) +
                             "); install mxnet==1.9.1 or mxnet-cu112==1.9.1 with numpy<1.24");
  return MX_FAIL;
}
