/*
 * library.cc: lib_api's initialize(), called by MXLoadLib with MXNet's version before any op is
 * registered. The ops themselves: group_norm_ops.cc, affine_ops.cc, dbn_ops.cc.
 */
#include <string>

#include "errors.h"
#include "group_norm_grad2_ops.h"

using namespace mxnet::ext;

MXReturnValue initialize(int version) {
  if (version >= 10900) {
    gn_mx::mxa::register_group_norm_grad2();  // after gn_group_norm: see group_norm_grad2_ops.cc
    return MX_SUCCESS;
  }
  gn_mx::mxa::ErrorList::set("gn_mx: needs MXNet >= 1.9.0 (got version code " +
                             std::to_string(version) +
                             "); install mxnet==1.9.1 or mxnet-cu112==1.9.1 with numpy<1.24");
  return MX_FAIL;
}
