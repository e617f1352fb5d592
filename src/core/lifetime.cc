#include "fcp/core/lifetime.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace fcp {

void keepUntilExit(std::shared_ptr<void> value) noexcept {
  try {
    static std::mutex mutex;
    static auto* kept = new std::vector<std::shared_ptr<void>>;  // never destroyed
    const std::lock_guard<std::mutex> lock(mutex);
    kept->push_back(std::move(value));
  } catch (...) {
    abortKeeping();
  }
}

void abortKeeping() noexcept {
  std::fputs(
      "fcp: out of memory while keeping a buffer that a pending message may still write "
      "into: ending the process rather than freeing it\n",
      stderr);
  std::abort();
}

}  // namespace fcp
