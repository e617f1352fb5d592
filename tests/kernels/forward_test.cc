// Forward partials against the float64 reference, on fresh random inputs, for every compiled
// path this CPU can run, in fp32 and bf16. Outputs are poisoned with NaN before every run, so an
// element the kernel forgets to write fails the comparison.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"
#include "fcp/kernels/cpu_dispatch.h"
#include "kernel_test_util.h"
#include "mask_cases.h"

namespace fcp::kernels {
namespace {

using testing::HostTensor;
using testing::Layout;

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

double tolerance(DType dtype) { return dtype == DType::kFp32 ? 1e-5 : 1e-2; }

std::vector<CpuPath> runnablePaths() {
  std::vector<CpuPath> paths;
  for (CpuPath p : {CpuPath::kPortable, CpuPath::kAvx2, CpuPath::kAvx512})
    if (cpuSupports(p)) paths.push_back(p);
  return paths;
}

// Restores automatic dispatch when a test ends, even on failure.
struct PathGuard {
  ~PathGuard() {
    setCpuPath(CpuPath::kAuto);
    setBf16Gemm(Bf16Gemm::kAuto);
  }
};

struct Problem {
  int64_t nq, nk;
  int hq, hkv, d;
  Layout layout;
};

// Heads and head_dim shrink with length so that the float64 reference stays cheap.
Problem problemFor(int64_t length, int ratio, Layout layout) {
  if (length >= 4096) return {length, length, ratio, 1, 32, layout};
  if (length >= 1000) return {length, length, ratio, 1, 64, layout};
  return {length, length, 2 * ratio, 2, 64, layout};
}

// Query rows the reference computes: all for short blocks, a sample plus both ends for long.
std::vector<int64_t> sampledRows(int64_t nq, std::mt19937_64& rng) {
  std::vector<int64_t> rows;
  if (nq <= 512) return rows;  // empty means all
  for (int64_t i = 0; i < 8; ++i) rows.push_back(i), rows.push_back(nq - 1 - i);
  for (int64_t i = 0; i < 8; ++i) rows.push_back((nq + 1) / 2 - 4 + i);
  for (int i = 0; i < 40; ++i) rows.push_back(static_cast<int64_t>(rng() % nq));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

void checkForward(const Problem& p) {
  std::mt19937_64 rng(testing::testSeed() ^ (p.nq * 131 + p.hq * 7 + static_cast<int>(p.layout)));
  SCOPED_TRACE("seed " + std::to_string(testing::testSeed()) + " (set FCP_TEST_SEED to replay)");
  const int64_t nk = p.layout == Layout::kVarlen ? p.nq : p.nk;
  HostTensor q(p.nq, p.hq, p.d), k(nk, p.hkv, p.d), v(nk, p.hkv, p.d);
  q.randomize(rng, 2.0f);  // spread-out scores exercise the max shift
  k.randomize(rng);
  v.randomize(rng);
  const testing::MaskSetup m = testing::makeMask(p.layout, p.nq, nk, rng);
  const std::vector<int64_t> rows = sampledRows(p.nq, rng);
  PathGuard guard;
  std::vector<float> o(p.nq * p.hq * p.d), lse(p.nq * p.hq);
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    // The reference sees what the kernel sees: bf16 storage rounds the inputs, and only the
    // arithmetic after that is under test (a reference on fp32 inputs would charge bf16's
    // input rounding to the kernel: on one-key rows that alone can exceed 1e-2).
    const testing::Reference ref = testing::referenceForward(
        q.asDouble(dtype), k.asDouble(dtype), v.asDouble(dtype), p.nq, nk, p.hq, p.hkv, p.d,
        testing::expand(m.q), testing::expand(m.k), m.kind == MaskKind::kCausal, rows);
    for (CpuPath path : runnablePaths()) {
      for (Bf16Gemm gemm : testing::bf16GemmsFor(dtype)) {
        SCOPED_TRACE(std::string(cpuPathName(path)) + " " + std::string(dtypeName(dtype)) +
                     " gemm " + std::string(bf16GemmName(gemm)));
        setCpuPath(path);
        setBf16Gemm(gemm);
        std::fill(o.begin(), o.end(), kPoison);
        std::fill(lse.begin(), lse.end(), kPoison);
        forward(q.view(dtype), k.view(dtype), v.view(dtype), m.mask(), o.data(), lse.data());
        for (float x : o) ASSERT_FALSE(std::isnan(x)) << "unwritten or NaN output";
        for (float x : lse) ASSERT_FALSE(std::isnan(x)) << "unwritten or NaN LSE";
        EXPECT_LE(testing::relativeL2(o.data(), ref.o), tolerance(dtype));
        EXPECT_LE(testing::relativeL2(lse.data(), ref.lse), tolerance(dtype));
      }
    }
  }
}

class ForwardTest : public ::testing::TestWithParam<std::tuple<int64_t, int, Layout>> {};

TEST_P(ForwardTest, MatchesFloat64Reference) {
  const auto [length, ratio, layout] = GetParam();
  checkForward(problemFor(length, ratio, layout));
}

INSTANTIATE_TEST_SUITE_P(
    Lengths, ForwardTest,
    ::testing::Combine(::testing::Values<int64_t>(1, 7, 64, 127, 128, 129, 1000, 4096),
                       ::testing::Values(1, 4, 8),
                       ::testing::Values(Layout::kCausalOffsets, Layout::kFull, Layout::kVarlen)),
    [](const auto& param_info) {
      return "L" + std::to_string(std::get<0>(param_info.param)) + "_g" +
             std::to_string(std::get<1>(param_info.param)) + "_" +
             testing::layoutName(std::get<2>(param_info.param));
    });

TEST(ForwardUnequalBlocksTest, MatchesFloat64Reference) {
  for (auto [nq, nk] : {std::pair<int64_t, int64_t>{129, 64}, {7, 1000}, {1000, 7}, {1, 300}})
    for (Layout layout : {Layout::kCausalOffsets, Layout::kFull}) {
      SCOPED_TRACE("nq " + std::to_string(nq) + " nk " + std::to_string(nk));
      checkForward({nq, nk, 8, 2, 64, layout});
    }
}

TEST(ForwardTest, RowWithNothingVisibleIsEmptyPartial) {
  // Every key lies in the future of every query.
  std::mt19937_64 rng(testing::testSeed());
  HostTensor q(5, 2, 16), k(9, 1, 16), v(9, 1, 16);
  q.randomize(rng), k.randomize(rng), v.randomize(rng);
  const std::vector<Segment> qs{{5, 0, 0}}, ks{{9, 0, 100}};
  std::vector<float> o(5 * 2 * 16, kPoison), lse(10, kPoison);
  forward(q.view(DType::kFp32), k.view(DType::kFp32), v.view(DType::kFp32),
          {MaskKind::kCausal, qs, ks}, o.data(), lse.data());
  for (float x : o) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

TEST(ForwardTest, ResultDoesNotDependOnThreadCount) {
  std::mt19937_64 rng(testing::testSeed());
  HostTensor q(700, 8, 64), k(700, 2, 64), v(700, 2, 64);
  q.randomize(rng), k.randomize(rng), v.randomize(rng);
  const testing::MaskSetup m = testing::makeMask(Layout::kCausalOffsets, 700, 700, rng);
  std::vector<float> o1(q.f32.size()), l1(700 * 8), o3(q.f32.size()), l3(700 * 8);
  forward(q.view(DType::kFp32), k.view(DType::kFp32), v.view(DType::kFp32), m.mask(), o1.data(),
          l1.data(), {.numThreads = 1});
  forward(q.view(DType::kFp32), k.view(DType::kFp32), v.view(DType::kFp32), m.mask(), o3.data(),
          l3.data(), {.numThreads = 3});
  EXPECT_EQ(o1, o3);
  EXPECT_EQ(l1, l3);
}

TEST(ForwardTest, RejectsInconsistentShapes) {
  std::vector<float> buf(64 * 16, 0.0f), o(64 * 16), lse(64);
  const std::vector<Segment> seg{{4, 0, 0}}, short_seg{{3, 0, 0}};
  const TensorView q{buf.data(), 4, 3, 16, DType::kFp32};
  const TensorView k{buf.data(), 4, 2, 16, DType::kFp32};
  EXPECT_THROW(forward(q, k, k, {MaskKind::kCausal, seg, seg}, o.data(), lse.data()), Error);
  const TensorView q2{buf.data(), 4, 4, 16, DType::kFp32};
  EXPECT_THROW(forward(q2, k, k, {MaskKind::kCausal, short_seg, seg}, o.data(), lse.data()),
               Error);
  const TensorView kb{buf.data(), 4, 2, 16, DType::kBf16};
  EXPECT_THROW(forward(q2, kb, kb, {MaskKind::kCausal, seg, seg}, o.data(), lse.data()), Error);
  EXPECT_NO_THROW(forward(q2, k, k, {MaskKind::kCausal, seg, seg}, o.data(), lse.data()));
}

TEST(VisiblePairsTest, CountsMatchElementwiseDefinition) {
  std::mt19937_64 rng(testing::testSeed());
  for (Layout layout : {Layout::kCausalOffsets, Layout::kFull, Layout::kVarlen}) {
    const testing::MaskSetup m = testing::makeMask(layout, 301, 301, rng);
    const testing::Tokens qt = testing::expand(m.q), kt = testing::expand(m.k);
    int64_t expected = 0;
    for (size_t i = 0; i < qt.seq.size(); ++i)
      for (size_t j = 0; j < kt.seq.size(); ++j)
        expected += testing::refVisible(qt, i, kt, j, m.kind == MaskKind::kCausal);
    EXPECT_EQ(countVisiblePairs(m.mask()), expected) << testing::layoutName(layout);
  }
}

}  // namespace
}  // namespace fcp::kernels
