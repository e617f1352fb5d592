// Plans read from files (issue 16): validate refuses what no planner makes, validateCosts
// refuses costs the plan's own configuration does not give, the JSON reader bounds nesting and
// names numbers out of range, and buildPlan refuses batches past kMaxPairs in one line.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "../common/error_of.h"
#include "fcp/core/error.h"
#include "fcp/plan/json.h"
#include "fcp/plan/limits.h"
#include "fcp/plan/plan.h"

namespace fcp::plan {
namespace {

using fcp::testing::errorOf;

Plan smallPlan() {
  PlanConfig c;
  c.numWorkers = 4;
  c.tokensPerWorker = 16 * 1024;
  c.blockSize = 2 * 1024;
  const Batch batch = sampleBatch(findWorkload("lognormal"), 4 * c.tokensPerWorker, 7);
  return buildPlan(batch, c, CostModel{c.attention});
}

bool mentions(const std::vector<std::string>& violations, const std::string& text) {
  for (const auto& v : violations) {
    if (v.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(PlanInputTest, ValidateRefusesWhatNoPlannerMakes) {
  const Plan good = smallPlan();
  ASSERT_TRUE(validate(good).empty());

  Plan p = good;  // a negative pair cost, its worker's load adjusted to match
  const int32_t worker = p.owner[static_cast<size_t>(p.pairs[0].qBlock)];
  p.loads[static_cast<size_t>(worker)].cost -= p.pairs[0].cost + 1e12;
  p.pairs[0].cost = -1e12;
  EXPECT_TRUE(mentions(validate(p), "pair 0 costs -1e+12: expected a finite cost >= 0"));

  p = good;
  p.lowerBound = 1e300;
  EXPECT_TRUE(mentions(validate(p), "plan says lower bound 1e+300 but its pair costs give"));

  p = good;
  p.config.blockSize = -4096;
  EXPECT_TRUE(mentions(validate(p), "block size -4096"));

  p = good;
  p.config.commBalanceSlack = 50;
  EXPECT_TRUE(mentions(validate(p), "communication balance slack 50"));

  p = good;
  p.strategy = "nonsense";
  EXPECT_TRUE(mentions(validate(p), "strategy 'nonsense'"));

  p = good;
  p.improveSteps = -3;
  EXPECT_TRUE(mentions(validate(p), "improve_steps -3"));

  p = good;
  p.config.localitySlack = 5;
  EXPECT_TRUE(mentions(validate(p), "locality slack 5"));

  p = good;
  p.config.commRatio = -1;
  EXPECT_TRUE(mentions(validate(p), "communication ratio -1"));

  p = good;
  p.config.improveStepsPerBlock = kMaxImproveStepsPerBlock + 1;
  EXPECT_TRUE(mentions(validate(p), "steps per block"));

  p = good;
  p.localityMoves = -1;
  EXPECT_TRUE(mentions(validate(p), "locality_moves -1"));
}

TEST(PlanInputTest, ACommunicationRatioOutOfRangeIsNamed) {
  const Batch batch{{3000, 5000}};
  for (const double ratio : {-1.0, std::nan(""), kMaxCommRatio * 2}) {
    PlanConfig c;
    c.numWorkers = 2;
    c.commRatio = ratio;
    const std::string message =
        errorOf([&] { buildPlan(batch, c, CostModel{c.attention}); });
    EXPECT_NE(message.find("invalid communication ratio"), std::string::npos) << message;
    EXPECT_NE(message.find("cost units per byte"), std::string::npos) << message;
  }
}

TEST(PlanInputTest, ValidateCostsRecomputesPairCostsFromTheConfiguration) {
  const Plan good = smallPlan();
  EXPECT_TRUE(validateCosts(good, CostModel{good.config.attention}).empty());
  Plan p = good;
  p.config.attention.numHeadsQ = 32;  // every cost depends on it; validate alone cannot tell
  EXPECT_TRUE(validate(p).empty());
  EXPECT_TRUE(mentions(validateCosts(p, CostModel{p.config.attention}), "costs"));
  // Another efficiency curve gives other costs: a plan must be loaded with its own curve.
  CostModel flat{good.config.attention, EfficiencyCurve({{1, 0.5}}), EfficiencyCurve({{1, 0.5}})};
  EXPECT_FALSE(validateCosts(good, flat).empty());
}

TEST(PlanInputTest, JsonNestedTooDeepIsAnErrorNotACrash) {
  // The crash of issue 16: "workers": [[[[...]]]] 100,000 deep.
  const std::string deep = "{\"format\":\"fcp-plan\",\"workers\":" + std::string(100000, '[') +
                           std::string(100000, ']') + "}";
  EXPECT_NE(errorOf([&] { planFromJson(deep); }).find("JSON nests arrays and objects more than 64"),
            std::string::npos);
}

TEST(PlanInputTest, JsonNumberOutOfRangeIsNamed) {
  std::string text = planToJson(smallPlan());
  const auto at = text.find("\"lower_bound\":");
  ASSERT_NE(at, std::string::npos);
  const auto end = text.find(',', at);
  text.replace(at + 14, end - at - 14, "1e400");
  const std::string message = errorOf([&] { planFromJson(text); });
  EXPECT_NE(message.find("plan JSON has a number out of range"), std::string::npos) << message;
}

// A field the writer does not write is named, not ignored; every field it writes reads back.
TEST(PlanInputTest, JsonWithAnUnknownFieldIsNamed) {
  const std::string text = planToJson(smallPlan());
  EXPECT_EQ(planToJson(planFromJson(text)), text);
  std::string extra = text;
  extra.insert(1, "\"extra\":1,");
  const std::string message = errorOf([&] { planFromJson(extra); });
  EXPECT_NE(message.find("plan JSON has an unknown field 'extra': expected only the fields fcp "
                         "plan --plan-out writes"),
            std::string::npos)
      << message;
  // Inside config (a misspelt optional field took its default) and sharding too.
  for (const auto& [object, field] :
       {std::pair{"\"config\":{", "config.comm_rato"}, {"\"sharding\":{", "sharding.extra"}}) {
    std::string nested = text;
    const auto at = nested.find(object);
    ASSERT_NE(at, std::string::npos) << object;
    const std::string name = std::string(field).substr(std::string(field).find('.') + 1);
    nested.insert(at + std::strlen(object), "\"" + name + "\":5,");
    const std::string why = errorOf([&] { planFromJson(nested); });
    EXPECT_NE(why.find(std::string("unknown field '") + field + "'"), std::string::npos) << why;
  }
}

TEST(PlanInputTest, PairCountIsBoundedBeforePlanning) {
  PlanConfig c;
  c.numWorkers = 16;
  c.tokensPerWorker = 4 * 1024 * 1024;
  const Batch batch{{int64_t{64} << 20}};  // 16K blocks of 4K: 2^28 pairs
  EXPECT_GT(estimatePairs(batch, c.blockSize), kMaxPairs);
  const auto start = std::chrono::steady_clock::now();
  const std::string message = errorOf([&] { buildPlan(batch, c, CostModel{c.attention}); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(message.find("more than 33554432 block pairs"), std::string::npos) << message;
  // The least size that fits: ceil(2^26 / B) blocks, squared, within 2^25 needs at most 5792
  // blocks (5792^2 = 33,547,264; 5793^2 passes), so B = ceil(2^26 / 5792) = 11587.
  EXPECT_NE(message.find("expected a block size of at least 11587 "), std::string::npos) << message;
  EXPECT_LE(estimatePairs(batch, 11587), kMaxPairs);
  EXPECT_GT(estimatePairs(batch, 11586), kMaxPairs);
  // Block size 1 on an ordinary batch is refused the same way.
  const Batch ordinary = sampleBatch(findWorkload("lognormal"), 16 * 32 * 1024, 0);
  c.tokensPerWorker = 32 * 1024;
  c.blockSize = 1;
  EXPECT_NE(errorOf([&] { buildPlan(ordinary, c, CostModel{c.attention}); }).find("block pairs"),
            std::string::npos);
  // Blocks the memory cap cut finer: a larger block size cannot help, so the refusal asks for
  // a larger cap (it offered a block size of 1024 while 4096 was asked for).
  c.numWorkers = 1 << 24;
  c.tokensPerWorker = 16;
  c.blockSize = 4096;
  const Batch capped = sampleBatch(findWorkload("lognormal"), c.numWorkers * c.tokensPerWorker, 0);
  const std::string underCap = errorOf([&] { buildPlan(capped, c, CostModel{c.attention}); });
  EXPECT_NE(underCap.find("cut finer than the block size 4096 so that the memory cap of 17 tokens "
                          "a worker can place them: expected a larger cap"),
            std::string::npos)
      << underCap;
}

TEST(PlanInputTest, PairEstimateBoundsTheRealCount) {
  for (int64_t blockSize : {16, 256, 4096}) {
    PlanConfig c;
    c.numWorkers = 8;
    c.tokensPerWorker = 16 * 1024;
    c.blockSize = blockSize;
    const Batch batch = sampleBatch(findWorkload("lognormal"), 8 * c.tokensPerWorker, 3);
    if (estimatePairs(batch, blockSize) > kMaxPairs) continue;
    const Plan p = buildPlan(batch, c, CostModel{c.attention});
    EXPECT_LE(static_cast<int64_t>(p.pairs.size()), estimatePairs(batch, blockSize)) << blockSize;
  }
}

}  // namespace
}  // namespace fcp::plan
