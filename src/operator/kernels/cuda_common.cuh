/*
 * cuda_common.cuh: the helpers every .cu file of gn_mx shares (never included by host-compiled
 * files):
 *   cuda_error(e)            nullptr or the error string of a CUDA runtime result (driver too old /
 *                            no kernel for the GPU: a message saying what is needed);
 *   GN_CUDA_CHECK_LAUNCH()   after a launch: return cudaGetLastError()'s string on failure; with
 *                            GNMX_CUDA_SYNC=1 also synchronize and return a fault of the kernel
 *                            itself, naming the launch's file and line (cuda_check_launch);
 *   ceil_div, aligned16      launch-plan arithmetic;
 *   sm_count, wave_blocks    the GPU's size: SMs (cached per device, thread-safe) times the
 *                            resident blocks per SM that the occupancy API reports for the
 *                            kernel actually launched (cached per kernel, device, block size and
 *                            dynamic shared memory, under a mutex), so
 *                            "one wave" plans follow the kernels' real register/shared-memory use;
 *   warp_reduce / block_reduce and their sum, max and Welford (count, mean, M2) forms, whose
 *                            results are bitwise the same on every lane (warp_reduce's NB);
 *   GN_ASSERT_UNIFORM        an emulator-checked claim that a team decides on one value.
 * Block reductions return the result to every thread, need every thread of the block (blockDim.x a
 * multiple of 32, at most their kMaxThreads argument, default 1024) and may be called repeatedly: they begin with a barrier, so their
 * shared slots are never overwritten while a previous call still reads them.
 */
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "../common/welford.h"

#define GN_CUDA_CHECK_LAUNCH()                                                          \
  do {                                                                                  \
    if (const char* gn_err_ = ::gn_mx::cuda_check_launch(__FILE__, __LINE__)) return gn_err_; \
  } while (0)

namespace gn_mx {

// The errors that mean "this build cannot run here" (driver older than the CUDA runtime linked in,
// no SASS for the GPU's arch and no PTX it can JIT): cuda_util.cu turns them into one message that
// names the driver / GPU arch found and what is needed (cuda_setup_message in cuda_util.h).
inline bool cuda_setup_error(cudaError_t e) {
  return e == cudaErrorInsufficientDriver || e == cudaErrorCallRequiresNewerDriver ||
         e == cudaErrorUnsupportedPtxVersion || e == cudaErrorNoKernelImageForDevice ||
         e == cudaErrorInvalidDeviceFunction || e == cudaErrorSystemDriverMismatch;
}
const char* cuda_setup_error_message(cudaError_t e);  // cuda_util.cu; thread-local storage

// nullptr for cudaSuccess, else the error's string (the setup errors above: the explained form).
inline const char* cuda_error(cudaError_t e) {
  if (e == cudaSuccess) return nullptr;
  if (cuda_setup_error(e)) return cuda_setup_error_message(e);
  return cudaGetErrorString(e);
}

// After a kernel launch at file:line: the launch's error (cuda_error), and with GNMX_CUDA_SYNC=1 a
// fault of the kernel while it ran (the device is synchronized); cuda_util.cu.
const char* cuda_check_launch(const char* file, int line);

constexpr int kWarpSize = 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename I>
__device__ __forceinline__ I imin(I a, I b) {
  return a < b ? a : b;
}

// V elements of T loaded / stored as one 16-byte (or narrower) access; vec_width<T>() elements make
// 16 bytes (GroupNorm and the affine kernels).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

// SM count of the current device into *out; nullptr or the CUDA error string. Cached per device
// (the first 64) in relaxed atomics: threads that race on a first query all store the same value,
// and no thread ever reads a torn or unsynchronized one.
inline const char* sm_count(int* out) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // static storage: zeros, "not yet known"
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cuda_error(e);
  const bool cached = dev >= 0 && dev < kCachedDevices;
  if (cached) {
    const int n = cache[dev].load(std::memory_order_relaxed);
    if (n > 0) {
      *out = n;
      return nullptr;
    }
  }
  int n = 0;
  e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return cuda_error(e);
  if (n <= 0) n = 1;
  if (cached) cache[dev].store(n, std::memory_order_relaxed);
  *out = n;
  return nullptr;
}

// Resident blocks per SM of `kernel` (a __global__ function) at `threads` threads and `smem` bytes
// of dynamic shared memory, on the current device (>= 1); nullptr or the CUDA error string.
inline const char* blocks_per_sm(const void* kernel, int threads, size_t smem, int* out) {
  struct Entry {
    const void* kernel;
    int dev, threads;
    size_t smem;
    int blocks;
  };
  static std::mutex mu;
  static std::vector<Entry> cache;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cuda_error(e);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const Entry& c : cache)
      if (c.kernel == kernel && c.dev == dev && c.threads == threads && c.smem == smem) {
        *out = c.blocks;
        return nullptr;
      }
  }
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  if (e != cudaSuccess) return cuda_error(e);
  if (n <= 0) n = 1;
  std::lock_guard<std::mutex> lock(mu);
  cache.push_back(Entry{kernel, dev, threads, smem, n});
  *out = n;
  return nullptr;
}

// Blocks of `kernel` that fill the GPU once: SMs x resident blocks per SM.
template <typename K>
inline const char* wave_blocks(K* kernel, int threads, size_t smem, int64_t* out) {
  int sms = 1, bps = 1;
  if (const char* e = sm_count(&sms)) return e;
  if (const char* e = blocks_per_sm(reinterpret_cast<const void*>(kernel), threads, smem, &bps))
    return e;
  *out = int64_t(sms) * bps;
  return nullptr;
}

// ------------------------------------------------------------------------------------------------
// Team-uniform values

// GN_ASSERT_UNIFORM(kTeam, v): v is bitwise the same on every thread of the calling team, the
// aligned kTeam consecutive lanes of a warp (kTeam a power of two <= 32) or the whole block
// (kTeam == blockDim.x), all of which must reach it. Placed where a team takes a decision on v
// that must not split it (an early exit, a path with shuffles or barriers). The CPU emulator
// (tests/gpu/emu/include/cuda_emu.h) checks it and fails the launch naming the site; nothing
// under nvcc.
#ifdef GNMX_CUDA_EMU
#define GN_ASSERT_UNIFORM(kTeam, v) ::emu::assert_uniform(int(kTeam), (v), #v, __FILE__, __LINE__)
#else
#define GN_ASSERT_UNIFORM(kTeam, v) ((void)0)
#endif

// ------------------------------------------------------------------------------------------------
// Warp and block reductions

template <typename A>
struct Pair {  // two sums reduced together (one pass of shuffles)
  A a, b;
};

template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int off) {
  return __shfl_xor_sync(0xffffffffu, v, off);
}
template <typename A>
__device__ __forceinline__ Pair<A> shfl_xor(const Pair<A>& p, int off) {
  return Pair<A>{shfl_xor(p.a, off), shfl_xor(p.b, off)};
}
template <typename A>
__device__ __forceinline__ Welford<A> shfl_xor(const Welford<A>& w, int off) {
  return make_welford<A>(shfl_xor(w.count, off), shfl_xor(w.mean, off), shfl_xor(w.m2, off));
}

// pick(c, a, b) = c ? a : b member by member: a ternary on whole structs makes nvcc keep both in a
// local-memory stack frame and select an address (24-48 bytes per kernel, seen by the resource
// audit), where member-wise selects stay in registers.
template <typename V>
__device__ __forceinline__ V pick(bool c, V a, V b) {
  return c ? a : b;
}
template <typename A>
__device__ __forceinline__ Pair<A> pick(bool c, const Pair<A>& a, const Pair<A>& b) {
  return Pair<A>{c ? a.a : b.a, c ? a.b : b.b};
}
template <typename A>
__device__ __forceinline__ Welford<A> pick(bool c, const Welford<A>& a, const Welford<A>& b) {
  return make_welford<A>(c ? a.count : b.count, c ? a.mean : b.mean, c ? a.m2 : b.m2);
}

struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return a + b; }
  template <typename A>
  __device__ __forceinline__ Pair<A> operator()(Pair<A> x, Pair<A> y) const {
    return Pair<A>{x.a + y.a, x.b + y.b};
  }
  template <typename V>
  __device__ __forceinline__ V identity() const { return V{}; }
};
struct MaxOp {  // for values >= 0 (identity 0)
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const { return fmax(a, b); }
  template <typename V>
  __device__ __forceinline__ V identity() const { return V(0); }
};
struct WelfordOp {  // Chan merge
  template <typename A>
  __device__ __forceinline__ Welford<A> operator()(Welford<A> a, const Welford<A>& b) const {
    a.merge(b);
    return a;
  }
  template <typename V>
  __device__ __forceinline__ V identity() const { return V(); }
};

// Reduction within aligned teams of kWidth lanes (a power of two <= 32); every lane gets its
// team's result, bitwise the same on every lane.
// NB: each butterfly step computes op(lower lane's value, upper lane's value) on both lanes of a
// pair (one call of op on operands picked by the lane's bit): for an op that is not bitwise
// commutative (Chan's Welford merge: mean_a + delta * n_b / n rounds differently from
// mean_b - delta * n_a / n) the plain op(own, partner) left lanes with different last bits, and a
// team-wide decision taken on them (gn_exact_group) could split the warp before a full-mask
// shuffle. Lane 0 computes exactly what it computed before (it is always the lower lane).
// ptxas (sm_80, nvcc 13), group_norm_cuda.cu's 247 kernels against the old butterfly: registers up
// in 33, down in 33 (total -45), kernels with spills 12 -> 15 (152 -> 176 bytes). Unmeasured on a
// GPU.
template <int kWidth = kWarpSize, typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int off = kWidth / 2; off > 0; off >>= 1) {
    const V other = shfl_xor(v, off);
    const bool upper = (lane & off) != 0;
    v = op(pick(upper, other, v), pick(upper, v, other));
  }
  GN_ASSERT_UNIFORM(kWidth, v);
  return v;
}

// Uninitialized storage for n values of V: __shared__ variables take no constructors (Welford has
// member initializers).
template <typename V, int n>
struct alignas(V) RawSlots {
  unsigned char bytes[n * sizeof(V)];
  __device__ __forceinline__ V* get() { return reinterpret_cast<V*>(bytes); }
};

// kMaxThreads: the largest blockDim.x of the caller's launches (sizes the per-warp slots).
template <int kMaxThreads = 1024, typename V, typename Op>
__device__ __forceinline__ V block_reduce(V v, Op op) {
  static_assert(kMaxThreads % kWarpSize == 0 && kMaxThreads <= 1024, "block size");
  __shared__ RawSlots<V, kMaxThreads / kWarpSize> s_raw;
  __shared__ RawSlots<V, 1> s_out_raw;
  V* s_part = s_raw.get();
  V* s_out = s_out_raw.get();
  const int lane = threadIdx.x % kWarpSize, wid = threadIdx.x / kWarpSize;
  v = warp_reduce(v, op);
  __syncthreads();  // the slots may still be read by a previous call
  if (lane == 0) s_part[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = lane < int(blockDim.x / kWarpSize) ? s_part[lane] : op.template identity<V>();
    v = warp_reduce(v, op);
    if (lane == 0) *s_out = v;
  }
  __syncthreads();
  return *s_out;
}

template <int kWidth = kWarpSize, typename V>
__device__ __forceinline__ V warp_sum(V v) { return warp_reduce<kWidth>(v, SumOp{}); }
template <int kMaxThreads = 1024, typename V>
__device__ __forceinline__ V block_sum(V v) { return block_reduce<kMaxThreads>(v, SumOp{}); }
template <int kMaxThreads = 1024, typename V>
__device__ __forceinline__ V block_max(V v) { return block_reduce<kMaxThreads>(v, MaxOp{}); }
template <typename A>
__device__ __forceinline__ Welford<A> warp_welford(Welford<A> w) {
  return warp_reduce(w, WelfordOp{});
}
template <int kMaxThreads = 1024, typename A>
__device__ __forceinline__ Welford<A> block_welford(Welford<A> w) {
  return block_reduce<kMaxThreads>(w, WelfordOp{});
}

}  // namespace gn_mx
