// Backward against the float64 reference (dQ, dK, dV of softmax(QK^T/sqrt(d))V under the mask),
// through the real call sequence: forward -> computeDelta -> backward. Backward accumulates, so
// gradient buffers cannot be poisoned with NaN; they start at zero, and SplitKeysAccumulate...
// checks that a second pair adds to (rather than overwrites) the first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
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

struct PathGuard {
  ~PathGuard() {
    setCpuPath(CpuPath::kAuto);
    setBf16Gemm(Bf16Gemm::kAuto);
  }
};

// ||got - ref|| / max(||ref||, ||scaleRef||), NaN if got has a NaN. The floor matters when the
// reference nearly cancels: a query with a single visible key has dS = P (dP - D) = 0 exactly,
// so dK is pure rounding; there the error is measured against dV's norm (the problem's gradient
// scale, which never cancels) instead of against zero.
double gradientError(const std::vector<float>& got, const std::vector<double>& ref,
                     const std::vector<double>& scaleRef) {
  double num = 0, den = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  for (double x : scaleRef) scale += x * x;
  return std::sqrt(num / std::max({den, scale, 1e-300}));
}

void checkBackward(int64_t n, int hq, int hkv, int d, Layout layout, float softmaxScale = 0) {
  std::mt19937_64 rng(testing::testSeed() ^ (n * 977 + hq * 13 + static_cast<int>(layout)));
  SCOPED_TRACE("seed " + std::to_string(testing::testSeed()));
  HostTensor q(n, hq, d), k(n, hkv, d), v(n, hkv, d), dO(n, hq, d);
  q.randomize(rng, 2.0f), k.randomize(rng), v.randomize(rng), dO.randomize(rng);
  const testing::MaskSetup m = testing::makeMask(layout, n, n, rng);
  PathGuard guard;
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    // Reference on the inputs as the kernel sees them (bf16-rounded for bf16), see forward.
    const testing::Reference ref = testing::referenceBackward(
        q.asDouble(dtype), k.asDouble(dtype), v.asDouble(dtype), dO.asDouble(dtype), n, n, hq, hkv,
        d, testing::expand(m.q), testing::expand(m.k), m.kind == MaskKind::kCausal, softmaxScale);
    for (CpuPath path : {CpuPath::kPortable, CpuPath::kAvx2, CpuPath::kAvx512}) {
      if (!cpuSupports(path)) continue;
      for (Bf16Gemm gemm : testing::bf16GemmsFor(dtype)) {
        SCOPED_TRACE(std::string(cpuPathName(path)) + " " + std::string(dtypeName(dtype)) +
                     " gemm " + std::string(bf16GemmName(gemm)));
        setCpuPath(path);
        setBf16Gemm(gemm);
        const double tol = dtype == DType::kFp32 ? 1e-5 : 1e-2;
        std::vector<float> o(q.f32.size()), lse(n * hq), delta(n * hq);
        const KernelOptions options{0, softmaxScale};
        forward(q.view(dtype), k.view(dtype), v.view(dtype), m.mask(), o.data(), lse.data(),
                options);
        computeDelta({o.data(), n, hq, d, DType::kFp32}, dO.view(dtype), delta.data());
        std::vector<float> dq(q.f32.size(), 0.0f), dk(k.f32.size(), 0.0f),
            dv(k.f32.size(), 0.0f);
        backward(q.view(dtype), k.view(dtype), v.view(dtype), dO.view(dtype), lse.data(),
                 delta.data(), m.mask(), dq.data(), dk.data(), dv.data(), options);
        if (softmaxScale > 0) {
          EXPECT_LE(testing::relativeL2(o.data(), ref.o), tol) << "o";
          EXPECT_LE(testing::relativeL2(lse.data(), ref.lse), tol) << "lse";
        }
        EXPECT_LE(gradientError(dq, ref.dq, ref.dv), tol) << "dq";
        EXPECT_LE(gradientError(dk, ref.dk, ref.dv), tol) << "dk";
        EXPECT_LE(gradientError(dv, ref.dv, ref.dv), tol) << "dv";
      }
    }
  }
}

class BackwardTest : public ::testing::TestWithParam<std::tuple<int64_t, int, Layout>> {};

TEST_P(BackwardTest, MatchesFloat64Reference) {
  const auto [n, ratio, layout] = GetParam();
  if (n >= 1000) checkBackward(n, ratio, 1, 32, layout);
  else checkBackward(n, 2 * ratio, 2, 64, layout);
}

INSTANTIATE_TEST_SUITE_P(
    Lengths, BackwardTest,
    ::testing::Combine(::testing::Values<int64_t>(1, 7, 64, 127, 128, 129, 1000),
                       ::testing::Values(1, 4, 8),
                       ::testing::Values(Layout::kCausalOffsets, Layout::kFull, Layout::kVarlen)),
    [](const auto& param_info) {
      // Appended, not "L" + ...: GCC 12 warns falsely on that operator+ (-Wrestrict).
      std::string name = "L";
      name += std::to_string(std::get<0>(param_info.param));
      name += "_g";
      name += std::to_string(std::get<1>(param_info.param));
      name += "_";
      name += testing::layoutName(std::get<2>(param_info.param));
      return name;
    });

// A scale other than 1/sqrt(d) (a model's own: 1/d, or none), forward and backward, on every
// path and mask.
TEST(SoftmaxScaleTest, ForwardAndBackwardMatchFloat64Reference) {
  for (const float scale : {1.0f / 64, 0.05f, 1.0f}) {
    for (Layout layout : {Layout::kCausalOffsets, Layout::kFull, Layout::kVarlen}) {
      SCOPED_TRACE("scale " + std::to_string(scale) + " " + testing::layoutName(layout));
      checkBackward(129, 4, 2, 64, layout, scale);
    }
  }
}

TEST(SoftmaxScaleTest, AScaleThatIsNegativeOrNotFiniteIsNamed) {
  HostTensor q(4, 2, 8), k(4, 1, 8);
  std::mt19937_64 rng(1);
  q.randomize(rng);
  k.randomize(rng);
  const testing::MaskSetup m = testing::makeMask(Layout::kFull, 4, 4, rng);
  std::vector<float> o(q.f32.size()), lse(8), dq(q.f32.size()), dk(k.f32.size()), dv(k.f32.size());
  for (const float bad :
       {-0.5f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const KernelOptions options{0, bad};
    for (const bool forwardPass : {true, false}) {
      try {
        if (forwardPass) {
          forward(q.view(DType::kFp32), k.view(DType::kFp32), k.view(DType::kFp32), m.mask(),
                  o.data(), lse.data(), options);
        } else {
          backward(q.view(DType::kFp32), k.view(DType::kFp32), k.view(DType::kFp32),
                   q.view(DType::kFp32), lse.data(), lse.data(), m.mask(), dq.data(), dk.data(),
                   dv.data(), options);
        }
        ADD_FAILURE() << "scale " << bad << " accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        std::ostringstream named;
        named << "softmax scale " << bad << ": expected a finite value >= 0";
        EXPECT_NE(std::string(e.what()).find(named.str()), std::string::npos) << e.what();
      }
    }
  }
}

TEST(BackwardLongTest, MatchesFloat64ReferenceAt4096) {
  checkBackward(4096, 4, 1, 16, Layout::kCausalOffsets);
}

TEST(BackwardTest, SplitKeysAccumulateToOnePass) {
  // The runtime recomputes each pair's backward and lets the gradients add up.
  std::mt19937_64 rng(testing::testSeed());
  const int64_t n = 333;
  const int hq = 4, hkv = 2, d = 32;
  HostTensor q(n, hq, d), k(n, hkv, d), v(n, hkv, d), dO(n, hq, d);
  q.randomize(rng), k.randomize(rng), v.randomize(rng), dO.randomize(rng);
  const testing::MaskSetup m = testing::makeMask(Layout::kCausalOffsets, n, n, rng);
  std::vector<float> o(q.f32.size()), lse(n * hq), delta(n * hq);
  forward(q.view(DType::kFp32), k.view(DType::kFp32), v.view(DType::kFp32), m.mask(), o.data(),
          lse.data());
  computeDelta({o.data(), n, hq, d, DType::kFp32}, dO.view(DType::kFp32), delta.data());
  std::vector<float> dq1(q.f32.size()), dk1(k.f32.size()), dv1(k.f32.size());
  backward(q.view(DType::kFp32), k.view(DType::kFp32), v.view(DType::kFp32),
           dO.view(DType::kFp32), lse.data(), delta.data(), m.mask(), dq1.data(), dk1.data(),
           dv1.data());
  std::vector<float> dq2(q.f32.size()), dk2(k.f32.size()), dv2(k.f32.size());
  const int64_t cut = 100, row = static_cast<int64_t>(hkv) * d;
  for (auto [k0, k1] : {std::pair<int64_t, int64_t>{0, cut}, {cut, n}}) {
    const std::vector<Segment> ks = testing::sliceSegments(m.k, k0, k1);
    const TensorView kv{k.f32.data() + k0 * row, k1 - k0, hkv, d, DType::kFp32};
    const TensorView vv{v.f32.data() + k0 * row, k1 - k0, hkv, d, DType::kFp32};
    backward(q.view(DType::kFp32), kv, vv, dO.view(DType::kFp32), lse.data(), delta.data(),
             {m.kind, m.q, ks}, dq2.data(), dk2.data() + k0 * row, dv2.data() + k0 * row);
  }
  std::vector<double> ref(dq1.begin(), dq1.end());
  EXPECT_LE(testing::relativeL2(dq2.data(), ref), 1e-6);
  ref.assign(dk1.begin(), dk1.end());
  EXPECT_LE(testing::relativeL2(dk2.data(), ref), 1e-6);
  ref.assign(dv1.begin(), dv1.end());
  EXPECT_LE(testing::relativeL2(dv2.data(), ref), 1e-6);
}

}  // namespace
}  // namespace fcp::kernels
