/*
 * cpu_isa.h: the one run-time x86 ISA check and the AVX2 helpers shared by the CPU kernels
 * (GroupNorm's simd_cpu.h, DBN's panels and small D x D math).
 *
 * GNMX_CPU_X86 is defined where the compiler can emit target("avx2,...") / target("avx512f,...")
 * functions next to the portable code (no global -m flags: the library runs on any x86-64). The
 * levels, lowest first:
 *   generic  the portable loops (baseline x86-64: SSE2)
 *   avx2     AVX2 + FMA + F16C
 *   avx512   the avx2 level plus AVX-512 F/BW/VL/DQ (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4)
 * cpu_isa() is the highest level the CPU (and OS) supports, read once per process; the environment
 * variable GNMX_CPU_ISA=generic|avx2|avx512 lowers it (a level above the CPU's is capped to the
 * CPU's; another value is ignored with one line on stderr). Every level >= avx2 also runs the avx2
 * kernels that have no avx512 version (cpu_has_avx2()). The tests run each supported level.
 */
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define GNMX_CPU_X86 1
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// The target attribute string of the avx512 level's functions.
#define GNMX_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"

namespace gn_mx {

enum class CpuIsa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* cpu_isa_name(CpuIsa l) {
  return l == CpuIsa::kAvx512 ? "avx512" : l == CpuIsa::kAvx2 ? "avx2" : "generic";
}

// The highest level this CPU supports (libgcc's checks include the OS saving the ymm/zmm state).
inline CpuIsa cpu_isa_supported() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")))
    return CpuIsa::kGeneric;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return CpuIsa::kAvx512;
  return CpuIsa::kAvx2;
}

// The level the kernels use: the CPU's, lowered by GNMX_CPU_ISA.
inline CpuIsa cpu_isa() {
  static const CpuIsa level = [] {
    const CpuIsa hw = cpu_isa_supported();
    const char* e = std::getenv("GNMX_CPU_ISA");
    if (e == nullptr || *e == '\0') return hw;
    for (int i = 0; i <= static_cast<int>(CpuIsa::kAvx512); ++i) {
      const CpuIsa l = static_cast<CpuIsa>(i);
      if (std::strcmp(e, cpu_isa_name(l)) == 0) return l < hw ? l : hw;
    }
    std::fprintf(stderr, "gn_mx: GNMX_CPU_ISA=%s is not one of generic, avx2, avx512; using %s\n",
                 e, cpu_isa_name(hw));
    return hw;
  }();
  return level;
}

inline bool cpu_has_avx2() { return cpu_isa() >= CpuIsa::kAvx2; }
inline bool cpu_has_avx512() { return cpu_isa() >= CpuIsa::kAvx512; }

// Whether the avx512 level also converts fp16 512 bits at a time (simd_cpu.h's fp16 primitives):
// on an Intel Xeon (full-width AVX-512 units) they beat the AVX2/F16C ones by 5-18%; on AMD's
// Zen 4, which splits 512-bit work into two 256-bit halves, they were 1.15x slower
// (benchmarks/results/simd_levels_cpu.md). So the rule is the vendor: Intel yes, others no;
// GNMX_CPU_FP16_AVX512=1 / 0 overrides it (read once per process; the tests run both tables on
// any AVX-512 CPU).
inline bool cpu_fast_avx512_fp16() {
  static const bool fast = [] {
    const char* e = std::getenv("GNMX_CPU_FP16_AVX512");
    if (e != nullptr && (std::strcmp(e, "0") == 0 || std::strcmp(e, "1") == 0)) return *e == '1';
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return fast;
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

// ---- Register tiles written once for float and double -----------------------------------------
#define GNMX_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) static inline
template <typename S> struct Avx2Vec;
template <> struct Avx2Vec<float> {
  using V = __m256;
  static constexpr int kLanes = 8;
  GNMX_AVX2_INLINE V zero() { return _mm256_setzero_ps(); }
  GNMX_AVX2_INLINE V load(const float* p) { return _mm256_loadu_ps(p); }
  GNMX_AVX2_INLINE V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  GNMX_AVX2_INLINE V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  GNMX_AVX2_INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
  GNMX_AVX2_INLINE void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};
template <> struct Avx2Vec<double> {
  using V = __m256d;
  static constexpr int kLanes = 4;
  GNMX_AVX2_INLINE V zero() { return _mm256_setzero_pd(); }
  GNMX_AVX2_INLINE V load(const double* p) { return _mm256_loadu_pd(p); }
  GNMX_AVX2_INLINE V bcast(const double* p) { return _mm256_broadcast_sd(p); }
  GNMX_AVX2_INLINE V fma(V a, V b, V c) { return _mm256_fmadd_pd(a, b, c); }
  GNMX_AVX2_INLINE V add(V a, V b) { return _mm256_add_pd(a, b); }
  GNMX_AVX2_INLINE void store(double* p, V v) { _mm256_storeu_pd(p, v); }
};
#undef GNMX_AVX2_INLINE

// The same operations 512 bits wide (the avx512 level): 16 floats / 8 doubles a vector.
#define GNMX_AVX512_VEC_INLINE __attribute__((target(GNMX_AVX512_TARGET), always_inline)) static inline
template <typename S> struct Avx512Vec;
template <> struct Avx512Vec<float> {
  using V = __m512;
  static constexpr int kLanes = 16;
  GNMX_AVX512_VEC_INLINE V zero() { return _mm512_setzero_ps(); }
  GNMX_AVX512_VEC_INLINE V load(const float* p) { return _mm512_loadu_ps(p); }
  GNMX_AVX512_VEC_INLINE V bcast(const float* p) { return _mm512_set1_ps(*p); }
  GNMX_AVX512_VEC_INLINE V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  GNMX_AVX512_VEC_INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
  GNMX_AVX512_VEC_INLINE void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
template <> struct Avx512Vec<double> {
  using V = __m512d;
  static constexpr int kLanes = 8;
  GNMX_AVX512_VEC_INLINE V zero() { return _mm512_setzero_pd(); }
  GNMX_AVX512_VEC_INLINE V load(const double* p) { return _mm512_loadu_pd(p); }
  GNMX_AVX512_VEC_INLINE V bcast(const double* p) { return _mm512_set1_pd(*p); }
  GNMX_AVX512_VEC_INLINE V fma(V a, V b, V c) { return _mm512_fmadd_pd(a, b, c); }
  GNMX_AVX512_VEC_INLINE V add(V a, V b) { return _mm512_add_pd(a, b); }
  GNMX_AVX512_VEC_INLINE void store(double* p, V v) { _mm512_storeu_pd(p, v); }
};
#undef GNMX_AVX512_VEC_INLINE

// C rows [0, R) x columns [0, 2 lanes) = A (R x K, row stride lda) B (K x 2 lanes, row stride
// ldb) (acc: C + A B), k ascending per entry (one FMA chain from zero, then C added): 2R accumulators (R <= 6: 12 + 2 + 1 of 16
// registers). X: Avx2Vec<S> (avx2_tile2) or Avx512Vec<S> (avx512_tile2, twice the columns); every
// entry is the same chain on both, so the two levels give the same bits. DBN's float panel products
// (16 / 32 columns) and fp64 D x D products (8 / 16 columns) are this tile.
#define GNMX_TILE2_BODY                                                 \
  typename X::V c0[R], c1[R];                                           \
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = X::zero();                \
  const S* b = B;                                                       \
  for (int k = 0; k < K; ++k, b += ldb) {                               \
    const typename X::V b0 = X::load(b), b1 = X::load(b + X::kLanes);   \
    for (int r = 0; r < R; ++r) {                                       \
      const typename X::V w = X::bcast(A + r * lda + k);                \
      c0[r] = X::fma(w, b0, c0[r]);                                     \
      c1[r] = X::fma(w, b1, c1[r]);                                     \
    }                                                                   \
  }                                                                     \
  for (int r = 0; r < R; ++r) {                                         \
    if (acc) {                                                          \
      c0[r] = X::add(X::load(C + r * ldc), c0[r]);                      \
      c1[r] = X::add(X::load(C + r * ldc + X::kLanes), c1[r]);          \
    }                                                                   \
    X::store(C + r * ldc, c0[r]);                                       \
    X::store(C + r * ldc + X::kLanes, c1[r]);                           \
  }
template <typename S, int R>
__attribute__((target("avx2,fma"), always_inline)) inline void avx2_tile2(
    const S* A, int64_t lda, const S* B, int64_t ldb, S* C, int64_t ldc, int K, bool acc = false) {
  using X = Avx2Vec<S>;
  GNMX_TILE2_BODY
}
template <typename S, int R>
__attribute__((target(GNMX_AVX512_TARGET), always_inline)) inline void avx512_tile2(
    const S* A, int64_t lda, const S* B, int64_t ldb, S* C, int64_t ldc, int K, bool acc = false) {
  using X = Avx512Vec<S>;
  GNMX_TILE2_BODY
}
#undef GNMX_TILE2_BODY

// Rows left by 6-row tiles: f(std::integral_constant<int, n>{}) for n in 1..5 (nothing for 0).
template <typename F>
inline void with_tail_rows(int n, F&& f) {
  switch (n) {
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

}  // namespace gn_mx
#endif
