// Communication balancing (src/plan/comm_balance.h, private to the plan module): the bounded
// swap search keeps exactly the swaps that trying every candidate keeps; and the floor on the
// busiest worker's bytes (commFloorBytes): never above what trying every placement of small
// plans finds, exact where it should be, the same however its blocks are searched.
#include "comm_balance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"
#include "fcp/plan/sharding.h"

namespace fcp::plan {
namespace {

struct Case {
  const char* workload;
  int64_t workers;
  int64_t tokensPerWorker;
  int64_t blockSize;
  Placement placement;
  MaskKind mask;
  uint64_t seed;
};

// The floor skips a swap only when the busiest worker's bytes cannot fall below where they
// were. Trying every candidate, the balancer checks each floor against the bytes the swap
// gives (a floor above them throws); and a floor set too high would skip a swap that lowers
// them, so the two searches would part (each step keeps the first swap that helps). Compute
// and memory caps looser than the planner's let many more swaps help, so most steps keep one.
TEST(CommBalanceTest, TheBoundedSearchKeepsTheSwapsEveryCandidateKeeps) {
  int64_t steps = 0;
  for (const Case& k : {Case{"bimodal", 32, 16384, 1024, Placement::kLocal, MaskKind::kCausal, 3},
                        Case{"lognormal", 64, 32768, 4096, Placement::kLpt, MaskKind::kCausal, 8},
                        Case{"bimodal", 64, 16384, 2048, Placement::kLocal, MaskKind::kCausal, 6},
                        Case{"lognormal-narrow", 16, 16384, 1024, Placement::kLpt,
                             MaskKind::kCausal, 2},
                        Case{"bimodal", 12, 16384, 2048, Placement::kLpt, MaskKind::kFull, 5},
                        // In these, some kept swaps lower the busiest worker only because the
                        // block it takes was why it sent its own blocks to the partner (the first
                        // two) or why it received that block (the third); found by searching
                        // small batches with each of those terms left out of the floor.
                        Case{"bimodal", 16, 16384, 1024, Placement::kLocal, MaskKind::kFull, 0},
                        Case{"bimodal", 8, 16384, 2048, Placement::kLocal, MaskKind::kCausal, 6},
                        Case{"bimodal", 4, 16384, 1024, Placement::kLocal, MaskKind::kCausal, 9},
                        Case{"lognormal", 32, 32768, 4096, Placement::kLpt, MaskKind::kFull, 0}}) {
    for (const double slack : {0.002, 0.05}) {
      PlanConfig c;
      c.numWorkers = k.workers;
      c.tokensPerWorker = k.tokensPerWorker;
      c.blockSize = k.blockSize;
      c.placement = k.placement;
      c.attention.mask = k.mask;
      c.commBalanceSlack = -1;  // unbalanced: the balancer below has the work to do
      const CostModel model{c.attention};
      const Plan built = buildPlan(
          sampleBatch(findWorkload(k.workload), k.workers * k.tokensPerWorker, k.seed), c, model);
      const std::vector<double> cost =
          blockCosts(static_cast<int64_t>(built.blocks.size()), built.pairs);
      const double computeCap = built.lowerBound * (1 + slack);
      const int64_t memoryCap = computeStats(built).memoryCapTokens + (slack > 0.01 ? 4096 : 0);
      const std::string what = std::string(k.workload) + " on " + std::to_string(k.workers) +
                               " workers, slack " + std::to_string(slack);
      Plan bounded = built, every = built;
      const int64_t maxSteps = 16 * k.workers;
      // Without the work limit: trying every candidate does far more work than the bounded
      // search, and would stop sooner.
      const int64_t a = detail::balanceCommunication(bounded, cost, computeCap, memoryCap, maxSteps,
                                                     detail::SwapSearch::kBounded, INT64_MAX);
      const int64_t b = detail::balanceCommunication(every, cost, computeCap, memoryCap, maxSteps,
                                                     detail::SwapSearch::kEvery, INT64_MAX);
      EXPECT_EQ(a, b) << what;
      EXPECT_EQ(bounded.owner, every.owner) << what;
      steps += a;
    }
  }
  EXPECT_GE(steps, 200);  // the comparison covers many kept swaps, not a few
}

// The work limit stops the balancer, it does not steer it: a run stopped by it made the first
// swaps of a run without it (the same owners as that run limited to as many steps), and fewer.
// A local placement of a bimodal batch in small blocks, balanced with loose caps (as in the
// test above): many swaps to make, each tried swap moving both blocks' pairs there and back.
TEST(CommBalanceTest, TheWorkLimitStopsTheSwapsItDoesNotChangeThem) {
  PlanConfig c;
  c.numWorkers = 32;
  c.tokensPerWorker = 16384;
  c.blockSize = 1024;
  c.placement = Placement::kLocal;
  c.commBalanceSlack = -1;
  const CostModel model{c.attention};
  const Plan built = buildPlan(
      sampleBatch(findWorkload("bimodal"), c.numWorkers * c.tokensPerWorker, 3), c, model);
  const std::vector<double> cost =
      blockCosts(static_cast<int64_t>(built.blocks.size()), built.pairs);
  const double computeCap = built.lowerBound * 1.05;
  const int64_t memoryCap = computeStats(built).memoryCapTokens + 4096;
  const int64_t maxSteps = 64 * c.numWorkers;
  Plan free = built;
  const int64_t all = detail::balanceCommunication(free, cost, computeCap, memoryCap, maxSteps,
                                                   detail::SwapSearch::kBounded, INT64_MAX);
  ASSERT_GE(all, 8) << "the balancer must have swaps to make here";
  // The default limit is far above what this plan needs.
  Plan byDefault = built;
  EXPECT_EQ(detail::balanceCommunication(byDefault, cost, computeCap, memoryCap, maxSteps), all);
  EXPECT_EQ(byDefault.owner, free.owner);
  int64_t least = all;
  for (const int64_t work : {int64_t{0}, int64_t{1} << 12, int64_t{1} << 16, int64_t{1} << 18}) {
    Plan limited = built;
    const int64_t made = detail::balanceCommunication(limited, cost, computeCap, memoryCap,
                                                      maxSteps, detail::SwapSearch::kBounded, work);
    Plan prefix = built;
    EXPECT_EQ(detail::balanceCommunication(prefix, cost, computeCap, memoryCap, made), made)
        << "work " << work;
    EXPECT_EQ(limited.owner, prefix.owner) << "work " << work;
    EXPECT_LE(made, all) << "work " << work;
    least = std::min(least, made);
  }
  EXPECT_LT(least, all);  // some limit did stop it
}

// The least, over every placement of a small plan's blocks under a token cap and a cost cap,
// of the busiest worker's bytes (sent plus received), by trying them all.
int64_t leastBusiestBytes(const Plan& plan, int64_t capTokens, double maxCost) {
  const size_t n = plan.blocks.size();
  const auto workers = static_cast<size_t>(plan.config.numWorkers);
  const std::vector<double> cost = blockCosts(static_cast<int64_t>(n), plan.pairs);
  const int64_t perToken = plan.config.attention.kvBytesPerToken();
  // Every array is made once: the loop runs up to 6e5 times, also under the sanitizers.
  std::vector<size_t> owner(n, 0);
  std::vector<int64_t> tokens(workers), bytes(workers);
  std::vector<double> load(workers);
  std::vector<int64_t> sentIn(n * workers, -1);  // the placement that last sent k to w
  int64_t least = std::numeric_limits<int64_t>::max();
  for (int64_t placement = 0;; ++placement) {
    std::fill(tokens.begin(), tokens.end(), 0);
    std::fill(load.begin(), load.end(), 0.0);
    for (size_t b = 0; b < n; ++b) {
      tokens[owner[b]] += plan.blocks[b].numTokens();
      load[owner[b]] += cost[b];
    }
    bool fits = true;
    for (size_t w = 0; w < workers; ++w) {
      fits = fits && tokens[w] <= capTokens && load[w] <= maxCost * (1 + 1e-12);
    }
    if (fits) {
      // Each KV block once to each worker other than its owner whose Q blocks read it.
      std::fill(bytes.begin(), bytes.end(), 0);
      for (const BlockPair& p : plan.pairs) {
        const auto k = static_cast<size_t>(p.kvBlock);
        const size_t to = owner[static_cast<size_t>(p.qBlock)];
        if (to == owner[k] || sentIn[k * workers + to] == placement) continue;
        sentIn[k * workers + to] = placement;
        bytes[owner[k]] += plan.blocks[k].numTokens() * perToken;
        bytes[to] += plan.blocks[k].numTokens() * perToken;
      }
      least = std::min(least, *std::max_element(bytes.begin(), bytes.end()));
    }
    size_t b = 0;  // the next owner vector, as a number in base `workers`
    while (b < n && ++owner[b] == workers) owner[b++] = 0;
    if (b == n) return least;
  }
}

// The floor against every placement of small plans' blocks: never above the least busiest
// worker's bytes, under the plan's own caps and under looser ones; and under the plan's own
// caps never 0 (every plan here has a block whose holder must trade KV). On these few workers
// each one holds several blocks and the floor, which counts one, is well under the least; it
// is exact where a block is alone on its worker (the test after this one).
TEST(CommFloorTest, NoPlacementOfTheBlocksMovesLessThanTheFloor) {
  struct Shape {
    int64_t workers, tokensPerWorker, blockSize;
  };
  int cases = 0;
  for (const char* workload : {"lognormal", "bimodal", "lognormal-narrow"}) {
    for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
      for (uint64_t seed = 0; seed < 4; ++seed) {
        // Every shape below has few enough blocks to try every placement (asserted).
        for (const Shape shape : {Shape{2, 4096, 1024}, Shape{2, 3072, 768},
                                  Shape{3, 2048, 1024}, Shape{3, 4096, 2048},
                                  Shape{4, 1024, 512}}) {
          PlanConfig c;
          c.numWorkers = shape.workers;
          c.tokensPerWorker = shape.tokensPerWorker;
          c.blockSize = shape.blockSize;
          c.attention.mask = mask;
          c.placement = seed % 2 ? Placement::kLpt : Placement::kLocal;
          const Plan plan = buildPlan(
              sampleBatch(findWorkload(workload), c.numWorkers * c.tokensPerWorker, seed), c,
              CostModel{c.attention});
          const std::string shapeName = std::string(workload) + " seed " + std::to_string(seed) +
                                        ", " + std::to_string(plan.blocks.size()) +
                                        " blocks on " + std::to_string(c.numWorkers);
          ASSERT_LE(std::pow(static_cast<double>(c.numWorkers),
                             static_cast<double>(plan.blocks.size())),
                    6e5)
              << shapeName;
          const PlanStats s = computeStats(plan);
          double busiest = 0;
          for (const WorkerLoad& l : plan.loads) busiest = std::max(busiest, l.cost);
          for (const auto& [cap, maxCost] :
               {std::pair{s.memoryCapTokens, busiest},
                std::pair{s.memoryCapTokens, std::numeric_limits<double>::infinity()},
                std::pair{s.memoryCapTokens + c.blockSize, busiest * 1.2}}) {
            const std::string what = shapeName + ", cap " + std::to_string(cap);
            const int64_t floor = commFloorBytes(plan, cap, maxCost);
            EXPECT_LE(floor, leastBusiestBytes(plan, cap, maxCost)) << what;
            ++cases;
          }
          EXPECT_EQ(s.commFloorBytes, commFloorBytes(plan, s.memoryCapTokens, busiest));
          EXPECT_GT(s.commFloorBytes, 0) << shapeName;
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 2 * 4 * 5 * 3);
}

// One sequence cut into m k blocks of equal cost on k workers, m each by the cap and by the
// busiest worker's cost. A block's holder receives the m (k - 1) blocks it cannot hold and sends
// its own to the k - 1 other workers, which its m k - 1 readers, m - 1 of them beside it, fill
// by tokens and by cost: (m + 1)(k - 1) blocks. With m = 1 that is what every worker moves.
TEST(CommFloorTest, OneLongSequenceOnFewerWorkersThanBlocks) {
  for (const int64_t m : {1, 2, 3}) {
    for (const int64_t k : {2, 4, 8}) {
      PlanConfig c;
      c.numWorkers = k;
      c.tokensPerWorker = 4096 * m;
      c.blockSize = 4096;
      c.memorySlack = 0;
      c.placement = Placement::kLpt;  // Zig-Zag blocks: each reads all the others
      Batch batch;
      batch.sequenceLengths = {4096 * m * k};
      const Plan plan = buildPlan(batch, c, CostModel{c.attention});
      const std::string what = std::to_string(m) + " x " + std::to_string(k);
      ASSERT_EQ(static_cast<int64_t>(plan.blocks.size()), m * k) << what;
      const PlanStats s = computeStats(plan);
      EXPECT_EQ(s.commFloorBytes, (m + 1) * (k - 1) * 4096 * c.attention.kvBytesPerToken())
          << what;
      if (m == 1) {
        EXPECT_NEAR(s.commImbalanceFloor, 0, 1e-12) << what;  // each worker moves the same
      }
    }
  }
}

// Every plan moves at least its floor at its busiest worker.
TEST(CommFloorTest, PlansMoveAtLeastTheirFloor) {
  for (const char* workload : {"lognormal", "bimodal", "lognormal-narrow"}) {
    for (const int64_t workers : {16, 64}) {
      for (uint64_t seed = 0; seed < 4; ++seed) {
        PlanConfig c;
        c.numWorkers = workers;
        const Plan plan = buildPlan(
            sampleBatch(findWorkload(workload), workers * c.tokensPerWorker, seed), c,
            CostModel{c.attention});
        const PlanStats s = computeStats(plan);
        std::vector<int64_t> bytes(static_cast<size_t>(workers), 0);
        for (const Transfer& t : plan.transfers) {
          bytes[static_cast<size_t>(t.sender)] += t.bytes;
          bytes[static_cast<size_t>(t.receiver)] += t.bytes;
        }
        EXPECT_GE(*std::max_element(bytes.begin(), bytes.end()), s.commFloorBytes) << workload;
        EXPECT_GT(s.commFloorBytes, 0) << workload;
        EXPECT_LE(s.commImbalanceFloor, s.commImbalance + 1e-12) << workload;
      }
    }
  }
}

// The bounded search (blocks by an upper bound on their value, stopping once none can raise
// the floor) finds what costing every block finds, on plans whose blocks differ widely: both
// placements, both masks, the caps the plans have and looser or tighter ones.
TEST(CommFloorTest, TheBoundedSearchFindsWhatCostingEveryBlockFinds) {
  int cases = 0, positive = 0;
  for (const char* workload : {"lognormal", "bimodal", "lognormal-narrow"}) {
    for (const Placement placement : {Placement::kLocal, Placement::kLpt}) {
      for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
        for (uint64_t seed = 0; seed < 3; ++seed) {
          PlanConfig c;
          c.numWorkers = 16 << seed;
          c.tokensPerWorker = 16384;
          c.blockSize = 2048;
          c.placement = placement;
          c.attention.mask = mask;
          const Plan plan = buildPlan(
              sampleBatch(findWorkload(workload), c.numWorkers * c.tokensPerWorker, seed), c,
              CostModel{c.attention});
          const PlanStats s = computeStats(plan);
          double busiest = 0;
          for (const WorkerLoad& l : plan.loads) busiest = std::max(busiest, l.cost);
          for (const double costScale : {1.0, 0.5, 0.25, 3.0}) {
            for (const int64_t cap :
                 {s.memoryCapTokens, 2 * s.memoryCapTokens, 8 * s.memoryCapTokens}) {
              const int64_t bounded = detail::commFloorBytes(plan, cap, busiest * costScale,
                                                             detail::FloorSearch::kBounded);
              const int64_t every = detail::commFloorBytes(plan, cap, busiest * costScale,
                                                           detail::FloorSearch::kEvery);
              EXPECT_EQ(bounded, every) << workload << " seed " << seed << " x" << costScale;
              ++cases;
              positive += bounded > 0;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 2 * 2 * 3 * 4 * 3);
  EXPECT_GT(positive, cases / 2);  // the floors compared are not all 0
}

// A plan made by hand where the block reading the most tokens is not the one whose holder
// must receive the most: block A reads five cheap blocks (its holder keeps two of them beside
// it, the token room), block B four costly ones (its holder can afford 95 of their tokens, the
// cost room). Units: blocks of 100 tokens, a cap of 300 tokens and a busiest cost of 10.
//   A (cost 0.5 + 5 x 0.1): receives 500 - 200 = 300 tokens, sends to no one;
//   B (cost 0.5 + 4 x 0.1): receives 400 - floor(9.1 / 9.5 x 100) = 305, sends to no one;
//   each of B's KV blocks (cost 9.5): its reader B (0.9) is over its cost room (0.5), so it
//   goes to one other worker: 100 sent.
// The floor is B's 305 tokens. Ordering blocks by what they read less the token room (a lower
// bound on their value, not an upper one) would stop at A's 300.
TEST(CommFloorTest, TheCostRoomCanMakeAShorterReaderTheFloor) {
  Plan plan;
  plan.config.numWorkers = 4;
  for (int32_t b = 0; b < 11; ++b) plan.blocks.push_back(Block{{Chunk{b, 0, 100}}});
  auto pair = [&](int32_t q, int32_t kv, double cost) {
    plan.pairs.push_back(BlockPair{q, kv, 0, cost});
  };
  pair(0, 0, 0.5);  // A = 0 reads K = 1..5
  for (int32_t k = 1; k <= 5; ++k) pair(0, k, 0.1);
  for (int32_t k = 1; k <= 5; ++k) pair(k, k, 0.1);
  pair(6, 6, 0.5);  // B = 6 reads H = 7..10
  for (int32_t h = 7; h <= 10; ++h) pair(6, h, 0.1);
  for (int32_t h = 7; h <= 10; ++h) pair(h, h, 9.5);
  const int64_t perToken = plan.config.attention.kvBytesPerToken();
  for (const auto search : {detail::FloorSearch::kBounded, detail::FloorSearch::kEvery}) {
    EXPECT_EQ(detail::commFloorBytes(plan, 300, 10.0, search), 305 * perToken);
  }
}

TEST(CommFloorTest, BadArgumentsAreNamed) {
  PlanConfig c;
  c.numWorkers = 4;
  const Plan plan = buildPlan(sampleBatch(findWorkload("lognormal"), 4 * c.tokensPerWorker, 1), c,
                              CostModel{c.attention});
  const auto message = [&](int64_t cap, double cost, const Plan& p) -> std::string {
    try {
      commFloorBytes(p, cap, cost);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message(0, 1.0, plan).find("cap of 0 tokens"), std::string::npos);
  EXPECT_NE(message(100, -1.0, plan).find("busiest cost of -1"), std::string::npos);
  EXPECT_NE(message(100, std::nan(""), plan).find("busiest cost of nan"), std::string::npos);
  Plan unsorted = plan;
  ASSERT_GE(unsorted.pairs.size(), 2u);
  std::swap(unsorted.pairs.front(), unsorted.pairs.back());
  EXPECT_NE(message(100, 1.0, unsorted).find("not in strict (Q block, KV block) order"),
            std::string::npos);
}

}  // namespace
}  // namespace fcp::plan
