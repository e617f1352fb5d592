// Issue 15: a plan for every batch that fits in workers x cap tokens (blocks the memory cap
// cannot place are cut finer), and cost-aware blocks for long-tailed batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <utility>

#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/json.h"
#include "fcp/plan/plan.h"
#include "../common/error_of.h"

namespace fcp::plan {
namespace {

/// safeBlockTokens by its definition: the largest m with (N - 1) m < N (cap + 1) - T, found by
/// counting up (0 when the batch does not fit).
int64_t safeByCounting(int64_t batchTokens, const DistributorOptions& o) {
  const int64_t cap = memoryCapTokens(o);
  if (batchTokens > o.numWorkers * cap) return 0;
  int64_t m = 0;
  while (m < cap && (o.numWorkers - 1) * (m + 1) < o.numWorkers * (cap + 1) - batchTokens) ++m;
  return m;
}

TEST(SafeBlockTokensTest, MatchesItsDefinition) {
  Rng rng(15);
  for (int trial = 0; trial < 2000; ++trial) {
    DistributorOptions o;
    o.numWorkers = 1 + static_cast<int64_t>(rng.next() % 9);
    o.memoryLimitTokens = 1 + static_cast<int64_t>(rng.next() % 200);
    o.memorySlack = trial % 3 == 0 ? 0.0 : 0.1 * static_cast<double>(rng.next() % 5);
    const int64_t batch =
        1 + static_cast<int64_t>(rng.next() %
                                 static_cast<uint64_t>(o.numWorkers * memoryCapTokens(o) + 20));
    ASSERT_EQ(safeBlockTokens(batch, o), safeByCounting(batch, o))
        << "trial " << trial << ": " << o.numWorkers << " workers, cap " << memoryCapTokens(o)
        << ", " << batch << " tokens";
  }
}

TEST(SafeBlockTokensTest, BlocksOfThatSizeAlwaysPack) {
  // Random blocks no larger than the safe size, filling the workers as full as the batch
  // allows: the greedy must never need the repair, let alone fail.
  Rng rng(16);
  for (int trial = 0; trial < 300; ++trial) {
    DistributorOptions o;
    o.numWorkers = 1 + static_cast<int64_t>(rng.next() % 12);
    o.memoryLimitTokens = 50 + static_cast<int64_t>(rng.next() % 400);
    o.memorySlack = trial % 2 ? 0.0 : 0.05;
    const int64_t cap = memoryCapTokens(o);
    const int64_t total = o.numWorkers * cap - static_cast<int64_t>(rng.next() % 30);
    const int64_t safe = safeBlockTokens(total, o);
    ASSERT_GE(safe, 1);
    std::vector<int64_t> tokens;
    std::vector<double> costs;
    for (int64_t left = total; left > 0;) {
      const int64_t m =
          std::min(left, 1 + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(safe)));
      tokens.push_back(m);
      costs.push_back(static_cast<double>(m) * (1.0 + 10.0 * rng.uniform()));
      left -= m;
    }
    const std::optional<Assignment> a = tryAssignBlocks(tokens, costs, o);
    ASSERT_TRUE(a.has_value()) << "trial " << trial;
    EXPECT_FALSE(a->memoryRepaired) << "trial " << trial;
  }
}

TEST(TryAssignBlocksTest, SaysWhichBlockFoundNoRoom) {
  DistributorOptions o;
  o.numWorkers = 2;
  o.memoryLimitTokens = 100;
  o.memorySlack = 0;
  int32_t unplaced = -1;
  // Fits in total, but three blocks of 60 do not pack into two workers of 100.
  EXPECT_FALSE(tryAssignBlocks({60, 60, 60}, {1, 1, 1}, o, &unplaced).has_value());
  EXPECT_GE(unplaced, 0);
  EXPECT_FALSE(tryAssignBlocks({30, 101}, {1, 1}, o, &unplaced).has_value());
  EXPECT_EQ(unplaced, 1);  // over the cap
  // A batch over workers x cap is still an error.
  EXPECT_THROW(tryAssignBlocks({60, 60, 60, 60}, {1, 1, 1, 1}, o), Error);
}

PlanConfig configFor(int64_t workers, int64_t tokensPerWorker, int64_t blockSize,
                     Placement placement) {
  PlanConfig c;
  c.numWorkers = workers;
  c.tokensPerWorker = tokensPerWorker;
  c.blockSize = blockSize;
  c.placement = placement;
  return c;
}

/// Every block no larger than the sharding's block size, and the plan valid.
void expectValidFinerPlan(const Plan& p, const std::string& what) {
  const auto violations = validate(p);
  ASSERT_TRUE(violations.empty()) << what << ": " << violations.front();
  EXPECT_GT(p.shardBlockSize, 0) << what;
  for (const Block& b : p.blocks) ASSERT_LE(b.numTokens(), p.shardBlockSize) << what;
}

TEST(PlanFallbackTest, Seed5979PlansWithFinerBlocks) {
  // Once "no worker has room for block 1 (3976 tokens) under the memory cap of 36044 tokens".
  const Batch batch = sampleBatch(findWorkload("lognormal"), 16 * 32768, 5979);
  for (Placement placement : {Placement::kLpt, Placement::kLocal}) {
    const PlanConfig c = configFor(16, 32768, 4096, placement);
    const Plan p = buildPlan(batch, c, CostModel{c.attention});
    expectValidFinerPlan(p, std::string(placementName(placement)));
    if (p.placement == Placement::kLpt) {
      EXPECT_GE(p.memoryRetries, 1);
      EXPECT_LT(p.shardBlockSize, 4096);
    }
    EXPECT_EQ(planToJson(p), planToJson(buildPlan(batch, c, CostModel{c.attention})));
  }
}

TEST(PlanFallbackTest, TightCapWithNoSlackStillPlans) {
  // Three sequences of 60 tokens on two workers of 100 tokens and no slack: no packing of
  // whole sequences fits, yet 180 <= 2 x 100, so a plan must exist.
  for (Placement placement : {Placement::kLpt, Placement::kLocal}) {
    PlanConfig c = configFor(2, 100, 60, placement);
    c.memorySlack = 0;
    const Plan p = buildPlan(Batch{{60, 60, 60}}, c, CostModel{c.attention});
    expectValidFinerPlan(p, std::string(placementName(placement)));
    EXPECT_GE(p.memoryRetries, 1);
  }
}

TEST(PlanFallbackTest, BlocksOverTheCapAreCutToFit) {
  const Batch batch = sampleBatch(findWorkload("bimodal"), 8 * 1024, 1);
  for (Placement placement : {Placement::kLpt, Placement::kLocal}) {
    const PlanConfig c = configFor(8, 1024, 16384, placement);
    const Plan p = buildPlan(batch, c, CostModel{c.attention});
    expectValidFinerPlan(p, std::string(placementName(placement)));
    EXPECT_LE(p.shardBlockSize, memoryCapTokens(DistributorOptions{8, 1024}));
    EXPECT_GE(p.memoryRetries, 1);
  }
}

TEST(PlanFallbackTest, TheLocalPlacementCutsFinerToo) {
  // 3 workers x 8K tokens in 8K blocks (lognormal, seed 19): the layout's blocks do not pack
  // under the cap of 9011; the local placement's own finer blocks win (not the paper's).
  const Batch batch = sampleBatch(findWorkload("lognormal"), 3 * 8192, 19);
  const PlanConfig c = configFor(3, 8192, 8192, Placement::kLocal);
  const Plan p = buildPlan(batch, c, CostModel{c.attention});
  expectValidFinerPlan(p, "local");
  EXPECT_EQ(p.placement, Placement::kLocal);
  EXPECT_GE(p.memoryRetries, 1);
  EXPECT_LT(p.shardBlockSize, 8192);
}

TEST(PlanFallbackTest, OnlyABatchOverWorkersTimesCapIsAnError) {
  PlanConfig c = configFor(2, 100, 60, Placement::kLpt);
  c.memorySlack = 0;
  const std::string what =
      fcp::testing::errorOf([&] { buildPlan(Batch{{150, 51}}, c, CostModel{c.attention}); });
  EXPECT_NE(what.find("201 tokens > 2 workers x 100 tokens"), std::string::npos) << what;
  EXPECT_NO_THROW(buildPlan(Batch{{150, 50}}, c, CostModel{c.attention}));  // exactly full
}

TEST(PlanFallbackTest, OldPlansWithoutTheShardingRecordStillLoad) {
  const PlanConfig c = configFor(4, 8192, 4096, Placement::kLocal);
  const Plan p =
      buildPlan(sampleBatch(findWorkload("lognormal"), 4 * 8192, 2), c, CostModel{c.attention});
  std::string text = planToJson(p);
  const auto at = text.find(",\"sharding\":{");
  ASSERT_NE(at, std::string::npos);
  text.erase(at, text.find('}', at) + 1 - at);
  const Plan old = planFromJson(text);
  EXPECT_EQ(old.shardBlockSize, 0);
  EXPECT_TRUE(validate(old).empty());
  EXPECT_EQ(planFromJson(planToJson(p)), p);
}

/// Issue 15's long-tailed batch, built like data/traces/longtail_64x32k.txt: one sequence of
/// 354K tokens among shorter ones of 1K to 16K, 64 x 32K tokens in all.
Batch longTailedBatch(uint64_t seed) {
  Rng rng(seed);
  Batch batch{{354 * 1024}};
  for (int64_t left = 64 * 32768 - batch.sequenceLengths[0]; left > 0;) {
    const int64_t length = std::min(left, int64_t{1024} << (rng.next() % 5));
    batch.sequenceLengths.push_back(length);
    left -= length;
  }
  return batch;
}

double busiest(const Plan& p) {
  double m = 0;
  for (const WorkerLoad& l : p.loads) m = std::max(m, l.cost);
  return m;
}

/// `batch` planned on 64 workers with `placement`: without cost-aware blocks, then with.
std::pair<Plan, Plan> uncutAndCut(const Batch& batch, Placement placement) {
  PlanConfig c;
  c.numWorkers = 64;
  c.placement = placement;
  c.costAwareBlocks = false;
  Plan before = buildPlan(batch, c, CostModel{c.attention});
  c.costAwareBlocks = true;
  return {std::move(before), buildPlan(batch, c, CostModel{c.attention})};
}

TEST(CostAwareBlocksTest, GiantBlocksAreCutWhenItLowersTheBusiestWorker) {
  // Each 4K Zig-Zag block of the 354K-token sequence costs most of a worker's share: 89 of
  // them on 64 workers leave 25 workers with two. Cutting them finer must lower the busiest
  // worker's cost (not only its gap to a lower bound that finer blocks raise).
  for (uint64_t seed : {1, 2}) {
    const Batch batch = longTailedBatch(seed);
    for (Placement placement : {Placement::kLpt, Placement::kLocal}) {
      const auto [before, after] = uncutAndCut(batch, placement);
      const std::string what =
          "seed " + std::to_string(seed) + " " + std::string(placementName(placement));
      ASSERT_TRUE(validate(after).empty()) << what;
      EXPECT_EQ(before.costCutSequences, 0) << what;
      EXPECT_GE(after.costCutSequences, 1) << what;
      EXPECT_LT(after.smallestBlockSize, 4096) << what;
      EXPECT_LT(busiest(after), 0.97 * busiest(before)) << what;
      EXPECT_LT(busiest(after), after.lowerBound * 1.02) << what;
      // The per-sequence sizes are deterministic: the same plan twice.
      EXPECT_EQ(planToJson(after), planToJson(uncutAndCut(batch, placement).second));
    }
  }
}

TEST(CostAwareBlocksTest, BlocksOverAShareAreCutThoughThePlanIsAtItsBound) {
  // Each 4K Zig-Zag block of a 96K-token sequence among 4K-token ones, in a batch of 60 % of
  // 64 workers' tokens, costs nearly two workers' shares: the lower bound is such a block, and
  // the uncut plan sits on it (the short blocks fit on the other workers), yet it is that far
  // above a share. Cost-aware blocks must cut the sequence all the same (code corpus on 4096
  // workers, seeds 2-4, were such batches: simulated 5-8 % faster on H100, 11-27 % on GPU-X,
  // once cut).
  Batch batch{{24 * 4096}};
  while (batch.numTokens() < 64 * 32768 * 6 / 10) batch.sequenceLengths.push_back(4096);
  for (Placement placement : {Placement::kLpt, Placement::kLocal}) {
    const auto [before, after] = uncutAndCut(batch, placement);
    const std::string what(placementName(placement));
    ASSERT_TRUE(validate(after).empty()) << what;
    double total = 0;
    for (const WorkerLoad& l : before.loads) total += l.cost;
    EXPECT_EQ(busiest(before), before.lowerBound) << what;  // at its bound ...
    EXPECT_GT(busiest(before), 1.5 * total / 64) << what;   // ... which is over a share
    EXPECT_GE(after.costCutSequences, 1) << what;
    EXPECT_LT(busiest(after), 0.8 * busiest(before)) << what;
  }
}

TEST(CostAwareBlocksTest, TheCostliestBlocksGetAnEvenCountOfTheirOwn) {
  // 93 4K blocks of a 372K-token sequence, each about half a worker's share, and 99 blocks of
  // nine 44K-token sequences over 5 % of a share: 192 blocks over it, a multiple of the 64
  // workers, so the "even count" over 5 % has nothing to do, while 29 workers must hold two of
  // the costliest (22 % above LB; code corpus seed 6 on 64 workers was such a batch). Counted
  // among themselves, the costliest become 128: two a worker.
  Batch batch{{93 * 4096}};
  for (int i = 0; i < 9; ++i) batch.sequenceLengths.push_back(11 * 4096);
  while (batch.numTokens() < 64 * 32768) batch.sequenceLengths.push_back(4096);
  PlanConfig c;
  c.numWorkers = 64;
  c.placement = Placement::kLpt;
  c.costAwareBlocks = false;
  const Plan before = buildPlan(batch, c, CostModel{c.attention});
  c.costAwareBlocks = true;
  const Plan after = buildPlan(batch, c, CostModel{c.attention});
  ASSERT_TRUE(validate(after).empty());
  EXPECT_EQ(after.costCutSequences, 1);  // the long sequence alone
  int64_t cut = 0;  // its blocks: twice the workers
  for (const Block& b : after.blocks) cut += b.chunks.front().sequence == 0;
  EXPECT_EQ(cut, 128);
  EXPECT_LT(busiest(after), 0.95 * busiest(before));  // 0.91x
  EXPECT_LT(busiest(after), after.lowerBound * 1.05);
}

TEST(CostAwareBlocksTest, ACheaperCuttingThatSpansLongerIsRefused) {
  // Finer cuttings put more rounds between the holders of a long sequence, and a worker can
  // then wait on another's stage: a cutting whose busiest worker is cheaper can still span
  // longer. The paper's placement keeps a cheaper cutting only if its forward pass spans no
  // longer, so a cost-aware plan never spans longer than the uncut one, with communication
  // taking no time (pipelineSpan). On the lognormal batches (16 workers, seed 4; 32 workers,
  // seed 3) the "even count" cutting made the busiest worker 0.6 % and 5.8 % cheaper but
  // spanned longer; simulated on H100 it was 3 % and 6 % slower. On the first every cutting is
  // refused; on the second another one, cheaper than the uncut plan but dearer than the
  // refused one, is kept. (Spans are compared before the plans are finished, so only the
  // refused case's finished spans are exactly those compared.) The third batch (as in
  // TheCostliestBlocksGetAnEvenCountOfTheirOwn) is one where a cutting is cheaper and spans
  // less, so it is kept.
  Batch giant{{93 * 4096}};
  for (int i = 0; i < 9; ++i) giant.sequenceLengths.push_back(11 * 4096);
  while (giant.numTokens() < 64 * 32768) giant.sequenceLengths.push_back(4096);
  const std::vector<std::pair<int64_t, Batch>> cases = {
      {16, sampleBatch(findWorkload("lognormal"), 16 * 32768, 4)},
      {32, sampleBatch(findWorkload("lognormal"), 32 * 32768, 3)},
      {64, giant}};
  for (const auto& [workers, batch] : cases) {
    PlanConfig c;
    c.numWorkers = workers;
    c.placement = Placement::kLpt;
    const Plan cut = buildPlan(batch, c, CostModel{c.attention});
    c.costAwareBlocks = false;
    const Plan uncut = buildPlan(batch, c, CostModel{c.attention});
    ASSERT_TRUE(validate(cut).empty());
    // The uncut plan ends above where cost-aware blocks stop, so the cuttings were tried.
    EXPECT_GT(busiest(uncut), uncut.lowerBound * (1.0 + c.improveTarget + 0.005));
    if (workers == 64) {  // kept
      EXPECT_EQ(cut.costCutSequences, 1);
      EXPECT_LT(busiest(cut), busiest(uncut));
      continue;
    }
    EXPECT_LE(pipelineSpan(cut), pipelineSpan(uncut)) << workers << " workers";
    if (workers == 16) {  // every cutting refused: the uncut plan stays
      EXPECT_EQ(cut.costCutSequences, 0);
      EXPECT_EQ(busiest(cut), busiest(uncut));
    }
  }
}

TEST(CostAwareBlocksTest, BalancedBatchesKeepTheirBlocks) {
  // Built-in workloads at 64 workers x 32K balance within the target with 4K blocks: nothing
  // is cut, and the plan is the same with and without cost-aware blocks.
  for (const Workload& w : builtinWorkloads()) {
    PlanConfig c;
    c.numWorkers = 64;
    const Batch batch = sampleBatch(w, 64 * 32768, 7);
    const Plan after = buildPlan(batch, c, CostModel{c.attention});
    EXPECT_EQ(after.costCutSequences, 0) << w.name;
    c.costAwareBlocks = false;
    Plan before = buildPlan(batch, c, CostModel{c.attention});
    before.config.costAwareBlocks = true;
    EXPECT_EQ(before, after) << w.name;
  }
}

TEST(MemoryAwarePackingTest, ShortSequencesPackFinerWhenTheCapLeavesThemNowhereToGo) {
  // Lognormal, 1024 workers x 32K, seed 8: the holder of the costliest block also kept packed
  // blocks of short sequences, and every other worker's room under the cap was less than a
  // 4K block (1.31 % above LB before chains, 0.88 % with them). Half-size packed blocks fill
  // that room: the busiest worker ends within the 1 % target of the bound.
  PlanConfig c;
  c.numWorkers = 1024;
  c.placement = Placement::kLpt;
  const Batch batch = sampleBatch(findWorkload("lognormal"), 1024 * 32768, 8);
  const Plan p = buildPlan(batch, c, CostModel{c.attention});
  ASSERT_TRUE(validate(p).empty());
  // Packed at half the block size, with no sequence cut finer (not the "halved" cutting).
  EXPECT_EQ(p.shardBlockSize, 4096);
  EXPECT_EQ(p.smallestBlockSize, 4096);
  EXPECT_EQ(p.packedBlockSize, 2048);
  EXPECT_LT(computeStats(p).lowerBoundGap, 0.01);
  for (const Block& b : p.blocks) {
    const auto first = static_cast<size_t>(b.chunks.front().sequence);
    const int64_t length = batch.sequenceLengths[first];
    if (length < p.shardBlockSize && length <= p.packedBlockSize) {
      EXPECT_LE(b.numTokens(), p.packedBlockSize);
    }
  }
  // The plan file says so, and reads back the same.
  const std::string text = planToJson(p);
  EXPECT_NE(text.find("\"packed_block_size\":" + std::to_string(p.packedBlockSize)),
            std::string::npos);
  EXPECT_EQ(planFromJson(text), p);
}

TEST(MemoryAwarePackingTest, PlansThatPackAtTheBlockSizeKeepTheirJson) {
  // Only a plan that packed finer writes packed_block_size (pinned digests stay as they were);
  // without it, a plan reads back packing at its sharding's block size.
  const PlanConfig c = configFor(64, 32768, 4096, Placement::kLpt);
  const Plan p =
      buildPlan(sampleBatch(findWorkload("lognormal"), 64 * 32768, 7), c, CostModel{c.attention});
  EXPECT_EQ(p.packedBlockSize, p.shardBlockSize);
  const std::string text = planToJson(p);
  EXPECT_EQ(text.find("packed_block_size"), std::string::npos);
  EXPECT_EQ(planFromJson(text), p);
  // A packed block size outside 0 .. the sharding's block size is named.
  Plan bad = p;
  bad.packedBlockSize = p.shardBlockSize + 1;
  const auto violations = validate(bad);
  ASSERT_FALSE(violations.empty());
  EXPECT_NE(violations.front().find("packed block size"), std::string::npos);
}

}  // namespace
}  // namespace fcp::plan
