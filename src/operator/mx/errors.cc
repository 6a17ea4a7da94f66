/*
 * errors.cc: the error messages MXNet shows for failing gn_mx callbacks (see errors.h).
 *
 * MXNet 1.9 fetches a library's messages with _msgSize/_msgGet right after every call into it, on
 * the thread that made the call. lib_api's own versions read one process-wide list that nothing
 * ever clears, and _msgGet allocates a std::string per fetch that nobody frees. src/link/messages.cc
 * exports replacements (lib_api.cc's are compiled under other names, see CMakeLists.txt) backed by
 * the ONE message per thread kept here: set when a callback on this thread fails, dropped when the
 * next callback on this thread starts. So
 *  - each MXNetError carries exactly its own message (no stale text from earlier errors);
 *  - a successful call leaves nothing to fetch, and a fetch allocates nothing;
 *  - threads never see each other's messages, and nothing is shared, so nothing races.
 * (lib_api.cc's MX_ERROR_MSG paths, its JSON parser for graph passes, are not used by gn_mx.)
 */
#include "errors.h"

#include <string>

namespace gn_mx {
namespace mxa {
namespace {

struct ThreadMessage {
  std::string text;
  bool set = false;
};

ThreadMessage& this_thread_message() {
  thread_local ThreadMessage m;
  return m;
}

}  // namespace

void ErrorList::clear() {
  ThreadMessage& m = this_thread_message();
  m.set = false;
  m.text.clear();  // keeps its capacity: no allocation per call
}

void ErrorList::set(const std::string& msg) {
  ThreadMessage& m = this_thread_message();
  m.text = msg;
  m.set = true;
}

const char* ErrorList::current() {
  const ThreadMessage& m = this_thread_message();
  return m.set ? m.text.c_str() : nullptr;
}

}  // namespace mxa
}  // namespace gn_mx
