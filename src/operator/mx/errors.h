/*
 * errors.h: how a failure inside a gn_mx callback reaches the user as one clean MXNetError.
 *
 * guarded() wraps every lib_api callback: a C++ exception (a bad attribute, a failed check)
 * becomes one message, the op's own text (no "<build path>/file.h[line]: " prefix of lib_api's
 * MX_ERROR_MSG), and MX_FAIL, which MXNet raises as MXNetError at the call site. Messages live in
 * ErrorList, one per thread (errors.cc), which src/link/messages.cc serves to MXNet through its own
 * _msgSize/_msgGet (lib_api's versions read a process-wide list that is never cleared: K caught
 * errors made every later call fetch, and leak, K strings, and every later error repeat all K stale
 * messages).
 */
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

#include "lib_api.h"

namespace gn_mx {
namespace mxa {

struct OpError : std::runtime_error {
  explicit OpError(const std::string& m) : std::runtime_error(m) {}
};

// Throw an OpError whose text is built by streaming `args`.
template <typename... Ts>
[[noreturn]] inline void fail(const Ts&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw OpError(os.str());
}

// The calling thread's error message, as MXNet fetches it after each call.
class ErrorList {
 public:
  // Drop this thread's message (a callback starts: MXNet has read the previous one).
  static void clear();
  // Store `msg` as the one message MXNet will show for this thread's failing call.
  static void set(const std::string& msg);
  // This thread's message, or nullptr when there is none (read by src/link/messages.cc).
  static const char* current();
};

// Every lib_api callback runs inside guarded(): a C++ exception (a bad attribute, a failed check)
// becomes one error message + MX_FAIL, which MXNet raises as MXNetError at the call site.
// lib_api.cc itself catches nothing; an escaping exception would abort the process.
template <typename F>
mxnet::ext::MXReturnValue guarded(const char* op, F&& f) {
  try {
    ErrorList::clear();
    return f();
  } catch (const std::exception& e) {
    try {
      ErrorList::set(e.what());
    } catch (...) {
    }
  } catch (...) {
    try {
      ErrorList::set(std::string(op) + ": unknown internal error");
    } catch (...) {
    }
  }
  return mxnet::ext::MX_FAIL;
}

}  // namespace mxa
}  // namespace gn_mx
