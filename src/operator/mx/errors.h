/*
 * errors.h: how a failure inside a gn_mx callback reaches the user as one clean MXNetError.
 *
 * lib_api hands errors to MXNet through a process-wide list (mxnet::ext::MXerrorMsgs) that it
 * never clears: MXNet 1.9 copies the WHOLE list into every error it raises and, after each
 * library call, fetches every entry through _msgGet, which allocates a std::string per entry that
 * nobody frees. Left alone, K caught errors make every later call allocate K strings (~10 KB per
 * forward+backward per error) and every later MXNetError repeats all K stale messages.
 *
 * guarded() therefore
 *  - empties the list when a callback starts (the previous call's message was already read: MXNet
 *    reads it right after the failing call returns, on the same thread), so a successful call
 *    leaves the list empty and MXNet fetches nothing;
 *  - on failure stores exactly one message, the op's own text, without MX_ERROR_MSG's
 *    "<build path>/file.h[line]: " prefix.
 * The list is a private member of lib_api's class; ErrorList (errors.cc) reaches it through the
 * standard explicit-instantiation access rule (no layout assumptions, no patched lib_api).
 * Callbacks run on MXNet's worker threads and on the calling threads at once. A mutex serializes
 * our edits; a callback clears only its own thread's messages (MXNet on that thread has read them),
 * so a message another thread is about to read survives; other threads' messages go once they are
 * a few seconds old (a thread that failed and never called again). lib_api's own reads are not
 * synchronized (its design): under concurrent failures an error may, rarely, show a message of a
 * simultaneous failure on another thread as well.
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

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw OpError(msg);
}

// lib_api's message list, emptied and filled per thread (errors.cc).
class ErrorList {
 public:
  // Drop this thread's messages (called when a callback starts), and other threads' messages once
  // they are a few seconds old (a thread that failed and never called again).
  static void clear();
  // Store `msg` as the one message MXNet will show for this thread's failing call.
  static void set(const std::string& msg);
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
