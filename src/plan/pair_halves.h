#pragma once
// Private to the plan module: a batch's pairs as blockPairs makes them, before its two halves
// are joined.

#include <utility>
#include <vector>

#include "fcp/core/cost_model.h"
#include "fcp/plan/sharding.h"

namespace fcp::plan::detail {

/// blockPairs(blocks, costModel) is `first` followed by `second`: on large batches the Q blocks
/// are cut in two and each half's pairs made on its own thread. `first` has room reserved for
/// `second`, so joining them moves no pair of `first`. `costs`, when asked for, is
/// blockCosts(blocks.size(), blockPairs(blocks, costModel)), each half's summed on its thread.
struct PairHalves {
  std::vector<BlockPair> first, second;
  std::vector<double> costs;
};

/// Throws as blockPairs does.
PairHalves blockPairHalves(const std::vector<Block>& blocks, const CostModel& costModel,
                           bool withCosts);

/// blockPairs' pairs from its halves: `second` appended to `first`, in the room reserved for
/// it (nothing reallocates); `halves` is left without pairs.
inline std::vector<BlockPair> joinHalves(PairHalves& halves) {
  halves.first.insert(halves.first.end(), halves.second.begin(), halves.second.end());
  halves.second = {};
  return std::move(halves.first);
}

}  // namespace fcp::plan::detail
