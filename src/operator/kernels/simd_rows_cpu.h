/*
 * simd_rows_cpu.h: the inner loops of the channels-last CPU kernels, with simd_cpu.h's runtime ISA
 * dispatch.
 *
 * Channels-last data (N, S, C) is read as rows of C contiguous channels, one row per position. A
 * group is D channels of every row, so nothing runs along a group; the loops run along a row instead,
 * with one coefficient per channel (a group's value repeated over its D channels): every loop is
 * "for each of R rows, for each channel c" over AccT rows (fp16 data is widened by simd_cpu.h's
 * load/store first), vectorized over c; rows lie ld >= C apart (ld = C: whole rows; ld > C: a block
 * of C channels of wider rows). The arithmetic is group_norm_math.h's, the formulas of the
 * channels-first primitives with per-channel instead of per-group scalars:
 *   col_sum:  out[c] = scale * sum_r x[r, c]
 *   col_m2:   out[c] = sum_r (x[r, c] - mu[c])^2
 *   chan_merge: Chan's update of per-channel (mean, M2) states by a chunk's (welford.h)
 *   affine:   y = act(x * a[c] + b[c])
 *   sums:     g = act'(x * a[c] + b[c]) dy;  s1[c] += sum_r g (x - mu[c]),  s2[c] += sum_r g
 *   dx:       dx = c1[c] g + c2[c] (x - mu[c]) + c3[c]
 *   stream:   dst[0, n) = src[0, n) with streaming (non-temporal) stores where the ISA has them
 *             (AVX2: a scalar head up to the first 32-byte boundary of dst); the channels-last
 *             outputs too large to stay in cache are computed into an L1 buffer and streamed out
 * Each exists as one always-inlined template, compiled twice: for the baseline ISA and, on x86-64,
 * inside target("avx2,fma,f16c") functions (the compiler vectorizes the same loop 8 floats wide).
 * rows<A>() picks the table once (GNMX_CPU_ISA=generic forces the baseline, as for simd_cpu.h). The
 * avx512 level runs the AVX2 table: the same loops compiled for AVX-512 were 2-14% slower on a
 * Zen 4 (col_sum + col_m2 + affine over cached 3136x64 .. 4096x320 fp32 rows, minimum of 200).
 */
#pragma once
#include <cstdint>

#include "../common/acc_type.h"
#include "cpu_isa.h"
#include "group_norm_math.h"

namespace gn_mx {
namespace simd {

#define GNMX_ROW_INLINE __attribute__((always_inline)) inline

// Column loops run over blocks of channels whose accumulators stay in registers (GCC vector
// extensions: 32-byte vectors, 8 floats / 4 doubles, which the AVX2 instantiation keeps in ymm
// registers and the baseline one in pairs of xmm) while the rows stream past; a row-by-row
// `out[c] += x[r, c]` would load and store every accumulator once per row (store-bound). The last
// C % block channels take col_vectors (below), the last C % vector channels plain loops.
template <typename A>
struct Vec32 {
  typedef A type __attribute__((vector_size(32)));
  static constexpr int64_t kWidth = 32 / static_cast<int64_t>(sizeof(A));
  static GNMX_ROW_INLINE type load(const A* p) {
    type v;
    __builtin_memcpy(&v, p, sizeof(v));
    return v;
  }
  static GNMX_ROW_INLINE void store(A* p, type v) { __builtin_memcpy(p, &v, sizeof(v)); }
};

// The 1-3 whole vectors of channels left after the 4-vector blocks (or all 5-7 of a row narrower
// than 8 vectors, C = 40-56 fp32), NV of them in ONE pass over
// the rows (a pass per vector re-read every row's cache lines NV times), U rows at a time so that
// NV * U independent add chains hide the add latency; a single chain per vector was latency-bound
// (R = 4096, C = 8: 30 -> 2.3 us, C = 16: 30 -> 9 us; benchmarks/simd_levels.cc rows).
//   kM2 false: out[c] = scale * sum_r x[r, c];  true: out[c] = sum_r (x[r, c] - mu[c])^2
template <typename A, int NV, bool kM2>
GNMX_ROW_INLINE void col_vectors_impl(const A* x, int64_t R, int64_t ld, const A* mu, A scale,
                                      A* out) {
  using Q = Vec32<A>;
  using V = typename Q::type;
  constexpr int64_t W = Q::kWidth;
  constexpr int U = NV == 1 ? 4 : NV <= 3 ? 2 : 1;
  V acc[U][NV] = {};
  V m[NV] = {};
  if (kM2)
    for (int v = 0; v < NV; ++v) m[v] = Q::load(mu + v * W);
  int64_t r = 0;
  for (; r + U <= R; r += U)
    for (int u = 0; u < U; ++u)
      for (int v = 0; v < NV; ++v) {
        const V d = Q::load(x + (r + u) * ld + v * W) - m[v];
        acc[u][v] += kM2 ? d * d : d;
      }
  for (; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      const V d = Q::load(x + r * ld + v * W) - m[v];
      acc[0][v] += kM2 ? d * d : d;
    }
  for (int v = 0; v < NV; ++v) {
    V t = acc[0][v];
    for (int u = 1; u < U; ++u) t += acc[u][v];
    Q::store(out + v * W, kM2 ? t : t * scale);
  }
}

// col_vectors_impl over the whole vectors of [0, C) (C < 4 vectors, or 5-7); returns the
// channels done.
template <typename A, bool kM2>
GNMX_ROW_INLINE int64_t col_vectors(const A* x, int64_t R, int64_t C, int64_t ld, const A* mu,
                                    A scale, A* out) {
  constexpr int64_t W = Vec32<A>::kWidth;
  switch (C / W) {
    case 7: col_vectors_impl<A, 7, kM2>(x, R, ld, mu, scale, out); return 7 * W;
    case 6: col_vectors_impl<A, 6, kM2>(x, R, ld, mu, scale, out); return 6 * W;
    case 5: col_vectors_impl<A, 5, kM2>(x, R, ld, mu, scale, out); return 5 * W;
    case 3: col_vectors_impl<A, 3, kM2>(x, R, ld, mu, scale, out); return 3 * W;
    case 2: col_vectors_impl<A, 2, kM2>(x, R, ld, mu, scale, out); return 2 * W;
    case 1: col_vectors_impl<A, 1, kM2>(x, R, ld, mu, scale, out); return W;
    default: return 0;
  }
}

// out[c] = scale * sum_r x[r, c]
template <typename A>
GNMX_ROW_INLINE void col_sum_impl(const A* x, int64_t R, int64_t C, int64_t ld, A scale, A* out) {
  using Q = Vec32<A>;
  using V = typename Q::type;
  constexpr int64_t W = Q::kWidth, B = 4 * W;
  int64_t c0 = C / W >= 5 && C / W <= 7 ? col_vectors<A, false>(x, R, C, ld, nullptr, scale, out) : 0;
  for (; c0 + B <= C; c0 += B) {
    V a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t r = 0; r < R; ++r) {
      const A* p = x + r * ld + c0;
      a0 += Q::load(p);
      a1 += Q::load(p + W);
      a2 += Q::load(p + 2 * W);
      a3 += Q::load(p + 3 * W);
    }
    Q::store(out + c0, a0 * scale);
    Q::store(out + c0 + W, a1 * scale);
    Q::store(out + c0 + 2 * W, a2 * scale);
    Q::store(out + c0 + 3 * W, a3 * scale);
  }
  c0 += col_vectors<A, false>(x + c0, R, C - c0, ld, nullptr, scale, out + c0);
  if (c0 == C) return;
  for (int64_t c = c0; c < C; ++c) out[c] = 0;
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * ld;
#pragma omp simd
    for (int64_t c = c0; c < C; ++c) out[c] += xr[c];
  }
  for (int64_t c = c0; c < C; ++c) out[c] *= scale;
}

// out[c] = sum_r (x[r, c] - mu[c])^2
template <typename A>
GNMX_ROW_INLINE void col_m2_impl(const A* x, int64_t R, int64_t C, int64_t ld, const A* mu,
                                 A* out) {
  using Q = Vec32<A>;
  using V = typename Q::type;
  constexpr int64_t W = Q::kWidth, B = 4 * W;
  int64_t c0 = C / W >= 5 && C / W <= 7 ? col_vectors<A, true>(x, R, C, ld, mu, A(0), out) : 0;
  for (; c0 + B <= C; c0 += B) {
    V a0 = {}, a1 = {}, a2 = {}, a3 = {};
    const V m0 = Q::load(mu + c0), m1 = Q::load(mu + c0 + W), m2 = Q::load(mu + c0 + 2 * W),
            m3 = Q::load(mu + c0 + 3 * W);
    for (int64_t r = 0; r < R; ++r) {
      const A* p = x + r * ld + c0;
      const V d0 = Q::load(p) - m0, d1 = Q::load(p + W) - m1, d2 = Q::load(p + 2 * W) - m2,
              d3 = Q::load(p + 3 * W) - m3;
      a0 += d0 * d0;
      a1 += d1 * d1;
      a2 += d2 * d2;
      a3 += d3 * d3;
    }
    Q::store(out + c0, a0);
    Q::store(out + c0 + W, a1);
    Q::store(out + c0 + 2 * W, a2);
    Q::store(out + c0 + 3 * W, a3);
  }
  c0 += col_vectors<A, true>(x + c0, R, C - c0, ld, mu + c0, A(0), out + c0);
  if (c0 == C) return;
  for (int64_t c = c0; c < C; ++c) out[c] = 0;
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * ld;
#pragma omp simd
    for (int64_t c = c0; c < C; ++c) {
      const A d = xr[c] - mu[c];
      out[c] += d * d;
    }
  }
}

// Chan's update of per-channel states (mean, m2) that all hold n_a rows with a chunk's exact
// (cm, cm2) of n_b rows: wb = n_b / (n_a + n_b), wab = n_a * n_b / (n_a + n_b) (welford.h's merge,
// one count for every channel).
template <typename A>
GNMX_ROW_INLINE void chan_merge_impl(A* mean, A* m2, const A* cm, const A* cm2, int64_t C, A wb,
                                     A wab) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) {
    const A d = cm[c] - mean[c];
    mean[c] += d * wb;
    m2[c] += cm2[c] + d * d * wab;
  }
}

template <typename A, Act ACT>
GNMX_ROW_INLINE void affine_impl(const A* x, A* y, int64_t R, int64_t C, int64_t ld, const A* a,
                                 const A* b) {
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * ld;
    A* yr = y + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) yr[c] = gn_act<ACT>(xr[c] * a[c] + b[c]);
  }
}

// s1[c] += sum_r g (x - mu[c]), s2[c] += sum_r g, g = act'(x a[c] + b[c]) dy (blocks of two
// vectors: their sums, means and pre-activation coefficients stay in registers).
template <typename A, Act ACT>
GNMX_ROW_INLINE void sums_impl(const A* x, const A* dy, int64_t R, int64_t C, int64_t ld, const A* mu,
                               const A* a, const A* b, A* s1, A* s2) {
  using Q = Vec32<A>;
  using V = typename Q::type;
  constexpr int64_t W = Q::kWidth, B = 2 * W;
  int64_t c0 = 0;
  if (ACT == Act::kNone) {
    for (; c0 + B <= C; c0 += B) {
      V t10 = {}, t11 = {}, t20 = {}, t21 = {};
      const V m0 = Q::load(mu + c0), m1 = Q::load(mu + c0 + W);
      for (int64_t r = 0; r < R; ++r) {
        const A* p = x + r * ld + c0;
        const A* q = dy + r * ld + c0;
        const V g0 = Q::load(q), g1 = Q::load(q + W);
        t10 += g0 * (Q::load(p) - m0);
        t11 += g1 * (Q::load(p + W) - m1);
        t20 += g0;
        t21 += g1;
      }
      Q::store(s1 + c0, Q::load(s1 + c0) + t10);
      Q::store(s1 + c0 + W, Q::load(s1 + c0 + W) + t11);
      Q::store(s2 + c0, Q::load(s2 + c0) + t20);
      Q::store(s2 + c0 + W, Q::load(s2 + c0 + W) + t21);
    }
  }
  for (int64_t r = 0; r < R && c0 < C; ++r) {
    const A* xr = x + r * ld;
    const A* gr = dy + r * ld;
#pragma omp simd
    for (int64_t c = c0; c < C; ++c) {
      const A g = ACT == Act::kNone ? gr[c] : gn_act_grad<ACT>(xr[c] * a[c] + b[c], gr[c]);
      s1[c] += g * (xr[c] - mu[c]);
      s2[c] += g;
    }
  }
}

template <typename A, Act ACT>
GNMX_ROW_INLINE void dx_impl(const A* x, const A* dy, A* dx, int64_t R, int64_t C, int64_t ld,
                             const A* mu,
                             const A* a, const A* b, const A* c1, const A* c2, const A* c3) {
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * ld;
    const A* gr = dy + r * ld;
    A* dr = dx + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const A g = ACT == Act::kNone ? gr[c] : gn_act_grad<ACT>(xr[c] * a[c] + b[c], gr[c]);
      dr[c] = c1[c] * g + c2[c] * (xr[c] - mu[c]) + c3[c];
    }
  }
}

template <typename A>
GNMX_ROW_INLINE void copy_impl(const A* src, A* dst, int64_t n) {
  __builtin_memcpy(dst, src, static_cast<size_t>(n) * sizeof(A));
}

#if defined(GNMX_CPU_X86)
__attribute__((target("avx2"), always_inline)) inline void stream8(float* p, const float* s) {
  _mm256_stream_ps(p, _mm256_loadu_ps(s));
}
__attribute__((target("avx2"), always_inline)) inline void stream8(double* p, const double* s) {
  _mm256_stream_pd(p, _mm256_loadu_pd(s));
}
// Streaming copy (the caller fences before others read dst).
template <typename A>
__attribute__((target("avx2"))) void stream_avx2(const A* src, A* dst, int64_t n) {
  constexpr int64_t W = 32 / static_cast<int64_t>(sizeof(A));
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0; ++i) dst[i] = src[i];
  for (; i + 4 * W <= n; i += 4 * W) {
    stream8(dst + i, src + i);
    stream8(dst + i + W, src + i + W);
    stream8(dst + i + 2 * W, src + i + 2 * W);
    stream8(dst + i + 3 * W, src + i + 3 * W);
  }
  for (; i + W <= n; i += W) stream8(dst + i, src + i);
  for (; i < n; ++i) dst[i] = src[i];
}
#endif

template <typename A>
struct RowPrims {
  void (*stream)(const A* src, A* dst, int64_t n);
  void (*col_sum)(const A* x, int64_t R, int64_t C, int64_t ld, A scale, A* out);
  void (*col_m2)(const A* x, int64_t R, int64_t C, int64_t ld, const A* mu, A* out);
  void (*chan_merge)(A* mean, A* m2, const A* cm, const A* cm2, int64_t C, A wb, A wab);
  // indexed by Act (kNone, kRelu, kSilu); x and y / dy and dx may be the same rows
  void (*affine[3])(const A* x, A* y, int64_t R, int64_t C, int64_t ld, const A* a, const A* b);
  void (*sums[3])(const A* x, const A* dy, int64_t R, int64_t C, int64_t ld, const A* mu,
                  const A* a, const A* b, A* s1, A* s2);
  void (*dx[3])(const A* x, const A* dy, A* dx, int64_t R, int64_t C, int64_t ld, const A* mu,
                const A* a, const A* b, const A* c1, const A* c2, const A* c3);
};

// One instantiation of the loops per ISA: ATTR is empty (baseline) or the AVX2 target attribute.
#define GNMX_ROW_PRIMS(NAME, ATTR)                                                                \
  template <typename A>                                                                          \
  struct NAME {                                                                                  \
    ATTR static void col_sum(const A* x, int64_t R, int64_t C, int64_t ld, A scale, A* out) {    \
      col_sum_impl<A>(x, R, C, ld, scale, out);                                                  \
    }                                                                                            \
    ATTR static void chan_merge(A* mean, A* m2, const A* cm, const A* cm2, int64_t C, A wb,      \
                                A wab) {                                                         \
      chan_merge_impl<A>(mean, m2, cm, cm2, C, wb, wab);                                         \
    }                                                                                            \
    ATTR static void col_m2(const A* x, int64_t R, int64_t C, int64_t ld, const A* mu, A* out) { \
      col_m2_impl<A>(x, R, C, ld, mu, out);                                                      \
    }                                                                                            \
    template <Act ACT>                                                                           \
    ATTR static void affine(const A* x, A* y, int64_t R, int64_t C, int64_t ld, const A* a,      \
                            const A* b) {                                                        \
      affine_impl<A, ACT>(x, y, R, C, ld, a, b);                                                 \
    }                                                                                            \
    template <Act ACT>                                                                           \
    ATTR static void sums(const A* x, const A* dy, int64_t R, int64_t C, int64_t ld,             \
                          const A* mu, const A* a, const A* b, A* s1, A* s2) {                   \
      sums_impl<A, ACT>(x, dy, R, C, ld, mu, a, b, s1, s2);                                      \
    }                                                                                            \
    template <Act ACT>                                                                           \
    ATTR static void dx(const A* x, const A* dy, A* d, int64_t R, int64_t C, int64_t ld,         \
                        const A* mu, const A* a, const A* b, const A* c1, const A* c2,           \
                        const A* c3) {                                                           \
      dx_impl<A, ACT>(x, dy, d, R, C, ld, mu, a, b, c1, c2, c3);                                 \
    }                                                                                            \
    ATTR static void stream(const A* src, A* dst, int64_t n) { copy_impl<A>(src, dst, n); }      \
    static RowPrims<A> table() {                                                                 \
      RowPrims<A> p{};                                                                           \
      p.stream = stream;                                                                         \
      p.col_sum = col_sum;                                                                       \
      p.col_m2 = col_m2;                                                                         \
      p.chan_merge = chan_merge;                                                                 \
      p.affine[0] = affine<Act::kNone>;                                                          \
      p.affine[1] = affine<Act::kRelu>;                                                          \
      p.affine[2] = affine<Act::kSilu>;                                                          \
      p.sums[0] = sums<Act::kNone>;                                                              \
      p.sums[1] = sums<Act::kRelu>;                                                              \
      p.sums[2] = sums<Act::kSilu>;                                                              \
      p.dx[0] = dx<Act::kNone>;                                                                  \
      p.dx[1] = dx<Act::kRelu>;                                                                  \
      p.dx[2] = dx<Act::kSilu>;                                                                  \
      return p;                                                                                  \
    }                                                                                            \
  };

GNMX_ROW_PRIMS(GenericRows, )
#if defined(GNMX_CPU_X86)
GNMX_ROW_PRIMS(Avx2Rows, __attribute__((target("avx2,fma,f16c"))))
#endif
#undef GNMX_ROW_PRIMS

template <typename A>
const RowPrims<A>& rows() {
#if defined(GNMX_CPU_X86)
  static const RowPrims<A> avx2 = [] {
    RowPrims<A> p = Avx2Rows<A>::table();
    p.stream = stream_avx2<A>;
    return p;
  }();
  static const RowPrims<A> generic = GenericRows<A>::table();
  return cpu_has_avx2() ? avx2 : generic;
#else
  static const RowPrims<A> generic = GenericRows<A>::table();
  return generic;
#endif
}

}  // namespace simd
}  // namespace gn_mx
