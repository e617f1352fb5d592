// The in-process transport the executor tests run on: its allreduce gives every rank the
// reduction of its own call, even when ranks run many back to back.
#include "thread_transport.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <thread>
#include <vector>

namespace fcp::runtime::testing {
namespace {

TEST(ThreadTransportTest, BackToBackAllreducesEachGiveTheirOwnResult) {
  constexpr int kRanks = 4;
  constexpr int64_t kCalls = 2000;
  ThreadWorld world(kRanks);
  std::vector<int64_t> wrong(kRanks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&world, &wrong, r] {
      ThreadTransport t(world, r);
      for (int64_t i = 0; i < kCalls; ++i) {
        // Call i: sum of (10 i + rank) and max of (i + rank), alternating the operation.
        int64_t v[2] = {10 * i + r, i + r};
        const ReduceOp op = i % 2 == 0 ? ReduceOp::kSum : ReduceOp::kMax;
        t.allreduce({v, 2}, op);
        const int64_t expect0 = op == ReduceOp::kSum ? 10 * i * kRanks + kRanks * (kRanks - 1) / 2
                                                     : 10 * i + kRanks - 1;
        const int64_t expect1 =
            op == ReduceOp::kSum ? i * kRanks + kRanks * (kRanks - 1) / 2 : i + kRanks - 1;
        if (v[0] != expect0 || v[1] != expect1) ++wrong[static_cast<size_t>(r)];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(wrong[static_cast<size_t>(r)], 0) << "rank " << r;
}

}  // namespace
}  // namespace fcp::runtime::testing
