/*
 * group_norm_nsc_cpu.h: the channels-last CPU kernels (group_norm_nsc_cpu.cc), called by
 * group_norm_cpu.cc's entry points (group_norm.h) for GroupDims::channels_last data; the twin of
 * group_norm_nsc_cuda.h. Same Args, same contracts. T: the data's storage type (Half, float or
 * double); gam / bet: the parameters widened to AccT<T>, C values each (bet zeros when absent).
 */
#pragma once
#include "group_norm.h"
#include "../common/acc_type.h"

namespace gn_mx {

template <typename T>
void nsc_moments_cpu(const MomentsArgs& a);
template <typename T>
void nsc_moments_bwd_cpu(const MomentsBwdArgs& a);
template <typename T>
void nsc_fwd_cpu(const GroupNormFwdArgs& a, const AccT<T>* gam, const AccT<T>* bet);
// The input gradient and the per-(n, c) sums in a.workspace (carve_bwd_sums); the parameter
// gradients are bwd_params' (group_norm_cpu.cc), as for channels first.
template <typename T>
void nsc_bwd_input_cpu(const GroupNormBwdArgs& a, const AccT<T>* gam, const AccT<T>* bet);

}  // namespace gn_mx
