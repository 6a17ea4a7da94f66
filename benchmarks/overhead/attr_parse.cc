// Time of gn_mx's attribute parsing as one callback does it (src/operator/mx/attributes.h): the
// three attributes of gn_group_norm, strict parser, unknown-key check. Prints ns per parse.
// Built and run by benchmarks/bench_overhead.py (the decision not to cache parsed attributes in
// lib_api stateful ops rests on this number; see src/operator/mx/attributes.h).
#include <chrono>
#include <cstdio>

#include "attributes.h"

int main() {
  using gn_mx::mxa::AttrMap;
  using gn_mx::mxa::Attrs;
  const AttrMap m = {{"num_groups", "32"}, {"eps", "1e-05"}, {"act_type", "relu"}};
  const int n = 2000000;
  double sink = 0;
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      Attrs a("gn_group_norm", m, {"num_groups", "eps", "act_type"});
      sink += a.get_int("num_groups", 1) + a.get_float("eps", 1e-5);
      sink += m.find("act_type")->second == "relu";
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
    if (ns < best) best = ns;
  }
  std::printf("%.1f\n", best);
  return sink == 0;  // keeps the loop
}
