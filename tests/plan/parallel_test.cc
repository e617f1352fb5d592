// runBoth (src/plan/parallel.h): the planner's two threads, and never more; a thread freed
// by one side serves the runBoths still to come under the other.
#include "parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
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

}  // namespace
}  // namespace fcp::plan::detail
