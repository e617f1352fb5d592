#pragma once
// Setting the planner's thread count (FCP_PLAN_THREADS) for one scope in a test.

#include <cstdlib>
#include <optional>
#include <string>

namespace fcp::testing {

/// Sets FCP_PLAN_THREADS for one scope, then puts back what was there.
class PlanThreads {
 public:
  explicit PlanThreads(const char* value) {
    if (const char* old = std::getenv("FCP_PLAN_THREADS")) old_ = old;
    setenv("FCP_PLAN_THREADS", value, 1);
  }
  ~PlanThreads() {
    if (old_) {
      setenv("FCP_PLAN_THREADS", old_->c_str(), 1);
    } else {
      unsetenv("FCP_PLAN_THREADS");
    }
  }
  PlanThreads(const PlanThreads&) = delete;
  PlanThreads& operator=(const PlanThreads&) = delete;

 private:
  std::optional<std::string> old_;
};

}  // namespace fcp::testing
