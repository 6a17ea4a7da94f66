/*
 * group_norm_grad2_cpu.cc: CPU double backward of gn_group_norm (formulas: group_norm_grad2.h and
 * group_norm_grad2_math.h, shared with the CUDA twin).
 *
 * The N*G groups are independent: each is read twice (sums, then the element-wise results) by one
 * thread of the OpenMP team. Either layout (channels first or last, group_shape.h's
 * gn_elem_strides): a group's channel is S elements e.pos apart. Per-(n, c) partial sums of d gamma / d beta go to the workspace and are
 * reduced over n afterwards in a fixed order (deterministic, no atomics). Plain scalar loops: this
 * op runs only when a second derivative is asked for.
 */
#include <cstdint>

#include "group_norm_grad2.h"
#include "dispatch_cpu.h"
#include "group_norm_grad2_math.h"
#include "../common/threads.h"

namespace gn_mx {
namespace {

template <typename T, typename P>
struct Grad2Impl {
  using A = AccT<T>;

  template <typename V>
  static A load(const void* p, int64_t i) {
    return p ? static_cast<A>(to_acc(static_cast<const V*>(p)[i])) : A(0);
  }

  template <Act ACT>
  static void group(const GroupNormGrad2Args& a, int64_t n, int64_t g, A* pg, A* pb) {
    const int64_t D = a.dims.C / a.dims.G, S = a.dims.S, M = D * S;
    const int64_t ng = n * a.dims.G + g;
    const ElemStrides e = gn_elem_strides(a.dims);  // either layout: (n, c, s) at off(n, c) + s*e.pos
    const A mu = load<A>(a.mean, ng), r = load<A>(a.rstd, ng);
    const A dmo = load<A>(a.dmean_o, ng), dro = load<A>(a.drstd_o, ng);
    const A inv_m = A(1) / static_cast<A>(M);
    const T* x = static_cast<const T*>(a.x);
    const T* dy = static_cast<const T*>(a.dy);
    Grad2Sums<A> s;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = g * D + d, off = n * e.sample + c * e.chan;
      const A gam = load<P>(a.gamma, c), bet = load<P>(a.beta, c), ggam = load<P>(a.gdgamma, c);
      A gxg = 0, dsc = 0, db = 0;
      for (int64_t i = off; i < off + S * e.pos; i += e.pos) {
        const A u = to_acc(x[i]) - mu;
        const A gv = gn_act_grad<ACT>(u * r * gam + bet, static_cast<A>(to_acc(dy[i])));
        const A gx = load<T>(a.gdx, i);
        gxg += gx * gv;
        dsc += gv * u;
        db += gv;
        s.P += gx * u;
        s.Q += gx;
      }
      s.sa += gam * dsc;
      s.sb += gam * db;
      s.t1 += gam * gxg + ggam * dsc;
      // d gamma's first-order part needs e2/e3 (known after this pass): keep the channel's sums
      pg[c] = gxg;
      pb[c] = dsc;
      pb[a.dims.C + c] = db;
    }
    const Grad2Coeffs<A> k = gn_grad2_coeffs(s, r, inv_m, dmo, dro);
    T* ddy = static_cast<T*>(a.ddy);
    T* dx = static_cast<T*>(a.dx);
    A sdx = 0, shug = 0;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t c = g * D + d, off = n * e.sample + c * e.chan;
      const A gam = load<P>(a.gamma, c), bet = load<P>(a.beta, c);
      const A ggam = load<P>(a.gdgamma, c), gbet = load<P>(a.gdbeta, c);
      A hu = 0, hs = 0;
      for (int64_t i = off; i < off + S * e.pos; i += e.pos) {
        const A u = to_acc(x[i]) - mu;
        const A z = u * r * gam + bet;
        A vddy, vdx, h;
        gn_grad2_elem(k, r, u, static_cast<A>(to_acc(dy[i])), gn_act_d1<ACT>(z),
                      gn_act_d2<ACT>(z), load<T>(a.gdx, i), gam, ggam, gbet, &vddy, &vdx, &h);
        ddy[i] = from_acc<T>(vddy);
        dx[i] = from_acc<T>(vdx);
        sdx += vdx;
        shug += h * u * gam;
        hu += h * u;
        hs += h;
      }
      pg[c] = r * pg[c] + k.e2 * pb[c] + k.e3 * pb[a.dims.C + c] + r * hu;
      pb[c] = hs;
    }
    static_cast<A*>(a.dmean)[ng] = -sdx;
    static_cast<A*>(a.drstd)[ng] = gn_grad2_drstd(s, r, inv_m, dro, shug);
    static_cast<A*>(a.ddmean_o)[ng] = s.Q * inv_m;
    static_cast<A*>(a.ddrstd_o)[ng] = k.e2;
  }

  static void run(const GroupNormGrad2Args& a) {
    A* ws = static_cast<A*>(a.workspace);  // pg (N, C), pb (N, 2C): per-sample partials
    const int64_t NG = a.dims.N * a.dims.G;
    dispatch_act(a.act, [&](auto act) {
      constexpr Act ACT = decltype(act)::value;
#pragma omp parallel for schedule(static) if (threads::team_size() > 1 && NG > 1)
      for (int64_t ng = 0; ng < NG; ++ng) {
        const int64_t n = ng / a.dims.G, g = ng % a.dims.G;
        group<ACT>(a, n, g, ws + n * a.dims.C, ws + a.dims.N * a.dims.C + n * 2 * a.dims.C);
      }
    });
    P* dgamma = static_cast<P*>(a.dgamma);
    P* dbeta = static_cast<P*>(a.dbeta);
    for (int64_t c = 0; c < a.dims.C; ++c) {
      A sg = 0, sb = 0;
      for (int64_t n = 0; n < a.dims.N; ++n) {
        sg += ws[n * a.dims.C + c];
        sb += ws[a.dims.N * a.dims.C + n * 2 * a.dims.C + c];
      }
      dgamma[c] = from_acc<P>(sg);
      dbeta[c] = from_acc<P>(sb);
    }
  }
};

template <typename T>
void moments_grad2_typed(const MomentsGrad2Args& a) {
  using A = AccT<T>;
  const int64_t D = a.dims.C / a.dims.G, M = D * a.dims.S, NG = a.dims.N * a.dims.G;
  const ElemStrides e = gn_elem_strides(a.dims);
  const T* x = static_cast<const T*>(a.x);
  const T* gdx = static_cast<const T*>(a.gdx);
  T* dx = static_cast<T*>(a.dx);
  const A inv_m = A(1) / static_cast<A>(M);
#pragma omp parallel for schedule(static) if (threads::team_size() > 1 && NG > 1)
  for (int64_t ng = 0; ng < NG; ++ng) {
    const A mu = static_cast<const A*>(a.mean)[ng];
    const A dvo = a.dvar_o ? static_cast<const A*>(a.dvar_o)[ng] : A(0);
    // the group's D channels at S positions, in either layout
    const int64_t n = ng / a.dims.G, c0 = (ng % a.dims.G) * D;
    A P = 0, Q = 0;
    for (int64_t c = c0; c < c0 + D; ++c)
      for (int64_t s = 0; s < a.dims.S; ++s) {
        const int64_t i = n * e.sample + c * e.chan + s * e.pos;
        const A g = gdx ? static_cast<A>(to_acc(gdx[i])) : A(0);
        P += g * (to_acc(x[i]) - mu);
        Q += g;
        dx[i] = from_acc<T>(A(2) * dvo * g * inv_m);
      }
    static_cast<A*>(a.ddmean_o)[ng] = Q * inv_m;
    static_cast<A*>(a.ddvar_o)[ng] = A(2) * P * inv_m;
    static_cast<A*>(a.dmean)[ng] = -A(2) * dvo * Q * inv_m;
  }
}

}  // namespace

const char* moments_grad2_cpu(const MomentsGrad2Args& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  if (!a.x || !a.mean || !a.ddmean_o || !a.ddvar_o || !a.dx || !a.dmean) return "null pointer";
  return cpu::dispatch_data(a.dtype, [&](auto t) { moments_grad2_typed<decltype(t)>(a); });
}

size_t group_norm_grad2_workspace_cpu(const GroupNormGrad2Args& a) {
  const size_t acc = dtype_size(acc_dtype(a.dtype));
  return static_cast<size_t>(a.dims.N) * static_cast<size_t>(a.dims.C) * 3 * acc;
}

const char* group_norm_grad2_cpu(const GroupNormGrad2Args& a) {
  if (const char* e = check_group_dims(a.dims)) return e;
  if (!a.dy || !a.x || !a.gamma || !a.beta || !a.mean || !a.rstd || !a.ddy || !a.ddmean_o ||
      !a.ddrstd_o || !a.dx || !a.dgamma || !a.dbeta || !a.dmean || !a.drstd)
    return "null pointer";
  if (!a.workspace) return kGnNeedsWorkspace;
  return cpu::dispatch_data_param<Grad2Impl>(a);
}

}  // namespace gn_mx
