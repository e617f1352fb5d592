#include "fcp/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <tuple>

#include "comm_balance.h"
#include "communication.h"
#include "fcp/core/error.h"
#include "fcp/core/statistics.h"
#include "fcp/plan/coloring.h"
#include "fcp/plan/limits.h"
#include "pair_halves.h"
#include "parallel.h"
#include "violations.h"

// Every rank must compute the same plan, so the arithmetic that decides one follows IEEE-754
// exactly: a build that lets the compiler reassociate, take reciprocals or assume finite
// values (-ffast-math, -Ofast and their parts) could plan differently from another build.
#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__) || \
    (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error \
    "FCP's planner must be built without -ffast-math or its parts (plans would differ between builds)"
#endif

namespace fcp::plan {
namespace {

using detail::Violations;

double msSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

/// The user worker holding most of each block's tokens (ties: the lower id).
std::vector<int32_t> homeWorkers(const Batch& batch, const std::vector<Block>& blocks,
                                 const std::vector<int64_t>& user) {
  const std::vector<int64_t> seq = sequenceStarts(batch);
  std::vector<int32_t> home;
  home.reserve(blocks.size());
  std::vector<std::pair<int32_t, int64_t>> held;  // (worker, tokens)
  for (const Block& b : blocks) {
    held.clear();
    detail::forEachUserRun(b, seq, user, [&held](int32_t w, int64_t begin, int64_t stop) {
      held.push_back({w, stop - begin});
    });
    std::sort(held.begin(), held.end());
    int32_t best = -1;
    int64_t bestTokens = -1;
    for (size_t i = 0; i < held.size();) {
      int64_t tokens = 0;
      size_t j = i;
      for (; j < held.size() && held[j].first == held[i].first; ++j) tokens += held[j].second;
      if (tokens > bestTokens) {
        best = held[i].first;
        bestTokens = tokens;
      }
      i = j;
    }
    home.push_back(best);
  }
  return home;
}

/// The busiest worker's cost, from Plan::loads.
double maxCost(const Plan& plan) {
  double busiest = 0;
  for (const WorkerLoad& l : plan.loads) busiest = std::max(busiest, l.cost);
  return busiest;
}

/// The paper's first pairs, made in two halves beside each other (detail::PairHalves) and
/// joined by whichever thread comes for them first: the local placement's side joins them
/// before its own work while the paper's side assigns its blocks, which needs only their costs
/// (the join, a fresh 7 MB at 4096 workers, cost the paper's side 1 ms and up to 14 when the
/// kernel found no memory at hand). The paper's side takes them before it sums its workers'
/// loads: it waits for a join under way, or joins them itself if none has begun (the local
/// side may not have started), so neither side ever waits for work the other has not begun.
class PendingPairs {
 public:
  explicit PendingPairs(detail::PairHalves halves) : halves_(std::move(halves)) {
    // joinHalves appends without reallocating: blockPairHalves reserves the pairs' bound,
    // which checkPairCount keeps under kMaxPairs before the pairs are made.
    FCP_CHECK(halves_.first.capacity() - halves_.first.size() >= halves_.second.size(),
              "no room reserved to join ", halves_.second.size(), " pairs to ",
              halves_.first.size());
  }

  /// Joins the halves unless a thread has claimed that already.
  void join() {
    if (claimed_.exchange(true)) return;
    joinHalves();
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      joined_ = true;
    }
    done_.notify_all();
  }

  /// The pairs, joined here or by the thread that claimed them (waited for); once.
  std::vector<BlockPair> take() {
    if (!claimed_.exchange(true)) {
      joinHalves();
    } else {
      detail::whileLent([&] {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return joined_; });
      });
    }
    return std::move(pairs_);
  }

 private:
  // Room for the second half is reserved in the first (checked above): nothing reallocates,
  // so nothing here can throw.
  void joinHalves() noexcept { pairs_ = detail::joinHalves(halves_); }

  detail::PairHalves halves_;
  std::vector<BlockPair> pairs_;
  std::atomic<bool> claimed_{false};
  std::mutex mutex_;
  std::condition_variable done_;
  bool joined_ = false;
};

/// A plan through the distributor (blocks, pairs, owners, loads), before its transfers.
struct Placed {
  Plan plan;
  std::vector<double> costs;
  double shardMs = 0, assignMs = 0, balanceMs = 0;
  /// Whether plan.transfers are built for the current owners (relabelForLocality renames
  /// them, or `receivers`, with the owners), and whether plan.reshuffle is too (hasTraffic:
  /// both are).
  bool hasTransfers = false;
  bool hasTraffic = false;
  /// Whether the transfers' rounds and the stages are built too, and then the forward span
  /// they give (spanOf).
  bool hasStages = false;
  /// Whether `span` is the forward span of the current owners, with or without the stages
  /// (forwardSpanOf: the rounds are built then, the stages not).
  bool hasSpan = false;
  double span = 0;
  /// Each block's receivers for the current owners, kept where the transfers are not built yet
  /// (communication balancing found them even): the locality relabelling renames these rather
  /// than the transfers, and ensureTransfers builds the transfers from them.
  std::optional<detail::BlockReceivers> receivers;
  /// Where plan.pairs are still being joined (buildPlan's paper's first placement), else null:
  /// they are taken before anything reads them (placeLpt).
  PendingPairs* pendingPairs = nullptr;
};

/// Builds p.plan.transfers for the current owners if they are not built yet.
void ensureTransfers(Placed& p) {
  if (p.hasTransfers) return;
  p.plan.transfers = p.receivers ? detail::transfersOf(p.plan, *p.receivers)
                                 : buildTransfers(p.plan);
  p.receivers.reset();
  p.hasTransfers = true;
}

/// How a placement cuts the batch: one block size, and optionally a smaller one per sequence
/// (see shardBatch).
struct Sharding {
  int64_t blockSize = 0;
  std::vector<int64_t> sequenceSizes;
  /// The most tokens a block of packed short sequences holds (0: blockSize; see shardBatch).
  int64_t packSize = 0;
  /// A cost-aware candidate is kept only if its busiest worker costs less than this (and, for
  /// the paper's placement, it spans no longer: refineCosts); blocks whose memory-aware bound
  /// is not below it are not assigned at all (the placement returns nullopt, as for blocks the
  /// cap refuses).
  double mustBeat = std::numeric_limits<double>::infinity();
  /// The paper's blocks, pairs and costs for this sharding, made already (moved from; the pairs
  /// possibly still pending: Placed::pendingPairs), or null.
  Placed* made = nullptr;
};

/// `blocks` with their costs, and their pairs: joined, or (`pending` not null) left in two
/// halves in *pending for a PendingPairs.
Placed placeWith(const Batch& batch, const PlanConfig& config, const CostModel& costModel,
                 std::vector<Block> blocks, std::optional<detail::PairHalves>* pending = nullptr) {
  Placed p;
  p.plan.config = config;
  p.plan.batch = batch;
  p.plan.blocks = std::move(blocks);
  detail::PairHalves halves = detail::blockPairHalves(p.plan.blocks, costModel, true);
  p.costs = std::move(halves.costs);
  if (pending) {
    *pending = std::move(halves);
  } else {
    p.plan.pairs = detail::joinHalves(halves);
  }
  return p;
}

void takeAssignment(Placed& p, Assignment a) {
  p.plan.owner = std::move(a.owner);
  p.plan.lowerBound = a.lowerBound;
  p.plan.greedyMaxCost = a.greedyMaxCost;
  p.plan.improveSteps = a.improveSteps;
  p.plan.localityMoves = a.localityMoves;
}

std::vector<int64_t> blockTokens(const std::vector<Block>& blocks) {
  std::vector<int64_t> tokens;
  tokens.reserve(blocks.size());
  for (const Block& b : blocks) tokens.push_back(b.numTokens());
  return tokens;
}

/// Whether blocks of `tokens` and `costs` cannot beat `mustBeat` under any assignment: their
/// memory-aware bound is at or above it (with a margin far above rounding).
bool cannotBeat(const std::vector<int64_t>& tokens, const std::vector<double>& costs,
                const DistributorOptions& options, double mustBeat) {
  if (!(mustBeat < std::numeric_limits<double>::infinity())) return false;
  const double bound =
      memoryAwareLowerBound(tokens, costs, options.numWorkers, memoryCapTokens(options));
  return bound >= mustBeat * (1 + 1e-12);
}

/// cannotBeat's test before the pairs are made, from the blocks' costs by their chunks
/// (blockCostsFromChunks): whether the costliest block, or the mean per worker, is at or above
/// `mustBeat`, with a margin far above the rounding between the two ways of summing the costs,
/// so blocks it refuses are blocks cannotBeat refuses once the pairs are made. The pairs are
/// most of a cutting's planning time (tens of milliseconds at 4096 workers).
bool cannotBeatByChunks(const std::vector<Block>& blocks, const Batch& batch,
                        const CostModel& costModel, const DistributorOptions& options,
                        double mustBeat) {
  if (!(mustBeat < std::numeric_limits<double>::infinity())) return false;
  double costliest = 0, total = 0;
  for (const double c : blockCostsFromChunks(blocks, batch.sequenceLengths, costModel)) {
    costliest = std::max(costliest, c);
    total += c;
  }
  const double bound = std::max(costliest, total / static_cast<double>(options.numWorkers));
  return bound >= mustBeat * (1 + 1e-9);
}

/// Whether the local placement's cutting `sharding` of `batch` along `user` cannot beat
/// sharding.mustBeat by the costliest own block of one of the batch's kLongestChecked longest
/// sequences (costliestLayoutBlock), before the batch is cut. cannotBeatByChunks would find
/// that block, at the same cost, once the batch is cut, and refuse the cutting on the same
/// test: so this refuses no cutting that one keeps, and costs microseconds where cutting the
/// batch costs milliseconds (at 4096 workers, the local placement's refused cuttings 22 ->
/// ~1 ms; its costliest blocks end its longest sequences).
constexpr size_t kLongestChecked = 4;

bool layoutCannotBeat(const Batch& batch, const std::vector<int64_t>& user,
                      const CostModel& costModel, const Sharding& sharding) {
  if (!(sharding.mustBeat < std::numeric_limits<double>::infinity())) return false;
  std::vector<int32_t> order(batch.sequenceLengths.size());
  std::iota(order.begin(), order.end(), 0);
  const auto longest = order.begin() +
                       static_cast<std::ptrdiff_t>(std::min(kLongestChecked, order.size()));
  std::partial_sort(order.begin(), longest, order.end(), [&](int32_t a, int32_t b) {
    const int64_t la = batch.sequenceLengths[static_cast<size_t>(a)];
    const int64_t lb = batch.sequenceLengths[static_cast<size_t>(b)];
    return la != lb ? la > lb : a < b;
  });
  return std::any_of(order.begin(), longest, [&](int32_t s) {
    return costliestLayoutBlock(batch, s, sharding.blockSize, user, sharding.sequenceSizes,
                                costModel) >= sharding.mustBeat * (1 + 1e-9);
  });
}

/// The paper's blocks (Zig-Zag) for `sharding`, with their pairs and costs; nullopt when the
/// blocks cannot beat sharding.mustBeat (cannotBeatByChunks).
std::optional<Placed> shardLpt(const Batch& batch, const PlanConfig& config,
                               const CostModel& costModel, const DistributorOptions& options,
                               const Sharding& sharding,
                               std::optional<detail::PairHalves>* pending = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Block> blocks = shardBatch(batch, sharding.blockSize, config.attention.mask,
                                         sharding.sequenceSizes, sharding.packSize);
  if (cannotBeatByChunks(blocks, batch, costModel, options, sharding.mustBeat))
    return std::nullopt;
  Placed p = placeWith(batch, config, costModel, std::move(blocks), pending);
  p.shardMs = msSince(start);
  return p;
}

/// The paper's placement, up to its assignment: Zig-Zag blocks, the LPT greedy and its
/// improvement (finishLpt adds the rest). Nullopt when the memory cap cannot place the blocks.
std::optional<Placed> placeLpt(const Batch& batch, const PlanConfig& config,
                               const CostModel& costModel, const DistributorOptions& options,
                               const Sharding& sharding) {
  std::optional<Placed> made;
  if (sharding.made) {
    made = std::move(*sharding.made);
  } else {
    made = shardLpt(batch, config, costModel, options, sharding);
    if (!made) return std::nullopt;
  }
  Placed& p = *made;
  const std::vector<int64_t> tokens = blockTokens(p.plan.blocks);
  if (cannotBeat(tokens, p.costs, options, sharding.mustBeat)) return std::nullopt;
  const auto start = std::chrono::steady_clock::now();
  std::optional<Assignment> a = tryAssignBlocks(tokens, p.costs, options);
  if (!a) return std::nullopt;
  takeAssignment(p, std::move(*a));
  p.plan.placement = Placement::kLpt;
  if (p.pendingPairs) p.plan.pairs = std::exchange(p.pendingPairs, nullptr)->take();
  p.plan.loads = computeLoads(p.plan);
  p.assignMs = msSince(start);
  return made;
}

/// Bytes of KV transfers each worker sends plus receives (the load PlanStats::commImbalance
/// measures).
std::vector<int64_t> transferBytesByWorker(const Plan& plan) {
  std::vector<int64_t> moved(static_cast<size_t>(plan.config.numWorkers), 0);
  for (const Transfer& t : plan.transfers) {
    moved[static_cast<size_t>(t.sender)] += t.bytes;
    moved[static_cast<size_t>(t.receiver)] += t.bytes;
  }
  return moved;
}

/// Whether the placement's communication is even already: the balancer would stop before its
/// first swap (the same test on the same integers), and setting up its state costs more than
/// the transfers. Then no balancing steps are recorded and, where the transfers are not built,
/// the receivers the test found are kept for them (ensureTransfers, after the locality
/// relabelling).
bool commEven(Placed& p) {
  Plan& plan = p.plan;
  if (p.hasTransfers) {
    if (imbalance(transferBytesByWorker(plan)) > detail::kCommTargetImbalance) return false;
  } else {
    detail::BlockReceivers receivers = detail::blockReceivers(plan);
    if (imbalance(detail::bytesByWorker(plan, receivers)) > detail::kCommTargetImbalance)
      return false;
    p.receivers = std::move(receivers);
  }
  plan.commBalanceSteps = 0;
  return true;
}

/// balanceComm's swaps, for a placement whose communication is not even (commEven).
void balanceUneven(Placed& p, const PlanConfig& config, const DistributorOptions& options,
                   int64_t stepsPerWorker, double limit = std::numeric_limits<double>::infinity()) {
  Plan& plan = p.plan;
  const double cap = std::max(
      maxCost(plan), std::min(limit, plan.lowerBound * (1.0 + config.commBalanceSlack)));
  plan.commBalanceSteps = detail::balanceCommunication(
      plan, p.costs, cap, memoryCapTokens(options), stepsPerWorker * config.numWorkers);
  plan.loads = computeLoads(plan);
  // Swaps change owners: transfers and reshuffle built for the placements' comparison are stale.
  if (plan.commBalanceSteps > 0) {
    p.hasTransfers = p.hasTraffic = p.hasStages = p.hasSpan = false;
    p.receivers.reset();
  }
}

/// Communication balancing (off when commBalanceSlack < 0): compute may rise to the slack
/// above LB (but not past `limit`), or stay at the busiest worker's cost where that is higher.
/// At most `stepsPerWorker` swaps per worker; the balancer also stops once it finds no swap
/// that helps, or past its work limit (detail::balanceWorkBudget).
void balanceComm(Placed& p, const PlanConfig& config, const DistributorOptions& options,
                 int64_t stepsPerWorker, double limit = std::numeric_limits<double>::infinity()) {
  if (config.commBalanceSlack < 0 || commEven(p)) return;
  balanceUneven(p, config, options, stepsPerWorker, limit);
}

/// The rest of the paper's placement: communication balancing and the locality relabelling.
void finishLpt(Placed& p, const PlanConfig& config, const DistributorOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  // The rounds and span made to compare cuttings (refineCosts, which builds no stages) are
  // for the owners before balancing and relabelling: the rounds are made again after (buildPlan
  // colours whatever has no stages).
  FCP_CHECK(!p.hasStages, "the paper's placement was staged before it was finished");
  p.hasSpan = false;
  Plan& plan = p.plan;
  // Usually the communication is even already and balancing moves nothing: then relabelling
  // first and finding the receivers after gives the plan and receivers of balancing first and
  // relabelling the receivers after (a renaming changes neither the bytes' imbalance, summed
  // in integers, nor which workers receive a block), without sorting every block's receivers
  // again (2-5 ms at 4096 workers). When balancing has work, the renaming is undone and the
  // steps run in their order.
  if (config.locality && config.commBalanceSlack >= 0 && !p.hasTransfers && !p.receivers &&
      plan.transfers.empty() && plan.reshuffle.empty()) {
    std::vector<int32_t> renamed;
    const int64_t moved = detail::relabelForLocality(plan, nullptr, &renamed);
    if (commEven(p)) {
      plan.movedTokensWithoutLocality = moved;
      p.balanceMs += msSince(start);
      return;
    }
    std::vector<int32_t> back(renamed.size());  // the renaming undone
    for (size_t f = 0; f < renamed.size(); ++f)
      back[static_cast<size_t>(renamed[f])] = static_cast<int32_t>(f);
    detail::renameWorkers(plan, back);
    balanceUneven(p, config, options, 2);  // commEven's answer holds under a renaming
  } else {
    balanceComm(p, config, options, 2);
  }
  if (config.locality) {
    plan.movedTokensWithoutLocality =
        detail::relabelForLocality(plan, p.receivers ? &*p.receivers : nullptr);
  }
  // The loads are current: the placement's or the balancing's, moved with their workers.
  p.balanceMs += msSince(start);
}

/// The local placement's communication balancing, for the winner only. Blocks cut along the
/// user layout concentrate traffic: the owner of a long sequence's first blocks sends each to
/// every later holder (code-corpus seed 6 on 64 workers: one worker moved 4x the mean bytes).
/// Its blocks vary widely in cost (a causal sequence's early chunks are cheap), so it needs
/// more swaps than the LPT plan: up to kLocalStepsPerWorker per worker.
constexpr int64_t kLocalStepsPerWorker = 32;

/// The locality-first placement: blocks cut along the user layout, each starting at home.
std::optional<Placed> placeLocal(const Batch& batch, const PlanConfig& config,
                                 const CostModel& costModel, const DistributorOptions& options,
                                 const Sharding& sharding) {
  FCP_CHECK(sharding.made == nullptr, "the local placement was given the paper's blocks");
  const std::vector<int64_t> user = userLayout(config, batch.numTokens());
  auto start = std::chrono::steady_clock::now();
  if (layoutCannotBeat(batch, user, costModel, sharding)) return std::nullopt;
  std::vector<Block> blocks =
      shardBatchForLayout(batch, sharding.blockSize, user, sharding.sequenceSizes);
  if (cannotBeatByChunks(blocks, batch, costModel, options, sharding.mustBeat))
    return std::nullopt;
  Placed p = placeWith(batch, config, costModel, std::move(blocks));
  p.shardMs = msSince(start);
  const std::vector<int64_t> tokens = blockTokens(p.plan.blocks);
  if (cannotBeat(tokens, p.costs, options, sharding.mustBeat)) return std::nullopt;
  start = std::chrono::steady_clock::now();
  std::optional<Assignment> a = tryAssignBlocksNearHome(
      tokens, p.costs, homeWorkers(batch, p.plan.blocks, user), options);
  if (!a) return std::nullopt;
  takeAssignment(p, std::move(*a));
  p.plan.placement = Placement::kLocal;
  p.plan.loads = computeLoads(p.plan);
  p.assignMs = msSince(start);
  return p;
}

/// The communication imbalance a winning local placement may have, if the paper's has less.
constexpr double kLocalCommImbalance = 0.05;

/// The most the local placement's busiest worker may cost and still be chosen (buildPlan,
/// when commRatio is 0): it must be within max(maxCost, LB x slack) of the finished paper's
/// placement, whose cost-aware cuttings only lower its busiest worker below `base`'s (and its
/// bound is at most that), and whose communication balancing raises it at most to
/// LB x (1 + commBalanceSlack). Infinite when the choice weighs bytes too (takeFastest).
double localWinLimit(const Placed& base, const PlanConfig& config) {
  if (config.commRatio > 0) return std::numeric_limits<double>::infinity();
  const double m = maxCost(base.plan);
  const double slack = 1.0 + std::max(config.improveTarget, config.localitySlack);
  return std::max({m, m * slack, m * (1.0 + config.commBalanceSlack)});
}

/// localWinLimit, passed from the paper's placement to the local one beside it: the local
/// placement assigns no finer cutting that cannot win (at 4096 workers a batch whose local
/// cutting has blocks of 1.9 shares tried four cuttings, 550 ms, none of which could). A value
/// of the inputs, never of the timing: the local side waits for it, so the plan is the same on
/// one thread or two. The paper's side offers infinity as it ends, so an error there never
/// leaves the local side waiting.
class LocalWinLimit {
 public:
  /// Sets the limit unless it is set already; wakes the waiting side.
  void offer(double limit) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (value_) return;
      value_ = limit;
    }
    set_.notify_all();
  }
  /// The limit, once offered.
  double get() const {
    return detail::whileLent([&] {
      std::unique_lock<std::mutex> lock(mutex_);
      set_.wait(lock, [&] { return value_.has_value(); });
      return *value_;
    });
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable set_;
  std::optional<double> value_;
};

/// Cost-aware blocks. A block is giant when it costs more than kCostCutShare of a worker's
/// share (total cost / workers). Finer cuttings are tried in turn against the best so far
/// (at first the base cutting: smaller blocks run less efficiently); one replaces it when its
/// busiest worker costs less and, for the paper's placement, its forward pass spans no longer
/// (refineCosts), so the order below matters:
/// - "by share": each giant block's sequence is cut so that its blocks cost about
///   kCostCutShare of a share (a block's cost is about linear in its size);
/// - "even count": the sequences with blocks over kEvenCountShare of a share get more blocks,
///   scaled alike, until their count is a multiple of the workers, so each worker can hold
///   the same number (89 blocks of a dominant sequence on 64 workers leave 25 workers with
///   two; 128 leave none); and again for the sequences with blocks over kEvenCountBigShare
///   alone, as the count over kEvenCountShare can be a multiple already while the costliest
///   blocks are not (code corpus, 64 workers, seed 6: 93 blocks of a 377K-token sequence at
///   0.55 of a share among 192 over 0.05; the busiest worker held two of them, 11.5 % above
///   LB);
/// - "halved": every block at half the size, for batches whose blocks are too large for the
///   memory cap to leave room for balance (two 4K blocks per worker of 8K).
/// They run only when the busiest worker ends more than kCostCutMinGap above where the
/// distributor stops (its improvement target, plus the locality slack for kLocal).
constexpr double kCostCutMinGap = 0.005;
constexpr double kEvenCountShare = 0.05;
constexpr double kEvenCountBigShare = 0.25;
/// Cost-aware blocks are at least 1/kCostCutMaxFactor of the sharding's block size: smaller
/// kernels run too far down the efficiency curve to pay.
constexpr int64_t kCostCutMaxFactor = 4;

using PlaceFn = std::optional<Placed> (*)(const Batch&, const PlanConfig&, const CostModel&,
                                          const DistributorOptions&, const Sharding&);

/// The first block size placeFeasibly tries: config.blockSize, cut by 3/4 (never below
/// safeBlockTokens) while over the memory cap, as such blocks can never be placed; adds the
/// cuts to `retries`.
int64_t firstSize(const Batch& batch, const PlanConfig& config, const DistributorOptions& options,
                  int64_t* retries) {
  const int64_t safe = safeBlockTokens(batch.numTokens(), options);
  const int64_t cap = memoryCapTokens(options);
  int64_t size = config.blockSize;
  for (; size > cap && size > safe; ++*retries) size = std::max(safe, size * 3 / 4);
  return size;
}

/// Always a plan: shards at config.blockSize and places; when the memory cap cannot place the
/// blocks, cuts every block finer (3/4 of the size, never below safeBlockTokens, where the
/// greedy provably finds room) and tries again. Steps of 3/4 rather than 1/2 keep blocks
/// larger (kernels more efficient): on 16 workers x 8K tokens, 4K blocks, they lowered the
/// busiest worker's cost by 3-15 % on 4 of 10 seeds against halving. Sizes over the cap are
/// skipped (such blocks can never be placed). Deterministic: the sizes tried depend only on
/// the inputs.
///
/// `made`, when given, holds the paper's blocks, pairs (possibly pending) and costs at
/// firstSize (buildPlan makes them before the two placements run side by side).
Placed placeFeasibly(PlaceFn place, const Batch& batch, const PlanConfig& config,
                     const CostModel& costModel, const DistributorOptions& options,
                     Placed* made = nullptr) {
  const int64_t safe = safeBlockTokens(batch.numTokens(), options);
  int64_t retries = 0;
  int64_t size = firstSize(batch, config, options, &retries);
  double shardMs = 0, assignMs = 0;
  for (;;) {
    checkPairCountUnderCap(batch, size, config.blockSize, memoryCapTokens(options));
    Sharding sharding{size, {}};
    sharding.made = std::exchange(made, nullptr);
    std::optional<Placed> p = place(batch, config, costModel, options, sharding);
    if (p) {
      p->shardMs += shardMs;
      p->assignMs += assignMs;
      p->plan.shardBlockSize = size;
      p->plan.smallestBlockSize = size;
      p->plan.packedBlockSize = size;
      p->plan.memoryRetries = retries;
      return std::move(*p);
    }
    FCP_CHECK(size > safe, "blocks of ", size, " tokens found no room under the cap of ",
              memoryCapTokens(options), " tokens although ", safe, "-token blocks always fit");
    size = std::max(safe, size * 3 / 4);
    ++retries;
  }
}

/// Blocks of `p` holding one sequence that was cut (not packed), with each one's sequence.
struct SequenceBlocks {
  std::vector<int32_t> blocksOf;  ///< per sequence: its own blocks
  std::vector<double> maxCostOf;  ///< per sequence: its costliest own block
};

SequenceBlocks sequenceBlocks(const Placed& p) {
  const Plan& plan = p.plan;
  SequenceBlocks sb{std::vector<int32_t>(plan.batch.sequenceLengths.size(), 0),
                    std::vector<double>(plan.batch.sequenceLengths.size(), 0.0)};
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    const std::vector<Chunk>& chunks = plan.blocks[b].chunks;
    if (chunks.empty()) continue;
    const int32_t s = chunks.front().sequence;
    if (std::any_of(chunks.begin(), chunks.end(), [&](const Chunk& c) { return c.sequence != s; }))
      continue;
    if (plan.batch.sequenceLengths[static_cast<size_t>(s)] < plan.shardBlockSize) continue;
    ++sb.blocksOf[static_cast<size_t>(s)];
    sb.maxCostOf[static_cast<size_t>(s)] =
        std::max(sb.maxCostOf[static_cast<size_t>(s)], p.costs[b]);
  }
  return sb;
}

double shareOf(const Placed& p) {
  double total = 0;
  for (double c : p.costs) total += c;
  return total / static_cast<double>(p.plan.config.numWorkers);
}

/// Per-sequence block sizes for the sequences whose costliest block is over `limit`: `want(s)`
/// clamped to [size / kCostCutMaxFactor, size], 0 (the sharding's size) where that is not
/// smaller; empty when no sequence gets a smaller size.
template <typename Want>
std::vector<int64_t> smallerSizes(const Placed& p, const SequenceBlocks& sb, double limit,
                                  Want want) {
  const int64_t size = p.plan.shardBlockSize;
  const int64_t floor = std::max<int64_t>(1, size / kCostCutMaxFactor);
  std::vector<int64_t> sizes(p.plan.batch.sequenceLengths.size(), 0);
  bool any = false;
  for (size_t s = 0; s < sizes.size(); ++s) {
    if (!(sb.maxCostOf[s] > limit)) continue;
    const int64_t w = std::clamp<int64_t>(want(s), floor, size);
    if (w >= size) continue;
    sizes[s] = w;
    any = true;
  }
  if (!any) sizes.clear();
  return sizes;
}

/// Per-sequence sizes "by share" (see kCostCutShare); empty when no block is giant.
std::vector<int64_t> sizesByShare(const Placed& p) {
  const double limit = kCostCutShare * shareOf(p);
  const SequenceBlocks sb = sequenceBlocks(p);
  return smallerSizes(p, sb, limit, [&](size_t s) {
    // Its blocks hold about length / count tokens; scale the costliest to the limit.
    const double tokens = static_cast<double>(p.plan.batch.sequenceLengths[s]) / sb.blocksOf[s];
    return static_cast<int64_t>(tokens * (limit / sb.maxCostOf[s]));
  });
}

/// Per-sequence sizes "even count" for the sequences with blocks over `share` of a worker's
/// share (see kEvenCountShare); empty when there is nothing to do.
std::vector<int64_t> sizesForEvenCount(const Placed& p, double share) {
  const Plan& plan = p.plan;
  const double limit = share * shareOf(p);
  const int64_t n = plan.config.numWorkers;
  const SequenceBlocks sb = sequenceBlocks(p);
  int64_t count = 0;
  for (size_t s = 0; s < sb.blocksOf.size(); ++s)
    if (sb.maxCostOf[s] > limit) count += sb.blocksOf[s];
  if (count == 0 || count % n == 0) return {};
  const double scale = static_cast<double>((count + n - 1) / n * n) / static_cast<double>(count);
  return smallerSizes(p, sb, limit, [&](size_t s) {
    const int64_t length = plan.batch.sequenceLengths[s];
    const auto blocks = static_cast<int64_t>(std::ceil(sb.blocksOf[s] * scale));
    return (length + blocks - 1) / blocks;
  });
}

/// estimatePairs for per-sequence sizes: the sum of k^2 over cut sequences, one per other.
int64_t pairsWithSizes(const Batch& batch, int64_t blockSize, const std::vector<int64_t>& sizes) {
  int64_t pairs = 0;
  for (size_t s = 0; s < batch.sequenceLengths.size(); ++s) {
    const int64_t length = batch.sequenceLengths[s];
    const int64_t size = sizes[s] == 0 ? blockSize : sizes[s];
    const int64_t k = length >= blockSize ? (length + size - 1) / size : 1;
    pairs += k * k;
    if (pairs > kMaxPairs) return kMaxPairs + 1;
  }
  return pairs;
}

double spanOf(Placed& p);
double forwardSpanOf(Placed& p);

/// Cost-aware blocks (see kCostCutMinGap): when `base` ends well above its lower bound, the
/// finer cuttings are placed too, in turn, and one replaces the best so far when its busiest
/// worker costs less. For the paper's placement it must also span no longer in the forward
/// pass with communication taking no time (spanOf): finer blocks put more rounds between the
/// holders of a long sequence, and a worker can then wait on another's stage. Code corpus,
/// 1024 workers, seed 1: the "even count" of the costliest blocks made the busiest worker
/// 0.6 % cheaper, but spanned 1.11x and simulated 298.7 -> 344.0 ms on H100. The spans are of
/// the plans before they are finished, so an estimate of the finished plan's: communication
/// balancing may still move blocks within the compute slack, and the colouring depends on the
/// relabelled workers' ids (the winner's rounds are made again after finishLpt).
Placed refineCosts(PlaceFn place, Placed base, const Batch& batch, const PlanConfig& config,
                   const CostModel& costModel, const DistributorOptions& options,
                   const LocalWinLimit* winLimit = nullptr) {
  if (!config.costAwareBlocks || base.plan.lowerBound <= 0) return base;
  // The local placement stops once within the locality slack of its bound, by design.
  const double stop =
      config.improveTarget + (place == &placeLocal ? config.localitySlack : 0.0) + kCostCutMinGap;
  // Measured against a worker's share (total / workers), not only the cutting's bound: where
  // a block costs more than a share, the bound is that block, and a plan at it can be twice
  // as slow as one of finer blocks (code corpus, 4096 workers, seed 2: 274 blocks of a
  // 1.1M-token sequence at 2.09 shares each, the busiest worker "at its bound").
  const double reference = std::min(base.plan.lowerBound, shareOf(base));
  if (maxCost(base.plan) <= reference * (1.0 + stop)) return base;
  // The local placement's cuttings that cannot win the choice are not assigned (their blocks
  // not even paired: cannotBeatByChunks), whatever they would do for its own busiest worker.
  const double cap = winLimit ? winLimit->get() : std::numeric_limits<double>::infinity();
  const int64_t size = base.plan.shardBlockSize;
  const int64_t retries = base.plan.memoryRetries;
  double shardMs = base.shardMs, assignMs = base.assignMs, balanceMs = base.balanceMs;
  Placed best = std::move(base);
  std::vector<Sharding> candidates;
  for (const std::vector<int64_t>& sizes :
       {sizesByShare(best), sizesForEvenCount(best, kEvenCountShare),
        sizesForEvenCount(best, kEvenCountBigShare)}) {
    const bool seen = std::any_of(candidates.begin(), candidates.end(),
                                  [&](const Sharding& c) { return c.sequenceSizes == sizes; });
    if (!sizes.empty() && !seen && pairsWithSizes(batch, size, sizes) <= kMaxPairs)
      candidates.push_back({size, sizes});
  }
  if (size / 2 >= std::max<int64_t>(1, size / kCostCutMaxFactor) &&
      estimatePairs(batch, size / 2) <= kMaxPairs) {
    candidates.push_back({size / 2, {}});
  }
  Sharding bestSharding{size, {}};
  // Places `sharding`; keeps it if its busiest worker costs less than the best's and, for the
  // paper's placement, its forward pass spans no longer (see refineCosts).
  const auto tryCandidate = [&](Sharding sharding) {
    // Only a busiest worker below the best so far is kept: blocks that cannot get there are
    // not assigned.
    sharding.mustBeat = std::min(maxCost(best.plan), cap);
    std::optional<Placed> fine = place(batch, config, costModel, options, sharding);
    if (!fine) return;  // finer blocks that the cap refuses, or that cannot win: keep best
    shardMs += fine->shardMs;
    assignMs += fine->assignMs;
    balanceMs += fine->balanceMs;
    if (!(maxCost(fine->plan) < maxCost(best.plan))) return;
    if (place == &placeLpt) {
      const auto start = std::chrono::steady_clock::now();
      const bool longer = forwardSpanOf(*fine) > forwardSpanOf(best);
      balanceMs += msSince(start);
      if (longer) return;
    }
    fine->plan.shardBlockSize = size;
    fine->plan.memoryRetries = retries;
    fine->plan.smallestBlockSize = sharding.blockSize;
    fine->plan.packedBlockSize = sharding.packSize > 0 ? sharding.packSize : size;
    for (size_t s = 0; s < batch.sequenceLengths.size(); ++s) {
      const int64_t own = sharding.sequenceSizes.empty() ? 0 : sharding.sequenceSizes[s];
      if (own > 0 || (sharding.blockSize < size && batch.sequenceLengths[s] > sharding.blockSize))
        ++fine->plan.costCutSequences;
      if (own > 0) fine->plan.smallestBlockSize = std::min(fine->plan.smallestBlockSize, own);
    }
    best = std::move(*fine);
    bestSharding = std::move(sharding);
  };
  for (Sharding& sharding : candidates) tryCandidate(std::move(sharding));
  // Memory-aware packing, when the busiest worker is still above the stop: the best cutting
  // again with the short sequences packed into blocks of half and then a quarter of its block
  // size.
  // Where the cap binds, the busiest worker can keep blocks of short sequences that fit
  // nowhere else (every worker's room is under a block; lognormal 1024 workers seed 8: 0.88 %
  // above LB, 0.11 % with half-size packed blocks). Those blocks are never transferred. The
  // local placement packs each worker's own short pieces, and is not tried.
  if (place == &placeLpt) {
    for (const int64_t div : {2, 4}) {
      if (maxCost(best.plan) <= best.plan.lowerBound * (1.0 + stop)) break;
      Sharding packed = bestSharding;
      packed.packSize = std::max<int64_t>(1, bestSharding.blockSize / div);
      tryCandidate(std::move(packed));
    }
  }
  best.shardMs = shardMs;
  best.assignMs = assignMs;
  best.balanceMs = balanceMs;
  return best;
}

/// One placement, always feasible and cost-aware; candidates are compared by their
/// assignment (and the paper's also by their spans), and only the winner is finished
/// (finishLpt).
///
/// `winLimit`, when given, is what the two placements share: the paper's offers it once its
/// first assignment is made, and the local one waits for it before it tries finer cuttings.
Placed placeBest(PlaceFn place, const Batch& batch, const PlanConfig& config,
                 const CostModel& costModel, const DistributorOptions& options,
                 Placed* made = nullptr, LocalWinLimit* winLimit = nullptr) {
  Placed p = placeFeasibly(place, batch, config, costModel, options, made);
  if (place == &placeLpt) {
    if (winLimit) winLimit->offer(localWinLimit(p, config));
    p = refineCosts(place, std::move(p), batch, config, costModel, options);
    finishLpt(p, config, options);
    return p;
  }
  return refineCosts(place, std::move(p), batch, config, costModel, options, winLimit);
}

/// Bytes a step moves, in all (as PlanStats::stepBytes) and at the busiest worker (as
/// PlanStats::maxWorkerStepBytes), from the owners alone: the transfers and the reshuffle they
/// imply, which are left in `p` (the plan keeps them if it wins and they are still current).
struct StepBytes {
  int64_t total = 0;
  int64_t busiestWorker = 0;
  double kvImbalance = 0;  ///< as PlanStats::commImbalance
};

StepBytes stepBytes(Placed& p) {
  ensureTransfers(p);
  if (!p.hasTraffic) p.plan.reshuffle = buildReshuffle(p.plan);
  p.hasTraffic = true;
  StepBytes bytes;
  for (const WorkerTraffic& w : computeTraffic(p.plan)) {
    bytes.total += w.forward.sent() + w.backward.sent();
    bytes.busiestWorker =
        std::max(bytes.busiestWorker, w.forward.busier() + w.backward.busier());
  }
  bytes.kvImbalance = imbalance(transferBytesByWorker(p.plan));
  return bytes;
}

/// The transfers of `p`, built if they are not, coloured, with the stage lists prepared
/// beside the colouring (neither reads what the other writes).
detail::StagePrep colourAndPrepare(Placed& p) {
  ensureTransfers(p);
  std::optional<detail::StagePrep> prep;
  detail::runBoth(
      detail::worthParallel(static_cast<int64_t>(p.plan.pairs.size())),
      [&] { colorTransfers(p.plan); }, [&] { prep = detail::prepareStages(p.plan); });
  return std::move(*prep);
}

/// The forward pass's span if moving data took no time (pipelineSpan), with the transfers,
/// their rounds and the stages it needs built and left in `p` (the plan keeps them if it wins).
double spanOf(Placed& p) {
  if (!p.hasStages) {
    detail::buildStages(p.plan, colourAndPrepare(p));
    p.span = pipelineSpan(p.plan);
    p.hasStages = p.hasSpan = true;
  }
  return p.span;
}

/// spanOf's value without the stages, for comparing the paper's cuttings (refineCosts), whose
/// stages finishLpt would drop: detail::forwardSpan reads the span from the stage lists (the
/// same sums and waits, so the same value). Code corpus on 4096 workers, seed 0: building a
/// candidate's stages and timing them took 115 + 177 of its 628 ms (half a million small
/// vectors, 49K page faults).
double forwardSpanOf(Placed& p) {
  if (!p.hasSpan) {
    p.span = detail::forwardSpan(p.plan, colourAndPrepare(p));
    p.hasSpan = true;
  }
  return p.span;
}

/// The evenness rule of the placement choice: where the paper's placement balances compute
/// within the slack (`paperBalanced`), a local plan's KV traffic may be no less even than the
/// paper's, or within kLocalCommImbalance; where it does not, compute decides.
bool evenEnough(const StepBytes& local, const StepBytes& paper, bool paperBalanced) {
  return !paperBalanced || local.kvImbalance <= std::max(paper.kvImbalance, kLocalCommImbalance);
}

/// With a known link (config.commRatio > 0), the local placement `local` with every block
/// left at its home worker, when the cap allows: nothing is reshuffled, at the price of
/// balance. Where a link is slow against compute (a batch of short sequences on a few workers
/// at GPU-X's ratio moves ten times the bytes its compute can hide) that can be the fastest.
std::optional<Placed> stayHome(const Placed& local, const Batch& batch, const PlanConfig& config,
                               const DistributorOptions& options) {
  const std::vector<int64_t> user = userLayout(config, batch.numTokens());
  std::vector<int32_t> home = homeWorkers(batch, local.plan.blocks, user);
  if (home == local.plan.owner) return std::nullopt;  // the same plan
  std::vector<int64_t> held(static_cast<size_t>(config.numWorkers), 0);
  for (size_t b = 0; b < home.size(); ++b)
    held[static_cast<size_t>(home[b])] += local.plan.blocks[b].numTokens();
  if (*std::max_element(held.begin(), held.end()) > memoryCapTokens(options)) return std::nullopt;
  Placed p;
  p.plan = local.plan;
  p.costs = local.costs;
  p.plan.owner = std::move(home);
  p.plan.transfers.clear();
  p.plan.reshuffle.clear();
  p.plan.localityMoves = 0;
  p.plan.improveSteps = 0;
  p.plan.loads = computeLoads(p.plan);
  p.plan.greedyMaxCost = maxCost(p.plan);
  return p;
}

/// Whether a placement's step is bound by its `bytes` at `ratio` (> 0) cost units per byte: its
/// busiest worker's bytes weigh at least its compute (its span, spanOf). Only then does the
/// link-aware choice (takeFastest) run; where compute binds the paper's placement, fewer bytes
/// cannot shorten the step, and the local placements' contiguous blocks lengthen its dependency
/// chains: on GPU-X such choices simulated up to 34 % slower (16 workers x 32K tokens,
/// lognormal-narrow; docs/locality.md, "The simulator told the link"), so the compute-only
/// choice decides there.
bool boundByBytes(Placed& p, const StepBytes& bytes, double ratio) {
  return ratio * static_cast<double>(bytes.busiestWorker) >= spanOf(p);
}

/// With a known link (config.commRatio > 0): of the paper's placement (`lpt`), the local one
/// and the local one with every block at home (stayHome), the one with the least estimated
/// step time (ties: the fewest bytes); moved into `lpt`. The estimate (linkedStepTime) runs
/// both passes' stages with each stage as long as the longest of its compute, its sends and
/// its receives over the link, so the local placements' contiguous blocks that make stages
/// wait count, as do the bytes a stage cannot hide; the reshuffle comes on top. (It replaced
/// the larger of the free-communication span and the busiest worker's bytes plus a fifth of
/// the smaller, which simulated slower than compute first on 41 of the 68 batches where it
/// chose differently: docs/planner.md, session 15.) A local candidate's communication
/// balancing may spend compute up to the best estimate so far. Where the paper's
/// placement balances compute within `slack`, the evenness rule of the compute-only choice
/// holds too: uneven traffic simulated slower than its bytes say (docs/locality.md). The
/// others are considered only where the paper's placement is bound by its bytes (its busiest
/// worker's bytes x commRatio at least its span).
void takeFastest(Placed& lpt, const StepBytes& lptBytes, Placed& local, const Batch& batch,
                 const PlanConfig& config, const DistributorOptions& options, double slack) {
  // The link ratio is per byte of both passes against the forward's compute (peak FLOP/s /
  // 3.5 / link bytes/s); a byte alone on the link costs 3.5 times that.
  const double costPerByte = (1.0 + kBackwardFlopsPerForward) * config.commRatio;
  // The step with its stages built (spanOf); its reshuffle is, by stepBytes before each call.
  const auto stepTime = [&](Placed& p) {
    FCP_CHECK(p.hasTraffic, "a placement timed before its bytes were counted");
    spanOf(p);
    return detail::linkedStepTime(p.plan, costPerByte);
  };
  // A floor under it from the owners alone: every worker computes both passes, one stage after
  // another, and the reshuffle comes on top.
  const auto floor = [&](const Placed& p) {
    return (1.0 + kBackwardFlopsPerForward) * maxCost(p.plan) * (1 - 1e-12);
  };
  const bool lptBalanced = maxCost(lpt.plan) <= lpt.plan.lowerBound * slack;
  double best = stepTime(lpt);
  int64_t bestBytes = lptBytes.total;
  // Faster, or as fast with fewer bytes (one block can set the busiest worker's cost alike).
  const auto beats = [&](double time, int64_t total) {
    return time < best || (time == best && total < bestBytes);
  };
  std::optional<Placed> home = stayHome(local, batch, config, options);
  Placed* fastest = &lpt;
  // A candidate that cannot win by its floor is neither balanced nor staged.
  for (Placed* c : {&local, home ? &*home : nullptr}) {
    if (!c) continue;
    const StepBytes before = stepBytes(*c);
    if (!beats(floor(*c), before.total)) continue;
    // Balancing may spend compute up to what the best's step would allow.
    balanceComm(*c, config, options, kLocalStepsPerWorker,
                best / (1.0 + kBackwardFlopsPerForward));
    const StepBytes bytes = stepBytes(*c);
    if (!beats(floor(*c), bytes.total)) continue;
    const double time = stepTime(*c);
    if (beats(time, bytes.total) && evenEnough(bytes, lptBytes, lptBalanced)) {
      best = time;
      bestBytes = bytes.total;
      fastest = c;
    }
  }
  if (fastest != &lpt) lpt = std::move(*fastest);
}

void checkTokenCoverage(const Plan& plan, Violations& v) {
  const auto numSequences = plan.batch.sequenceLengths.size();
  std::vector<std::vector<Chunk>> bySequence(numSequences);
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    if (plan.blocks[b].chunks.empty()) v.add("block ", b, " holds no tokens");
    for (const Chunk& c : plan.blocks[b].chunks) {
      if (c.sequence < 0 || static_cast<size_t>(c.sequence) >= numSequences) {
        v.add("block ", b, " names sequence ", c.sequence, " but the batch has ", numSequences);
      } else if (c.begin < 0 || c.end <= c.begin ||
                 c.end > plan.batch.sequenceLengths[static_cast<size_t>(c.sequence)]) {
        v.add("block ", b, " holds tokens [", c.begin, ", ", c.end, ") of sequence ", c.sequence,
              " of length ", plan.batch.sequenceLengths[static_cast<size_t>(c.sequence)]);
      } else {
        bySequence[static_cast<size_t>(c.sequence)].push_back(c);
      }
    }
  }
  for (size_t s = 0; s < numSequences; ++s) {
    auto& chunks = bySequence[s];
    std::sort(chunks.begin(), chunks.end(),
              [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (const Chunk& c : chunks) {
      if (c.begin > next)
        v.add("sequence ", s, ": tokens [", next, ", ", c.begin, ") are in no block");
      if (c.begin < next) v.add("sequence ", s, ": tokens from ", c.begin, " are in two blocks");
      next = std::max(next, c.end);
    }
    const int64_t len = plan.batch.sequenceLengths[s];
    if (next < len) v.add("sequence ", s, ": tokens [", next, ", ", len, ") are in no block");
  }
}

void checkOwnersAndLoads(const Plan& plan, Violations& v) {
  const int64_t n = plan.config.numWorkers;
  if (plan.owner.size() != plan.blocks.size()) {
    v.add("owner has ", plan.owner.size(), " entries for ", plan.blocks.size(), " blocks");
    return;
  }
  for (size_t b = 0; b < plan.owner.size(); ++b) {
    if (plan.owner[b] < 0 || plan.owner[b] >= n) {
      v.add("block ", b, " is owned by worker ", plan.owner[b], ", not one of 0..", n - 1);
    }
  }
  const auto numBlocks = static_cast<int32_t>(plan.blocks.size());
  for (const BlockPair& p : plan.pairs) {
    if (p.qBlock < 0 || p.qBlock >= numBlocks) return;  // checkPairs reports it
  }
  if (!v.empty()) return;
  const std::vector<WorkerLoad> loads = computeLoads(plan);
  const int64_t cap = memoryCapTokens(distributorOptions(plan.config));
  for (size_t w = 0; w < loads.size(); ++w) {
    if (loads[w].numTokens > cap) {
      v.add("worker ", w, " holds ", loads[w].numTokens, " tokens, over the memory cap of ", cap);
    }
  }
  if (plan.loads.size() != loads.size()) {
    v.add("loads has ", plan.loads.size(), " entries for ", n, " workers");
    return;
  }
  for (size_t w = 0; w < loads.size(); ++w) {
    const double tolerance = 1e-9 * std::max(1.0, std::abs(loads[w].cost));
    if (plan.loads[w].numTokens != loads[w].numTokens ||
        std::abs(plan.loads[w].cost - loads[w].cost) > tolerance) {
      v.add("worker ", w, " load says ", plan.loads[w].numTokens, " tokens / cost ",
            plan.loads[w].cost, " but its blocks give ", loads[w].numTokens, " / ", loads[w].cost);
    }
  }
}

/// The (Q chunk, KV chunk) pairs with visible entries that pairs [first, last) cover, by
/// global chunk id (firstChunk: each block's first), with the sentences of those pairs, in
/// pair order; `room` is reserved for them. `inOrder`: these pairs name blocks in range and
/// ascend strictly by (Q block, KV block), each also after the pair before it (the one before
/// `first` too); then each Q block's run of chunk pairs is sorted (the runs follow each other
/// in Q chunk order, so sorting each run sorts them all).
struct CoveredChunks {
  std::vector<std::pair<int64_t, int64_t>> chunkPairs;
  bool inOrder = true;
  Violations found;
};

/// Whether `chunks` ascend by sequence (a sequence's chunks side by side).
bool bySequence(const std::vector<Chunk>& chunks) {
  return std::is_sorted(chunks.begin(), chunks.end(),
                        [](const Chunk& a, const Chunk& b) { return a.sequence < b.sequence; });
}

CoveredChunks coveredChunks(const Plan& plan, const std::vector<int64_t>& firstChunk, size_t first,
                            size_t last, size_t room) {
  const MaskKind mask = plan.config.attention.mask;
  const auto numBlocks = static_cast<int32_t>(plan.blocks.size());
  CoveredChunks c;
  std::vector<std::pair<int64_t, int64_t>>& covered = c.chunkPairs;
  covered.reserve(room);
  std::vector<size_t> runStart{0};  // where each Q block's run starts in `covered`
  for (size_t p = first; p < last; ++p) {
    const BlockPair& pair = plan.pairs[p];
    if (pair.qBlock < 0 || pair.qBlock >= numBlocks || pair.kvBlock < 0 ||
        pair.kvBlock >= numBlocks) {
      c.found.add("pair ", p, " names blocks (", pair.qBlock, ", ", pair.kvBlock, ") outside 0..",
                  numBlocks - 1);
      c.inOrder = false;
      continue;
    }
    if (p > 0 && std::tie(plan.pairs[p - 1].qBlock, plan.pairs[p - 1].kvBlock) >=
                     std::tie(pair.qBlock, pair.kvBlock)) {
      c.found.add("pairs are not sorted and unique at pair ", p, " (", pair.qBlock, ", ",
                  pair.kvBlock, ")");
      c.inOrder = false;
    }
    if (p > first && plan.pairs[p - 1].qBlock != pair.qBlock) runStart.push_back(covered.size());
    const auto& qChunks = plan.blocks[static_cast<size_t>(pair.qBlock)].chunks;
    const auto& kChunks = plan.blocks[static_cast<size_t>(pair.kvBlock)].chunks;
    int64_t visible = 0;
    const auto visit = [&](size_t i, size_t j) {
      const int64_t e =
          visibleEntries(mask, qChunks[i].begin, qChunks[i].end, kChunks[j].begin, kChunks[j].end);
      if (e == 0) return;
      visible += e;
      covered.push_back({firstChunk[static_cast<size_t>(pair.qBlock)] + static_cast<int64_t>(i),
                         firstChunk[static_cast<size_t>(pair.kvBlock)] + static_cast<int64_t>(j)});
    };
    // The same-sequence chunk pairs in (Q chunk, KV chunk) order. Where both blocks' chunks
    // ascend by sequence (the planner's blocks all do), a merge finds them in O(q + k + found):
    // a packed block of thousands of one-token sequences pairs with itself in as many steps, not
    // their square (512K such sequences on 8 workers took 1.5 s). Otherwise every (i, j).
    if (bySequence(qChunks) && bySequence(kChunks)) {
      size_t from = 0;  // kChunks' first of qChunks[i]'s sequence or after
      for (size_t i = 0; i < qChunks.size(); ++i) {
        while (from < kChunks.size() && kChunks[from].sequence < qChunks[i].sequence) ++from;
        for (size_t j = from; j < kChunks.size() && kChunks[j].sequence == qChunks[i].sequence; ++j)
          visit(i, j);
      }
    } else {
      for (size_t i = 0; i < qChunks.size(); ++i) {
        for (size_t j = 0; j < kChunks.size(); ++j) {
          if (qChunks[i].sequence == kChunks[j].sequence) visit(i, j);
        }
      }
    }
    if (visible == 0)
      c.found.add("pair ", p, " (", pair.qBlock, ", ", pair.kvBlock, ") needs no computation");
    if (visible != pair.visible) {
      c.found.add("pair ", p, " says ", pair.visible, " visible entries but its chunks give ",
                  visible);
    }
  }
  runStart.push_back(covered.size());
  if (c.inOrder) {
    for (size_t r = 0; r + 1 < runStart.size(); ++r) {
      std::sort(covered.begin() + static_cast<std::ptrdiff_t>(runStart[r]),
                covered.begin() + static_cast<std::ptrdiff_t>(runStart[r + 1]));
    }
  }
  return c;
}

/// Every (Q chunk, KV chunk) of one sequence with visible entries must lie in exactly one pair.
/// On large plans, in two halves on two threads (the pairs cut at a Q block's first pair, the
/// sequences at half the chunk pairs), with the sentences each would add in order.
void checkPairs(const Plan& plan, Violations& v) {
  const MaskKind mask = plan.config.attention.mask;
  const auto numBlocks = static_cast<int32_t>(plan.blocks.size());
  std::vector<int64_t> firstChunk(plan.blocks.size() + 1, 0);  // global chunk id of a block's first
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    firstChunk[b + 1] = firstChunk[b] + static_cast<int64_t>(plan.blocks[b].chunks.size());
  }
  const size_t numPairs = plan.pairs.size();
  const bool parallel = detail::worthParallelCheck(static_cast<int64_t>(numPairs));
  size_t mid = parallel ? numPairs / 2 : numPairs;
  while (mid > 0 && mid < numPairs && plan.pairs[mid].qBlock == plan.pairs[mid - 1].qBlock) ++mid;
  // Room for each half's chunk pairs, the first half's for both, so that the second is
  // appended in place. A block holds each sequence in at most two chunks (Zig-Zag), so a pair
  // of blocks of q and k chunks covers at most min(q k, 2 min(q, k)) chunk pairs (a packed
  // block of thousands of one-token sequences covers as many with itself, not their square).
  // A plan breaking that only makes its vectors grow.
  const auto roomOf = [&](size_t first, size_t last) {
    size_t room = 0;
    for (size_t p = first; p < last; ++p) {
      const BlockPair& pair = plan.pairs[p];
      if (pair.qBlock >= 0 && pair.qBlock < numBlocks && pair.kvBlock >= 0 &&
          pair.kvBlock < numBlocks) {
        const size_t q = plan.blocks[static_cast<size_t>(pair.qBlock)].chunks.size();
        const size_t k = plan.blocks[static_cast<size_t>(pair.kvBlock)].chunks.size();
        room += std::min(q * k, 2 * std::min(q, k));
      }
    }
    return room;
  };
  const size_t secondRoom = roomOf(mid, numPairs);
  CoveredChunks head, tail;
  detail::runBoth(
      parallel,
      [&] { head = coveredChunks(plan, firstChunk, 0, mid, roomOf(0, mid) + secondRoom); },
      [&] { tail = coveredChunks(plan, firstChunk, mid, numPairs, secondRoom); });
  v.append(std::move(head.found));
  v.append(std::move(tail.found));
  std::vector<std::pair<int64_t, int64_t>> covered = std::move(head.chunkPairs);
  covered.insert(covered.end(), tail.chunkPairs.begin(), tail.chunkPairs.end());
  tail.chunkPairs = {};
  if (!(head.inOrder && tail.inOrder)) std::sort(covered.begin(), covered.end());
  for (size_t i = 1; i < covered.size(); ++i) {
    if (covered[i] == covered[i - 1]) {
      v.add("chunk pair (", covered[i].first, ", ", covered[i].second, ") is computed twice");
    }
  }
  // Where each Q chunk's covered pairs start (they are a run, sorted by KV chunk).
  const auto numChunks = static_cast<size_t>(firstChunk.back());
  std::vector<size_t> coveredFrom(numChunks + 1, 0);
  for (const auto& [q, k] : covered) ++coveredFrom[static_cast<size_t>(q) + 1];
  for (size_t c = 1; c <= numChunks; ++c) coveredFrom[c] += coveredFrom[c - 1];
  // What the mask needs: all same-sequence chunk pairs with visible entries.
  std::vector<std::vector<int64_t>> chunksOf(plan.batch.sequenceLengths.size());
  std::vector<const Chunk*> chunkById;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    for (const Chunk& c : plan.blocks[b].chunks) {
      if (c.sequence >= 0 && static_cast<size_t>(c.sequence) < chunksOf.size()) {
        chunksOf[static_cast<size_t>(c.sequence)].push_back(static_cast<int64_t>(chunkById.size()));
      }
      chunkById.push_back(&c);
    }
  }
  const auto checkSequences = [&](size_t first, size_t last, Violations& found) {
    for (size_t s = first; s < last; ++s) {
      const std::vector<int64_t>& ids = chunksOf[s];
      for (int64_t q : ids) {
        // ids ascend, so the KV chunks are met in the order of q's run: one walk along it finds
        // each (as a binary search of the whole list would).
        size_t at = coveredFrom[static_cast<size_t>(q)];
        const size_t end = coveredFrom[static_cast<size_t>(q) + 1];
        for (int64_t k : ids) {
          const Chunk& qc = *chunkById[static_cast<size_t>(q)];
          const Chunk& kc = *chunkById[static_cast<size_t>(k)];
          if (visibleEntries(mask, qc.begin, qc.end, kc.begin, kc.end) == 0) continue;
          while (at < end && covered[at].second < k) ++at;
          if (at == end || covered[at].second != k) {
            found.add("sequence ", qc.sequence, ": Q tokens [", qc.begin, ", ", qc.end,
                      ") x KV tokens [", kc.begin, ", ", kc.end, ") are never computed");
          }
        }
      }
    }
  };
  // The sequences cut where the chunk pairs to check reach half.
  size_t total = 0;
  for (const auto& ids : chunksOf) total += ids.size() * ids.size();
  size_t cut = parallel ? 0 : chunksOf.size();
  for (size_t sum = 0; cut < chunksOf.size() && sum < total / 2; ++cut)
    sum += chunksOf[cut].size() * chunksOf[cut].size();
  Violations later;
  detail::runBoth(
      parallel, [&] { checkSequences(0, cut, v); },
      [&] { checkSequences(cut, chunksOf.size(), later); });
  v.append(std::move(later));
}

/// The planner's knobs and counters a plan file may carry: each in the range its flag or the
/// planner accepts, so a loaded plan cannot claim what no planner makes.
void checkConfigRanges(const Plan& plan, Violations& v) {
  const PlanConfig& c = plan.config;
  static const char* const kStrategies[] = {"fcp",      "fcp-base", "fcp-pipeline", "fcp-cfree",
                                            "fcp-coalesce", "ring", "bytescale",    "wlb",
                                            "magi",     "megatron"};
  if (std::find(std::begin(kStrategies), std::end(kStrategies), plan.strategy) ==
      std::end(kStrategies)) {
    v.add("plan has strategy '", plan.strategy,
          "': expected fcp, ring, bytescale, wlb, magi, megatron or an fcp ablation");
  }
  if (c.blockSize <= 0 || c.blockSize > kMaxSequenceLength) {
    v.add("plan has block size ", c.blockSize, ": expected 1 to ", kMaxSequenceLength, " tokens");
  }
  if (c.tokensPerWorker <= 0 || c.tokensPerWorker > kMaxBatchTokens) {
    v.add("plan has ", c.tokensPerWorker, " tokens per worker: expected 1 to ", kMaxBatchTokens);
  }
  if (!(c.commBalanceSlack >= kMinCommBalanceSlack && c.commBalanceSlack <= kMaxCommBalanceSlack)) {
    v.add("plan has communication balance slack ", c.commBalanceSlack, ": expected ",
          kMinCommBalanceSlack, " to ", kMaxCommBalanceSlack);
  }
  if (!(c.localitySlack >= 0 && c.localitySlack <= 1)) {
    v.add("plan has locality slack ", c.localitySlack, ": expected 0 to 1");
  }
  if (!(c.commRatio >= 0 && c.commRatio <= kMaxCommRatio)) {
    v.add("plan has communication ratio ", c.commRatio, ": expected 0 to ", kMaxCommRatio);
  }
  if (!(c.alpha > 0 && c.alpha <= 1e6) || !(c.beta > 0 && c.beta <= 1e6)) {
    v.add("plan has alpha ", c.alpha, " and beta ", c.beta, ": expected each in (0, 1e6]");
  }
  if (!(c.improveTarget >= 0 && c.improveTarget <= 1) || c.improveStepsPerBlock < 0 ||
      c.improveStepsPerBlock > kMaxImproveStepsPerBlock) {
    v.add("plan has improvement target ", c.improveTarget, " and ", c.improveStepsPerBlock,
          " steps per block: expected 0 to 1 and 0 to ", kMaxImproveStepsPerBlock);
  }
  for (auto [value, name] : {std::pair{plan.improveSteps, "improve_steps"},
                             {plan.commBalanceSteps, "comm_balance_steps"},
                             {plan.localityMoves, "locality_moves"},
                             {plan.memoryRetries, "memory_retries"},
                             {plan.costCutSequences, "cost_cut_sequences"},
                             {plan.movedTokensWithoutLocality, "moved_tokens_without_locality"}}) {
    if (value < 0) v.add("plan has ", name, " ", value, ": expected 0 or more");
  }
  if (plan.shardBlockSize < 0 || plan.shardBlockSize > std::max<int64_t>(c.blockSize, 0) ||
      plan.smallestBlockSize < 0 || plan.smallestBlockSize > plan.shardBlockSize) {
    v.add("plan has sharding block size ", plan.shardBlockSize, " and smallest block size ",
          plan.smallestBlockSize, ": expected 0 <= smallest <= sharding <= the configured ",
          c.blockSize);
  }
  const int64_t packed = plan.packedBlockSize;
  if (plan.shardBlockSize > 0 ? packed < 1 || packed > plan.shardBlockSize : packed != 0) {
    v.add("plan has packed block size ", plan.packedBlockSize, ": expected 1 to the sharding's ",
          plan.shardBlockSize, " (0 when that is 0)");
  }
  if (!(plan.lowerBound >= 0 && std::isfinite(plan.lowerBound)) ||
      !(plan.greedyMaxCost >= 0 && std::isfinite(plan.greedyMaxCost))) {
    v.add("plan has lower bound ", plan.lowerBound, " and greedy maximum ", plan.greedyMaxCost,
          ": expected finite costs >= 0");
  }
}

/// Every pair cost a finite number >= 0 (a negative cost could hide work from a worker's load).
void checkPairCosts(const Plan& plan, Violations& v) {
  for (size_t p = 0; p < plan.pairs.size(); ++p) {
    const double cost = plan.pairs[p].cost;
    if (!(cost >= 0 && std::isfinite(cost))) {
      v.add("pair ", p, " costs ", cost, ": expected a finite cost >= 0");
    }
  }
}

/// LB = max(largest block cost, total cost / workers), recomputed from the pairs.
void checkLowerBound(const Plan& plan, Violations& v) {
  if (plan.strategy != "fcp" && plan.strategy.rfind("fcp-", 0) != 0) return;  // baselines set their own
  const std::vector<double> costs =
      blockCosts(static_cast<int64_t>(plan.blocks.size()), plan.pairs);
  double total = 0, largest = 0;
  for (double c : costs) {
    total += c;
    largest = std::max(largest, c);
  }
  const double lowerBound = std::max(largest, total / static_cast<double>(plan.config.numWorkers));
  if (std::abs(plan.lowerBound - lowerBound) > 1e-9 * std::max(1.0, lowerBound)) {
    v.add("plan says lower bound ", plan.lowerBound, " but its pair costs give ", lowerBound);
  }
}

}  // namespace

DistributorOptions distributorOptions(const PlanConfig& config) {
  DistributorOptions o;
  o.numWorkers = config.numWorkers;
  o.memoryLimitTokens = config.memoryLimit();
  o.memorySlack = config.memorySlack;
  o.alpha = config.alpha;
  o.beta = config.beta;
  o.improveTarget = config.improveTarget;
  o.improveStepsPerBlock = config.improveStepsPerBlock;
  o.localitySlack = config.localitySlack;
  return o;
}

std::vector<std::string> validateCosts(const Plan& plan, const CostModel& costModel) {
  Violations v;
  if (costModel.attention != plan.config.attention) {
    v.add("the cost model's attention differs from the plan's");
    return v.take();
  }
  const std::vector<BlockPair> pairs = blockPairs(plan.blocks, costModel);
  if (pairs.size() != plan.pairs.size()) {
    v.add("plan has ", plan.pairs.size(), " pairs but its blocks make ", pairs.size());
    return v.take();
  }
  for (size_t p = 0; p < pairs.size(); ++p) {
    const double want = pairs[p].cost, got = plan.pairs[p].cost;
    if (std::abs(want - got) > 1e-9 * std::max(1.0, std::abs(want))) {
      v.add("pair ", p, " (", plan.pairs[p].qBlock, ", ", plan.pairs[p].kvBlock, ") costs ", got,
            " but the plan's heads, head dim, mask and efficiency curve give ", want);
    }
  }
  return v.take();
}

std::string_view placementName(Placement placement) {
  return placement == Placement::kLocal ? "local" : "lpt";
}

Placement parsePlacement(std::string_view name) {
  if (name == "local") return Placement::kLocal;
  if (name == "lpt") return Placement::kLpt;
  throwInvalidArgument("unknown placement '", name, "': expected local or lpt");
}

Plan buildPlan(const Batch& batch, const PlanConfig& config, const CostModel& costModel,
               PlanTimings* timings) {
  const auto start = std::chrono::steady_clock::now();
  checkAttentionConfig(config.attention);
  if (config.numWorkers <= 0 || config.numWorkers > kMaxWorkers) {
    throwInvalidArgument("invalid worker count ", config.numWorkers, ": expected 1 to ",
                         kMaxWorkers);
  }
  if (config.tokensPerWorker <= 0) {
    throwInvalidArgument("invalid tokens per worker ", config.tokensPerWorker, ": expected > 0");
  }
  if (config.coalesce <= 0 || config.coalesce > kMaxCoalesce) {
    throwInvalidArgument("invalid coalesce ", config.coalesce, ": expected 1 to ", kMaxCoalesce,
                         " rounds per stage");
  }
  if (config.bufferDepth < 2 || config.bufferDepth > kMaxBufferDepth) {
    throwInvalidArgument("invalid buffer depth ", config.bufferDepth,
                         ": expected 2 (the least "
                         "that overlaps receiving with computing) to ",
                         kMaxBufferDepth);
  }
  if (!(config.commBalanceSlack < 1) || std::isnan(config.commBalanceSlack)) {
    throwInvalidArgument("invalid communication balance slack ", config.commBalanceSlack,
                         ": expected below 1 (negative turns balancing off)");
  }
  if (!(config.commRatio >= 0 && config.commRatio <= kMaxCommRatio)) {
    throwInvalidArgument("invalid communication ratio ", config.commRatio, ": expected 0 to ",
                         kMaxCommRatio, " cost units per byte (0: unknown)");
  }
  if (!config.userStarts.empty())
    checkUserLayout(config.userStarts, batch.numTokens(), config.numWorkers);
  if (config.blockSize <= 0 || config.blockSize > kMaxSequenceLength) {
    throwInvalidArgument("invalid block size ", config.blockSize, ": expected 1 to ",
                         kMaxSequenceLength, " tokens");
  }
  checkPairCount(batch, config.blockSize);  // bounded time and memory (fcp/plan/limits.h)
  if (config.attention.mask != costModel.attention.mask) {
    throw Error(ErrorCode::kInternal, "cost model mask differs from the plan's mask");
  }
  const DistributorOptions options = distributorOptions(config);
  checkDistributorOptions(options);
  const int64_t cap = memoryCapTokens(options);
  if (safeBlockTokens(batch.numTokens(), options) == 0) {
    throwInvalidArgument("memory cap cannot hold the batch: ", batch.numTokens(), " tokens > ",
                         config.numWorkers, " workers x ", cap,
                         " tokens (M(1+delta)); raise the tokens per worker, the memory limit or "
                         "slack, or the number of workers");
  }
  // The two placements are independent: on two threads when the batch is large (their
  // shard and assign times then overlap, and the phases can sum above the total). The paper's
  // first blocks and pairs are made before, alone (their two halves on both threads, joined
  // later: PendingPairs): making both placements' pairs side by side, both bound by memory,
  // slowed the paper's, which leads the longer chain, from 12 to 18-40 ms at 4096 workers x
  // 32K tokens.
  const bool withLocal = config.placement == Placement::kLocal;
  const bool parallel = detail::worthParallel(estimatePairs(batch, config.blockSize));
  std::optional<Placed> lptFirst;
  // The paper's first pairs are joined on the local placement's side (PendingPairs), which
  // outlives both sides.
  std::optional<PendingPairs> lptPairs;
  if (parallel && withLocal) {
    int64_t unusedRetries = 0;
    const int64_t size = firstSize(batch, config, options, &unusedRetries);
    checkPairCountUnderCap(batch, size, config.blockSize, cap);
    std::optional<detail::PairHalves> halves;
    lptFirst = shardLpt(batch, config, costModel, options, Sharding{size, {}}, &halves);
    if (lptFirst) lptFirst->pendingPairs = &lptPairs.emplace(std::move(*halves));
  }
  Placed lpt, local;
  LocalWinLimit winLimit;
  detail::runBoth(
      parallel && withLocal,
      [&] {
        struct OfferOnExit {  // an error leaves no waiter: infinity, if nothing was offered
          LocalWinLimit& limit;
          ~OfferOnExit() { limit.offer(std::numeric_limits<double>::infinity()); }
        } const offerOnExit{winLimit};
        lpt = placeBest(&placeLpt, batch, config, costModel, options,
                        lptFirst ? &*lptFirst : nullptr, &winLimit);
      },
      [&] {
        if (lptPairs) lptPairs->join();
        if (withLocal)
          local = placeBest(&placeLocal, batch, config, costModel, options, nullptr, &winLimit);
      });
  lptFirst.reset();
  double shardMs = lpt.shardMs, assignMs = lpt.assignMs, balanceMs = lpt.balanceMs;
  if (withLocal) {
    shardMs += local.shardMs;
    assignMs += local.assignMs;
    const auto chooseStart = std::chrono::steady_clock::now();
    // The local placement wins when it balances within the slack of the paper's (or better)
    // and moves no more bytes, in all and at the busiest worker, once its communication is
    // balanced too, and that communication is no less even than the paper's (or within
    // kLocalCommImbalance): its traffic can gather on a few workers (the first blocks of a long
    // sequence go to every later holder), and such plans, at 0.42x the bytes, simulated 10-26 %
    // slower on GPU-X than the paper's (docs/locality.md). That balancing may not spend compute
    // past the limit: the local placement's own bound may be above the paper's. Last, its
    // forward pass must span no longer than the slack over the paper's with communication
    // taking no time (pipelineSpan): contiguous causal blocks make the holders of a sequence's
    // late blocks wait for its early ones, which per-worker costs and bytes do not show (one
    // 512K-token sequence on 64 H100s at 8K tokens each: the local plan is 0.8 % above LB with
    // 23 % fewer bytes, but spans 1.28x the paper's and simulated 1.29x slower).
    const double slack = 1.0 + std::max(config.improveTarget, config.localitySlack);
    std::optional<StepBytes> lptBytes;  // built once, for whichever choice needs it
    if (config.commRatio > 0) lptBytes = stepBytes(lpt);
    if (lptBytes && boundByBytes(lpt, *lptBytes, config.commRatio)) {
      takeFastest(lpt, *lptBytes, local, batch, config, options, slack);
    } else if (const double limit = std::max(maxCost(lpt.plan), lpt.plan.lowerBound * slack);
               maxCost(local.plan) <= limit) {  // else the paper's bytes are never counted here
      if (!lptBytes) lptBytes = stepBytes(lpt);
      StepBytes localBytes = stepBytes(local);
      if (localBytes.total <= lptBytes->total) {
        balanceComm(local, config, options, kLocalStepsPerWorker, limit);
        if (!local.hasTraffic) localBytes = stepBytes(local);  // balancing moved blocks
        const bool lptBalanced = maxCost(lpt.plan) <= lpt.plan.lowerBound * slack;
        if (localBytes.total <= lptBytes->total &&
            localBytes.busiestWorker <= lptBytes->busiestWorker &&
            evenEnough(localBytes, *lptBytes, lptBalanced) &&
            spanOf(local) <= spanOf(lpt) * slack)
          lpt = std::move(local);
      }
    }
    local = Placed{};  // its memory is free for the transfers and stages
    balanceMs += msSince(chooseStart);
  }
  // Built already when the two placements were compared by their bytes (the stages too when
  // by their spans). The reshuffle needs only the owners: it is built beside the transfers.
  // The stages' lists of transfers and pairs need only the transfers, not their rounds: they
  // are prepared while the transfers are coloured.
  const auto transfersStart = std::chrono::steady_clock::now();
  std::vector<ReshufflePiece> reshuffle;
  detail::runBoth(
      parallel, [&] { ensureTransfers(lpt); },
      [&] {  // reads the batch, blocks and owners; ensureTransfers writes only the transfers
        if (!lpt.hasTraffic) reshuffle = buildReshuffle(lpt.plan);
      });
  const double transfersMs = msSince(transfersStart);
  Plan plan = std::move(lpt.plan);
  double colorMs = 0;
  std::optional<detail::StagePrep> prep;
  detail::runBoth(
      parallel,
      [&] {
        if (lpt.hasStages) return;
        const auto colorStart = std::chrono::steady_clock::now();
        colorTransfers(plan);
        colorMs = msSince(colorStart);
      },
      [&] {
        if (!lpt.hasStages) prep = detail::prepareStages(plan);
      });
  if (!lpt.hasTraffic) plan.reshuffle = std::move(reshuffle);
  const auto scheduleStart = std::chrono::steady_clock::now();
  if (!lpt.hasStages) detail::buildStages(plan, std::move(*prep));
  if (plan.placement == Placement::kLocal || !config.locality)
    plan.movedTokensWithoutLocality = movedTokens(plan.reshuffle);
  if (timings) {
    timings->shardMs = shardMs;
    timings->assignMs = assignMs;
    timings->balanceMs = balanceMs;
    timings->transfersMs = transfersMs;
    timings->colorMs = colorMs;
    timings->scheduleMs = msSince(scheduleStart);
    timings->totalMs = msSince(start);
  }
  return plan;
}

std::vector<WorkerLoad> computeLoads(const Plan& plan) {
  std::vector<WorkerLoad> loads(static_cast<size_t>(plan.config.numWorkers));
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    loads[static_cast<size_t>(plan.owner[b])].numTokens += plan.blocks[b].numTokens();
  }
  for (const BlockPair& p : plan.pairs) {
    loads[static_cast<size_t>(plan.owner[static_cast<size_t>(p.qBlock)])].cost += p.cost;
  }
  return loads;
}

std::vector<WorkerTraffic> computeTraffic(const Plan& plan) {
  std::vector<WorkerTraffic> traffic(static_cast<size_t>(plan.config.numWorkers));
  const AttentionConfig& a = plan.config.attention;
  const int64_t q = a.qBytesPerToken(), kv = a.kvBytesPerToken();
  const int64_t lse = a.numHeadsQ * static_cast<int64_t>(sizeof(float));
  const int64_t kvGrad = 2 * a.numHeadsKv * a.headDim * static_cast<int64_t>(sizeof(float));
  const auto at = [&](int32_t w) -> WorkerTraffic& { return traffic[static_cast<size_t>(w)]; };
  for (const ReshufflePiece& p : plan.reshuffle) {
    if (p.userWorker == p.fcpWorker) continue;
    const int64_t t = p.end - p.begin;
    WorkerTraffic& user = at(p.userWorker);
    WorkerTraffic& fcp = at(p.fcpWorker);
    user.forward.reshuffleSent += t * (q + kv);  // Q, K, V in
    fcp.forward.reshuffleReceived += t * (q + kv);
    fcp.forward.reshuffleSent += t * (q + lse);  // O and LSE out
    user.forward.reshuffleReceived += t * (q + lse);
    user.backward.reshuffleSent += t * q;  // dO in
    fcp.backward.reshuffleReceived += t * q;
    fcp.backward.reshuffleSent += t * (q + kv);  // dQ, dK, dV out
    user.backward.reshuffleReceived += t * (q + kv);
  }
  for (const Transfer& t : plan.transfers) {
    const int64_t tokens = plan.blocks[static_cast<size_t>(t.block)].numTokens();
    for (PassTraffic* pass : {&at(t.sender).forward, &at(t.sender).backward}) pass->kvSent += t.bytes;
    for (PassTraffic* pass : {&at(t.receiver).forward, &at(t.receiver).backward})
      pass->kvReceived += t.bytes;
    at(t.receiver).backward.kvSent += tokens * kvGrad;  // the dK/dV partial goes back
    at(t.sender).backward.kvReceived += tokens * kvGrad;
  }
  return traffic;
}

PlanStats computeStats(const Plan& plan) {
  PlanStats s;
  std::vector<double> cost;
  std::vector<int64_t> tokens;
  double maxCost = 0;
  for (const WorkerLoad& l : plan.loads) {
    cost.push_back(l.cost);
    tokens.push_back(l.numTokens);
    maxCost = std::max(maxCost, l.cost);
    s.maxWorkerTokens = std::max(s.maxWorkerTokens, l.numTokens);
  }
  s.computeImbalance = imbalance(cost);
  s.memoryImbalance = imbalance(tokens);
  s.lowerBoundGap = plan.lowerBound > 0 ? maxCost / plan.lowerBound - 1 : 0;
  s.memoryCapTokens = memoryCapTokens(distributorOptions(plan.config));
  s.memoryLowerBound = std::max(
      plan.lowerBound,
      memoryAwareLowerBound(blockTokens(plan.blocks),
                            blockCosts(static_cast<int64_t>(plan.blocks.size()), plan.pairs),
                            plan.config.numWorkers, s.memoryCapTokens));
  s.memoryBoundGap = s.memoryLowerBound > 0 ? maxCost / s.memoryLowerBound - 1 : 0;
  for (const BlockPair& p : plan.pairs)
    s.totalForwardFlops += forwardFlops(plan.config.attention, p.visible);

  std::vector<Edge> edges;
  for (const Transfer& t : plan.transfers) {
    s.commBytes += t.bytes;
    edges.push_back({t.sender, t.receiver, t.bytes});
  }
  // Each transfer counts at its sender and its receiver.
  const std::vector<int64_t> moved = transferBytesByWorker(plan);
  s.commImbalance = imbalance(moved);
  s.commFloorBytes =
      commFloorBytes(plan, std::max(s.memoryCapTokens, s.maxWorkerTokens), maxCost);
  const double meanMoved =
      moved.empty() ? 0
                    : static_cast<double>(std::accumulate(moved.begin(), moved.end(), int64_t{0})) /
                          static_cast<double>(moved.size());
  if (static_cast<double>(s.commFloorBytes) > meanMoved) {
    s.commImbalanceFloor = 1 - meanMoved / static_cast<double>(s.commFloorBytes);
  }
  const auto& a = plan.config.attention;
  const int64_t bytesPerToken = a.qBytesPerToken() + a.kvBytesPerToken() + a.oBytesPerToken();
  s.reshuffleBytes = movedTokens(plan.reshuffle) * bytesPerToken;
  s.reshuffleBytesWithoutLocality = plan.movedTokensWithoutLocality * bytesPerToken;
  const auto numWorkers = static_cast<int32_t>(plan.config.numWorkers);
  const RoundCostBounds bounds = roundCostBounds(numWorkers, edges);
  s.maxWorkerCommBytes = bounds.maxWorkerBytes;
  s.sortedRoundBound = bounds.sortedRoundBound;
  EdgeColoring coloring{plan.numRounds, {}};
  for (const Transfer& t : plan.transfers) coloring.color.push_back(t.round);
  s.sumRoundMaxima = sumOfRoundMaxima(edges, coloring);
  s.maxDegree = maxDegree(numWorkers, edges);
  s.numForwardStages = plan.forward.empty() ? 0 : static_cast<int32_t>(plan.forward.front().size());
  for (const WorkerTraffic& w : computeTraffic(plan)) {
    s.stepBytes += w.forward.sent() + w.backward.sent();
    s.maxWorkerStepBytes = std::max(s.maxWorkerStepBytes, w.forward.busier() + w.backward.busier());
  }
  return s;
}

std::vector<std::string> validate(const Plan& plan) {
  Violations v;
  // The configuration and batch first: a plan read from a file may carry anything, and the
  // checks below size arrays by these numbers.
  const PlanConfig& c = plan.config;
  if (c.numWorkers <= 0 || c.numWorkers > kMaxWorkers) {
    v.add("plan has ", c.numWorkers, " workers: expected 1 to ", kMaxWorkers);
  }
  if (c.coalesce <= 0 || c.coalesce > kMaxCoalesce || c.bufferDepth < 2 ||
      c.bufferDepth > kMaxBufferDepth) {
    v.add("plan has coalesce ", c.coalesce, " and buffer depth ", c.bufferDepth, ": expected 1 to ",
          kMaxCoalesce, " and 2 to ", kMaxBufferDepth);
  }
  if (!(c.memorySlack >= 0 && c.memorySlack <= 100) || c.memoryLimit() <= 0 ||
      c.memoryLimit() > kMaxBatchTokens) {
    v.add("plan has memory limit ", c.memoryLimit(), " tokens with slack ", c.memorySlack,
          ": expected 1 to ", kMaxBatchTokens, " tokens and slack 0 to 100");
  }
  checkConfigRanges(plan, v);
  try {
    checkAttentionConfig(c.attention);
  } catch (const Error& e) {
    v.add("plan's attention: ", e.what());
  }
  try {
    checkBatch(plan.batch);
  } catch (const Error& e) {
    v.add("plan's batch: ", e.what());
  }
  if (!v.empty()) return v.take();
  checkTokenCoverage(plan, v);
  checkPairCosts(plan, v);
  checkOwnersAndLoads(plan, v);
  checkPairs(plan, v);
  if (v.empty()) checkLowerBound(plan, v);
  if (v.empty()) detail::validateCommunication(plan, v);
  return v.take();
}

void checkValid(const Plan& plan) {
  const std::vector<std::string> violations = validate(plan);
  if (violations.empty()) return;
  std::string message = "plan breaks invariants: ";
  for (size_t i = 0; i < violations.size() && i < 3; ++i)
    message += (i ? "; " : "") + violations[i];
  throw Error(ErrorCode::kInvalidPlan, message);
}

}  // namespace fcp::plan
