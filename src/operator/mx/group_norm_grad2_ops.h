/*
 * group_norm_grad2_ops.h: the double backward of gn_group_norm, by re-registering MXNet's
 * `_backward_gn_group_norm` (see group_norm_grad2_ops.cc).
 */
#pragma once
#include <cstdint>
#include <vector>

#include "tensors.h"
#include "../kernels/group_norm.h"

namespace gn_mx {
namespace mxa {

// gn_group_norm's / gn_moments' validated attributes and first-order backward callbacks
// (defined in group_norm_ops.cc, where they live).
struct GroupNormAttrs {
  int64_t num_groups = 1;
  Act act = Act::kNone;
  int64_t axis = 1;  // the channel axis attribute (validate.h data_groups())
};
GroupNormAttrs group_norm_attrs(const AttrMap& attrs);
MXReturnValue group_norm_backward(const AttrMap& attrs, std::vector<MXTensor>* in,
                                  std::vector<MXTensor>* out, const OpResource& res);
GroupNormAttrs moments_attrs(const AttrMap& attrs);  // gn_moments' validated num_groups, axis
MXReturnValue moments_backward(const AttrMap& attrs, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource& res);

// Adds `_backward_gn_group_norm` and `_backward_gn_moments` to lib_api's op registry, once per process; called from
// initialize(), i.e. after every static REGISTER_OP (gn_group_norm's included) has run.
void register_group_norm_grad2();

}  // namespace mxa
}  // namespace gn_mx
