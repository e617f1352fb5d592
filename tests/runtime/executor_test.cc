// The executor on ranks as threads (thread_transport.h): outputs and gradients against the
// float64 reference for FCP and ring plans, and plan agreement. The same properties run on
// real MPI ranks in tests/mpi/.
#include <gtest/gtest.h>

#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/plan/communication.h"
#include "fcp/runtime/executor.h"
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
  return strategy == "ring" ? baselines::ringPlan(batch, config, cost) : plan::buildPlan(batch, config, cost);
}

std::vector<float> randomTensor(Rng& rng, int64_t size) {
  std::vector<float> x(static_cast<size_t>(size));
  for (float& v : x) v = static_cast<float>(rng.normal());
  return x;
}

struct Outputs {
  std::vector<float> o, dq, dk, dv;
};

// Runs one plan on `ranks` threads over whole-batch inputs; returns the outputs in the packed
// layout.
Outputs runPlan(const plan::Plan& p, int ranks, const std::vector<float>& q, const std::vector<float>& k,
                const std::vector<float>& v, const std::vector<float>& dO) {
  const auto& a = p.config.attention;
  const int64_t qRow = a.numHeadsQ * a.headDim, kRow = a.numHeadsKv * a.headDim;
  const auto starts = plan::userLayoutStarts(p.batch.numTokens(), ranks);
  Outputs out{std::vector<float>(q.size()), std::vector<float>(q.size()), std::vector<float>(k.size()),
              std::vector<float>(k.size())};
  testing::runRanks(ranks, [&](Transport& t) {
    checkPlanAgreement(p, t);
    Executor ex(p, t);
    const int64_t b = starts[static_cast<size_t>(t.rank())], n = ex.userTokens();
    auto in = [&](const std::vector<float>& x, int64_t w) { return std::span<const float>(x.data() + b * w, n * w); };
    auto mine = [&](std::vector<float>& x, int64_t w) { return std::span<float>(x.data() + b * w, n * w); };
    std::vector<float> lse(static_cast<size_t>(n * a.numHeadsQ));
    ex.forward(in(q, qRow), in(k, kRow), in(v, kRow), mine(out.o, qRow), lse);
    ex.backward(in(dO, qRow), mine(out.dq, qRow), mine(out.dk, kRow), mine(out.dv, kRow));
  });
  return out;
}

class ExecutorTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ExecutorTest, MatchesTheFloat64ReferenceForwardAndBackward) {
  const auto& [strategy, ranks] = GetParam();
  Rng rng(static_cast<uint64_t>(ranks) * 31 + strategy.size());
  for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
    Batch batch;
    for (int64_t total = 0; total < 400;) {
      batch.sequenceLengths.push_back(1 + static_cast<int64_t>(rng.uniform() * 150));
      total += batch.sequenceLengths.back();
    }
    const plan::Plan p = makePlan(strategy, batch, ranks, mask);
    ASSERT_TRUE(plan::validate(p).empty());
    const int64_t tokens = batch.numTokens();
    const auto q = randomTensor(rng, tokens * 64), k = randomTensor(rng, tokens * 32),
               v = randomTensor(rng, tokens * 32), dO = randomTensor(rng, tokens * 64);
    const Outputs got = runPlan(p, ranks, q, k, v, dO);
    const ReferenceResult ref = referenceAttention(batch, p.config.attention, q, k, v, dO);
    EXPECT_LE(relativeL2(got.o, ref.o), 1e-5) << maskName(mask);
    EXPECT_LE(relativeL2(got.dq, ref.dq), 1e-5) << maskName(mask);
    EXPECT_LE(relativeL2(got.dk, ref.dk), 1e-5) << maskName(mask);
    EXPECT_LE(relativeL2(got.dv, ref.dv), 1e-5) << maskName(mask);
  }
}

INSTANTIATE_TEST_SUITE_P(StrategiesAndRanks, ExecutorTest,
                         ::testing::Combine(::testing::Values("fcp", "ring"), ::testing::Values(1, 2, 3, 5)));

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
  testing::runRanks(3, [&](Transport& t) { checkPlanAgreement(makePlan("fcp", batch, 3, MaskKind::kCausal), t); });
}

TEST(ReferenceTest, RelativeL2IsZeroForEqualAndOneForZero) {
  const std::vector<float> a{1, 2, 3};
  const std::vector<double> b{1, 2, 3};
  EXPECT_EQ(relativeL2(a, b), 0);
  EXPECT_DOUBLE_EQ(relativeL2(std::vector<float>{0, 0, 0}, b), 1.0);
}

}  // namespace
}  // namespace fcp::runtime
