/*
 * group_norm_cpu_common.h: what the two CPU GroupNorm translation units share: the thread plan
 * (make_plan), the output-streaming threshold, the exactly recomputed groups (GroupWalk, exact_*)
 * and the backward workspace layout (carve_bwd_sums). group_norm_cpu.cc (channels first and the
 * entry points) and group_norm_nsc_cpu.cc (channels last) include it; private to them: internal
 * linkage (an unnamed namespace), each translation unit its own copy, as before the split.
 * The design notes (threads, exact groups) are in group_norm_cpu.cc's header comment.
 */
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "group_norm.h"
#include "group_norm_math.h"
#include "../common/carver.h"
#include "../common/threads.h"

namespace gn_mx {
namespace {

using threads::barrier;
using threads::num_threads;
using threads::team_size;
using threads::thread_id;

constexpr int64_t kMinParallel = 1 << 14;  // fewer elements than this: no OpenMP fork
// Smallest group that threads share: sharing costs one barrier per group (about a microsecond),
// which 8192 elements (32 KB fp32, a few microseconds of one thread's work) still pay for.
constexpr int64_t kMinCoopGroup = 1 << 13;
// Groups split statically over threads are "balanced" when every thread gets the same count, or at
// least this many groups each: the last, partly idle, round then costs at most 1/8 of the time.
constexpr int64_t kMinGroupsPerThread = 8;
// Outputs of at least this many bytes are written with streaming stores: they cannot stay in cache
// anyway, and streaming saves the read-for-ownership of every output line (1/3 of the traffic).
// Forward keeps y cached up to 8 MB (the next layer reads it; x + y fit a typical L3); backward's
// working set is three tensors (x, dy, dx), so it streams dx from 4 MB. Measured on a Zen 4 with a
// 32 MB L3: 8x256x28x28 fp32 backward 1.07 -> 0.50 ms with streaming, its forward 0.33 -> 0.43 ms.
constexpr int64_t kStreamBytesFwd = int64_t(8) << 20;
constexpr int64_t kStreamBytesBwd = int64_t(4) << 20;

bool stream_output(int64_t elems, size_t elem_size, int64_t threshold) {
  return elems * static_cast<int64_t>(elem_size) >= threshold;
}

struct Plan {
  int nt = 1;         // threads to request
  bool coop = false;  // threads share each group
};

Plan make_plan(int64_t NG, int64_t M) {
  Plan p;
  const int nt = team_size();
  if (nt <= 1 || NG * M < kMinParallel) return p;
  p.nt = nt;
  const bool balanced =
      NG >= nt && (NG % nt == 0 || NG >= kMinGroupsPerThread * static_cast<int64_t>(nt));
  p.coop = !balanced && M >= kMinCoopGroup;
  // Static schedules only: with schedule(dynamic) inside MXNet (after MXNet's own OpenMP ops ran)
  // a 1.5 MB forward on 2 threads took 12 ms instead of 0.12 ms, the threads spinning in libgomp.
  return p;
}


// ------------------------------------------------------------------------------------------------
// Exactly recomputed groups (see the header comment)

// A group's elements in either layout: element (d, s) (channel d of the group, position s) lies at
// xg[d*cs + s*ps] from the group's first element: (cs, ps) = (S, 1) channels first, (1, C)
// channels last (group_shape.h gn_elem_strides).
struct GroupWalk {
  int64_t D, S, cs, ps;
  int64_t at(int64_t d, int64_t s) const { return d * cs + s * ps; }
  int64_t size() const { return D * S; }
};
GroupWalk group_walk(const GroupDims& dims) {
  const ElemStrides e = gn_elem_strides(dims);
  return {dims.D, dims.S, e.chan, e.pos};
}
// The group (n, g)'s first element.
int64_t group_offset(const GroupDims& dims, int64_t n, int64_t g) {
  const ElemStrides e = gn_elem_strides(dims);
  return n * e.sample + g * dims.D * e.chan;
}

// Group statistics in float64 around x0 = xg[0]: *d = mean - x0, *r = rstd (and *var).
template <typename T>
void exact_stats(const T* xg, const GroupWalk& w, double eps, double* x0, double* d, double* r,
                 double* var = nullptr) {
  const int64_t M = w.size();
  *x0 = static_cast<double>(to_acc(xg[0]));
  double s = 0;
  for (int64_t c = 0; c < w.D; ++c)
    for (int64_t i = 0; i < w.S; ++i) s += static_cast<double>(to_acc(xg[w.at(c, i)])) - *x0;
  *d = s / static_cast<double>(M);
  double q = 0;
  for (int64_t c = 0; c < w.D; ++c)
    for (int64_t i = 0; i < w.S; ++i) {
      const double v = (static_cast<double>(to_acc(xg[w.at(c, i)])) - *x0) - *d;
      q += v * v;
    }
  *r = 1.0 / std::sqrt(q / static_cast<double>(M) + eps);
  if (var) *var = q / static_cast<double>(M);
}

// gn_moments of a group gn_exact_moments selects.
template <typename T>
void exact_moments(const T* xg, const GroupWalk& w, AccT<T>* mean, AccT<T>* var) {
  double x0, d, r, v;
  exact_stats(xg, w, 0.0, &x0, &d, &r, &v);
  *mean = static_cast<AccT<T>>(x0 + d);
  *var = static_cast<AccT<T>>(v);
}

template <typename T, Act ACT>
void exact_fwd(const T* xg, T* yg, const GroupWalk& w, double eps, const AccT<T>* gam,
               const AccT<T>* bet, AccT<T>* mean, AccT<T>* rstd) {
  using A = AccT<T>;
  double x0, d, r;
  exact_stats(xg, w, eps, &x0, &d, &r);
  *mean = static_cast<A>(x0 + d);
  *rstd = static_cast<A>(r);
  const double sc = gn_exact_xhat_scale(r, w.size());
  for (int64_t c = 0; c < w.D; ++c) {
    const double ga = gam[c], be = bet[c];
    for (int64_t i = 0; i < w.S; ++i) {
      const int64_t s = w.at(c, i);
      // exactly 0 when M == 1
      const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[s])), x0, d);
      yg[s] = from_acc<T>(static_cast<A>(gn_act<ACT>(gn_exact_z(xc, sc, ga, be))));
    }
  }
}

// dx of one group and its per-channel sums dgs[c] = sum g xhat, db[c] = sum g.
template <typename T, Act ACT>
void exact_bwd(const T* xg, const T* dyg, T* dxg, const GroupWalk& w, double eps,
               const AccT<T>* gam, const AccT<T>* bet, double dmean_o, double drstd_o, AccT<T>* dgs,
               AccT<T>* db) {
  using A = AccT<T>;
  const int64_t M = w.size();
  double x0, d, r;
  exact_stats(xg, w, eps, &x0, &d, &r);
  const double sc = gn_exact_xhat_scale(r, M);
  auto grad = [&](int64_t s, double xc, double ga, double be) {
    const double dy = static_cast<double>(to_acc(dyg[s]));
    return gn_act_grad<ACT>(gn_exact_z(xc, sc, ga, be), dy);
  };
  if (M == 1) {  // x - mean = 0: out = act(beta), d out/dx = 0; only mean (= x) passes dmean on
    dgs[0] = A(0);
    db[0] = static_cast<A>(grad(0, 0.0, gam[0], bet[0]));
    dxg[0] = from_acc<T>(static_cast<A>(dmean_o));
    return;
  }
  double sa = 0, sb = 0;
  for (int64_t c = 0; c < w.D; ++c) {
    const double ga = gam[c], be = bet[c];
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < w.S; ++i) {
      const int64_t s = w.at(c, i);
      const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[s])), x0, d);
      const double g = grad(s, xc, ga, be);
      s1 += g * xc;
      s2 += g;
    }
    dgs[c] = static_cast<A>(s1 * r);
    db[c] = static_cast<A>(s2);
    sa += ga * s1;
    sb += ga * s2;
  }
  double c2, c3;
  gn_bwd_coeffs<double>(sa, sb, r, 1.0 / static_cast<double>(M), dmean_o, drstd_o, &c2, &c3);
  for (int64_t c = 0; c < w.D; ++c) {
    const double ga = gam[c], be = bet[c];
    for (int64_t i = 0; i < w.S; ++i) {
      const int64_t s = w.at(c, i);
      const double xc = gn_exact_xc(static_cast<double>(to_acc(xg[s])), x0, d);
      dxg[s] = from_acc<T>(static_cast<A>(r * ga * grad(s, xc, ga, be) + c2 * xc + c3));
    }
  }
}


// The backward workspace, one layout (WorkspaceCarver: with ws == nullptr it only measures):
// per-(n, c) sums dsc = sum g xhat (= r sum g (x - mu)) and db = sum g, (N, C) AccT each, written
// per group by the input gradient and reduced over n into dgamma / dbeta by bwd_params.
template <typename A>
struct BwdSums {
  A* dsc;
  A* db;
};
template <typename A>
BwdSums<A> carve_bwd_sums(void* ws, const GroupDims& d, size_t* bytes = nullptr) {
  WorkspaceCarver<64> w{static_cast<char*>(ws)};
  const size_t nc = static_cast<size_t>(d.N) * static_cast<size_t>(d.C);
  BwdSums<A> s;
  s.dsc = w.take<A>(nc);
  s.db = w.take<A>(nc);
  if (bytes) *bytes = w.off;
  return s;
}

// gn_group_norm's input gradient (and the per-(n, c) sums of the parameter gradients). The partial

}  // namespace
}  // namespace gn_mx
