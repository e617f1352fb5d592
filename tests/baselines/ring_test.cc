// Ring attention's plan: valid for every rank count and odd batch, Zig-Zag balanced, relayed
// around the ring one hop per stage.
#include <gtest/gtest.h>

#include <string>

#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"

namespace fcp::baselines {
namespace {

plan::Plan ringFor(const Batch& batch, int64_t ranks, MaskKind mask = MaskKind::kCausal) {
  plan::PlanConfig c;
  c.numWorkers = ranks;
  c.tokensPerWorker = std::max<int64_t>(1, batch.numTokens() / ranks);
  c.attention.mask = mask;
  return ringPlan(batch, c, CostModel{c.attention});
}

void expectValid(const plan::Plan& p, const std::string& what) {
  const auto violations = plan::validate(p);
  ASSERT_TRUE(violations.empty()) << what << ": " << violations.front();
}

TEST(RingTest, ValidForOneToEightRanksAndOddBatches) {
  const std::vector<Batch> batches = {
      {{1}}, {{2}}, {{3, 1}}, {{7}}, {{1, 1, 1, 1, 1}}, {{5, 17, 1, 2}}, {{16}}, {{15}},
      {{100, 3, 64, 1, 9}}, {{1000}}, {{4096, 1, 333}}};
  for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
    for (int64_t ranks = 1; ranks <= 8; ++ranks) {
      for (const Batch& b : batches) {
        const plan::Plan p = ringFor(b, ranks, mask);
        expectValid(p, std::to_string(ranks) + " ranks, " + std::to_string(b.numSequences()) +
                           " sequences, first " + std::to_string(b.sequenceLengths[0]));
        EXPECT_EQ(p.strategy, "ring");
      }
    }
  }
}

TEST(RingTest, LongSequencesGiveTheTextbookRing) {
  const plan::Plan p = ringFor(Batch{{4096, 2048}}, 4);
  expectValid(p, "4 ranks");
  EXPECT_EQ(p.config.coalesce, 1);
  EXPECT_EQ(p.config.bufferDepth, 2);
  EXPECT_TRUE(p.congestionFree);
  EXPECT_EQ(p.numRounds, 3);
  ASSERT_EQ(p.transfers.size(), 12u);  // every rank needs every other rank's KV
  for (const plan::Transfer& t : p.transfers) {
    // In round t a rank passes on what it received in round t−1: always to its successor.
    EXPECT_EQ(t.receiver, (t.sender + 1) % 4);
    EXPECT_EQ(t.round, (t.receiver - p.owner[static_cast<size_t>(t.block)] + 4) % 4 - 1);
  }
  for (const auto& stages : p.forward) {
    ASSERT_EQ(stages.size(), 4u);
    for (size_t s = 0; s < 3; ++s) {
      EXPECT_EQ(stages[s].send.size(), 1u);
      EXPECT_EQ(stages[s].recv.size(), 1u);
    }
  }
}

TEST(RingTest, ZigZagBalancesCausalWork) {
  const plan::Plan p = ringFor(Batch{{8192}}, 4);
  for (const plan::WorkerLoad& l : p.loads) {
    EXPECT_EQ(l.numTokens, 2048);
    EXPECT_NEAR(l.cost, p.loads[0].cost, 1e-9 * p.loads[0].cost);
  }
}

TEST(RingTest, RejectsBadInput) {
  plan::PlanConfig c;
  c.numWorkers = 0;
  EXPECT_THROW(ringPlan(Batch{{8}}, c, CostModel{}), Error);
  c.numWorkers = 2;
  EXPECT_THROW(ringPlan(Batch{{0}}, c, CostModel{}), Error);
}

}  // namespace
}  // namespace fcp::baselines
