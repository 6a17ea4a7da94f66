/*
 * rules_probe.cu: small kernels that keep or break one hardware rule each, for
 * tests/gpu/test_gpu_emu_rules.py (built only for the CPU emulator by build_emu.build_probe; never
 * part of the library). Every probe_* function launches one kernel and returns nullptr or the
 * launch's error string (the emulator's message naming the broken rule); results go to `out`
 * (host memory: device pointers are host pointers under the emulator).
 */
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_common.cuh"

using namespace gn_mx;

namespace {

const char* last_error() {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// out[block linear index * threads + thread] = block linear index (every block of a 3-D grid).
__global__ void grid_kernel(int* out) {
  const unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  out[b * blockDim.x + threadIdx.x] = static_cast<int>(b);
}

__global__ void __launch_bounds__(128) bounded_kernel(int* out) { out[threadIdx.x] = 1; }

// Dynamic shared memory of `bytes`: every thread writes its slot; thread 0 returns the sum.
__global__ void dyn_kernel(float* out, int n) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* s = reinterpret_cast<float*>(smem);
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0;
    for (int i = 0; i < n; ++i) t += s[i];
    out[blockIdx.x] = t;
  }
}

// Reads shared memory before anything wrote it in this block (static: slot 0 of s_stat; dynamic:
// word 0), then writes both: a second block reads the first one's values unless the emulator
// poisons shared memory at the block start.
__global__ void uninit_kernel(float* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float s_stat[32];
  float* dyn = reinterpret_cast<float*>(smem);
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = s_stat[0];
    out[2 * blockIdx.x + 1] = dyn[0];
  }
  __syncthreads();
  s_stat[threadIdx.x % 32] = 7.0f;
  dyn[threadIdx.x] = 7.0f;
}

// mode 0: every lane shuffles at one site (fine); 1: lanes < 16 and >= 16 at two sites with the
// full mask; 2: lanes >= 16 return before a full-mask shuffle; 3: lanes < 16 with mask 0xffff
// (fine); 4: lane 20 passes mask 0xffff.
__global__ void shuffle_kernel(float* out, int mode) {
  const int lane = threadIdx.x % 32;
  float v = static_cast<float>(lane);
  if (mode == 0) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else if (mode == 1) {
    if (lane < 16)
      v = __shfl_xor_sync(0xffffffffu, v, 1);
    else
      v = __shfl_xor_sync(0xffffffffu, v, 1) + 1.0f;
  } else if (mode == 2) {
    if (lane >= 16) return;
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else if (mode == 3) {
    if (lane < 16) v = __shfl_xor_sync(0x0000ffffu, v, 1);
  } else if (mode == 4) {
    if (lane < 16 || lane == 20) v = __shfl_xor_sync(0x0000ffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

// __syncthreads reached by only half of the block (mode 1) or all of it (mode 0).
__global__ void sync_kernel(float* out, int mode) {
  if (mode == 1 && threadIdx.x >= blockDim.x / 2) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// GN_ASSERT_UNIFORM on a team-uniform value (mode 0), a lane-dependent one (mode 1), the block
// (mode 2: uniform, mode 3: one thread differs).
__global__ void uniform_kernel(float* out, int mode) {
  float v = mode == 1 ? static_cast<float>(threadIdx.x % 32) : 3.0f;
  if (mode < 2) {
    GN_ASSERT_UNIFORM(32, v);
  } else {
    if (mode == 3 && threadIdx.x == blockDim.x - 1) v = 4.0f;
    GN_ASSERT_UNIFORM(blockDim.x, v);
  }
  out[threadIdx.x] = v;
}

// A race: thread t reads the slot thread t + 1 writes, with no barrier between. The value it gets
// depends on which of the two ran first: the schedules (GNMX_EMU_SCHED) tell it apart.
__global__ void race_kernel(float* out) {
  __shared__ float s[1024];
  s[threadIdx.x] = 0.0f;
  __syncthreads();
  s[threadIdx.x] = static_cast<float>(threadIdx.x) + 1.0f;
  out[threadIdx.x] = threadIdx.x + 1 < blockDim.x ? s[threadIdx.x + 1] : -1.0f;
}

// The Welford warp reduction of cuda_common.cuh (symmetric: mode 0) and the butterfly it replaced
// (v = op(v, partner): mode 1), each followed by GN_ASSERT_UNIFORM: per-lane states of lane-varying
// data; out[lane] = the lane's mean.
__global__ void welford_kernel(const float* x, int per_lane, float* out, int mode) {
  const int lane = threadIdx.x % 32;
  Welford<float> w;
  for (int i = 0; i < per_lane; ++i) w.push(x[lane * per_lane + i]);
  if (mode == 0) {
    w = warp_welford(w);
  } else {
    for (int off = 16; off > 0; off >>= 1) w = WelfordOp{}(w, shfl_xor(w, off));
    GN_ASSERT_UNIFORM(32, w);
  }
  out[threadIdx.x] = w.mean;
}

}  // namespace

extern "C" {

const char* probe_grid(int* out, unsigned gx, unsigned gy, unsigned gz, unsigned threads) {
  grid_kernel<<<dim3(gx, gy, gz), threads, 0, nullptr>>>(out);
  return last_error();
}

const char* probe_bounded(int* out, unsigned threads) {
  bounded_kernel<<<1, threads, 0, nullptr>>>(out);
  return last_error();
}

// optin: the cudaFuncSetAttribute value to record first (< 0: none).
const char* probe_dyn(float* out, int bytes, int optin) {
  if (optin >= 0)
    if (cudaFuncSetAttribute(dyn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin) !=
        cudaSuccess)
      return cudaGetErrorString(cudaErrorInvalidValue);
  dyn_kernel<<<2, 128, static_cast<size_t>(bytes), nullptr>>>(out, bytes / 4);
  return last_error();
}

const char* probe_uninit(float* out, unsigned blocks) {
  uninit_kernel<<<blocks, 64, 64 * sizeof(float), nullptr>>>(out);
  return last_error();
}

const char* probe_shuffle(float* out, int mode) {
  shuffle_kernel<<<1, 64, 0, nullptr>>>(out, mode);
  return last_error();
}

const char* probe_sync(float* out, int mode) {
  sync_kernel<<<1, 128, 0, nullptr>>>(out, mode);
  return last_error();
}

const char* probe_uniform(float* out, int mode) {
  uniform_kernel<<<1, 128, 0, nullptr>>>(out, mode);
  return last_error();
}

const char* probe_race(float* out, unsigned threads) {
  race_kernel<<<1, threads, 0, nullptr>>>(out);
  return last_error();
}

const char* probe_welford(const float* x, int per_lane, float* out, int mode) {
  welford_kernel<<<1, 32, 0, nullptr>>>(x, per_lane, out, mode);
  return last_error();
}

}  // extern "C"
