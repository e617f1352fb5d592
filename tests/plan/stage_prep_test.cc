// The plan module's private steps that buildPlan runs out of their public order
// (src/plan/communication.h): the stages' lists prepared before the transfers are coloured,
// and the relabelling of receivers kept instead of transfers.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "../test_seed.h"
#include "communication.h"
#include "fcp/core/workload.h"
#include "fcp/plan/coloring.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/plan.h"

namespace fcp::plan {
namespace {

Plan plannedBatch(const char* workload, int64_t workers, uint64_t seed, bool locality) {
  PlanConfig c;
  c.numWorkers = workers;
  c.tokensPerWorker = 16384;
  c.blockSize = 2048;
  c.placement = Placement::kLpt;
  c.locality = locality;
  return buildPlan(sampleBatch(findWorkload(workload), workers * c.tokensPerWorker, seed), c,
                   CostModel{c.attention});
}

// buildPlan prepares the stages' lists while the transfers are coloured: what it prepares must
// not depend on the rounds. Here the lists are prepared while every round is wrong, and the
// stages must come out as the plan's own (small plans are built on one thread, colouring
// first, so those lists were prepared after the rounds were set).
TEST(StagePrepTest, ListsPreparedBeforeTheColouringGiveThePlansStages) {
  for (const auto& [workload, workers, seed] :
       {std::tuple{"lognormal", 16, 1}, std::tuple{"bimodal", 8, 4}, std::tuple{"lognormal", 3, 2}}) {
    const Plan built = plannedBatch(workload, workers, seed, true);
    ASSERT_FALSE(built.transfers.empty());
    Plan p = built;
    p.forward = {};
    p.backward = {};
    for (Transfer& t : p.transfers) t.round = -7;
    p.numRounds = 0;
    detail::StagePrep prep = detail::prepareStages(p);
    colorTransfers(p);
    detail::buildStages(p, std::move(prep));
    EXPECT_EQ(p.transfers, built.transfers) << workload << " " << workers;
    EXPECT_EQ(p.forward, built.forward) << workload << " " << workers;
    EXPECT_EQ(p.backward, built.backward) << workload << " " << workers;
  }
}

// buildPlan colours the transfers in place (colorTransferRounds) rather than through a copy as
// edges: the rounds must be those colorEdges gives the same edges, with the same count. The
// batches hold blocks of many sizes (packed short sequences, cut long ones), so the transfers
// fall in several size classes and the rounds are renumbered by their largest transfer.
TEST(StagePrepTest, TransfersColouredInPlaceGetTheRoundsOfColorEdges) {
  for (const auto& [workload, workers, seed] :
       {std::tuple{"lognormal", 16, 1}, std::tuple{"bimodal", 8, 4}, std::tuple{"lognormal", 64, 3},
        std::tuple{"lognormal-narrow", 5, 0}}) {
    Plan p = plannedBatch(workload, workers, seed, true);
    ASSERT_FALSE(p.transfers.empty());
    std::vector<Edge> edges;
    for (const Transfer& t : p.transfers) edges.push_back({t.sender, t.receiver, t.bytes});
    const EdgeColoring expected = colorEdges(static_cast<int32_t>(workers), edges);
    for (Transfer& t : p.transfers) t.round = -7;
    EXPECT_EQ(detail::colorTransferRounds(static_cast<int32_t>(workers), p.transfers),
              expected.numColors);
    std::vector<int32_t> rounds;
    for (const Transfer& t : p.transfers) rounds.push_back(t.round);
    EXPECT_EQ(rounds, expected.color) << workload << " " << workers;
  }
}

// Each KV block's receivers are the owners of the Q blocks that read it, other than its own,
// sorted and distinct; a block whose readers are those of the block before it reuses that
// block's sorted list (the blocks of a Zig-Zag sequence). Checked against sets made from the
// pairs, for plans as planned and with owners drawn at random from a few workers (so that
// lists repeat owners and a block's own owner is among its readers' owners), under both masks
// and both placements (Zig-Zag blocks, contiguous blocks, packed blocks).
TEST(StagePrepTest, BlockReceiversAreTheOtherOwnersOfTheBlocksReaders) {
  const uint64_t ownersSeed = testing::testSeed();
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(ownersSeed));
  std::mt19937_64 rng(ownersSeed);
  int reused = 0;
  for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
    for (const Placement placement : {Placement::kLpt, Placement::kLocal}) {
      for (const auto& [workload, workers, seed] :
           {std::tuple{"lognormal", 16, 1}, std::tuple{"bimodal", 8, 4},
            std::tuple{"lognormal-narrow", 5, 0}}) {
        PlanConfig c;
        c.numWorkers = workers;
        c.tokensPerWorker = 16384;
        c.blockSize = 2048;
        c.placement = placement;
        c.attention.mask = mask;
        Plan p = buildPlan(sampleBatch(findWorkload(workload), workers * c.tokensPerWorker, seed),
                           c, CostModel{c.attention});
        for (int round = 0; round < 3; ++round) {
          if (round > 0) {
            std::uniform_int_distribution<int32_t> few(0, round == 1 ? 1 : 2);
            for (int32_t& o : p.owner) o = few(rng);
          }
          std::vector<std::set<int32_t>> want(p.blocks.size());
          std::vector<std::vector<int32_t>> readers(p.blocks.size());
          for (const BlockPair& pair : p.pairs) {
            const int32_t w = p.owner[static_cast<size_t>(pair.qBlock)];
            readers[static_cast<size_t>(pair.kvBlock)].push_back(pair.qBlock);
            if (w != p.owner[static_cast<size_t>(pair.kvBlock)])
              want[static_cast<size_t>(pair.kvBlock)].insert(w);
          }
          const detail::BlockReceivers r = detail::blockReceivers(p);
          ASSERT_EQ(r.first.size(), p.blocks.size() + 1);
          ASSERT_EQ(r.last.size(), p.blocks.size());
          for (size_t k = 0; k < p.blocks.size(); ++k) {
            ASSERT_LE(r.first[k], r.last[k]);
            ASSERT_LE(r.last[k], r.first[k + 1]);
            const std::vector<int32_t> got(r.receivers.begin() + r.first[k],
                                           r.receivers.begin() + r.last[k]);
            EXPECT_EQ(got, std::vector<int32_t>(want[k].begin(), want[k].end()))
                << workload << " " << workers << " round " << round << " block " << k;
            // Reused lists: the block is read by the blocks that read the one before it, and
            // the two have different owners (each drops its own from the shared list).
            if (k > 0 && readers[k] == readers[k - 1] && p.owner[k] != p.owner[k - 1]) ++reused;
          }
        }
      }
    }
  }
  EXPECT_GT(reused, 0);
}

// Relabelling the receivers kept from communication balancing, then building the transfers
// from them, gives the transfers built from scratch for the relabelled owners.
TEST(StagePrepTest, RelabelledReceiversGiveTheRelabelledPlansTransfers) {
  for (const auto& [workload, workers, seed] :
       {std::tuple{"lognormal", 16, 1}, std::tuple{"bimodal", 8, 4}, std::tuple{"lognormal", 32, 0}}) {
    Plan p = plannedBatch(workload, workers, seed, false);
    const std::vector<int32_t> before = p.owner;
    p.transfers.clear();
    p.reshuffle.clear();
    p.forward = {};
    p.backward = {};
    Plan q = p;
    detail::BlockReceivers r = detail::blockReceivers(p);
    const int64_t moved = detail::relabelForLocality(p, &r);
    EXPECT_EQ(moved, relabelForLocality(q));
    ASSERT_EQ(p.owner, q.owner);
    ASSERT_NE(p.owner, before) << workload << " " << workers << ": the relabelling renamed nobody";
    EXPECT_EQ(detail::transfersOf(p, r), buildTransfers(q)) << workload << " " << workers;
  }
}

// finishLpt relabels before it looks at the communication (the receivers then come out named
// and sorted), and undoes that when balancing has work: either way the plan must be the one of
// balancing first and relabelling after, which is the plan without the relabelling, relabelled.
TEST(StagePrepTest, RelabellingBeforeTheBalancingCheckGivesThePlanOfBalancingFirst) {
  int balanced = 0, even = 0;
  for (const auto& c : {std::tuple{"lognormal", 16, 1}, std::tuple{"bimodal", 8, 4},
                        std::tuple{"lognormal", 32, 0}, std::tuple{"lognormal", 64, 3},
                        std::tuple{"bimodal", 64, 0}, std::tuple{"lognormal", 5, 2}}) {
    // Named copies, not structured bindings: lambdas capture those only from Clang 16.
    const char* workload = std::get<0>(c);
    const int workers = std::get<1>(c);
    const int seed = std::get<2>(c);
    const Plan want = [&] {
      Plan p = plannedBatch(workload, workers, seed, false);
      p.transfers.clear();
      p.reshuffle.clear();
      p.forward = {};
      p.backward = {};
      p.movedTokensWithoutLocality = relabelForLocality(p);
      p.transfers = buildTransfers(p);
      colorTransfers(p);
      p.reshuffle = buildReshuffle(p);
      buildStages(p);
      return p;
    }();
    const Plan got = plannedBatch(workload, workers, seed, true);
    (got.commBalanceSteps > 0 ? balanced : even) += 1;
    EXPECT_EQ(got.owner, want.owner) << workload << " " << workers;
    EXPECT_EQ(got.loads, want.loads) << workload << " " << workers;
    EXPECT_EQ(got.transfers, want.transfers) << workload << " " << workers;
    EXPECT_EQ(got.reshuffle, want.reshuffle) << workload << " " << workers;
    EXPECT_EQ(got.forward, want.forward) << workload << " " << workers;
    EXPECT_EQ(got.movedTokensWithoutLocality, want.movedTokensWithoutLocality);
    EXPECT_EQ(got.commBalanceSteps, want.commBalanceSteps);
  }
  // Both branches: plans whose communication balancing moved blocks, and plans already even.
  EXPECT_GT(balanced, 0);
  EXPECT_GT(even, 0);
}

// forwardSpan reads the forward span from the stage lists without building the stages: it
// must be pipelineSpan of the stages buildStages builds, to the bit (refineCosts compares the
// two plans' spans, and a last-bit difference could flip that choice). Buffer depths, coalescing
// and block sizes vary the stage count and where the pairs land; one worker has no transfers.
TEST(StagePrepTest, TheForwardSpanWithoutStagesIsThePipelineSpan) {
  struct Case {
    const char* workload;
    int64_t workers;
    uint64_t seed;
    int64_t blockSize, coalesce, bufferDepth;
  };
  int withTransfers = 0;
  for (const Case& c : {Case{"lognormal", 16, 1, 2048, 16, 3}, Case{"bimodal", 8, 4, 1024, 1, 2},
                        Case{"lognormal-narrow", 64, 2, 2048, 4, 5},
                        Case{"lognormal", 1, 0, 4096, 16, 3}, Case{"bimodal", 3, 5, 512, 2, 4}}) {
    PlanConfig config;
    config.numWorkers = c.workers;
    config.tokensPerWorker = 16384;
    config.blockSize = c.blockSize;
    config.coalesce = c.coalesce;
    config.bufferDepth = c.bufferDepth;
    const Plan p = buildPlan(
        sampleBatch(findWorkload(c.workload), c.workers * config.tokensPerWorker, c.seed), config,
        CostModel{config.attention});
    withTransfers += !p.transfers.empty();
    const double expected = pipelineSpan(p);
    EXPECT_GT(expected, 0.0) << c.workload << " " << c.workers;
    EXPECT_EQ(detail::forwardSpan(p, detail::prepareStages(p)), expected)
        << c.workload << " on " << c.workers << ", coalesce " << c.coalesce << ", depth "
        << c.bufferDepth;
  }
  EXPECT_EQ(withTransfers, 4);
}

}  // namespace
}  // namespace fcp::plan
