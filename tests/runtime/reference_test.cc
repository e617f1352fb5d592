// The checking tools of reference.h on ranks as threads: gathering rows to rank 0 (uneven and
// empty ranks, back-to-back gathers on one tag) and comparing outputs with the reference.
#include "fcp/runtime/reference.h"

#include <gtest/gtest.h>

#include <atomic>

#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "thread_transport.h"

namespace fcp::runtime {
namespace {

/// Row `row`, column `col` of a test tensor: distinct everywhere.
float valueAt(int64_t row, int64_t col, int64_t salt) {
  return static_cast<float>(row * 100 + col + salt * 100000);
}

std::vector<float> rowsOf(int64_t begin, int64_t end, int64_t width, int64_t salt) {
  std::vector<float> out;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t c = 0; c < width; ++c) out.push_back(valueAt(r, c, salt));
  }
  return out;
}

TEST(GatherToRootTest, RankZeroGetsEveryRanksRowsInRankOrder) {
  // Uneven ranges, rank 2 empty; two gathers of different widths back to back on one tag.
  const std::vector<int64_t> starts{0, 5, 6, 6, 13};
  testing::runRanks(4, [&](Transport& t) {
    const auto r = static_cast<size_t>(t.rank());
    const std::vector<float> a =
        gatherToRoot(t, rowsOf(starts[r], starts[r + 1], 3, 0), starts, 3, 7);
    const std::vector<float> b =
        gatherToRoot(t, rowsOf(starts[r], starts[r + 1], 2, 1), starts, 2, 7);
    if (t.rank() == 0) {
      EXPECT_EQ(a, rowsOf(0, 13, 3, 0));
      EXPECT_EQ(b, rowsOf(0, 13, 2, 1));
    } else {
      EXPECT_TRUE(a.empty());
      EXPECT_TRUE(b.empty());
    }
  });
}

TEST(GatherToRootTest, OneRankReturnsItsOwnRows) {
  const std::vector<int64_t> starts{0, 4};
  testing::runRanks(1, [&](Transport& t) {
    EXPECT_EQ(gatherToRoot(t, rowsOf(0, 4, 5, 0), starts, 5, 1), rowsOf(0, 4, 5, 0));
  });
}

TEST(GatherToRootTest, RefusesStartsAndSizesThatDoNotMatch) {
  std::atomic<int> refused = 0;
  auto expectRefused = [&refused](auto call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "expected a refusal naming '" << words << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      ++refused;
    }
  };
  testing::runRanks(2, [&](Transport& t) {
    const std::vector<float> mine = rowsOf(0, 3, 2, 0);
    expectRefused(
        [&] {
          gatherToRoot(t, mine, std::vector<int64_t>{0, 3}, 2, 1);
        },
        "expected 3 starts");
    expectRefused(
        [&] {
          gatherToRoot(t, mine, std::vector<int64_t>{0, 4, 2}, 2, 1);
        },
        "do not fall");
    expectRefused(
        [&] {
          gatherToRoot(t, mine, std::vector<int64_t>{0, 4, 8}, 2, 1);
        },
        "holds 6 floats: expected 4 rows of 2");
  });
  EXPECT_EQ(refused.load(), 6);
}

TEST(CompareWithReferenceTest, ZeroForTheReferenceItselfAndTheRelativeErrorOtherwise) {
  const Batch batch{{5, 3}};
  const AttentionConfig a{2, 1, 4, 4, MaskKind::kCausal};
  Rng rng(3);
  auto random = [&rng](int64_t n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = static_cast<float>(rng.normal());
    return x;
  };
  const int64_t tokens = batch.numTokens();
  const std::vector<float> q = random(tokens * 8), k = random(tokens * 4), v = random(tokens * 4),
                           dO = random(tokens * 8);
  const ReferenceResult ref = referenceAttention(batch, a, q, k, v, dO);
  auto asFloat = [](const std::vector<double>& x) {
    return std::vector<float>(x.begin(), x.end());
  };
  std::vector<float> o = asFloat(ref.o), dq = asFloat(ref.dq), dk = asFloat(ref.dk),
                     dv = asFloat(ref.dv);
  const ReferenceErrors same = compareWithReference(ref, o, dq, dk, dv);
  for (const double e : {same.o, same.dq, same.dk, same.dv}) EXPECT_LT(e, 1e-6);
  for (float& x : dk) x = 0;  // all wrong: relative error 1
  const ReferenceErrors wrong = compareWithReference(ref, o, dq, dk, dv);
  EXPECT_DOUBLE_EQ(wrong.dk, 1.0);
  EXPECT_LT(wrong.dv, 1e-6);
  dv.pop_back();
  EXPECT_THROW(compareWithReference(ref, o, dq, dk, dv), Error);
}

}  // namespace
}  // namespace fcp::runtime
