/*
 * Per-stage profile of the DBN CPU kernels (no MXNet): thread-0 CPU time per stage, min / median
 * over repetitions, and the GFLOP/s of each panel-product stage. Build and run (1 thread, 20 reps):
 *   g++ -O3 -fopenmp -std=c++17 -DGNMX_DBN_PROFILE -Isrc/operator benchmarks/dbn_stages.cc \
 *       src/operator/kernels/dbn_*cpu.cc -o /tmp/dbn_stages -ldl
 *   GNMX_DBN_PROFILE_CHUNKED=1 LD_LIBRARY_PATH=$(python -c 'import mxnet,os;print(os.path.dirname(mxnet.__file__))') \
 *       /tmp/dbn_stages 1 20
 * (the OpenBLAS of the mxnet wheel backs the BLAS paths and the dsyevd fallback; it is set to one
 * thread). Stage times are meaningful with GNMX_DBN_PROFILE_CHUNKED=1 (all groups per pass);
 * FWD / BWD / INF totals are valid either way. Thread CPU time survives a loaded machine at one
 * thread; at two it includes OpenMP spin-waiting. Args: threads, reps, [shape index 0-3].
 */
#include <omp.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>
#include "kernels/dbn.h"
#include <dlfcn.h>
namespace gn_mx { extern double g_dbn_prof[16]; double dbn_prof_clock(); }
static double tclk() { return gn_mx::dbn_prof_clock(); }
using namespace gn_mx;
static double tcpu() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  int nt = argc > 1 ? atoi(argv[1]) : 1;
  if (void* h = dlopen("libopenblas.so.0", RTLD_LAZY)) if (auto s = (void(*)(int))dlsym(h, "openblas_set_num_threads")) s(1);
  int reps = argc > 2 ? atoi(argv[2]) : 20;
  struct Sh { long N, C, G, S; } shapes[] = {{32, 64, 4, 256}, {8, 128, 8, 1024}, {128, 256, 4, 64}, {16, 64, 2, 1024}};
  int only = argc > 3 ? atoi(argv[3]) : -1;
  for (int si = 0; si < 4; ++si) {
    if (only >= 0 && si != only) continue;
    Sh sh = shapes[si];
    long n = sh.N * sh.C * sh.S, D = sh.C / sh.G;
    std::vector<float> x(n), dy(n), y(n), dx(n), mean(sh.C), U(sh.G * D * D), l(sh.G * D), rm(sh.C, 0.f), rp(sh.G * D * D, 0.f);
    std::mt19937 rng(1); std::normal_distribution<float> nd;
    for (auto& v : x) v = nd(rng);
    for (auto& v : dy) v = nd(rng);
    DbnFwdArgs f; f.x = x.data(); f.y = y.data(); f.mean = mean.data(); f.eigvec = U.data(); f.eigval = l.data();
    f.running_mean = rm.data(); f.running_proj = rp.data(); f.dims = group_dims(sh.N, sh.C, sh.G, sh.S); f.num_threads = nt;
    DbnBwdArgs b; b.dy = dy.data(); b.x = x.data(); b.mean = mean.data(); b.eigvec = U.data(); b.eigval = l.data(); b.dx = dx.data();
    b.dims = group_dims(sh.N, sh.C, sh.G, sh.S); b.num_threads = nt;
    DbnInferenceArgs ia; ia.x = x.data(); ia.y = y.data(); ia.running_mean = rm.data(); ia.running_proj = rp.data();
    ia.dims = group_dims(sh.N, sh.C, sh.G, sh.S); ia.num_threads = nt;
    size_t ws = std::max({dbn_fwd_workspace_cpu(f), dbn_bwd_workspace_cpu(b), dbn_inference_workspace_cpu(ia)});
    void* w = aligned_alloc(64, (ws + 63) / 64 * 64);
    f.workspace = b.workspace = ia.workspace = w;
    std::vector<std::vector<double>> st(9);
    double cpu_fb = 0, wall_fb = 0;
    for (int r = 0; r < reps + 2; ++r) {
      double c0 = tcpu();
      double t0 = tclk();
      if (const char* e = dbn_fwd_cpu(f)) { printf("err %s\n", e); return 1; }
      double t1 = tclk();
      double p1 = g_dbn_prof[1], p2 = g_dbn_prof[2], p3 = g_dbn_prof[3];
      if (const char* e = dbn_bwd_cpu(b)) { printf("err %s\n", e); return 1; }
      double t2 = tclk();
      double c1 = tcpu();
      double q4 = g_dbn_prof[4], q5 = g_dbn_prof[5], q6 = g_dbn_prof[6];
      dbn_inference_cpu(ia);
      double t3 = tclk();
      if (r < 2) continue;
      cpu_fb += c1 - c0; wall_fb += t2 - t0;
      double v[9] = {p1 - t0, p2 - p1, p3 - p2, t1 - t0, q4 - t1, q5 - q4, q6 - q5, t2 - t1, t3 - t2};
      for (int i = 0; i < 9; ++i) st[i].push_back(v[i] * 1e3);
    }
    const char* names[9] = {"f.stats", "f.eigh+W", "f.whiten", "FWD", "b.gram", "b.DxD", "b.apply", "BWD", "INF"};
    // GFLOP/s: f.stats counts the symmetric half (D^2 m / 2 FMAs), FWD 1.5 and BWD 3 products.
    printf("shape (%ld,%ld,S=%ld) G=%ld D=%ld nt=%d  cpu/wall=%.2f\n", sh.N, sh.C, sh.S, sh.G, D, nt, cpu_fb / wall_fb);
    double fl = (double)D * D * sh.N * sh.S * sh.G;  // FMAs of one D x D x m product over all groups
    for (int i = 0; i < 9; ++i) {
      auto v = st[i]; std::sort(v.begin(), v.end());
      double mult = (i == 0 ? 0.5 : i == 2 ? 1 : i == 4 ? 1 : i == 6 ? 2 : i == 8 ? 1 : i == 3 ? 1.5 : i == 7 ? 3 : 0);
      double gf = mult > 0 ? 2 * mult * fl / (v[0] * 1e-3) / 1e9 : 0;
      printf("  %-9s min %7.3f  med %7.3f ms   %s%6.1f GFLOP/s(min)\n", names[i], v[0], v[v.size() / 2], mult > 0 ? "" : "", gf);
    }
    free(w);
  }
}
