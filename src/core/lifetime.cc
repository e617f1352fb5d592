#include "fcp/core/lifetime.h"

#include <mutex>
#include <vector>

namespace fcp {

void keepUntilExit(std::shared_ptr<void> value) {
  static std::mutex mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>;  // never destroyed
  const std::lock_guard<std::mutex> lock(mutex);
  kept->push_back(std::move(value));
}

}  // namespace fcp
