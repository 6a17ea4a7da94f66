/*
 * errors.cc: ErrorList (see errors.h), the one place that edits lib_api's error-message list.
 */
#include "errors.h"

#include <chrono>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

namespace gn_mx {
namespace mxa {
namespace {

using MsgVec = std::vector<std::stringstream*>;

// MXerrorMsgs::messages is private. An explicit instantiation may name a private member
// ([temp.spec]); the friend it defines hands the member pointer out. Instantiated once, here.
template <MsgVec mxnet::ext::MXerrorMsgs::*M>
struct ErrorListAccess {
  friend MsgVec& error_list(mxnet::ext::MXerrorMsgs& e) { return e.*M; }
};
MsgVec& error_list(mxnet::ext::MXerrorMsgs& e);
template struct ErrorListAccess<&mxnet::ext::MXerrorMsgs::messages>;

constexpr int kStaleSeconds = 2;

struct Owner {
  std::thread::id thread;
  std::chrono::steady_clock::time_point born;
};

std::mutex& list_mutex() {
  static std::mutex m;
  return m;
}

// The messages gn_mx stored, by owner thread; entries lib_api added itself have none.
std::unordered_map<std::stringstream*, Owner>& owners() {
  static std::unordered_map<std::stringstream*, Owner> o;
  return o;
}

}  // namespace

void ErrorList::clear() {
  std::lock_guard<std::mutex> lock(list_mutex());
  MsgVec& list = error_list(*mxnet::ext::MXerrorMsgs::get());
  if (list.empty()) return;
  auto& own = owners();
  const auto me = std::this_thread::get_id();
  const auto now = std::chrono::steady_clock::now();
  size_t keep = 0;
  for (std::stringstream* m : list) {
    auto it = own.find(m);
    const bool drop = it == own.end() || it->second.thread == me ||
                      now - it->second.born > std::chrono::seconds(kStaleSeconds);
    if (drop) {
      if (it != own.end()) own.erase(it);
      delete m;
    } else {
      list[keep++] = m;
    }
  }
  list.resize(keep);
}

void ErrorList::set(const std::string& msg) {
  std::lock_guard<std::mutex> lock(list_mutex());
  auto* m = new std::stringstream(msg);
  error_list(*mxnet::ext::MXerrorMsgs::get()).push_back(m);
  owners()[m] = Owner{std::this_thread::get_id(), std::chrono::steady_clock::now()};
}

}  // namespace mxa
}  // namespace gn_mx
