// Plan agreement on ranks as threads (thread_transport.h) and the reference's error measure.
// The executor itself is tested through the public API (tests/api/) and on MPI ranks
// (tests/mpi/).
#include "fcp/runtime/executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/json.h"
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

// A plan fits where its last tag is the transport's largest (it was refused one tag early), and
// not where it would need one more; the message names the plan's last tag.
TEST(ExecutorTagsTest, APlanFitsTheTransportsTagsExactly) {
  const plan::Plan p = makePlan("fcp", Batch{{300, 100}}, 2, MaskKind::kCausal);
  testing::runRanks(2, [&](Transport& t) {
    const int64_t needed = Executor(p, t).tagsNeeded();
    ExecutorOptions o;
    o.firstTag = static_cast<int>(t.maxTag() - needed + 1);
    EXPECT_NO_THROW(Executor(p, t, o));
    ++o.firstTag;
    try {
      Executor refused(p, t, o);
      ADD_FAILURE() << "a plan one tag past the largest was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("plan needs tags " + std::to_string(o.firstTag) +
                                           " to " + std::to_string(int64_t{t.maxTag()} + 1) + " ("),
                std::string::npos)
          << e.what();
    }
  });
}

// The executor checks the strides it is given itself (the public API checks them first, in
// elements): under one row, not a multiple of the element, or past an int64 offset is refused
// before any message, naming the tensor; a null lse's stride is not looked at.
TEST(ExecutorStridesTest, BadStridesAreRefusedBeforeAnyMessage) {
  const plan::Plan p = makePlan("fcp", Batch{{100}}, 1, MaskKind::kCausal);
  testing::runRanks(1, [&](Transport& t) {
    Executor ex(p, t);
    const auto n = static_cast<size_t>(ex.callTokens());
    std::vector<float> q(n * (4 * 16 + 1)), kv(n * 2 * 16), o(n * 4 * 16);  // q: rows 65 apart
    LayerState layer;
    const int64_t row = 4 * 16 * 4, most = std::numeric_limits<int64_t>::max() / 100;
    const std::vector<std::pair<int64_t, std::string>> bad = {
        {row - 4,
         "q's row stride of 252 bytes: expected 0 (rows back to back) or a multiple of 4 "
         "from 256 (one row) to " +
             std::to_string(most) + " (100 rows)"},
        {row + 2, "q's row stride of 258 bytes: expected 0"},
        {most + 1, "q's row stride of " + std::to_string(most + 1) + " bytes: expected 0"}};
    for (const auto& [stride, text] : bad) {
      try {
        ex.forward(layer, {q.data(), stride}, kv.data(), kv.data(), o.data(), {nullptr, -7});
        ADD_FAILURE() << "stride " << stride << " was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        EXPECT_EQ(std::string(e.what()).find(text), 0u) << e.what();
      }
    }
    EXPECT_EQ(layer.batchId, 0u) << "a refused forward changed the layer";
    ex.forward(layer, {q.data(), row + 4}, kv.data(), kv.data(), o.data(), {nullptr, -7});
    EXPECT_EQ(layer.batchId, ex.id());
  });
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

// A digest computed ahead (on a planning thread) is compared as the plan's own would be: the
// rank whose digest differs, and only its digest, fails every rank, with this rank's digest
// (its top 63 bits) in the message; equal digests pass.
TEST(PlanAgreementTest, DigestsComputedAheadAreComparedAsPlans) {
  const plan::Plan p = makePlan("fcp", Batch{{300, 100}}, 3, MaskKind::kCausal);
  const uint64_t digest = plan::planDigest(p);
  std::atomic<int> failures = 0;
  testing::runRanks(3, [&](Transport& t) {
    const uint64_t mine = t.rank() == 2 ? digest ^ 2 : digest;  // differs in the top 63 bits
    try {
      checkPlanAgreement(mine, t);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidPlan);
      char shown[17];
      std::snprintf(shown, sizeof shown, "%016llx", static_cast<unsigned long long>(mine >> 1));
      EXPECT_NE(std::string(e.what()).find(std::string("this rank's is ") + shown),
                std::string::npos)
          << e.what();
      ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 3);
  testing::runRanks(3, [&](Transport& t) {
    checkPlanAgreement(digest, t);
    checkPlanAgreement(p, t);  // the plan's own digest is the same
  });
}

TEST(PlanAgreementTest, IdenticalPlansPass) {
  const Batch batch{{300, 100}};
  testing::runRanks(3, [&](Transport& t) {
    checkPlanAgreement(makePlan("fcp", batch, 3, MaskKind::kCausal), t);
  });
}

// Ranks whose planning threw join the agreement through failPlanAgreement: each rethrows its
// own exception, and every other rank throws one naming the lowest failed rank, with its code
// (kInternal for an exception that is not an fcp::Error). Afterwards the ranks are still in
// step: the next collective pairs up.
TEST(PlanAgreementTest, ARankThatCouldNotPlanFailsEveryRank) {
  const Batch batch{{300, 100}};
  struct Case {
    std::vector<int> failing;
    bool fcpError;
    ErrorCode expected;
    int named;
  };
  const Case cases[] = {
      {{1}, true, ErrorCode::kInvalidArgument, 1},
      {{3, 2}, true, ErrorCode::kInvalidArgument, 2},
      {{0}, false, ErrorCode::kInternal, 0},
      {{0, 1, 2, 3}, true, ErrorCode::kInvalidArgument, -1},
  };
  for (const Case& c : cases) {
    std::atomic<int> own = 0, named = 0;
    testing::runRanks(4, [&](Transport& t) {
      const bool fails = std::find(c.failing.begin(), c.failing.end(), t.rank()) != c.failing.end();
      try {
        if (fails) {
          std::exception_ptr error = c.fcpError
                                         ? std::make_exception_ptr(Error(
                                               ErrorCode::kInvalidArgument,
                                               "bad planner threads " + std::to_string(t.rank())))
                                         : std::make_exception_ptr(std::bad_alloc());
          failPlanAgreement(error, t);
        } else {
          checkPlanAgreement(makePlan("fcp", batch, 4, MaskKind::kCausal), t);
        }
        ADD_FAILURE() << "rank " << t.rank() << " did not throw";
      } catch (const Error& e) {
        const std::string what = e.what();
        if (fails) {
          EXPECT_EQ(what, "bad planner threads " + std::to_string(t.rank()));
          ++own;
        } else {
          EXPECT_EQ(e.code(), c.expected) << what;
          EXPECT_EQ(what, "rank " + std::to_string(t.rank()) + ": rank " + std::to_string(c.named) +
                              " could not plan this batch (its error there, of kind '" +
                              std::string(errorCodeName(c.expected)) +
                              "', says why): expected a batch every rank can plan");
          ++named;
        }
      } catch (const std::bad_alloc&) {
        EXPECT_TRUE(fails && !c.fcpError);
        ++own;
      }
      int64_t sum[1] = {t.rank()};
      t.allreduce(sum, ReduceOp::kSum);
      EXPECT_EQ(sum[0], 0 + 1 + 2 + 3);
    });
    EXPECT_EQ(own.load(), static_cast<int>(c.failing.size()));
    EXPECT_EQ(named.load(), 4 - static_cast<int>(c.failing.size()));
  }
}

TEST(ReferenceTest, RelativeL2IsZeroForEqualAndOneForZero) {
  const std::vector<float> a{1, 2, 3};
  const std::vector<double> b{1, 2, 3};
  EXPECT_EQ(relativeL2(a, b), 0);
  EXPECT_DOUBLE_EQ(relativeL2(std::vector<float>{0, 0, 0}, b), 1.0);
  EXPECT_EQ(relativeL2(std::vector<float>{}, std::vector<double>{}), 0);
}

// Against a reference of zeros (dQ, dK of one-token sequences) the error is the RMS error: a
// rounding residue is small, not infinite (fcp run --check failed such a run).
TEST(ReferenceTest, RelativeL2AgainstZerosIsTheRmsError) {
  const std::vector<double> zeros{0, 0, 0, 0};
  EXPECT_EQ(relativeL2(std::vector<float>{0, 0, 0, 0}, zeros), 0);
  EXPECT_DOUBLE_EQ(relativeL2(std::vector<float>{3e-8f, 0, -4e-8f, 0}, zeros),
                   std::sqrt((double(3e-8f) * 3e-8f + double(4e-8f) * 4e-8f) / 4));
  EXPECT_DOUBLE_EQ(relativeL2(std::vector<float>{2, 2, 2, 2}, zeros), 2.0);
}

}  // namespace
}  // namespace fcp::runtime
