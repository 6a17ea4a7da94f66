/*
 * dbn_sync_data_cpu.cc: synchronized DBN's passes over the data on the host (contract and math:
 * dbn_sync.h): the local sums, the local covariance about the global mean, and the apply step,
 * each with its backward. Per group the device's columns are gathered once into a float64 panel
 * (D rows x M = N*S columns, centred where the step needs it) and the products run on it as
 * row-major gemms: dbn_small_cpu.h's dmm_nn (AVX2 / AVX-512 tiles) where the CPU has AVX2, else
 * BLAS (dbn_blas_cpu.h; MXNet's OpenBLAS runs its SSE3 "Prescott" kernels on CPUs newer than it
 * knows, ~3x slower here);
 * groups run in parallel when the data is large enough.
 */
#include <algorithm>
#include <vector>

#include "cpu_isa.h"
#include "dbn_blas_cpu.h"
#include "dbn_small_cpu.h"
#include "dbn_sync.h"
#include "dispatch_cpu.h"

namespace gn_mx {
namespace {

// Row-major C (rows x cols) = A (rows x K) B (K x cols): DBN's register-tiled dmm_nn (AVX2 or
// AVX-512 tiles) where the CPU has AVX2, else BLAS, which sees the column-major transposes:
// C^T = B^T A^T.
void gemm_rm(const double* A, int64_t lda, const double* B, int64_t ldb, double* C, int64_t ldc,
             int64_t rows, int64_t cols, int64_t K) {
#if defined(GNMX_CPU_X86)
  if (cpu_has_avx2())
    return dbn_small::dmm_nn(A, static_cast<int>(lda), B, static_cast<int>(ldb), C,
                             static_cast<int>(ldc), static_cast<int>(rows),
                             static_cast<int>(cols), static_cast<int>(K));
#endif
  dbn_cpu::gemm('N', 'N', static_cast<int>(cols), static_cast<int>(rows), static_cast<int>(K),
                1.0, B, static_cast<int>(ldb), A, static_cast<int>(lda), 0.0, C,
                static_cast<int>(ldc));
}

// A group's columns as a float64 panel: P[i * M + n * S + s] = x[n, g D + i, s] - mu[i] (mu may
// be null: not centred). Column-major this is the M x D matrix P^T with leading dimension M.
struct Panel {
  int64_t N, C, D, S, M;
  Panel(const GroupDims& d) : N(d.N), C(d.C), D(d.D), S(d.S), M(d.N * d.S) {}
  int64_t offset(int64_t n, int64_t g, int64_t i) const { return (n * C + g * D + i) * S; }
};

// Element loads / stores of the data dtype through float64 (as dbn_load_stat / dbn_store_stat,
// typed so that the row loops vectorize).
template <typename T>
inline double load(const T* p, int64_t i) { return static_cast<double>(to_acc(p[i])); }
template <typename T>
inline void store(T* p, int64_t i, double v) { p[i] = from_acc<T>(static_cast<AccT<T>>(v)); }

template <typename T>
void gather_t(const Panel& q, const T* x, int64_t g, const double* mu, double* P) {
  for (int64_t i = 0; i < q.D; ++i) {
    const double m = mu ? mu[i] : 0.0;
    for (int64_t n = 0; n < q.N; ++n) {
      const T* src = x + q.offset(n, g, i);
      double* dst = P + i * q.M + n * q.S;
      for (int64_t s = 0; s < q.S; ++s) dst[s] = load(src, s) - m;
    }
  }
}

void gather(const Panel& q, DType t, const void* x, int64_t g, const double* mu, double* P) {
  cpu::dispatch_data(t, [&](auto tag) {
    gather_t(q, static_cast<const decltype(tag)*>(x), g, mu, P);
  });
}

// out[n, g D + i, s] = scale_i P[i, n S + s] + shift_i (scale / shift null: 1 / 0), in dtype t.
void scatter(const Panel& q, DType t, const double* P, int64_t g, const double* scale,
             const double* shift, void* out) {
  cpu::dispatch_data(t, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t i = 0; i < q.D; ++i) {
      const double a = scale ? scale[i] : 1.0, b = shift ? shift[i] : 0.0;
      for (int64_t n = 0; n < q.N; ++n) {
        T* dst = static_cast<T*>(out) + q.offset(n, g, i);
        const double* src = P + i * q.M + n * q.S;
        for (int64_t s = 0; s < q.S; ++s) store(dst, s, a * src[s] + b);
      }
    }
  });
}

// Sum of p[0, n) in float64 (four partial sums: not one add latency per element).
template <typename T>
double sum_row(const T* p, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t k = 0;
  for (; k + 4 <= n; k += 4)
    for (int u = 0; u < 4; ++u) s[u] += load(p, k + u);
  for (; k < n; ++k) s[0] += load(p, k);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Row sums of a D x M panel into r (D).
void row_sums(const Panel& q, const double* P, double* r) {
  for (int64_t i = 0; i < q.D; ++i) {
    r[i] = sum_row(P + i * q.M, q.M);
  }
}

// Row-major D x M panels: Out = A P (A: D x D row-major).
void left_mul(const Panel& q, const double* A, const double* P, double* Out) {
  gemm_rm(A, q.D, P, q.M, Out, q.M, q.D, q.M, q.D);
}

// Row-major D x D: Out = P Q^T / div (P, Q: D x M panels), by blocks of kOuterCols columns (both
// blocks stay in L2): T = the block of Q transposed (scratch of kOuterCols x D), Acc = P_b T.
constexpr int64_t kOuterCols = 256;
void outer(const Panel& q, const double* P, const double* Q, double div, double* T, double* Out) {
  const int64_t D = q.D, DD = D * D;
  std::vector<double> acc(DD);
  std::fill(Out, Out + DD, 0.0);
  for (int64_t c0 = 0; c0 < q.M; c0 += kOuterCols) {
    const int64_t kc = std::min(kOuterCols, q.M - c0);
    for (int64_t i = 0; i < D; ++i)
      for (int64_t c = 0; c < kc; ++c) T[c * D + i] = Q[i * q.M + c0 + c];
    gemm_rm(P + c0, q.M, T, D, acc.data(), D, D, D, kc);
    for (int64_t e = 0; e < DD; ++e) Out[e] += acc[e];
  }
  for (int64_t e = 0; e < DD; ++e) Out[e] /= div;
}

// The transpose of a D x D row-major matrix.
std::vector<double> transposed(const double* A, int64_t D) {
  std::vector<double> t(D * D);
  for (int64_t i = 0; i < D; ++i)
    for (int64_t j = 0; j < D; ++j) t[j * D + i] = A[i * D + j];
  return t;
}

// Runs body(g, scratch) for every group, in parallel when the data is large; scratch holds
// `panels` D x M panels per thread.
template <typename Body>
void for_groups(const GroupDims& d, int panels, Body&& body) {
  const int64_t per = d.D * d.N * d.S;
#pragma omp parallel if (d.G > 1 && d.N * d.C * d.S > 65536)
  {
    std::vector<double> scratch(static_cast<size_t>(panels * per));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < d.G; ++g) body(g, scratch.data());
  }
}

// gamma / beta of group g as float64 (D each).
void group_params(const DbnApplyArgs& a, const void* p, int64_t g, double* out) {
  for (int64_t i = 0; i < a.dims.D; ++i) out[i] = dbn_load_stat(a.param_dtype, p, g * a.dims.D + i);
}

}  // namespace

// ---- local sums ---------------------------------------------------------------------------------
const char* dbn_local_sums_cpu(const DbnLocalArgs& a) {
  const GroupDims& d = a.dims;
  std::fill(a.tot, a.tot + d.G * (d.D + 1), 0.0);
  cpu::dispatch_data(a.dtype, [&](auto tag) {
    const auto* x = static_cast<const decltype(tag)*>(a.x);
    for (int64_t n = 0; n < d.N; ++n)
      for (int64_t c = 0; c < d.C; ++c)
        a.tot[(c / d.D) * (d.D + 1) + c % d.D] += sum_row(x + (n * d.C + c) * d.S, d.S);
  });
  for (int64_t g = 0; g < d.G; ++g) a.tot[g * (d.D + 1) + d.D] = static_cast<double>(d.N * d.S);
  return nullptr;
}

const char* dbn_local_sums_bwd_cpu(const DbnLocalArgs& a) {
  const GroupDims& d = a.dims;
  cpu::dispatch_data(a.dtype, [&](auto tag) {
    auto* dx = static_cast<decltype(tag)*>(a.dx);
    for (int64_t n = 0; n < d.N; ++n)
      for (int64_t c = 0; c < d.C; ++c) {
        const double v = a.dtot[(c / d.D) * (d.D + 1) + c % d.D];
        for (int64_t s = 0; s < d.S; ++s) store(dx + (n * d.C + c) * d.S, s, v);
      }
  });
  return nullptr;
}

// ---- local covariance about the global mean ----------------------------------------------------
const char* dbn_local_cov_cpu(const DbnLocalArgs& a) {
  const GroupDims& d = a.dims;
  const Panel q(d);
  for (int64_t g = 0; g < d.G; ++g) {
    const double* t = a.tot + g * (d.D + 1);
    for (int64_t i = 0; i < d.D; ++i) a.mean[g * d.D + i] = t[i] / t[d.D];
  }
  for_groups(d, 2, [&](int64_t g, double* P) {
    gather(q, a.dtype, a.x, g, a.mean + g * d.D, P);
    outer(q, P, P, a.tot[g * (d.D + 1) + d.D], P + d.D * q.M, a.cov + g * d.D * d.D);
  });
  return nullptr;
}

// B = (dcov + dcov^T) / m; dx = B (x - mu); dmu_total = dmu - B r (r: the local column sums of
// x - mu); dtot[i < D] = dmu_total_i / m; dtot[D] = -(dmu_total . mu + dcov : cov) / m.
const char* dbn_local_cov_bwd_cpu(const DbnLocalArgs& a) {
  const GroupDims& d = a.dims;
  const Panel q(d);
  const int64_t DD = d.D * d.D;
  for_groups(d, 2, [&](int64_t g, double* P) {
    const double* t = a.tot + g * (d.D + 1);
    const double m = t[d.D];
    const double *mu = a.mean + g * d.D, *dc = a.dcov + g * DD, *cv = a.cov + g * DD;
    std::vector<double> B(DD), r(d.D);
    for (int64_t i = 0; i < d.D; ++i)
      for (int64_t j = 0; j < d.D; ++j) B[i * d.D + j] = (dc[i * d.D + j] + dc[j * d.D + i]) / m;
    gather(q, a.dtype, a.x, g, mu, P);
    row_sums(q, P, r.data());
    left_mul(q, B.data(), P, P + d.D * q.M);
    scatter(q, a.dtype, P + d.D * q.M, g, nullptr, nullptr, a.dx);
    double* dt = a.dtot + g * (d.D + 1);
    double dm = 0.0;
    for (int64_t i = 0; i < d.D; ++i) {
      double v = a.dmean ? a.dmean[g * d.D + i] : 0.0;
      for (int64_t j = 0; j < d.D; ++j) v -= B[i * d.D + j] * r[j];
      dt[i] = v / m;
      dm -= v * mu[i];
    }
    for (int64_t e = 0; e < DD; ++e) dm -= dc[e] * cv[e];
    dt[d.D] = dm / m;
  });
  return nullptr;
}

// ---- apply --------------------------------------------------------------------------------------
const char* dbn_apply_cpu(const DbnApplyArgs& a) {
  const GroupDims& d = a.dims;
  const Panel q(d);
  for_groups(d, 2, [&](int64_t g, double* P) {
    std::vector<double> gb(2 * d.D);
    group_params(a, a.gamma, g, gb.data());
    group_params(a, a.beta, g, gb.data() + d.D);
    gather(q, a.dtype, a.x, g, a.mean + g * d.D, P);
    left_mul(q, a.W + g * d.D * d.D, P, P + d.D * q.M);
    scatter(q, a.dtype, P + d.D * q.M, g, gb.data(), gb.data() + d.D, a.y);
  });
  return nullptr;
}

// A = gamma dy (panel), Y = W xc: dx = W^T A, dW = A xc^T, dmean = -row sums of dx,
// dgamma_i = sum dy_i Y_i, dbeta_i = sum dy_i.
const char* dbn_apply_bwd_cpu(const DbnApplyArgs& a) {
  const GroupDims& d = a.dims;
  const Panel q(d);
  const int64_t DM = d.D * q.M;
  for_groups(d, 3, [&](int64_t g, double* P) {
    double *Xc = P, *Dy = P + DM, *Tmp = P + 2 * DM;
    const double* W = a.W + g * d.D * d.D;
    std::vector<double> gam(d.D), r(d.D);
    group_params(a, a.gamma, g, gam.data());
    gather(q, a.dtype, a.x, g, a.mean + g * d.D, Xc);
    gather(q, a.dtype, a.dy, g, nullptr, Dy);
    left_mul(q, W, Xc, Tmp);  // Y
    for (int64_t i = 0; i < d.D; ++i) {
      double sdy = 0.0, sdyx = 0.0;
      double* dyr = Dy + i * q.M;
      const double* yr = Tmp + i * q.M;
      for (int64_t c = 0; c < q.M; ++c) {
        sdy += dyr[c];
        sdyx += dyr[c] * yr[c];
        dyr[c] *= gam[i];  // A
      }
      dbn_store_stat(a.param_dtype, a.dgamma, g * d.D + i, sdyx);
      dbn_store_stat(a.param_dtype, a.dbeta, g * d.D + i, sdy);
    }
    outer(q, Dy, Xc, 1.0, Tmp, a.dW + g * d.D * d.D);
    left_mul(q, transposed(W, d.D).data(), Dy, Tmp);  // dx
    scatter(q, a.dtype, Tmp, g, nullptr, nullptr, a.dx);
    row_sums(q, Tmp, r.data());
    for (int64_t i = 0; i < d.D; ++i) a.dmean[g * d.D + i] = -r[i];
  });
  return nullptr;
}

}  // namespace gn_mx
