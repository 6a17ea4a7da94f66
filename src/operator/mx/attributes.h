/*
 * attributes.h: the one strict attribute parser of every gn_mx op, and the checks of eps against
 * the dtype it is used in.
 *
 * Attribute values arrive as strings (MXNet passes str(value) of each keyword). One grammar for all
 * ops, all attributes:
 *   integer: [+-]?[0-9]+                                           (decimal only: no hex, no suffix)
 *   number:  [+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?   (decimal only: no hex floats)
 *            or [+-]?(inf|infinity|nan), any case (parsed, then rejected by the op's range check)
 * Surrounding ASCII whitespace is always accepted, for integers and numbers alike (as MXNet's own
 * parameter parser does); whitespace inside a value never is. Numbers are parsed to float64:
 * subnormal values (5e-324) are numbers; a value that overflows (1e400) or underflows to zero
 * (1e-400) float64 is an error. Unknown keys are errors too, so a typo such as `num_group=4` is
 * reported instead of silently ignored. Keys MXNet adds itself start with "__".
 *
 * Every callback parses its attributes again; nothing is cached. Parsing gn_group_norm's three
 * attributes takes ~180 ns (benchmarks/bench_overhead.py, attr_parse.cc): under 1% of the ~31 us an
 * imperative call costs in MXNet's lib_api path (which itself marshals the attribute map into
 * strings for every callback). lib_api could keep parsed attributes only in a stateful op, and
 * MXNet's imperative mode creates that state again on every call (a CustomStatefulOp allocated
 * through the library, attributes marshalled once more), so caching would not pay for itself.
 */
#pragma once
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <string>
#include <unordered_map>

#include "errors.h"

namespace gn_mx {
namespace mxa {

using AttrMap = std::unordered_map<std::string, std::string>;

namespace limits {
// The DBN group-size limits are kDbnMaxGroupSizeCpu / kDbnMaxGroupSizeCuda in kernels/dbn.h.
// Smallest eps > 0 whose running projection (up to 1/sqrt(eps) for a direction without variance)
// still fits float16 running statistics: 1 / 65504^2, rounded up.
constexpr double kMinEpsFloat16Stats = 2.4e-10;
}  // namespace limits

namespace detail {
inline bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
inline bool is_digit(char c) { return c >= '0' && c <= '9'; }
inline std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && is_space(s[b])) ++b;
  while (e > b && is_space(s[e - 1])) --e;
  return s.substr(b, e - b);
}
inline bool iequals(const std::string& a, const char* b) {
  size_t i = 0;
  for (; i < a.size() && b[i]; ++i) {
    char c = a[i];
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    if (c != b[i]) return false;
  }
  return i == a.size() && !b[i];
}
// [+-]?[0-9]+
inline bool is_decimal_integer(const std::string& t) {
  size_t i = (!t.empty() && (t[0] == '+' || t[0] == '-')) ? 1 : 0;
  if (i == t.size()) return false;
  for (; i < t.size(); ++i)
    if (!is_digit(t[i])) return false;
  return true;
}
// The number grammar above; *nonzero tells whether any mantissa digit is not 0.
inline bool is_decimal_number(const std::string& t, bool* nonzero) {
  *nonzero = false;
  size_t i = (!t.empty() && (t[0] == '+' || t[0] == '-')) ? 1 : 0;
  const std::string body = t.substr(i);
  if (iequals(body, "inf") || iequals(body, "infinity") || iequals(body, "nan")) {
    *nonzero = true;
    return true;
  }
  size_t digits = 0;
  for (; i < t.size() && is_digit(t[i]); ++i, ++digits) *nonzero |= t[i] != '0';
  if (i < t.size() && t[i] == '.') {
    for (++i; i < t.size() && is_digit(t[i]); ++i, ++digits) *nonzero |= t[i] != '0';
  }
  if (digits == 0) return false;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    size_t exp_digits = 0;
    for (; i < t.size() && is_digit(t[i]); ++i) ++exp_digits;
    if (exp_digits == 0) return false;
  }
  return i == t.size();
}
}  // namespace detail

class Attrs {
 public:
  Attrs(const char* op, const AttrMap& m, std::initializer_list<const char*> known) : op_(op), m_(m) {
    for (const auto& kv : m) {
      if (kv.first.rfind("__", 0) == 0) continue;
      bool ok = false;
      for (const char* k : known) ok = ok || kv.first == k;
      if (!ok) {
        std::ostringstream os;
        os << op << ": unknown attribute '" << kv.first << "'; expected one of:";
        for (const char* k : known) os << " " << k;
        throw OpError(os.str());
      }
    }
  }

  int64_t get_int(const char* key, int64_t dflt) const {
    auto it = m_.find(key);
    if (it == m_.end()) return dflt;
    const std::string t = detail::trim(it->second);
    if (!detail::is_decimal_integer(t))
      fail(op_, ": attribute ", key, " must be an integer; got '", it->second,
           "' (decimal digits only, e.g. 4)");
    errno = 0;
    const long long v = std::strtoll(t.c_str(), nullptr, 10);
    if (errno == ERANGE)
      fail(op_, ": attribute ", key, " is out of the int64 range; got '", it->second, "'");
    return v;
  }

  double get_float(const char* key, double dflt) const {
    auto it = m_.find(key);
    if (it == m_.end()) return dflt;
    const std::string t = detail::trim(it->second);
    bool nonzero = false;
    if (!detail::is_decimal_number(t, &nonzero))
      fail(op_, ": attribute ", key, " must be a number; got '", it->second,
           "' (decimal only, e.g. 1e-5)");
    errno = 0;
    const double v = std::strtod(t.c_str(), nullptr);
    if (errno == ERANGE) {  // glibc also flags subnormal results: those are numbers
      if (std::isinf(v))
        fail(op_, ": attribute ", key, " is out of the float64 range; got '", it->second, "'");
      if (v == 0 && nonzero)
        fail(op_, ": attribute ", key, " underflows to 0 in float64; got '", it->second, "'");
    }
    return v;
  }

 private:
  const char* op_;
  const AttrMap& m_;
};

// ---- eps against the dtype it is used in --------------------------------------------------------
// The kernels add eps to variances in the accumulation dtype (float32 for float16/float32 data,
// float64 for float64 data). An eps > 0 below that dtype's smallest NORMAL value is rejected: it
// would round to 0 there (1e-300 in float32), or be a subnormal that flush-to-zero modes drop, so
// the op would silently run with eps = 0 on some machines and not on others.
// acc_is_double: the accumulation dtype is float64.
inline void check_eps_in_acc(const char* op, double eps, bool acc_is_double, const char* data_dtype) {
  if (eps == 0) return;
  const double tiny = acc_is_double ? DBL_MIN : static_cast<double>(FLT_MIN);
  if (eps < tiny) {
    std::ostringstream os;
    os.precision(6);
    os << op << ": eps=" << eps << " is below the smallest normal "
       << (acc_is_double ? "float64" : "float32") << " (" << tiny << "), the dtype " << op
       << " accumulates " << data_dtype << " data in: it would act as eps=0 there; use eps >= "
       << tiny << (acc_is_double ? "" : " or float64 data");
    throw OpError(os.str());
  }
}

}  // namespace mxa
}  // namespace gn_mx
