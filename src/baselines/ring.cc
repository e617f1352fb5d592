#include "fcp/baselines/ring.h"

#include <numeric>

#include "ring_schedule.h"

namespace fcp::baselines {

plan::Plan ringPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel) {
  // Terms: P ranks; sequence s of length L is cut into 2P chunks, chunk i being
  // [i·L/2P, (i+1)·L/2P); rank r's block holds chunks r and 2P−1−r of every sequence.
  detail::checkBaselineConfig(batch, config);
  const int64_t ranks = config.numWorkers;
  std::vector<plan::Block> byRank(static_cast<size_t>(ranks));
  for (size_t s = 0; s < batch.sequenceLengths.size(); ++s) {
    const int64_t len = batch.sequenceLengths[s];
    const auto cut = [&](int64_t i) { return i * len / (2 * ranks); };
    for (int64_t r = 0; r < ranks; ++r) {
      for (const int64_t i : {r, 2 * ranks - 1 - r}) {
        if (cut(i + 1) > cut(i)) {
          byRank[static_cast<size_t>(r)].chunks.push_back({static_cast<int32_t>(s), cut(i), cut(i + 1)});
        }
      }
    }
  }
  std::vector<plan::Block> blocks;
  std::vector<int32_t> owner;
  for (int64_t r = 0; r < ranks; ++r) {
    if (byRank[static_cast<size_t>(r)].chunks.empty()) continue;
    blocks.push_back(std::move(byRank[static_cast<size_t>(r)]));
    owner.push_back(static_cast<int32_t>(r));
  }
  plan::PlanConfig c = config;
  c.coalesce = 1;
  c.bufferDepth = 2;
  c.locality = false;
  plan::Plan p = detail::startPlan("ring", batch, c, costModel, std::move(blocks), std::move(owner));
  std::vector<int32_t> ring(static_cast<size_t>(ranks));
  std::iota(ring.begin(), ring.end(), 0);
  detail::scheduleRings(p, {ring});
  return p;
}

}  // namespace fcp::baselines
