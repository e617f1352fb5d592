// Calibration cases count the work they time: a causal self pair of n tokens, and the Zig-Zag
// case (every visible pair of a causal sequence of k × n tokens in k Zig-Zag blocks), whose
// pairs together must cover the sequence's causal triangle exactly once.
#include "fcp/kernels/calibration.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "fcp/core/error.h"

namespace fcp::kernels {
namespace {

double causalTriangleFlops(int64_t tokens, int heads, int dim) {
  return 4.0 * static_cast<double>(tokens * (tokens + 1) / 2) * heads * dim;
}

TEST(CalibrationTest, SelfPairCountsItsCausalTriangle) {
  CalibrationCase c;
  c.blockTokens = 64;
  c.headDim = 16;
  const CalibrationResult r = calibrate(c, 0);
  EXPECT_DOUBLE_EQ(r.usefulForwardFlops, causalTriangleFlops(64, c.numHeadsQ, c.headDim));
  EXPECT_GT(r.forwardGflops, 0);
  EXPECT_GT(r.backwardGflops, 0);
}

TEST(CalibrationTest, ZigzagPairsCoverTheSequenceOnce) {
  for (const int blocks : {1, 2, 4}) {
    CalibrationCase c;
    c.blockTokens = 64;
    c.headDim = 16;
    c.zigzagBlocks = blocks;
    const CalibrationResult r = calibrate(c, 0);
    EXPECT_DOUBLE_EQ(r.usefulForwardFlops, causalTriangleFlops(64 * blocks, c.numHeadsQ, c.headDim))
        << blocks << " blocks";
    // Zig-Zag blocks see each other both ways (block i's tail chunk follows block j's head
    // chunk for every i, j): all k^2 pairs, where k contiguous pieces would give k(k+1)/2.
    EXPECT_EQ(r.blockPairs, blocks * blocks) << blocks << " blocks";
    EXPECT_GT(r.forwardGflops, 0);
    EXPECT_GT(r.backwardGflops, 0);
  }
}

TEST(CalibrationTest, SustainedTimingTimesTheSameWork) {
  CalibrationCase c;
  c.blockTokens = 64;
  c.headDim = 16;
  c.zigzagBlocks = 2;
  const CalibrationResult best = calibrate(c, 0);
  c.sustained = true;
  const CalibrationResult sustained = calibrate(c, 0);
  EXPECT_DOUBLE_EQ(sustained.usefulForwardFlops, best.usefulForwardFlops);
  EXPECT_EQ(sustained.blockPairs, best.blockPairs);
  EXPECT_GT(sustained.forwardSeconds, 0);
  EXPECT_GT(sustained.backwardSeconds, 0);
  EXPECT_DOUBLE_EQ(sustained.forwardGflops,
                   sustained.usefulForwardFlops / sustained.forwardSeconds * 1e-9);
  EXPECT_GT(sustained.forwardGemmGflops, 0);
}

TEST(CalibrationTest, SustainedTimingIsTheMeanAfterAnUntimedWarmUp) {
  // A warm-up of 200 ms, then 2 ms calls: the mean of the three timed calls stays far below
  // the ~68 ms it would be with the warm-up counted.
  int calls = 0;
  const double mean = detail::meanSeconds(
      [&] { std::this_thread::sleep_for(std::chrono::milliseconds(calls++ == 0 ? 200 : 2)); }, 0);
  EXPECT_EQ(calls, 4);
  EXPECT_GE(mean, 0.002);
  EXPECT_LT(mean, 0.04);
  // And it keeps going until minSeconds of timed calls have passed.
  calls = 0;
  detail::meanSeconds(
      [&] {
        ++calls;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      },
      0.05);
  EXPECT_GE(calls, 1 + 3);
  EXPECT_LE(calls, 1 + 10);
}

TEST(CalibrationTest, ZigzagNeedsEvenBlocksAndACausalMask) {
  CalibrationCase c;
  c.zigzagBlocks = 4;
  c.blockTokens = 63;
  EXPECT_THROW(calibrate(c, 0), Error);
  c.blockTokens = 64;
  c.mask = MaskKind::kFull;
  EXPECT_THROW(calibrate(c, 0), Error);
}

}  // namespace
}  // namespace fcp::kernels
