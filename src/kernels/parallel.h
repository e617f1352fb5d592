#pragma once
// The kernels' parallel loop: tasks handed out in the given order through an atomic counter,
// so that a list sorted by decreasing cost is scheduled longest-first (LPT-like balance).
// Each worker sets its own OpenMP thread count to 1 so that oneDNN, which is OpenMP-threaded in
// Debian's build, runs its GEMMs sequentially inside our loop instead of nesting a team.
#include <cstdint>
#include <functional>

namespace fcp::kernels::detail {

/// Resolves KernelOptions::numThreads (0 = omp_get_max_threads()).
int resolveThreads(int requested);

/// Calls body(task, worker) for task in [0, numTasks) on `numThreads` workers (worker in
/// [0, numThreads)). Exceptions thrown by body are rethrown here (the first one).
void parallelFor(int numThreads, int64_t numTasks,
                 const std::function<void(int64_t task, int worker)>& body);

}  // namespace fcp::kernels::detail
