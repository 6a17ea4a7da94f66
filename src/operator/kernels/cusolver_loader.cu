/*
 * cusolver_loader.cu: see cusolver_loader.h. Host code only (nvcc compiles it with the kernels so
 * that it reaches the op library and the GPU harness from the one source list).
 * Formats with snprintf into fixed buffers (no std::string / std::map instantiations: the GPU
 * harness exports no weak symbols, see cuda_util.cu).
 */
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cuda_common.cuh"
#include "cusolver_loader.h"

namespace gn_mx {
namespace {

// cuSOLVER's C ABI, declared by value (cusolver_common.h / cublas_api.h): status 0 = success;
// CUSOLVER_EIG_MODE_VECTOR = 1; CUBLAS_FILL_MODE_LOWER = 0; the handle is an opaque pointer.
using Handle = void*;
using create_t = int (*)(Handle*);
using set_stream_t = int (*)(Handle, void*);
using syevd_lwork_t = int (*)(Handle, int, int, int, const double*, int, const double*, int*);
using syevd_t = int (*)(Handle, int, int, int, double*, int, double*, double*, int, int*);
constexpr int kEigModeVector = 1;
constexpr int kFillLower = 0;
constexpr int kMaxDevices = 64;

struct Api {
  create_t create = nullptr;
  set_stream_t set_stream = nullptr;
  syevd_lwork_t lwork = nullptr;
  syevd_t syevd = nullptr;
};

// One cuSOLVER handle per (device, stream), bound to that stream once at creation (NVIDIA: a
// handle per thread or stream; MXNet gives each GPU worker thread its own stream): calls on
// different streams never share a handle's workspace or its stream binding, and run concurrently;
// calls on the same stream (the same handle) are serialized by the entry's lock. Entries are never
// removed and handles never destroyed (a handle destroyed at exit may outlive the driver); MXNet
// has a few streams per device, so the table stays small.
struct HandleEntry {
  const Api* api = nullptr;
  int dev = -1;
  void* stream = nullptr;
  Handle handle = nullptr;
  std::mutex mu;  // calls on this handle
};
constexpr int kMaxHandles = 256;

// One loaded library per requested name (GNMX_CUSOLVER_LIBRARY's value, "" = the default search),
// so that a test can point the variable elsewhere in the same process. Failures are not cached.
struct Slot {
  char name[512];
  Api api;
};
constexpr int kMaxSlots = 8;
std::mutex g_mu;  // slots, the handle table
Slot g_slots[kMaxSlots];
int g_nslots = 0;
HandleEntry g_handles[kMaxHandles];
int g_nhandles = 0;

void* open_lib(const char* name, int flags) { return dlopen(name, RTLD_LAZY | RTLD_LOCAL | flags); }

// The library handle by the search in cusolver_loader.h; on failure *why names what was tried.
void* find_library(const char* requested, char* why, size_t n) {
  if (requested[0]) {
    void* h = open_lib(requested, 0);
    if (!h) std::snprintf(why, n, "GNMX_CUSOLVER_LIBRARY=%s: %s", requested, dlerror());
    return h;
  }
  static const char* const kNames[] = {"libcusolver.so.11", "libcusolver.so.12", "libcusolver.so"};
  for (const char* nm : kNames)
    if (void* h = open_lib(nm, RTLD_NOLOAD)) return h;
  const char* last = "";
  for (const char* nm : kNames) {
    if (void* h = open_lib(nm, 0)) return h;
    last = dlerror();
  }
  std::snprintf(why, n, "tried libcusolver.so.11, .so.12, .so (last: %s)", last ? last : "");
  return nullptr;
}

// The loaded API for the current GNMX_CUSOLVER_LIBRARY; nullptr and *err on failure. g_mu held.
Api* load_locked(const char** err) {
  const char* env = std::getenv("GNMX_CUSOLVER_LIBRARY");
  const char* requested = env ? env : "";
  for (int i = 0; i < g_nslots; ++i)
    if (std::strcmp(g_slots[i].name, requested) == 0) return &g_slots[i].api;
  if (std::strlen(requested) >= sizeof(g_slots[0].name) || g_nslots == kMaxSlots) {
    *err = cusolver_missing_message("GNMX_CUSOLVER_LIBRARY: too long, or too many different values");
    return nullptr;
  }
  char why[768];
  void* h = find_library(requested, why, sizeof(why));
  if (!h) {
    *err = cusolver_missing_message(why);
    return nullptr;
  }
  Api a;
  a.create = reinterpret_cast<create_t>(dlsym(h, "cusolverDnCreate"));
  a.set_stream = reinterpret_cast<set_stream_t>(dlsym(h, "cusolverDnSetStream"));
  a.lwork = reinterpret_cast<syevd_lwork_t>(dlsym(h, "cusolverDnDsyevd_bufferSize"));
  a.syevd = reinterpret_cast<syevd_t>(dlsym(h, "cusolverDnDsyevd"));
  if (!a.create || !a.set_stream || !a.lwork || !a.syevd) {
    *err = cusolver_missing_message("the library lacks cusolverDnCreate / cusolverDnSetStream / "
                                    "cusolverDnDsyevd(_bufferSize)");
    return nullptr;
  }
  Slot& s = g_slots[g_nslots++];
  std::snprintf(s.name, sizeof(s.name), "%s", requested);
  s.api = a;
  return &s.api;
}

const char* status_error(const char* call, int status) {
  thread_local char buf[160];
  std::snprintf(buf, sizeof(buf), "%s failed (cusolverStatus_t %d)", call, status);
  return buf;
}

// The handle of (current device, stream) for the current GNMX_CUSOLVER_LIBRARY, created and bound
// to `stream` on first use; nullptr or the error.
const char* handle_for(void* stream, HandleEntry** out) {
  int dev = 0;
  if (const char* e = cuda_error(cudaGetDevice(&dev))) return e;
  if (dev < 0 || dev >= kMaxDevices) return "cuSOLVER: device ordinal out of range";
  std::lock_guard<std::mutex> lock(g_mu);
  const char* err = nullptr;
  Api* a = load_locked(&err);
  if (!a) return err;
  for (int i = 0; i < g_nhandles; ++i) {
    HandleEntry& h = g_handles[i];
    if (h.api == a && h.dev == dev && h.stream == stream) {
      *out = &h;
      return nullptr;
    }
  }
  if (g_nhandles == kMaxHandles)
    return "cuSOLVER: more than 256 (device, stream) pairs used the eigensolver; gn_mx keeps one "
           "handle per pair";
  Handle nh = nullptr;
  if (int s = a->create(&nh)) return status_error("cusolverDnCreate", s);
  if (int s = a->set_stream(nh, stream)) return status_error("cusolverDnSetStream", s);
  HandleEntry& h = g_handles[g_nhandles++];
  h.api = a;
  h.dev = dev;
  h.stream = stream;
  h.handle = nh;
  *out = &h;
  return nullptr;
}

}  // namespace

const char* cusolver_missing_message(const char* detail) {
  thread_local char buf[1200];
  std::snprintf(buf, sizeof(buf),
                "cuSOLVER (libcusolver.so.11 or .so.12) could not be loaded: %s. The CUDA DBN "
                "eigensolver uses it for group sizes too large for shared memory; mxnet-cu112 ships "
                "it (libmxnet.so links libcusolver.so.11), otherwise install it (e.g. pip install "
                "nvidia-cusolver-cu11, or the CUDA toolkit) and add its lib directory to "
                "LD_LIBRARY_PATH, or point GNMX_CUSOLVER_LIBRARY at it; GNMX_DBN_CUDA_EIG=global "
                "uses the (much slower) Jacobi solver instead (docs/dbn.md)",
                detail);
  return buf;
}

const char* cusolver_syevd_lwork(int n, int* lwork) {
  // A host-side query: the handle of the null stream serves it (its answer depends on n only).
  HandleEntry* h = nullptr;
  if (const char* e = handle_for(nullptr, &h)) return e;
  std::lock_guard<std::mutex> lock(h->mu);
  *lwork = 0;
  // The query reads no matrix: null data pointers with the real leading dimension.
  if (int s = h->api->lwork(h->handle, kEigModeVector, kFillLower, n, nullptr, n, nullptr, lwork))
    return status_error("cusolverDnDsyevd_bufferSize", s);
  return nullptr;
}

const char* cusolver_syevd_batch(void* stream, double* a, long long stride, int n, int count,
                                 double* w, int* info, double* work, int lwork) {
  HandleEntry* h = nullptr;
  if (const char* e = handle_for(stream, &h)) return e;
  std::lock_guard<std::mutex> lock(h->mu);
  for (int k = 0; k < count; ++k)
    if (int s = h->api->syevd(h->handle, kEigModeVector, kFillLower, n, a + k * stride, n,
                              w + (long long)k * n, work, lwork, info + k))
      return status_error("cusolverDnDsyevd", s);
  return nullptr;
}

}  // namespace gn_mx
