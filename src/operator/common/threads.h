/*
 * threads.h: the CPU kernels' view of OpenMP, one place for all of them. With OpenMP off
 * (GNMX_OPENMP=OFF or a compiler without it) everything runs on the calling thread and the
 * `#pragma omp` lines are ignored.
 */
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gn_mx {
namespace threads {

// Threads a new parallel region would get: 1 inside an active region (no nested teams).
inline int team_size() {
#if defined(_OPENMP)
  return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
  return 1;
#endif
}

// omp_get_max_threads(): what `num_threads = 0` means in the kernels' parameters.
inline int max_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads() > 0 ? omp_get_max_threads() : 1;
#else
  return 1;
#endif
}

// The caller's index and the team's size inside a parallel region (0 and 1 outside one).
inline int thread_id() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int num_threads() {
#if defined(_OPENMP)
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// An orphaned barrier: binds to the innermost enclosing parallel region.
inline void barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}

}  // namespace threads
}  // namespace gn_mx
