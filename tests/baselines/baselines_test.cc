// Every baseline emits plans validate accepts, on odd batches and rank counts, and each keeps
// the shape it models.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "fcp/baselines/baselines.h"
#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "../common/error_of.h"

namespace fcp::baselines {
namespace {

plan::PlanConfig configFor(const Batch& batch, int64_t workers) {
  plan::PlanConfig c;
  c.numWorkers = workers;
  c.tokensPerWorker = std::max<int64_t>(1, (batch.numTokens() + workers - 1) / workers);
  c.blockSize = std::max<int64_t>(1, c.tokensPerWorker / 4);
  return c;
}

/// Oracle for the tests: the busiest worker's compute cost.
double busiest(const plan::Plan& p) {
  double m = 0;
  for (const plan::WorkerLoad& l : p.loads) m = std::max(m, l.cost);
  return m;
}

TEST(BaselinesTest, EveryStrategyGivesValidPlans) {
  std::vector<Batch> batches = {{{1}}, {{3, 1}}, {{5, 17, 1, 2}}, {{100, 3, 64, 1, 9}},
                                {{4096, 1, 333}}, {{700, 700, 700}}, {{2000, 10, 10, 10, 10, 10}}};
  for (uint64_t seed = 0; seed < 3; ++seed) {
    batches.push_back(sampleBatch(findWorkload("lognormal"), 64 * 1024, seed));
  }
  for (const std::string name : {"ring", "bytescale", "wlb", "magi", "megatron", "fcp-base",
                                  "fcp-pipeline", "fcp-cfree", "fcp-coalesce"}) {
    for (const int64_t workers : {1, 2, 3, 4, 5, 8, 16}) {
      for (const Batch& b : batches) {
        plan::PlanConfig c = configFor(b, workers);
        c.memorySlack = 1.0;
        const plan::Plan p = makePlan(name, b, c, CostModel{c.attention}, busiest);
        auto violations = plan::validate(p);
        if (name == "fcp-base" || name == "fcp-pipeline") {
          // They model an unordered all-to-all: only the per-stage limits may break.
          std::erase_if(violations, [](const std::string& v) {
            return v.find("moves more than") != std::string::npos || v.find("holds") != std::string::npos;
          });
        }
        ASSERT_TRUE(violations.empty()) << name << ", " << workers << " workers, "
                                        << b.numSequences() << " sequences: " << violations.front();
      }
    }
  }
}

TEST(BaselinesTest, ByteScaleGivesLongerSequencesProportionallyMoreWorkers) {
  // 8 workers, 8K tokens each: a 32K sequence gets 4 workers, a 16K one 2, the rest 1 each.
  const Batch b{{32768, 16384, 4096, 4096, 4096, 4096}};
  plan::PlanConfig c = configFor(b, 8);
  const plan::Plan p = bytescalePlan(b, c, CostModel{c.attention});
  std::vector<std::set<int32_t>> holders(b.sequenceLengths.size());
  for (size_t blk = 0; blk < p.blocks.size(); ++blk) {
    for (const plan::Chunk& ch : p.blocks[blk].chunks) holders[static_cast<size_t>(ch.sequence)].insert(p.owner[blk]);
  }
  EXPECT_EQ(holders[0].size(), 4u);
  EXPECT_EQ(holders[1].size(), 2u);
  for (size_t s = 2; s < holders.size(); ++s) EXPECT_EQ(holders[s].size(), 1u);
  EXPECT_EQ(p.strategy, "bytescale");
}

TEST(BaselinesTest, MegatronGroupsArePowersOfTwo) {
  const Batch b{{24576, 8192, 8192, 4096, 4096, 8192}};
  plan::PlanConfig c = configFor(b, 8);
  const plan::Plan p = megatronPlan(b, c, CostModel{c.attention});
  std::vector<std::set<int32_t>> holders(b.sequenceLengths.size());
  for (size_t blk = 0; blk < p.blocks.size(); ++blk) {
    for (const plan::Chunk& ch : p.blocks[blk].chunks) holders[static_cast<size_t>(ch.sequence)].insert(p.owner[blk]);
  }
  EXPECT_EQ(holders[0].size(), 4u);  // 24K over an 8K cap: 3, rounded up to 4
  for (const auto& h : holders) EXPECT_EQ(h.size() & (h.size() - 1), 0u);
}

TEST(BaselinesTest, MagiBalancesAreaAndIsNotCongestionFree) {
  const Batch b = sampleBatch(findWorkload("lognormal"), 64 * 1024, 7);
  plan::PlanConfig c = configFor(b, 8);
  const plan::Plan p = magiPlan(b, c, CostModel{c.attention});
  EXPECT_FALSE(p.congestionFree);
  for (const plan::Block& blk : p.blocks) EXPECT_LE(blk.numTokens(), kMagiChunkTokens);
  EXPECT_LE(p.numRounds, kMagiStages);
}

TEST(BaselinesTest, WlbTakesTheOraclesChoice) {
  const Batch b{{32768, 1024, 1024}};
  plan::PlanConfig c = configFor(b, 4);
  const CostModel m{c.attention};
  const plan::Plan ring = ringPlan(b, c, m);
  const plan::Plan bytescale = bytescalePlan(b, c, m);
  const plan::Plan pick = wlbPlan(b, c, m, busiest);
  EXPECT_EQ(pick.strategy, "wlb");
  EXPECT_EQ(pick.blocks, busiest(bytescale) < busiest(ring) ? bytescale.blocks : ring.blocks);
  EXPECT_THROW(wlbPlan(b, c, m, {}), Error);
  EXPECT_THROW(makePlan("nope", b, c, m), Error);
}

}  // namespace
}  // namespace fcp::baselines

namespace fcp::baselines {
namespace {

// Baselines are bounded like FCP's planner (fcp/plan/limits.h): past kMaxPairs worker pairs a
// one-line refusal, at once, instead of minutes and gigabytes.
TEST(BaselineLimitsTest, RingStylePlannersRefusePastThePairLimit) {
  plan::PlanConfig c;
  c.numWorkers = 8192;  // 8192^2 = 2^26 > 2^25 pairs
  c.tokensPerWorker = 1024;
  const Batch batch{{c.numWorkers * c.tokensPerWorker}};
  for (const char* name : {"ring", "megatron", "bytescale", "wlb"}) {
    const std::string what = fcp::testing::errorOf([&] {
      makePlan(name, batch, c, CostModel{c.attention}, [](const plan::Plan&) { return 0.0; });
    });
    EXPECT_NE(what.find("expected at most 5792 workers"), std::string::npos) << name << ": " << what;
  }
  c.numWorkers = 64;  // well inside: plans
  const Batch small{{c.numWorkers * c.tokensPerWorker}};
  EXPECT_NO_THROW(makePlan("ring", small, c, CostModel{c.attention}));
}

TEST(BaselineLimitsTest, MagiIsBoundedByItsChunkPairs) {
  plan::PlanConfig c;
  c.numWorkers = 256;
  c.tokensPerWorker = 64 * 1024;
  // One sequence of 16M tokens: 8192 chunks of 2048, 2^26 pairs.
  const Batch batch{{c.numWorkers * c.tokensPerWorker}};
  EXPECT_THROW(makePlan("magi", batch, c, CostModel{c.attention}), Error);
}

}  // namespace
}  // namespace fcp::baselines
