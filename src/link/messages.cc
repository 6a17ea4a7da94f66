/*
 * The error messages MXNet fetches after every call into the library: lib_api's _msgSize/_msgGet,
 * replaced (the reasons are in src/operator/mx/errors.cc) by the calling thread's one message.
 *
 * src/link holds every replaced lib_api entry point (this file and register_once.cc) and the export
 * map; lib_api.cc's own versions are compiled under other names by -D renames (CMakeLists.txt:
 * GNMX_LIB_API_RENAMES) and are never exported.
 */
#include "mx/errors.h"

extern "C" __attribute__((visibility("default"))) int _msgSize() {
  return gn_mx::mxa::ErrorList::current() ? 1 : 0;
}

extern "C" __attribute__((visibility("default"))) void _msgGet(int idx, const char** msg) {
  const char* m = gn_mx::mxa::ErrorList::current();
  *msg = (m != nullptr && idx == 0) ? m : "";
}
