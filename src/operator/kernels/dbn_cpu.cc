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

// ---- Training forward -------------------------------------------------------------------------
template <typename A>
struct FwdLayout {
  double* acc;   // T x G x D x D, fp64 centred sums M2 (upper triangle, column-major)
  double* tmean; // T x G x D, fp64 running mean of the chunks a thread merged
  double* tcnt;  // T x G, their column count
  double* delta; // T x D
  A* csum;       // T x D, a chunk's row sums
  A* W;          // G x D x D, Sigma^{-1/2} in AccT for the whitening gemm
  A* panel;      // T x D x K
  A* out;        // T x D x K
  A* cb;         // T x D x D, one chunk's syrk result
  double* sig;   // T x D x D
  double* U;     // T x D x D
  double* l;     // T x D
  double* Wd;    // T x D x D
  double* ea;    // T x D x D, eigensolver matrix
  double* tmp;   // T x (2 D^2 + D), dbn_whitening_matrix scratch (Ut, V, r)
  double* work;  // T x lwork
  int* iwork;    // T x liwork
};

template <typename A>
FwdLayout<A> fwd_layout(Carver* c, const PanelGeo& q, int T) {
  FwdLayout<A> L;
  const size_t DD = q.D * q.D;
  L.acc = c->take<double>(T * q.G * DD);
  L.tmean = c->take<double>(T * q.G * q.D);
  L.tcnt = c->take<double>(T * q.G);
  L.delta = c->take<double>(T * q.D);
  L.csum = c->take<A>(T * q.D);
  L.W = c->take<A>(q.G * DD);
  L.panel = c->take<A>(T * q.D * q.ld);
  L.out = c->take<A>(T * q.D * q.ld);
  L.cb = c->take<A>(T * DD);
  L.sig = c->take<double>(T * DD);
  L.U = c->take<double>(T * DD);
  L.l = c->take<double>(T * q.D);
  L.Wd = c->take<double>(T * DD);
  L.ea = c->take<double>(T * DD);
  L.tmp = c->take<double>(T * (2 * DD + q.D));
  L.work = c->take<double>(T * eig_lwork(q.D));
  L.iwork = c->take<int>(T * eig_liwork(q.D));
  return L;
}

template <typename T>
const char* fwd_impl(const DbnFwdArgs& a) {
  using A = AccT<T>;
  const PanelGeo q = make_geo(a.N, a.C, a.G, a.S);
  const int nt = resolve_threads(a.num_threads);
  Carver cv{static_cast<char*>(a.workspace)};
  const FwdLayout<A> L = fwd_layout<A>(&cv, q, nt);
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  A* mean = static_cast<A*>(a.mean);
  A* eigvec = static_cast<A*>(a.eigvec);
  A* eigval = static_cast<A*>(a.eigval);
  const int64_t D = q.D, DD = D * D;
  const int Di = static_cast<int>(D);
  const int64_t gb = group_block(q, sizeof(T), nt);
  const bool per_group = use_per_group(q, sizeof(T), nt);
  // Zeroed up front: a team smaller than nt must still leave every partial state defined.
  std::fill(L.acc, L.acc + nt * q.G * DD, 0.0);
  std::fill(L.tmean, L.tmean + nt * q.G * D, 0.0);
  std::fill(L.tcnt, L.tcnt + nt * q.G, 0.0);

#pragma omp parallel num_threads(nt)
  {
    const int t = threads::thread_id();
    const dbn_small::CpuExec ex;
    // Pass 1: mean and covariance in one read of x. Each chunk is centred on its own mean while
    // it sits in cache (exact two-pass statistics of the chunk), then merged into the thread's
    // fp64 state with Chan's update, the matrix form of welford.h's merge:
    //   delta = mean_b - mean_a, n = n_a + n_b,
    //   mean += delta n_b / n,   M2 = M2_a + M2_b + delta delta^T n_a n_b / n.
    // No E[xx^T] - mu mu^T cancellation anywhere, whatever the offset of the data.
    double* acc_t = L.acc + t * q.G * DD;
    A* panel = L.panel + t * D * q.ld;
    A* cb = L.cb + t * DD;
    A* csum = L.csum + t * D;
    double* delta = L.delta + t * D;
    const EigScratch es{L.ea + t * DD, L.work + t * eig_lwork(D), L.iwork + t * eig_liwork(D),
                        static_cast<int>(eig_lwork(D)), static_cast<int>(eig_liwork(D))};
    double* sig = L.sig + t * DD;
    double* U = L.U + t * DD;
    double* l = L.l + t * D;
    double* Wd = L.Wd + t * DD;
    A* out = L.out + t * D * q.ld;
    auto stats_chunk = [&](int64_t it) {
      const auto [g, j0, kc] = chunk_of(q, it);
      gather_sum(x, q, g, j0, kc, panel, q.ld, csum);
      for (int64_t d = 0; d < D; ++d) {
        A* row = panel + d * q.ld;
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
      panel_gram(panel, panel, q.ld, Di, static_cast<int>(kc), cb, true);
      double* accg = acc_t + g * DD;
      double* tmean = L.tmean + (t * q.G + g) * D;
      double& na = L.tcnt[t * q.G + g];
      const double nb = static_cast<double>(kc), n = na + nb, w = na * nb / n;
      for (int64_t d = 0; d < D; ++d) {
        const double r = delta[d];
        delta[d] = static_cast<double>(csum[d]) + r / nb - tmean[d];  // mean_b - mean_a
        csum[d] = static_cast<A>(r);
      }
      for (int64_t j = 0; j < D; ++j) {
        const double rj = static_cast<double>(csum[j]) / nb, dj = delta[j] * w;
        for (int64_t i = 0; i <= j; ++i)
          accg[i + j * D] += static_cast<double>(cb[i + j * D]) -
                             static_cast<double>(csum[i]) * rj + delta[i] * dj;
      }
      for (int64_t d = 0; d < D; ++d) tmean[d] += delta[d] * nb / n;
      na = n;
    };
    // Per group: Sigma, eigh, W, running statistics.
    auto finish_group = [&](int64_t g) {
      // Merge the threads' (count, mean, M2) states (Chan), into l (mean) and Wd (M2).
      double n = 0.0;
      std::fill(l, l + D, 0.0);
      std::fill(Wd, Wd + DD, 0.0);
      for (int u = 0; u < nt; ++u) {
        const double nb = L.tcnt[u * q.G + g];
        if (nb == 0) continue;
        const double* mb = L.tmean + (u * q.G + g) * D;
        const double* m2b = L.acc + (u * q.G + g) * DD;
        const double nn = n + nb, w = n * nb / nn;
        for (int64_t j = 0; j < D; ++j)
          for (int64_t i = 0; i <= j; ++i)
            Wd[i + j * D] += m2b[i + j * D] + (mb[i] - l[i]) * (mb[j] - l[j]) * w;
        for (int64_t d = 0; d < D; ++d) l[d] += (mb[d] - l[d]) * nb / nn;
        n = nn;
      }
      for (int64_t d = 0; d < D; ++d) mean[g * D + d] = static_cast<A>(l[d]);
      bool finite = true;
      for (int64_t j = 0; j < D; ++j)
        for (int64_t i = 0; i <= j; ++i) {
          double s = Wd[i + j * D] / static_cast<double>(q.m);
          if (i == j) s += a.eps;
          sig[i * D + j] = sig[j * D + i] = s;
          finite = finite && std::isfinite(s);
        }
      if (finite) {
        eigh(sig, Di, U, l, es);
        double* tmp = L.tmp + t * (2 * DD + D);
        dbn_whitening_matrix(ex, U, l, Di, a.eps, Wd, tmp, tmp + DD, tmp + 2 * DD);
      } else {
        const double nan = std::numeric_limits<double>::quiet_NaN();
        std::fill(U, U + DD, nan);
        std::fill(l, l + D, nan);
        std::fill(Wd, Wd + DD, nan);
      }
      for (int64_t i = 0; i < DD; ++i) {
        eigvec[g * DD + i] = static_cast<A>(U[i]);
        L.W[g * DD + i] = static_cast<A>(Wd[i]);
      }
      for (int64_t i = 0; i < D; ++i) eigval[g * D + i] = static_cast<A>(l[i]);
      dbn_update_running(ex, a.stat_dtype, a.running_proj, a.running_mean, g, Di, Wd, mean,
                         a.momentum);
    };
    // Pass 3: whitening, y = W (x - mu).
    auto whiten_chunk = [&](int64_t it) {
      const auto [g, j0, kc] = chunk_of(q, it);
      gather(x, q, g, j0, kc, mean + g * D, panel, q.ld);
      apply_out(L.W + g * DD, Di, Di, panel, q.ld, static_cast<int>(kc), out, q, g, j0, y);
    };
    run_stages(q, per_group, gb, 1, stats_chunk, finish_group, whiten_chunk);
  }
  return nullptr;
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
  double* tmp;    // T x (3 D^2 + 2 D), dbn_bwd_small scratch (H, T, Ut, sq, r)
};

template <typename A>
BwdLayout<A> bwd_layout(Carver* c, const PanelGeo& q, int T) {
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
  L.tmp = c->take<double>(T * (3 * DD + 2 * q.D));
  return L;
}

template <typename T>
const char* bwd_impl(const DbnBwdArgs& a) {
  using A = AccT<T>;
  const PanelGeo q = make_geo(a.N, a.C, a.G, a.S);
  const int nt = resolve_threads(a.num_threads);
  Carver cv{static_cast<char*>(a.workspace)};
  const BwdLayout<A> L = bwd_layout<A>(&cv, q, nt);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const A* mean = static_cast<const A*>(a.mean);
  const A* eigvec = static_cast<const A*>(a.eigvec);
  const A* eigval = static_cast<const A*>(a.eigval);
  const int64_t D = q.D, DD = D * D;
  const int Di = static_cast<int>(D);
  const int64_t gb = group_block(q, sizeof(T), nt);
  const bool per_group = use_per_group(q, sizeof(T), nt);
  std::fill(L.acc, L.acc + nt * q.G * DD, 0.0);
  std::fill(L.dysum, L.dysum + nt * q.G * D, 0.0);

#pragma omp parallel num_threads(nt)
  {
    const int t = threads::thread_id();
    const dbn_small::CpuExec ex;
    double* acc_t = L.acc + t * q.G * DD;
    double* dys_t = L.dysum + t * q.G * D;
    A* pdy = L.panel + t * 2 * D * q.ld;  // rows 0..D-1: dY
    A* pxc = pdy + D * q.ld;              // rows D..2D-1: Xc
    A* cb = L.cb + t * DD;
    double* U = L.U + t * DD;
    double* l = L.l + t * D;
    double* GW = L.GW + t * DD;
    double* W = L.W + t * DD;
    double* B = L.B + t * DD;
    double* tmp = L.tmp + t * (3 * DD + 2 * D);
    const DbnBwdScratch bs{tmp, tmp + DD, tmp + 2 * DD, tmp + 3 * DD, tmp + 3 * DD + D};
    A* out = L.out + t * D * q.ld;
    // Pass 1: G_W = dY Xc^T and sum(dY).
    auto gram_chunk = [&](int64_t it) {
      const auto [g, j0, kc] = chunk_of(q, it);
      gather_sum(dy, q, g, j0, kc, pdy, q.ld, L.rsum + t * D);
      gather(x, q, g, j0, kc, mean + g * D, pxc, q.ld);
      panel_gram(pdy, pxc, q.ld, Di, static_cast<int>(kc), cb, false);  // G_W = dY Xc^T
      double* accg = acc_t + g * DD;
      for (int64_t i = 0; i < DD; ++i) accg[i] += static_cast<double>(cb[i]);
      double* dsg = dys_t + g * D;
      for (int64_t d = 0; d < D; ++d) dsg[d] += static_cast<double>(L.rsum[t * D + d]);
    };
    auto group_step = [&](int64_t g) {
      for (int64_t i = 0; i < DD; ++i) {
        double s = 0.0;
        for (int u = 0; u < nt; ++u) s += L.acc[(u * q.G + g) * DD + i];
        GW[i] = s;
        U[i] = static_cast<double>(eigvec[g * DD + i]);
      }
      for (int64_t d = 0; d < D; ++d) {
        double s = 0.0;
        for (int u = 0; u < nt; ++u) s += L.dysum[(u * q.G + g) * D + d];
        L.dymean[g * D + d] = static_cast<A>(s / static_cast<double>(q.m));
        l[d] = static_cast<double>(eigval[g * D + d]);
      }
      dbn_bwd_small(ex, U, l, GW, Di, static_cast<double>(q.m), W, B, bs);
      A* a2 = L.A2 + g * 2 * DD;
      for (int64_t i = 0; i < D; ++i)
        for (int64_t j = 0; j < D; ++j) {
          a2[i * 2 * D + j] = static_cast<A>(W[i * D + j]);
          a2[i * 2 * D + D + j] = static_cast<A>(B[i * D + j]);
        }
    };
    // Pass 2: dX = [W | B] [dY - mean(dY); Xc].
    auto apply_chunk = [&](int64_t it) {
      const auto [g, j0, kc] = chunk_of(q, it);
      gather(dy, q, g, j0, kc, L.dymean + g * D, pdy, q.ld);
      gather(x, q, g, j0, kc, mean + g * D, pxc, q.ld);
      apply_out(L.A2 + g * 2 * DD, Di, 2 * Di, pdy, q.ld, static_cast<int>(kc), out, q, g, j0, dx);
    };
    run_stages(q, per_group, gb, 4, gram_chunk, group_step, apply_chunk);
  }
  return nullptr;
}

// ---- Inference forward / backward -------------------------------------------------------------
template <typename A>
struct InfLayout {
  A* P;      // G x D x D (transposed for the backward)
  A* shift;  // C
  A* panel;  // T x D x K
  A* out;    // T x D x K
};

template <typename A>
InfLayout<A> inf_layout(Carver* c, const PanelGeo& q, int T) {
  InfLayout<A> L;
  L.P = c->take<A>(q.G * q.D * q.D);
  L.shift = c->take<A>(q.C);
  L.panel = c->take<A>(T * q.D * q.ld);
  L.out = c->take<A>(T * q.D * q.ld);
  return L;
}

template <typename T>
const char* inference_impl(const DbnInferenceArgs& a, bool backward) {
  using A = AccT<T>;
  const PanelGeo q = make_geo(a.N, a.C, a.G, a.S);
  const int nt = resolve_threads(a.num_threads);
  Carver cv{static_cast<char*>(a.workspace)};
  const InfLayout<A> L = inf_layout<A>(&cv, q, nt);
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const int64_t D = q.D, DD = D * D;
  const int Di = static_cast<int>(D);
  for (int64_t g = 0; g < q.G; ++g)
    for (int64_t i = 0; i < D; ++i)
      for (int64_t j = 0; j < D; ++j) {
        const double p = dbn_load_stat(a.stat_dtype, a.running_proj, g * DD + i * D + j);
        L.P[g * DD + (backward ? j * D + i : i * D + j)] = static_cast<A>(p);
      }
  for (int64_t c = 0; c < q.C; ++c)
    L.shift[c] = backward ? A(0) : static_cast<A>(dbn_load_stat(a.stat_dtype, a.running_mean, c));
  const int64_t items = q.G * q.nchunk;
#pragma omp parallel num_threads(nt)
  {
    const int t = threads::thread_id();
    A* panel = L.panel + t * D * q.ld;
    A* out = L.out + t * D * q.ld;
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const auto [g, j0, kc] = chunk_of(q, it);
      gather(x, q, g, j0, kc, L.shift + g * D, panel, q.ld);
      apply_out(L.P + g * DD, Di, Di, panel, q.ld, static_cast<int>(kc), out, q, g, j0, y);
    }
  }
  return nullptr;
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
  if (check_geo(a.N, a.C, a.G, a.S)) return 0;
  Carver c;
  const PanelGeo q = make_geo(a.N, a.C, a.G, a.S);
  const int nt = resolve_threads(a.num_threads);
  cpu::dispatch_data(a.dtype, [&](auto tag) { layout(tag, &c, q, nt); });
  return c.off + kAlign;
}

}  // namespace

size_t dbn_fwd_workspace_cpu(const DbnFwdArgs& a) {
  return ws_size(a, [](auto tag, Carver* c, const PanelGeo& q, int nt) {
    fwd_layout<AccT<decltype(tag)>>(c, q, nt);
  });
}

size_t dbn_bwd_workspace_cpu(const DbnBwdArgs& a) {
  return ws_size(a, [](auto tag, Carver* c, const PanelGeo& q, int nt) {
    bwd_layout<AccT<decltype(tag)>>(c, q, nt);
  });
}

size_t dbn_inference_workspace_cpu(const DbnInferenceArgs& a) {
  return ws_size(a, [](auto tag, Carver* c, const PanelGeo& q, int nt) {
    inf_layout<AccT<decltype(tag)>>(c, q, nt);
  });
}

const char* dbn_fwd_cpu(const DbnFwdArgs& a) {
  if (const char* e = check_geo(a.N, a.C, a.G, a.S)) return e;
  if (!a.x || !a.y || !a.mean || !a.eigvec || !a.eigval || !a.workspace)
    return "forward: null pointer";
  if ((a.running_mean || a.running_proj) && !dbn_stat_dtype_ok(a.dtype, a.stat_dtype))
    return kDbnStatDtypeError;
  if (!(a.eps > 0)) return "eps must be > 0";
  return run_typed(a.dtype, [&](auto tag) { return fwd_impl<decltype(tag)>(a); });
}

const char* dbn_bwd_cpu(const DbnBwdArgs& a) {
  if (const char* e = check_geo(a.N, a.C, a.G, a.S)) return e;
  if (!a.dy || !a.x || !a.mean || !a.eigvec || !a.eigval || !a.dx || !a.workspace)
    return "backward: null pointer";
  return run_typed(a.dtype, [&](auto tag) { return bwd_impl<decltype(tag)>(a); });
}

static const char* inference_dispatch(const DbnInferenceArgs& a, bool backward) {
  if (const char* e = check_geo(a.N, a.C, a.G, a.S)) return e;
  if (!a.x || !a.y || !a.running_proj || (!backward && !a.running_mean) || !a.workspace)
    return "inference: null pointer";
  if (!dbn_stat_dtype_ok(a.dtype, a.stat_dtype))
    return kDbnStatDtypeError;
  return run_typed(a.dtype, [&](auto tag) { return inference_impl<decltype(tag)>(a, backward); });
}

const char* dbn_inference_cpu(const DbnInferenceArgs& a) { return inference_dispatch(a, false); }
const char* dbn_inference_bwd_cpu(const DbnInferenceArgs& a) {
  return inference_dispatch(a, true);
}

}  // namespace gn_mx
