#include "fcp/plan/plan.h"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <string>

#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/plan/json.h"
#include "fcp/plan/limits.h"
#include "parallel.h"
#include "plan_threads.h"

namespace fcp::plan {
namespace {

Plan makePlan(const std::string& workload, int64_t workers, MaskKind mask, uint64_t seed,
              int64_t tokensPerWorker = 32 * 1024, int64_t blockSize = 4 * 1024) {
  PlanConfig c;
  c.numWorkers = workers;
  c.tokensPerWorker = tokensPerWorker;
  c.blockSize = blockSize;
  c.attention.mask = mask;
  const Batch batch = sampleBatch(findWorkload(workload), workers * tokensPerWorker, seed);
  return buildPlan(batch, c, CostModel{c.attention});
}

bool mentions(const std::vector<std::string>& violations, const std::string& text) {
  for (const auto& v : violations) {
    if (v.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(PlanTest, PlansOfEveryWorkloadAndMaskAreValid) {
  for (const auto& w : builtinWorkloads()) {
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
      for (int64_t workers : {1, 3, 16, 64}) {
        const Plan p = makePlan(w.name, workers, mask, 3);
        const auto violations = validate(p);
        ASSERT_TRUE(violations.empty()) << w.name << " " << workers << ": " << violations.front();
        const PlanStats s = computeStats(p);
        EXPECT_LE(s.maxWorkerTokens, s.memoryCapTokens);
        EXPECT_GE(s.lowerBoundGap, -1e-12);
      }
    }
  }
}

TEST(PlanTest, SmallOddShapesAreValid) {
  // Tiny blocks, a block larger than every sequence, a single worker, lengths off the grid.
  Rng rng(12);
  for (int trial = 0; trial < 40; ++trial) {
    PlanConfig c;
    c.numWorkers = 1 + static_cast<int64_t>(rng.next() % 9);
    c.blockSize = 1 + static_cast<int64_t>(rng.next() % 300);
    c.attention.mask = trial % 2 ? MaskKind::kCausal : MaskKind::kFull;
    Batch batch;
    for (uint64_t i = 0, n = 1 + rng.next() % 12; i < n; ++i) {
      batch.sequenceLengths.push_back(1 + static_cast<int64_t>(rng.next() % 1000));
    }
    c.tokensPerWorker =
        std::max((batch.numTokens() + c.numWorkers - 1) / c.numWorkers, c.blockSize);
    c.memorySlack = 1.0;  // always room for a block: the point here is shape, not balance
    const Plan p = buildPlan(batch, c, CostModel{c.attention});
    const auto violations = validate(p);
    ASSERT_TRUE(violations.empty()) << "trial " << trial << ": " << violations.front();
  }
}

TEST(PlanTest, LoadsBalancedAtScale) {
  const Plan p = makePlan("lognormal", 256, MaskKind::kCausal, 1);
  const PlanStats s = computeStats(p);
  EXPECT_LT(s.computeImbalance, 0.01);
  EXPECT_LT(s.lowerBoundGap, 0.005);
}

TEST(PlanTest, SameSeedGivesByteIdenticalJson) {
  const std::string a = planToJson(makePlan("bimodal", 32, MaskKind::kCausal, 42));
  const std::string b = planToJson(makePlan("bimodal", 32, MaskKind::kCausal, 42));
  EXPECT_EQ(a, b);
  EXPECT_NE(a, planToJson(makePlan("bimodal", 32, MaskKind::kCausal, 43)));
}

using testing::PlanThreads;

// validate replays the two passes' stages on two threads for large plans: the same sentences,
// in the same order, as on one thread, forward's first, over the 50 reported (the rest
// counted); and a bad FCP_PLAN_THREADS, which planning refuses, is no error for validate.
TEST(PlanTest, ValidateSaysTheSameOnOneThreadAndOnTwo) {
  Plan p = makePlan("lognormal", 512, MaskKind::kCausal, 7);
  ASSERT_GE(p.pairs.size(), size_t{1} << 16) << "under the two-thread threshold";
  // 20 workers' forward pairs and 60 workers' backward pairs never computed.
  for (const auto& [pass, workers] : {std::pair{&p.forward, 20}, std::pair{&p.backward, 60}}) {
    int dropped = 0;
    pass->edit([&](auto& lists) {
      for (auto& stages : lists) {
        for (auto& st : stages) {
          if (dropped < workers && !st.compute.empty()) {
            st.compute.pop_back();
            ++dropped;
            break;
          }
        }
      }
    });
    ASSERT_EQ(dropped, workers);
  }
  std::vector<std::string> one, two, bad;
  {
    PlanThreads t("1");
    one = validate(p);
  }
  {
    PlanThreads t("2");
    two = validate(p);
  }
  {
    PlanThreads t("three");
    bad = validate(p);
  }
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, bad);
  ASSERT_EQ(one.size(), 51u);
  EXPECT_EQ(one.front().rfind("forward", 0), 0u) << one.front();
  EXPECT_EQ(one[20].rfind("backward", 0), 0u) << one[20];
  EXPECT_NE(one.back().find("more"), std::string::npos) << one.back();
}

// checkPairs re-derives the chunk pairs in two halves on two threads for large plans (the
// pairs cut at a Q block's first pair, the sequences' mask check at half its work): the same
// sentences, in the same order, as on one thread, for pairs broken in either half or in
// both, out of order (the sort of all chunk pairs, not of each Q block's run), out of range,
// duplicated or missing.
TEST(PlanTest, PairChecksSayTheSameOnOneThreadAndOnTwo) {
  const Plan good = makePlan("lognormal", 512, MaskKind::kCausal, 7);
  const size_t n = good.pairs.size();
  ASSERT_GE(n, size_t{1} << 16) << "under the two-thread threshold";
  const size_t early = n / 5, late = n - n / 5;
  struct Case {
    const char* what;
    std::function<void(Plan&)> breakIt;
    const char* says;  ///< what one of the sentences says
  };
  const auto miscount = [](Plan& p, size_t at) { p.pairs[at].visible += 1; };
  const std::vector<Case> cases = {
      {"miscounted in both halves",
       [&](Plan& p) {
         miscount(p, early);
         miscount(p, late);
       },
       "visible entries but its chunks give"},
      {"out of order in the second half",
       [&](Plan& p) { std::swap(p.pairs[late], p.pairs[late + 1]); }, "pairs are not sorted"},
      {"out of range in the first half", [&](Plan& p) { p.pairs[early].kvBlock = -3; },
       ") outside 0.."},
      {"duplicated in the second half",
       [&](Plan& p) {
         p.pairs.insert(p.pairs.begin() + static_cast<std::ptrdiff_t>(late), p.pairs[late]);
       },
       "is computed twice"},
      {"missing from both halves",
       [&](Plan& p) {
         p.pairs.erase(p.pairs.begin() + static_cast<std::ptrdiff_t>(late));
         p.pairs.erase(p.pairs.begin() + static_cast<std::ptrdiff_t>(early));
       },
       "are never computed"},
  };
  // A valid plan stays valid. On this one the pairs' middle falls inside a Q block's run,
  // among KV blocks before it: its front and back chunks' pairs alternate there, so halves cut
  // at the middle would each sort their piece of the run, and the two pieces not each other.
  {
    const Plan valid = makePlan("lognormal", 512, MaskKind::kCausal, 2);
    const size_t mid = valid.pairs.size() / 2;
    ASSERT_GE(valid.pairs.size(), size_t{1} << 16);
    EXPECT_EQ(valid.pairs[mid].qBlock, valid.pairs[mid - 1].qBlock);
    EXPECT_LT(valid.pairs[mid].kvBlock + 1, valid.pairs[mid].qBlock);
    PlanThreads t("2");
    const std::vector<std::string> none = validate(valid);
    EXPECT_TRUE(none.empty()) << none.front();
  }
  for (const Case& c : cases) {
    Plan p = good;
    c.breakIt(p);
    std::vector<std::string> one, two;
    {
      PlanThreads t("1");
      one = validate(p);
    }
    {
      PlanThreads t("2");
      two = validate(p);
    }
    EXPECT_EQ(one, two) << c.what;
    EXPECT_TRUE(mentions(one, c.says)) << c.what;
  }
  // Over the 50 sentences reported, across the halves: 60 pairs miscounted in each, the first
  // 50 named are the first half's, the rest counted.
  {
    Plan p = good;
    for (size_t k = 0; k < 60; ++k) {
      miscount(p, early + k);
      miscount(p, late + k);
    }
    std::vector<std::string> one, two;
    {
      PlanThreads t("1");
      one = validate(p);
    }
    {
      PlanThreads t("2");
      two = validate(p);
    }
    EXPECT_EQ(one, two);
    ASSERT_EQ(two.size(), 51u);
    EXPECT_EQ(two[49].rfind("pair " + std::to_string(early + 49) + " says", 0), 0u) << two[49];
    EXPECT_EQ(two.back(), "... and 70 more");
  }
  // Each half's sentences, the first half's first: the miscounted pairs are named in order.
  Plan p = good;
  miscount(p, early);
  miscount(p, late);
  PlanThreads t("2");
  const std::vector<std::string> found = validate(p);
  ASSERT_GE(found.size(), 2u);
  EXPECT_EQ(found[0].rfind("pair " + std::to_string(early) + " says", 0), 0u) << found[0];
  EXPECT_EQ(found[1].rfind("pair " + std::to_string(late) + " says", 0), 0u) << found[1];
  // Two missing pairs leave chunk pairs of their sequences never computed, whichever half of
  // the mask check finds them.
  p = good;
  p.pairs.erase(p.pairs.begin() + static_cast<std::ptrdiff_t>(late));
  p.pairs.erase(p.pairs.begin() + static_cast<std::ptrdiff_t>(early));
  std::vector<std::string> never;
  for (const std::string& s : validate(p))
    if (s.find("never computed") != std::string::npos) never.push_back(s);
  EXPECT_GE(never.size(), 2u);
}

// The visible entries validate finds for a pair, against every (Q chunk, KV chunk) of the
// same sequence summed here (validate merges the blocks' chunks by sequence): pairs of Zig-Zag
// blocks, of contiguous blocks and of packed blocks, each miscounted by one, are named with
// these sums.
TEST(PlanTest, PairsAreCountedOverEverySameSequenceChunkPair) {
  for (const Placement placement : {Placement::kLpt, Placement::kLocal}) {
    PlanConfig c;
    c.numWorkers = 8;
    c.blockSize = 1024;
    c.tokensPerWorker = 8192;
    c.placement = placement;
    // Long sequences (Zig-Zag or contiguous blocks) and short ones (packed).
    Batch batch;
    Rng rng(5);
    for (int i = 0; i < 12; ++i) batch.sequenceLengths.push_back(1500 + rng.next() % 3000);
    while (batch.numTokens() < 8 * 8192 - 600)
      batch.sequenceLengths.push_back(1 + static_cast<int64_t>(rng.next() % 300));
    const Plan planned = buildPlan(batch, c, CostModel{c.attention});
    Plan p = planned;
    size_t packed = 0;
    for (size_t k = 0; k < p.pairs.size(); ++k) {
      BlockPair& pair = p.pairs[k];
      const auto& qs = p.blocks[static_cast<size_t>(pair.qBlock)].chunks;
      const auto& ks = p.blocks[static_cast<size_t>(pair.kvBlock)].chunks;
      if (k % 7 != 0 && (qs.size() <= 2 || packed >= 20)) continue;
      packed += qs.size() > 2;
      int64_t sum = 0;
      for (const Chunk& q : qs) {
        for (const Chunk& kv : ks) {
          if (q.sequence == kv.sequence)
            sum += visibleEntries(c.attention.mask, q.begin, q.end, kv.begin, kv.end);
        }
      }
      pair.visible += 1;
      const std::vector<std::string> found = validate(p);
      pair.visible -= 1;
      EXPECT_TRUE(mentions(
          found, "pair " + std::to_string(k) + " says " + std::to_string(pair.visible + 1) +
                     " visible entries but its chunks give " + std::to_string(sum)))
          << k;
    }
    EXPECT_GT(packed, 0u) << "no packed block among the pairs tried";
  }
}

// Half a million one-token sequences, packed 4096 to a block: each packed block pairs with
// itself over 4096 chunks. validate finds the plan valid (it once reserved room for every
// chunk's pair with every other, 34 GB here, and threw std::bad_alloc).
TEST(PlanTest, PackedBlocksOfOneTokenSequencesAreValid) {
  PlanConfig c;
  c.numWorkers = 8;
  c.blockSize = 4096;
  c.tokensPerWorker = 65536;
  Batch batch;
  batch.sequenceLengths.assign(8 * 65536, 1);
  const Plan p = buildPlan(batch, c, CostModel{c.attention});
  ASSERT_EQ(p.blocks.front().chunks.size(), 4096u);
  const std::vector<std::string> found = validate(p);
  EXPECT_TRUE(found.empty()) << found.front();
}

// The stage replay records stages in 16 bits up to 2^15 stages per worker, in 32 bits past
// that: a worker with 40,000 stages (the last ones empty) is still valid, and a pair computed
// in its last stage (39,999), after its block's buffer was freed, is named with that stage.
TEST(PlanTest, ReplayOfPassesWithManyStagesPerWorker) {
  Plan p = makePlan("lognormal", 16, MaskKind::kCausal, 4);
  ASSERT_TRUE(validate(p).empty());
  constexpr size_t kStages = 40000;
  p.forward.edit([&](std::vector<std::vector<StageIds>>& lists) { lists[0].resize(kStages); });
  const std::vector<std::string> none = validate(p);
  EXPECT_TRUE(none.empty()) << none.front();
  // A pair of worker 0 that computes with a received block, moved to the last stage.
  int32_t moved = -1;
  p.forward.edit([&](std::vector<std::vector<StageIds>>& lists) {
    for (StageIds& st : lists[0]) {
      for (size_t k = 0; k < st.compute.size() && moved < 0; ++k) {
        const BlockPair& pair = p.pairs[static_cast<size_t>(st.compute[k])];
        if (p.owner[static_cast<size_t>(pair.kvBlock)] == 0) continue;
        moved = st.compute[k];
        st.compute.erase(st.compute.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    ASSERT_GE(moved, 0);
    lists[0].back().compute.push_back(moved);
  });
  // That one sentence alone: the pair is computed (a 16-bit record of stage 39,999 would read
  // as never), and every other check holds.
  const std::vector<std::string> found = validate(p);
  ASSERT_EQ(found.size(), 1u) << found.back();
  EXPECT_EQ(
      found.front().rfind("forward: worker 0 computes pair " + std::to_string(moved) +
                              " at stage " + std::to_string(kStages - 1) + " before its KV block",
                          0),
      0u)
      << found.front();
}

TEST(PlanTest, APlanIsTheSameOnOneThreadAndOnTwo) {
  // Large enough for the second thread (64K pairs and up): the paper's first pairs in two
  // halves, the two placements, the reshuffle beside the transfers and each half of the stages
  // run side by side. In the first case the local placement's blocks cost over a share, so it
  // tries finer cuttings once the paper's placement beside it has said what it must beat
  // (LocalWinLimit). The plan on one thread is the reference, to the byte.
  struct Case {
    const char* workload;
    int64_t workers, tokensPerWorker, blockSize;
    uint64_t seed;
  };
  for (const Case& c : {Case{"lognormal", 1024, 32 * 1024, 4 * 1024, 0},
                        Case{"lognormal", 64, 32 * 1024, 1024, 0}}) {
    std::string one, two;
    {
      const PlanThreads threads("1");
      one = planToJson(makePlan(c.workload, c.workers, MaskKind::kCausal, c.seed,
                                c.tokensPerWorker, c.blockSize));
    }
    {
      const PlanThreads threads("2");
      const Plan plan = makePlan(c.workload, c.workers, MaskKind::kCausal, c.seed,
                                 c.tokensPerWorker, c.blockSize);
      // Both thresholds: the placements' (estimated pairs) and the stages' (the plan's pairs).
      const Batch batch =
          sampleBatch(findWorkload(c.workload), c.workers * c.tokensPerWorker, c.seed);
      ASSERT_GE(estimatePairs(batch, c.blockSize), int64_t{1} << 16) << c.workload;
      ASSERT_GE(plan.pairs.size(), size_t{1} << 16) << c.workload;
      two = planToJson(plan);
    }
    EXPECT_EQ(one, two) << c.workload << " on " << c.workers << " workers";
    // Planned where the second thread is taken (inside a runBoth whose other side holds it
    // until the plan is made): every step that would go beside another runs after it, on this
    // thread; the paper's side then joins its first pairs itself (PendingPairs), as the local
    // side, which would have, has not begun.
    std::string held;
    {
      const PlanThreads threads("2");
      std::atomic<bool> planned{false};
      detail::runBoth(
          true,
          [&] {
            struct Release {  // also when planning throws: the other side must not wait on
              std::atomic<bool>& planned;
              ~Release() {
                planned = true;
                planned.notify_all();
              }
            } const release{planned};
            held = planToJson(makePlan(c.workload, c.workers, MaskKind::kCausal, c.seed,
                                       c.tokensPerWorker, c.blockSize));
          },
          [&] { planned.wait(false); });
    }
    EXPECT_EQ(one, held) << c.workload << " on " << c.workers << " workers, the thread held";
  }
}

TEST(PlanTest, APlannerThreadCountOtherThanOneOrTwoIsNamed) {
  for (const char* bad : {"3", "0", "two", "-1"}) {
    const PlanThreads threads(bad);
    try {
      makePlan("bimodal", 32, MaskKind::kCausal, 42);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(std::string("FCP_PLAN_THREADS '") + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(PlanTest, JsonRoundTripIsExact) {
  const Plan p = makePlan("lognormal", 16, MaskKind::kCausal, 5);
  const std::string text = planToJson(p);
  const Plan back = planFromJson(text);
  EXPECT_EQ(back, p);
  EXPECT_EQ(planToJson(back), text);
  EXPECT_TRUE(validate(back).empty());
}

TEST(PlanTest, JsonErrorsNameTheField) {
  EXPECT_THROW(planFromJson("not json"), Error);
  EXPECT_THROW(planFromJson("{\"format\": \"other\"}"), Error);
  const Plan p = makePlan("lognormal", 2, MaskKind::kCausal, 5);
  std::string text = planToJson(p);
  const auto at = text.find("\"owner\"");
  text.replace(at, 7, "\"ownerX\"");
  try {
    planFromJson(text);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'owner'"), std::string::npos) << e.what();
  }
}

TEST(PlanTest, JsonNumbersMustFitTheirFields) {
  const Plan p = makePlan("lognormal", 2, MaskKind::kCausal, 5);
  std::string text = planToJson(p);
  // An owner of 2^32 + 1 must not be read as worker 1.
  const auto at = text.find("\"owner\":[");
  ASSERT_NE(at, std::string::npos);
  const auto firstDigit = at + 9;
  const auto end = text.find_first_of(",]", firstDigit);
  std::string big = text;
  big.replace(firstDigit, end - firstDigit, "4294967297");
  EXPECT_THROW(planFromJson(big), Error);
  std::string fractional = text;
  fractional.replace(firstDigit, end - firstDigit, "1e300");
  EXPECT_THROW(planFromJson(fractional), Error);
  EXPECT_THROW(planFromJson("{\"format\": 7}"), Error);
}

TEST(PlanTest, ValidateRejectsOutOfRangeConfiguration) {
  Plan p = makePlan("lognormal", 2, MaskKind::kCausal, 5);
  p.config.numWorkers = int64_t{1} << 40;
  EXPECT_TRUE(mentions(validate(p), "workers: expected 1 to"));
  p = makePlan("lognormal", 2, MaskKind::kCausal, 5);
  p.config.attention.headDim = int64_t{1} << 40;
  EXPECT_TRUE(mentions(validate(p), "head dim"));
  p = makePlan("lognormal", 2, MaskKind::kCausal, 5);
  p.batch.sequenceLengths[0] = int64_t{1} << 62;
  EXPECT_TRUE(mentions(validate(p), "plan's batch"));
}

TEST(PlanTest, ValidateCatchesEachBrokenInvariant) {
  const Plan good = makePlan("lognormal", 8, MaskKind::kCausal, 9);
  ASSERT_TRUE(validate(good).empty());

  Plan p = good;
  p.pairs.erase(p.pairs.begin() + static_cast<std::ptrdiff_t>(p.pairs.size() / 2));
  EXPECT_TRUE(mentions(validate(p), "never computed"));

  p = good;
  p.pairs.push_back(p.pairs.back());
  EXPECT_TRUE(mentions(validate(p), "computed twice"));

  p = good;
  p.blocks[0].chunks[0].end -= 1;  // a token that is in no block
  EXPECT_TRUE(mentions(validate(p), "in no block"));

  p = good;
  p.blocks[1].chunks.push_back(good.blocks[0].chunks[0]);  // a token in two blocks
  EXPECT_TRUE(mentions(validate(p), "in two blocks"));

  p = good;
  p.owner[0] = 8;
  EXPECT_TRUE(mentions(validate(p), "not one of 0..7"));

  p = good;
  for (auto& o : p.owner) o = 0;  // everything on worker 0: over the cap
  EXPECT_TRUE(mentions(validate(p), "over the memory cap"));

  p = good;
  p.loads[3].numTokens += 1;
  EXPECT_TRUE(mentions(validate(p), "worker 3 load says"));

  p = good;
  p.batch.sequenceLengths[0] += 1;
  EXPECT_TRUE(mentions(validate(p), "in no block"));

  EXPECT_THROW(checkValid(p), Error);
}

TEST(PlanTest, BadConfigurationIsAnError) {
  PlanConfig c;
  const Batch batch{{4096}};
  c.numWorkers = 0;
  EXPECT_THROW(buildPlan(batch, c, CostModel{c.attention}), Error);
  c.numWorkers = 2;
  c.tokensPerWorker = -1;
  EXPECT_THROW(buildPlan(batch, c, CostModel{c.attention}), Error);
  c.tokensPerWorker = 1024;  // 2 x 1126 < 4096 tokens
  EXPECT_THROW(buildPlan(batch, c, CostModel{c.attention}), Error);
}

}  // namespace
}  // namespace fcp::plan
