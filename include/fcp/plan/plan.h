#pragma once
/// The `Plan`: plain data saying which tokens form each block, which worker owns each block,
/// and what must be computed. Deterministic (same inputs, same plan on every rank), JSON
/// serialisable, and checked by `validate`.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fcp/core/config.h"
#include "fcp/core/cost_model.h"
#include "fcp/core/workload.h"
#include "fcp/plan/distributor.h"
#include "fcp/plan/schedule.h"
#include "fcp/plan/sharding.h"

namespace fcp::plan {

/// Limits buildPlan and validate enforce (ids are int32; stages are stored per worker).
inline constexpr int64_t kMaxWorkers = int64_t{1} << 24;
inline constexpr int64_t kMaxCoalesce = int64_t{1} << 20;
inline constexpr int64_t kMaxBufferDepth = 1024;

/// Cost-aware blocks: a block costing more than this fraction of a worker's share (total cost
/// / workers) is "giant"; see PlanConfig::costAwareBlocks.
inline constexpr double kCostCutShare = 0.25;

/// How blocks are cut and placed.
enum class Placement {
  /// Locality first (the default): sharding follows the user layout (shardBatchForLayout),
  /// every block starts where its tokens are, and only the work balance needs moves
  /// (assignBlocksNearHome). When that cannot balance as well as the paper's method, the
  /// paper's method is used instead (the plan's `placement` says which).
  kLocal,
  /// The paper's §4.1: Zig-Zag sharding, the LPT greedy and its improvement pass, then the
  /// communication balancing and the locality relabelling (when `locality`).
  kLpt,
};
std::string_view placementName(Placement placement);
/// Throws Error(kInvalidArgument) naming `name` unless it is "local" or "lpt".
Placement parsePlacement(std::string_view name);

/// The largest PlanConfig::commRatio (cost units per byte), and of fcp run's --comm-ratio (FLOP
/// per byte).
inline constexpr double kMaxCommRatio = 1e5;

/// Everything the planner was asked for.
struct PlanConfig {
  int64_t numWorkers = 16;
  /// Tokens each worker holds in the user layout; also the default memory budget M.
  int64_t tokensPerWorker = 32 * 1024;
  int64_t blockSize = 4 * 1024;
  /// M in Algorithm 1; 0 means tokensPerWorker.
  int64_t memoryLimitTokens = 0;
  double memorySlack = 0.1;
  double alpha = 1.0;
  double beta = 1.0;
  double improveTarget = 0.001;
  int64_t improveStepsPerBlock = 4;
  /// Rounds merged into one pipeline stage (the bottom-up coalescer).
  int64_t coalesce = 16;
  /// Groups of remote KV a worker may hold at once; 2 is the least that overlaps.
  int64_t bufferDepth = 3;
  Placement placement = Placement::kLocal;
  /// Local placement: how far above the lower bound the busiest worker may stay rather than
  /// move another block (see assignBlocksNearHome); the paper's placement is used instead if
  /// it balances better than this.
  double localitySlack = 0.01;
  /// How slow the link is against compute: the cost units a worker gets through in the time
  /// one byte crosses its link. A pair's cost is its forward FLOPs at the kernels' peak (the
  /// backward, 2.5x that, is proportional), so this is peak FLOP/s / 3.5 over link bytes/s
  /// when the backward runs at the forward's efficiency (GPU-X's 5920 FLOP per byte: about
  /// 1700); `fcp run --comm-ratio` measures it for its capped link. 0 (the default): unknown,
  /// and the local placement must balance compute as well as the paper's. Above 0, where the
  /// paper's placement is bound by its bytes (its busiest worker's bytes x this ratio at least
  /// its busiest cost), the placement with the least estimated step time (both passes' stages,
  /// each as long as the longest of its compute and its bytes over the link at 3.5 times this
  /// ratio, and the reshuffle) wins among the paper's, the local one and the local one with
  /// every block at home: where bytes dominate, fewer bytes are worth more compute.
  double commRatio = 0;
  /// With the LPT placement, the locality relabelling: the distributor's workers are
  /// interchangeable (any relabelling of them balances the same), so they are relabelled to keep
  /// blocks where the user layout already holds most of their tokens, shrinking the reshuffle.
  bool locality = true;
  /// Communication balancing: after the distributor, blocks of near-equal cost are swapped
  /// to lower the busiest worker's transfer bytes, letting compute rise to at most this
  /// fraction above the lower bound (never above the distributor's own busiest worker if
  /// that is higher). Negative turns it off.
  double commBalanceSlack = 0.002;
  /// Cost-aware blocks: when the busiest worker ends well above the lower bound and some
  /// blocks cost a large fraction of a worker's share, their sequences are cut into smaller
  /// blocks and placed again; the finer plan is kept only if its busiest worker costs less
  /// (smaller blocks run less efficiently, so cutting raises the total cost).
  bool costAwareBlocks = true;
  AttentionConfig attention;
  /// The user layout: worker r holds tokens [userStarts[r], userStarts[r + 1]) of the packed
  /// batch (N + 1 non-decreasing entries from 0 to the batch's tokens; a worker may hold none
  /// and a slice may start mid-sequence). Empty means the even split, userLayoutStarts.
  std::vector<int64_t> userStarts;

  int64_t memoryLimit() const {
    return memoryLimitTokens > 0 ? memoryLimitTokens : tokensPerWorker;
  }
  friend bool operator==(const PlanConfig&, const PlanConfig&) = default;
};

/// The Block Distributor's options for a plan of `config`: its workers, the memory cap
/// (memoryLimit() and memorySlack; memoryCapTokens, safeBlockTokens) and the balancing knobs.
DistributorOptions distributorOptions(const PlanConfig& config);

/// One worker's load in the FCP layout.
struct WorkerLoad {
  int64_t numTokens = 0;
  double cost = 0;  ///< forward cost of the pairs whose Q block it owns
  friend bool operator==(const WorkerLoad&, const WorkerLoad&) = default;
};

struct Plan {
  /// Which planner made it: "fcp", or a baseline's name.
  std::string strategy = "fcp";
  /// Whether transfers are ordered into congestion-free rounds: each round a matching, and
  /// exactly Δ of them. Baselines without that ordering (an all-to-all per stage) set false;
  /// validate then checks everything else.
  bool congestionFree = true;
  PlanConfig config;
  Batch batch;
  std::vector<Block> blocks;
  std::vector<BlockPair> pairs;   ///< sorted by (qBlock, kvBlock); computed by the Q block's owner
  std::vector<int32_t> owner;     ///< block -> worker
  std::vector<WorkerLoad> loads;  ///< per worker, derived from blocks, pairs and owner
  double lowerBound = 0;          ///< LB = max(largest block cost, total cost / workers)
  double greedyMaxCost = 0;       ///< busiest worker's cost before the improvement pass
  int64_t improveSteps = 0;
  int64_t commBalanceSteps = 0;  ///< swaps applied by communication balancing
  /// Tokens the reshuffle would move off-worker without the locality relabelling.
  int64_t movedTokensWithoutLocality = 0;
  /// The placement that made `owner`: config.placement, or kLpt where kLocal fell back.
  Placement placement = Placement::kLpt;
  /// kLocal: blocks moved off their home workers to balance work.
  int64_t localityMoves = 0;
  /// The block size the sharding used: config.blockSize, or smaller when the memory cap could
  /// not place blocks of that size (every block of the batch is then cut finer, down to a
  /// size that always packs: safeBlockTokens). 0 in plans saved before it was recorded.
  int64_t shardBlockSize = 0;
  /// Shardings the memory cap refused before this one.
  int64_t memoryRetries = 0;
  /// Sequences given blocks smaller than shardBlockSize by cost-aware blocks (their blocks
  /// cost a large fraction of a worker's share, or the blocks were too coarse to balance).
  int64_t costCutSequences = 0;
  /// The smallest block size any sequence was given (shardBlockSize when none was cut).
  int64_t smallestBlockSize = 0;
  /// The pack size memory-aware packing chose (smaller packed blocks of short sequences fill
  /// the room the memory cap leaves; see shardBatch), shardBlockSize when it did not run: no
  /// block of packed short sequences holds more tokens.
  int64_t packedBlockSize = 0;

  std::vector<Transfer> transfers;           ///< sorted by (block, receiver)
  int32_t numRounds = 0;                     ///< Δ of the transfer graph
  Stages forward;                            ///< [worker][stage]
  Stages backward;                           ///< [worker][stage]
  /// Inward reshuffle, sorted by begin; the outward one is the same pieces reversed.
  std::vector<ReshufflePiece> reshuffle;

  friend bool operator==(const Plan&, const Plan&) = default;
};

/// Wall-clock time of each planning phase, in milliseconds. Kept out of `Plan`, which must be
/// identical on every rank. Large plans build the two placements on two threads: shardMs and
/// assignMs then add up both placements' times, which overlapped, so the phases may sum above
/// totalMs.
struct PlanTimings {
  double shardMs = 0;
  double assignMs = 0;  ///< the Block Distributor (greedy and improvement)
  /// Communication balancing, the locality relabelling and the choice between the two
  /// placements; where that choice times their forward passes (pipelineSpan), the transfers,
  /// colouring and stages it builds for both are in here too, and the phases below are then
  /// about 0. So is timing the cost-aware cuttings of the paper's placement, which may overlap
  /// the local placement's shard and assign.
  double balanceMs = 0;
  double transfersMs = 0;
  double colorMs = 0;
  /// The stages once the rounds are set. Their transfer and pair lists are built beside the
  /// colouring (on the reshuffle's thread for large plans) and counted in no phase.
  double scheduleMs = 0;
  double totalMs = 0;
};

/// Shards `batch`, builds its pairs and assigns blocks to workers. Always finds a plan when the
/// batch fits in workers x cap tokens: blocks the cap cannot place are cut finer (the plan's
/// shardBlockSize and memoryRetries say so). Throws Error(kInvalidArgument) for bad
/// configuration, a batch over workers x cap tokens, or one that needs more than kMaxPairs
/// block pairs.
Plan buildPlan(const Batch& batch, const PlanConfig& config, const CostModel& costModel,
               PlanTimings* timings = nullptr);

/// Per-worker loads recomputed from a plan's blocks, pairs and owners.
std::vector<WorkerLoad> computeLoads(const Plan& plan);

/// Bytes one worker sends and receives in one pass, by kind: the reshuffle in and out of the
/// FCP layout (transparent layout, once per layer; forward Q, K, V in and O, LSE out; backward
/// dO in and dQ, dK, dV out) and the KV transfers (backward: KV again, and the fp32 dK/dV
/// partials going back). These are the bytes the runtime puts on the wire.
struct PassTraffic {
  int64_t reshuffleSent = 0;
  int64_t reshuffleReceived = 0;
  int64_t kvSent = 0;
  int64_t kvReceived = 0;
  int64_t sent() const { return reshuffleSent + kvSent; }
  int64_t received() const { return reshuffleReceived + kvReceived; }
  /// What bounds the pass's time on a full-duplex link: the larger direction.
  int64_t busier() const { return std::max(sent(), received()); }
  friend bool operator==(const PassTraffic&, const PassTraffic&) = default;
};
struct WorkerTraffic {
  PassTraffic forward;
  PassTraffic backward;
};
/// Per worker, from the plan's reshuffle pieces and transfers.
std::vector<WorkerTraffic> computeTraffic(const Plan& plan);

/// Summary numbers of a plan.
struct PlanStats {
  double computeImbalance = 0;  ///< (max - mean) / max of worker cost
  double memoryImbalance = 0;   ///< (max - mean) / max of worker tokens
  double lowerBoundGap = 0;     ///< max cost / LB - 1
  /// memoryAwareLowerBound of the plan's blocks under its cap (>= LB): no assignment of these
  /// blocks has a busiest worker below it.
  double memoryLowerBound = 0;
  double memoryBoundGap = 0;  ///< max cost / memoryLowerBound - 1
  int64_t maxWorkerTokens = 0;
  int64_t memoryCapTokens = 0;
  double totalForwardFlops = 0;
  int64_t commBytes = 0;     ///< forward KV bytes sent over the network
  double commImbalance = 0;  ///< (max - mean) / max of bytes sent + received per worker
  /// commFloorBytes under the plan's memory cap (or its fullest worker, if above) and its
  /// busiest worker's cost: no placement of these blocks as balanced in compute, sending each
  /// KV block from its owner (no relays), moves fewer bytes at its busiest worker.
  int64_t commFloorBytes = 0;
  /// 1 - mean / commFloorBytes (0 when the floor is at or under the mean): a lower bound on
  /// commImbalance for any such placement moving no more bytes in all than this plan.
  double commImbalanceFloor = 0;
  int64_t reshuffleBytes = 0;  ///< forward: Q, K, V in and O out, off-worker pieces only
  int64_t reshuffleBytesWithoutLocality = 0;  ///< the same without the locality relabelling
  int64_t maxWorkerCommBytes = 0;  ///< weighted bound: most bytes a worker sends or receives
  int64_t sortedRoundBound = 0;    ///< weighted bound: Σ_k ((k−1)N+1)-th largest transfer
  int64_t sumRoundMaxima = 0;      ///< Σ over rounds of the largest transfer
  int32_t maxDegree = 0;
  int32_t numForwardStages = 0;
  /// Every byte sent in a step (both passes, reshuffle and KV, all workers).
  int64_t stepBytes = 0;
  /// The busiest worker's bytes: max over workers of Σ over passes of the busier direction.
  int64_t maxWorkerStepBytes = 0;
};
PlanStats computeStats(const Plan& plan);

/// A floor on the busiest worker's KV bytes (sent plus received, as PlanStats::commImbalance
/// counts them) over every placement of `plan`'s blocks in which no worker holds more than
/// `capTokens` tokens or costs more than `maxCost`, each KV block sent by its owner to every
/// other worker holding a Q block that reads it (no relays): for each block, what its holder
/// must receive (the KV its Q reads, less what fits beside it) and send (to at least as many
/// other workers as its readers need, by their tokens and cost). It depends on the blocks, not
/// on where the plan put them. 0 when a transfer of the plan is relayed (sent by a worker
/// other than its block's owner, as ring attention's baselines do). O(pairs log pairs).
/// Throws Error(kInvalidArgument) for a cap under 1 token, a negative or NaN cost, or pairs
/// not in strict (Q block, KV block) order.
int64_t commFloorBytes(const Plan& plan, int64_t capTokens, double maxCost);

/// Every violated invariant, one sentence each; empty when the plan is valid. Checks: each
/// token of each sequence in exactly one block, each block on one worker, memory cap held,
/// loads consistent, every (Q chunk, KV chunk) pair the mask needs computed exactly once (and
/// no pair that needs nothing); transfers exactly those needed, each round a matching, rounds
/// = Δ; in both passes every pair computed once by its Q owner after its KV arrived, every
/// transfer (and backward, every dK/dV partial) sent once and received once, at most
/// `coalesce` per worker and stage, buffers never over depth; the reshuffle moves every token
/// exactly once each way. And the plan's own numbers: its configuration inside the ranges the
/// planner and its flags accept (fcp/plan/limits.h), a known strategy, pair costs finite and
/// >= 0, counters >= 0, and (FCP plans) the lower bound equal to the one its pair costs give.
std::vector<std::string> validate(const Plan& plan);

/// A plan's pair costs against `costModel` (whose attention must be the plan's): every pair's
/// cost as blockPairs computes it, within a relative 1e-9. For plans read from a file, after
/// `validate`: a plan made with one efficiency curve fails under another.
std::vector<std::string> validateCosts(const Plan& plan, const CostModel& costModel);

/// Throws Error(kInvalidPlan) listing the first violations unless `validate` finds none.
void checkValid(const Plan& plan);

}  // namespace fcp::plan
