/*
 * ws_ops.cc: MXNet registration of gn_weight_standardize (Weight Standardization, Qiao et al. 2019;
 * contract: docs/reference/ops.md):
 *   weight (O, *fan_in dims), gain (O,) -> out (weight's shape), mean (O,), rstd (O,)
 *   mean[o] = 1/F sum_f w[o, f],  var[o] = 1/F sum_f (w[o, f] - mean[o])^2  (F = prod(shape[1:]))
 *   out[o, f] = gain[o] * (w[o, f] - mean[o]) / sqrt(var[o] + eps)
 * This is gn_group_norm of the weight seen as (N=1, C=O, S=F) data in G=O groups with gamma = gain
 * and beta = 0, so it runs the GroupNorm kernels (../kernels/group_norm.h) on both devices, with
 * their numerics: one-element rows give 0 (a 1x1 convolution with one input channel), constant
 * rows give exactly 0 (eps decides: no NaN), statistics in float32 for float16 weights.
 *
 * Why an op of its own rather than gn_group_norm on a reshape: AMP lists ops by name.
 * gn_group_norm is a float16 op under AMP (activations), but a weight must be standardized from the
 * float32 master copy with float32 statistics and only the result cast for the convolution; this
 * name sits in AMP's FP32 list (python/gn_mx/amp.py). It also saves the two reshapes and the zero
 * beta input a composed graph needs (beta = 0 lives in this op's workspace).
 *
 * Backward inputs (lib_api): [dout, dmean, drstd, weight, gain, out, mean, rstd]; outputs
 * [dweight, dgain]: the GroupNorm backward with dbeta not computed (beta is not an input).
 */
#include <cmath>
#include <cstring>
#include <vector>

#include "device.h"
#include "validate.h"
#include "../kernels/group_norm.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

constexpr char kWs[] = "gn_weight_standardize";

const Kernel<GroupNormFwdArgs> kWsFwdKernel{group_norm_fwd_cpu, nullptr,
                                            GNMX_CUDA_ENTRY(group_norm_fwd_cuda),
                                            GNMX_CUDA_ENTRY(group_norm_fwd_workspace_cuda)};
const Kernel<GroupNormBwdArgs> kWsBwdKernel{group_norm_bwd_cpu, group_norm_bwd_workspace_cpu,
                                            GNMX_CUDA_ENTRY(group_norm_bwd_cuda),
                                            GNMX_CUDA_ENTRY(group_norm_bwd_workspace_cuda)};

enum WsIn { kWsWeight = 0, kWsGain, kWsNumIn };
enum WsOut { kWsOut = 0, kWsMean, kWsRstd, kWsNumOut };
// backward inputs: [dout, dmean, drstd, weight, gain, out, mean, rstd]
enum WsBwdIn {
  kWsBdOut = 0, kWsBdMean, kWsBdRstd, kWsBWeight, kWsBGain, kWsBOut, kWsBMean, kWsBRstd
};

// The one attribute: eps (default 1e-5, a finite number >= 0).
double parse_ws(const AttrMap& attrs) {
  const double eps = Attrs(kWs, attrs, {"eps"}).get_float("eps", 1e-5);
  if (!(eps >= 0) || !std::isfinite(eps)) fail(kWs, ": eps must be a finite number >= 0; got ", eps);
  return eps;
}

// A weight (O, *fan_in dims) as GroupNorm data (1, O, F) in O groups of one channel.
GroupDims weight_rows(const std::vector<int64_t>& shape) {
  if (shape.size() < 2)
    fail(kWs, ": weight must have at least 2 dims (O, *fan_in); got shape ", shape_str(shape));
  int64_t F = 1;
  for (size_t i = 1; i < shape.size(); ++i) F *= shape[i];
  const GroupDims d = group_dims(1, shape[0], shape[0], F);
  if (const char* e = check_group_dims(d)) fail(kWs, ": ", e, "; weight shape ", shape_str(shape));
  return d;
}

MXReturnValue ws_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kWs, [&] {
    parse_ws(attrs);
    *num_in = kWsNumIn;
    *num_out = kWsNumOut;
    return MX_SUCCESS;
  });
}

MXReturnValue ws_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kWs, [&] {
    const double eps = parse_ws(attrs);
    // The weight's dtype may be known only from the consumer (a Convolution infers its weight
    // input, our output, from its data): take it from there, so a symbol binds without it.
    if ((*in)[kWsWeight] == kDtypeUnknown) (*in)[kWsWeight] = (*out)[kWsOut];
    const int t = (*in)[kWsWeight];
    if (t != kDtypeUnknown && !is_float_dtype(t))
      fail(kWs, ": weight must be float16, float32 or float64; got ", mx_dtype_name(t));
    int& gt = (*in)[kWsGain];
    if (gt != kDtypeUnknown && !is_float_dtype(gt))
      fail(kWs, ": gain must be a float type; got ", mx_dtype_name(gt));
    if (t == kDtypeUnknown) return MX_SUCCESS;
    if (gt == kDtypeUnknown) gt = t;
    if (gt != t && !(t == kFloat16 && gt == kFloat32))
      fail(kWs, ": gain dtype must equal the weight dtype (or be float32 with a float16 weight); "
                "got gain ", mx_dtype_name(gt), " with weight ", mx_dtype_name(t));
    check_eps_in_acc(kWs, eps, t == kFloat64, mx_dtype_name(t));
    (*out)[kWsOut] = t;
    (*out)[kWsMean] = (*out)[kWsRstd] = mx_acc_dtype(t);
    return MX_SUCCESS;
  });
}

MXReturnValue ws_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                       std::vector<std::vector<unsigned>>* out) {
  return guarded(kWs, [&] {
    parse_ws(attrs);
    // As for the dtype: a Convolution infers its weight's shape (our output's) from its data and
    // attributes, which is how Gluon's deferred initialization learns the raw weight's shape.
    if (shape_unknown((*in)[kWsWeight]) && !(*out)[kWsOut].empty() &&
        !shape_unknown((*out)[kWsOut]))
      (*in)[kWsWeight] = (*out)[kWsOut];
    const auto& ws = (*in)[kWsWeight];
    if (data_shape_unknown(kWs, ws)) return MX_SUCCESS;
    const GroupDims d = weight_rows(to_i64(ws));
    const std::vector<unsigned> oshape = {static_cast<unsigned>(d.C)};
    auto& gs = (*in)[kWsGain];
    if (shape_unknown(gs)) {
      gs = oshape;
    } else if (gs != oshape) {
      fail(kWs, ": gain must have shape (", d.C, ",) for weight shape ", shape_str(to_i64(ws)),
           "; got ", shape_str(to_i64(gs)));
    }
    (*out)[kWsOut] = ws;
    (*out)[kWsMean] = (*out)[kWsRstd] = oshape;
    return MX_SUCCESS;
  });
}

void check_gain(const MXTensor& g, const GroupDims& d) {
  if (g.shape.size() != 1 || g.shape[0] != d.C)
    fail(kWs, ": gain must have shape (", d.C, ",); got ", shape_str(g.shape));
}

// Forward: GroupNorm with beta = 0. One workspace allocation (device.h: a second one may alias the
// first) holds the zero beta, then the kernel's own scratch at a 64-byte boundary.
MXReturnValue ws_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                     const OpResource& res) {
  return guarded(kWs, [&] {
    const double eps = parse_ws(attrs);
    const MXTensor& w = (*in)[kWsWeight];
    const MXTensor& g = (*in)[kWsGain];
    const Device dev = device_of(kWs, w, res);
    const GroupDims d = weight_rows(w.shape);
    check_gain(g, d);
    GroupNormFwdArgs a;
    a.dtype = to_dtype(w.dtype);
    a.param_dtype = to_dtype(g.dtype);
    a.x = w.data_ptr;
    a.gamma = g.data_ptr;
    a.y = (*out)[kWsOut].data_ptr;
    a.mean = (*out)[kWsMean].data_ptr;
    a.rstd = (*out)[kWsRstd].data_ptr;
    a.dims = d;
    a.eps = eps;
    if (dev.gpu && kWsFwdKernel.cuda == nullptr) fail(kWs, ": gn_mx was built without CUDA");
    const size_t beta_bytes = (static_cast<size_t>(d.C) * dtype_size(a.param_dtype) + 63) / 64 * 64;
    size_t (*kernel_ws)(const GroupNormFwdArgs&) =
        dev.gpu ? kWsFwdKernel.cuda_workspace : kWsFwdKernel.cpu_workspace;
    const size_t scratch = kernel_ws ? kernel_ws(a) : 0;
    char* buf = static_cast<char*>(workspace(dev, beta_bytes + scratch, kWs));
    if (dev.gpu) {
#if defined(GNMX_WITH_CUDA)
      if (const char* e = zero_cuda(buf, beta_bytes, dev.stream())) fail(kWs, ": ", e);
#endif
    } else {
      std::memset(buf, 0, beta_bytes);
    }
    a.beta = buf;
    a.workspace = scratch ? buf + beta_bytes : nullptr;
    const char* err = dev.gpu ? kWsFwdKernel.cuda(a, dev.stream()) : kWsFwdKernel.cpu(a);
    if (err) fail(kWs, ": ", err);
    return MX_SUCCESS;
  });
}

MXReturnValue ws_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                     const OpResource& res) {
  return guarded(kWs, [&] {
    const double eps = parse_ws(attrs);
    const MXTensor& w = (*in)[kWsBWeight];
    const Device dev = device_of(kWs, w, res);
    const GroupDims d = weight_rows(w.shape);
    static_assert(kWsBdOut == 0 && kWsBdMean == 1 && kWsBdRstd == 2 && kWsBWeight == 3 &&
                      kWsBGain == 4 && kWsBRstd == kWsBMean + 1 && kWsWeight == 0 && kWsGain == 1,
                  "gn_bwd_args's input / output order");
    GroupNormBwdArgs a = gn_bwd_args(kWs, *in, *out, kWsBMean, d);
    a.beta = nullptr;  // read only with a fused activation (none here)
    a.dbeta = nullptr;
    a.eps = eps;
    run(kWs, dev, kWsBwdKernel, a);
    return MX_SUCCESS;
  });
}

}  // namespace
}  // namespace mxa
}  // namespace gn_mx

REGISTER_OP(gn_weight_standardize)
    .setParseAttrs(gn_mx::mxa::ws_parse)
    .setInferType(gn_mx::mxa::ws_type)
    .setInferShape(gn_mx::mxa::ws_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kWs>)
    .setForward(gn_mx::mxa::ws_fwd, "cpu")
    .setBackward(gn_mx::mxa::ws_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::ws_fwd, "gpu")
    .setBackward(gn_mx::mxa::ws_bwd, "gpu")
#endif
    ;
