#pragma once
// Private to the plan module: running two independent pieces of planning at once.
//
// Every rank must reach the same plan, so concurrency here never decides anything: the two
// callables read shared inputs only and write disjoint outputs, and the plan is the same
// whether they ran one after the other or side by side, in either order. (Two exceptions, by
// field: colorTransfers writes each transfer's `round`, and plan.numRounds, while the other
// side reads the transfers' other fields and never those two; the two sides of a trade search
// share the distributor's cache of sorted block lists, each writing only its own workers'
// entries.)

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
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

/// worthParallel for validation, which reports on the plan, not on the environment: a bad
/// FCP_PLAN_THREADS (which planning refuses) checks in order here rather than turn a check
/// into an error.
inline bool worthParallelCheck(int64_t pairs) {
  try {
    return worthParallel(pairs);
  } catch (const Error&) {
    return false;
  }
}

/// The second thread of one piece of planning (a top-level runBoth, and every runBoth under
/// it). A runBoth nested in one on two threads runs in order while the helper is busy, so the
/// planner never uses more than two threads; once the helper's side is done, its thread is
/// free for the runBoths still to come under the calling thread's side (buildPlan's first
/// side, the paper's placement, refines its cuttings for a second or more on long-tailed
/// batches at 4096 workers, long after the local placement beside it is done). The calling
/// thread, when its side ends first, waits for the helper's without lending its thread; a
/// thread that sleeps until the other side offers a value lends itself while it sleeps
/// (whileLent). `free` counts the threads a runBoth may start: 1 while no helper runs (or while
/// the one that runs is lent); the running threads and `free` always add up to two.
struct ThreadBudget {
  std::atomic<int> free{1};
  /// Lenders waiting to take their thread back: while one waits, take() leaves the thread to
  /// it (a runBoth in a loop would otherwise take it again before the waiter wakes).
  std::atomic<int> reclaiming{0};
  /// Takes a free thread, if there is one and no lender is waiting for it.
  bool take() { return reclaiming.load() == 0 && takeAny(); }
  /// Takes a free thread, if there is one, before any runBoth.
  bool takeAny() {
    for (int n = free.load(); n > 0;)
      if (free.compare_exchange_weak(n, n - 1)) return true;
    return false;
  }
  /// Gives a thread back, waking a thread waiting to take one.
  void give() {
    free.fetch_add(1);
    free.notify_all();
  }
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
  if (!parallel || !budget->take()) {
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
      budget->give();  // done: a runBoth still running under `first` may use it
    });
  } catch (const std::system_error&) {  // no thread to be had (a process limit): in order
    budget->give();
    first();
    second();
    return;
  } catch (...) {
    budget->give();
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

/// Runs `wait()`, which must block this thread without using a core (a condition variable's
/// wait), with the thread lent to the budget it draws on: a runBoth under the same budget may
/// start a helper meanwhile, so the two threads stay busy while this one sleeps (the local
/// placement waits for the paper's first assignment, which at 4096 workers can take a second
/// on a long-tailed batch). Once `wait` returns (or throws), the thread is taken back: if a
/// helper started meanwhile is still running, this thread waits for it to end, so no more
/// than two threads ever run. Outside any runBoth on two threads, just `wait()`.
template <typename Wait>
decltype(auto) whileLent(Wait&& wait) {
  ThreadBudget* const budget = tBudget;
  if (budget == nullptr) return wait();
  struct Lent {
    ThreadBudget* budget;
    explicit Lent(ThreadBudget* b) : budget(b) { budget->give(); }
    ~Lent() {
      budget->reclaiming.fetch_add(1);
      while (!budget->takeAny()) budget->free.wait(0);
      budget->reclaiming.fetch_sub(1);
    }
    Lent(const Lent&) = delete;
    Lent& operator=(const Lent&) = delete;
  } const lent(budget);
  return wait();
}

/// A second thread kept for many short runBoths in a row (the improvement pass weighs a trade
/// with every worker thousands of times, each a fraction of a millisecond: a fresh thread per
/// call starts too late to take its half). Its runBoth keeps runBoth's rules: it draws on
/// the budget this thread draws on (or a budget of its own outside any runBoth, which runBoths
/// nested in its sides then draw on), so it runs in order while no thread is free; the second
/// side goes to whichever thread claims it first; the same error is thrown. The thread is
/// started at the first runBoth that gets a thread. A runBoth holds the budget's thread from
/// start to end, whichever thread runs the second side. Between runBoths the kept thread spins
/// briefly while the budget has a thread free (the next call usually comes within
/// microseconds, and waking from a wait takes tens of them), then sleeps on an atomic. Not for
/// use from two threads at once; made and destroyed inside the runBoth, if any, whose budget it
/// draws on.
class HelperThread {
 public:
  HelperThread() = default;
  HelperThread(const HelperThread&) = delete;
  HelperThread& operator=(const HelperThread&) = delete;
  ~HelperThread() {
    if (!thread_.joinable()) return;
    stop_ = true;
    posted_.fetch_add(1);
    posted_.notify_one();
    thread_.join();
  }

  template <typename First, typename Second>
  void runBoth(First&& first, Second&& second) {
    ThreadBudget* const budget = tBudget != nullptr ? tBudget : &own_;
    if (!budget->take()) {
      first();
      second();
      return;
    }
    // Both threads draw on `budget` until the call returns, and the thread goes back to it.
    struct Hold {
      ThreadBudget* budget;
      ThreadBudget* saved = tBudget;
      explicit Hold(ThreadBudget* b) : budget(b) { tBudget = b; }
      ~Hold() {
        tBudget = saved;
        budget->give();
      }
      Hold(const Hold&) = delete;
      Hold& operator=(const Hold&) = delete;
    } const hold(budget);
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { serve(); });
      } catch (const std::system_error&) {  // no thread to be had (a process limit): in order
        first();
        second();
        return;
      }
    }
    using Task = std::remove_reference_t<Second>;
    task_ = [](const void* f) { (*static_cast<Task*>(const_cast<void*>(f)))(); };
    taskArg_ = static_cast<const void*>(std::addressof(second));
    taskBudget_ = budget;
    taskError_ = nullptr;
    claimed_.store(false);
    const uint32_t round = posted_.fetch_add(1) + 1;  // publishes the task
    posted_.notify_one();
    std::exception_ptr firstError;
    try {
      first();
    } catch (...) {
      firstError = std::current_exception();
    }
    if (!claimed_.exchange(true)) {  // not started yet: this thread runs it (unless first threw)
      if (firstError) std::rethrow_exception(firstError);
      second();
      return;
    }
    for (uint32_t d = done_.load(); d != round; d = done_.load()) done_.wait(d);
    if (firstError) std::rethrow_exception(firstError);
    if (taskError_) std::rethrow_exception(taskError_);
  }

 private:
  void serve() {
    uint32_t seen = 0;
    for (;;) {
      // tBudget: the last task's, once there was one.
      for (int spin = 0; spin < kSpins && tBudget != nullptr && tBudget->free.load() > 0 &&
                         posted_.load(std::memory_order_relaxed) == seen;
           ++spin) {
        std::this_thread::yield();
      }
      posted_.wait(seen);
      const uint32_t round = posted_.load();
      if (round == seen) continue;
      seen = round;
      if (stop_) return;
      if (!claimed_.exchange(true)) {
        tBudget = taskBudget_;
        try {
          task_(taskArg_);
        } catch (...) {
          taskError_ = std::current_exception();
        }
      }
      done_.store(round);
      done_.notify_one();
    }
  }

  /// Yields before sleeping.
  static constexpr int kSpins = 200;
  ThreadBudget own_;
  std::thread thread_;
  // The task of the last runBoth, written before `claimed_` is cleared and `posted_` raised.
  void (*task_)(const void*) = nullptr;
  const void* taskArg_ = nullptr;
  ThreadBudget* taskBudget_ = nullptr;
  std::exception_ptr taskError_;
  std::atomic<bool> claimed_{true};
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> posted_{0};
  std::atomic<uint32_t> done_{0};
};

}  // namespace fcp::plan::detail
