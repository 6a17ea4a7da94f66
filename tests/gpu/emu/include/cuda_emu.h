/*
 * cuda_emu.h: a tiny CPU emulator of the CUDA subset the gn_mx kernels use, for checking kernel
 * *logic* (indexing, launch plans, reductions, the Jacobi schedule) on machines without a GPU.
 * NOT a performance or memory-model check: blocks run one at a time; each CUDA thread is a ucontext
 * fiber on the calling OS thread, switched round-robin at __syncthreads (a barrier over the block) and
 * at warp shuffles (per-warp slots and a 32-lane barrier); __shared__ variables are function
 * statics (one block at a time makes that exact). Kernel launches `k<<<g, b, smem, s>>>(args)` are rewritten by build_emu.py into
 * `emu::launch(k, g, b, smem, s)(args)`. Used by tests/gpu/emu/build_emu.py only.
 */
#pragma once
#include <immintrin.h>
#include <math.h>

#include <setjmp.h>
#include <ucontext.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef void* cudaStream_t;
enum cudaError_t {  // the real codes, for those the kernels test for
  cudaSuccess = 0,
  cudaErrorInsufficientDriver = 35,
  cudaErrorCallRequiresNewerDriver = 36,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorUnsupportedPtxVersion = 222,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorSystemDriverMismatch = 803,
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {  // the fields the kernels read
  size_t sharedSizeBytes = 0;
};

namespace emu {
// Cooperative fibers, one per CUDA thread, on the calling OS thread: entered once through
// makecontext, then switched with _setjmp/_longjmp (no signal-mask syscalls).
struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  std::vector<char> stack;
  dim3 tid;
  bool started = false, done = false;
};
inline dim3 t_thread, t_block;  // of the running fiber (blocks run in lockstep)
inline dim3 g_grid, g_bdim;
inline unsigned char* g_dyn_smem = nullptr;
inline jmp_buf g_sched_jb;
inline std::vector<Fiber>* g_fibers = nullptr;
inline unsigned g_cur = 0;
inline unsigned g_bar_count = 0, g_bar_gen = 0;          // __syncthreads
inline unsigned g_end_count = 0, g_end_gen = 0;          // end of a block
inline unsigned g_wcount[32] = {0}, g_wgen[32] = {0};  // warp shuffles
inline uint64_t g_slots[32][32];
inline int g_and = 1;

inline void yield() {
  Fiber& f = (*g_fibers)[g_cur];
  f.tid = t_thread;
  if (!_setjmp(f.jb)) _longjmp(g_sched_jb, 1);
  t_thread = (*g_fibers)[g_cur].tid;
}

// Barrier over `expected` arrivals: the last one releases, the others yield until released.
inline void barrier(unsigned* count, unsigned* gen, unsigned expected) {
  const unsigned my_gen = *gen;
  if (++*count == expected) {
    *count = 0;
    ++*gen;
    return;
  }
  while (*gen == my_gen) yield();
}
}  // namespace emu

#define threadIdx (emu::t_thread)
#define blockIdx (emu::t_block)
#define blockDim (emu::g_bdim)
#define gridDim (emu::g_grid)

// GNMX_EMU_CUDA_ERROR=<code>: every launch (cudaGetLastError) and memset fails with that error, as
// on a machine whose driver is too old (35) or whose GPU has no kernel in the build (209);
// GNMX_EMU_DRIVER (cudaDriverGetVersion, default 13000) and GNMX_EMU_CC (compute capability as
// 10 * major + minor, default 90) are what such a machine reports.
inline int emu_env_int(const char* name, int dflt) {
  const char* e = std::getenv(name);
  return e ? std::atoi(e) : dflt;
}
inline cudaError_t emu_injected_error() {
  return static_cast<cudaError_t>(emu_env_int("GNMX_EMU_CUDA_ERROR", 0));
}
// Errors that earlier work left behind, and faults that surface only at a synchronization (the
// adapter's checks, src/operator/mx/device.h; tests/test_adapter_emu.py):
//   GNMX_EMU_PENDING_ERROR=<code>: an unchecked, non-sticky error: the next cudaGetLastError of the
//     process returns it once;
//   GNMX_EMU_STICKY_ERROR=<code>: a sticky error (e.g. 700, an illegal address): cudaGetLastError,
//     cudaStreamQuery and every synchronization return it;
//   GNMX_EMU_KERNEL_FAULT=<code>: the kernels run, and the fault shows only when the stream or the
//     device is synchronized (as a real kernel's asynchronous fault);
//   GNMX_EMU_DEVICE=<n>: what cudaGetDevice reports (default 0).
inline cudaError_t emu_sticky_error() {
  return static_cast<cudaError_t>(emu_env_int("GNMX_EMU_STICKY_ERROR", 0));
}
inline cudaError_t cudaGetLastError() {
  static std::atomic<bool> pending_taken{false};
  if (cudaError_t e = emu_sticky_error()) return e;
  const int pending = emu_env_int("GNMX_EMU_PENDING_ERROR", 0);
  if (pending && !pending_taken.exchange(true)) return static_cast<cudaError_t>(pending);
  return emu_injected_error();
}
inline cudaError_t cudaStreamQuery(cudaStream_t) { return emu_sticky_error(); }
inline cudaError_t emu_synchronize() {
  if (cudaError_t e = emu_sticky_error()) return e;
  return static_cast<cudaError_t>(emu_env_int("GNMX_EMU_KERNEL_FAULT", 0));
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return emu_synchronize(); }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    default: return "cuda_emu error";
  }
}
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    default: return "cudaErrorUnknown";
  }
}
inline cudaError_t cudaDriverGetVersion(int* v) {
  *v = emu_env_int("GNMX_EMU_DRIVER", 13000);
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) { *d = emu_env_int("GNMX_EMU_DEVICE", 0); return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  if (a == cudaDevAttrComputeCapabilityMajor) *v = emu_env_int("GNMX_EMU_CC", 90) / 10;
  else if (a == cudaDevAttrComputeCapabilityMinor) *v = emu_env_int("GNMX_EMU_CC", 90) % 10;
  else if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin)
    *v = emu_env_int("GNMX_EMU_SMEM_OPTIN", 232448);  // sm_90's 227 KB; 49152 on sm_50/60
  else *v = emu_env_int("GNMX_EMU_SMS", 4);
  return cudaSuccess;
}
// Resident blocks per SM: GNMX_EMU_BLOCKS_PER_SM=N, else what 2048 threads per SM allow (the
// real API also weighs registers and shared memory; the emulator has neither).
// GNMX_EMU_BLOCKS_PER_SM=vary gives each kernel its own count (1..8, from its address), as real
// register use does: plans that must agree (workspace query vs launch) then diverge if they ask
// about different kernels.
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void* kernel,
                                                                 int threads, size_t) {
  const char* e = std::getenv("GNMX_EMU_BLOCKS_PER_SM");
  if (e && std::strcmp(e, "vary") == 0)
    *n = 1 + static_cast<int>((reinterpret_cast<uintptr_t>(kernel) >> 4) % 8);
  else
    *n = e ? std::atoi(e) : (threads > 0 ? 2048 / threads : 1);
  if (*n < 1) *n = 1;
  return cudaSuccess;
}
// Static shared memory: GNMX_EMU_STATIC_SMEM bytes (default 1024) for every kernel (the emulator
// cannot measure it; the real figure is ptxas's). The opt-in attribute is recorded nowhere: blocks
// get whatever dynamic shared memory their launch asks for.
template <typename K>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, K*) {
  a->sharedSizeBytes = static_cast<size_t>(emu_env_int("GNMX_EMU_STATIC_SMEM", 1024));
  return cudaSuccess;
}
template <typename K>
inline cudaError_t cudaFuncSetAttribute(K*, cudaFuncAttribute, int) { return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  if (cudaError_t e = emu_injected_error()) return e;
  std::memset(p, v, n);
  return cudaSuccess;
}
// Device memory is host memory (the harness's memory calls, tests/gpu/harness.cc).
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t n) {
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  std::memcpy(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return emu_synchronize(); }

struct __half {
  uint16_t bits;
};
inline float __half2float(__half h) { return _cvtsh_ss(h.bits); }
inline __half __float2half_rn(float f) { return __half{_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)}; }
inline double __longlong_as_double(long long v) {
  double d;
  std::memcpy(&d, &v, sizeof(d));
  return d;
}
using std::isfinite;

inline void __syncthreads() {
  emu::barrier(&emu::g_bar_count, &emu::g_bar_gen, emu::g_bdim.x * emu::g_bdim.y * emu::g_bdim.z);
}
inline int __syncthreads_and(int pred) {
  __syncthreads();
  if (!pred) emu::g_and = 0;
  __syncthreads();
  const int r = emu::g_and;
  __syncthreads();
  if (threadIdx.x == 0) emu::g_and = 1;
  __syncthreads();
  return r;
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int off) {
  static_assert(sizeof(T) <= 8, "shuffle of > 8 bytes");
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu::g_slots[warp][lane] = bits;
  emu::barrier(&emu::g_wcount[warp], &emu::g_wgen[warp], 32);
  bits = emu::g_slots[warp][lane ^ unsigned(off)];
  emu::barrier(&emu::g_wcount[warp], &emu::g_wgen[warp], 32);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned off) {
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu::g_slots[warp][lane] = bits;
  emu::barrier(&emu::g_wcount[warp], &emu::g_wgen[warp], 32);
  if (lane + off < 32) bits = emu::g_slots[warp][lane + off];
  emu::barrier(&emu::g_wcount[warp], &emu::g_wgen[warp], 32);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

namespace emu {
inline unsigned char* dyn_smem() { return g_dyn_smem; }

inline const std::function<void()>* g_body = nullptr;

inline void fiber_main() {
  const unsigned me = g_cur;
  const unsigned nt = g_bdim.x * g_bdim.y * g_bdim.z;
  t_thread = dim3(me, 0, 0);
  for (unsigned by = 0; by < g_grid.y; ++by)
    for (unsigned bx = 0; bx < g_grid.x; ++bx) {
      t_block = dim3(bx, by, 0);
      (*g_body)();
      barrier(&g_end_count, &g_end_gen, nt);  // kernels never __syncthreads after a return
    }
  (*g_fibers)[me].done = true;
  _longjmp(g_sched_jb, 1);
}

// Round-robin over the fibers until every one has run every block.
inline void run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  const unsigned nt = block.x * block.y * block.z;
  g_grid = grid;
  g_bdim = block;
  g_body = &body;
  std::vector<unsigned char> dyn(smem + 16);
  g_dyn_smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(dyn.data()) + 15) & ~uintptr_t(15));
  static std::vector<Fiber> fibers;  // stacks reused across launches
  if (fibers.size() < nt) fibers.resize(nt);
  g_fibers = &fibers;
  g_bar_count = g_end_count = 0;
  for (unsigned w = 0; w < 32; ++w) g_wcount[w] = 0;
  for (unsigned t = 0; t < nt; ++t) {
    Fiber& f = fibers[t];
    if (f.stack.empty()) f.stack.resize(128 * 1024);
    f.started = f.done = false;
    f.tid = dim3(t, 0, 0);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  unsigned alive = nt;
  while (alive > 0) {
    alive = 0;
    for (unsigned t = 0; t < nt; ++t) {
      Fiber& f = fibers[t];
      if (f.done) continue;
      g_cur = t;
      t_thread = f.tid;
      if (!_setjmp(g_sched_jb)) {
        if (!f.started) {
          f.started = true;
          ucontext_t here;
          swapcontext(&here, &f.ctx);
        } else {
          _longjmp(f.jb, 1);
        }
      }
      if (!f.done) ++alive;
    }
  }
  g_fibers = nullptr;
}

template <typename... P>
struct Launcher {
  void (*k)(P...);
  dim3 g, b;
  size_t smem;
  template <typename... A>
  void operator()(A&&... a) const {
    std::tuple<P...> params(std::forward<A>(a)...);
    auto kk = k;
    run_grid(g, b, smem, [&] { std::apply(kk, params); });
  }
};

// GNMX_EMU_LAUNCH_LOG=<file>: every launch appends "grid.x grid.y grid.z block.x" to it (tests
// check launch plans with it, e.g. tests/gpu/test_gpu_plans.py).
inline void log_launch(dim3 g, dim3 b) {
  const char* path = std::getenv("GNMX_EMU_LAUNCH_LOG");
  if (!path) return;
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%u %u %u %u\n", g.x, g.y, g.z, b.x);
    std::fclose(f);
  }
}

template <typename... P>
Launcher<P...> launch(void (*k)(P...), dim3 g, dim3 b, size_t smem, cudaStream_t) {
  log_launch(g, b);
  return Launcher<P...>{k, g, b, smem};
}
}  // namespace emu
