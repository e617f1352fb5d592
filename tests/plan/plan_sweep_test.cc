// Issue 15's acceptance sweep: every combination of workers {1, 2, 3, 8, 64}, tokens per
// worker {1K, 2K, 8K, 32K}, block sizes {1K, 2K, 4K, 8K, 16K}, the built-in workloads and 3
// seeds plans without error under both placements, and every plan passes `validate`, holds
// the memory cap and cuts no block over the block size the plan says it used. One test per
// worker count and tokens per worker, so CTest can run them side by side.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "fcp/plan/plan.h"

namespace fcp::plan {
namespace {

class PlanSweepTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(PlanSweepTest, EveryShapePlansAndValidates) {
  const auto [workers, tokensPerWorker] = GetParam();
  int64_t plans = 0;
  {
    for (const Workload& workload : builtinWorkloads()) {
      for (uint64_t seed : {1, 2, 3}) {
        const Batch batch = sampleBatch(workload, workers * tokensPerWorker, seed);
        for (int64_t blockSize : {1024, 2048, 4096, 8192, 16384}) {
          for (Placement placement : {Placement::kLocal, Placement::kLpt}) {
            PlanConfig c;
            c.numWorkers = workers;
            c.tokensPerWorker = tokensPerWorker;
            c.blockSize = blockSize;
            c.placement = placement;
            const std::string what =
                std::to_string(workers) + " workers x " + std::to_string(tokensPerWorker) +
                " tokens, blocks " + std::to_string(blockSize) + ", " + workload.name + " seed " +
                std::to_string(seed) + ", " + std::string(placementName(placement));
            Plan p;
            try {
              p = buildPlan(batch, c, CostModel{c.attention});
            } catch (const std::exception& e) {
              FAIL() << what << ": " << e.what();
            }
            const auto violations = validate(p);
            ASSERT_TRUE(violations.empty()) << what << ": " << violations.front();
            const PlanStats s = computeStats(p);
            ASSERT_LE(s.maxWorkerTokens, s.memoryCapTokens) << what;
            ASSERT_GE(p.shardBlockSize, p.smallestBlockSize) << what;
            ASSERT_LE(p.shardBlockSize, blockSize) << what;
            for (const Block& b : p.blocks) ASSERT_LE(b.numTokens(), p.shardBlockSize) << what;
            ++plans;
          }
        }
      }
    }
  }
  EXPECT_EQ(plans, 3 * 3 * 5 * 2);
}

std::string shapeName(const ::testing::TestParamInfo<std::tuple<int64_t, int64_t>>& shape) {
  return std::to_string(std::get<0>(shape.param)) + "x" +
         std::to_string(std::get<1>(shape.param) / 1024) + "K";
}

INSTANTIATE_TEST_SUITE_P(Shapes, PlanSweepTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 8, 64),
                                            ::testing::Values(1024, 2048, 8192, 32768)),
                         shapeName);

}  // namespace
}  // namespace fcp::plan
