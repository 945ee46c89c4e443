// veloxquant — parallelism the engine controls (docs/design.md 7.3). A cache runs the heads of a
// call serially unless the engine hands it a parallel-for: a function that runs task(0) ..
// task(tasks - 1), possibly at the same time, and returns when all have finished (the engine's own
// thread pool, say). Each task gets a contiguous range of heads and scratch of its own, and every
// head runs the same serial code, so the results are bit-identical to a serial run.
#pragma once

#include <functional>

namespace veloxquant::cache {

/// Runs task(0) .. task(tasks - 1) and returns when every one has returned.
using ParallelFor = std::function<void(int tasks, const std::function<void(int task)>& task)>;

#if defined(_OPENMP)
/// A ready-made parallel-for on OpenMP threads; available when the including translation unit is
/// compiled with OpenMP (-fopenmp), which the library never requires.
inline ParallelFor openmp_parallel_for() {
  return [](int tasks, const std::function<void(int)>& task) {
#pragma omp parallel for schedule(static) num_threads(tasks)
    for (int t = 0; t < tasks; ++t) task(t);
  };
}
#endif

}  // namespace veloxquant::cache
