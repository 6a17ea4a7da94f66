/*
 * dbn_sync_cpu.cc: synchronized DBN's D x D whitening step and in-process barrier on the host
 * (contract and math: dbn_sync.h; the passes over the data: dbn_sync_data_cpu.cc). The D x D steps
 * are dbn_math.h's, run with the CPU executor, so a given Sigma gives the fused op's W and
 * dL/dSigma; groups run one after another (G D x D problems, small next to the data passes).
 */
#include "dbn_sync.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dbn_eigen_cpu.h"
#include "dbn_math.h"
#include "dbn_small_cpu.h"

namespace gn_mx {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Sigma = cov + eps I of group g; false when an entry is not finite.
bool sigma_of(const double* cov, int64_t D, double eps, double* sig) {
  bool finite = true;
  for (int64_t e = 0; e < D * D; ++e) {
    sig[e] = cov[e] + (e % (D + 1) == 0 ? eps : 0.0);
    finite = finite && std::isfinite(sig[e]);
  }
  return finite;
}

// W, eigvec, eigval of one group from sig (destroyed).
void whiten_group(const DbnWhitenArgs& a, int64_t g, double* sig, std::vector<double>* scratch) {
  const int D = static_cast<int>(a.D);
  const int64_t DD = a.D * a.D;
  double *W = a.W + g * DD, *U = a.eigvec + g * DD, *l = a.eigval + g * a.D;
  dbn_small::CpuExec ex;
  if (a.whitening == DbnWhitening::kIterNorm) {
    std::copy(sig, sig + DD, U);
    for (int64_t d = 0; d < a.D; ++d) l[d] = sig[d * (a.D + 1)];
    scratch->resize(dbn_iternorm_mats(a.iterations, false) * DD + dbn_iternorm_doubles(D, false));
    double* s = scratch->data();
    dbn_iternorm_whitening(ex, U, D, a.iterations, W,
                           dbn_iternorm_layout<double>(s, s + dbn_iternorm_mats(a.iterations, false) * DD,
                                                       D, a.iterations, false));
    return;
  }
  const size_t lw = dbn_cpu::eig_lwork(D), liw = dbn_cpu::eig_liwork(D);
  scratch->resize(DD + lw + (liw + 1) / 2 + 1 + 2 * DD + D);
  double* s = scratch->data();
  const dbn_cpu::EigScratch es{s, s + DD, reinterpret_cast<int*>(s + DD + lw),
                               static_cast<int>(lw), static_cast<int>(liw)};
  double* tmp = s + DD + lw + (liw + 1) / 2 + 1;
  dbn_cpu::eigh(sig, D, U, l, es);
  dbn_whitening_matrix(ex, U, l, D, a.eps, W, tmp, tmp + DD, tmp + 2 * DD);
}

}  // namespace

const char* dbn_whiten_cpu(const DbnWhitenArgs& a) {
  if (const char* e = dbn_whitening_error(a.whitening, a.iterations)) return e;
  const int64_t DD = a.D * a.D;
  std::vector<double> sig(DD), scratch;
  dbn_small::CpuExec ex;
  for (int64_t g = 0; g < a.G; ++g) {
    if (sigma_of(a.cov + g * DD, a.D, a.eps, sig.data())) {
      whiten_group(a, g, sig.data(), &scratch);
    } else {
      std::fill(a.W + g * DD, a.W + (g + 1) * DD, kNaN);
      std::fill(a.eigvec + g * DD, a.eigvec + (g + 1) * DD, kNaN);
      std::fill(a.eigval + g * a.D, a.eigval + (g + 1) * a.D, kNaN);
    }
    dbn_update_running(ex, a.stat_dtype, a.running_proj, a.running_mean, g,
                       static_cast<int>(a.D), a.W + g * DD, a.mean, a.momentum);
  }
  return nullptr;
}

const char* dbn_whiten_bwd_cpu(const DbnWhitenBwdArgs& a) {
  if (const char* e = dbn_whitening_error(a.whitening, a.iterations)) return e;
  const int D = static_cast<int>(a.D);
  const int64_t DD = a.D * a.D;
  const int T = a.iterations;
  const bool iter = a.whitening == DbnWhitening::kIterNorm;
  const int64_t mats = iter ? dbn_iternorm_mats(T, true) * DD + dbn_iternorm_doubles(D, true) : 0;
  std::vector<double> GW(DD), W(DD), sig(DD), s(3 * DD + 2 * a.D + mats);
  dbn_small::CpuExec ex;
  for (int64_t g = 0; g < a.G; ++g) {
    std::copy(a.dW + g * DD, a.dW + (g + 1) * DD, GW.begin());
    double* B = a.dcov + g * DD;
    if (iter) {
      sigma_of(a.cov + g * DD, a.D, a.eps, sig.data());
      double* m = s.data();
      dbn_bwd_iternorm(ex, sig.data(), GW.data(), D, T, 2.0, nullptr, nullptr, W.data(), B,
                       dbn_iternorm_layout<double>(m, m + dbn_iternorm_mats(T, true) * DD, D, T,
                                                   true));
    } else {
      double* p = s.data();
      dbn_bwd_small(ex, a.eigvec + g * DD, a.eigval + g * a.D, GW.data(), D, 2.0, nullptr,
                    nullptr, W.data(), B,
                    DbnBwdScratch{p, p + DD, p + 2 * DD, p + 3 * DD, p + 3 * DD + a.D});
    }
  }
  return nullptr;
}

// ---- In-process sum across devices -------------------------------------------------------------
namespace {

// One key's barrier. A round gathers `arrived` calls into `sum`; once num_devices have arrived it
// releases them (each copies the sum out); the last to leave opens the next round (gen + 1).
struct SyncState {
  std::mutex mu;
  std::condition_variable cv;
  int ndev = 0, arrived = 0, departed = 0;
  bool releasing = false;
  uint64_t gen = 0, failed_gen = std::numeric_limits<uint64_t>::max();
  std::string failed_msg;
  std::vector<double> sum;
};

SyncState& state_of(const std::string& key) {
  static std::mutex m;
  static std::map<std::string, std::unique_ptr<SyncState>> states;
  std::lock_guard<std::mutex> lk(m);
  auto& p = states[key];
  if (!p) p = std::make_unique<SyncState>();
  return *p;
}

// Ends the gathering round with `msg` for every caller in it; the key starts a fresh round.
void fail_round(SyncState* s, const std::string& msg) {
  s->failed_gen = s->gen;
  s->failed_msg = msg;
  s->arrived = s->departed = 0;
  s->releasing = false;
  ++s->gen;
  s->cv.notify_all();
}

std::string describe(const char* key, const char* what) {
  return std::string("key '") + key + "': " + what;
}

}  // namespace

const char* sync_sum_cpu(const SyncSumArgs& a) {
  thread_local std::string err;
  SyncState& s = state_of(a.key);
  std::unique_lock<std::mutex> lk(s.mu);
  // system_clock, not steady_clock: libstdc++ turns a steady_clock wait into
  // pthread_cond_clockwait (glibc 2.30), which the manylinux2014 wheel (glibc 2.17) cannot link.
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::duration_cast<std::chrono::system_clock::duration>(
                            std::chrono::duration<double>(a.timeout_s));
  if (!s.cv.wait_until(lk, deadline, [&] { return !s.releasing; })) {
    err = describe(a.key, "timed out waiting for the previous round to hand out its sum");
    return err.c_str();
  }
  const uint64_t my = s.gen;
  char buf[256];
  if (s.arrived == 0) {
    s.ndev = a.num_devices;
    s.sum.assign(static_cast<size_t>(a.n), 0.0);
  } else if (a.num_devices != s.ndev || static_cast<size_t>(a.n) != s.sum.size()) {
    std::snprintf(buf, sizeof(buf),
                  "mismatched calls: num_devices=%d and %lld elements here, num_devices=%d and "
                  "%lld elements on a device that arrived first",
                  a.num_devices, static_cast<long long>(a.n), s.ndev,
                  static_cast<long long>(s.sum.size()));
    fail_round(&s, describe(a.key, buf));
    err = s.failed_msg;
    return err.c_str();
  }
  for (int64_t i = 0; i < a.n; ++i) s.sum[i] += a.in[i];
  if (++s.arrived == s.ndev) {
    s.releasing = true;
    s.cv.notify_all();
  } else if (!s.cv.wait_until(lk, deadline, [&] { return s.gen != my || s.releasing; })) {
    std::snprintf(buf, sizeof(buf), "timed out after %g s with %d of %d devices arrived",
                  a.timeout_s, s.arrived, s.ndev);
    fail_round(&s, describe(a.key, buf));
  }
  if (s.gen != my) {
    err = s.failed_gen == my ? s.failed_msg : describe(a.key, "round ended without a result");
    return err.c_str();
  }
  std::copy(s.sum.begin(), s.sum.end(), a.out);
  if (++s.departed == s.arrived) {
    s.arrived = s.departed = 0;
    s.releasing = false;
    ++s.gen;
    s.cv.notify_all();
  }
  return nullptr;
}

}  // namespace gn_mx
