/*
 * simd_levels.cc: the GroupNorm forward kernel of one cached sample on each CPU ISA level of
 * cpu_isa.h (generic, avx2, avx512), in one process, without MXNet, next to a plain copy of the same
 * bytes (the bound of a pass that reads x and writes y).
 *
 *   g++ -O3 -fopenmp-simd -std=c++17 -Isrc/operator benchmarks/simd_levels.cc -o build/simd_levels
 *   build/simd_levels [C S G reps]          # default 64 3136 32 400: one 2x64x56x56 sample
 *   build/simd_levels rows R C [reps]       # channels-last statistics of R rows of C channels
 *
 * One "forward" is what group_norm_cpu.cc's FwdJob does per group on one thread: the chunked
 * moments primitive (2048-element chunks, Chan merge), then y = x a_c + b_c per channel. The sample
 * stays in L2 (0.8 MB fp32 at the default size), so this is the kernel's compute + cache cost, the
 * part MXNet's per-call cost and DRAM traffic do not hide. Levels and the copy run interleaved,
 * round after round; the time per level is the minimum over rounds (the machine is shared: the
 * minimum is the run least disturbed by other jobs), with the median beside it.
 * `rows`: the channels-last statistics of one chunk (simd_rows_cpu.h's col_sum then col_m2 over R
 * rows of C fp32 channels, as group_norm_nsc_cpu.cc's reduction) per level, next to a copy.
 */
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/welford.h"
#include "kernels/simd_cpu.h"
#include "kernels/simd_rows_cpu.h"

using namespace gn_mx;

namespace {

template <typename T>
void forward(const simd::Prims<T>& P, const T* x, T* y, int64_t C, int64_t S, int64_t G) {
  using A = AccT<T>;
  const int64_t D = C / G, M = D * S;
  for (int64_t g = 0; g < G; ++g) {
    const T* xg = x + g * M;
    Welford<A> w;
    for (int64_t off = 0; off < M; off += 2048) {
      const int64_t len = std::min<int64_t>(2048, M - off);
      A cm, m2;
      P.moments(xg + off, len, &cm, &m2);
      w.merge(make_welford<A>(static_cast<A>(len), cm, m2));
    }
    const A r = A(1) / std::sqrt(w.var() + A(1e-5));
    for (int64_t d = 0; d < D; ++d)
      P.affine(xg + d * S, y + g * M + d * S, S, r, -w.mean * r);
  }
}

double seconds(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename T>
void run(const char* dtype, int64_t C, int64_t S, int64_t G, int reps) {
  const int64_t n = C * S;
  std::vector<T> x(n), y(n);
  for (int64_t i = 0; i < n; ++i) x[i] = from_acc<T>(static_cast<AccT<T>>((i * 7919 % 1000) * 1e-3));
  struct Level { const char* name; const simd::Prims<T>* P; std::vector<double> t; };
  std::vector<Level> lv = {{"generic", &simd::generic_prims<T>(), {}}};
  if (cpu_isa_supported() >= CpuIsa::kAvx2) lv.push_back({"avx2", &simd::avx2_prims<T>(), {}});
  // fp16's avx512 table runs in the library on Intel CPUs only (cpu_fast_avx512_fp16): timed
  // on every AVX-512 CPU here, so that the rule can be checked
  if (cpu_isa_supported() >= CpuIsa::kAvx512) lv.push_back({"avx512", &simd::avx512_prims<T>(), {}});
  std::vector<double> copy;
  const int inner = 5;
  for (int r = 0; r < reps; ++r) {
    for (auto& l : lv) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < inner; ++k) forward(*l.P, x.data(), y.data(), C, S, G);
      l.t.push_back(seconds(t0) / inner);
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < inner; ++k) {
      std::memcpy(y.data(), x.data(), n * sizeof(T));
      asm volatile("" ::: "memory");
    }
    copy.push_back(seconds(t0) / inner);
  }
  auto mn = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()) * 1e6; };
  auto md = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2] * 1e6;
  };
  std::printf("| %s | %lldx%lld G%lld | %.1f KB | copy | %.1f | %.1f | 1.00 |\n", dtype, (long long)C,
              (long long)S, (long long)G, n * sizeof(T) / 1024.0, mn(copy), md(copy));
  for (auto& l : lv)
    std::printf("| %s | | | %s | %.1f | %.1f | %.2f |\n", dtype, l.name, mn(l.t), md(l.t),
                mn(l.t) / mn(copy));
}

double min_us(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()) * 1e6; }

void run_rows(int64_t R, int64_t C, int reps) {
  std::vector<float> x(R * C), y(R * C), mu(C), out(C);
  for (int64_t i = 0; i < R * C; ++i) x[i] = static_cast<float>((i * 7919 % 1000) * 1e-3);
  struct Level { const char* name; simd::RowPrims<float> P; std::vector<double> t; };
  std::vector<Level> lv = {{"generic", simd::GenericRows<float>::table(), {}}};
#if defined(GNMX_CPU_X86)
  if (cpu_isa_supported() >= CpuIsa::kAvx2) lv.push_back({"avx2", simd::Avx2Rows<float>::table(), {}});
#endif
  std::vector<double> copy;
  for (int r = 0; r < reps; ++r) {
    for (auto& l : lv) {
      const auto t0 = std::chrono::steady_clock::now();
      l.P.col_sum(x.data(), R, C, C, 1.0f / static_cast<float>(R), mu.data());
      l.P.col_m2(x.data(), R, C, C, mu.data(), out.data());
      l.t.push_back(seconds(t0));
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
    asm volatile("" ::: "memory");
    copy.push_back(seconds(t0));
  }
  std::printf("| rows | C | path | min us | min / copy min |\n|---|---|---|---|---|\n");
  std::printf("| %lld | %lld | copy | %.1f | 1.00 |\n", (long long)R, (long long)C, min_us(copy));
  for (auto& l : lv)
    std::printf("| | | %s | %.1f | %.2f |\n", l.name, min_us(l.t), min_us(l.t) / min_us(copy));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "rows") == 0) {
    run_rows(argc > 2 ? std::atoll(argv[2]) : 4096, argc > 3 ? std::atoll(argv[3]) : 24,
             argc > 4 ? std::atoi(argv[4]) : 200);
    return 0;
  }
  const int64_t C = argc > 1 ? std::atoll(argv[1]) : 64, S = argc > 2 ? std::atoll(argv[2]) : 3136;
  const int64_t G = argc > 3 ? std::atoll(argv[3]) : 32;
  const int reps = argc > 4 ? std::atoi(argv[4]) : 400;
  std::printf("| dtype | sample (C x S) | bytes | path | min us | median us | min / copy min |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  run<float>("float32", C, S, G, reps);
  run<Half>("float16", C, S, G, reps);
  return 0;
}
