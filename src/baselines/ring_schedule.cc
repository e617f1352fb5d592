#include "ring_schedule.h"

#include <algorithm>
#include <set>
#include <utility>

#include "fcp/core/error.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/distributor.h"

namespace fcp::baselines::detail {

using plan::Plan;
using plan::Stage;
using plan::StageIds;
using plan::Transfer;

void checkBaselineConfig(const Batch& batch, const plan::PlanConfig& config) {
  checkAttentionConfig(config.attention);
  checkBatch(batch);
  if (config.numWorkers <= 0) {
    throwInvalidArgument("invalid worker count ", config.numWorkers, ": expected > 0");
  }
  if (config.numWorkers > (int64_t{1} << 24)) {
    throwInvalidArgument("invalid worker count ", config.numWorkers, ": expected at most 2^24");
  }
  if (config.tokensPerWorker <= 0) {
    throwInvalidArgument("invalid tokens per worker ", config.tokensPerWorker, ": expected > 0");
  }
}

Plan startPlan(const char* strategy, const Batch& batch, const plan::PlanConfig& config,
               const CostModel& costModel, std::vector<plan::Block> blocks,
               std::vector<int32_t> owner) {
  if (config.attention.mask != costModel.attention.mask) {
    throw Error(ErrorCode::kInternal, "cost model mask differs from the plan's mask");
  }
  Plan p;
  p.strategy = strategy;
  p.config = config;
  p.batch = batch;
  p.blocks = std::move(blocks);
  p.owner = std::move(owner);
  p.pairs = plan::blockPairs(p.blocks, costModel);
  return p;
}

void finishLayout(Plan& p) {
  p.loads = plan::computeLoads(p);
  int64_t maxTokens = 0;
  for (const plan::WorkerLoad& l : p.loads) maxTokens = std::max(maxTokens, l.numTokens);
  if (maxTokens > plan::memoryCapTokens(plan::distributorOptions(p.config))) {
    p.config.memoryLimitTokens = maxTokens;
  }
  double total = 0, maxCost = 0;
  for (const plan::WorkerLoad& l : p.loads) total += l.cost;
  for (const plan::BlockPair& pair : p.pairs) maxCost = std::max(maxCost, pair.cost);
  p.lowerBound = std::max(maxCost, total / static_cast<double>(p.config.numWorkers));
  p.reshuffle = plan::buildReshuffle(p);
  p.movedTokensWithoutLocality = plan::movedTokens(p.reshuffle);
}

void fitLimits(Plan& p) {
  // Most blocks moved one way by one worker in one stage, and most remote blocks held.
  size_t most = 1;
  int64_t mostHeld = 0;
  for (const auto* pass : {&p.forward, &p.backward}) {
    for (const auto& stages : *pass) {
      int64_t held = 0;
      for (const Stage& s : stages) {
        most = std::max({most, s.send.size(), s.recv.size(), s.sendGrad.size(), s.recvGrad.size()});
        held += static_cast<int64_t>(s.recv.size());
        mostHeld = std::max(mostHeld, held);
        held -= static_cast<int64_t>(s.release.size());
      }
    }
  }
  p.config.coalesce = static_cast<int64_t>(most);
  p.config.bufferDepth = std::max<int64_t>(
      p.config.bufferDepth, (mostHeld + p.config.coalesce - 1) / p.config.coalesce);
  p.config.bufferDepth = std::max<int64_t>(p.config.bufferDepth, 2);

  // Congestion-free: each round a matching and exactly Δ rounds.
  std::vector<int64_t> degree(static_cast<size_t>(2 * p.config.numWorkers), 0);
  std::set<std::pair<int32_t, int32_t>> sent, received;  // (round, worker)
  bool matching = true;
  for (const Transfer& t : p.transfers) {
    ++degree[static_cast<size_t>(t.sender)];
    ++degree[static_cast<size_t>(p.config.numWorkers + t.receiver)];
    matching = sent.insert({t.round, t.sender}).second && matching;
    matching = received.insert({t.round, t.receiver}).second && matching;
  }
  const int64_t delta = *std::max_element(degree.begin(), degree.end());
  p.congestionFree = matching && delta == p.numRounds;
}

namespace {

/// Each transfer's pairs (those whose KV it brings), and each worker's local pairs.
struct PairsByTransfer {
  std::vector<std::vector<int32_t>> byTransfer;
  std::vector<std::vector<int32_t>> local;
};

PairsByTransfer groupPairs(const Plan& p) {
  PairsByTransfer g;
  g.byTransfer.resize(p.transfers.size());
  g.local.resize(static_cast<size_t>(p.config.numWorkers));
  for (size_t i = 0; i < p.pairs.size(); ++i) {
    const plan::BlockPair& pair = p.pairs[i];
    const int32_t w = p.owner[static_cast<size_t>(pair.qBlock)];
    const auto id = static_cast<int32_t>(i);
    if (p.owner[static_cast<size_t>(pair.kvBlock)] == w) {
      g.local[static_cast<size_t>(w)].push_back(id);
    } else {
      const int32_t t = plan::findTransfer(p.transfers, pair.kvBlock, w);
      FCP_CHECK(t >= 0, "no transfer of block ", pair.kvBlock, " to worker ", w);
      g.byTransfer[static_cast<size_t>(t)].push_back(id);
    }
  }
  return g;
}

StageIds& stageAt(std::vector<StageIds>& stages, int64_t s) {
  if (static_cast<int64_t>(stages.size()) <= s) stages.resize(static_cast<size_t>(s) + 1);
  return stages[static_cast<size_t>(s)];
}

}  // namespace

void scheduleRings(Plan& p, const std::vector<std::vector<int32_t>>& rings) {
  // Terms: a block's *chain* is its transfers ordered by the receiver's ring distance d from
  // the owner (1..size−1); each transfer's sender is the previous link (or the owner), its
  // round d−1. `next[t]` is the link after t (the transfer t's receiver relays), or −1.
  const auto n = static_cast<size_t>(p.config.numWorkers);
  std::vector<int32_t> ringOf(n, -1), position(n, -1);
  for (size_t r = 0; r < rings.size(); ++r) {
    for (size_t i = 0; i < rings[r].size(); ++i) {
      ringOf[static_cast<size_t>(rings[r][i])] = static_cast<int32_t>(r);
      position[static_cast<size_t>(rings[r][i])] = static_cast<int32_t>(i);
    }
  }
  p.transfers = plan::buildTransfers(p);
  std::vector<int32_t> next(p.transfers.size(), -1);
  int32_t numRounds = 0;
  for (size_t first = 0; first < p.transfers.size();) {
    const int32_t block = p.transfers[first].block;
    const int32_t owner = p.owner[static_cast<size_t>(block)];
    const int32_t ring = ringOf[static_cast<size_t>(owner)];
    FCP_CHECK(ring >= 0, "owner ", owner, " of block ", block, " is in no ring");
    const auto size = static_cast<int32_t>(rings[static_cast<size_t>(ring)].size());
    std::vector<std::pair<int32_t, int32_t>> chain;  // (distance, transfer)
    size_t last = first;
    for (; last < p.transfers.size() && p.transfers[last].block == block; ++last) {
      const int32_t receiver = p.transfers[last].receiver;
      FCP_CHECK(ringOf[static_cast<size_t>(receiver)] == ring, "worker ", receiver,
                " needs block ", block, " from outside its ring");
      const int32_t d = (position[static_cast<size_t>(receiver)] -
                         position[static_cast<size_t>(owner)] + size) % size;
      chain.push_back({d, static_cast<int32_t>(last)});
    }
    std::sort(chain.begin(), chain.end());
    int32_t sender = owner, previous = -1;
    for (const auto& [d, t] : chain) {
      Transfer& tr = p.transfers[static_cast<size_t>(t)];
      tr.sender = sender;
      tr.round = d - 1;
      numRounds = std::max(numRounds, d);
      if (previous >= 0) next[static_cast<size_t>(previous)] = t;
      sender = tr.receiver;
      previous = t;
    }
    first = last;
  }
  p.numRounds = numRounds;

  // Forward: transfer t moves in stage round(t), is used in round(t) + 1 and freed once it
  // has also been relayed.
  const PairsByTransfer need = groupPairs(p);
  std::vector<std::vector<StageIds>> forward(
      n, std::vector<StageIds>(static_cast<size_t>(numRounds) + 1));
  for (size_t w = 0; w < n; ++w) forward[w][0].compute = need.local[w];
  for (size_t t = 0; t < p.transfers.size(); ++t) {
    const Transfer& tr = p.transfers[t];
    const auto id = static_cast<int32_t>(t);
    auto& mine = forward[static_cast<size_t>(tr.receiver)];
    forward[static_cast<size_t>(tr.sender)][static_cast<size_t>(tr.round)].send.push_back(id);
    mine[static_cast<size_t>(tr.round)].recv.push_back(id);
    auto& use = mine[static_cast<size_t>(tr.round) + 1].compute;
    use.insert(use.end(), need.byTransfer[t].begin(), need.byTransfer[t].end());
    const int32_t relay = next[t];
    const int32_t freeAt = std::max(tr.round + 1, relay >= 0 ? p.transfers[static_cast<size_t>(relay)].round : 0);
    mine[static_cast<size_t>(freeAt)].release.push_back(id);
  }
  for (auto& stages : forward) {
    for (StageIds& s : stages) std::sort(s.compute.begin(), s.compute.end());
  }

  // Backward: partials unwind the chain from its end.
  std::vector<int64_t> gradAt(p.transfers.size(), -1);
  for (size_t t = p.transfers.size(); t-- > 0;) {
    // A chain's links increase in distance, and transfers are sorted by (block, receiver),
    // not by distance, so resolve each chain from its end recursively.
    std::vector<int32_t> path;
    for (auto u = static_cast<int32_t>(t); u >= 0 && gradAt[static_cast<size_t>(u)] < 0;
         u = next[static_cast<size_t>(u)]) {
      path.push_back(u);
    }
    for (size_t i = path.size(); i-- > 0;) {
      const auto u = static_cast<size_t>(path[i]);
      const int32_t after = next[u];
      gradAt[u] = std::max<int64_t>(p.transfers[u].round + 2,
                                    after >= 0 ? gradAt[static_cast<size_t>(after)] + 1 : 0);
    }
  }
  std::vector<std::vector<StageIds>> backward = forward;
  for (size_t t = 0; t < p.transfers.size(); ++t) {
    const Transfer& tr = p.transfers[t];
    const auto id = static_cast<int32_t>(t);
    stageAt(backward[static_cast<size_t>(tr.receiver)], gradAt[t]).sendGrad.push_back(id);
    stageAt(backward[static_cast<size_t>(tr.sender)], gradAt[t]).recvGrad.push_back(id);
  }
  size_t stages = 0;
  for (const auto& s : backward) stages = std::max(stages, s.size());
  for (auto& s : backward) s.resize(stages);

  p.forward = plan::Stages(forward);
  p.backward = plan::Stages(backward);
  finishLayout(p);
  fitLimits(p);
}

}  // namespace fcp::baselines::detail
