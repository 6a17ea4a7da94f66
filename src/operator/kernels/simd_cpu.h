/*
 * simd_cpu.h: the CPU kernels' inner loops ("primitives") with runtime ISA dispatch.
 *
 * The library is built for the baseline x86-64 (or any other) target; nothing here needs -march flags.
 * Each primitive exists three times:
 *   - a portable version (plain loops over to_acc/from_acc that the compiler vectorizes for the baseline
 *     ISA; fp16 goes through the software conversions of acc_type.h on builds without F16C), and
 *   - on x86-64 with GCC/Clang, an AVX2+FMA+F16C version compiled with __attribute__((target(...))),
 *     8 floats a vector, several independent accumulators, fp16 widened with vcvtph2ps in registers,
 *   - and, for fp32 / fp64, an AVX-512 version: 16 floats a vector, run tails by masked loads / stores.
 * prims<T>() picks one table per dtype on first use by cpu_isa.h's level. The environment variable
 * GNMX_CPU_ISA=generic|avx2 forces a lower level (tests run every level the CPU has).
 *
 * Every primitive works on one contiguous run of n elements, reads T (fp16/fp32/fp64) and computes in
 * AccT<T>; no primitive allocates. The arithmetic is that of group_norm_math.h.
 */
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "../common/acc_type.h"
#include "cpu_isa.h"
#include "group_norm_math.h"

namespace gn_mx {
namespace simd {

template <typename T>
struct Prims {
  using A = AccT<T>;
  // Exact moments of x[0, n): *mean = sum / n, *m2 = sum (x - mean)^2 (two passes; n should fit L1).
  void (*moments)(const T* x, int64_t n, A* mean, A* m2);
  // y = x * a + b.
  void (*affine)(const T* x, T* y, int64_t n, A a, A b);
  // *s1 += sum dy (x - mu), *s2 += sum dy.
  void (*bwd_sums)(const T* x, const T* dy, int64_t n, A mu, A* s1, A* s2);
  // dx = c1 dy + c2 (x - mu) + c3.
  void (*bwd_dx)(const T* x, const T* dy, T* dx, int64_t n, A mu, A c1, A c2, A c3);
  // With a fused activation (act = Act::kNone/kRelu/kSilu, group_norm.h), indexed
  // [act][streaming] (streaming = non-temporal stores, for outputs too large to stay in cache; a
  // thread that used them calls fence() before its results are read by others):
  //   act_affine: y = act(x * a + b)
  //   act_sums:   g = act'(x * a + b) dy;  *s1 += sum g (x - mu), *s2 += sum g
  //   act_dx:     dx = c1 g + c2 (x - mu) + c3
  void (*act_affine[3][2])(const T* x, T* y, int64_t n, A a, A b);
  void (*act_sums[3])(const T* x, const T* dy, int64_t n, A mu, A a, A b, A* s1, A* s2);
  void (*act_dx[3][2])(const T* x, const T* dy, T* dx, int64_t n, A mu, A a, A b, A c1, A c2, A c3);
  void (*fence)();
  // Widen / narrow a short run through an AccT buffer (small-spatial paths).
  void (*load)(const T* x, A* out, int64_t n);
  void (*store)(const A* in, T* out, int64_t n);
};

// Fills the tables of a Prims from templates Affine<ACT, NT>::f, Sums<ACT>::f, Dx<ACT, NT>::f; the
// plain entries above (affine, bwd_sums, bwd_dx: gn_channel_affine and gn_moments' backward) are the
// ACT = Act::kNone, cached-store instances.
template <typename T, template <Act, bool> class Affine, template <Act> class Sums,
          template <Act, bool> class Dx>
void fill_act_tables(Prims<T>* p) {
  using A = AccT<T>;
  p->act_affine[0][0] = Affine<Act::kNone, false>::f;  p->act_affine[0][1] = Affine<Act::kNone, true>::f;
  p->act_affine[1][0] = Affine<Act::kRelu, false>::f;  p->act_affine[1][1] = Affine<Act::kRelu, true>::f;
  p->act_affine[2][0] = Affine<Act::kSilu, false>::f;  p->act_affine[2][1] = Affine<Act::kSilu, true>::f;
  p->act_sums[0] = Sums<Act::kNone>::f;
  p->act_sums[1] = Sums<Act::kRelu>::f;
  p->act_sums[2] = Sums<Act::kSilu>::f;
  p->act_dx[0][0] = Dx<Act::kNone, false>::f;  p->act_dx[0][1] = Dx<Act::kNone, true>::f;
  p->act_dx[1][0] = Dx<Act::kRelu, false>::f;  p->act_dx[1][1] = Dx<Act::kRelu, true>::f;
  p->act_dx[2][0] = Dx<Act::kSilu, false>::f;  p->act_dx[2][1] = Dx<Act::kSilu, true>::f;
  p->affine = Affine<Act::kNone, false>::f;
  p->bwd_sums = [](const T* x, const T* dy, int64_t n, A mu, A* s1, A* s2) {
    Sums<Act::kNone>::f(x, dy, n, mu, A(1), A(0), s1, s2);
  };
  p->bwd_dx = [](const T* x, const T* dy, T* dx, int64_t n, A mu, A c1, A c2, A c3) {
    Dx<Act::kNone, false>::f(x, dy, dx, n, mu, A(1), A(0), c1, c2, c3);
  };
}

// ------------------------------------------------------------------------------------------------
// Portable versions.

template <typename T>
void moments_generic(const T* x, int64_t n, AccT<T>* mean, AccT<T>* m2) {
  using A = AccT<T>;
  A s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += to_acc(x[i]);
  const A mu = s / static_cast<A>(n);
  A q = 0;
#pragma omp simd reduction(+ : q)
  for (int64_t i = 0; i < n; ++i) {
    const A d = to_acc(x[i]) - mu;
    q += d * d;
  }
  *mean = mu;
  *m2 = q;
}

template <typename T, Act ACT>
void affine_generic(const T* x, T* y, int64_t n, AccT<T> a, AccT<T> b) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = from_acc<T>(gn_act<ACT>(to_acc(x[i]) * a + b));
}

template <typename T, Act ACT>
void bwd_sums_generic(const T* x, const T* dy, int64_t n, AccT<T> mu, AccT<T> a, AccT<T> b,
                      AccT<T>* s1, AccT<T>* s2) {
  using A = AccT<T>;
  A a1 = 0, a2 = 0;
#pragma omp simd reduction(+ : a1, a2)
  for (int64_t i = 0; i < n; ++i) {
    const A xv = to_acc(x[i]);
    const A g = gn_act_grad<ACT>(xv * a + b, to_acc(dy[i]));
    a1 += g * (xv - mu);
    a2 += g;
  }
  *s1 += a1;
  *s2 += a2;
}

template <typename T, Act ACT>
void bwd_dx_generic(const T* x, const T* dy, T* dx, int64_t n, AccT<T> mu, AccT<T> a, AccT<T> b,
                    AccT<T> c1, AccT<T> c2, AccT<T> c3) {
  using A = AccT<T>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const A xv = to_acc(x[i]);
    const A g = gn_act_grad<ACT>(xv * a + b, to_acc(dy[i]));
    dx[i] = from_acc<T>(c1 * g + c2 * (xv - mu) + c3);
  }
}

template <typename T>
void load_generic(const T* x, AccT<T>* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_acc(x[i]);
}

template <typename T>
void store_generic(const AccT<T>* in, T* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_acc<T>(in[i]);
}

inline void fence_none() {}

template <typename T> struct GenericOps {
  template <Act ACT, bool NT> struct Affine { static constexpr auto f = affine_generic<T, ACT>; };
  template <Act ACT> struct Sums { static constexpr auto f = bwd_sums_generic<T, ACT>; };
  template <Act ACT, bool NT> struct Dx { static constexpr auto f = bwd_dx_generic<T, ACT>; };
};

template <typename T>
const Prims<T>& generic_prims() {
  static const Prims<T> p = [] {
    Prims<T> q{};
    q.moments = moments_generic<T>;
    fill_act_tables<T, GenericOps<T>::template Affine, GenericOps<T>::template Sums,
                    GenericOps<T>::template Dx>(&q);
    q.fence = fence_none;
    q.load = load_generic<T>;
    q.store = store_generic<T>;
    return q;
  }();
  return p;
}

// ------------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C versions (fp32 and fp16 data; fp64 gets the portable loops vectorized for AVX2).

#if defined(GNMX_CPU_X86)
#define GNMX_AVX2 __attribute__((target("avx2,fma,f16c")))
#define GNMX_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

GNMX_AVX2_INLINE __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
GNMX_AVX2_INLINE __m256 ld8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
GNMX_AVX2_INLINE void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
GNMX_AVX2_INLINE void st8(Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// Streaming stores: 32-byte aligned fp32 / 16-byte aligned fp16 destinations.
GNMX_AVX2_INLINE void st8nt(float* p, __m256 v) { _mm256_stream_ps(p, v); }
GNMX_AVX2_INLINE void st8nt(Half* p, __m256 v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
template <typename T>
GNMX_AVX2_INLINE bool nt_aligned(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & (8 * sizeof(T) - 1)) == 0;
}
template <bool NT, typename T>
GNMX_AVX2_INLINE void st8x(T* p, __m256 v) {
  if (NT) st8nt(p, v); else st8(p, v);
}
GNMX_AVX2_INLINE float ld1(const float* p) { return *p; }
GNMX_AVX2_INLINE float ld1(const Half* p) { return _cvtsh_ss(p->bits); }
GNMX_AVX2_INLINE void st1(float* p, float v) { *p = v; }
GNMX_AVX2_INLINE void st1(Half* p, float v) { p->bits = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }

template <typename T>
GNMX_AVX2 void moments_avx2(const T* x, int64_t n, float* mean, float* m2) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, ld8(x + i));
    a1 = _mm256_add_ps(a1, ld8(x + i + 8));
    a2 = _mm256_add_ps(a2, ld8(x + i + 16));
    a3 = _mm256_add_ps(a3, ld8(x + i + 24));
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_add_ps(a0, ld8(x + i));
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += ld1(x + i);
  const float mu = s / static_cast<float>(n);
  const __m256 vmu = _mm256_set1_ps(mu);
  a0 = _mm256_setzero_ps(); a1 = a0; a2 = a0; a3 = a0;
  i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 d0 = _mm256_sub_ps(ld8(x + i), vmu), d1 = _mm256_sub_ps(ld8(x + i + 8), vmu);
    const __m256 d2 = _mm256_sub_ps(ld8(x + i + 16), vmu), d3 = _mm256_sub_ps(ld8(x + i + 24), vmu);
    a0 = _mm256_fmadd_ps(d0, d0, a0);
    a1 = _mm256_fmadd_ps(d1, d1, a1);
    a2 = _mm256_fmadd_ps(d2, d2, a2);
    a3 = _mm256_fmadd_ps(d3, d3, a3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 d = _mm256_sub_ps(ld8(x + i), vmu);
    a0 = _mm256_fmadd_ps(d, d, a0);
  }
  float q = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) {
    const float d = ld1(x + i) - mu;
    q += d * d;
  }
  *mean = mu;
  *m2 = q;
}

// exp(x) for 8 floats: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes
// expf coefficients, ~2 ulp), 2^n through the exponent bits. Inputs are clamped to [-87.3, 88.3]
// (exp saturates at ~1e-38 / ~2e38), which is all sigmoid needs.
GNMX_AVX2_INLINE __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
GNMX_AVX2_INLINE __m256 sigmoid8(__m256 z) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
}
template <Act ACT>
GNMX_AVX2_INLINE __m256 act8(__m256 z) {
  if (ACT == Act::kRelu) return _mm256_max_ps(z, _mm256_setzero_ps());
  if (ACT == Act::kSilu) return _mm256_mul_ps(z, sigmoid8(z));
  return z;
}
// dy * act'(z).
template <Act ACT>
GNMX_AVX2_INLINE __m256 act_grad8(__m256 z, __m256 dy) {
  if (ACT == Act::kRelu) return _mm256_and_ps(dy, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GT_OQ));
  if (ACT == Act::kSilu) {
    const __m256 one = _mm256_set1_ps(1.0f), s = sigmoid8(z);
    return _mm256_mul_ps(dy, _mm256_mul_ps(s, _mm256_fmadd_ps(z, _mm256_sub_ps(one, s), one)));
  }
  return dy;
}

template <typename T, Act ACT, bool NT>
GNMX_AVX2 void affine_avx2(const T* x, T* y, int64_t n, float a, float b) {
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  int64_t i = 0;
  if (NT) {
    for (; i < n && !nt_aligned(y + i); ++i) st1(y + i, gn_act<ACT>(ld1(x + i) * a + b));
  }
  for (; i + 16 <= n; i += 16) {
    st8x<NT>(y + i, act8<ACT>(_mm256_fmadd_ps(ld8(x + i), va, vb)));
    st8x<NT>(y + i + 8, act8<ACT>(_mm256_fmadd_ps(ld8(x + i + 8), va, vb)));
  }
  for (; i + 8 <= n; i += 8) st8x<NT>(y + i, act8<ACT>(_mm256_fmadd_ps(ld8(x + i), va, vb)));
  for (; i < n; ++i) st1(y + i, gn_act<ACT>(ld1(x + i) * a + b));
}

template <typename T, Act ACT>
GNMX_AVX2 void bwd_sums_avx2(const T* x, const T* dy, int64_t n, float mu, float a, float b,
                             float* s1, float* s2) {
  const __m256 vmu = _mm256_set1_ps(mu), va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, q0 = p0, q1 = p0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = ld8(x + i), x1 = ld8(x + i + 8);
    const __m256 g0 = act_grad8<ACT>(_mm256_fmadd_ps(x0, va, vb), ld8(dy + i));
    const __m256 g1 = act_grad8<ACT>(_mm256_fmadd_ps(x1, va, vb), ld8(dy + i + 8));
    p0 = _mm256_fmadd_ps(g0, _mm256_sub_ps(x0, vmu), p0);
    p1 = _mm256_fmadd_ps(g1, _mm256_sub_ps(x1, vmu), p1);
    q0 = _mm256_add_ps(q0, g0);
    q1 = _mm256_add_ps(q1, g1);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = ld8(x + i);
    const __m256 g0 = act_grad8<ACT>(_mm256_fmadd_ps(x0, va, vb), ld8(dy + i));
    p0 = _mm256_fmadd_ps(g0, _mm256_sub_ps(x0, vmu), p0);
    q0 = _mm256_add_ps(q0, g0);
  }
  float a1 = hsum8(_mm256_add_ps(p0, p1)), a2 = hsum8(_mm256_add_ps(q0, q1));
  for (; i < n; ++i) {
    const float xv = ld1(x + i);
    const float g = gn_act_grad<ACT>(xv * a + b, ld1(dy + i));
    a1 += g * (xv - mu);
    a2 += g;
  }
  *s1 += a1;
  *s2 += a2;
}

template <typename T, Act ACT>
GNMX_AVX2_INLINE void bwd_dx1(const T* x, const T* dy, T* dx, float mu, float a, float b, float c1,
                              float c2, float c3) {
  const float xv = ld1(x);
  st1(dx, c1 * gn_act_grad<ACT>(xv * a + b, ld1(dy)) + c2 * (xv - mu) + c3);
}

template <typename T, Act ACT, bool NT>
GNMX_AVX2 void bwd_dx_avx2(const T* x, const T* dy, T* dx, int64_t n, float mu, float a, float b,
                           float c1, float c2, float c3) {
  const __m256 vmu = _mm256_set1_ps(mu), v1 = _mm256_set1_ps(c1), v2 = _mm256_set1_ps(c2),
               v3 = _mm256_set1_ps(c3), va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
#define one(j) bwd_dx1<T, ACT>(x + (j), dy + (j), dx + (j), mu, a, b, c1, c2, c3)
  int64_t i = 0;
  if (NT) {
    for (; i < n && !nt_aligned(dx + i); ++i) one(i);
  }
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = ld8(x + i), x1 = ld8(x + i + 8);
    const __m256 t0 = _mm256_fmadd_ps(v2, _mm256_sub_ps(x0, vmu), v3);
    const __m256 t1 = _mm256_fmadd_ps(v2, _mm256_sub_ps(x1, vmu), v3);
    const __m256 g0 = act_grad8<ACT>(_mm256_fmadd_ps(x0, va, vb), ld8(dy + i));
    const __m256 g1 = act_grad8<ACT>(_mm256_fmadd_ps(x1, va, vb), ld8(dy + i + 8));
    st8x<NT>(dx + i, _mm256_fmadd_ps(v1, g0, t0));
    st8x<NT>(dx + i + 8, _mm256_fmadd_ps(v1, g1, t1));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = ld8(x + i);
    const __m256 t0 = _mm256_fmadd_ps(v2, _mm256_sub_ps(x0, vmu), v3);
    st8x<NT>(dx + i, _mm256_fmadd_ps(v1, act_grad8<ACT>(_mm256_fmadd_ps(x0, va, vb), ld8(dy + i)), t0));
  }
  for (; i < n; ++i) one(i);
#undef one
}

GNMX_AVX2 inline void fence_avx2() { _mm_sfence(); }

template <typename T>
GNMX_AVX2 void load_avx2(const T* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, ld8(x + i));
  for (; i < n; ++i) out[i] = ld1(x + i);
}

template <typename T>
GNMX_AVX2 void store_avx2(const float* in, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) st8(out + i, _mm256_loadu_ps(in + i));
  for (; i < n; ++i) st1(out + i, in[i]);
}

// fp64: the portable loops, compiled for AVX2 by inlining them into target functions.
GNMX_AVX2 inline void moments_avx2_d(const double* x, int64_t n, double* mean, double* m2) {
  moments_generic<double>(x, n, mean, m2);
}
template <Act ACT>
GNMX_AVX2 void affine_avx2_d(const double* x, double* y, int64_t n, double a, double b) {
  affine_generic<double, ACT>(x, y, n, a, b);
}
template <Act ACT>
GNMX_AVX2 void bwd_sums_avx2_d(const double* x, const double* dy, int64_t n, double mu, double a,
                               double b, double* s1, double* s2) {
  bwd_sums_generic<double, ACT>(x, dy, n, mu, a, b, s1, s2);
}
template <Act ACT>
GNMX_AVX2 void bwd_dx_avx2_d(const double* x, const double* dy, double* dx, int64_t n, double mu,
                             double a, double b, double c1, double c2, double c3) {
  bwd_dx_generic<double, ACT>(x, dy, dx, n, mu, a, b, c1, c2, c3);
}

template <typename T> struct Avx2Ops {
  template <Act ACT, bool NT> struct Affine { static constexpr auto f = affine_avx2<T, ACT, NT>; };
  template <Act ACT> struct Sums { static constexpr auto f = bwd_sums_avx2<T, ACT>; };
  template <Act ACT, bool NT> struct Dx { static constexpr auto f = bwd_dx_avx2<T, ACT, NT>; };
};
template <> struct Avx2Ops<double> {
  template <Act ACT, bool NT> struct Affine { static constexpr auto f = affine_avx2_d<ACT>; };
  template <Act ACT> struct Sums { static constexpr auto f = bwd_sums_avx2_d<ACT>; };
  template <Act ACT, bool NT> struct Dx { static constexpr auto f = bwd_dx_avx2_d<ACT>; };
};

template <typename T>
const Prims<T>& avx2_prims() {
  static const Prims<T> p = [] {
    Prims<T> q{};
    fill_act_tables<T, Avx2Ops<T>::template Affine, Avx2Ops<T>::template Sums,
                    Avx2Ops<T>::template Dx>(&q);
    if constexpr (std::is_same<T, double>::value) {
      q.moments = moments_avx2_d;
      q.fence = fence_none;
      q.load = load_generic<double>;
      q.store = store_generic<double>;
    } else {
      q.moments = moments_avx2<T>;
      q.fence = fence_avx2;
      q.load = load_avx2<T>;
      q.store = store_avx2<T>;
    }
    return q;
  }();
  return p;
}

// ------------------------------------------------------------------------------------------------
// AVX-512 versions (the avx512 level of cpu_isa.h) for fp32: 16 floats a vector, the last n % 16
// elements of a run done by masked loads / stores instead of scalar loops; fp64 gets the portable
// loops compiled for AVX-512. fp16 (the 512-bit vcvtph2ps / vcvtps2ph) runs here only on Intel
// CPUs (cpu_fast_avx512_fp16): on a Zen 4 (double-pumped 512-bit conversions) it was 1.15x slower
// than the AVX2/F16C table (cached forward of a 64x3136 sample 29.2 vs 25.4 us), on an Intel Xeon
// 1.05-1.18x faster (benchmarks/results/simd_levels_cpu.md).

#define GNMX_AVX512 __attribute__((target(GNMX_AVX512_TARGET)))
#define GNMX_AVX512_INLINE __attribute__((target(GNMX_AVX512_TARGET), always_inline)) inline

// The first min(n, 16) lanes.
GNMX_AVX512_INLINE __mmask16 lanes16(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}
GNMX_AVX512_INLINE __m512 ld16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
GNMX_AVX512_INLINE __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
GNMX_AVX512_INLINE void st16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// fp16: 16 halves (32 bytes) widened / rounded (to nearest even, as st8) by the 512-bit conversions;
// masked-off lanes load +0.0 and are not written.
GNMX_AVX512_INLINE __m512 ld16(const Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
GNMX_AVX512_INLINE __m512 ld16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
GNMX_AVX512_INLINE __m256i half16(__m512 v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
GNMX_AVX512_INLINE void st16(Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, half16(v));
}
// Full vectors; streaming needs a 16-element (64-byte fp32, 32-byte fp16) aligned destination.
template <bool NT>
GNMX_AVX512_INLINE void st16x(float* p, __m512 v) {
  if (NT) _mm512_stream_ps(p, v); else _mm512_storeu_ps(p, v);
}
template <bool NT>
GNMX_AVX512_INLINE void st16x(Half* p, __m512 v) {
  if (NT)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), half16(v));
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half16(v));
}
// Elements before the first streaming-aligned one (0 when not streaming).
template <bool NT, typename T>
GNMX_AVX512_INLINE int64_t nt_head16(const T* p, int64_t n) {
  if (!NT) return 0;
  const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) & (16 * sizeof(T) - 1));
  const int64_t head = mis == 0 ? 0 : (static_cast<int64_t>(16 * sizeof(T)) - mis) / sizeof(T);
  return head < n ? head : n;
}

template <typename T>
GNMX_AVX512 void moments_avx512(const T* x, int64_t n, float* mean, float* m2) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, ld16(x + i));
    a1 = _mm512_add_ps(a1, ld16(x + i + 16));
    a2 = _mm512_add_ps(a2, ld16(x + i + 32));
    a3 = _mm512_add_ps(a3, ld16(x + i + 48));
  }
  for (; i < n; i += 16) a0 = _mm512_add_ps(a0, ld16(x + i, lanes16(n - i)));
  const float mu =
      _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))) /
      static_cast<float>(n);
  const __m512 vmu = _mm512_set1_ps(mu);
  a0 = _mm512_setzero_ps(); a1 = a0; a2 = a0; a3 = a0;
  i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512 d0 = _mm512_sub_ps(ld16(x + i), vmu), d1 = _mm512_sub_ps(ld16(x + i + 16), vmu);
    const __m512 d2 = _mm512_sub_ps(ld16(x + i + 32), vmu), d3 = _mm512_sub_ps(ld16(x + i + 48), vmu);
    a0 = _mm512_fmadd_ps(d0, d0, a0);
    a1 = _mm512_fmadd_ps(d1, d1, a1);
    a2 = _mm512_fmadd_ps(d2, d2, a2);
    a3 = _mm512_fmadd_ps(d3, d3, a3);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    const __m512 d = _mm512_maskz_sub_ps(m, ld16(x + i, m), vmu);
    a0 = _mm512_fmadd_ps(d, d, a0);
  }
  *mean = mu;
  *m2 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

// exp and sigmoid: exp8's method (simd_cpu.h's AVX2 version above), 2^n by vscalefps.
GNMX_AVX512_INLINE __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}
template <Act ACT>
GNMX_AVX512_INLINE __m512 act16(__m512 z) {
  if (ACT == Act::kRelu) return _mm512_max_ps(z, _mm512_setzero_ps());
  if (ACT == Act::kSilu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(z, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
  }
  return z;
}
// dy * act'(z).
template <Act ACT>
GNMX_AVX512_INLINE __m512 act_grad16(__m512 z, __m512 dy) {
  if (ACT == Act::kRelu) return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GT_OQ), dy);
  if (ACT == Act::kSilu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
    return _mm512_mul_ps(dy, _mm512_mul_ps(s, _mm512_fmadd_ps(z, _mm512_sub_ps(one, s), one)));
  }
  return dy;
}

template <typename T, Act ACT, bool NT>
GNMX_AVX512 void affine_avx512(const T* x, T* y, int64_t n, float a, float b) {
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  const int64_t h = nt_head16<NT>(y, n);
  if (h > 0) st16(y, act16<ACT>(_mm512_fmadd_ps(ld16(x, lanes16(h)), va, vb)), lanes16(h));
  int64_t i = h;
  for (; i + 32 <= n; i += 32) {
    st16x<NT>(y + i, act16<ACT>(_mm512_fmadd_ps(ld16(x + i), va, vb)));
    st16x<NT>(y + i + 16, act16<ACT>(_mm512_fmadd_ps(ld16(x + i + 16), va, vb)));
  }
  for (; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    st16(y + i, act16<ACT>(_mm512_fmadd_ps(ld16(x + i, m), va, vb)), m);
  }
}

template <typename T, Act ACT>
GNMX_AVX512 void bwd_sums_avx512(const T* x, const T* dy, int64_t n, float mu, float a, float b,
                                 float* s1, float* s2) {
  const __m512 vmu = _mm512_set1_ps(mu), va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
  __m512 p0 = _mm512_setzero_ps(), p1 = p0, q0 = p0, q1 = p0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 x0 = ld16(x + i), x1 = ld16(x + i + 16);
    const __m512 g0 = act_grad16<ACT>(_mm512_fmadd_ps(x0, va, vb), ld16(dy + i));
    const __m512 g1 = act_grad16<ACT>(_mm512_fmadd_ps(x1, va, vb), ld16(dy + i + 16));
    p0 = _mm512_fmadd_ps(g0, _mm512_sub_ps(x0, vmu), p0);
    p1 = _mm512_fmadd_ps(g1, _mm512_sub_ps(x1, vmu), p1);
    q0 = _mm512_add_ps(q0, g0);
    q1 = _mm512_add_ps(q1, g1);
  }
  for (; i < n; i += 16) {  // masked-off lanes load dy = 0, so g = 0 there
    const __mmask16 m = lanes16(n - i);
    const __m512 x0 = ld16(x + i, m);
    const __m512 g0 = act_grad16<ACT>(_mm512_fmadd_ps(x0, va, vb), ld16(dy + i, m));
    p0 = _mm512_fmadd_ps(g0, _mm512_sub_ps(x0, vmu), p0);
    q0 = _mm512_add_ps(q0, g0);
  }
  *s1 += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  *s2 += _mm512_reduce_add_ps(_mm512_add_ps(q0, q1));
}

// c1 act'(x a + b) dy + c2 (x - mu) + c3 of 16 elements.
template <Act ACT>
GNMX_AVX512_INLINE __m512 dx16(__m512 x, __m512 dy, __m512 vmu, __m512 va, __m512 vb, __m512 v1,
                               __m512 v2, __m512 v3) {
  const __m512 t = _mm512_fmadd_ps(v2, _mm512_sub_ps(x, vmu), v3);
  return _mm512_fmadd_ps(v1, act_grad16<ACT>(_mm512_fmadd_ps(x, va, vb), dy), t);
}

template <typename T, Act ACT, bool NT>
GNMX_AVX512 void bwd_dx_avx512(const T* x, const T* dy, T* dx, int64_t n, float mu, float a,
                               float b, float c1, float c2, float c3) {
  const __m512 vmu = _mm512_set1_ps(mu), v1 = _mm512_set1_ps(c1), v2 = _mm512_set1_ps(c2),
               v3 = _mm512_set1_ps(c3), va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
#define one16(j, m) dx16<ACT>(ld16(x + (j), m), ld16(dy + (j), m), vmu, va, vb, v1, v2, v3)
  const int64_t h = nt_head16<NT>(dx, n);
  if (h > 0) st16(dx, one16(0, lanes16(h)), lanes16(h));
  int64_t i = h;
  for (; i + 32 <= n; i += 32) {
    st16x<NT>(dx + i, dx16<ACT>(ld16(x + i), ld16(dy + i), vmu, va, vb, v1, v2, v3));
    st16x<NT>(dx + i + 16, dx16<ACT>(ld16(x + i + 16), ld16(dy + i + 16), vmu, va, vb, v1, v2, v3));
  }
  for (; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    st16(dx + i, one16(i, m), m);
  }
#undef one16
}

template <typename T>
GNMX_AVX512 void load_avx512(const T* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    _mm512_mask_storeu_ps(out + i, m, ld16(x + i, m));
  }
}

template <typename T>
GNMX_AVX512 void store_avx512(const float* in, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    st16(out + i, _mm512_maskz_loadu_ps(m, in + i), m);
  }
}

// fp64: the portable loops, compiled for AVX-512 by inlining them into target functions.
GNMX_AVX512 inline void moments_avx512_d(const double* x, int64_t n, double* mean, double* m2) {
  moments_generic<double>(x, n, mean, m2);
}
template <Act ACT>
GNMX_AVX512 void affine_avx512_d(const double* x, double* y, int64_t n, double a, double b) {
  affine_generic<double, ACT>(x, y, n, a, b);
}
template <Act ACT>
GNMX_AVX512 void bwd_sums_avx512_d(const double* x, const double* dy, int64_t n, double mu,
                                   double a, double b, double* s1, double* s2) {
  bwd_sums_generic<double, ACT>(x, dy, n, mu, a, b, s1, s2);
}
template <Act ACT>
GNMX_AVX512 void bwd_dx_avx512_d(const double* x, const double* dy, double* dx, int64_t n,
                                 double mu, double a, double b, double c1, double c2, double c3) {
  bwd_dx_generic<double, ACT>(x, dy, dx, n, mu, a, b, c1, c2, c3);
}

template <typename T> struct Avx512Ops {
  template <Act ACT, bool NT> struct Affine { static constexpr auto f = affine_avx512<T, ACT, NT>; };
  template <Act ACT> struct Sums { static constexpr auto f = bwd_sums_avx512<T, ACT>; };
  template <Act ACT, bool NT> struct Dx { static constexpr auto f = bwd_dx_avx512<T, ACT, NT>; };
};
template <> struct Avx512Ops<double> {
  template <Act ACT, bool NT> struct Affine { static constexpr auto f = affine_avx512_d<ACT>; };
  template <Act ACT> struct Sums { static constexpr auto f = bwd_sums_avx512_d<ACT>; };
  template <Act ACT, bool NT> struct Dx { static constexpr auto f = bwd_dx_avx512_d<ACT>; };
};

template <typename T>
const Prims<T>& avx512_prims() {
  static const Prims<T> p = [] {
    Prims<T> q{};
    fill_act_tables<T, Avx512Ops<T>::template Affine, Avx512Ops<T>::template Sums,
                    Avx512Ops<T>::template Dx>(&q);
    if constexpr (std::is_same<T, double>::value) {
      q.moments = moments_avx512_d;
      q.fence = fence_none;
      q.load = load_generic<double>;
      q.store = store_generic<double>;
    } else {
      q.moments = moments_avx512<T>;
      q.fence = fence_avx2;
      q.load = load_avx512<T>;
      q.store = store_avx512<T>;
    }
    return q;
  }();
  return p;
}

template <typename T>
const Prims<T>& prims() {
  if constexpr (std::is_same<T, Half>::value) {
    if (cpu_has_avx512() && cpu_fast_avx512_fp16()) return avx512_prims<T>();
  } else {
    if (cpu_has_avx512()) return avx512_prims<T>();
  }
  return cpu_has_avx2() ? avx2_prims<T>() : generic_prims<T>();
}
#else
template <typename T>
const Prims<T>& prims() {
  return generic_prims<T>();
}
#endif

}  // namespace simd
}  // namespace gn_mx
