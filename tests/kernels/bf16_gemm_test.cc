// The bf16 GEMM probe against what the kernels do. Where oneDNN's bf16 GEMM runs, the native
// path must be the default and match the float64 reference within bf16 tolerance while really
// rounding P to bf16 (its result differs from the widened path's); where it does not run, the
// native path must be refused and the default must be the widened path, which is then exactly
// the fp32 kernel on the bf16-rounded inputs.
#include <gtest/gtest.h>

#include <vector>

#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"
#include "fcp/kernels/cpu_dispatch.h"
#include "kernel_test_util.h"
#include "mask_cases.h"

namespace fcp::kernels {
namespace {

using testing::HostTensor;

struct GemmGuard {
  ~GemmGuard() { setBf16Gemm(Bf16Gemm::kAuto); }
};

struct Inputs {
  int64_t n = 300;
  int hq = 8, hkv = 2, d = 64;
  HostTensor q, k, v;
  testing::MaskSetup mask;
  // The bf16 inputs widened back to fp32, as a separate fp32 problem.
  std::vector<float> qw, kw, vw;
};

Inputs makeInputs() {
  std::mt19937_64 rng(testing::testSeed() ^ 0xbf16);
  Inputs in;
  in.q = HostTensor(in.n, in.hq, in.d);
  in.k = HostTensor(in.n, in.hkv, in.d);
  in.v = HostTensor(in.n, in.hkv, in.d);
  in.q.randomize(rng, 2.0f), in.k.randomize(rng), in.v.randomize(rng);
  in.mask = testing::makeMask(testing::Layout::kCausalOffsets, in.n, in.n, rng);
  for (const auto& [t, w] : {std::pair{&in.q, &in.qw}, {&in.k, &in.kw}, {&in.v, &in.vw}})
    for (uint16_t x : t->bf16) w->push_back(fromBf16(x));
  return in;
}

struct Output {
  std::vector<float> o, lse;
};

Output runBf16(const Inputs& in) {
  Output out{std::vector<float>(in.q.f32.size()), std::vector<float>(in.n * in.hq)};
  forward(in.q.view(DType::kBf16), in.k.view(DType::kBf16), in.v.view(DType::kBf16),
          in.mask.mask(), out.o.data(), out.lse.data());
  return out;
}

Output runWidenedFp32(const Inputs& in) {
  Output out{std::vector<float>(in.q.f32.size()), std::vector<float>(in.n * in.hq)};
  forward({in.qw.data(), in.n, in.hq, in.d, DType::kFp32},
          {in.kw.data(), in.n, in.hkv, in.d, DType::kFp32},
          {in.vw.data(), in.n, in.hkv, in.d, DType::kFp32}, in.mask.mask(), out.o.data(),
          out.lse.data());
  return out;
}

TEST(Bf16GemmTest, ProbeAgreesWithThePathTheKernelsTake) {
  SCOPED_TRACE("seed " + std::to_string(testing::testSeed()));
  GemmGuard guard;
  const Inputs in = makeInputs();
  setBf16Gemm(Bf16Gemm::kAuto);
  if (bf16GemmSupported()) {
    EXPECT_EQ(activeBf16Gemm(), Bf16Gemm::kNative);
    const testing::Reference ref = testing::referenceForward(
        in.q.asDouble(DType::kBf16), in.k.asDouble(DType::kBf16), in.v.asDouble(DType::kBf16),
        in.n, in.n, in.hq, in.hkv, in.d, testing::expand(in.mask.q), testing::expand(in.mask.k),
        true);
    const Output native = runBf16(in);
    EXPECT_LE(testing::relativeL2(native.o.data(), ref.o), 1e-2);
    EXPECT_LE(testing::relativeL2(native.lse.data(), ref.lse), 1e-2);
    // P rounded to bf16 for O += P V: the native result cannot equal the fp32 computation.
    EXPECT_NE(native.o, runWidenedFp32(in).o);
  } else {
    EXPECT_EQ(activeBf16Gemm(), Bf16Gemm::kWiden);
    EXPECT_THROW(setBf16Gemm(Bf16Gemm::kNative), Error);
    EXPECT_EQ(activeBf16Gemm(), Bf16Gemm::kWiden);
  }
}

TEST(Bf16GemmTest, WidenedPathIsTheFp32KernelOnRoundedInputs) {
  GemmGuard guard;
  const Inputs in = makeInputs();
  setBf16Gemm(Bf16Gemm::kWiden);
  const Output widened = runBf16(in);
  const Output fp32 = runWidenedFp32(in);
  EXPECT_EQ(widened.o, fp32.o);
  EXPECT_EQ(widened.lse, fp32.lse);
}

TEST(Bf16GemmTest, NamesAndAutoRestore) {
  GemmGuard guard;
  EXPECT_EQ(bf16GemmName(Bf16Gemm::kNative), "native");
  EXPECT_EQ(bf16GemmName(Bf16Gemm::kWiden), "widen");
  setBf16Gemm(Bf16Gemm::kWiden);
  EXPECT_EQ(activeBf16Gemm(), Bf16Gemm::kWiden);
  setBf16Gemm(Bf16Gemm::kAuto);
  EXPECT_EQ(activeBf16Gemm(), bf16GemmSupported() ? Bf16Gemm::kNative : Bf16Gemm::kWiden);
}

}  // namespace
}  // namespace fcp::kernels
