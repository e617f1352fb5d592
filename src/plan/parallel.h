#pragma once
// Private to the plan module: running two independent pieces of planning at once.
//
// Every rank must reach the same plan, so concurrency here never decides anything: the two
// callables read shared inputs only and write disjoint outputs, and the plan is the same
// whether they ran one after the other or side by side, in either order.

#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>

namespace fcp::plan::detail {

/// Whether planning work of about `pairs` block pairs is worth a second thread: below this a
/// plan takes a few milliseconds, and starting a thread (tens of microseconds) buys little.
/// False on a machine with one hardware thread.
inline bool worthParallel(int64_t pairs) {
  constexpr int64_t kParallelPairs = int64_t{1} << 16;
  return pairs >= kParallelPairs && std::thread::hardware_concurrency() > 1;
}

/// Runs `first()` and `second()`, on two threads when `parallel`, else in that order. Both
/// always finish before it returns; if either throws, it rethrows `first`'s exception, else
/// `second`'s: what running them in order would have thrown (there, `second` never runs after
/// `first` throws), so the error is the same whatever the timing.
///
/// `second` goes to whichever thread claims it first: the helper when it starts, or this
/// thread once `first` is done. On a machine whose other cores are busy the helper may not
/// start for a while; this thread then runs both rather than wait for it.
template <typename First, typename Second>
void runBoth(bool parallel, First&& first, Second&& second) {
  if (!parallel) {
    first();
    second();
    return;
  }
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
  std::thread helper(runSecond);
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
