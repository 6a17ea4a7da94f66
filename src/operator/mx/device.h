/*
 * device.h: the device a lib_api callback runs on, and the one way every op runs a kernel there.
 *
 * Every forward/backward callback does the same on cpu and gpu (the "gpu" registrations exist only
 * in a CUDA build, GNMX_WITH_CUDA):
 *   1. validate and fill the kernel's Args (op files),
 *   2. run(op, dev, kernel, args, {aux grads}): ask the device's kernel how much workspace it needs,
 *      take it from lib_api's temp space (one allocation per callback: a second one may alias the
 *      first), launch, turn a kernel error string into the op's MXNetError, zero the aux-state
 *      gradients (memset on the host, cudaMemsetAsync on MXNet's stream).
 * On the gpu, before anything is launched: the current CUDA device must be the data's, and an
 * error left by earlier GPU work is reported as such (cuda_op_prologue), never as the op's; with
 * GNMX_CUDA_SYNC=1 every kernel and then the op's stream are synchronized and checked, so a fault
 * names the op (and the kernel's launch line) that caused it (cuda_util.h).
 * A Kernel<Args> pairs the CPU and CUDA entry points of one computation (kernels/<name>.h); in a
 * build without CUDA its CUDA members are null.
 */
#pragma once
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "tensors.h"
#if defined(GNMX_WITH_CUDA)
#include "../kernels/cuda_util.h"
#endif

namespace gn_mx {
namespace mxa {

// A CUDA entry point inside a Kernel<> initializer, or null without CUDA.
#if defined(GNMX_WITH_CUDA)
#define GNMX_CUDA_ENTRY(f) f
#else
#define GNMX_CUDA_ENTRY(f) nullptr
#endif

template <class Args>
struct Kernel {
  const char* (*cpu)(const Args&);
  size_t (*cpu_workspace)(const Args&);          // null: needs none
  const char* (*cuda)(const Args&, void* stream);  // null: built without CUDA
  size_t (*cuda_workspace)(const Args&);         // null: needs none
};

struct Device {
  bool gpu = false;
  const OpResource* res = nullptr;
  int id = 0;  // the gpu ordinal of the op's data
  const char* name() const { return gpu ? "gpu" : "cpu"; }
  void* stream() const { return gpu ? res->get_cuda_stream() : nullptr; }
};

// The device of the callback, from its data tensor (MXNet runs an op where its inputs live).
inline Device device_of(const char* op, const MXTensor& x, const OpResource& res) {
  const std::string& t = x.ctx.dev_type;
  if (t == "gpu") {
#if !defined(GNMX_WITH_CUDA)
    fail(op, ": gn_mx was built without CUDA (rebuild with GNMX_CUDA=1)");
#endif
    return Device{true, &res, x.ctx.dev_id};
  }
  if (t == "cpu" || t.rfind("cpu_", 0) == 0) return Device{false, &res, 0};  // cpu_pinned, cpu_shared
  fail(op, ": unsupported context '", t, "' (gn_mx runs on cpu and gpu)");
}

// `bytes` of lib_api temp space on the device, 64-byte aligned (nullptr for 0 bytes).
inline void* workspace(const Device& dev, size_t bytes, const char* op) {
  constexpr size_t kAlign = 64;
  if (bytes == 0) return nullptr;
  const size_t want = bytes + kAlign;  // lib_api gives no alignment guarantee: ask for the slack
  if (want > static_cast<size_t>(INT32_MAX))
    fail(op, ": workspace of ", want, " bytes exceeds lib_api's int allocation limit");
  const int n = static_cast<int>(want);
  void* p = dev.gpu ? dev.res->alloc_gpu(n) : dev.res->alloc_cpu(n);
  if (!p) fail(op, ": could not allocate ", want, " bytes of ", dev.name(), " workspace");
  const uintptr_t u = (reinterpret_cast<uintptr_t>(p) + kAlign - 1) / kAlign * kAlign;
  return reinterpret_cast<void*>(u);
}

// Writes zeros over a whole tensor on the device (aux-state gradients).
inline void zero_tensor(const Device& dev, MXTensor& t, const char* op) {
  if (t.data_ptr == nullptr || t.size() <= 0) return;
  const size_t bytes = static_cast<size_t>(t.size()) * dtype_size(to_dtype(t.dtype));
  if (!dev.gpu) {
    std::memset(t.data_ptr, 0, bytes);
    return;
  }
#if defined(GNMX_WITH_CUDA)
  if (const char* e = zero_cuda(t.data_ptr, bytes, dev.stream())) fail(op, ": ", e);
#endif
}

template <class A, class = void>
struct HasWorkspace : std::false_type {};
template <class A>
struct HasWorkspace<A, std::void_t<decltype(std::declval<A&>().workspace)>> : std::true_type {};

// Runs kernel `k` on `dev` with args `a` (workspace filled in here), then zeroes `zeroed`.
template <class A>
void run(const char* op, const Device& dev, const Kernel<A>& k, A a,
         std::initializer_list<MXTensor*> zeroed = {}) {
  if (dev.gpu && k.cuda == nullptr) fail(op, ": gn_mx was built without CUDA");
#if defined(GNMX_WITH_CUDA)
  if (dev.gpu)
    if (const char* e = cuda_op_prologue(dev.id, dev.stream())) fail(op, ": ", e);
#endif
  if constexpr (HasWorkspace<A>::value) {
    size_t (*size)(const A&) = dev.gpu ? k.cuda_workspace : k.cpu_workspace;
    a.workspace = workspace(dev, size ? size(a) : 0, op);
  }
  const char* err = dev.gpu ? k.cuda(a, dev.stream()) : k.cpu(a);
  if (err) fail(op, ": ", err);
  for (MXTensor* t : zeroed) zero_tensor(dev, *t, op);
#if defined(GNMX_WITH_CUDA)
  if (dev.gpu)
    if (const char* e = cuda_op_epilogue(dev.stream())) fail(op, ": ", e);
#endif
}

}  // namespace mxa
}  // namespace gn_mx
