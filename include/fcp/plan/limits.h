#pragma once
/// What the planner accepts, so that every plan it makes takes bounded time and memory.
///
/// A sequence of L tokens in blocks of B tokens makes k = ceil(L / B) blocks, and under a
/// causal (Zig-Zag) or full mask all k^2 of their pairs need computing: the pairs grow with
/// the square of the block count. The planner holds every pair (24 bytes each, with the
/// transfers and stages they imply), so it refuses batches whose pairs pass kMaxPairs.

#include <cstdint>
#include <string_view>

#include "fcp/core/config.h"
#include "fcp/core/error.h"
#include "fcp/core/workload.h"

namespace fcp::plan {

struct PlanConfig;

/// Most block pairs a plan may have: 2^25 (about 1.6 GB of pairs across the plan's two
/// candidate placements, and a few minutes of planning here).
inline constexpr int64_t kMaxPairs = int64_t{1} << 25;
/// Smallest block size the front ends accept (fcp's --block-size, the API's planConfig.blockSize):
/// below it the pairs of even a modest batch outgrow kMaxPairs, or take minutes to plan, long
/// before the blocks could run efficiently. The planner itself takes any size from 1, as it
/// cuts blocks finer where the memory cap needs it.
inline constexpr int64_t kMinBlockSize = 16;
/// Throws Error(kInvalidArgument) unless `blockSize` is kMinBlockSize to kMaxSequenceLength,
/// naming it as `name` ("--block-size", "block size") and the bound it broke. Inline, so that
/// the CLI's flag parsing (and its fuzzer, which links fcp::core only) needs no plan library.
inline void checkBlockSize(int64_t blockSize, std::string_view name) {
  if (blockSize >= kMinBlockSize && blockSize <= kMaxSequenceLength) return;
  throwInvalidArgument("invalid ", name, " ", blockSize, ": expected ", kMinBlockSize, " to ",
                       kMaxSequenceLength, " tokens",
                       blockSize < kMinBlockSize
                           ? " (smaller blocks make more pairs than any batch can use)"
                           : " (the longest sequence)");
}
/// Most improvement steps per block a plan may ask of the distributor.
inline constexpr int64_t kMaxImproveStepsPerBlock = 1024;
/// The range of the communication balance slack (negative: balancing off).
inline constexpr double kMinCommBalanceSlack = -1;
inline constexpr double kMaxCommBalanceSlack = 0.99;

/// An upper bound on the pairs sharding `batch` into blocks of `blockSize` makes: the sum of
/// ceil(L / blockSize)^2 over sequences of at least blockSize tokens, plus one per shorter
/// sequence (packed blocks). Saturates at a value above kMaxPairs.
int64_t estimatePairs(const Batch& batch, int64_t blockSize);

/// Throws Error(kInvalidArgument) when estimatePairs passes kMaxPairs, naming the longest
/// sequence, its block count and pairs, and the smallest block size that would fit.
void checkPairCount(const Batch& batch, int64_t blockSize);

/// checkPairCount for blocks the planner cut finer than `requestedBlockSize` to place them
/// under a memory cap of `capTokens` tokens a worker: a larger block size cannot help there,
/// so the refusal asks for a larger cap. The same as checkPairCount when blockSize is at least
/// requestedBlockSize.
void checkPairCountUnderCap(const Batch& batch, int64_t blockSize, int64_t requestedBlockSize,
                            int64_t capTokens);

}  // namespace fcp::plan
