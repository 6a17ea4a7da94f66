/*
 * cuda_util.h: small CUDA helpers for the host-compiled adapter (which includes no CUDA headers).
 */
#pragma once
#include <cstddef>
#include <string>

namespace gn_mx {

// The explanation of a CUDA error that means "this build of gn_mx cannot run on this machine"
// (cuda_common.cuh's cuda_setup_error: driver older than the runtime linked in, or no kernel for
// the GPU's architecture). Pure - no CUDA call - so the wording is testable without a GPU.
//   error_name, error_text: the CUDA error's name and string;
//   driver_problem: true for the driver class (insufficient driver, PTX too new), false for the
//                   architecture class (no kernel image / invalid device function);
//   driver, runtime: CUDA versions as 1000 * major + 10 * minor (cudaDriverGetVersion,
//                    CUDART_VERSION; 0 = unknown / no driver);
//   cc: the GPU's compute capability as 10 * major + minor (0 = unknown);
//   archs: the build's CUDA architectures as CMake was given them ("50-real,60-real,...,90").
std::string cuda_setup_message(const char* error_name, const char* error_text, bool driver_problem,
                               int driver, int runtime, int cc, const char* archs);

#if defined(GNMX_WITH_CUDA)
// cudaMemsetAsync(p, 0, bytes) on `stream` (a cudaStream_t as void*); nullptr or the error string.
const char* zero_cuda(void* p, size_t bytes, void* stream);

// GNMX_CUDA_SYNC=1 (read once per process): every gn_mx kernel is followed by a synchronization and
// a check, so a fault is reported by the op that caused it, with the launch's source line (slow:
// for debugging). Otherwise faults surface asynchronously, at a later CUDA call.
bool cuda_sync_mode();

// Before a gpu op launches anything: the current CUDA device must be `dev_id` (the device of the
// op's data), and CUDA must hold no error from earlier work (one left unchecked by an earlier call,
// now cleared, or a sticky one that makes the context unusable): reported as such, never as the
// op's own. nullptr or the message (the adapter adds the op name).
const char* cuda_op_prologue(int dev_id, void* stream);

// After an op's launches (kernels, cuSOLVER, memsets) on `stream`: with GNMX_CUDA_SYNC=1 the
// stream is synchronized and a fault of that work reported; otherwise nothing. nullptr or the
// message.
const char* cuda_op_epilogue(void* stream);

// What the CUDA kernels were built with: CUDART_VERSION (1000 * major + 10 * minor, static
// runtime) and the architectures ("50-real,...,90": SASS for "-real", SASS + PTX otherwise).
int cuda_runtime_built_version();
const char* cuda_built_archs();
#endif

}  // namespace gn_mx
