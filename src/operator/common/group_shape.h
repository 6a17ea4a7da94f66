/*
 * group_shape.h: the (N, C, G, D = C/G, S = prod(spatial)) view every kernel works on, and the
 * validation shared by all ops. Data layout is (N, C, *spatial), row-major, 0..k spatial dims, so a
 * group of sample n is one contiguous block of D*S elements starting at (n*C + g*D)*S.
 */
#pragma once
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace gn_mx {

struct GroupShape {
  int64_t N = 0, C = 0, G = 1, D = 0, S = 1;
  int64_t group_elems() const { return D * S; }
  int64_t numel() const { return N * C * S; }
};

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  if (s.size() == 1) os << ",";
  os << ")";
  return os.str();
}

// Returns "" when `shape` is a valid (N, C, *spatial) input for `num_groups`, else a message that
// starts with `op` and names the problem, what was expected and what was received.
inline std::string check_group_shape(const char* op, const std::vector<int64_t>& shape,
                                     int64_t num_groups, GroupShape* out) {
  std::ostringstream os;
  if (shape.size() < 2) {
    os << op << ": data must have at least 2 dims (N, C, *spatial); got shape " << shape_str(shape);
    return os.str();
  }
  for (int64_t d : shape) {
    if (d <= 0) {
      os << op << ": empty tensors are not supported (every dim must be > 0); data shape "
         << shape_str(shape);
      return os.str();
    }
  }
  if (num_groups <= 0) {
    os << op << ": num_groups must be positive; got " << num_groups;
    return os.str();
  }
  const int64_t C = shape[1];
  if (C % num_groups != 0) {
    os << op << ": channels (C=" << C << ") must be divisible by num_groups (" << num_groups
       << "); data shape " << shape_str(shape);
    return os.str();
  }
  GroupShape g;
  g.N = shape[0];
  g.C = C;
  g.G = num_groups;
  g.D = C / num_groups;
  g.S = 1;
  for (size_t i = 2; i < shape.size(); ++i) g.S *= shape[i];
  if (out) *out = g;
  return "";
}

}  // namespace gn_mx
