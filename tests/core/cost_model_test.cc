#include "fcp/core/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>

#include "../common/error_of.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"

namespace fcp {
namespace {

using fcp::testing::errorOf;

/// Counts mask entries one by one: the obviously correct reference.
int64_t bruteForceVisible(MaskKind mask, int64_t q0, int64_t q1, int64_t k0, int64_t k1) {
  int64_t count = 0;
  for (int64_t i = q0; i < q1; ++i) {
    for (int64_t j = k0; j < k1; ++j) count += (mask == MaskKind::kFull || j <= i) ? 1 : 0;
  }
  return count;
}

TEST(CostModelTest, VisibleEntriesMatchBruteForceOnRandomRanges) {
  Rng rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const auto r = [&](int64_t n) { return static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n)); };
    const int64_t q0 = r(60), q1 = q0 + r(40), k0 = r(60), k1 = k0 + r(40);
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
      ASSERT_EQ(visibleEntries(mask, q0, q1, k0, k1), bruteForceVisible(mask, q0, q1, k0, k1))
          << maskName(mask) << " q[" << q0 << "," << q1 << ") k[" << k0 << "," << k1 << ")";
    }
  }
}

TEST(CostModelTest, VisibleEntriesMatchBruteForceAcrossTheFastPathsLimit) {
  // Positions under 2^31 take a 64-bit path, the rest 128 bits: ranges on either side of the
  // limit and straddling it, each against the one-by-one count.
  Rng rng(11);
  const int64_t limit = int64_t{1} << 31;
  for (int trial = 0; trial < 2000; ++trial) {
    const auto r = [&](int64_t n) {
      return static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n));
    };
    const int64_t q0 = limit - 50 + r(100), q1 = q0 + r(40);
    const int64_t k0 = limit - 50 + r(100), k1 = k0 + r(40);
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
      ASSERT_EQ(visibleEntries(mask, q0, q1, k0, k1), bruteForceVisible(mask, q0, q1, k0, k1))
          << maskName(mask) << " q[" << q0 << "," << q1 << ") k[" << k0 << "," << k1 << ")";
    }
  }
  // The largest products the 64-bit path takes: just under 2^31 tokens each way.
  const int64_t top = limit - 1;
  EXPECT_EQ(visibleEntries(MaskKind::kFull, 0, top, 0, top), top * top);
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, 0, top, 0, top), top * ((top + 1) / 2));
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, 0, top, 0, 1), top);
}

TEST(CostModelTest, VisibleEntriesOfAWholeSequence) {
  const int64_t len = 100000;
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, 0, len, 0, len), len * (len + 1) / 2);
  EXPECT_EQ(visibleEntries(MaskKind::kFull, 0, len, 0, len), len * len);
  // The largest sequence FCP accepts still counts exactly.
  const int64_t big = int64_t{1} << 30;
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, 0, big, 0, big), big / 2 * (big + 1));
}

TEST(CostModelTest, FlopsFollowTheConvention) {
  AttentionConfig c;  // 64 Q heads x 128
  EXPECT_DOUBLE_EQ(forwardFlops(c, 10), 4.0 * 10 * 64 * 128);
  EXPECT_DOUBLE_EQ(backwardFlops(c, 10), 2.5 * 4.0 * 10 * 64 * 128);
  EXPECT_EQ(c.qBytesPerToken(), 64 * 128 * 2);
  EXPECT_EQ(c.kvBytesPerToken(), 2 * 8 * 128 * 2);
}

TEST(CostModelTest, DefaultCurveIsShapedLikeThePaper) {
  const EfficiencyCurve f = EfficiencyCurve::paperDefault();
  EXPECT_NEAR(f.at(512), 0.25, 1e-12);
  EXPECT_LT(f.at(1024), f.at(2048));
  EXPECT_LT(f.at(2048), f.at(4096));
  // Saturating above 4K: the next doubling gains far less than the one before.
  EXPECT_LT(f.at(8192) - f.at(4096), 0.5 * (f.at(4096) - f.at(2048)));
  EXPECT_EQ(f.at(1), f.at(128));
  EXPECT_EQ(f.at(1 << 20), f.at(16384));
  // Log-linear between points.
  EXPECT_NEAR(f.at(724), 0.25 + 0.15 * std::log2(724.0 / 512.0), 1e-12);
}

TEST(CostModelTest, CurveRejectsBadPoints) {
  EXPECT_THROW(EfficiencyCurve({}), Error);
  EXPECT_THROW(EfficiencyCurve({{0, 0.5}}), Error);
  EXPECT_THROW(EfficiencyCurve({{512, 0.0}}), Error);
  EXPECT_THROW(EfficiencyCurve({{512, 1.5}}), Error);
  EXPECT_THROW(EfficiencyCurve({{512, 0.3}, {512, 0.4}}), Error);
  // A fraction so small that costs would overflow (1e-300 made a planner error about a block
  // of infinite cost): refused at the curve, naming the point; the least allowed is kept.
  EXPECT_NE(errorOf([] {
              EfficiencyCurve({{512, 1e-300}});
            }).find("point 0 has efficiency 1e-300: expected a fraction of peak from 1e-06 to 1"),
            std::string::npos);
  EXPECT_EQ(EfficiencyCurve({{512, kMinEfficiency}}).at(512), kMinEfficiency);
}

TEST(CostModelTest, CheckAttentionConfigNamesTheBadField) {
  AttentionConfig c;
  c.numHeadsQ = 12;
  c.numHeadsKv = 8;
  EXPECT_THROW(checkAttentionConfig(c), Error);
  c = AttentionConfig{};
  c.headDim = 0;
  try {
    checkAttentionConfig(c);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fcp
