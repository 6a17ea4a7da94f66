/*
 * cpu_isa.h: the one run-time x86 ISA check and the AVX2 helpers shared by the CPU kernels
 * (GroupNorm's simd_cpu.h, DBN's panels and small D x D math).
 *
 * GNMX_CPU_X86 is defined where the compiler can emit target("avx2,...") functions next to the
 * portable code; cpu_has_avx2() then tells at run time whether the CPU has AVX2 + FMA + F16C, and
 * GNMX_CPU_ISA=generic forces the portable paths (tests run both).
 */
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define GNMX_CPU_X86 1
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

namespace gn_mx {

inline bool cpu_has_avx2() {
  static const bool ok = [] {
    const char* e = std::getenv("GNMX_CPU_ISA");
    if (e != nullptr && std::strcmp(e, "generic") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return ok;
}

// Horizontal sums (inlined into any avx2,fma[,f16c] caller).
__attribute__((target("avx2,fma"), always_inline)) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
// Four at once: {sum a, sum b, sum c, sum d}.
__attribute__((target("avx2,fma"), always_inline)) inline __m128 hsum4(__m256 a, __m256 b,
                                                                      __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

}  // namespace gn_mx
#endif
