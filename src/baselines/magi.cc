#include <algorithm>
#include <queue>

#include "fcp/baselines/baselines.h"
#include "fcp/plan/communication.h"
#include "ring_schedule.h"

namespace fcp::baselines {

plan::Plan magiPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel) {
  // Terms: a chunk is kMagiChunkTokens consecutive tokens of the packed stream (a block, possibly spanning
  // sequences); its area is the visible (query, key) entries of its queries; a worker's area
  // is the sum over the chunks it owns.
  detail::checkBaselineConfig(batch, config);
  const std::vector<int64_t> starts = plan::sequenceStarts(batch);
  std::vector<plan::Block> blocks;
  const int64_t total = batch.numTokens();
  size_t seq = 0;
  for (int64_t begin = 0; begin < total; begin += kMagiChunkTokens) {
    const int64_t end = std::min(total, begin + kMagiChunkTokens);
    plan::Block b;
    while (seq < batch.sequenceLengths.size() && starts[seq + 1] <= begin) ++seq;
    for (size_t s = seq; s < batch.sequenceLengths.size() && starts[s] < end; ++s) {
      const int64_t from = std::max(begin, starts[s]) - starts[s];
      const int64_t to = std::min(end, starts[s + 1]) - starts[s];
      b.chunks.push_back({static_cast<int32_t>(s), from, to});
    }
    blocks.push_back(std::move(b));
  }
  const std::vector<plan::BlockPair> pairs = plan::blockPairs(blocks, costModel);
  std::vector<int64_t> area(blocks.size(), 0);
  for (const plan::BlockPair& p : pairs) area[static_cast<size_t>(p.qBlock)] += p.visible;
  std::vector<int32_t> order(blocks.size());
  for (size_t b = 0; b < order.size(); ++b) order[b] = static_cast<int32_t>(b);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return area[static_cast<size_t>(a)] > area[static_cast<size_t>(b)];
  });
  using Entry = std::pair<int64_t, int32_t>;  // (area so far, worker): least first
  std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
  for (int64_t w = 0; w < config.numWorkers; ++w) heap.push({0, static_cast<int32_t>(w)});
  std::vector<int32_t> owner(blocks.size());
  for (const int32_t b : order) {
    auto [load, w] = heap.top();
    heap.pop();
    owner[static_cast<size_t>(b)] = w;
    heap.push({load + area[static_cast<size_t>(b)], w});
  }

  plan::PlanConfig c = config;
  c.coalesce = 1;  // one all-to-all-v per round; raised below to what a stage moves
  c.bufferDepth = 2;
  c.locality = false;
  c.blockSize = kMagiChunkTokens;
  plan::Plan p = detail::startPlan("magi", batch, c, costModel, std::move(blocks), std::move(owner));
  p.transfers = plan::buildTransfers(p);
  // Each receiver's needed blocks, in block order, split evenly over the stages.
  std::vector<int64_t> incoming(static_cast<size_t>(c.numWorkers), 0), seen(incoming.size(), 0);
  for (const plan::Transfer& t : p.transfers) ++incoming[static_cast<size_t>(t.receiver)];
  for (plan::Transfer& t : p.transfers) {
    const auto r = static_cast<size_t>(t.receiver);
    t.round = static_cast<int32_t>(seen[r]++ * kMagiStages / incoming[r]);
  }
  p.numRounds = p.transfers.empty() ? 0 : kMagiStages;
  plan::buildStages(p);
  detail::finishLayout(p);
  detail::fitLimits(p);
  p.congestionFree = false;
  return p;
}

}  // namespace fcp::baselines
