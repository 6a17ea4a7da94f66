/*
 * simd_rows_cpu.h: the inner loops of the channels-last CPU kernels, with simd_cpu.h's runtime ISA
 * dispatch.
 *
 * Channels-last data (N, S, C) is read as rows of C contiguous channels, one row per position. A
 * group is D channels of every row, so nothing runs along a group; the loops run along a row instead,
 * with one coefficient per channel (a group's value repeated over its D channels): every loop is
 * "for each of R rows, for each channel c" over AccT rows (fp16 data is widened by simd_cpu.h's
 * load/store first), vectorized over c. The arithmetic is group_norm_math.h's, the formulas of the
 * channels-first primitives with per-channel instead of per-group scalars:
 *   col_sum:  out[c] = sum_r x[r, c]
 *   col_m2:   out[c] = sum_r (x[r, c] - mu[c])^2
 *   affine:   y = act(x * a[c] + b[c])
 *   sums:     g = act'(x * a[c] + b[c]) dy;  s1[c] += sum_r g (x - mu[c]),  s2[c] += sum_r g
 *   dx:       dx = c1[c] g + c2[c] (x - mu[c]) + c3[c]
 * Each exists as one always-inlined template, compiled twice: for the baseline ISA and, on x86-64,
 * inside target("avx2,fma,f16c") functions (the compiler vectorizes the same loop 8 floats wide).
 * rows<A>() picks the table once (GNMX_CPU_ISA=generic forces the baseline, as for simd_cpu.h).
 */
#pragma once
#include <cstdint>

#include "../common/acc_type.h"
#include "cpu_isa.h"
#include "group_norm_math.h"

namespace gn_mx {
namespace simd {

#define GNMX_ROW_INLINE __attribute__((always_inline)) inline

template <typename A>
GNMX_ROW_INLINE void col_sum_impl(const A* x, int64_t R, int64_t C, A* out) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) out[c] = x[c];
  for (int64_t r = 1; r < R; ++r) {
    const A* xr = x + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[c] += xr[c];
  }
}

template <typename A>
GNMX_ROW_INLINE void col_m2_impl(const A* x, int64_t R, int64_t C, const A* mu, A* out) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) {
    const A d = x[c] - mu[c];
    out[c] = d * d;
  }
  for (int64_t r = 1; r < R; ++r) {
    const A* xr = x + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const A d = xr[c] - mu[c];
      out[c] += d * d;
    }
  }
}

template <typename A, Act ACT>
GNMX_ROW_INLINE void affine_impl(const A* x, A* y, int64_t R, int64_t C, const A* a, const A* b) {
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * C;
    A* yr = y + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) yr[c] = gn_act<ACT>(xr[c] * a[c] + b[c]);
  }
}

template <typename A, Act ACT>
GNMX_ROW_INLINE void sums_impl(const A* x, const A* dy, int64_t R, int64_t C, const A* mu,
                               const A* a, const A* b, A* s1, A* s2) {
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * C;
    const A* gr = dy + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const A g = ACT == Act::kNone ? gr[c] : gn_act_grad<ACT>(xr[c] * a[c] + b[c], gr[c]);
      s1[c] += g * (xr[c] - mu[c]);
      s2[c] += g;
    }
  }
}

template <typename A, Act ACT>
GNMX_ROW_INLINE void dx_impl(const A* x, const A* dy, A* dx, int64_t R, int64_t C, const A* mu,
                             const A* a, const A* b, const A* c1, const A* c2, const A* c3) {
  for (int64_t r = 0; r < R; ++r) {
    const A* xr = x + r * C;
    const A* gr = dy + r * C;
    A* dr = dx + r * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      const A g = ACT == Act::kNone ? gr[c] : gn_act_grad<ACT>(xr[c] * a[c] + b[c], gr[c]);
      dr[c] = c1[c] * g + c2[c] * (xr[c] - mu[c]) + c3[c];
    }
  }
}

template <typename A>
struct RowPrims {
  void (*col_sum)(const A* x, int64_t R, int64_t C, A* out);
  void (*col_m2)(const A* x, int64_t R, int64_t C, const A* mu, A* out);
  // indexed by Act (kNone, kRelu, kSilu); x and y / dy and dx may be the same rows
  void (*affine[3])(const A* x, A* y, int64_t R, int64_t C, const A* a, const A* b);
  void (*sums[3])(const A* x, const A* dy, int64_t R, int64_t C, const A* mu, const A* a,
                  const A* b, A* s1, A* s2);
  void (*dx[3])(const A* x, const A* dy, A* dx, int64_t R, int64_t C, const A* mu, const A* a,
                const A* b, const A* c1, const A* c2, const A* c3);
};

// One instantiation of the loops per ISA: ATTR is empty (baseline) or the AVX2 target attribute.
#define GNMX_ROW_PRIMS(NAME, ATTR)                                                                \
  template <typename A>                                                                          \
  struct NAME {                                                                                  \
    ATTR static void col_sum(const A* x, int64_t R, int64_t C, A* out) {                         \
      col_sum_impl<A>(x, R, C, out);                                                             \
    }                                                                                            \
    ATTR static void col_m2(const A* x, int64_t R, int64_t C, const A* mu, A* out) {             \
      col_m2_impl<A>(x, R, C, mu, out);                                                          \
    }                                                                                            \
    template <Act ACT>                                                                           \
    ATTR static void affine(const A* x, A* y, int64_t R, int64_t C, const A* a, const A* b) {    \
      affine_impl<A, ACT>(x, y, R, C, a, b);                                                     \
    }                                                                                            \
    template <Act ACT>                                                                           \
    ATTR static void sums(const A* x, const A* dy, int64_t R, int64_t C, const A* mu,            \
                          const A* a, const A* b, A* s1, A* s2) {                                \
      sums_impl<A, ACT>(x, dy, R, C, mu, a, b, s1, s2);                                          \
    }                                                                                            \
    template <Act ACT>                                                                           \
    ATTR static void dx(const A* x, const A* dy, A* d, int64_t R, int64_t C, const A* mu,        \
                        const A* a, const A* b, const A* c1, const A* c2, const A* c3) {         \
      dx_impl<A, ACT>(x, dy, d, R, C, mu, a, b, c1, c2, c3);                                     \
    }                                                                                            \
    static RowPrims<A> table() {                                                                 \
      RowPrims<A> p{};                                                                           \
      p.col_sum = col_sum;                                                                       \
      p.col_m2 = col_m2;                                                                         \
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
  static const RowPrims<A> avx2 = Avx2Rows<A>::table();
  static const RowPrims<A> generic = GenericRows<A>::table();
  return cpu_has_avx2() ? avx2 : generic;
#else
  static const RowPrims<A> generic = GenericRows<A>::table();
  return generic;
#endif
}

}  // namespace simd
}  // namespace gn_mx
