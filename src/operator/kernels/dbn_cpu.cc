/*
 * dbn_cpu.cc: CPU Decorrelated BN kernels (math in dbn.h / dbn_math.h).
 *
 * Every O(D^2 m) stage is a product on a column panel: for group g, columns j0..j0+K of the
 * D x m matrix X are gathered (widened to AccT) into a row-major D x K panel straight from NCHW
 * (row stride ld = K + padding), then, two passes over the data each way:
 *   forward 1   centre the panel on its own mean (in cache), C_chunk = panel panel^T, merged
 *               into fp64 (count, mean, M2) per thread and group with Chan's update: exact
 *               two-pass statistics in one read of x
 *   forward 2   Q = W (x - mu) -> scattered (narrowed) into y
 *   backward 1  G_W += dY Xc^T, sum(dY)
 *   backward 2  dX = [W | B] [dY - mean(dY); Xc]  (one product with a D x 2D matrix)
 * Panels are per thread; (group, chunk) items are spread over an OpenMP team. Tensors > 4 MB:
 * whole groups per thread when they divide evenly over the team (use_per_group), else the passes
 * in blocks of groups (group_block), so that a group's second read hits the last-level cache.
 * D x D math (eigh, W, backward matrices) is fp64: dbn_math.h's steps run by dbn_small_cpu.h's
 * CpuExec (register-blocked products), eigensolver in dbn_eigen_cpu.cc (Householder + QL for
 * D > 8, Jacobi from dbn_math.h up to 8). float panels use
 * AVX2+FMA kernels when the CPU has them (6 x 16 register tiles for W P, 4 x 3 dot-product tiles
 * for X Y^T: ~85-97% of the FMA peak in cache; runtime dispatch; GNMX_CPU_ISA=generic disables
 * them), otherwise and for double the BLAS
 * sgemm/dgemm/syrk of the OpenBLAS shipped in the mxnet wheel (built with OpenMP, so it runs
 * single-threaded inside our team), looked up at run time (dbn_blas_cpu.cc); without it a
 * naive gemm/syrk keeps results correct (LAPACK dsyevd is only a fallback of the eigensolver).
 * NB: BLAS sees row-major D x K panels as column-major K x D matrices (leading dimension ld), so
 * a row-major product C = A B is issued as the column-major C^T = B^T A^T.
 */


#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(GNMX_DBN_PROFILE)
#include <ctime>
#endif

#include "dbn.h"
#include "../common/carver.h"
#include "../common/threads.h"
#include "dbn_eigen_cpu.h"
#include "dbn_panels_cpu.h"
#include "dbn_small_cpu.h"
#include "dispatch_cpu.h"

namespace gn_mx {
namespace {
using namespace dbn_cpu;  // BLAS wrappers (dbn_blas_cpu.h), eigh (dbn_eigen_cpu.h)

constexpr size_t kAlign = 64;

using Carver = WorkspaceCarver<kAlign>;

// Stage timestamps for benchmarks/dbn_stages.cc (built with -DGNMX_DBN_PROFILE); no-ops otherwise.
// Placed right after an `omp for` (its implicit barrier), so thread 0's clock marks the stage end;
// meaningful for the chunk-parallel schedule over all groups (GNMX_DBN_PROFILE_CHUNKED=1 forces
// it in a profiling build; whole-group and blocked schedules interleave the stages).
#if defined(GNMX_DBN_PROFILE)
}  // namespace
double g_dbn_prof[16];
double dbn_prof_clock() {  // thread CPU time: survives a loaded machine at one thread
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
namespace {
#define DBN_PROF(i) \
  do { if (threads::thread_id() == 0) g_dbn_prof[i] = dbn_prof_clock(); } while (0)
#else
#define DBN_PROF(i) do { } while (0)
#endif

int resolve_threads(int t) { return t > 0 ? t : std::max(1, threads::max_threads()); }

// The CPU group-size limit keeps every int-indexed D x D and panel extent far below INT_MAX.
static_assert(2 * kDbnMaxGroupSizeCpu * kDbnMaxGroupSizeCpu <= INT_MAX / 2 &&
                  2 * kDbnMaxGroupSizeCpu * (kPanelElems + 64) <= INT_MAX / 2,
              "kDbnMaxGroupSizeCpu overflows int indexing");

const char* check_geo(int64_t N, int64_t C, int64_t G, int64_t S) {
  return dbn_check_shape(N, C, G, S, kDbnMaxGroupSizeCpu, "cpu");
}

// ---- Group blocks -------------------------------------------------------------------------------
// Training passes run block by block over the groups: statistics pass, D x D step, apply pass for
// groups [g0, g0 + gb), then the next block. A block's data is read twice (x; dy and x in the
// backward), so when the tensor is larger than the caches the second read of a block comes from
// the last-level cache instead of memory. gb: as many groups as fit kBlockBytes of input, at least
// one per thread (the D x D steps of a block run in parallel over its groups); all groups when
// the tensor is small (then blocking only adds barriers).
constexpr int64_t kBlockBytes = int64_t(4) << 20;

int64_t group_block(const PanelGeo& q, size_t elem, int nt) {
#if defined(GNMX_DBN_PROFILE)
  if (std::getenv("GNMX_DBN_PROFILE_CHUNKED")) return q.G;
#endif
  const int64_t group_bytes = q.D * q.m * static_cast<int64_t>(elem);
  if (group_bytes * q.G <= kBlockBytes) return q.G;
  const int64_t gb = std::max<int64_t>(nt, kBlockBytes / std::max<int64_t>(group_bytes, 1));
  return std::min(q.G, std::max<int64_t>(gb, 1));
}

// Large tensors whose groups divide evenly over the team: each thread runs the passes of whole
// groups (statistics, D x D step, apply), with no barrier between them and one group's data (not
// a block's) in flight per thread; measured on a Zen 4 at 2 threads: 128x256x8x8 G=4 forward
// 3.6 vs 3.9-4.2 ms. Small tensors keep the chunk-parallel passes (there the per-group split was
// 5-15% slower: 8x128x32x32 G=8).
bool use_per_group(const PanelGeo& q, size_t elem, int nt) {
#if defined(GNMX_DBN_PROFILE)
  if (std::getenv("GNMX_DBN_PROFILE_CHUNKED")) return false;  // stage timestamps need the passes
#endif
  return q.G % nt == 0 && q.D * q.m * q.G * static_cast<int64_t>(elem) > kBlockBytes;
}

// Column chunk `it` of the (group, chunk) items: group g, columns [j0, j0 + kc).
struct Chunk {
  int64_t g, j0, kc;
};
inline Chunk chunk_of(const PanelGeo& q, int64_t it) {
  const int64_t g = it / q.nchunk, j0 = (it % q.nchunk) * q.K;
  return {g, j0, std::min(q.K, q.m - j0)};
}

// The three stages of a training pass, called by every thread of the team: pass1(it) over the
// (group, chunk) items, step(g) per group, pass2(it). Whole groups per thread without barriers
// (per_group, see use_per_group), else blocks of gb groups (group_block) with the stages
// separated by the barriers of `omp for`. prof: DBN_PROF index of the first stage's end.
template <typename P1, typename Step, typename P2>
void run_stages(const PanelGeo& q, bool per_group, int64_t gb, int prof, P1&& pass1, Step&& step,
                P2&& pass2) {
  if (per_group) {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < q.G; ++g) {
      const int64_t it0 = g * q.nchunk, it1 = it0 + q.nchunk;
      for (int64_t it = it0; it < it1; ++it) pass1(it);
      step(g);
      for (int64_t it = it0; it < it1; ++it) pass2(it);
    }
    DBN_PROF(prof); DBN_PROF(prof + 1); DBN_PROF(prof + 2);
    return;
  }
  for (int64_t g0 = 0; g0 < q.G; g0 += gb) {
    const int64_t g1 = std::min(q.G, g0 + gb), it0 = g0 * q.nchunk, it1 = g1 * q.nchunk;
#pragma omp for schedule(static)
    for (int64_t it = it0; it < it1; ++it) pass1(it);
    DBN_PROF(prof);
#pragma omp for schedule(static)
    for (int64_t g = g0; g < g1; ++g) step(g);
    DBN_PROF(prof + 1);
#pragma omp for schedule(static)
    for (int64_t it = it0; it < it1; ++it) pass2(it);
    DBN_PROF(prof + 2);
  }
}

// A training pass (FwdPass, BwdPass) over its team: the schedule of its data type T (group_block,
// use_per_group), each thread's Tls, then run_stages with the pass's three member stages.
// The stages are template arguments (member pointers known at compile time: direct calls).
template <typename T, auto kPass1, auto kStep, auto kPass2, class Pass>
void run_team(const Pass& p, int prof) {
  const int64_t gb = group_block(p.q, sizeof(T), p.nt);
  const bool per_group = use_per_group(p.q, sizeof(T), p.nt);
#pragma omp parallel num_threads(p.nt)
  {
    const auto s = p.tls(threads::thread_id());
    run_stages(p.q, per_group, gb, prof, [&](int64_t it) { (p.*kPass1)(s, it); },
               [&](int64_t g) { (p.*kStep)(s, g); }, [&](int64_t it) { (p.*kPass2)(s, it); });
  }
}

// ---- IterNorm scratch ---------------------------------------------------------------------------
// One thread's IterNorm state (dbn_math.h's DbnIterScratch): its matrices in S (float when
// dbn_iternorm_fp32, else double; bytes `s`) and its doubles `d`, carved per thread. keep: the
// backward's (every iteration's Q, R1, R2 and the back steps' matrices), else the forward's.
struct IterSizes {
  bool fp32;
  int T;
  int64_t s_bytes, d;
};
IterSizes iter_sizes(const PanelGeo& q, DType dtype, DbnWhitening w, int iterations, bool keep) {
  IterSizes z{false, 1, 0, 0};
  if (w != DbnWhitening::kIterNorm) return z;
  z.T = std::max(1, std::min(iterations, kDbnMaxIterations));  // invalid counts size nothing odd
  z.fp32 = dbn_iternorm_fp32(dtype, z.T);
  const int64_t bytes = dbn_iternorm_mats(z.T, keep) * q.D * q.D * (z.fp32 ? 4 : 8);
  z.s_bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  z.d = dbn_iternorm_doubles(static_cast<int>(q.D), keep);
  return z;
}
template <typename S>
DbnIterScratch<S> iter_scratch(const IterSizes& z, char* s_all, double* d_all, int t, int D,
                               bool keep) {
  return dbn_iternorm_layout(reinterpret_cast<S*>(s_all + t * z.s_bytes), d_all + t * z.d, D, z.T,
                             keep);
}

// ---- Training forward -------------------------------------------------------------------------
template <typename A>
struct FwdLayout {
  double* acc;   // T x G x D x D, fp64 centred sums M2 (upper triangle, column-major)
  double* tmean; // T x G x D, fp64 running mean of the chunks a thread merged
  double* tcnt;  // T x G, their column count
  double* delta; // T x D
  A* csum;       // T x D, a chunk's row sums
  A* W;          // G x D x (D+1): [diag(gamma) W | beta] in AccT for the whitening product (D x D
                 // when there is no affine)
  A* panel;      // T x (D+1) x K (row D: ones, the affine's beta column)
  A* out;        // T x D x K
  A* cb;         // T x D x D, one chunk's syrk result
  double* sig;   // T x D x D
  double* U;     // T x D x D
  double* l;     // T x D
  double* Wd;    // T x D x D
  double* ea;    // T x D x D, eigensolver matrix
  double* tmp;   // T x fwd_tmp(), dbn_whitening_matrix's (Ut, V, r) (ZCA)
  char* its;     // T x IterSizes::s_bytes, IterNorm's matrices (float or double)
  double* itd;   // T x IterSizes::d, IterNorm's doubles
  double* work;  // T x lwork
  int* iwork;    // T x liwork
};

// Doubles of a thread's D x D scratch in the forward: ZCA 2 D^2 + D (IterNorm: iter_sizes).
int64_t fwd_tmp(const PanelGeo& q, DbnWhitening w) {
  return w == DbnWhitening::kIterNorm ? 0 : 2 * q.D * q.D + q.D;
}

template <typename A>
FwdLayout<A> fwd_layout(Carver* c, const PanelGeo& q, int T, const DbnFwdArgs& a) {
  const DbnWhitening w = a.whitening;
  const IterSizes z = iter_sizes(q, a.dtype, w, a.iterations, false);
  FwdLayout<A> L;
  const size_t DD = q.D * q.D;
  L.acc = c->take<double>(T * q.G * DD);
  L.tmean = c->take<double>(T * q.G * q.D);
  L.tcnt = c->take<double>(T * q.G);
  L.delta = c->take<double>(T * q.D);
  L.csum = c->take<A>(T * q.D);
  L.W = c->take<A>(q.G * q.D * (q.D + 1));
  L.panel = c->take<A>(T * (q.D + 1) * q.ld);
  L.out = c->take<A>(T * q.D * q.ld);
  L.cb = c->take<A>(T * DD);
  L.sig = c->take<double>(T * DD);
  L.U = c->take<double>(T * DD);
  L.l = c->take<double>(T * q.D);
  L.Wd = c->take<double>(T * DD);
  L.ea = c->take<double>(T * DD);
  L.tmp = c->take<double>(T * fwd_tmp(q, w));
  L.its = c->take<char>(T * z.s_bytes);
  L.itd = c->take<double>(T * z.d);
  L.work = c->take<double>(T * eig_lwork(q.D));
  L.iwork = c->take<int>(T * eig_liwork(q.D));
  return L;
}

// The training forward's stages, one function each, over the call's shared state (args, geometry,
// workspace) and one thread's slice of the workspace (Tls):
//   stats_chunk(it)   pass 1, mean and covariance of one column chunk merged into the thread's state
//   finish_group(g)   merge the threads' states, Sigma, eigh, W, saved and running statistics
//   whiten_chunk(it)  pass 2, y = W (x - mu) for one column chunk
template <typename T>
struct FwdPass {
  using A = AccT<T>;
  const DbnFwdArgs& a;
  PanelGeo q;
  int nt;
  FwdLayout<A> L;
  IterSizes iz;
  const T* x;
  T* y;
  A* mean;
  A* eigvec;
  A* eigval;
  int64_t D, DD;
  int Di;
  bool affine;  // y = gamma xhat + beta
  int Dw;       // columns of the whitening product's matrix: D, or D + 1 with the beta column

  // One thread's scratch.
  struct Tls {
    int t;
    dbn_small::CpuExec ex;
    double* acc;  // the thread's G x D x D M2 sums
    A *panel, *cb, *csum, *out;
    double *delta, *sig, *U, *l, *Wd, *tmp;
    EigScratch es;
  };

  FwdPass(const DbnFwdArgs& args, Carver* cv)
      : a(args), q(make_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)), nt(resolve_threads(a.num_threads)),
        L(fwd_layout<A>(cv, q, nt, a)),
        iz(iter_sizes(q, a.dtype, a.whitening, a.iterations, false)),
        x(static_cast<const T*>(a.x)), y(static_cast<T*>(a.y)),
        mean(static_cast<A*>(a.mean)), eigvec(static_cast<A*>(a.eigvec)),
        eigval(static_cast<A*>(a.eigval)), D(q.D), DD(q.D * q.D), Di(static_cast<int>(q.D)),
        affine(a.gamma != nullptr), Dw(Di + (affine ? 1 : 0)) {}

  Tls tls(int t) const {
    Tls s;
    s.t = t;
    s.acc = L.acc + t * q.G * DD;
    s.panel = L.panel + t * (D + 1) * q.ld;
    s.cb = L.cb + t * DD;
    s.csum = L.csum + t * D;
    s.out = L.out + t * D * q.ld;
    s.delta = L.delta + t * D;
    s.sig = L.sig + t * DD;
    s.U = L.U + t * DD;
    s.l = L.l + t * D;
    s.Wd = L.Wd + t * DD;
    s.tmp = L.tmp + t * fwd_tmp(q, a.whitening);
    s.es = EigScratch{L.ea + t * DD, L.work + t * eig_lwork(D), L.iwork + t * eig_liwork(D),
                      static_cast<int>(eig_lwork(D)), static_cast<int>(eig_liwork(D))};
    return s;
  }

  // Pass 1: mean and covariance in one read of x. Each chunk is centred on its own mean while
  // it sits in cache (exact two-pass statistics of the chunk), then merged into the thread's
  // fp64 state with Chan's update, the matrix form of welford.h's merge:
  //   delta = mean_b - mean_a, n = n_a + n_b,
  //   mean += delta n_b / n,   M2 = M2_a + M2_b + delta delta^T n_a n_b / n.
  // No E[xx^T] - mu mu^T cancellation anywhere, whatever the offset of the data.
  void stats_chunk(const Tls& s, int64_t it) const {
    const auto [g, j0, kc] = chunk_of(q, it);
    A* csum = s.csum;
    double* delta = s.delta;
    gather_sum(x, q, g, j0, kc, s.panel, q.ld, csum);
    for (int64_t d = 0; d < D; ++d) {
      A* row = s.panel + d * q.ld;
      const A c = csum[d] / static_cast<A>(kc);
      A r = 0;  // residual sum after centring (rounding of c), folded in exactly below
#pragma omp simd reduction(+ : r)
      for (int64_t k = 0; k < kc; ++k) {
        row[k] -= c;
        r += row[k];
      }
      csum[d] = c;  // chunk mean = c + r / kc
      delta[d] = static_cast<double>(r);
    }
    panel_gram(s.panel, s.panel, q.ld, Di, static_cast<int>(kc), s.cb, true);
    double* accg = s.acc + g * DD;
    double* tmean = L.tmean + (s.t * q.G + g) * D;
    double& na = L.tcnt[s.t * q.G + g];
    const double nb = static_cast<double>(kc), n = na + nb, w = na * nb / n;
    for (int64_t d = 0; d < D; ++d) {
      const double r = delta[d];
      delta[d] = static_cast<double>(csum[d]) + r / nb - tmean[d];  // mean_b - mean_a
      csum[d] = static_cast<A>(r);
    }
    for (int64_t j = 0; j < D; ++j) {
      const double rj = static_cast<double>(csum[j]) / nb, dj = delta[j] * w;
      for (int64_t i = 0; i <= j; ++i)
        accg[i + j * D] += static_cast<double>(s.cb[i + j * D]) -
                           static_cast<double>(csum[i]) * rj + delta[i] * dj;
    }
    for (int64_t d = 0; d < D; ++d) tmean[d] += delta[d] * nb / n;
    na = n;
  }

  // Merges the threads' (count, mean, M2) states of group g (Chan): the mean into mu, M2 (upper
  // triangle, column-major) into m2.
  void merge_states(int64_t g, double* mu, double* m2) const {
    double n = 0.0;
    std::fill(mu, mu + D, 0.0);
    std::fill(m2, m2 + DD, 0.0);
    for (int u = 0; u < nt; ++u) {
      const double nb = L.tcnt[u * q.G + g];
      if (nb == 0) continue;
      const double* mb = L.tmean + (u * q.G + g) * D;
      const double* m2b = L.acc + (u * q.G + g) * DD;
      const double nn = n + nb, w = n * nb / nn;
      for (int64_t j = 0; j < D; ++j)
        for (int64_t i = 0; i <= j; ++i)
          m2[i + j * D] += m2b[i + j * D] + (mb[i] - mu[i]) * (mb[j] - mu[j]) * w;
      for (int64_t d = 0; d < D; ++d) mu[d] += (mb[d] - mu[d]) * nb / nn;
      n = nn;
    }
  }

  // sig = M2 / m + eps I (full symmetric, row-major); false when an entry is not finite.
  bool covariance(const double* m2, double* sig) const {
    bool finite = true;
    for (int64_t j = 0; j < D; ++j)
      for (int64_t i = 0; i <= j; ++i) {
        double v = m2[i + j * D] / static_cast<double>(q.m);
        if (i == j) v += a.eps;
        sig[i * D + j] = sig[j * D + i] = v;
        finite = finite && std::isfinite(v);
      }
    return finite;
  }

  // Per group: Sigma, eigh, W (into s.Wd), the saved and the running statistics.
  void finish_group(const Tls& s, int64_t g) const {
    double *U = s.U, *l = s.l, *Wd = s.Wd;
    merge_states(g, l, Wd);  // mean into l, M2 into Wd (both free until eigh)
    for (int64_t d = 0; d < D; ++d) mean[g * D + d] = static_cast<A>(l[d]);
    const bool finite = covariance(Wd, s.sig);
    if (a.whitening == DbnWhitening::kIterNorm) {
      // W by the Newton iterations; saved: Sigma (eigvec) and its diagonal (eigval).
      if (finite && iz.fp32) {
        dbn_iternorm_whitening(s.ex, s.sig, Di, a.iterations, Wd,
                               iter_scratch<float>(iz, L.its, L.itd, s.t, Di, false));
      } else if (finite) {
        dbn_iternorm_whitening(s.ex, s.sig, Di, a.iterations, Wd,
                               iter_scratch<double>(iz, L.its, L.itd, s.t, Di, false));
      } else {
        std::fill(Wd, Wd + DD, std::numeric_limits<double>::quiet_NaN());
      }
      std::copy(s.sig, s.sig + DD, U);
      for (int64_t d = 0; d < D; ++d) l[d] = s.sig[d * D + d];
    } else if (finite) {
      eigh(s.sig, Di, U, l, s.es);
      dbn_whitening_matrix(s.ex, U, l, Di, a.eps, Wd, s.tmp, s.tmp + DD, s.tmp + 2 * DD);
    } else {
      const double nan = std::numeric_limits<double>::quiet_NaN();
      std::fill(U, U + DD, nan);
      std::fill(l, l + D, nan);
      std::fill(Wd, Wd + DD, nan);
    }
    for (int64_t i = 0; i < DD; ++i) eigvec[g * DD + i] = static_cast<A>(U[i]);
    store_whitening(g, Wd);
    for (int64_t i = 0; i < D; ++i) eigval[g * D + i] = static_cast<A>(l[i]);
    dbn_update_running(s.ex, a.stat_dtype, a.running_proj, a.running_mean, g, Di, Wd, mean,
                       a.momentum);
  }

  // The whitening product's matrix of group g in AccT: W, or with the affine
  // [diag(gamma) W | beta] (scaled in fp64, then rounded once).
  void store_whitening(int64_t g, const double* Wd) const {
    A* M = L.W + g * D * Dw;
    for (int64_t i = 0; i < D; ++i) {
      const double gi = affine ? dbn_load_stat(a.param_dtype, a.gamma, g * D + i) : 1.0;
      for (int64_t j = 0; j < D; ++j)
        M[i * Dw + j] = static_cast<A>(affine ? gi * Wd[i * D + j] : Wd[i * D + j]);
      if (affine) M[i * Dw + D] = static_cast<A>(dbn_load_stat(a.param_dtype, a.beta, g * D + i));
    }
  }

  // Pass 2: whitening, y = W (x - mu); with the affine y = [diag(gamma) W | beta] [x - mu; 1].
  void whiten_chunk(const Tls& s, int64_t it) const {
    const auto [g, j0, kc] = chunk_of(q, it);
    gather(x, q, g, j0, kc, mean + g * D, s.panel, q.ld);
    if (affine) std::fill(s.panel + D * q.ld, s.panel + D * q.ld + kc, A(1));
    apply_out(L.W + g * D * Dw, Di, Dw, s.panel, q.ld, static_cast<int>(kc), s.out, q, g, j0, y);
  }

  const char* run() {
    // Zeroed up front: a team smaller than nt must still leave every partial state defined.
    std::fill(L.acc, L.acc + nt * q.G * DD, 0.0);
    std::fill(L.tmean, L.tmean + nt * q.G * D, 0.0);
    std::fill(L.tcnt, L.tcnt + nt * q.G, 0.0);
    run_team<T, &FwdPass::stats_chunk, &FwdPass::finish_group, &FwdPass::whiten_chunk>(*this, 1);
    return nullptr;
  }
};

template <typename T>
const char* fwd_impl(const DbnFwdArgs& a) {
  Carver cv{static_cast<char*>(a.workspace)};
  return FwdPass<T>(a, &cv).run();
}

// ---- Training backward ------------------------------------------------------------------------
//
// Derivation, per group (X: D x m, Xc = X - mu 1^T, Sigma = Xc Xc^T / m + eps I, W = Sigma^{-1/2},
// Y = W Xc; L is the loss, dZ = dL/dZ):
//  1. Y = W Xc gives two paths:  dXc|direct = W^T dY = W dY   and   dW = dY Xc^T =: G_W.
//  2. W = f(Sigma) with f(l) = l^-1/2 applied to the eigenvalues. For symmetric perturbations the
//     Frechet derivative is d f(Sigma)[E] = U (K o (U^T E U)) U^T with the Daleckii-Krein matrix
//     K_ij = (f(l_i) - f(l_j)) / (l_i - l_j) (i != j), K_ii = f'(l_i). For f = l^-1/2 this is
//     exactly K_ij = -1 / (sqrt(l_i) sqrt(l_j) (sqrt(l_i) + sqrt(l_j))) for all i, j: bounded,
//     with no 1/(l_i - l_j) and no special case for equal eigenvalues. K and the map are
//     self-adjoint, so dSigma = G_S = U (K o (U^T Gs U)) U^T with Gs = (G_W + G_W^T)/2 (only the
//     symmetric part of G_W couples to a symmetric dSigma).
//  3. Sigma = Xc Xc^T / m + eps I gives dXc|Sigma = (G_S + G_S^T) Xc / m = (2/m) G_S Xc.
//  4. Xc = X - mean_cols(X) 1^T gives dX = dXc - mean_cols(dXc) 1^T. mean_cols(Xc) = 0, so the
//     Sigma path has zero column mean and only the direct path is centred:
//        dX = W (dY - mean_cols(dY) 1^T) + (2/m) G_S Xc.
//  D = 1 reduces to BatchNorm's dx = rstd (dy - mean(dy) - xhat mean(dy xhat)).
// Pass 1 accumulates G_W and sum(dY) over panels; the D x D step (dbn_bwd_small) runs in fp64;
// pass 2 is one gemm per panel with [W | B] (D x 2D) on the stacked panel [dY - mean(dY); Xc].
// Xc is recomputed from x and the saved AccT mean (exactly the forward's centring), which keeps
// fp16 inputs exact, unlike Xc = W^-1 Y from the rounded output.
// With the fused affine (y = gamma xhat + beta), dY above is gamma dy (dy: the gradient of y), so
// pass 1 sums dy Xc^T and dy unchanged and the D x D step scales: G_W's rows by gamma, and the
// apply matrix becomes [W diag(gamma) | B] on [dy - mean(dy); Xc]; dgamma_c = sum_j W_cj (dy Xc^T)_cj
// and dbeta_c = sum(dy_c) come from the D x D sums, with no extra pass over the data.
template <typename A>
struct BwdLayout {
  double* acc;    // T x G x D x D, G_W sums (row-major)
  double* dysum;  // T x G x D
  A* A2;          // G x D x 2D, [W | B]
  A* dymean;      // G x D
  A* panel;       // T x 2D x K
  A* out;         // T x D x K
  A* cb;          // T x D x D
  A* rsum;        // T x D, a dY panel's row sums
  double* U;      // T x D x D
  double* l;      // T x D
  double* GW;     // T x D x D
  double* W;      // T x D x D
  double* B;      // T x D x D
  double* tmp;    // T x bwd_tmp(): dbn_bwd_small's (H, T, Ut, sq, r) (ZCA)
  char* its;      // T x IterSizes::s_bytes, IterNorm's kept iterations and back-step matrices
  double* itd;    // T x IterSizes::d
  double* gam;    // T x 2D, gamma and dgamma of a group (fp64)
};

// Doubles of a thread's D x D scratch in the backward.
int64_t bwd_tmp(const PanelGeo& q, const DbnBwdArgs& a) {
  return a.whitening == DbnWhitening::kIterNorm ? 0 : 3 * q.D * q.D + 2 * q.D;
}

template <typename A>
BwdLayout<A> bwd_layout(Carver* c, const PanelGeo& q, int T, const DbnBwdArgs& a) {
  BwdLayout<A> L;
  const size_t DD = q.D * q.D;
  L.acc = c->take<double>(T * q.G * DD);
  L.dysum = c->take<double>(T * q.G * q.D);
  L.A2 = c->take<A>(q.G * 2 * DD);
  L.dymean = c->take<A>(q.G * q.D);
  L.panel = c->take<A>(T * 2 * q.D * q.ld);
  L.out = c->take<A>(T * q.D * q.ld);
  L.cb = c->take<A>(T * DD);
  L.rsum = c->take<A>(T * q.D);
  L.U = c->take<double>(T * DD);
  L.l = c->take<double>(T * q.D);
  L.GW = c->take<double>(T * DD);
  L.W = c->take<double>(T * DD);
  L.B = c->take<double>(T * DD);
  L.tmp = c->take<double>(T * bwd_tmp(q, a));
  const IterSizes z = iter_sizes(q, a.dtype, a.whitening, a.iterations, true);
  L.its = c->take<char>(T * z.s_bytes);
  L.itd = c->take<double>(T * z.d);
  L.gam = c->take<double>(T * 2 * q.D);
  return L;
}

// The training backward's stages over the call's shared state and one thread's scratch (Tls):
//   gram_chunk(it)   pass 1, G_W += dY Xc^T and sum(dY) of one column chunk
//   group_step(g)    merge the threads' sums, dbn_bwd_small, [W | B], dgamma / dbeta
//   apply_chunk(it)  pass 2, dX = [W | B] [dY - mean(dY); Xc] for one column chunk
template <typename T>
struct BwdPass {
  using A = AccT<T>;
  const DbnBwdArgs& a;
  PanelGeo q;
  int nt;
  BwdLayout<A> L;
  IterSizes iz;
  const T *x, *dy;
  T* dx;
  const A *mean, *eigvec, *eigval;
  int64_t D, DD;
  int Di;
  bool affine;

  struct Tls {
    int t;
    dbn_small::CpuExec ex;
    double *acc, *dys;   // the thread's G_W and sum(dY) sums
    A *pdy, *pxc, *cb, *rsum, *out;
    double *U, *l, *GW, *W, *B, *gam;
    DbnBwdScratch bs;
  };

  BwdPass(const DbnBwdArgs& args, Carver* cv)
      : a(args), q(make_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)), nt(resolve_threads(a.num_threads)),
        L(bwd_layout<A>(cv, q, nt, a)), iz(iter_sizes(q, a.dtype, a.whitening, a.iterations, true)),
        x(static_cast<const T*>(a.x)),
        dy(static_cast<const T*>(a.dy)), dx(static_cast<T*>(a.dx)),
        mean(static_cast<const A*>(a.mean)), eigvec(static_cast<const A*>(a.eigvec)),
        eigval(static_cast<const A*>(a.eigval)), D(q.D), DD(q.D * q.D),
        Di(static_cast<int>(q.D)), affine(a.gamma != nullptr) {}

  Tls tls(int t) const {
    Tls s;
    s.t = t;
    s.acc = L.acc + t * q.G * DD;
    s.dys = L.dysum + t * q.G * D;
    s.pdy = L.panel + t * 2 * D * q.ld;  // rows 0..D-1: dY
    s.pxc = s.pdy + D * q.ld;            // rows D..2D-1: Xc
    s.cb = L.cb + t * DD;
    s.rsum = L.rsum + t * D;
    s.out = L.out + t * D * q.ld;
    s.U = L.U + t * DD;
    s.l = L.l + t * D;
    s.GW = L.GW + t * DD;
    s.W = L.W + t * DD;
    s.B = L.B + t * DD;
    s.gam = L.gam + t * 2 * D;
    double* tmp = L.tmp + t * bwd_tmp(q, a);
    s.bs = DbnBwdScratch{tmp, tmp + DD, tmp + 2 * DD, tmp + 3 * DD, tmp + 3 * DD + D};
    return s;
  }

  // Pass 1: G_W = dY Xc^T and sum(dY).
  void gram_chunk(const Tls& s, int64_t it) const {
    const auto [g, j0, kc] = chunk_of(q, it);
    gather_sum(dy, q, g, j0, kc, s.pdy, q.ld, s.rsum);
    gather(x, q, g, j0, kc, mean + g * D, s.pxc, q.ld);
    panel_gram(s.pdy, s.pxc, q.ld, Di, static_cast<int>(kc), s.cb, false);  // G_W = dY Xc^T
    double* accg = s.acc + g * DD;
    for (int64_t i = 0; i < DD; ++i) accg[i] += static_cast<double>(s.cb[i]);
    double* dsg = s.dys + g * D;
    for (int64_t d = 0; d < D; ++d) dsg[d] += static_cast<double>(s.rsum[d]);
  }

  // Per group: the threads' sums, dbn_bwd_small, [W (diag(gamma)) | B], dgamma / dbeta.
  void group_step(const Tls& s, int64_t g) const {
    double *U = s.U, *l = s.l, *GW = s.GW, *W = s.W, *B = s.B;
    double *gam = s.gam, *dgam = s.gam + D;
    for (int64_t i = 0; i < DD; ++i) {
      double v = 0.0;
      for (int u = 0; u < nt; ++u) v += L.acc[(u * q.G + g) * DD + i];
      GW[i] = v;
      U[i] = static_cast<double>(eigvec[g * DD + i]);
    }
    for (int64_t d = 0; d < D; ++d) {
      double v = 0.0;
      for (int u = 0; u < nt; ++u) v += L.dysum[(u * q.G + g) * D + d];
      L.dymean[g * D + d] = static_cast<A>(v / static_cast<double>(q.m));
      l[d] = static_cast<double>(eigval[g * D + d]);
      if (affine) {
        gam[d] = dbn_load_stat(a.param_dtype, a.gamma, g * D + d);
        dbn_store_stat(a.param_dtype, a.dbeta, g * D + d, v);
      }
    }
    const double m = static_cast<double>(q.m);
    const double* gm = affine ? gam : nullptr;
    if (a.whitening == DbnWhitening::kIterNorm && iz.fp32)  // U holds the forward's Sigma
      dbn_bwd_iternorm(s.ex, U, GW, Di, a.iterations, m, gm, dgam, W, B,
                       iter_scratch<float>(iz, L.its, L.itd, s.t, Di, true));
    else if (a.whitening == DbnWhitening::kIterNorm)
      dbn_bwd_iternorm(s.ex, U, GW, Di, a.iterations, m, gm, dgam, W, B,
                       iter_scratch<double>(iz, L.its, L.itd, s.t, Di, true));
    else
      dbn_bwd_small(s.ex, U, l, GW, Di, static_cast<double>(q.m), affine ? gam : nullptr, dgam, W,
                    B, s.bs);
    A* a2 = L.A2 + g * 2 * DD;
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) {
        a2[i * 2 * D + j] = static_cast<A>(affine ? W[i * D + j] * gam[j] : W[i * D + j]);
        a2[i * 2 * D + D + j] = static_cast<A>(B[i * D + j]);
      }
    if (affine)
      for (int64_t d = 0; d < D; ++d) dbn_store_stat(a.param_dtype, a.dgamma, g * D + d, dgam[d]);
  }

  // Pass 2: dX = [W | B] [dY - mean(dY); Xc].
  void apply_chunk(const Tls& s, int64_t it) const {
    const auto [g, j0, kc] = chunk_of(q, it);
    gather(dy, q, g, j0, kc, L.dymean + g * D, s.pdy, q.ld);
    gather(x, q, g, j0, kc, mean + g * D, s.pxc, q.ld);
    apply_out(L.A2 + g * 2 * DD, Di, 2 * Di, s.pdy, q.ld, static_cast<int>(kc), s.out, q, g, j0,
              dx);
  }

  const char* run() {
    std::fill(L.acc, L.acc + nt * q.G * DD, 0.0);
    std::fill(L.dysum, L.dysum + nt * q.G * D, 0.0);
    run_team<T, &BwdPass::gram_chunk, &BwdPass::group_step, &BwdPass::apply_chunk>(*this, 4);
    return nullptr;
  }
};

template <typename T>
const char* bwd_impl(const DbnBwdArgs& a) {
  Carver cv{static_cast<char*>(a.workspace)};
  return BwdPass<T>(a, &cv).run();
}

// ---- Inference forward / backward -------------------------------------------------------------
// Forward y = P (x - r_mean), backward dx = P^T dy, one product per column panel. With the fused
// affine the forward's matrix is [diag(gamma) P | beta] on the panel [x - r_mean; 1] and the
// backward's (diag(gamma) P)^T; the backward's dgamma = sum(dy P (x - r_mean)) per channel comes
// from one more pass summing dy (x - r_mean)^T (as the training backward's pass 1) and
// dbn_affine_dgamma; dbeta = sum(dy).
template <typename A>
struct InfLayout {
  A* P;         // G x D x (D+1) (transposed for the backward; column D: beta)
  A* shift;     // C
  A* panel;     // T x 2D x K (rows 0..D: the product's input, D..2D-1: x - r_mean for dgamma)
  A* out;       // T x D x K
  // The affine backward's dgamma pass only (empty otherwise):
  A* cb;        // T x D x D, a panel's dy Xc^T
  A* rsum;      // T x D
  double* acc;  // T x G x D x D
  double* dys;  // T x G x D
  double* tmp;  // T x (2 D^2 + 2 D): P (fp64), the sums, dgamma
};

template <typename A>
InfLayout<A> inf_layout(Carver* c, const PanelGeo& q, int T, bool grads) {
  InfLayout<A> L;
  const size_t DD = q.D * q.D, g = grads ? 1 : 0;
  L.P = c->take<A>(q.G * q.D * (q.D + 1));
  L.shift = c->take<A>(q.C);
  L.panel = c->take<A>(T * 2 * q.D * q.ld);
  L.out = c->take<A>(T * q.D * q.ld);
  L.cb = c->take<A>(g * T * DD);
  L.rsum = c->take<A>(g * T * q.D);
  L.acc = c->take<double>(g * T * q.G * DD);
  L.dys = c->take<double>(g * T * q.G * q.D);
  L.tmp = c->take<double>(g * T * (2 * DD + 2 * q.D));
  return L;
}

template <typename T>
struct InfPass {
  using A = AccT<T>;
  const DbnInferenceArgs& a;
  bool backward;
  PanelGeo q;
  int nt;
  InfLayout<A> L;
  int64_t D, DD;
  int Di, Dw;
  bool affine;

  InfPass(const DbnInferenceArgs& args, bool bwd, Carver* cv)
      : a(args), backward(bwd), q(make_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)),
        nt(resolve_threads(a.num_threads)), L(inf_layout<A>(cv, q, nt, a.dgamma != nullptr)), D(q.D), DD(q.D * q.D),
        Di(static_cast<int>(q.D)), affine(a.gamma != nullptr) {
    Dw = Di + (affine && !backward ? 1 : 0);
  }

  double proj(int64_t g, int64_t i, int64_t j) const {
    return dbn_load_stat(a.stat_dtype, a.running_proj, g * DD + i * D + j);
  }
  double param(const void* p, int64_t c) const { return dbn_load_stat(a.param_dtype, p, c); }

  // The product's matrices (AccT) and the centring shift.
  void prepare() {
    for (int64_t g = 0; g < q.G; ++g) {
      A* M = L.P + g * D * Dw;
      for (int64_t i = 0; i < D; ++i) {
        const double gi = affine ? param(a.gamma, g * D + i) : 1.0;
        for (int64_t j = 0; j < D; ++j) {
          const double p = affine ? gi * proj(g, i, j) : proj(g, i, j);
          M[backward ? j * Dw + i : i * Dw + j] = static_cast<A>(p);
        }
        if (Dw > Di) M[i * Dw + D] = static_cast<A>(param(a.beta, g * D + i));
      }
    }
    for (int64_t c = 0; c < q.C; ++c)
      L.shift[c] = backward ? A(0) : static_cast<A>(dbn_load_stat(a.stat_dtype, a.running_mean, c));
  }

  // Affine backward: dgamma, dbeta from sum(dy (x - r_mean)^T) and sum(dy) per group.
  void affine_grads() {
    std::fill(L.acc, L.acc + nt * q.G * DD, 0.0);
    std::fill(L.dys, L.dys + nt * q.G * D, 0.0);
    const T* dy = static_cast<const T*>(a.x);
    const T* data = static_cast<const T*>(a.data);
    const int64_t items = q.G * q.nchunk;
#pragma omp parallel num_threads(nt)
    {
      const int t = threads::thread_id();
      A* pdy = L.panel + t * 2 * D * q.ld;
      A* pxc = pdy + D * q.ld;
      A* cb = L.cb + t * DD;
      A* rsum = L.rsum + t * D;
#pragma omp for schedule(static)
      for (int64_t it = 0; it < items; ++it) {
        const auto [g, j0, kc] = chunk_of(q, it);
        gather_sum(dy, q, g, j0, kc, pdy, q.ld, rsum);
        gather(data, q, g, j0, kc, L.shift + g * D, pxc, q.ld);
        panel_gram(pdy, pxc, q.ld, Di, static_cast<int>(kc), cb, false);
        double* accg = L.acc + (t * q.G + g) * DD;
        for (int64_t i = 0; i < DD; ++i) accg[i] += static_cast<double>(cb[i]);
        double* dsg = L.dys + (t * q.G + g) * D;
        for (int64_t d = 0; d < D; ++d) dsg[d] += static_cast<double>(rsum[d]);
      }
#pragma omp for schedule(static)
      for (int64_t g = 0; g < q.G; ++g) {
        double* Pd = L.tmp + t * (2 * DD + 2 * D);
        double* Gs = Pd + DD;
        double* dg = Gs + DD;
        for (int64_t i = 0; i < D; ++i)
          for (int64_t j = 0; j < D; ++j) Pd[i * D + j] = proj(g, i, j);
        for (int64_t i = 0; i < DD; ++i) {
          double v = 0.0;
          for (int u = 0; u < nt; ++u) v += L.acc[(u * q.G + g) * DD + i];
          Gs[i] = v;
        }
        const dbn_small::CpuExec ex;
        dbn_affine_dgamma(ex, Pd, Gs, Di, dg);
        for (int64_t d = 0; d < D; ++d) {
          double v = 0.0;
          for (int u = 0; u < nt; ++u) v += L.dys[(u * q.G + g) * D + d];
          dbn_store_stat(a.param_dtype, a.dbeta, g * D + d, v);
          dbn_store_stat(a.param_dtype, a.dgamma, g * D + d, dg[d]);
        }
      }
    }
  }

  const char* run() {
    // The backward's shift is zero, so the dgamma pass needs the running mean separately.
    if (backward && affine) {
      for (int64_t c = 0; c < q.C; ++c)
        L.shift[c] = static_cast<A>(dbn_load_stat(a.stat_dtype, a.running_mean, c));
      affine_grads();
    }
    prepare();
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    const int64_t items = q.G * q.nchunk;
#pragma omp parallel num_threads(nt)
    {
      const int t = threads::thread_id();
      A* panel = L.panel + t * 2 * D * q.ld;
      A* out = L.out + t * D * q.ld;
#pragma omp for schedule(static)
      for (int64_t it = 0; it < items; ++it) {
        const auto [g, j0, kc] = chunk_of(q, it);
        gather(x, q, g, j0, kc, L.shift + g * D, panel, q.ld);
        if (Dw > Di) std::fill(panel + D * q.ld, panel + D * q.ld + kc, A(1));
        apply_out(L.P + g * D * Dw, Di, Dw, panel, q.ld, static_cast<int>(kc), out, q, g, j0, y);
      }
    }
    return nullptr;
  }
};

template <typename T>
const char* inference_impl(const DbnInferenceArgs& a, bool backward) {
  Carver cv{static_cast<char*>(a.workspace)};
  return InfPass<T>(a, backward, &cv).run();
}

// Runs f(T{}) for the storage type of `t` (dispatch_cpu.h) and returns f's error, or the
// dispatcher's for an unsupported dtype.
template <typename F>
const char* run_typed(DType t, F&& f) {
  const char* err = nullptr;
  if (const char* e = cpu::dispatch_data(t, [&](auto tag) { err = f(tag); })) return e;
  return err;
}

// Workspace bytes of a call: layout(tag, carver, geometry, threads) carves what the kernels take
// for the data dtype; 0 for an invalid shape.
template <typename Args, typename L>
size_t ws_size(const Args& a, L&& layout) {
  if (check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return 0;
  Carver c;
  const PanelGeo q = make_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S);
  const int nt = resolve_threads(a.num_threads);
  cpu::dispatch_data(a.dtype, [&](auto tag) { layout(tag, &c, q, nt); });
  return c.off + kAlign;
}

}  // namespace

size_t dbn_fwd_workspace_cpu(const DbnFwdArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const PanelGeo& q, int nt) {
    fwd_layout<AccT<decltype(tag)>>(c, q, nt, a);
  });
}

size_t dbn_bwd_workspace_cpu(const DbnBwdArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const PanelGeo& q, int nt) {
    bwd_layout<AccT<decltype(tag)>>(c, q, nt, a);
  });
}

size_t dbn_inference_workspace_cpu(const DbnInferenceArgs& a) {
  return ws_size(a, [&a](auto tag, Carver* c, const PanelGeo& q, int nt) {
    inf_layout<AccT<decltype(tag)>>(c, q, nt, a.dgamma != nullptr);
  });
}

const char* dbn_fwd_cpu(const DbnFwdArgs& a) {
  if (const char* e = check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return e;
  if (!a.x || !a.y || !a.mean || !a.eigvec || !a.eigval || !a.workspace)
    return "forward: null pointer";
  if ((a.running_mean || a.running_proj) && !dbn_stat_dtype_ok(a.dtype, a.stat_dtype))
    return kDbnStatDtypeError;
  if (!(a.eps > 0)) return "eps must be > 0";
  if (const char* e = dbn_affine_fwd_error(a)) return e;
  if (const char* e = dbn_whitening_error(a.whitening, a.iterations)) return e;
  return run_typed(a.dtype, [&](auto tag) { return fwd_impl<decltype(tag)>(a); });
}

const char* dbn_bwd_cpu(const DbnBwdArgs& a) {
  if (const char* e = check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return e;
  if (!a.dy || !a.x || !a.mean || !a.eigvec || !a.eigval || !a.dx || !a.workspace)
    return "backward: null pointer";
  if (const char* e = dbn_affine_bwd_error(a)) return e;
  if (const char* e = dbn_whitening_error(a.whitening, a.iterations)) return e;
  return run_typed(a.dtype, [&](auto tag) { return bwd_impl<decltype(tag)>(a); });
}

static const char* inference_dispatch(const DbnInferenceArgs& a, bool backward) {
  if (const char* e = check_geo(a.dims.N, a.dims.C, a.dims.G, a.dims.S)) return e;
  if (!a.x || !a.y || !a.running_proj || (!backward && !a.running_mean) || !a.workspace)
    return "inference: null pointer";
  if (!dbn_stat_dtype_ok(a.dtype, a.stat_dtype))
    return kDbnStatDtypeError;
  if (const char* e = dbn_affine_inf_error(a, backward)) return e;
  if (backward && a.gamma && !a.running_mean) return "inference: null pointer";
  return run_typed(a.dtype, [&](auto tag) { return inference_impl<decltype(tag)>(a, backward); });
}

const char* dbn_inference_cpu(const DbnInferenceArgs& a) { return inference_dispatch(a, false); }
const char* dbn_inference_bwd_cpu(const DbnInferenceArgs& a) {
  return inference_dispatch(a, true);
}

}  // namespace gn_mx
