// Plan agreement on ranks as threads (thread_transport.h) and the reference's error measure.
// The executor itself is tested through the public API (tests/api/) and on MPI ranks
// (tests/mpi/).
#include "fcp/runtime/executor.h"

#include <gtest/gtest.h>

#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/plan/communication.h"
#include "fcp/runtime/reference.h"
#include "thread_transport.h"

namespace fcp::runtime {
namespace {

plan::Plan makePlan(const std::string& strategy, const Batch& batch, int ranks, MaskKind mask) {
  plan::PlanConfig config;
  config.numWorkers = ranks;
  config.blockSize = 64;
  config.tokensPerWorker = (batch.numTokens() + ranks - 1) / ranks;
  config.memoryLimitTokens = batch.numTokens();
  config.coalesce = 1;
  config.attention = {4, 2, 16, 4, mask};
  const CostModel cost{config.attention};
  return strategy == "ring" ? baselines::ringPlan(batch, config, cost)
                            : plan::buildPlan(batch, config, cost);
}

TEST(PlanAgreementTest, DifferentPlansFailOnEveryRank) {
  const Batch one{{300, 100}}, other{{200, 200}};
  std::atomic<int> failures = 0;
  testing::runRanks(3, [&](Transport& t) {
    const plan::Plan p = makePlan("fcp", t.rank() == 1 ? other : one, 3, MaskKind::kCausal);
    try {
      checkPlanAgreement(p, t);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidPlan);
      EXPECT_NE(std::string(e.what()).find("built different plans"), std::string::npos);
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 3);
}

TEST(PlanAgreementTest, IdenticalPlansPass) {
  const Batch batch{{300, 100}};
  testing::runRanks(3, [&](Transport& t) {
    checkPlanAgreement(makePlan("fcp", batch, 3, MaskKind::kCausal), t);
  });
}

TEST(ReferenceTest, RelativeL2IsZeroForEqualAndOneForZero) {
  const std::vector<float> a{1, 2, 3};
  const std::vector<double> b{1, 2, 3};
  EXPECT_EQ(relativeL2(a, b), 0);
  EXPECT_DOUBLE_EQ(relativeL2(std::vector<float>{0, 0, 0}, b), 1.0);
}

}  // namespace
}  // namespace fcp::runtime
