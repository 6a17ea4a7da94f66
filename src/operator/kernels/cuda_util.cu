/*
 * cuda_util.cu: see cuda_util.h.
 */
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_common.cuh"
#include "cuda_util.h"

#ifndef GNMX_CUDA_ARCHS  // set by CMakeLists.txt from CMAKE_CUDA_ARCHITECTURES
#define GNMX_CUDA_ARCHS "unknown"
#endif
#ifndef CUDART_VERSION
#define CUDART_VERSION 0
#endif

namespace gn_mx {

const char* zero_cuda(void* p, size_t bytes, void* stream) {
  if (p == nullptr || bytes == 0) return nullptr;
  return cuda_error(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)));
}

bool cuda_sync_mode() {
  static const bool on = [] {
    const char* v = std::getenv("GNMX_CUDA_SYNC");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

namespace {

// Whether the context holds a sticky error (every later call fails: the process must restart):
// cudaStreamQuery reports it; a stream still busy (cudaErrorNotReady) is no error.
cudaError_t sticky_error(void* stream) {
  const cudaError_t q = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  return q == cudaErrorNotReady ? cudaSuccess : q;
}

constexpr const char* kStickyAdvice =
    " The error is sticky: the CUDA context is unusable until the process restarts. To find the "
    "operation that failed, run with CUDA_LAUNCH_BLOCKING=1 (GNMX_CUDA_SYNC=1 checks each of "
    "gn_mx's kernels).";

const char* file_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

// The one wording of GPU work that failed while running, found by GNMX_CUDA_SYNC's synchronization
// (`what`: the work, `after`: what the mode synchronizes after), in the calling thread's buffer.
const char* failed_while_running(const char* what, cudaError_t e, bool sticky, const char* after) {
  thread_local char buf[640];
  std::snprintf(buf, sizeof buf,
                "%s failed while running: %s (%s) (GNMX_CUDA_SYNC=1 synchronizes after %s).%s",
                what, cudaGetErrorName(e), cudaGetErrorString(e), after,
                sticky ? kStickyAdvice : "");
  return buf;
}

}  // namespace

const char* cuda_check_launch(const char* file, int line) {
  if (const char* e = cuda_error(cudaGetLastError())) return e;
  if (!cuda_sync_mode()) return nullptr;
  // The launch's stream is not known here: the whole device (GNMX_CUDA_SYNC is for debugging).
  const cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) return nullptr;
  (void)cudaGetLastError();
  const bool sticky = sticky_error(nullptr) != cudaSuccess;
  char where[320];
  std::snprintf(where, sizeof where, "the kernel launched at %s:%d", file_name(file), line);
  return failed_while_running(where, e, sticky, "every gn_mx kernel");
}

const char* cuda_op_prologue(int dev_id, void* stream) {
  thread_local char buf[640];
  int cur = 0;
  if (const char* e = cuda_error(cudaGetDevice(&cur))) return e;
  if (cur != dev_id) {
    std::snprintf(buf, sizeof buf,
                  "the data is on gpu(%d) but the current CUDA device is %d: gn_mx launches on the "
                  "current device, which MXNet sets to the op's context before calling it (code "
                  "that calls cudaSetDevice inside an operator must restore the device)",
                  dev_id, cur);
    return buf;
  }
  const cudaError_t pending = cudaGetLastError();  // clears it unless it is sticky
  const cudaError_t sticky = sticky_error(stream);
  if (pending == cudaSuccess && sticky == cudaSuccess) return nullptr;
  const cudaError_t e = sticky != cudaSuccess ? sticky : pending;
  std::snprintf(buf, sizeof buf,
                "CUDA reported %s (%s) before this op launched anything: the error comes from "
                "earlier work on the GPU (another operator, or a kernel still running), not from "
                "gn_mx.%s",
                cudaGetErrorName(e), cudaGetErrorString(e),
                sticky != cudaSuccess ? kStickyAdvice
                                      : " It had been left unchecked by an earlier CUDA call (now "
                                        "cleared).");
  return buf;
}

const char* cuda_op_epilogue(void* stream) {
  if (!cuda_sync_mode()) return nullptr;
  cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess) return nullptr;
  (void)cudaGetLastError();
  const bool sticky = sticky_error(stream) != cudaSuccess;
  return failed_while_running("its GPU work", e, sticky, "each op");
}

int cuda_runtime_built_version() { return CUDART_VERSION; }
const char* cuda_built_archs() { return GNMX_CUDA_ARCHS; }

namespace {

// The helpers below format with snprintf and std::string::append only: no std::to_string /
// operator+ template instantiations, which the GPU harness (hidden visibility, no version
// script) would otherwise export as weak symbols.

// "11.8" for 11080, "unknown" for <= 0.
const char* cuda_version_str(int v, char* buf, size_t n) {
  if (v <= 0) return "unknown";
  std::snprintf(buf, n, "%d.%d", v / 1000, (v % 1000) / 10);
  return buf;
}

// The oldest driver that runs a given CUDA runtime major version (CUDA 11+: minor-version
// compatibility, so any driver of the major's first release line).
const char* min_driver_for(int runtime) {
  switch (runtime / 1000) {
    case 11: return "450.80.02";
    case 12: return "525.60.13";
    case 13: return "580.65.06";
    default: return nullptr;
  }
}

void append_arch(std::string* list, const char* prefix, const std::string& num) {
  if (!list->empty()) list->append(", ");
  list->append(prefix).append(num);
}

// "50-real,60-real,90" -> SASS "sm_50, sm_60, sm_90", PTX "compute_90".
void describe_archs(const std::string& archs, std::string* sass, std::string* ptx) {
  size_t start = 0;
  while (start <= archs.size()) {
    size_t end = archs.find_first_of(",;", start);
    if (end == std::string::npos) end = archs.size();
    std::string a = archs.substr(start, end - start);
    start = end + 1;
    if (a.empty()) continue;
    const bool real_only = a.find("-real") != std::string::npos;
    const bool virtual_only = a.find("-virtual") != std::string::npos;
    const std::string num = a.substr(0, a.find('-'));
    if (!virtual_only) append_arch(sass, "sm_", num);
    if (!real_only) append_arch(ptx, "compute_", num);
  }
}

}  // namespace

std::string cuda_setup_message(const char* error_name, const char* error_text, bool driver_problem,
                               int driver, int runtime, int cc, const char* archs) {
  char rt[16], drv[16], buf[1024];
  cuda_version_str(runtime, rt, sizeof rt);
  std::string m = "this build of gn_mx cannot run its CUDA kernels here (";
  m.append(error_name).append(": ").append(error_text).append("): ");
  if (driver_problem) {
    const char* need = min_driver_for(runtime);
    std::snprintf(buf, sizeof buf,
                  "the NVIDIA driver reports CUDA %s, but the library links the CUDA %s runtime "
                  "statically, which needs %s%s (its PTX needs a driver of CUDA %s or newer to be "
                  "JIT-compiled). Update the driver, or install a gn_mx built with the CUDA your "
                  "driver supports (the release wheel uses CUDA 11.8: drivers >= 450.80.02; see "
                  "docs/install.md)",
                  driver > 0 ? cuda_version_str(driver, drv, sizeof drv) : "(no driver found)",
                  cuda_version_str(runtime, rt, sizeof rt),
                  need ? "an NVIDIA driver >= " : "a newer NVIDIA driver", need ? need : "", rt);
  } else {
    std::string sass, ptx;
    describe_archs(archs ? archs : "", &sass, &ptx);
    char ccs[16], arch[16];
    if (cc > 0) {
      std::snprintf(ccs, sizeof ccs, "%d.%d", cc / 10, cc % 10);
      std::snprintf(arch, sizeof arch, "%d", cc);
    } else {
      std::snprintf(ccs, sizeof ccs, "unknown");
      std::snprintf(arch, sizeof arch, "<arch>");
    }
    std::snprintf(buf, sizeof buf,
                  "no kernel for this GPU (compute capability %s); the library has SASS for %s and "
                  "PTX for %s (PTX runs only on GPUs of that or a newer architecture, with a driver "
                  "of CUDA %s or newer: the driver reports %s). Build gn_mx for this GPU: "
                  "GNMX_CUDA=1 GNMX_CUDA_ARCH=%s pip install --no-build-isolation . (see "
                  "docs/install.md)",
                  ccs, sass.empty() ? "no architecture" : sass.c_str(),
                  ptx.empty() ? "none" : ptx.c_str(), rt, cuda_version_str(driver, drv, sizeof drv),
                  arch);
  }
  m.append(buf);
  return m;
}

const char* cuda_setup_error_message(cudaError_t e) {
  static thread_local std::string msg;
  int driver = 0, dev = 0, major = 0, minor = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    major = minor = 0;
  const bool driver_problem = e == cudaErrorInsufficientDriver ||
                              e == cudaErrorCallRequiresNewerDriver ||
                              e == cudaErrorUnsupportedPtxVersion ||
                              e == cudaErrorSystemDriverMismatch;
  msg = cuda_setup_message(cudaGetErrorName(e), cudaGetErrorString(e), driver_problem, driver,
                           CUDART_VERSION, major * 10 + minor, GNMX_CUDA_ARCHS);
  (void)cudaGetLastError();  // clear a non-sticky error so a later call reports its own
  return msg.c_str();
}

}  // namespace gn_mx
