/*
 * group_shape.h: GroupDims, the one shape type of every op on every device, and its one check.
 *
 * Data layout is (N, C, *spatial), row-major, 0..k spatial dims, seen as (N, C, S) with
 * S = prod(spatial) (S = 1 for (N, C) data) and G groups of D = C/G channels, so the group (n, g) is
 * one contiguous block of D*S elements starting at (n*C + g*D)*S. Per-channel ops without groups
 * (gn_channel_affine) use G = 1, D = C.
 * Channels-last data (N, *spatial, C) (the ops' axis = -1) sets `channels_last`: seen as (N, S, C),
 * the group (n, g) is then D contiguous values at each of S positions, element (n, c, s) at
 * (n*S + s)*C + c. Only where S > 1: with S = 1 both layouts are the same memory and the flag stays
 * false, so the channels-first kernels run. gn_elem_strides() is the one place the two layouts'
 * element offsets are written.
 *
 * Every kernel Args struct embeds a GroupDims (`dims`); the adapter fills it from the data shape
 * (mx/validate.h data_groups()), a harness or benchmark with group_dims(). check_group_dims() is the
 * only place the rules are checked and worded: the kernels return its message as their error, the
 * adapter prefixes the op name and appends the data shape. Device-specific limits (CUDA's 32-bit
 * offsets, DBN's largest group) are checked next to the kernels that have them.
 *
 * Host code only (kernels receive plain integers); safe to include from .cu files.
 */
#pragma once
#include <cstdint>
#include <cstdio>

namespace gn_mx {

struct GroupDims {
  int64_t N = 0, C = 0, G = 1, D = 0, S = 1;
  bool channels_last = false;  // (N, S, C) memory instead of (N, C, S); see above
};

// Element (n, c, s) lies at n*sample + c*chan + s*pos.
struct ElemStrides {
  int64_t sample, chan, pos;
};
inline ElemStrides gn_elem_strides(const GroupDims& d) {
  return d.channels_last ? ElemStrides{d.S * d.C, 1, d.C} : ElemStrides{d.C * d.S, d.S, 1};
}

// The dims of (N, C, S) data in G groups; D = C/G (0 when G does not divide C: check_group_dims
// then reports it).
inline GroupDims group_dims(int64_t N, int64_t C, int64_t G, int64_t S,
                            bool channels_last = false) {
  GroupDims d;
  d.channels_last = channels_last && S > 1;
  d.N = N;
  d.C = C;
  d.G = G;
  d.D = (G > 0 && C % G == 0) ? C / G : 0;
  d.S = S;
  return d;
}

// nullptr when num_groups is valid, else the message (also used when parsing the attribute).
// Thread-local storage, valid until the next call on this thread.
inline const char* num_groups_error(int64_t G) {
  if (G > 0) return nullptr;
  thread_local char buf[64];
  std::snprintf(buf, sizeof(buf), "num_groups must be positive; got %lld", static_cast<long long>(G));
  return buf;
}

// The rule every op states for a tensor with a 0 dim (the GroupNorm-family data and the
// synchronized-DBN ops' inputs).
constexpr char kEmptyTensorRule[] = "empty tensors are not supported (every dim must be > 0)";

// nullptr for valid dims, else the one wording of the broken rule, with the values involved
// (thread-local storage, valid until the next call on this thread).
inline const char* check_group_dims(const GroupDims& d) {
  if (d.N <= 0 || d.C <= 0 || d.S <= 0)
    return kEmptyTensorRule;
  if (const char* e = num_groups_error(d.G)) return e;
  thread_local char buf[128];
  if (d.C % d.G != 0) {
    std::snprintf(buf, sizeof(buf), "channels (C=%lld) must be divisible by num_groups (%lld)",
                  static_cast<long long>(d.C), static_cast<long long>(d.G));
    return buf;
  }
  if (d.D != d.C / d.G) {
    std::snprintf(buf, sizeof(buf), "group size D=%lld must equal C/num_groups = %lld",
                  static_cast<long long>(d.D), static_cast<long long>(d.C / d.G));
    return buf;
  }
  return nullptr;
}

}  // namespace gn_mx
