/*
 * group_norm_nsc_cpu.cc: CPU kernels for gn_moments and gn_group_norm on channels-last data (N, S, C),
 * GroupDims::channels_last; the twin of group_norm_nsc_cuda.cu. Entry points: group_norm_nsc_cpu.h,
 * called by group_norm_cpu.cc's dispatch; the thread plan, exact groups and backward workspace come
 * from group_norm_cpu_common.h, the formulas from group_norm_math.h, the row primitives from
 * simd_rows_cpu.h.
 *
 * A group is D contiguous channels at each of S positions, so the kernels walk rows (positions) of C
 * channels with per-channel coefficients (simd_rows_cpu.h) instead of runs of one group:
 *   forward:  statistics of all G groups of a sample in one read of its rows, in chunks of
 *             kRowChunk elements (whole rows, L1-resident): per chunk the column sums give every
 *             group's chunk mean, a second (cached) read the centred column M2, merged per group with
 *             Chan's update (welford.h): the chunked, exact-centred statistics of the channels-first
 *             path. Then y = act(x * a_c + b_c) in a second read of the sample's rows.
 *   backward: the per-(n, c) sums dsc_c = sum g (x - mu), db_c = sum g (one read of x and dy per
 *             sample, chunk by chunk), then dx in a second read; bwd_params as channels first.
 * The forward's second read walks a thread's rows backwards (last chunk first): every group needs
 * the whole sample's statistics, so rows cannot be applied while the reduction holds them, but it
 * starts on the rows the reduction left in L2; outputs of kStreamBytesFwd and more (fp32 / fp64)
 * are computed into an L1 chunk buffer and streamed out (RowPrims::stream), as channels first
 * writes them. The backward's dx pass stays forwards with cached stores: with both changes it
 * timed 1.0-1.35x slower in two interleaved A/B runs on the loaded machine (inconclusive, not kept).
 * (Blocks of whole groups read down all rows, rows C apart, so that a block could be applied from L2
 * like a channels-first group, were tried: blocks narrow enough for L2 (16-20
 * channels at S = 4096-16384) ran 2-5x slower than whole rows, in scalar column loops and strided
 * lines; not kept.)
 * Threads (run_samples): per sample, or, when N is small or uneven for the team, each thread takes
 * the same row slice of every sample and the partials meet after one barrier per sample, combined in
 * thread order (identical coefficients in every thread), as run_groups does for groups.
 * Exactly recomputed groups: the same gn_exact_group / gn_exact_moments rule; their values are
 * rewritten by exact_fwd / exact_bwd (strided GroupWalk) after the fast pass has written the whole
 * rows (a barrier first when threads share a sample). Samples whose groups have at most
 * kGnExactGroup elements are recomputed whole, without the fast pass.
 */
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "group_norm_nsc_cpu.h"
#include "group_norm_cpu_common.h"
#include "group_norm_math.h"
#include "simd_cpu.h"
#include "simd_rows_cpu.h"
#include "../common/welford.h"

namespace gn_mx {
namespace {

constexpr int64_t kRowChunk = 4096;  // elements per statistics chunk (16 KB fp32): fits L1
// Rows per chunk at most: each column sum runs sequentially down the rows, so its rounding grows
// with their count; 64 keeps a constant group's mean within the edge cases' 16 ulp (576 rows of
// 0.37 in one sum: 20 ulp) at one merge of C values per 64 rows.
constexpr int64_t kRowChunkMaxRows = 64;

// Rows per chunk for C channels: whole rows, at least one.
int64_t chunk_rows(int64_t C) {
  return std::max<int64_t>(1, std::min(kRowChunkMaxRows, kRowChunk / C));
}

// Rows [lo, hi) of thread t of T over S positions.
void row_slice(int64_t S, int t, int T, int64_t* lo, int64_t* hi) {
  const int64_t per = (S + T - 1) / T;
  *lo = std::min(S, per * t);
  *hi = std::min(S, *lo + per);
}

// Whether the channels-last output of data dims is streamed: fp32 / fp64 data (fp16 rows are
// narrowed through RowIo's cached stores) of at least threshold bytes.
template <typename T>
bool stream_rows(const GroupDims& d, int64_t threshold) {
  return std::is_same<T, AccT<T>>::value && stream_output(d.N * d.S * d.C, sizeof(T), threshold);
}

// AccT rows of data of dtype T: the data itself when T is AccT (fp32 / fp64), else widened into
// (or narrowed from) a buffer of the thread.
template <typename T>
struct RowIo {
  using A = AccT<T>;
  static constexpr bool kSame = std::is_same<T, A>::value;
  const simd::Prims<T>& P;
  const A* in(const T* p, A* buf, int64_t n) const {
    if (kSame) return reinterpret_cast<const A*>(p);
    P.load(p, buf, n);
    return buf;
  }
  A* out(T* p, A* buf) const { return kSame ? reinterpret_cast<A*>(p) : buf; }
  void flush(const A* buf, T* p, int64_t n) const {
    if (!kSame) P.store(buf, p, n);
  }
};

// The channels-last schedule: a job is a reduction over each sample's rows, a combination of the
// threads' partials, an elementwise pass over the rows and the rewrite of exactly recomputed groups.
//   Scratch            per-thread buffers (constructed by each thread from the job)
//   part_len()         values of one thread's partial of one sample
//   begin(n, sc)       per-sample set-up of the thread's scratch (before reduce)
//   reduce(n, lo, hi, part, sc)    partial over the rows [lo, hi)
//   finish(n, parts, k, owner, sc) combines k partials in thread order into sc's coefficients, the
//                      owner publishes the sample's outputs; returns whether any group is exact
//   apply(n, lo, hi, sc)           the elementwise pass (kApply)
//   exact(n, g, sc)    rewrites group g if sc marks it exact
template <class Job>
void run_samples(const Job& job, int64_t N, int64_t S, int64_t C) {
  using Part = typename Job::Part;
  const Plan pl = make_plan(N, S * C);
  const size_t len = job.part_len(), nt = static_cast<size_t>(pl.nt);
  if (!pl.coop) {
    std::vector<Part> part(nt * len);
#pragma omp parallel num_threads(pl.nt) if (pl.nt > 1)
    {
      typename Job::Scratch sc(job);
      Part* mine = part.data() + thread_id() * len;
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        job.begin(n, sc);
        job.reduce(n, 0, S, mine, sc);
        const bool any_exact = job.finish(n, mine, 1, true, sc);
        if (Job::kApply) job.apply(n, 0, S, sc);
        if (any_exact)
          for (int64_t g = 0; g < job.G; ++g) job.exact(n, g, sc);
      }
      job.end_thread();
    }
    return;
  }
  std::vector<Part> part(2 * nt * len);
#pragma omp parallel num_threads(pl.nt)
  {
    typename Job::Scratch sc(job);
    const int t = thread_id(), T_ = num_threads();
    int64_t lo, hi;
    row_slice(S, t, T_, &lo, &hi);
    for (int64_t n = 0; n < N; ++n) {
      Part* base = part.data() + (n & 1) * nt * len;
      job.begin(n, sc);
      job.reduce(n, lo, hi, base + t * len, sc);
      barrier();
      const bool any_exact = job.finish(n, base, T_, t == 0, sc);  // same partials in every thread
      if (Job::kApply) job.apply(n, lo, hi, sc);
      if (any_exact) {
        if (Job::kApply) barrier();  // the fast pass has written every row of the sample
        for (int64_t g = t; g < job.G; g += T_) job.exact(n, g, sc);
      }
    }
    job.end_thread();
  }
}

// Per-group statistics of rows of C channels in G groups of D: the reduction of the channels-last
// forward and gn_moments. Per chunk of rows, every channel's exact (mean, M2) (column sums, then
// the centred column M2 in a second read of the L1-resident chunk), merged into per-channel running
// states with Chan's update (all channels hold the same count: vector loops, one division per
// chunk); at the end the D channel states of each group merge into w[g]: the rows [lo, hi) of
// sample n. Rows lie ld apart (ld > C: x is a block of C channels of wider rows; fp32 / fp64 only).
template <typename T>
struct RowStats {
  using A = AccT<T>;
  const simd::Prims<T>& P;
  const simd::RowPrims<A>& R;
  const T* x;
  int64_t S, C, G, D, ld;

  struct Buffers {
    std::vector<A> buf, col, mu, mean, m2;
    Buffers(int64_t C)
        : buf(RowIo<T>::kSame ? 0 : chunk_rows(C) * C), col(C), mu(C), mean(C), m2(C) {}
  };

  void reduce(int64_t n, int64_t lo, int64_t hi, Welford<A>* w, Buffers& b) const {
    const RowIo<T> io{P};
    const int64_t rows = chunk_rows(C);
    int64_t have = 0;  // rows merged into b.mean / b.m2
    for (int64_t r0 = lo; r0 < hi; r0 += rows) {
      const int64_t rr = std::min(rows, hi - r0);
      const A* xr = io.in(x + (n * S + r0) * ld, b.buf.data(), rr * C);
      A* cm = have ? b.mu.data() : b.mean.data();  // the first chunk is the state
      A* cm2 = have ? b.col.data() : b.m2.data();
      R.col_sum(xr, rr, C, ld, A(1) / static_cast<A>(rr), cm);
      R.col_m2(xr, rr, C, ld, cm, cm2);
      if (have) {
        const A na = static_cast<A>(have), nb = static_cast<A>(rr), tot = na + nb;
        R.chan_merge(b.mean.data(), b.m2.data(), cm, cm2, C, nb / tot, na * nb / tot);
      }
      have += rr;
    }
    const A cnt = static_cast<A>(have);
    for (int64_t g = 0; g < G; ++g) {
      w[g] = Welford<A>();
      if (have == 0) continue;
      for (int64_t c = g * D; c < (g + 1) * D; ++c)
        w[g].merge(make_welford<A>(cnt, b.mean[c], b.m2[c]));
    }
  }
};

// gn_moments on channels-last data: reduction only.
template <typename T>
struct MomentsRowsJob {
  using A = AccT<T>;
  using Part = Welford<A>;
  static constexpr bool kApply = false;
  RowStats<T> st;
  A* mean;
  A* var;
  int64_t G;
  GroupDims dims;

  struct Scratch : RowStats<T>::Buffers {
    explicit Scratch(const MomentsRowsJob& j) : RowStats<T>::Buffers(j.st.C) {}
  };
  size_t part_len() const { return static_cast<size_t>(G); }
  void begin(int64_t, Scratch&) const {}
  void reduce(int64_t n, int64_t lo, int64_t hi, Part* p, Scratch& sc) const {
    st.reduce(n, lo, hi, p, sc);
  }
  bool finish(int64_t n, const Part* parts, int k, bool owner, Scratch&) const {
    if (!owner) return false;
    const int64_t M = dims.D * dims.S;
    for (int64_t g = 0; g < G; ++g) {
      Welford<A> w;
      for (int u = 0; u < k; ++u) w.merge(parts[u * G + g]);
      const int64_t ng = n * G + g;
      mean[ng] = w.mean;
      var[ng] = w.var();
      if (gn_exact_moments<T>(w.mean, w.var(), M))
        exact_moments(st.x + group_offset(dims, n, g), group_walk(dims), mean + ng, var + ng);
    }
    return false;
  }
  void apply(int64_t, int64_t, int64_t, Scratch&) const {}
  void exact(int64_t, int64_t, Scratch&) const {}
  void end_thread() const {}
};

// gn_group_norm forward on channels-last data.
template <typename T, Act ACT>
struct FwdRowsJob {
  using A = AccT<T>;
  using Part = Welford<A>;
  static constexpr bool kApply = true;
  RowStats<T> st;
  T* y;
  A* mean;
  A* rstd;
  const A* gam;
  const A* bet;
  int64_t G;
  GroupDims dims;
  double eps;
  A eps_acc;
  bool nt;  // streaming stores (fp32 / fp64 data only: stream_rows)

  struct Scratch : RowStats<T>::Buffers {
    std::vector<A> a, b, ob;  // ob: the chunk streamed out (nt)
    std::vector<char> ex;     // group is recomputed exactly
    explicit Scratch(const FwdRowsJob& j)
        : RowStats<T>::Buffers(j.st.C),
          a(j.st.C),
          b(j.st.C),
          ob(j.nt ? chunk_rows(j.st.C) * j.st.C : 0),
          ex(j.G) {}
  };
  size_t part_len() const { return static_cast<size_t>(G); }
  void begin(int64_t, Scratch&) const {}
  void reduce(int64_t n, int64_t lo, int64_t hi, Part* p, Scratch& sc) const {
    st.reduce(n, lo, hi, p, sc);
  }
  bool finish(int64_t n, const Part* parts, int k, bool owner, Scratch& sc) const {
    const int64_t D = dims.D, M = D * dims.S;
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      Welford<A> w;
      for (int u = 0; u < k; ++u) w.merge(parts[u * G + g]);
      const A r = gn_rstd<A>(w.var(), eps_acc);
      const bool ex = gn_exact_group<T>(w.mean, r, M);
      sc.ex[g] = ex;
      any = any || ex;
      if (owner && !ex) {
        mean[n * G + g] = w.mean;
        rstd[n * G + g] = r;
      }
      for (int64_t c = g * D; c < (g + 1) * D; ++c) gn_fwd_coeffs<A>(w.mean, r, gam[c], bet[c], &sc.a[c], &sc.b[c]);
    }
    return any;
  }
  void apply(int64_t n, int64_t lo, int64_t hi, Scratch& sc) const {
    const RowIo<T> io{st.P};
    const int64_t C = st.C, rows = chunk_rows(C);
    for (int64_t k = (hi - lo + rows - 1) / rows - 1; k >= 0; --k) {  // backwards: L2 first
      const int64_t r0 = lo + k * rows, rr = std::min(rows, hi - r0), off = (n * st.S + r0) * C;
      const A* xr = io.in(st.x + off, sc.buf.data(), rr * C);
      A* yr = nt ? sc.ob.data() : io.out(y + off, sc.buf.data());
      st.R.affine[static_cast<int>(ACT)](xr, yr, rr, C, C, sc.a.data(), sc.b.data());
      if (nt)
        st.R.stream(yr, reinterpret_cast<A*>(y + off), rr * C);
      else
        io.flush(yr, y + off, rr * C);
    }
    if (nt) st.P.fence();  // before the barrier that precedes exact rewrites and the caller
  }
  void exact(int64_t n, int64_t g, Scratch& sc) const {
    if (!sc.ex[g]) return;
    const int64_t off = group_offset(dims, n, g);
    exact_fwd<T, ACT>(st.x + off, y + off, group_walk(dims), eps, gam + g * dims.D,
                      bet + g * dims.D, mean + n * G + g, rstd + n * G + g);
  }
  void end_thread() const {}
};

// gn_group_norm's input gradient (and the per-(n, c) sums of the parameter gradients) on
// channels-last data. The partial of a thread is 2*C sums: s1[c] = sum g (x - mu), s2[c] = sum g.
template <typename T, Act ACT>
struct BwdRowsJob {
  using A = AccT<T>;
  using Part = A;
  static constexpr bool kApply = true;
  const simd::Prims<T>& P;
  const simd::RowPrims<A>& R;
  const T* x;
  const T* dy;
  T* dx;
  const A* mean;
  const A* rstd;
  const A* dmean_o;  // (N, G) or nullptr (= 0)
  const A* drstd_o;
  const A* gam;
  const A* bet;
  BwdSums<A> sums;
  int64_t G;
  GroupDims dims;
  double eps;

  struct Scratch {
    std::vector<A> bx, bg, mu, a, b, c1, c2, c3, t1, t2;
    std::vector<char> ex;
    explicit Scratch(const BwdRowsJob& j) {
      const int64_t C = j.dims.C, buf = RowIo<T>::kSame ? 0 : chunk_rows(C) * C;
      bx.resize(buf);
      bg.resize(buf);
      for (auto* v : {&mu, &a, &b, &c1, &c2, &c3, &t1, &t2}) v->resize(C);
      ex.resize(j.G);
    }
  };
  size_t part_len() const { return 2 * static_cast<size_t>(dims.C); }
  // The per-channel mean and pre-activation coefficients from the saved statistics.
  void begin(int64_t n, Scratch& sc) const {
    const int64_t D = dims.D;
    for (int64_t g = 0; g < G; ++g) {
      const A mu = mean[n * G + g], r = rstd[n * G + g];
      sc.ex[g] = gn_exact_group<T>(mu, r, D * dims.S);
      for (int64_t c = g * D; c < (g + 1) * D; ++c) {
        sc.mu[c] = mu;
        gn_fwd_coeffs<A>(mu, r, gam[c], bet[c], &sc.a[c], &sc.b[c]);
      }
    }
  }
  void reduce(int64_t n, int64_t lo, int64_t hi, A* p, Scratch& sc) const {
    const RowIo<T> io{P};
    const int64_t C = dims.C, rows = chunk_rows(C);
    std::fill(p, p + 2 * C, A(0));
    for (int64_t r0 = lo; r0 < hi; r0 += rows) {
      const int64_t rr = std::min(rows, hi - r0), off = (n * dims.S + r0) * C;
      const A* xr = io.in(x + off, sc.bx.data(), rr * C);
      const A* gr = io.in(dy + off, sc.bg.data(), rr * C);
      // each chunk's sums first, then added: shorter running sums over long sequences of rows
      std::fill(sc.t1.begin(), sc.t1.end(), A(0));
      std::fill(sc.t2.begin(), sc.t2.end(), A(0));
      R.sums[static_cast<int>(ACT)](xr, gr, rr, C, C, sc.mu.data(), sc.a.data(), sc.b.data(),
                                     sc.t1.data(), sc.t2.data());
      for (int64_t c = 0; c < C; ++c) {
        p[c] += sc.t1[c];
        p[C + c] += sc.t2[c];
      }
    }
  }
  bool finish(int64_t n, const A* parts, int k, bool owner, Scratch& sc) const {
    bool any = false;
    for (int64_t g = 0; g < G; ++g) {
      finish_group(n, g, parts, k, owner, sc);
      any = any || sc.ex[g];
    }
    return any;
  }
  // Group g's dx coefficients from k partials (each 2*C sums, channels of all groups).
  void finish_group(int64_t n, int64_t g, const A* parts, int k, bool owner, Scratch& sc) const {
    const int64_t C = dims.C, D = dims.D, M = D * dims.S;
    {
      const A r = rstd[n * G + g];
      A sum_a = 0, sum_b = 0;
      for (int64_t c = g * D; c < (g + 1) * D; ++c) {
        A p1 = parts[c], p2 = parts[C + c];
        for (int u = 1; u < k; ++u) {
          p1 += parts[u * 2 * C + c];
          p2 += parts[u * 2 * C + C + c];
        }
        if (owner && !sc.ex[g]) {
          sums.dsc[n * C + c] = p1 * r;
          sums.db[n * C + c] = p2;
        }
        sum_a += gam[c] * p1;
        sum_b += gam[c] * p2;
      }
      A c2, c3;
      const A dmo = dmean_o ? dmean_o[n * G + g] : A(0), dro = drstd_o ? drstd_o[n * G + g] : A(0);
      gn_bwd_coeffs<A>(sum_a, sum_b, r, A(1) / static_cast<A>(M), dmo, dro, &c2, &c3);
      for (int64_t c = g * D; c < (g + 1) * D; ++c) {
        sc.c1[c] = r * gam[c];
        sc.c2[c] = c2;
        sc.c3[c] = c3;
      }
    }
  }
  void apply(int64_t n, int64_t lo, int64_t hi, Scratch& sc) const {
    const RowIo<T> io{P};
    const int64_t C = dims.C, rows = chunk_rows(C);
    for (int64_t r0 = lo; r0 < hi; r0 += rows) {
      const int64_t rr = std::min(rows, hi - r0), off = (n * dims.S + r0) * C;
      const A* xr = io.in(x + off, sc.bx.data(), rr * C);
      const A* gr = io.in(dy + off, sc.bg.data(), rr * C);
      A* dr = io.out(dx + off, sc.bg.data());
      R.dx[static_cast<int>(ACT)](xr, gr, dr, rr, C, C, sc.mu.data(), sc.a.data(), sc.b.data(),
                                   sc.c1.data(), sc.c2.data(), sc.c3.data());
      io.flush(dr, dx + off, rr * C);
    }
  }
  void exact(int64_t n, int64_t g, Scratch& sc) const {
    if (!sc.ex[g]) return;
    const int64_t off = group_offset(dims, n, g), ng = n * G + g, c = g * dims.D;
    exact_bwd<T, ACT>(x + off, dy + off, dx + off, group_walk(dims), eps, gam + c, bet + c,
                      dmean_o ? dmean_o[ng] : A(0), drstd_o ? drstd_o[ng] : A(0),
                      sums.dsc + n * dims.C + c, sums.db + n * dims.C + c);
  }
  void end_thread() const {}
};

// Samples whose groups all have at most kGnExactGroup elements: every group recomputed exactly.
template <typename F>
void for_all_groups(int64_t NG, F&& f) {
  const int nt = NG * kGnExactGroup >= kMinParallel ? team_size() : 1;
  (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
  for (int64_t ng = 0; ng < NG; ++ng) f(ng);
}

template <typename T>
void moments_rows(const MomentsArgs& a) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const MomentsRowsJob<T> job{{simd::prims<T>(), simd::rows<A>(), static_cast<const T*>(a.x), d.S,
                               d.C, d.G, d.D, d.C},
                              static_cast<A*>(a.mean), static_cast<A*>(a.var), d.G, d};
  run_samples(job, d.N, d.S, d.C);
}

template <typename T>
void moments_bwd_rows(const MomentsBwdArgs& a) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const simd::Prims<T>& P = simd::prims<T>();
  const simd::RowPrims<A>& R = simd::rows<A>();
  const T* x = static_cast<const T*>(a.x);
  T* dx = static_cast<T*>(a.dx);
  const A* dmean = static_cast<const A*>(a.dmean);
  const A* dvar = static_cast<const A*>(a.dvar);
  const A* mean = static_cast<const A*>(a.mean);
  const A inv_m = A(1) / static_cast<A>(d.D * d.S);
  const int64_t C = d.C, rows = chunk_rows(C), chunks = (d.S + rows - 1) / rows;
  const int nt = d.N * d.S * C >= kMinParallel ? team_size() : 1;
  (void)nt;  // read by the pragma only
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const RowIo<T> io{P};
    std::vector<A> buf(RowIo<T>::kSame ? 0 : rows * C), mu(C), c0(C), c1(C), zero(C, A(0));
    int64_t last = -1;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < d.N * chunks; ++k) {
      const int64_t n = k / chunks, r0 = (k % chunks) * rows, rr = std::min(rows, d.S - r0);
      if (n != last) {  // dx = c0 + c1 (x - mu): the dx loop with a zero dy coefficient
        for (int64_t g = 0; g < d.G; ++g) {
          A k0, k1;
          gn_moments_bwd_coeffs<A>(dmean[n * d.G + g], dvar[n * d.G + g], inv_m, &k0, &k1);
          for (int64_t c = g * d.D; c < (g + 1) * d.D; ++c) {
            mu[c] = mean[n * d.G + g];
            c0[c] = k0;
            c1[c] = k1;
          }
        }
        last = n;
      }
      const int64_t off = (n * d.S + r0) * C;
      const A* xr = io.in(x + off, buf.data(), rr * C);
      A* dr = io.out(dx + off, buf.data());
      R.dx[0](xr, xr, dr, rr, C, C, mu.data(), nullptr, nullptr, zero.data(), c1.data(), c0.data());
      io.flush(dr, dx + off, rr * C);
    }
  }
}

template <typename T, Act ACT>
void fwd_rows(const GroupNormFwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const FwdRowsJob<T, ACT> job{{simd::prims<T>(), simd::rows<A>(), static_cast<const T*>(a.x), d.S,
                                d.C, d.G, d.D, d.C},
                               static_cast<T*>(a.y), static_cast<A*>(a.mean),
                               static_cast<A*>(a.rstd), gam, bet, d.G, d, a.eps,
                               static_cast<A>(a.eps),
                               stream_rows<T>(d, kStreamBytesFwd)};
  if (d.D * d.S <= kGnExactGroup) {
    for_all_groups(d.N * d.G, [&](int64_t ng) {
      const int64_t off = group_offset(d, ng / d.G, ng % d.G), c = (ng % d.G) * d.D;
      exact_fwd<T, ACT>(job.st.x + off, job.y + off, group_walk(d), a.eps, gam + c, bet + c,
                        job.mean + ng, job.rstd + ng);
    });
    return;
  }
  run_samples(job, d.N, d.S, d.C);
}

template <typename T, Act ACT>
void bwd_input_rows(const GroupNormBwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  using A = AccT<T>;
  const GroupDims& d = a.dims;
  const BwdRowsJob<T, ACT> job{simd::prims<T>(),
                               simd::rows<A>(),
                               static_cast<const T*>(a.x),
                               static_cast<const T*>(a.dy),
                               static_cast<T*>(a.dx),
                               static_cast<const A*>(a.mean),
                               static_cast<const A*>(a.rstd),
                               static_cast<const A*>(a.dmean),
                               static_cast<const A*>(a.drstd),
                               gam,
                               bet,
                               carve_bwd_sums<A>(a.workspace, d),
                               d.G,
                               d,
                               a.eps};
  if (d.D * d.S <= kGnExactGroup) {
    for_all_groups(d.N * d.G, [&](int64_t ng) {
      const int64_t off = group_offset(d, ng / d.G, ng % d.G), c = (ng % d.G) * d.D;
      exact_bwd<T, ACT>(job.x + off, job.dy + off, job.dx + off, group_walk(d), a.eps, gam + c,
                        bet + c, job.dmean_o ? job.dmean_o[ng] : A(0),
                        job.drstd_o ? job.drstd_o[ng] : A(0), job.sums.dsc + (ng / d.G) * d.C + c,
                        job.sums.db + (ng / d.G) * d.C + c);
    });
    return;
  }
  run_samples(job, d.N, d.S, d.C);
}

}  // namespace

template <typename T>
void nsc_moments_cpu(const MomentsArgs& a) {
  moments_rows<T>(a);
}

template <typename T>
void nsc_moments_bwd_cpu(const MomentsBwdArgs& a) {
  moments_bwd_rows<T>(a);
}

template <typename T>
void nsc_fwd_cpu(const GroupNormFwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  dispatch_act(a.act, [&](auto act) { fwd_rows<T, decltype(act)::value>(a, gam, bet); });
}

template <typename T>
void nsc_bwd_input_cpu(const GroupNormBwdArgs& a, const AccT<T>* gam, const AccT<T>* bet) {
  dispatch_act(a.act, [&](auto act) { bwd_input_rows<T, decltype(act)::value>(a, gam, bet); });
}

// The storage types of dispatch_data (../common/dispatch.h).
#define GNMX_NSC_CPU_INSTANTIATE(T)                                                               \
  template void nsc_moments_cpu<T>(const MomentsArgs&);                                          \
  template void nsc_moments_bwd_cpu<T>(const MomentsBwdArgs&);                                   \
  template void nsc_fwd_cpu<T>(const GroupNormFwdArgs&, const AccT<T>*, const AccT<T>*);         \
  template void nsc_bwd_input_cpu<T>(const GroupNormBwdArgs&, const AccT<T>*, const AccT<T>*);
GNMX_NSC_CPU_INSTANTIATE(Half)
GNMX_NSC_CPU_INSTANTIATE(float)
GNMX_NSC_CPU_INSTANTIATE(double)
#undef GNMX_NSC_CPU_INSTANTIATE

}  // namespace gn_mx
