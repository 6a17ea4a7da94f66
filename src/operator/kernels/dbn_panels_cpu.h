/*
 * dbn_panels_cpu.h: the DBN CPU column panels: their geometry, the panel products (AVX2+FMA
 * kernels for float, BLAS otherwise) and gather / scatter between NCHW and panels. Hot inline
 * code, private to dbn_cpu.cc: internal linkage (an unnamed namespace), as before the split.
 */
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/acc_type.h"
#include "cpu_isa.h"
#include "dbn.h"
#include "dbn_blas_cpu.h"

namespace gn_mx {
namespace {
using namespace dbn_cpu;  // gemm / syrk_t

constexpr int64_t kPanelElems = 32768;  // D*K AccT values per panel (128 KiB in fp32)

// The shape plus its column panels: K columns per panel, nchunk panels per group.
struct PanelGeo : DbnShape {
  int64_t K, nchunk;
  int64_t ld;  // panel row stride: K rounded up + 16, so panel rows are not 4 KiB apart (aliasing)
};

PanelGeo make_geo(int64_t N, int64_t C, int64_t G, int64_t S) {
  PanelGeo q;
  static_cast<DbnShape&>(q) = dbn_shape(N, C, G, S);
  int64_t K = std::max<int64_t>(64, kPanelElems / std::max<int64_t>(q.D, 1));
  K = (K + 15) / 16 * 16;
  q.K = std::min(q.m, K);
  q.nchunk = (q.m + q.K - 1) / q.K;
  q.ld = (q.K + 15) / 16 * 16 + 16;
  return q;
}

// ---- Panel products ---------------------------------------------------------------------------
// Row-major panels with row stride `ld`:
//   panel_apply: Q (Dout x kc) = M (Dout x Din, contiguous) * P (Din x kc)
//   panel_gram:  C (D x D, row-major) = X (D x kc) Y^T (D x kc); with sym (X == Y) only the upper
//                triangle in column-major order (= lower row-major) is guaranteed.
// float uses AVX2+FMA kernels when the CPU has them (OpenBLAS packs these thin operands at a loss:
// measured 2-3x slower for D = 16..32, 1.2x at 64); double, other CPUs and GNMX_CPU_ISA=generic
// use BLAS.
#if defined(GNMX_CPU_X86)

// The same for one 8-column vector (column tails), R <= 6.
template <int R>
__attribute__((target("avx2,fma"), always_inline)) inline void apply_tile8(
    const float* M, int Din, const float* P, int64_t ld, float* Q, int64_t ldq) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const float* p = P;
  for (int k = 0; k < Din; ++k, p += ld) {
    const __m256 p0 = _mm256_loadu_ps(p);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(M + r * Din + k), p0, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(Q + r * ldq, acc[r]);
}

// Where column c of an apply's output goes: a panel (base + c, row stride rs) or, with S > 0, the
// NCHW tensor itself ("direct": no scatter pass): column j = j0 + c of the group is element
// (n, row, s) = (j / S, row, j % S), i.e. base + n * CS + s with base = y + g*D*S, rs = S,
// CS = C*S. Tiles of 8 / 16 columns stay inside one sample when S and j0 are multiples of 16.
struct OutCols {
  float* base;
  int64_t rs;
  int64_t S = 0, CS = 0, j0 = 0;
  float* at(int64_t c) const {
    if (S == 0) return base + c;
    const int64_t j = j0 + c;
    return base + (j / S) * CS + j % S;
  }
  OutCols rows(int64_t i) const { OutCols o = *this; o.base += i * rs; return o; }
  OutCols cols(int64_t c0) const {
    OutCols o = *this;
    if (S == 0) o.base += c0; else o.j0 += c0;
    return o;
  }
};

template <int R>
__attribute__((target("avx2,fma"))) void apply_rows_avx2(const float* M, int Din, const float* P,
                                                         int64_t ld, int kc, const OutCols& oc) {
  int c = 0;
  for (; c + 16 <= kc; c += 16) avx2_tile2<float, R>(M, Din, P + c, ld, oc.at(c), oc.rs, Din);
  for (; c + 8 <= kc; c += 8) apply_tile8<R>(M, Din, P + c, ld, oc.at(c), oc.rs);
  for (; c < kc; ++c) {
    float* q = oc.at(c);
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int k = 0; k < Din; ++k) s += M[r * Din + k] * P[k * ld + c];
      q[r * oc.rs] = s;
    }
  }
}

// Q (Dout x kc) = M (Dout x Din) P (Din x kc): blocks of 6 rows of Q, then the remaining 1-5.
void apply_f32_avx2(const float* M, int Dout, int Din, const float* P, int64_t ld, int kc,
                    const OutCols& oc) {
  int i = 0;
  for (; i + 6 <= Dout; i += 6)
    apply_rows_avx2<6>(M + static_cast<int64_t>(i) * Din, Din, P, ld, kc, oc.rows(i));
  const float* m = M + static_cast<int64_t>(i) * Din;
  const OutCols q = oc.rows(i);
  with_tail_rows(Dout - i, [&](auto r) { apply_rows_avx2<decltype(r)::value>(m, Din, P, ld, kc, q); });
}


// C = X Y^T by dot products along the contiguous k axis, 4 rows of X x 3 rows of Y per block
// (12 accumulators; per 8 columns 7 loads feed 12 FMAs). sym (X == Y): only blocks with j >= i
// are computed, each written to both (i, j) and (j, i).
__attribute__((target("avx2,fma"))) void gram_f32_avx2(const float* X, const float* Y,
                                                       int64_t ld, int D, int kc, float* C,
                                                       bool sym) {
  const int kv = kc / 8 * 8;
  for (int i = 0; i < D; i += 4) {
    const int ni = std::min(4, D - i);
    const float* a[4];
    for (int r = 0; r < 4; ++r) a[r] = X + (i + std::min(r, ni - 1)) * ld;
    for (int j = sym ? i : 0; j < D; j += 3) {
      const int nj = std::min(3, D - j);
      const float* b0 = Y + j * ld;
      const float* b1 = Y + (j + std::min(1, nj - 1)) * ld;
      const float* b2 = Y + (j + std::min(2, nj - 1)) * ld;
      __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
      __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
      for (int k = 0; k < kv; k += 8) {
        const __m256 y0 = _mm256_loadu_ps(b0 + k), y1 = _mm256_loadu_ps(b1 + k),
                     y2 = _mm256_loadu_ps(b2 + k);
        __m256 x = _mm256_loadu_ps(a[0] + k);
        c00 = _mm256_fmadd_ps(x, y0, c00);
        c01 = _mm256_fmadd_ps(x, y1, c01);
        c02 = _mm256_fmadd_ps(x, y2, c02);
        x = _mm256_loadu_ps(a[1] + k);
        c10 = _mm256_fmadd_ps(x, y0, c10);
        c11 = _mm256_fmadd_ps(x, y1, c11);
        c12 = _mm256_fmadd_ps(x, y2, c12);
        x = _mm256_loadu_ps(a[2] + k);
        c20 = _mm256_fmadd_ps(x, y0, c20);
        c21 = _mm256_fmadd_ps(x, y1, c21);
        c22 = _mm256_fmadd_ps(x, y2, c22);
        x = _mm256_loadu_ps(a[3] + k);
        c30 = _mm256_fmadd_ps(x, y0, c30);
        c31 = _mm256_fmadd_ps(x, y1, c31);
        c32 = _mm256_fmadd_ps(x, y2, c32);
      }
      float s[3][4];  // s[u][r] = row i+r of X . row j+u of Y
      _mm_storeu_ps(s[0], hsum4(c00, c10, c20, c30));
      _mm_storeu_ps(s[1], hsum4(c01, c11, c21, c31));
      _mm_storeu_ps(s[2], hsum4(c02, c12, c22, c32));
      const float* b[3] = {b0, b1, b2};
      for (int r = 0; r < ni; ++r)
        for (int u = 0; u < nj; ++u) {
          float v = s[u][r];
          for (int k = kv; k < kc; ++k) v += a[r][k] * b[u][k];
          C[(i + r) * D + j + u] = v;
          if (sym) C[(j + u) * D + i + r] = v;
        }
    }
  }
}

#endif

inline void panel_apply(const double* M, int Dout, int Din, const double* P, int64_t ld, int kc,
                        double* Q) {
  const int ldi = static_cast<int>(ld);
  gemm('N', 'N', kc, Dout, Din, 1.0, P, ldi, M, Din, 0.0, Q, ldi);
}
inline void panel_apply(const float* M, int Dout, int Din, const float* P, int64_t ld, int kc,
                        float* Q) {
#if defined(GNMX_CPU_X86)
  if (cpu_has_avx2()) return apply_f32_avx2(M, Dout, Din, P, ld, kc, OutCols{Q, ld});
#endif
  const int ldi = static_cast<int>(ld);
  gemm('N', 'N', kc, Dout, Din, 1.f, P, ldi, M, Din, 0.f, Q, ldi);
}

// BLAS: column-major C_cm = Y_cm^T X_cm, i.e. row-major C = X Y^T; sym uses syrk.
template <typename A>
void panel_gram_blas(const A* X, const A* Y, int64_t ld, int D, int kc, A* C, bool sym) {
  const int ldi = static_cast<int>(ld);
  if (sym) syrk_t(D, kc, X, ldi, C);
  else gemm('T', 'N', D, D, kc, A(1), Y, ldi, X, ldi, A(0), C, D);
}
inline void panel_gram(const double* X, const double* Y, int64_t ld, int D, int kc, double* C,
                       bool sym) {
  panel_gram_blas(X, Y, ld, D, kc, C, sym);
}
inline void panel_gram(const float* X, const float* Y, int64_t ld, int D, int kc, float* C,
                       bool sym) {
#if defined(GNMX_CPU_X86)
  if (cpu_has_avx2()) return gram_f32_avx2(X, Y, ld, D, kc, C, sym);
#endif
  panel_gram_blas(X, Y, ld, D, kc, C, sym);
}

// Q = M P for chunk (g, j0, kc), written into y: straight from the kernel's registers for float
// data with AVX2 when S % 16 == 0 (K is a multiple of 16, so are j0 and kc: no tile crosses a
// sample), else into the panel `out` and scattered (narrowing to T). Measured on a Zen 4: the
// scatter pass was 15-20% of each apply pass.
template <typename T, typename A>
void apply_out(const A* M, int Dout, int Din, const A* P, int64_t ld, int kc, A* out,
               const PanelGeo& q, int64_t g, int64_t j0, T* y) {
#if defined(GNMX_CPU_X86)
  if constexpr (std::is_same<T, float>::value) {
    if (cpu_has_avx2() && q.S % 16 == 0)
      return apply_f32_avx2(M, Dout, Din, P, ld, kc,
                            OutCols{y + g * q.D * q.S, q.S, q.S, q.C * q.S, j0});
  }
#endif
  panel_apply(M, Dout, Din, P, ld, kc, out);
  scatter(out, ld, q, g, j0, kc, y);
}

// ---- Panel gather / scatter -------------------------------------------------------------------
// Columns j0 .. j0+kc of group g split into runs inside one sample n: f(off, k, run) for each,
// where panel columns k .. k+run come from tensor elements off + d*S + r (channel g*D + d).
template <typename F>
__attribute__((always_inline)) inline void for_each_run(const PanelGeo& q, int64_t g, int64_t j0, int64_t kc, F&& f) {
  int64_t j = j0, k = 0;
  while (k < kc) {
    const int64_t n = j / q.S, s = j % q.S;
    const int64_t run = std::min(q.S - s, kc - k);
    f((n * q.C + g * q.D) * q.S + s, k, run);
    k += run;
    j += run;
  }
}

// P[d*ldp + k] = x[n, g*D + d, s] - shift[d] for the kc columns starting at j0 (j = n*S + s).
template <typename T, typename A>
void gather(const T* x, const PanelGeo& q, int64_t g, int64_t j0, int64_t kc, const A* shift, A* P,
            int64_t ldp) {
  const int64_t D = q.D, S = q.S;
  for_each_run(q, g, j0, kc, [&](int64_t off, int64_t k, int64_t run) __attribute__((always_inline)) {
    for (int64_t d = 0; d < D; ++d) {
      const T* src = x + off + d * S;
      A* dst = P + d * ldp + k;
      const A sh = shift ? shift[d] : A(0);
      for (int64_t r = 0; r < run; ++r) dst[r] = to_acc(src[r]) - sh;
    }
  });
}

// gather without shift that also returns the row sums of the panel: sum[d] = sum_k P[d*ldp + k]
// (saves a pass over the panel where the caller needs them).
template <typename T, typename A>
void gather_sum(const T* x, const PanelGeo& q, int64_t g, int64_t j0, int64_t kc, A* P, int64_t ldp,
                A* sum) {
  const int64_t D = q.D, S = q.S;
  for (int64_t d = 0; d < D; ++d) sum[d] = A(0);
  for_each_run(q, g, j0, kc, [&](int64_t off, int64_t k, int64_t run) __attribute__((always_inline)) {
    for (int64_t d = 0; d < D; ++d) {
      const T* src = x + off + d * S;
      A* dst = P + d * ldp + k;
      A acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t r = 0; r < run; ++r) {
        const A v = to_acc(src[r]);
        dst[r] = v;
        acc += v;
      }
      sum[d] += acc;
    }
  });
}

template <typename T, typename A>
void scatter(const A* P, int64_t ldp, const PanelGeo& q, int64_t g, int64_t j0, int64_t kc, T* y) {
  const int64_t D = q.D, S = q.S;
  for_each_run(q, g, j0, kc, [&](int64_t off, int64_t k, int64_t run) __attribute__((always_inline)) {
    for (int64_t d = 0; d < D; ++d) {
      T* dst = y + off + d * S;
      const A* src = P + d * ldp + k;
      for (int64_t r = 0; r < run; ++r) dst[r] = from_acc<T>(src[r]);
    }
  });
}

}  // namespace
}  // namespace gn_mx
