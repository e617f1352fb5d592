// runBoth (src/plan/parallel.h): the planner's two threads, and never more.
#include "parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace fcp::plan::detail {
namespace {

TEST(ParallelTest, ARunBothNestedInOneOnTwoThreadsRunsInOrderOnItsThread) {
  // Each side of a two-thread runBoth runs a nested runBoth asking for two threads: both of its
  // sides must run on that side's own thread, first then second. The nested first side waits
  // (up to 200 ms) for the second to start, so that a second side given a thread of its own
  // would be seen running on it, rather than claimed by this thread once the first is done.
  std::thread::id outer[2], inner[2][2];
  std::string order[2];
  const auto side = [&](int s) {
    outer[s] = std::this_thread::get_id();
    std::atomic<bool> secondStarted{false};
    runBoth(
        true,
        [&] {
          const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
          while (!secondStarted && std::chrono::steady_clock::now() < until)
            std::this_thread::yield();
          inner[s][0] = std::this_thread::get_id();
          order[s] += 'a';
        },
        [&] {
          secondStarted = true;
          inner[s][1] = std::this_thread::get_id();
          order[s] += 'b';
        });
  };
  runBoth(true, [&] { side(0); }, [&] { side(1); });
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(inner[s][0], outer[s]) << "side " << s;
    EXPECT_EQ(inner[s][1], outer[s]) << "side " << s;
    EXPECT_EQ(order[s], "ab") << "side " << s;
  }
  // Outside any runBoth this thread may use two again, also after a side threw.
  EXPECT_FALSE(tOneOfTwo);
  EXPECT_THROW(runBoth(true, [] { throw std::runtime_error("first"); }, [] {}),
               std::runtime_error);
  EXPECT_FALSE(tOneOfTwo);
}

}  // namespace
}  // namespace fcp::plan::detail
