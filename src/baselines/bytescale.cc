#include <algorithm>
#include <numeric>

#include "fcp/baselines/baselines.h"
#include "ring_schedule.h"

namespace fcp::baselines {
namespace {

/// Sequence ids, longest first (ties: lower id first).
std::vector<int32_t> longestFirst(const Batch& batch) {
  std::vector<int32_t> order(batch.sequenceLengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return batch.sequenceLengths[static_cast<size_t>(a)] > batch.sequenceLengths[static_cast<size_t>(b)];
  });
  return order;
}

}  // namespace

plan::Plan bytescalePlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel) {
  // Terms: C = ceil(T / N), the average tokens per worker; a group's tokens and compute
  // (Σ L², proportional to causal work) are divided by its size when comparing groups.
  detail::checkBaselineConfig(batch, config);
  const int64_t n = config.numWorkers;
  const int64_t perWorker = (batch.numTokens() + n - 1) / n;
  std::vector<std::vector<int32_t>> groups, sequences;
  std::vector<double> tokens, compute;
  int32_t nextWorker = 0;
  std::vector<int32_t> shortOnes;
  for (const int32_t s : longestFirst(batch)) {
    const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
    const int64_t size = (len + perWorker - 1) / perWorker;
    if (size <= 1 || nextWorker + size > n) {
      shortOnes.push_back(s);
      continue;
    }
    std::vector<int32_t> members(static_cast<size_t>(size));
    std::iota(members.begin(), members.end(), nextWorker);
    nextWorker += static_cast<int32_t>(size);
    groups.push_back(std::move(members));
    sequences.push_back({s});
    tokens.push_back(static_cast<double>(len));
    compute.push_back(static_cast<double>(len) * static_cast<double>(len));
  }
  for (; nextWorker < n; ++nextWorker) {
    groups.push_back({nextWorker});
    sequences.emplace_back();
    tokens.push_back(0);
    compute.push_back(0);
  }
  const double room = static_cast<double>(perWorker) * (1 + config.memorySlack);
  for (const int32_t s : shortOnes) {
    const auto len = static_cast<double>(batch.sequenceLengths[static_cast<size_t>(s)]);
    size_t best = groups.size(), fallback = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto size = static_cast<double>(groups[g].size());
      if ((tokens[g] + len) / size <= room &&
          (best == groups.size() || compute[g] / size < compute[best] / static_cast<double>(groups[best].size()))) {
        best = g;
      }
      if (tokens[g] / size < tokens[fallback] / static_cast<double>(groups[fallback].size())) fallback = g;
    }
    if (best == groups.size()) best = fallback;
    sequences[best].push_back(s);
    tokens[best] += len;
    compute[best] += len * len;
  }
  return detail::groupRingPlan("bytescale", batch, config, costModel, groups, sequences);
}

plan::Plan megatronPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel) {
  // Terms: cap = tokensPerWorker; a sequence's CP size is a power of two; a group of size g
  // has room for g · cap tokens; its load is its tokens per worker.
  detail::checkBaselineConfig(batch, config);
  const int64_t n = config.numWorkers;
  const int64_t cap = config.tokensPerWorker;
  int64_t largest = 1;
  while (largest * 2 <= n) largest *= 2;
  std::vector<std::vector<int32_t>> groups, sequences;
  std::vector<int64_t> tokens;
  int32_t nextWorker = 0;
  const auto load = [&](size_t g) {
    return static_cast<double>(tokens[g]) / static_cast<double>(groups[g].size());
  };
  for (const int32_t s : longestFirst(batch)) {
    const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
    int64_t size = 1;
    while (size < largest && size * cap < len) size *= 2;
    size_t best = groups.size();
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto gs = static_cast<int64_t>(groups[g].size());
      if (gs == size && tokens[g] + len <= gs * cap && (best == groups.size() || load(g) < load(best))) best = g;
    }
    if (best == groups.size() && nextWorker + size <= n) {
      std::vector<int32_t> members(static_cast<size_t>(size));
      std::iota(members.begin(), members.end(), nextWorker);
      nextWorker += static_cast<int32_t>(size);
      groups.push_back(std::move(members));
      sequences.emplace_back();
      tokens.push_back(0);
      best = groups.size() - 1;
    }
    if (best == groups.size()) {
      for (size_t g = 0; g < groups.size(); ++g) {
        if (static_cast<int64_t>(groups[g].size()) >= size && (best == groups.size() || load(g) < load(best))) best = g;
      }
    }
    if (best == groups.size()) {  // only smaller groups remain: the least loaded of all
      best = 0;
      for (size_t g = 1; g < groups.size(); ++g) best = load(g) < load(best) ? g : best;
    }
    sequences[best].push_back(s);
    tokens[best] += len;
  }
  return detail::groupRingPlan("megatron", batch, config, costModel, groups, sequences);
}

}  // namespace fcp::baselines
