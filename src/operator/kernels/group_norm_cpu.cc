/*
 * group_norm_cpu.cc: CPU kernels for gn_moments and gn_group_norm (forward and backward).
 *
 * A group of sample n is the contiguous block x[(n*C + g*D)*S ...] of M = D*S elements, so the
 * (N*G) groups are independent and OpenMP splits them across threads.
 *
 * Statistics: each group is read in chunks of kChunk elements (L1-resident); a chunk's moments are
 * computed exactly around the chunk's own mean (two passes over cached data) and merged with Chan's
 * update (welford.h). One read of x from memory, no E[x^2]-E[x]^2 cancellation.
 *
 * Forward:  y = x * a_c + b_c with a_c = rstd * gamma_c, b_c = beta_c - a_c * mean.  (2 reads of x.)
 *
 * Backward, per group (m = D*S, xhat = (x - mean) * rstd, y = gamma_c * xhat + beta_c):
 *   dgamma_c = sum_n sum_s dy * xhat            dbeta_c = sum_n sum_s dy
 *   dx = rstd * (gamma_c dy - 1/m sum_{c',s} gamma_c' dy - xhat/m sum_{c',s} gamma_c' dy xhat)
 * With per-(n,c) sums dsc = sum_s dy (x - mean) and db = sum_s dy, and per group
 * A = sum_c gamma_c dsc, B = sum_c gamma_c db:
 *   dx = (rstd gamma_c) dy + c2 (x - mean) + c3,  c2 = -A rstd^3 / m,  c3 = -B rstd / m.
 * The mean/rstd outputs are differentiable too: d mean/dx = 1/m, d rstd/dx = -rstd^3 (x - mean)/m,
 * so their incoming gradients only add to c3 and c2.
 * Centring the products at the mean (dsc instead of sum dy x) avoids cancellation when |mean| >> std.
 */
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "group_norm.h"
#include "../common/welford.h"

namespace gn_mx {
namespace {

constexpr int64_t kChunk = 2048;

template <typename T>
Welford<AccT<T>> group_moments(const T* x, int64_t m) {
  using A = AccT<T>;
  Welford<A> w;
  for (int64_t off = 0; off < m; off += kChunk) {
    const int64_t len = std::min(kChunk, m - off);
    const T* p = x + off;
    A sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) sum += to_acc(p[i]);
    const A cm = sum / static_cast<A>(len);
    A m2 = 0;
#pragma omp simd reduction(+ : m2)
    for (int64_t i = 0; i < len; ++i) {
      const A d = to_acc(p[i]) - cm;
      m2 += d * d;
    }
    w.merge(make_welford<A>(static_cast<A>(len), cm, m2));
  }
  return w;
}

template <typename T>
void moments_impl(const MomentsArgs& a) {
  using A = AccT<T>;
  const T* x = static_cast<const T*>(a.x);
  A* mean = static_cast<A*>(a.mean);
  A* var = static_cast<A*>(a.var);
  const int64_t NG = a.N * a.G, M = (a.C / a.G) * a.S;
#pragma omp parallel for schedule(static)
  for (int64_t ng = 0; ng < NG; ++ng) {
    const Welford<A> w = group_moments(x + ng * M, M);
    mean[ng] = w.mean;
    var[ng] = w.var();
  }
}

template <typename T>
void moments_bwd_impl(const MomentsBwdArgs& a) {
  using A = AccT<T>;
  const T* x = static_cast<const T*>(a.x);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  const A* mean = static_cast<const A*>(a.mean);
  T* dx = static_cast<T*>(a.dx);
  const int64_t NG = a.N * a.G, M = (a.C / a.G) * a.S;
  const A inv_m = A(1) / static_cast<A>(M);
#pragma omp parallel for schedule(static)
  for (int64_t ng = 0; ng < NG; ++ng) {
    const A c0 = dmean[ng] * inv_m, c1 = 2 * dvar[ng] * inv_m, mu = mean[ng];
    const T* xp = x + ng * M;
    T* dxp = dx + ng * M;
#pragma omp simd
    for (int64_t i = 0; i < M; ++i) dxp[i] = from_acc<T>(c0 + c1 * (to_acc(xp[i]) - mu));
  }
}

template <typename T, typename P>
void fwd_impl(const GroupNormFwdArgs& a) {
  using A = AccT<T>;
  const T* x = static_cast<const T*>(a.x);
  const P* gamma = static_cast<const P*>(a.gamma);
  const P* beta = static_cast<const P*>(a.beta);
  T* y = static_cast<T*>(a.y);
  A* mean = static_cast<A*>(a.mean);
  A* rstd = static_cast<A*>(a.rstd);
  const int64_t G = a.G, D = a.C / a.G, S = a.S, NG = a.N * G, M = D * S;
  const A eps = static_cast<A>(a.eps);
#pragma omp parallel for schedule(static)
  for (int64_t ng = 0; ng < NG; ++ng) {
    const int64_t g = ng % G;
    const T* xg = x + ng * M;
    T* yg = y + ng * M;
    const Welford<A> w = group_moments(xg, M);
    const A r = A(1) / std::sqrt(w.var() + eps);
    mean[ng] = w.mean;
    rstd[ng] = r;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = g * D + d;
      const A sc = r * static_cast<A>(to_acc(gamma[c]));
      const A sh = static_cast<A>(to_acc(beta[c])) - sc * w.mean;
      const T* xp = xg + d * S;
      T* yp = yg + d * S;
#pragma omp simd
      for (int64_t s = 0; s < S; ++s) yp[s] = from_acc<T>(to_acc(xp[s]) * sc + sh);
    }
  }
}

template <typename T, typename P>
void bwd_impl(const GroupNormBwdArgs& a) {
  using A = AccT<T>;
  const T* dy = static_cast<const T*>(a.dy);
  const T* x = static_cast<const T*>(a.x);
  const A* mean = static_cast<const A*>(a.mean);
  const A* rstd = static_cast<const A*>(a.rstd);
  const P* gamma = static_cast<const P*>(a.gamma);
  T* dx = static_cast<T*>(a.dx);
  P* dgamma = static_cast<P*>(a.dgamma);
  P* dbeta = static_cast<P*>(a.dbeta);
  const int64_t N = a.N, C = a.C, G = a.G, D = C / G, S = a.S, NG = N * G, M = D * S;
  // Per-(n, c) sums, kept for the dgamma/dbeta reduction over n.
  A* dsc = static_cast<A*>(a.workspace);
  A* db = dsc + N * C;
  const A* dmean_o = static_cast<const A*>(a.dmean);
  const A* drstd_o = static_cast<const A*>(a.drstd);
  const A inv_m = A(1) / static_cast<A>(M);
#pragma omp parallel for schedule(static)
  for (int64_t ng = 0; ng < NG; ++ng) {
    const int64_t n = ng / G, g = ng % G;
    const A mu = mean[ng], r = rstd[ng];
    const T* xg = x + ng * M;
    const T* dyg = dy + ng * M;
    A sum_a = 0, sum_b = 0;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = g * D + d;
      const T* xp = xg + d * S;
      const T* dyp = dyg + d * S;
      A s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
      for (int64_t s = 0; s < S; ++s) {
        const A go = to_acc(dyp[s]);
        s1 += go * (to_acc(xp[s]) - mu);
        s2 += go;
      }
      dsc[n * C + c] = s1;
      db[n * C + c] = s2;
      const A gm = static_cast<A>(to_acc(gamma[c]));
      sum_a += gm * s1;
      sum_b += gm * s2;
    }
    const A r3 = r * r * r;
    A c2 = -sum_a * r3 * inv_m;
    A c3 = -sum_b * r * inv_m;
    if (dmean_o) c3 += dmean_o[ng] * inv_m;
    if (drstd_o) c2 -= drstd_o[ng] * r3 * inv_m;
    T* dxg = dx + ng * M;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = g * D + d;
      const A c1 = r * static_cast<A>(to_acc(gamma[c]));
      const T* xp = xg + d * S;
      const T* dyp = dyg + d * S;
      T* dxp = dxg + d * S;
#pragma omp simd
      for (int64_t s = 0; s < S; ++s)
        dxp[s] = from_acc<T>(c1 * to_acc(dyp[s]) + c2 * (to_acc(xp[s]) - mu) + c3);
    }
  }
  if (dgamma == nullptr && dbeta == nullptr) return;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    const int64_t g = c / D;
    A sg = 0, sb = 0;
    for (int64_t n = 0; n < N; ++n) {
      sg += dsc[n * C + c] * rstd[n * G + g];
      sb += db[n * C + c];
    }
    if (dgamma) dgamma[c] = from_acc<P>(sg);
    if (dbeta) dbeta[c] = from_acc<P>(sb);
  }
}

const char* check_dims(int64_t N, int64_t C, int64_t G, int64_t S) {
  if (N <= 0 || C <= 0 || S <= 0) return "gn_mx: empty tensors are not supported";
  if (G <= 0 || C % G != 0) return "gn_mx: channels must be divisible by num_groups > 0";
  return nullptr;
}

// Calls f.template operator()<T>() for the data dtype.
template <typename F>
const char* dispatch_data(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32: f(float{}); return nullptr;
    case DType::kFloat64: f(double{}); return nullptr;
    case DType::kFloat16: f(Half{}); return nullptr;
  }
  return "gn_mx: unsupported data dtype";
}

// Supported (data, param) pairs: (T, T) and (float16, float32).
template <template <typename, typename> class Impl, typename Args>
const char* dispatch_data_param(const Args& a) {
  if (a.param_dtype == a.dtype) {
    return dispatch_data(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      Impl<T, T>::run(a);
    });
  }
  if (a.dtype == DType::kFloat16 && a.param_dtype == DType::kFloat32) {
    Impl<Half, float>::run(a);
    return nullptr;
  }
  return "gn_mx: gamma/beta dtype must equal the data dtype (or be float32 with float16 data)";
}

template <typename T, typename P> struct FwdRun { static void run(const GroupNormFwdArgs& a) { fwd_impl<T, P>(a); } };
template <typename T, typename P> struct BwdRun { static void run(const GroupNormBwdArgs& a) { bwd_impl<T, P>(a); } };

}  // namespace

size_t group_norm_bwd_workspace_cpu(const GroupNormBwdArgs& a) {
  const size_t acc = dtype_size(acc_dtype(a.dtype));
  return 2 * static_cast<size_t>(a.N) * static_cast<size_t>(a.C) * acc;
}

const char* moments_cpu(const MomentsArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  return dispatch_data(a.dtype, [&](auto tag) { moments_impl<decltype(tag)>(a); });
}

const char* moments_bwd_cpu(const MomentsBwdArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  return dispatch_data(a.dtype, [&](auto tag) { moments_bwd_impl<decltype(tag)>(a); });
}

const char* group_norm_fwd_cpu(const GroupNormFwdArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  return dispatch_data_param<FwdRun>(a);
}

const char* group_norm_bwd_cpu(const GroupNormBwdArgs& a) {
  if (const char* e = check_dims(a.N, a.C, a.G, a.S)) return e;
  if (a.workspace == nullptr) return "gn_mx: group_norm backward needs a workspace";
  return dispatch_data_param<BwdRun>(a);
}

}  // namespace gn_mx
