/*
 * Register the ops once per process, however often the library is loaded.
 *
 * MXLoadLib (MXNet 1.9) registers every op the library reports at each call: a second load of the
 * same library re-registers at a higher priority, a third fails half-way with "Attribute ... of
 * operator gn_dbn is already registered" (and the process is left with a failed load). dlopen hands
 * every load of this file the same instance, so the op count is reported once and later loads
 * report 0 ops: they succeed and change nothing (the first registration stays in effect; NNVM
 * registrations are never removed).
 *
 * The real _opRegSize of lib_api.cc is compiled under another name (see CMakeLists.txt:
 * -D_opRegSize=gnmx_lib_api_opRegSize on lib_api.cc only); this file exports the public one. It
 * needs no MXNet header: the signature is lib_api's `int _opRegSize()`.
 */
#include <atomic>

extern "C" int gnmx_lib_api_opRegSize();

extern "C" __attribute__((visibility("default"))) int _opRegSize() {
  static std::atomic<bool> reported{false};
  if (reported.exchange(true)) return 0;
  return gnmx_lib_api_opRegSize();
}
