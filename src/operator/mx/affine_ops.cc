/*
 * affine_ops.cc: MXNet registration of gn_channel_affine: data, gamma (C,), beta (C,) ->
 * out = data * gamma[c] + beta[c]. The per-channel affine that DecorrelatedBatchNorm applies after
 * whitening, fused into one pass (multi-precision like gn_group_norm: float32 gamma/beta with
 * float16 data). Math: ../kernels/affine.h. Callback structure as in group_norm_ops.cc.
 */
#include <vector>

#include "device.h"
#include "validate.h"
#include "../kernels/affine.h"

using namespace mxnet::ext;

namespace gn_mx {
namespace mxa {
namespace {

constexpr char kAffine[] = "gn_channel_affine";

const Kernel<AffineArgs> kAffFwdKernel{affine_fwd_cpu, nullptr, GNMX_CUDA_ENTRY(affine_fwd_cuda),
                                       nullptr};
const Kernel<AffineBwdArgs> kAffBwdKernel{affine_bwd_cpu, nullptr,
                                          GNMX_CUDA_ENTRY(affine_bwd_cuda),
                                          GNMX_CUDA_ENTRY(affine_bwd_workspace_cuda)};

enum AffOut { kAffOut = 0, kAffNumOut };
// backward inputs: [dout, data, gamma, beta, out]
enum AffBwdIn { kAffBdOut = 0, kAffBData, kAffBGamma, kAffBBeta, kAffBOut };

// The (N, C, *spatial) rules with one group: at least 2 dims, none empty.
GroupDims affine_groups(const std::vector<int64_t>& shape) {
  return data_groups(kAffine, shape, 1);
}

MXReturnValue aff_parse(const AttrMap& attrs, int* num_in, int* num_out) {
  return guarded(kAffine, [&] {
    Attrs a(kAffine, attrs, {});
    *num_in = kAffNumIn;
    *num_out = kAffNumOut;
    return MX_SUCCESS;
  });
}

MXReturnValue aff_type(const AttrMap& attrs, std::vector<int>* in, std::vector<int>* out) {
  return guarded(kAffine, [&] {
    const int t = infer_affine_param_types(kAffine, in);
    if (t != kDtypeUnknown) (*out)[kAffOut] = t;
    return MX_SUCCESS;
  });
}

MXReturnValue aff_shape(const AttrMap& attrs, std::vector<std::vector<unsigned>>* in,
                        std::vector<std::vector<unsigned>>* out) {
  return guarded(kAffine, [&] {
    const auto& ds = (*in)[kAffData];
    if (data_shape_unknown(kAffine, ds)) return MX_SUCCESS;
    infer_affine_param_shapes(kAffine, in, affine_groups(to_i64(ds)));
    (*out)[kAffOut] = ds;
    return MX_SUCCESS;
  });
}

MXReturnValue aff_fwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kAffine, [&] {
    const MXTensor& x = (*in)[kAffData];
    const Device dev = device_of(kAffine, x, res);
    const GroupDims gs = affine_groups(x.shape);
    check_param_tensor(kAffine, (*in)[kAffGamma], gs, kAffGamma);
    check_param_tensor(kAffine, (*in)[kAffBeta], gs, kAffBeta);
    AffineArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kAffGamma].dtype);
    a.x = x.data_ptr;
    a.gamma = (*in)[kAffGamma].data_ptr;
    a.beta = (*in)[kAffBeta].data_ptr;
    a.y = (*out)[kAffOut].data_ptr;
    a.dims = gs;
    run(kAffine, dev, kAffFwdKernel, a);
    return MX_SUCCESS;
  });
}

MXReturnValue aff_bwd(const AttrMap& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource& res) {
  return guarded(kAffine, [&] {
    const MXTensor& x = (*in)[kAffBData];
    const Device dev = device_of(kAffine, x, res);
    const GroupDims gs = affine_groups(x.shape);
    check_grad_dtype(kAffine, (*in)[kAffBdOut], x.dtype, "out");
    AffineBwdArgs a;
    a.dtype = to_dtype(x.dtype);
    a.param_dtype = to_dtype((*in)[kAffBGamma].dtype);
    a.dy = (*in)[kAffBdOut].data_ptr;
    a.x = x.data_ptr;
    a.gamma = (*in)[kAffBGamma].data_ptr;
    a.dx = (*out)[kAffData].data_ptr;
    a.dgamma = (*out)[kAffGamma].data_ptr;
    a.dbeta = (*out)[kAffBeta].data_ptr;
    a.dims = gs;
    run(kAffine, dev, kAffBwdKernel, a);
    return MX_SUCCESS;
  });
}

}  // namespace
}  // namespace mxa
}  // namespace gn_mx

REGISTER_OP(gn_channel_affine)
    .setParseAttrs(gn_mx::mxa::aff_parse)
    .setInferType(gn_mx::mxa::aff_type)
    .setInferShape(gn_mx::mxa::aff_shape)
    .setInferSType(gn_mx::mxa::dense_storage<gn_mx::mxa::kAffine>)
    .setForward(gn_mx::mxa::aff_fwd, "cpu")
    .setBackward(gn_mx::mxa::aff_bwd, "cpu")
#if defined(GNMX_WITH_CUDA)
    .setForward(gn_mx::mxa::aff_fwd, "gpu")
    .setBackward(gn_mx::mxa::aff_bwd, "gpu")
#endif
    ;
