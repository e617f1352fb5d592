#pragma once
// Private to the plan module: running two independent pieces of planning at once.
//
// Every rank must reach the same plan, so concurrency here never decides anything: the two
// callables read shared inputs only and write disjoint outputs, and the plan is the same
// whether they ran one after the other or side by side, in either order. (One exception, by
// field: colorTransfers writes each transfer's `round`, and plan.numRounds, while the other
// side reads the transfers' other fields and never those two.)

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "fcp/core/error.h"

namespace fcp::plan::detail {

/// Threads the planner may use: FCP_PLAN_THREADS, 1 or 2; unset or empty, 2 where the machine
/// has a second hardware thread, else 1. The plan is the same either way; 1 suits a rank whose
/// cores are all busy. Any other value is an error.
inline int planThreads() {
  const char* env = std::getenv("FCP_PLAN_THREADS");
  if (env == nullptr || *env == '\0') return std::thread::hardware_concurrency() > 1 ? 2 : 1;
  const std::string_view value(env);
  if (value == "1") return 1;
  if (value == "2") return 2;
  std::string shown;  // one line whatever the variable holds
  for (const char c : value) shown += (c == '\n' || c == '\r') ? ' ' : c;
  throwInvalidArgument("invalid FCP_PLAN_THREADS '", shown, "': expected 1 or 2 planner threads");
}

/// Whether planning work of about `pairs` block pairs is worth a second thread: below this a
/// plan takes a few milliseconds, and starting a thread (tens of microseconds) buys little.
/// False when planThreads() is 1 (read first, so a bad FCP_PLAN_THREADS fails every plan).
inline bool worthParallel(int64_t pairs) {
  constexpr int64_t kParallelPairs = int64_t{1} << 16;
  return planThreads() > 1 && pairs >= kParallelPairs;
}

/// The second thread of one piece of planning (a top-level runBoth, and every runBoth under
/// it): `free` is 1 while no helper runs. A runBoth nested in one on two threads runs in order
/// while the helper is busy, so the planner never uses more than two threads; once the helper's
/// side is done, its thread is free for the runBoths still to come under the calling thread's
/// side (buildPlan's first side, the paper's placement, refines its cuttings for a second or
/// more on long-tailed batches at 4096 workers, long after the local placement beside it is
/// done). The calling thread, when its side ends first, waits for the helper's without lending
/// its thread.
struct ThreadBudget {
  std::atomic<int> free{1};
};

/// The budget this thread's runBoths draw on: the innermost runBoth on two threads around it,
/// or null outside any.
inline thread_local ThreadBudget* tBudget = nullptr;

/// Runs `first()` and `second()`, on two threads when `parallel` and the budget has a thread
/// free (see ThreadBudget), else in that order. Both always finish before it returns; if either
/// throws, it rethrows `first`'s exception, else `second`'s: what running them in order would
/// have thrown (there, `second` never runs after `first` throws), so the error is the same
/// whatever the timing.
///
/// `second` goes to whichever thread claims it first: the helper when it starts, or this
/// thread once `first` is done. On a machine whose other cores are busy the helper may not
/// start for a while; this thread then runs both rather than wait for it.
template <typename First, typename Second>
void runBoth(bool parallel, First&& first, Second&& second) {
  ThreadBudget own;
  ThreadBudget* const budget = tBudget != nullptr ? tBudget : &own;
  int one = 1;
  if (!parallel || !budget->free.compare_exchange_strong(one, 0)) {
    first();
    second();
    return;
  }
  // Both threads draw on `budget` until the call returns (also when unwinding).
  struct Use {
    ThreadBudget* saved = tBudget;
    explicit Use(ThreadBudget* b) { tBudget = b; }
    ~Use() { tBudget = saved; }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
  };
  const Use use(budget);
  std::atomic<bool> claimed{false};
  std::exception_ptr secondError;
  const auto runSecond = [&] {
    if (claimed.exchange(true)) return;
    try {
      second();
    } catch (...) {
      secondError = std::current_exception();
    }
  };
  std::thread helper;
  try {
    helper = std::thread([&runSecond, budget] {
      tBudget = budget;
      runSecond();
      budget->free.fetch_add(1);  // done: a runBoth still running under `first` may use it
    });
  } catch (const std::system_error&) {  // no thread to be had (a process limit): in order
    budget->free.fetch_add(1);
    first();
    second();
    return;
  } catch (...) {
    budget->free.fetch_add(1);
    throw;
  }
  try {
    first();
  } catch (...) {
    claimed.exchange(true);  // not started yet: it need not run
    helper.join();
    throw;
  }
  runSecond();
  helper.join();
  if (secondError) std::rethrow_exception(secondError);
}

}  // namespace fcp::plan::detail
