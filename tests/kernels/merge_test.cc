// Merging partials: any split of the KV range, merged in any order, equals one pass; empty
// partials (LSE = -inf) change nothing. Also the bf16 array conversions the runtime uses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/kernels/attention.h"
#include "kernel_test_util.h"
#include "mask_cases.h"

namespace fcp::kernels {
namespace {

using testing::HostTensor;
using testing::Layout;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Partial {
  std::vector<float> o, lse;
};

// Forward over key tokens [k0, k1) only.
Partial forwardSlice(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                     const testing::MaskSetup& m, int64_t k0, int64_t k1) {
  const int64_t rowFloats = static_cast<int64_t>(k.heads) * k.dim;
  const std::vector<Segment> ks = testing::sliceSegments(m.k, k0, k1);
  const TensorView kv{k.f32.data() + k0 * rowFloats, k1 - k0, k.heads, k.dim, DType::kFp32};
  const TensorView vv{v.f32.data() + k0 * rowFloats, k1 - k0, v.heads, v.dim, DType::kFp32};
  Partial p{std::vector<float>(q.f32.size(), std::numeric_limits<float>::quiet_NaN()),
            std::vector<float>(q.tokens * q.heads, std::numeric_limits<float>::quiet_NaN())};
  forward(q.view(DType::kFp32), kv, vv, {m.kind, m.q, ks}, p.o.data(), p.lse.data());
  return p;
}

// Largest |a - b| / max(1, |b|); infinite if only one side is NaN or infinite.
double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;  // also equal infinities
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) /
                                std::max(1.0, std::abs(static_cast<double>(b[i]))));
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
  }
  return worst;
}

TEST(MergeTest, AnySplitOfKeysMergedEqualsOnePass) {
  std::mt19937_64 rng(testing::testSeed());
  SCOPED_TRACE("seed " + std::to_string(testing::testSeed()));
  for (Layout layout : {Layout::kCausalOffsets, Layout::kFull, Layout::kVarlen}) {
    for (int trial = 0; trial < 4; ++trial) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 700);
      HostTensor q(n, 4, 32), k(n, 2, 32), v(n, 2, 32);
      q.randomize(rng, 2.0f), k.randomize(rng), v.randomize(rng);
      const testing::MaskSetup m = testing::makeMask(layout, n, n, rng);
      const Partial whole = forwardSlice(q, k, v, m, 0, n);
      // Random cut points (repeats allowed: empty slices must be harmless too).
      std::vector<int64_t> cuts{0, n};
      for (int c = 0; c < 1 + trial * 2; ++c) cuts.push_back(static_cast<int64_t>(rng() % (n + 1)));
      std::sort(cuts.begin(), cuts.end());
      std::vector<Partial> parts;
      for (size_t c = 0; c + 1 < cuts.size(); ++c)
        parts.push_back(forwardSlice(q, k, v, m, cuts[c], cuts[c + 1]));
      std::shuffle(parts.begin(), parts.end(), rng);
      Partial acc{std::vector<float>(q.f32.size(), 0.0f), std::vector<float>(n * 4, kNegInf)};
      for (const Partial& p : parts)
        mergePartials(n, 4, 32, acc.o.data(), acc.lse.data(), p.o.data(), p.lse.data());
      SCOPED_TRACE(testing::layoutName(layout) + " n=" + std::to_string(n));
      EXPECT_LE(maxAbsDiff(acc.o, whole.o), 1e-5);
      EXPECT_LE(maxAbsDiff(acc.lse, whole.lse), 1e-5);
    }
  }
}

TEST(MergeTest, EmptyPartialIsIdentityOnBothSides) {
  const std::vector<float> o{1.5f, -2.0f, 0.25f, 4.0f}, lse{0.7f, kNegInf};
  std::vector<float> accO(4, 0.0f), accLse(2, kNegInf);
  mergePartials(2, 1, 2, accO.data(), accLse.data(), o.data(), lse.data());
  EXPECT_EQ(accO[0], 1.5f);
  EXPECT_EQ(accO[1], -2.0f);
  EXPECT_EQ(accLse[0], 0.7f);
  EXPECT_EQ(accLse[1], kNegInf);  // empty merged into empty stays empty, not NaN
  EXPECT_EQ(accO[2], 0.0f);
  const std::vector<float> none(4, 0.0f), noneLse(2, kNegInf);
  mergePartials(2, 1, 2, accO.data(), accLse.data(), none.data(), noneLse.data());
  EXPECT_EQ(accO[0], 1.5f);
  EXPECT_EQ(accLse[0], 0.7f);
}

TEST(MergeTest, OrderDoesNotMatterBeyondRounding) {
  std::mt19937_64 rng(testing::testSeed());
  std::normal_distribution<float> dist(0.0f, 3.0f);
  const int rows = 50, d = 16, parts = 5;
  std::vector<std::vector<float>> os(parts, std::vector<float>(rows * d));
  std::vector<std::vector<float>> ls(parts, std::vector<float>(rows));
  for (int p = 0; p < parts; ++p) {
    for (float& x : os[p]) x = dist(rng);
    for (float& x : ls[p]) x = (rng() % 5 == 0) ? kNegInf : dist(rng) * 20.0f;
  }
  std::vector<int> order(parts);
  std::iota(order.begin(), order.end(), 0);
  std::vector<float> firstO, firstL;
  for (int trial = 0; trial < 6; ++trial) {
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<float> accO(rows * d, 0.0f), accL(rows, kNegInf);
    for (int p : order)
      mergePartials(rows, 1, d, accO.data(), accL.data(), os[p].data(), ls[p].data());
    if (trial == 0) {
      firstO = accO, firstL = accL;
      continue;
    }
    // Orders round differently. An output near 0 is a weighted mean of partials of either
    // sign (|o| up to ~12 here), so its rounding error is on their scale, not its own: the
    // difference is measured against the largest partial for that element (a check against
    // the output alone failed once here, at 1.25e-5).
    double worst = 0;
    for (size_t i = 0; i < accO.size(); ++i) {
      double scale = 1;
      for (int p = 0; p < parts; ++p) scale = std::max(scale, std::abs(double{os[p][i]}));
      worst = std::max(worst, std::abs(double{accO[i]} - firstO[i]) / scale);
    }
    EXPECT_LE(worst, 1e-5) << "FCP_TEST_SEED=" << testing::testSeed();
    EXPECT_LE(maxAbsDiff(accL, firstL), 1e-5) << "FCP_TEST_SEED=" << testing::testSeed();
  }
}

}  // namespace
}  // namespace fcp::kernels

namespace fcp::kernels {
namespace {

// The array conversions (the CPU's fastest path) against the scalar ones, on random values,
// ties that round to even, infinities and zeros, at lengths around a vector width.
TEST(Bf16ConversionTest, ArraysMatchTheScalarConversions) {
  Rng rng(17);
  for (const size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{15}, size_t{16},
                         size_t{17}, size_t{1000}}) {
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i)
      in[i] = static_cast<float>(rng.normal() * std::pow(10.0, rng.uniform() * 8 - 4));
    const float specials[] = {0.f,
                              -0.f,
                              1.00390625f,
                              1.01171875f,
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
    for (size_t i = 0; i < n && i < std::size(specials); ++i) in[i] = specials[i];
    std::vector<uint16_t> half(n);
    toBf16(in, half);
    std::vector<float> back(n);
    fromBf16(half, back);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(half[i], toBf16(in[i])) << "n " << n << " element " << i << " = " << in[i];
      EXPECT_EQ(back[i], fromBf16(half[i])) << "n " << n << " element " << i;
    }
  }
  std::vector<float> two(2);
  std::vector<uint16_t> one(1);
  EXPECT_THROW(toBf16(two, one), Error);
}

}  // namespace
}  // namespace fcp::kernels
