#include "parallel.h"

#include <omp.h>

#include <atomic>
#include <exception>
#include <mutex>

#include "fcp/core/error.h"

namespace fcp::kernels::detail {

int resolveThreads(int requested) {
  if (requested < 0) throwInvalidArgument("numThreads = ", requested, ", expected >= 0");
  return requested == 0 ? omp_get_max_threads() : requested;
}

void parallelFor(int numThreads, int64_t numTasks,
                 const std::function<void(int64_t task, int worker)>& body) {
  if (numTasks <= 0) return;
  std::atomic<int64_t> next{0};
  std::exception_ptr failure;
  std::mutex failureMutex;
  const int team = static_cast<int>(numThreads < numTasks ? numThreads : numTasks);
#pragma omp parallel num_threads(team)
  {
    // Per implicit task ICV: nested oneDNN calls from this worker use one thread.
    omp_set_num_threads(1);
    const int worker = omp_get_thread_num();
    for (int64_t task = next++; task < numTasks; task = next++) {
      try {
        body(task, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(failureMutex);
        if (!failure) failure = std::current_exception();
        next = numTasks;
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace fcp::kernels::detail
