// Calibration cases count the work they time: a causal self pair of n tokens, and the Zig-Zag
// case (every visible pair of a causal sequence of k × n tokens in k Zig-Zag blocks), whose
// pairs together must cover the sequence's causal triangle exactly once.
#include <gtest/gtest.h>

#include "fcp/core/error.h"
#include "fcp/kernels/calibration.h"

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
  EXPECT_DOUBLE_EQ(sustained.forwardGflops, sustained.usefulForwardFlops / sustained.forwardSeconds * 1e-9);
  EXPECT_GT(sustained.forwardGemmGflops, 0);
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
