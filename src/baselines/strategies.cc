#include <algorithm>
#include <map>
#include <optional>

#include "fcp/baselines/baselines.h"
#include "fcp/core/config.h"
#include "fcp/core/error.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/limits.h"
#include "ring_schedule.h"

namespace fcp::baselines {

plan::Plan wlbPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel,
                   const PlanOracle& oracle) {
  if (!oracle) throwInvalidArgument("wlb needs an oracle to choose its sharding: none given");
  plan::Plan perDocument = ringPlan(batch, config, costModel);
  plan::Plan perSequence = bytescalePlan(batch, config, costModel);
  plan::Plan& best = oracle(perSequence) < oracle(perDocument) ? perSequence : perDocument;
  best.strategy = "wlb";
  return std::move(best);
}

plan::Plan fcpAblationPlan(const Batch& batch, const plan::PlanConfig& config,
                           const CostModel& costModel, int step) {
  if (step < 0 || step > 4) throwInvalidArgument("invalid ablation step ", step, ": expected 0..4");
  plan::PlanConfig c = config;
  c.locality = step >= 4;
  c.placement = plan::Placement::kLpt;  // the paper's method, step by step
  c.commRatio = 0;
  plan::Plan p = plan::buildPlan(batch, c, costModel);
  static const char* const kNames[] = {"fcp-base", "fcp-pipeline", "fcp-cfree", "fcp-coalesce", "fcp"};
  p.strategy = kNames[step];
  if (step >= 3) return p;
  if (step <= 1) {
    // Each sender's transfers in its own order (by receiver, then block), one per round.
    std::vector<std::tuple<int32_t, int32_t, int32_t, size_t>> order;  // (sender, receiver, block, id)
    for (size_t t = 0; t < p.transfers.size(); ++t) {
      const plan::Transfer& tr = p.transfers[t];
      order.push_back({tr.sender, tr.receiver, tr.block, t});
    }
    std::sort(order.begin(), order.end());
    int32_t round = 0, numRounds = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      round = i > 0 && std::get<0>(order[i - 1]) == std::get<0>(order[i]) ? round + 1 : 0;
      p.transfers[std::get<3>(order[i])].round = round;
      numRounds = std::max(numRounds, round + 1);
    }
    p.numRounds = numRounds;
    p.congestionFree = false;
  }
  // Base: every transfer in one group, computed after all arrived; otherwise one round a stage.
  p.config.coalesce = step == 0 ? std::max(1, p.numRounds) : 1;
  if (step == 0) p.config.bufferDepth = 2;
  plan::buildStages(p);
  if (step <= 1) detail::fitLimits(p);
  if (step <= 1) p.congestionFree = false;
  return p;
}

const std::vector<std::string>& headParallelNames() {
  static const std::vector<std::string> kNames = {"ulysses", "usp", "fcp+ulysses"};
  return kNames;
}

const std::vector<std::string>& strategyNames() {
  static const std::vector<std::string> kNames = {"fcp", "ring", "bytescale", "wlb", "magi", "megatron"};
  return kNames;
}

namespace {

/// The baselines hold their pairs like FCP does, so they are bounded by the same kMaxPairs
/// (fcp/plan/limits.h): ring, megatron, bytescale and wlb pair every two workers of a ring
/// group (groups partition the workers: at most N^2 pairs); magi pairs its kMagiChunkTokens-token chunks.
void checkBaselineSize(const std::string& name, const Batch& batch, const plan::PlanConfig& config) {
  if (name == "magi") {
    plan::checkPairCount(batch, kMagiChunkTokens);
    return;
  }
  if (name != "ring" && name != "megatron" && name != "bytescale" && name != "wlb") return;
  const int64_t n = config.numWorkers;
  if (n > 0 && n <= plan::kMaxPairs / n) return;
  int64_t fits = 1;
  while ((fits + 1) * (fits + 1) <= plan::kMaxPairs) ++fits;
  throwInvalidArgument(name, " on ", n, " workers pairs up to ", n, "^2 worker blocks: expected at most ",
                       fits, " workers (", plan::kMaxPairs, " pairs, as for every plan)");
}

}  // namespace

namespace {

/// Whether groups of `degree` consecutive workers each sit inside one node or are whole nodes.
bool groupsFitNodes(int64_t degree, int64_t workers, int64_t workersPerNode) {
  if (degree % workersPerNode == 0) return true;  // whole nodes (groups start at multiples)
  for (int64_t first = 0; first < workers; first += degree) {
    if (first / workersPerNode != (first + degree - 1) / workersPerNode) return false;
  }
  return true;
}

/// Whether `degree` workers can form head-parallel groups of `attention`'s heads over `workers`
/// workers with no group straddling a node part-way.
bool legalDegree(int64_t degree, int64_t workers, int64_t workersPerNode,
                 const AttentionConfig& attention) {
  return degree >= 1 && degree <= workers && workers % degree == 0 &&
         splitsHeads(attention, degree) && groupsFitNodes(degree, workers, workersPerNode);
}

/// The plan over groups of `degree` workers with one member's heads: FCP's or a Zig-Zag ring.
HeadParallelPlan groupPlan(bool fcp, const Batch& batch, const plan::PlanConfig& config,
                           const CostModel& costModel, int64_t degree) {
  plan::PlanConfig c = config;
  c.numWorkers = config.numWorkers / degree;
  c.tokensPerWorker = config.tokensPerWorker * degree;
  if (config.memoryLimitTokens > 0) c.memoryLimitTokens = config.memoryLimitTokens * degree;
  if (!config.userStarts.empty()) {
    // A group holds its members' tokens: every degree-th boundary of the user layout.
    c.userStarts.clear();
    for (size_t r = 0; r < config.userStarts.size(); r += static_cast<size_t>(degree)) {
      c.userStarts.push_back(config.userStarts[r]);
    }
  }
  c.attention = headShare(config.attention, degree);
  CostModel share = costModel;
  share.attention = c.attention;
  // FCP's planner over the groups, each a worker with the group's memory and one member's
  // heads, under its own limits; the ring under the baselines' size limit.
  if (fcp) return {plan::buildPlan(batch, c, share), degree};
  checkBaselineSize("ring", batch, c);
  return {ringPlan(batch, c, share), degree};
}

}  // namespace

void checkUlyssesDegree(const std::string& name, int64_t degree, int64_t workers,
                        int64_t workersPerNode, const AttentionConfig& attention) {
  if (workersPerNode >= 1 && legalDegree(degree, workers, workersPerNode, attention)) return;
  throwInvalidArgument(name, " with Ulysses degree ", degree, " on ", workers, " workers (",
                       workersPerNode, " per node) and ", attention.numHeadsQ, " query and ",
                       attention.numHeadsKv,
                       " key/value heads: expected a divisor of the workers that splits the heads, "
                       "its groups each inside a node or whole nodes");
}

HeadParallelPlan headParallelPlan(const std::string& name, const Batch& batch,
                                  const plan::PlanConfig& config, const CostModel& costModel,
                                  int64_t workersPerNode, const HeadParallelOracle& oracle,
                                  int64_t degree) {
  detail::checkBaselineConfig(batch, config);
  const AttentionConfig& attention = config.attention;
  const int64_t n = config.numWorkers;
  if (name != "ulysses" && name != "usp" && name != "fcp+ulysses") {
    throwInvalidArgument("unknown head-parallel strategy '", name,
                         "': expected ulysses, usp or fcp+ulysses");
  }
  if (degree != 0 && name != "ulysses") {
    checkUlyssesDegree(name, degree, n, workersPerNode, attention);
    return groupPlan(name == "fcp+ulysses", batch, config, costModel, degree);
  }
  if (name == "ulysses") {
    if (!splitsHeads(attention, n)) {
      throwInvalidArgument("ulysses on ", n, " workers with ", attention.numHeadsQ, " query and ",
                           attention.numHeadsKv,
                           " key/value heads: expected workers that divide the query heads and "
                           "divide or are a multiple of the key/value heads (or usp)");
    }
    return groupPlan(false, batch, config, costModel, n);
  }
  if (workersPerNode < 1) {
    throwInvalidArgument(name, " with ", workersPerNode, " workers per node: expected at least 1");
  }
  if (name == "usp" && oracle) {
    // USP's Ulysses degree is the user's to tune: the best of every legal one by the oracle,
    // the smallest degree on a tie.
    std::optional<HeadParallelPlan> best;
    double bestTime = 0;
    for (int64_t d = 1; d <= n; ++d) {
      // A ring past the baselines' size limit is no candidate.
      const int64_t ring = n / d;
      if (!legalDegree(d, n, workersPerNode, attention) || ring > plan::kMaxPairs / ring) continue;
      HeadParallelPlan candidate = groupPlan(false, batch, config, costModel, d);
      const double time = oracle(candidate);
      if (!best || time < bestTime) {
        best = std::move(candidate);
        bestTime = time;
      }
    }
    if (best) return std::move(*best);
    // Else no legal degree's ring fits: the node's degree below names the limit.
  }
  degree = 1;
  for (int64_t d = std::min(n, workersPerNode); d > 1; --d) {
    if (legalDegree(d, n, workersPerNode, attention)) {
      degree = d;
      break;
    }
  }
  return groupPlan(name == "fcp+ulysses", batch, config, costModel, degree);
}

plan::Plan makePlan(const std::string& name, const Batch& batch, const plan::PlanConfig& config,
                    const CostModel& costModel, const PlanOracle& oracle) {
  checkBaselineSize(name, batch, config);
  static const std::map<std::string, int> kAblation = {
      {"fcp-base", 0}, {"fcp-pipeline", 1}, {"fcp-cfree", 2}, {"fcp-coalesce", 3}};
  if (name == "fcp") return plan::buildPlan(batch, config, costModel);
  if (name == "ring") return ringPlan(batch, config, costModel);
  if (name == "bytescale") return bytescalePlan(batch, config, costModel);
  if (name == "megatron") return megatronPlan(batch, config, costModel);
  if (name == "magi") return magiPlan(batch, config, costModel);
  if (name == "wlb") return wlbPlan(batch, config, costModel, oracle);
  if (const auto it = kAblation.find(name); it != kAblation.end()) {
    return fcpAblationPlan(batch, config, costModel, it->second);
  }
  throwInvalidArgument("unknown strategy '", name,
                       "': expected fcp, ring, bytescale, wlb, magi, megatron (or fcp-base, "
                       "fcp-pipeline, fcp-cfree, fcp-coalesce)");
}

}  // namespace fcp::baselines
