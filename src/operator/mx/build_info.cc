/*
 * build_info.cc: gnmx_build_info(), the one exported non-lib_api function (src/link/gn_mx.map):
 * what this library was built with, as "key=value" lines, read by gn_mx.build_info()
 * (python/gn_mx/_library.py) through ctypes - also before MXNet loads the library, so the Python
 * side can refuse an MXNet whose lib_api version differs from the one compiled in.
 *   version          gn_mx's __version__ (python/gn_mx/__init__.py, passed by CMakeLists.txt)
 *   mxnet            the MXNet distribution and version the library was built against
 *   lib_api          MX_LIBRARY_VERSION of that MXNet's lib_api.h
 *   compiler         C++ compiler and version; build_type
 *   cpu_isa          the CPU code paths compiled in (generic, avx2, avx512: cpu_isa.h) and
 *   cpu_isa_active   the one this CPU runs (GNMX_CPU_ISA=generic|avx2 forces a lower one)
 *   openmp           the OpenMP version the CPU kernels use (0: none)
 *   cuda_runtime     CUDA runtime version linked in statically (empty: CPU only)
 *   cuda_archs       CUDA architectures as given to CMake ("50-real,...,90": SASS, + PTX if no -real)
 */
#include <string>

#include "lib_api.h"
#include "kernels/cpu_isa.h"
#include "kernels/cuda_util.h"

#ifndef GNMX_VERSION
#define GNMX_VERSION "unknown"
#endif
#ifndef GNMX_MXNET_BUILT
#define GNMX_MXNET_BUILT "unknown"
#endif
#ifndef GNMX_BUILD_TYPE
#define GNMX_BUILD_TYPE "unknown"
#endif

namespace {

std::string compiler() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("gcc ") + __VERSION__;
#else
  return "unknown";
#endif
}

std::string make_info() {
  std::string s;
  auto add = [&s](const char* k, const std::string& v) { s += std::string(k) + "=" + v + "\n"; };
  add("version", GNMX_VERSION);
  add("mxnet", GNMX_MXNET_BUILT);
  add("lib_api", std::to_string(MX_LIBRARY_VERSION));
  add("compiler", compiler());
  add("build_type", GNMX_BUILD_TYPE);
#if defined(GNMX_CPU_X86)
  add("cpu_isa", "generic,avx2,avx512");
  add("cpu_isa_active", gn_mx::cpu_isa_name(gn_mx::cpu_isa()));
#else
  add("cpu_isa", "generic");
  add("cpu_isa_active", "generic");
#endif
#if defined(_OPENMP)
  add("openmp", std::to_string(_OPENMP));
#else
  add("openmp", "0");
#endif
#if defined(GNMX_WITH_CUDA)
  const int v = gn_mx::cuda_runtime_built_version();
  add("cuda_runtime", std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10));
  add("cuda_archs", gn_mx::cuda_built_archs());
#else
  add("cuda_runtime", "");
  add("cuda_archs", "");
#endif
  return s;
}

}  // namespace

extern "C" const char* gnmx_build_info() {
  static const std::string info = make_info();
  return info.c_str();
}
