/*
 * cuda_emu.h: a CPU emulator of the CUDA subset the gn_mx kernels use, for checking kernel *logic*
 * (indexing, launch plans, reductions, the Jacobi schedule) on machines without a GPU, and for
 * failing where a GPU would. NOT a performance or memory-model check: blocks run one at a time; each
 * CUDA thread is a ucontext fiber on the calling OS thread, switched at __syncthreads (a barrier
 * over the block), at warp shuffles (a barrier over the mask's lanes) and at GN_ASSERT_UNIFORM (a
 * barrier over the team). Kernel launches `k<<<g, b, smem, s>>>(args)` are rewritten by
 * build_emu.py into `emu::launch(k, g, b, smem, s)(args)`, and a kernel declared with
 * __launch_bounds__(n) starts with `emu::launch_bounds(n);`. Used by tests/gpu/emu/build_emu.py only.
 *
 * The hardware's rules it enforces (tests/gpu/README.md lists them and what it cannot see): a
 * broken rule fails the launch like a GPU error: cudaGetLastError / cudaDeviceSynchronize return
 * it once, its string names the rule (GNMX_EMU_ABORT=1: print it and abort() instead).
 *   launch      block <= 1024 threads (x, y <= 1024, z <= 64) and <= the kernel's
 *               __launch_bounds__; grid x < 2^31, y and z <= 65535; no zero dimension; blockIdx.z
 *               iterated;
 *   shared mem  dynamic > 48 KB only after cudaFuncSetAttribute(kernel,
 *               cudaFuncAttributeMaxDynamicSharedMemorySize) recorded at least that much for that
 *               kernel and device; static (cudaFuncGetAttributes' figure) + dynamic <= the
 *               architecture's opt-in limit (GNMX_EMU_ARCH); static (__shared__) and dynamic
 *               shared memory are filled with 0xff bytes (NaN for fp16/fp32/fp64, -1 for ints) at
 *               every block start (GNMX_EMU_POISON=0: not);
 *   shuffles    all lanes of one shuffle come from the same call site (the return-address chain)
 *               and pass the same mask, which names exactly the lanes that arrive; a lane that
 *               never comes (returned, or waiting elsewhere) is a deadlock, reported;
 *   barriers    a __syncthreads / shuffle / team assertion that some threads never reach: deadlock
 *               (what the threads wait at), reported;
 *   uniformity  GN_ASSERT_UNIFORM(kTeam, v) (cuda_common.cuh): v bitwise the same on the team;
 *   schedules   between barriers the block's threads run in forward, reverse or seeded random
 *               order: GNMX_EMU_SCHED=forward (default) | reverse | random:SEED; reverse also
 *               runs the grid's blocks last to first (a block that reads what a higher block of
 *               the same launch writes then sees something else).
 * Architecture: GNMX_EMU_ARCH=sm_90 (default) | sm_80 | sm_86 | sm_75 | sm_70 | sm_61 | sm_60 sets
 * the compute capability, the opt-in shared memory per block and the threads per SM (occupancy);
 * GNMX_EMU_CC / GNMX_EMU_SMEM_OPTIN override the first two.
 */
#pragma once
#include <immintrin.h>
#include <math.h>

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#define GNMX_CUDA_EMU 1
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Function statics (one block at a time makes that exact), all in one section that is poisoned at
// every block start.
#define __shared__ static __attribute__((section("gnmx_emu_shared")))

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef void* cudaStream_t;
enum cudaError_t {  // the real codes, for those the kernels test for or the emulator reports
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInsufficientDriver = 35,
  cudaErrorCallRequiresNewerDriver = 36,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoKernelImageForDevice = 209,
  cudaErrorUnsupportedPtxVersion = 222,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorAssert = 710,
  cudaErrorLaunchFailure = 719,
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

inline int emu_env_int(const char* name, int dflt) {
  const char* e = std::getenv(name);
  return e ? std::atoi(e) : dflt;
}

namespace emu {
// ---- Architecture (GNMX_EMU_ARCH) ----------------------------------------------------------------
struct Arch {
  int cc;            // 10 * major + minor
  int smem_optin;    // cudaDevAttrMaxSharedMemoryPerBlockOptin (bytes)
  int threads_sm;    // resident threads per SM
};
inline Arch arch() {
  static const struct {
    const char* name;
    Arch a;
  } kArchs[] = {{"sm_90", {90, 232448, 2048}}, {"sm_80", {80, 166912, 2048}},
                {"sm_86", {86, 101376, 1536}}, {"sm_75", {75, 65536, 1024}},
                {"sm_70", {70, 98304, 2048}},  {"sm_61", {61, 49152, 2048}},
                {"sm_60", {60, 49152, 2048}}};
  const char* e = std::getenv("GNMX_EMU_ARCH");
  Arch a = kArchs[0].a;
  if (e) {
    bool found = false;
    for (const auto& k : kArchs)
      if (std::strcmp(k.name, e) == 0) a = k.a, found = true;
    if (!found) {
      std::fprintf(stderr, "cuda_emu: unknown GNMX_EMU_ARCH=%s\n", e);
      std::abort();
    }
  }
  a.cc = emu_env_int("GNMX_EMU_CC", a.cc);
  a.smem_optin = emu_env_int("GNMX_EMU_SMEM_OPTIN", a.smem_optin);
  return a;
}
constexpr size_t kDefaultSmem = 48 * 1024;  // dynamic shared memory without the opt-in

// ---- Errors ----------------------------------------------------------------------------------------
inline cudaError_t g_err = cudaSuccess;  // the pending error (one, the first)
inline std::string g_err_msg;            // its text (kept after it is read)
inline jmp_buf g_abort_jb;               // run_grid's: a rule broken inside a running grid
inline bool g_in_grid = false;
inline const char* g_kernel = "";        // the running kernel (its symbol, for messages)

// Records a broken rule (the first one wins until read); inside a grid, abandons it.
inline void fail(cudaError_t code, const std::string& msg) {
  if (std::getenv("GNMX_EMU_ABORT") && std::strcmp(std::getenv("GNMX_EMU_ABORT"), "1") == 0) {
    std::fprintf(stderr, "cuda_emu: %s\n", msg.c_str());
    std::abort();
  }
  if (g_err == cudaSuccess) {
    g_err = code;
    g_err_msg = "cuda_emu: " + msg;
  }
  if (g_in_grid) _longjmp(g_abort_jb, 1);
}
template <typename... A>
inline std::string fmt(const char* f, A... a) {
  char buf[1024];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

// ---- Fibers ----------------------------------------------------------------------------------------
// Cooperative fibers, one per CUDA thread, on the calling OS thread: entered once through
// makecontext, then switched with _setjmp/_longjmp (no signal-mask syscalls).
enum Wait : unsigned char { kRunning, kSyncthreads, kShuffle, kUniform, kBlockEnd };
struct Fiber {
  ucontext_t ctx;
  jmp_buf jb;
  std::vector<char> stack;
  unsigned linear = 0;  // thread index in the block (x fastest)
  bool started = false, done = false;
  Wait wait = kRunning;
};
inline dim3 t_thread, t_block;  // of the running fiber (blocks run in lockstep)
inline unsigned t_linear = 0;
inline dim3 g_grid, g_bdim;
inline unsigned g_nt = 0;
inline unsigned char* g_dyn_smem = nullptr;
inline jmp_buf g_sched_jb;
inline std::vector<Fiber>* g_fibers = nullptr;
inline unsigned g_cur = 0;
inline uint64_t g_progress = 0;                          // arrivals: deadlock detection
inline unsigned g_bar_count = 0, g_bar_gen = 0;          // __syncthreads
inline unsigned g_end_count = 0, g_end_gen = 0;          // end of a block
inline int g_and = 1;

inline void yield() {
  Fiber& f = (*g_fibers)[g_cur];
  if (!_setjmp(f.jb)) _longjmp(g_sched_jb, 1);
  const Fiber& me = (*g_fibers)[g_cur];
  t_linear = me.linear;
  t_thread = dim3(me.linear % g_bdim.x, me.linear / g_bdim.x % g_bdim.y,
                  me.linear / (g_bdim.x * g_bdim.y));
}

// Barrier over `expected` arrivals: the last one releases (and gets true), the others yield until
// released.
inline bool barrier(unsigned* count, unsigned* gen, unsigned expected, Wait kind) {
  ++g_progress;
  const unsigned my_gen = *gen;
  if (++*count == expected) {
    *count = 0;
    ++*gen;
    return true;
  }
  Fiber& f = (*g_fibers)[g_cur];
  f.wait = kind;
  while (*gen == my_gen) yield();
  (*g_fibers)[g_cur].wait = kRunning;
  return false;
}

// The call site of a collective: the return addresses up the running fiber's frame-pointer chain
// (the emulated sources are built with -fno-omit-frame-pointer), hashed.
__attribute__((noinline)) inline uint64_t call_site() {
  const Fiber& f = (*g_fibers)[g_cur];
  const char* lo = f.stack.data();
  const char* hi = lo + f.stack.size();
  uint64_t h = 1469598103934665603ull;
  void** fp = static_cast<void**>(__builtin_frame_address(0));
  for (int d = 0; d < 16; ++d) {
    if (reinterpret_cast<const char*>(fp) < lo || reinterpret_cast<const char*>(fp) + 16 > hi)
      break;
    h = (h ^ reinterpret_cast<uint64_t>(fp[1])) * 1099511628211ull;
    void** next = static_cast<void**>(fp[0]);
    if (next <= fp) break;
    fp = next;
  }
  return h;
}

// One warp's open collective (a shuffle): its mask, call site and the lanes arrived so far.
struct WarpOp {
  unsigned mask = 0, arrived = 0, count = 0, gen = 0;
  uint64_t site = 0;
  const char* what = "";
  uint64_t slots[32];
};
inline WarpOp g_warp[32];

inline unsigned lane_id() { return t_linear % 32; }
inline unsigned warp_id() { return t_linear / 32; }

// A shuffle of 8 bytes `bits` by lane `lane`; src(lane) the source lane (or the lane itself).
template <typename Src>
inline uint64_t shuffle(const char* what, unsigned mask, uint64_t bits, Src src) {
  const unsigned lane = lane_id(), warp = warp_id();
  WarpOp& w = g_warp[warp];
  const uint64_t site = call_site();
  const unsigned lanes_in_warp = std::min(32u, g_nt - warp * 32);
  const unsigned present = lanes_in_warp == 32 ? ~0u : (1u << lanes_in_warp) - 1;
  if (!(mask >> lane & 1u))
    fail(cudaErrorLaunchFailure,
         fmt("%s: %s(mask 0x%08x) called by lane %u, not in its mask (block thread %u)", g_kernel,
             what, mask, lane, t_linear));
  if (mask & ~present)
    fail(cudaErrorLaunchFailure,
         fmt("%s: %s mask 0x%08x names lanes the warp does not have", g_kernel, what, mask));
  if (w.arrived == 0) {
    w.mask = mask;
    w.site = site;
    w.what = what;
  } else if (w.mask != mask || w.site != site || std::strcmp(w.what, what) != 0) {
    fail(cudaErrorLaunchFailure,
         fmt("%s: divergent shuffle in warp %u: lane %u at %s(mask 0x%08x) from another call site "
             "or mask than lanes 0x%08x at %s(mask 0x%08x)",
             g_kernel, warp, lane, what, mask, w.arrived, w.what, w.mask));
  }
  w.arrived |= 1u << lane;
  w.slots[lane] = bits;
  const unsigned n = __builtin_popcount(mask);
  barrier(&w.count, &w.gen, n, kShuffle);
  const unsigned from = src(lane);
  if (from < 32 && from != lane && !(mask >> from & 1u))
    fail(cudaErrorLaunchFailure, fmt("%s: %s: lane %u reads lane %u, outside mask 0x%08x",
                                     g_kernel, what, lane, from, mask));
  const uint64_t r = from < 32 ? w.slots[from] : bits;
  if (barrier(&w.count, &w.gen, n, kShuffle)) w.arrived = 0;
  return r;
}

// GN_ASSERT_UNIFORM's collective: teams of kTeam aligned lanes (<= 32) or the whole block.
struct TeamOp {
  unsigned count = 0, gen = 0;
  int line = 0;
  const char* file = nullptr;
};
inline TeamOp g_team[1024 + 1];  // by the team's first thread; [1024]: the block
inline std::vector<std::vector<unsigned char>> g_team_bytes;

template <typename V>
inline void assert_uniform(int team, const V& v, const char* expr, const char* file, int line) {
  if (team == 1) return;
  const bool block = unsigned(team) == g_nt;
  if (!block && (team > 32 || (team & (team - 1)) != 0))
    fail(cudaErrorAssert, fmt("%s: GN_ASSERT_UNIFORM(%d, %s) at %s:%d: a team is a power of two "
                              "<= 32 lanes or the block (%u threads)",
                              g_kernel, team, expr, file, line, g_nt));
  const unsigned first = block ? 0 : t_linear / team * team;
  TeamOp& t = g_team[block ? 1024 : first];
  const unsigned n = block ? g_nt : unsigned(team);
  if (t.count == 0) {
    t.file = file;
    t.line = line;
  } else if (t.line != line || std::strcmp(t.file, file) != 0) {
    fail(cudaErrorAssert, fmt("%s: team of thread %u split: %s:%d and %s:%d", g_kernel, t_linear,
                              file, line, t.file, t.line));
  }
  std::vector<unsigned char>& mine = g_team_bytes[t_linear];
  mine.assign(reinterpret_cast<const unsigned char*>(&v),
              reinterpret_cast<const unsigned char*>(&v) + sizeof(V));
  barrier(&t.count, &t.gen, n, kUniform);
  const std::vector<unsigned char>& ref = g_team_bytes[first];
  if (std::memcmp(ref.data(), mine.data(), sizeof(V)) != 0) {
    std::string hex_ref, hex_mine;
    for (size_t i = 0; i < sizeof(V) && i < 48; ++i) {
      hex_ref += fmt("%02x", ref[i]);
      hex_mine += fmt("%02x", mine[i]);
    }
    fail(cudaErrorAssert,
         fmt("%s: GN_ASSERT_UNIFORM(%d, %s) at %s:%d: block (%u,%u,%u) thread %u holds %s, its "
             "team's first thread %u holds %s (bytes, little-endian)",
             g_kernel, team, expr, file, line, t_block.x, t_block.y, t_block.z, t_linear,
             hex_mine.c_str(), first, hex_ref.c_str()));
  }
  barrier(&t.count, &t.gen, n, kUniform);
}
}  // namespace emu

#define threadIdx (emu::t_thread)
#define blockIdx (emu::t_block)
#define blockDim (emu::g_bdim)
#define gridDim (emu::g_grid)

// GNMX_EMU_CUDA_ERROR=<code>: every launch (cudaGetLastError) and memset fails with that error, as
// on a machine whose driver is too old (35) or whose GPU has no kernel in the build (209);
// GNMX_EMU_DRIVER (cudaDriverGetVersion, default 13000) and GNMX_EMU_CC (compute capability as
// 10 * major + minor, default GNMX_EMU_ARCH's) are what such a machine reports.
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
// The injected error, else the pending one of a broken rule (cleared: the next call succeeds).
inline cudaError_t emu_take_error() {
  if (cudaError_t e = emu_injected_error()) return e;
  const cudaError_t e = emu::g_err;
  emu::g_err = cudaSuccess;
  return e;
}
inline cudaError_t cudaGetLastError() {
  static std::atomic<bool> pending_taken{false};
  if (cudaError_t e = emu_sticky_error()) return e;
  const int pending = emu_env_int("GNMX_EMU_PENDING_ERROR", 0);
  if (pending && !pending_taken.exchange(true)) return static_cast<cudaError_t>(pending);
  return emu_take_error();
}
inline cudaError_t cudaStreamQuery(cudaStream_t) { return emu_sticky_error(); }
// Launches run synchronously: a broken rule of one is also what a synchronize reports.
inline cudaError_t emu_synchronize() {
  if (cudaError_t e = emu_sticky_error()) return e;
  if (cudaError_t e = static_cast<cudaError_t>(emu_env_int("GNMX_EMU_KERNEL_FAULT", 0))) return e;
  return emu_take_error();
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return emu_synchronize(); }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorLaunchOutOfResources:
    case cudaErrorAssert:
    case cudaErrorLaunchFailure:
      if (!emu::g_err_msg.empty()) return emu::g_err_msg.c_str();
      return "cuda_emu error";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    default: return "cuda_emu error";
  }
}
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoKernelImageForDevice: return "cudaErrorNoKernelImageForDevice";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorAssert: return "cudaErrorAssert";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
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
  const emu::Arch ar = emu::arch();
  if (a == cudaDevAttrComputeCapabilityMajor) *v = ar.cc / 10;
  else if (a == cudaDevAttrComputeCapabilityMinor) *v = ar.cc % 10;
  else if (a == cudaDevAttrMaxSharedMemoryPerBlockOptin) *v = ar.smem_optin;
  else *v = emu_env_int("GNMX_EMU_SMS", 4);
  return cudaSuccess;
}
// Resident blocks per SM: GNMX_EMU_BLOCKS_PER_SM=N, else what the architecture's threads per SM
// allow (the real API also weighs registers and shared memory; the emulator has neither).
// GNMX_EMU_BLOCKS_PER_SM=vary gives each kernel its own count (1..8, from its address), as real
// register use does: plans that must agree (workspace query vs launch) then diverge if they ask
// about different kernels.
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void* kernel,
                                                                 int threads, size_t) {
  const char* e = std::getenv("GNMX_EMU_BLOCKS_PER_SM");
  if (e && std::strcmp(e, "vary") == 0)
    *n = 1 + static_cast<int>((reinterpret_cast<uintptr_t>(kernel) >> 4) % 8);
  else
    *n = e ? std::atoi(e) : (threads > 0 ? emu::arch().threads_sm / threads : 1);
  if (*n < 1) *n = 1;
  return cudaSuccess;
}

namespace emu {
// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) per (kernel,
// device): what a launch with more than 48 KB of dynamic shared memory needs.
struct SmemOptin {
  const void* kernel;
  int dev;
  size_t bytes;
};
inline std::vector<SmemOptin> g_optin;
inline size_t dyn_smem_allowed(const void* kernel) {
  int dev = 0;
  cudaGetDevice(&dev);
  for (const SmemOptin& o : g_optin)
    if (o.kernel == kernel && o.dev == dev) return std::max(o.bytes, kDefaultSmem);
  return kDefaultSmem;
}
// Static shared memory of every kernel: GNMX_EMU_STATIC_SMEM bytes (default 1024; the emulator
// cannot measure it per kernel; the real figure is ptxas's).
inline size_t static_smem() { return static_cast<size_t>(emu_env_int("GNMX_EMU_STATIC_SMEM", 1024)); }
}  // namespace emu

template <typename K>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, K*) {
  a->sharedSizeBytes = emu::static_smem();
  return cudaSuccess;
}
template <typename K>
inline cudaError_t cudaFuncSetAttribute(K* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  const size_t limit = static_cast<size_t>(emu::arch().smem_optin) - emu::static_smem();
  if (value < 0 || static_cast<size_t>(value) > limit) {
    emu::g_err_msg = emu::fmt("cuda_emu: cudaFuncSetAttribute(MaxDynamicSharedMemorySize, %d): "
                              "more than the %zu bytes the architecture allows beside %zu static",
                              value, limit, emu::static_smem());
    return cudaErrorInvalidValue;
  }
  int dev = 0;
  cudaGetDevice(&dev);
  const void* k = reinterpret_cast<const void*>(kernel);
  for (emu::SmemOptin& o : emu::g_optin)
    if (o.kernel == k && o.dev == dev) {
      o.bytes = static_cast<size_t>(value);
      return cudaSuccess;
    }
  emu::g_optin.push_back(emu::SmemOptin{k, dev, static_cast<size_t>(value)});
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  if (cudaError_t e = emu_injected_error()) return e;
  std::memset(p, v, n);
  return cudaSuccess;
}
// Device memory is host memory (the harness's memory calls, tests/gpu/harness.cc).
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
// Fresh device memory is poisoned (0xff bytes: NaN in every float type), as cudaMalloc promises
// nothing about its contents: a kernel that reads workspace nobody wrote fails here, not only on a GPU.
inline cudaError_t cudaMalloc(void** p, size_t n) {
  const size_t bytes = (n + 255) / 256 * 256;
  *p = std::aligned_alloc(256, bytes);
  if (*p) std::memset(*p, 0xff, bytes);
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
  emu::barrier(&emu::g_bar_count, &emu::g_bar_gen, emu::g_nt, emu::kSyncthreads);
}
inline int __syncthreads_and(int pred) {
  __syncthreads();
  if (!pred) emu::g_and = 0;
  __syncthreads();
  const int r = emu::g_and;
  __syncthreads();
  if (emu::t_linear == 0) emu::g_and = 1;
  __syncthreads();
  return r;
}

template <typename T>
__attribute__((noinline)) T __shfl_xor_sync(unsigned mask, T v, int off) {
  static_assert(sizeof(T) <= 8, "shuffle of > 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = emu::shuffle("__shfl_xor_sync", mask, bits,
                      [off](unsigned lane) { return lane ^ unsigned(off); });
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

template <typename T>
__attribute__((noinline)) T __shfl_down_sync(unsigned mask, T v, unsigned off) {
  static_assert(sizeof(T) <= 8, "shuffle of > 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = emu::shuffle("__shfl_down_sync", mask, bits,
                      [off](unsigned lane) { return lane + off < 32 ? lane + off : lane; });
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

template <typename T>
__attribute__((noinline)) T __shfl_sync(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of > 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = emu::shuffle("__shfl_sync", mask, bits, [src](unsigned) { return unsigned(src) % 32; });
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// The static __shared__ variables of the emulated kernels of this library or program: the
// section's bounds, from the linker (hidden: each shared object its own). Every translation unit
// registers them (the same pair, once), so that fiber_main, whichever object's copy runs, poisons
// the sections of every loaded object (e.g. the harness and tests/gpu/emu/rules_probe.cu).
extern "C" unsigned char __start_gnmx_emu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" unsigned char __stop_gnmx_emu_shared[] __attribute__((weak, visibility("hidden")));

namespace emu {
inline unsigned char* dyn_smem() { return g_dyn_smem; }

struct Section {
  unsigned char *begin, *end;
};
inline std::vector<Section>& shared_sections() {
  static std::vector<Section> s;
  return s;
}
inline int register_shared_section(unsigned char* begin, unsigned char* end) {
  if (!begin || !end) return 0;
  for (const Section& x : shared_sections())
    if (x.begin == begin) return 0;
  shared_sections().push_back(Section{begin, end});
  return 0;
}
namespace {
[[maybe_unused]] const int g_shared_registered =
    register_shared_section(__start_gnmx_emu_shared, __stop_gnmx_emu_shared);
}  // namespace

inline const std::function<void()>* g_body = nullptr;
inline bool g_blocks_reversed = false;  // GNMX_EMU_SCHED=reverse: the last block first
inline size_t g_dyn_bytes = 0;
inline bool g_poison = true;

// A kernel declared with __launch_bounds__(n, ...) starts with this (build_emu.py).
inline void launch_bounds(unsigned max_threads, unsigned = 0, unsigned = 0) {
  if (g_nt > max_threads)
    fail(cudaErrorLaunchOutOfResources,
         fmt("%s: %u threads per block, above its __launch_bounds__(%u)", g_kernel, g_nt,
             max_threads));
}

// Every block starts with poisoned shared memory (0xff bytes: NaN in fp16/fp32/fp64, -1 in ints):
// a read before a write then shows instead of finding the previous block's values or zeros.
inline void poison_shared() {
  if (!g_poison) return;
  if (g_dyn_bytes) std::memset(g_dyn_smem, 0xff, g_dyn_bytes);
  for (const Section& x : shared_sections())
    std::memset(x.begin, 0xff, static_cast<size_t>(x.end - x.begin));
}

inline void fiber_main() {
  const unsigned me = g_cur;
  t_linear = me;
  t_thread = dim3(me % g_bdim.x, me / g_bdim.x % g_bdim.y, me / (g_bdim.x * g_bdim.y));
  const uint64_t nx = g_grid.x, nxy = nx * g_grid.y, nb = nxy * g_grid.z;
  for (uint64_t b = 0; b < nb; ++b) {
    const uint64_t l = g_blocks_reversed ? nb - 1 - b : b;  // x fastest, then y, then z
    t_block = dim3(static_cast<unsigned>(l % nx), static_cast<unsigned>(l % nxy / nx),
                   static_cast<unsigned>(l / nxy));
    (*g_body)();
        // kernels never __syncthreads after a return; the last thread of the block to end
        // poisons shared memory for the next one
    if (barrier(&g_end_count, &g_end_gen, g_nt, kBlockEnd)) poison_shared();
  }
  (*g_fibers)[me].done = true;
  _longjmp(g_sched_jb, 1);
}

// GNMX_EMU_SCHED: the order in which the block's runnable threads run between barriers.
struct Sched {
  enum Kind { kForward, kReverse, kRandom } kind = kForward;
  uint64_t seed = 0;
};
inline Sched sched() {
  Sched s;
  const char* e = std::getenv("GNMX_EMU_SCHED");
  if (!e || !*e || std::strcmp(e, "forward") == 0) return s;
  if (std::strcmp(e, "reverse") == 0) {
    s.kind = Sched::kReverse;
  } else if (std::strncmp(e, "random:", 7) == 0) {
    s.kind = Sched::kRandom;
    s.seed = std::strtoull(e + 7, nullptr, 10);
  } else {
    std::fprintf(stderr, "cuda_emu: GNMX_EMU_SCHED=%s: forward, reverse or random:SEED\n", e);
    std::abort();
  }
  return s;
}
inline uint64_t g_launches = 0;

inline std::string deadlock_report(const std::vector<Fiber>& fibers, unsigned nt) {
  unsigned n[5] = {0, 0, 0, 0, 0};
  for (unsigned t = 0; t < nt; ++t) ++n[fibers[t].wait];
  std::string r = fmt("%s: deadlock in block (%u,%u,%u): of %u threads, %u wait at __syncthreads, "
                      "%u at a warp shuffle, %u at GN_ASSERT_UNIFORM, %u ended the block",
                      g_kernel, t_block.x, t_block.y, t_block.z, nt, n[kSyncthreads], n[kShuffle],
                      n[kUniform], n[kBlockEnd]);
  for (unsigned w = 0; w * 32 < nt; ++w)
    if (g_warp[w].arrived)
      r += fmt("; warp %u: lanes 0x%08x at %s(mask 0x%08x)", w, g_warp[w].arrived, g_warp[w].what,
               g_warp[w].mask);
  return r;
}

// Runs every block, its fibers scheduled per GNMX_EMU_SCHED until each has run every block; a
// round in which no fiber arrived anywhere is a deadlock.
inline void run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  const unsigned nt = block.x * block.y * block.z;
  g_grid = grid;
  g_bdim = block;
  g_nt = nt;
  g_body = &body;
  std::vector<unsigned char> dyn(smem + 16);
  g_dyn_smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(dyn.data()) + 15) & ~uintptr_t(15));
  g_dyn_bytes = smem;
  g_poison = emu_env_int("GNMX_EMU_POISON", 1) != 0;
  static std::vector<Fiber> fibers;  // stacks reused across launches
  if (fibers.size() < nt) fibers.resize(nt);
  if (g_team_bytes.size() < nt) g_team_bytes.resize(nt);
  g_fibers = &fibers;
  g_bar_count = g_end_count = 0;
  g_and = 1;
  for (WarpOp& w : g_warp) w.count = w.arrived = 0;
  for (TeamOp& t : g_team) t.count = 0;
  for (unsigned t = 0; t < nt; ++t) {
    Fiber& f = fibers[t];
    if (f.stack.empty()) f.stack.resize(128 * 1024);
    f.started = f.done = false;
    f.linear = t;
    f.wait = kRunning;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
  }
  poison_shared();
  const Sched sc = sched();
  g_blocks_reversed = sc.kind == Sched::kReverse;
  std::mt19937_64 rng(sc.seed * 1000003u + g_launches++);
  std::vector<unsigned> order(nt);
  for (unsigned t = 0; t < nt; ++t) order[t] = sc.kind == Sched::kReverse ? nt - 1 - t : t;
  g_in_grid = true;
  if (_setjmp(g_abort_jb)) {  // a broken rule (fail): the grid is abandoned
    g_in_grid = false;
    g_fibers = nullptr;
    return;
  }
  unsigned alive = nt;
  while (alive > 0) {
    alive = 0;
    const uint64_t before = g_progress;
    if (sc.kind == Sched::kRandom) std::shuffle(order.begin(), order.end(), rng);
    for (unsigned t : order) {
      Fiber& f = fibers[t];
      if (f.done) continue;
      g_cur = t;
      t_linear = t;
      t_thread = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
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
      else ++g_progress;
    }
    if (alive > 0 && g_progress == before) fail(cudaErrorLaunchFailure, deadlock_report(fibers, nt));
  }
  g_in_grid = false;
  g_fibers = nullptr;
}

template <typename... P>
struct Launcher {
  void (*k)(P...);
  dim3 g, b;
  size_t smem;
  const char* name;
  bool ok;
  template <typename... A>
  void operator()(A&&... a) const {
    if (!ok) return;
    std::tuple<P...> params(std::forward<A>(a)...);
    auto kk = k;
    g_kernel = name;
    run_grid(g, b, smem, [&] { std::apply(kk, params); });
  }
};

// GNMX_EMU_LAUNCH_LOG=<file>: every launch appends "grid.x grid.y grid.z block.x name" to it
// (tests check launch plans with it, e.g. tests/gpu/test_gpu_plans.py; name as launched, e.g.
// "gram_reduce_kernel" or "stats_kernel<T, AccT, ...>" without spaces).
inline void log_launch(const char* name, dim3 g, dim3 b) {
  const char* path = std::getenv("GNMX_EMU_LAUNCH_LOG");
  if (!path) return;
  std::string n(name ? name : "?");
  n.erase(std::remove_if(n.begin(), n.end(), [](char c) { return c == ' ' || c == '\n'; }),
          n.end());
  if (FILE* f = std::fopen(path, "a")) {
    std::fprintf(f, "%u %u %u %u %s\n", g.x, g.y, g.z, b.x, n.c_str());
    std::fclose(f);
  }
}

// The launch-time rules (the configuration and the shared memory); false after fail().
inline bool launch_ok(const void* kernel, const char* name, dim3 g, dim3 b, size_t smem) {
  g_kernel = name;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  if (g.x == 0 || g.y == 0 || g.z == 0 || b.x == 0 || b.y == 0 || b.z == 0) {
    fail(cudaErrorInvalidConfiguration,
         fmt("%s: launch with a zero dimension: grid (%u,%u,%u) block (%u,%u,%u)", name, g.x, g.y,
             g.z, b.x, b.y, b.z));
    return false;
  }
  if (b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024) {
    fail(cudaErrorInvalidConfiguration,
         fmt("%s: block (%u,%u,%u): at most 1024 threads (x, y <= 1024, z <= 64)", name, b.x, b.y,
             b.z));
    return false;
  }
  if (g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    fail(cudaErrorInvalidConfiguration,
         fmt("%s: grid (%u,%u,%u): x < 2^31, y and z <= 65535", name, g.x, g.y, g.z));
    return false;
  }
  const Arch ar = arch();
  if (smem > dyn_smem_allowed(kernel)) {
    fail(cudaErrorInvalidValue,
         fmt("%s: %zu bytes of dynamic shared memory: above 48 KB it needs cudaFuncSetAttribute("
             "MaxDynamicSharedMemorySize) of at least that much for this kernel (set: %zu)",
             name, smem, dyn_smem_allowed(kernel)));
    return false;
  }
  if (smem + static_smem() > size_t(ar.smem_optin)) {
    fail(cudaErrorInvalidValue,
         fmt("%s: %zu bytes of dynamic + %zu static shared memory: above the %d bytes per block of "
             "compute capability %d",
             name, smem, static_smem(), ar.smem_optin, ar.cc));
    return false;
  }
  return true;
}

template <typename... P>
Launcher<P...> launch_named(const char* name, void (*k)(P...), dim3 g, dim3 b, size_t smem = 0,
                            cudaStream_t = nullptr) {
  log_launch(name, g, b);
  const bool ok = launch_ok(reinterpret_cast<const void*>(k), name, g, b, smem);
  return Launcher<P...>{k, g, b, smem, name, ok};
}
}  // namespace emu
