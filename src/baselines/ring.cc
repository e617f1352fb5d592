#include "fcp/baselines/ring.h"

#include <numeric>

#include "ring_schedule.h"

namespace fcp::baselines {

namespace detail {

plan::Plan groupRingPlan(const char* strategy, const Batch& batch, const plan::PlanConfig& config,
                         const CostModel& costModel, const std::vector<std::vector<int32_t>>& groups,
                         const std::vector<std::vector<int32_t>>& sequencesOfGroup) {
  // Terms: a group of g workers; its sequence s of length L is cut into 2g chunks, chunk i
  // being [i·L/2g, (i+1)·L/2g); member i's block holds chunks i and 2g−1−i of each.
  std::vector<plan::Block> byWorker(static_cast<size_t>(config.numWorkers));
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto size = static_cast<int64_t>(groups[g].size());
    for (const int32_t s : sequencesOfGroup[g]) {
      const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
      const auto cut = [&](int64_t i) { return i * len / (2 * size); };
      for (int64_t m = 0; m < size; ++m) {
        auto& chunks = byWorker[static_cast<size_t>(groups[g][static_cast<size_t>(m)])].chunks;
        for (const int64_t i : {m, 2 * size - 1 - m}) {
          if (cut(i + 1) > cut(i)) chunks.push_back({s, cut(i), cut(i + 1)});
        }
      }
    }
  }
  std::vector<plan::Block> blocks;
  std::vector<int32_t> owner;
  for (size_t w = 0; w < byWorker.size(); ++w) {
    if (byWorker[w].chunks.empty()) continue;
    blocks.push_back(std::move(byWorker[w]));
    owner.push_back(static_cast<int32_t>(w));
  }
  plan::PlanConfig c = config;
  c.coalesce = 1;
  c.bufferDepth = 2;
  c.locality = false;
  plan::Plan p = startPlan(strategy, batch, c, costModel, std::move(blocks), std::move(owner));
  scheduleRings(p, groups);
  return p;
}

}  // namespace detail

plan::Plan ringPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel) {
  detail::checkBaselineConfig(batch, config);
  std::vector<int32_t> ring(static_cast<size_t>(config.numWorkers));
  std::iota(ring.begin(), ring.end(), 0);
  std::vector<int32_t> sequences(batch.sequenceLengths.size());
  std::iota(sequences.begin(), sequences.end(), 0);
  return detail::groupRingPlan("ring", batch, config, costModel, {ring}, {sequences});
}

}  // namespace fcp::baselines
