// runBoth (src/plan/parallel.h): the planner's two threads, and never more; a thread freed
// by one side serves the runBoths still to come under the other.
#include "parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace fcp::plan::detail {
namespace {

TEST(ParallelTest, NeverMoreThanTwoThreadsPlanAtOnce) {
  // runBoths nested three deep, each asking for two threads; every leaf counts the leaves
  // running beside it. Each second side opens with a leaf that ends at once, so its thread is
  // free early for the runBoths still to come under the first side.
  std::atomic<int> running{0}, most{0}, leaves{0};
  const auto leaf = [&](int ms) {
    const int now = ++running;
    for (int m = most; now > m && !most.compare_exchange_weak(m, now);) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    ++leaves;
    --running;
  };
  std::function<void(int)> tree = [&](int depth) {
    if (depth == 0) return leaf(3);
    runBoth(true, [&] { tree(depth - 1); leaf(1); }, [&] { leaf(0); tree(depth - 1); });
  };
  tree(3);
  EXPECT_LE(most.load(), 2);
  EXPECT_EQ(leaves.load(), 8 + 14);  // 2^3 at the bottom, 2 per runBoth (7 of them)
  EXPECT_EQ(tBudget, nullptr);
}

// Inside the first side of an outer runBoth whose second side ends at once: after
// `beforehand()`, asks (until it gets one, up to 5 s) for a nested second side on another
// thread, the one the outer second side frees as it ends; returns the outer first side's
// thread and the nested second side's. The nested first side waits (up to 100 ms) for the
// second to start, so that a second side given a thread is seen running on it, not claimed by
// this thread.
template <typename Beforehand>
std::pair<std::thread::id, std::thread::id> nestedSecondThread(Beforehand&& beforehand) {
  std::atomic<bool> secondDone{false};
  std::thread::id outer, inner;
  runBoth(
      true,
      [&] {
        outer = std::this_thread::get_id();
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (!secondDone && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        beforehand();
        do {
          std::atomic<bool> started{false};
          runBoth(
              true,
              [&] {
                const auto wait = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
                while (!started && std::chrono::steady_clock::now() < wait)
                  std::this_thread::yield();
              },
              [&] {
                started = true;
                inner = std::this_thread::get_id();
              });
        } while (inner == outer && std::chrono::steady_clock::now() < until);
      },
      [&] { secondDone = true; });
  return {outer, inner};
}

TEST(ParallelTest, ANestedRunBothUsesTheThreadItsSiblingFreed) {
  const auto [outer, inner] = nestedSecondThread([] {});
  EXPECT_NE(inner, outer);
}

TEST(ParallelTest, ANestedRunBothThatThrowsGivesItsThreadBack) {
  // Under one budget: a nested runBoth whose second side throws on the freed thread must give
  // it back, so a later nested runBoth can have it again.
  bool threw = false;
  const auto [outer, inner] = nestedSecondThread([&] {
    try {
      runBoth(true, [] {}, [] { throw std::runtime_error("nested"); });
    } catch (const std::runtime_error&) {
      threw = true;
    }
  });
  EXPECT_TRUE(threw);
  EXPECT_NE(inner, outer);
}

TEST(ParallelTest, AfterARunBothThisThreadHasTwoAgain) {
  // Outside any runBoth this thread may use two again, also after a side threw.
  EXPECT_THROW(runBoth(true, [] { throw std::runtime_error("first"); }, [] {}),
               std::runtime_error);
  EXPECT_EQ(tBudget, nullptr);
  EXPECT_THROW(runBoth(true, [] {}, [] { throw std::runtime_error("second"); }),
               std::runtime_error);
  EXPECT_EQ(tBudget, nullptr);
  std::thread::id here = std::this_thread::get_id(), second = here;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    runBoth(true, [&] { std::this_thread::sleep_for(std::chrono::milliseconds(20)); },
            [&] { second = std::this_thread::get_id(); });
  } while (second == here && std::chrono::steady_clock::now() < until);
  EXPECT_NE(second, here);
}

// Busy for `us` microseconds (a side that uses its core).
void spinFor(int us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Counts the callables running at once (`running`) and the most seen (`most`).
struct Concurrency {
  std::atomic<int> running{0}, most{0};
  template <typename F>
  void run(F&& f) {
    const int now = ++running;
    for (int m = most; now > m && !most.compare_exchange_weak(m, now);) {
    }
    f();
    --running;
  }
};

TEST(HelperThreadTest, EverySideRunsOnceAndSecondSidesRunOnTheHelper) {
  // Many short runBoths in a row, as the trade search makes them: each side runs exactly once
  // per call, some second sides run on the kept thread, never more than two at once. The calls
  // go on past 2,000 until one ran there (for at most 20 s): on a loaded machine the kept
  // thread may not get a core for the first 2,000's 40 ms.
  Concurrency c;
  std::atomic<int> firsts{0}, seconds{0}, elsewhere{0};
  const std::thread::id here = std::this_thread::get_id();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int calls = 0;
  {
    HelperThread helper;
    for (; calls < 2000 || (elsewhere == 0 && std::chrono::steady_clock::now() < until); ++calls) {
      helper.runBoth(
          [&] {
            c.run([&] {
              spinFor(20);
              ++firsts;
            });
          },
          [&] {
            c.run([&] {
              if (std::this_thread::get_id() != here) ++elsewhere;
              ++seconds;
            });
          });
    }
  }
  EXPECT_EQ(firsts.load(), calls);
  EXPECT_EQ(seconds.load(), calls);
  EXPECT_GT(elsewhere.load(), 0);
  EXPECT_LE(c.most.load(), 2);
  EXPECT_EQ(tBudget, nullptr);
}

TEST(HelperThreadTest, ErrorsAreRunBothsAndTheHelperGoesOn) {
  // The first side's error when it throws (the second still finished or never started), else
  // the second side's, on whichever thread ran it; later calls still run both sides.
  HelperThread helper;
  int firsts = 0, seconds = 0;  // each side writes its own
  for (int k = 0; k < 50; ++k) {
    EXPECT_THROW(helper.runBoth([] { throw std::runtime_error("first"); },
                                [] { throw std::logic_error("second"); }),
                 std::runtime_error);
    EXPECT_THROW(helper.runBoth([] {}, [] { throw std::logic_error("second"); }), std::logic_error);
    helper.runBoth([&] { ++firsts; }, [&] { ++seconds; });
  }
  EXPECT_EQ(firsts, 50);
  EXPECT_EQ(seconds, 50);
}

TEST(HelperThreadTest, InOrderWhenTheBudgetHasNoThreadAndWithTheOneLentWhileAThreadSleeps) {
  // Under an outer runBoth whose second side is busy, the kept thread gets no budget: every
  // second side runs on the calling thread. Once that side sleeps in whileLent, its thread is
  // lent: second sides run on the kept thread. When it wakes it takes its thread back, waiting
  // for the kept thread's call to end: never more than two running at once.
  Concurrency c;
  std::atomic<int> phase{0};  // 1: the outer second side is busy; 2: asleep; 3: awake again
  std::atomic<bool> wake{false}, secondDone{false};
  std::mutex mutex;
  std::condition_variable woken;
  int inOrderElsewhere = 0, lentElsewhere = 0;
  runBoth(
      true,
      [&] {
        const std::thread::id here = std::this_thread::get_id();
        HelperThread helper;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (phase != 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        for (int k = 0; k < 200; ++k) {  // the outer second side holds the budget's thread
          helper.runBoth(
              [&] { c.run([] {}); },
              [&] { c.run([&] { inOrderElsewhere += std::this_thread::get_id() != here; }); });
        }
        phase = 2;  // let it sleep
        while (lentElsewhere == 0 && std::chrono::steady_clock::now() < until) {
          helper.runBoth(
              [&] { c.run([] { spinFor(50); }); },
              [&] { c.run([&] { lentElsewhere += std::this_thread::get_id() != here; }); });
        }
        {
          const std::lock_guard<std::mutex> lock(mutex);
          wake = true;
        }
        woken.notify_all();
        while (!secondDone && std::chrono::steady_clock::now() < until) {  // while the other
          // side takes its thread back and runs
          helper.runBoth([&] { c.run([] { spinFor(20); }); }, [&] { c.run([] { spinFor(20); }); });
        }
      },
      [&] {
        c.run([&] {
          phase = 1;
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          while (phase == 1 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
        });
        whileLent([&] {
          std::unique_lock<std::mutex> lock(mutex);
          woken.wait(lock, [&] { return wake.load(); });
        });
        for (int k = 0; k < 200; ++k) c.run([] { spinFor(20); });
        secondDone = true;
      });
  EXPECT_EQ(inOrderElsewhere, 0);
  EXPECT_GT(lentElsewhere, 0);
  EXPECT_LE(c.most.load(), 2);
  EXPECT_EQ(tBudget, nullptr);
}

}  // namespace
}  // namespace fcp::plan::detail
