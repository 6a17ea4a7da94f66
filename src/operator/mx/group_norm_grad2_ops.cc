/*
 * group_norm_grad2_ops.cc: second derivatives of gn_group_norm.
 *
 * MXNet 1.9 names the backward node of a library op `_backward_<op>` and gives it no gradient, so
 * autograd.grad(..., create_graph=True) through gn_group_norm failed ("non-differentiable because it
 * didn't register FGradient"). MXLoadLib registers the library's ops in registry order and lets a
 * name that already exists be registered once more (at a higher priority). So, after gn_group_norm
 * (which creates `_backward_gn_group_norm`), the library registers `_backward_gn_group_norm` again as
 * an ordinary op:
 *   forward  = gn_group_norm's backward callback (the same computation as before, so first-order
 *              training is unchanged), with its own shape/type inference for its 9 inputs
 *              [dout, dmean, drstd, data, gamma, beta, out, mean, rstd] and 3 outputs
 *              [ddata, dgamma, dbeta] (used when it is called as a forward op: gn_mx.ops's
 *              group_norm_backward, or a graph built from it);
 *   backward = the double backward (kernels/group_norm_grad2.h): gradients into all 9 inputs.
 * Registering it before gn_group_norm makes MXLoadLib fail, which is why this runs from
 * initialize() (after every static REGISTER_OP) instead of being a static REGISTER_OP.
 *
 * Backward inputs (lib_api): [gdx, gdgamma, gdbeta, the 9 inputs, the 3 outputs]; outputs: one
 * gradient per input (the `out` input's is zero: the first-order backward does not read it).
 * `_backward_gn_moments` ([dmean, dvar, data, mean, var] -> [ddata]) is re-registered the same way.
 */
#include "group_norm_grad2_ops.h"

#include <string>
#include <vector>

#include "device.h"
#include "validate.h"
#include "../kernels/group_norm_grad2.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

constexpr char kOp[] = "_backward_gn_group_norm";

const Kernel<GroupNormGrad2Args> kGrad2Kernel{
    group_norm_grad2_cpu, group_norm_grad2_workspace_cpu, GNMX_CUDA_ENTRY(group_norm_grad2_cuda),
    GNMX_CUDA_ENTRY(group_norm_grad2_workspace_cuda)};

// inputs of the re-registered op (= gn_group_norm's backward inputs)
enum In { kDOut = 0, kDMean, kDRstd, kData, kGamma, kBeta, kOut, kMean, kRstd, kNumIn };
enum Out { kDData = 0, kDGamma, kDBeta, kNumOut };
// its backward's inputs: [gradients of its 3 outputs, its 9 inputs, its 3 outputs]
constexpr int kGIn = kNumOut;  // offset of the 9 inputs

const char* input_name(int i) {
  static const char* names[kNumIn] = {"dout", "dmean", "drstd", "data", "gamma",
                                      "beta", "out",   "mean",  "rstd"};
  return names[i];
}

MXReturnValue parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kOp, [&] {
    group_norm_attrs(attrs);
    *num_in = kNumIn;
    *num_out = kNumOut;
    return MX_SUCCESS;
  });
}

// dout/out/data share the data dtype, dmean/drstd/mean/rstd are the accumulation dtype, gamma/beta
// the data dtype or float32 with float16 data (as gn_group_norm's).
MXReturnValue infer_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kOp, [&] {
    int t = kDtypeUnknown;
    for (int i : {kData, kDOut, kOut})
      if ((*in)[i] != kDtypeUnknown) { t = (*in)[i]; break; }
    check_float_data(kOp, t);
    if (t == kDtypeUnknown) return MX_SUCCESS;
    const int acc = mx_acc_dtype(t);
    for (int i = 0; i < kNumIn; ++i) {
      const bool stat = i == kDMean || i == kDRstd || i == kMean || i == kRstd;
      const bool param = i == kGamma || i == kBeta;
      int& v = (*in)[i];
      if (v == kDtypeUnknown) v = stat ? acc : t;
      const bool ok = stat ? v == acc : param ? (v == t || (t == kFloat16 && v == kFloat32)) : v == t;
      if (!ok)
        fail(kOp, ": input '", input_name(i), "' must be ",
             mx_dtype_name(stat ? acc : t), param && t == kFloat16 ? " (or float32)" : "",
             " for data ", mx_dtype_name(t), "; got ", mx_dtype_name(v));
    }
    if ((*in)[kGamma] != (*in)[kBeta])
      fail(kOp, ": gamma and beta must have the same dtype; got ", mx_dtype_name((*in)[kGamma]),
           " and ", mx_dtype_name((*in)[kBeta]));
    (*out)[kDData] = t;
    (*out)[kDGamma] = (*out)[kDBeta] = (*in)[kGamma];
    return MX_SUCCESS;
  });
}

MXReturnValue infer_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                          std::vector<std::vector<unsigned>>* out) {
  return guarded(kOp, [&] {
    const GroupNormAttrs p = group_norm_attrs(attrs);
    std::vector<unsigned> ds;
    for (int i : {kData, kDOut, kOut})
      if (!shape_unknown((*in)[i])) { ds = (*in)[i]; break; }
    if (ds.empty()) return MX_SUCCESS;
    const GroupDims gs = data_groups(kOp, to_i64(ds), p.num_groups, p.axis);
    const std::vector<unsigned> stat = {static_cast<unsigned>(gs.N), static_cast<unsigned>(gs.G)};
    const std::vector<unsigned> chan = {static_cast<unsigned>(gs.C)};
    for (int i = 0; i < kNumIn; ++i) {
      const bool is_stat = i == kDMean || i == kDRstd || i == kMean || i == kRstd;
      const std::vector<unsigned>& want =
          is_stat ? stat : (i == kGamma || i == kBeta) ? chan : ds;
      auto& s = (*in)[i];
      if (shape_unknown(s)) {
        s = want;
      } else if (s != want) {
        fail(kOp, ": input '", input_name(i), "' must have shape ", shape_str(to_i64(want)),
             " for data shape ", shape_str(to_i64(ds)), "; got ", shape_str(to_i64(s)));
      }
    }
    (*out)[kDData] = ds;
    (*out)[kDGamma] = (*out)[kDBeta] = chan;
    return MX_SUCCESS;
  });
}

MXReturnValue grad2(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                    const OpResource& res) {
  return guarded(kOp, [&] {
    const GroupNormAttrs p = group_norm_attrs(attrs);
    const MXTensor& x = (*in)[kGIn + kData];
    const Device dev = device_of(kOp, x, res);
    const GroupDims gs = data_groups(kOp, x.shape, p.num_groups, p.axis);
    check_param_tensor(kOp, (*in)[kGIn + kGamma], gs, kAffGamma);
    check_param_tensor(kOp, (*in)[kGIn + kBeta], gs, kAffBeta);
    const int pt = static_cast<int>((*in)[kGIn + kGamma].dtype);
    check_grad_dtype(kOp, (*in)[kDData], x.dtype, "ddata");
    check_grad_dtype(kOp, (*in)[kDGamma], pt, "dgamma");
    check_grad_dtype(kOp, (*in)[kDBeta], pt, "dbeta");
    auto ptr = [&](int i) { return (*in)[kGIn + i].data_ptr; };
    GroupNormGrad2Args a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype(pt);
    a.dy = ptr(kDOut);
    a.dmean_o = ptr(kDMean);
    a.drstd_o = ptr(kDRstd);
    a.x = ptr(kData);
    a.gamma = ptr(kGamma);
    a.beta = ptr(kBeta);
    a.mean = ptr(kMean);
    a.rstd = ptr(kRstd);
    a.gdx = (*in)[kDData].data_ptr;
    a.gdgamma = (*in)[kDGamma].data_ptr;
    a.gdbeta = (*in)[kDBeta].data_ptr;
    a.ddy = (*out)[kDOut].data_ptr;
    a.ddmean_o = (*out)[kDMean].data_ptr;
    a.ddrstd_o = (*out)[kDRstd].data_ptr;
    a.dx = (*out)[kData].data_ptr;
    a.dgamma = (*out)[kGamma].data_ptr;
    a.dbeta = (*out)[kBeta].data_ptr;
    a.dmean = (*out)[kMean].data_ptr;
    a.drstd = (*out)[kRstd].data_ptr;
    a.dims = gs;
    a.act = p.act;
    run(kOp, dev, kGrad2Kernel, a, {&(*out)[kOut]});
    return MX_SUCCESS;
  });
}

// ---------------------------------------------------------------------------------------------
// _backward_gn_moments: [dmean, dvar, data, mean, var] -> [ddata]; backward: kernels'
// MomentsGrad2Args (the gradient of `var` is zero: the first-order backward does not read it).

constexpr char kMOp[] = "_backward_gn_moments";
const Kernel<MomentsGrad2Args> kMomentsGrad2Kernel{moments_grad2_cpu, nullptr,
                                                   GNMX_CUDA_ENTRY(moments_grad2_cuda), nullptr};
enum MIn { kMDMean = 0, kMDVar, kMData, kMMean, kMVar, kMNumIn };

const char* m_input_name(int i) {
  static const char* names[kMNumIn] = {"dmean", "dvar", "data", "mean", "var"};
  return names[i];
}

MXReturnValue m_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kMOp, [&] {
    moments_attrs(attrs);
    *num_in = kMNumIn;
    *num_out = 1;
    return MX_SUCCESS;
  });
}

MXReturnValue m_infer_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kMOp, [&] {
    const int t = (*in)[kMData];
    check_float_data(kMOp, t);
    if (t == kDtypeUnknown) return MX_SUCCESS;
    const int acc = mx_acc_dtype(t);
    for (int i : {kMDMean, kMDVar, kMMean, kMVar}) {
      int& v = (*in)[i];
      if (v == kDtypeUnknown) v = acc;
      if (v != acc)
        fail(kMOp, ": input '", m_input_name(i), "' must be ", mx_dtype_name(acc), " for data ",
             mx_dtype_name(t), "; got ", mx_dtype_name(v));
    }
    (*out)[0] = t;
    return MX_SUCCESS;
  });
}

MXReturnValue m_infer_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                            std::vector<std::vector<unsigned>>* out) {
  return guarded(kMOp, [&] {
    const auto& ds = (*in)[kMData];
    if (data_shape_unknown(kMOp, ds)) return MX_SUCCESS;
    const GroupNormAttrs p = moments_attrs(attrs);
    const GroupDims gs = data_groups(kMOp, to_i64(ds), p.num_groups, p.axis);
    const std::vector<unsigned> stat = {static_cast<unsigned>(gs.N), static_cast<unsigned>(gs.G)};
    for (int i : {kMDMean, kMDVar, kMMean, kMVar}) {
      auto& s = (*in)[i];
      if (shape_unknown(s)) {
        s = stat;
      } else if (s != stat) {
        fail(kMOp, ": input '", m_input_name(i), "' must have shape ", shape_str(to_i64(stat)),
             " for data shape ", shape_str(to_i64(ds)), "; got ", shape_str(to_i64(s)));
      }
    }
    (*out)[0] = ds;
    return MX_SUCCESS;
  });
}

MXReturnValue m_grad2(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kMOp, [&] {
    constexpr int kOff = 1;  // [gddata, the 5 inputs, ddata]
    const MXTensor& x = (*in)[kOff + kMData];
    const Device dev = device_of(kMOp, x, res);
    const GroupNormAttrs p = moments_attrs(attrs);
    const GroupDims gs = data_groups(kMOp, x.shape, p.num_groups, p.axis);
    check_grad_dtype(kMOp, (*in)[0], x.dtype, "ddata");
    MomentsGrad2Args a;
    a.dtype = to_dtype(x.dtype);
    a.dmean_o = (*in)[kOff + kMDMean].data_ptr;
    a.dvar_o = (*in)[kOff + kMDVar].data_ptr;
    a.x = x.data_ptr;
    a.mean = (*in)[kOff + kMMean].data_ptr;
    a.gdx = (*in)[0].data_ptr;
    a.ddmean_o = (*out)[kMDMean].data_ptr;
    a.ddvar_o = (*out)[kMDVar].data_ptr;
    a.dx = (*out)[kMData].data_ptr;
    a.dmean = (*out)[kMMean].data_ptr;
    a.dims = gs;
    run(kMOp, dev, kMomentsGrad2Kernel, a, {&(*out)[kMVar]});
    return MX_SUCCESS;
  });
}

}  // namespace

void register_group_norm_grad2() {
  static const bool once = [] {
    Registry<CustomOp>::get()
        ->add(kOp)
        .setParseAttrs(parse)
        .setInferType(infer_type)
        .setInferShape(infer_shape)
        .setInferSType(dense_storage<kOp>)
        .setForward(group_norm_backward, "cpu")
        .setBackward(grad2, "cpu")
#if defined(GNMX_WITH_CUDA)
        .setForward(group_norm_backward, "gpu")
        .setBackward(grad2, "gpu")
#endif
        ;
    Registry<CustomOp>::get()
        ->add(kMOp)
        .setParseAttrs(m_parse)
        .setInferType(m_infer_type)
        .setInferShape(m_infer_shape)
        .setInferSType(dense_storage<kMOp>)
        .setForward(moments_backward, "cpu")
        .setBackward(m_grad2, "cpu")
#if defined(GNMX_WITH_CUDA)
        .setForward(moments_backward, "gpu")
        .setBackward(m_grad2, "gpu")
#endif
        ;
    return true;
  }();
  (void)once;
}

}  // namespace mxa
}  // namespace gn_mx
