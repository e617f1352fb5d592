#pragma once
/// The Block Distributor (§4.1, Appendix A, Algorithm 1): which worker owns each block.
///
/// Terms: block i has memory m_i (tokens) and compute c_i (cost); worker w has loads m_w, c_w;
/// m̂ and ĉ are the per-worker averages; the memory cap is floor(M · (1 + δ)) tokens.
/// Greedy: blocks in descending max(m_i / m̂, c_i / ĉ), each to the worker minimising
/// max(α (m_w + m_i) / m̂, β (c_w + c_i) / ĉ) among those under the cap (ties: lowest id).
/// Improvement: while the busiest worker is above LB · (1 + target), the best single move or
/// swap off it that lowers the larger of the two workers' loads is applied. LB = max(largest
/// c_i, Σ c_i / N) bounds every assignment's busiest worker from below.
///
/// The greedy finds the exact argmin with workers kept ordered by α m_w / m̂ − β c_w / ĉ
/// (where the score switches between its two terms) in about 2√N sorted buckets read through
/// groups of 8, O(√N) per block with small constants; ties go to the lowest worker id. The
/// improvement pass searches a segment tree over workers (least compute, least memory, most compute
/// per subtree). Neither scans full workers one by one. The improvement pass is bounded by a step
/// count, not by time, so every rank stops at the same plan.

#include <cstdint>
#include <optional>
#include <vector>

namespace fcp::plan {

struct DistributorOptions {
  int64_t numWorkers = 1;
  /// M: the per-worker memory budget in tokens.
  int64_t memoryLimitTokens = 0;
  /// δ: tolerated overshoot of M.
  double memorySlack = 0.1;
  double alpha = 1.0;  ///< weight of memory in the greedy's score (> 0)
  double beta = 1.0;   ///< weight of compute in the greedy's score (> 0)
  /// Stop improving once the busiest worker is within this fraction above LB.
  double improveTarget = 0.001;
  /// At most this many improvement steps per block (a deterministic budget).
  int64_t improveStepsPerBlock = 4;
  /// assignBlocksNearHome: how far above LB the busiest worker may stay rather than move
  /// another block (fewer bytes for a little compute).
  double localitySlack = 0.01;
};

struct Assignment {
  std::vector<int32_t> owner;  ///< block -> worker
  double lowerBound = 0;       ///< LB as defined above
  double greedyMaxCost = 0;    ///< busiest worker after the greedy, before improvement
  int64_t improveSteps = 0;    ///< improvement steps applied
  /// Of those, the trades and chains: the steps taken when no single move or swap lowers the
  /// busiest worker, each of which weighs every worker.
  int64_t tradeSteps = 0;
  /// The greedy found no room for some block (large blocks against a tight cap) and moves and
  /// swaps had to bring every worker back under the cap before the improvement pass.
  bool memoryRepaired = false;
  /// assignBlocksNearHome: blocks moved off their home workers to shed excess work.
  int64_t localityMoves = 0;
  /// Internal: the first block the greedy found no room for when its repair got stuck.
  int32_t firstHomeless = -1;
};

/// Throws Error(kInvalidArgument) naming the first option out of range.
void checkDistributorOptions(const DistributorOptions& options);

/// The cap in tokens: floor(M · (1 + δ)).
int64_t memoryCapTokens(const DistributorOptions& options);

/// From how many workers the improvement pass's trade search may use a second thread
/// (FCP_PLAN_THREADS, as buildPlan); the assignment is the same on one thread or two.
inline constexpr int64_t kParallelTradeWorkers = 1024;

/// Assigns blocks with memories `tokens` and costs `costs` (same length) to workers.
/// Throws Error(kInvalidArgument) when options are out of range, a block has negative tokens
/// or a cost that is negative or not finite, a block or the whole batch cannot fit under the
/// cap, the greedy met a block no worker had room for and no moves or swaps could make room
/// (naming the block), or (from kParallelTradeWorkers workers) FCP_PLAN_THREADS is invalid.
Assignment assignBlocks(const std::vector<int64_t>& tokens, const std::vector<double>& costs,
                        const DistributorOptions& options);

/// assignBlocks without the error for a batch that fits the cap in total but whose blocks do
/// not pack under it: nullopt when a block is over the cap or the greedy met a block no
/// worker had room for and no moves or swaps could make room; that block's index goes to
/// `unplaced` when given. Blocks of at most safeBlockTokens tokens always pack. Still throws
/// for the other errors of assignBlocks.
std::optional<Assignment> tryAssignBlocks(const std::vector<int64_t>& tokens,
                                          const std::vector<double>& costs,
                                          const DistributorOptions& options,
                                          int32_t* unplaced = nullptr);

/// The largest block size (tokens) at which the greedy provably finds room for every block of
/// a batch of `batchTokens` tokens: g = floor((N (cap + 1) - T - 1) / (N - 1)) (the cap when
/// N = 1), at least 1 when T <= N x cap, 0 when the batch does not fit at all. Why: a block of
/// m tokens finds no room only if every worker holds more than cap - m, i.e. the other blocks
/// hold at least N (cap - m + 1) <= T - m tokens, impossible when (N - 1) m < N (cap + 1) - T.
int64_t safeBlockTokens(int64_t batchTokens, const DistributorOptions& options);

/// A lower bound on the busiest worker's cost of every assignment of these blocks to
/// `numWorkers` workers under `cap` tokens each; at least LB = max(largest cost, total / N).
/// LB ignores memory; this counts it. Take the g costliest blocks G (each g from 1 to N).
/// Either some worker holds two of them (it costs at least the two cheapest of G), or g
/// workers hold one each; the other N - g workers then hold at most (N - g) cap tokens, so the
/// holders carry at least E = T - (N - g) cap - (tokens of G) more tokens between them, which
/// cost at least the cheapest cover of E tokens by blocks in order of cost per token (a block
/// counted in part). The busiest holder costs at least (cost of G + that cover) / g. So every
/// assignment is above min(two cheapest of G, that average) for every g. It matters where
/// giant blocks (each near a worker's share) leave their holders room the other workers
/// cannot absorb (docs/planner.md). Sums run in a fixed order: every rank gets the same
/// number. `tokens` and `costs` have the same length; O(B log B).
double memoryAwareLowerBound(const std::vector<int64_t>& tokens, const std::vector<double>& costs,
                             int64_t numWorkers, int64_t cap);

/// Locality first: every block starts on `home[i]` (the worker whose user-layout slice holds
/// its tokens), so nothing moves unless balance needs it. If the layout puts a worker over the
/// cap, moves and swaps first bring it under (as the greedy's repair does). Then every worker
/// above LB · (1 + improveTarget) sheds work, in descending load: its densest blocks first (the
/// most cost per token, so the fewest tokens move), each to the least-loaded worker with room
/// that stays under the target, skipping blocks larger than what is left to shed; then, if it
/// is still above LB · (1 + localitySlack), the block with the fewest tokens that brings it
/// under. The improvement pass above then runs with LB · (1 + localitySlack) as its target
/// (greedyMaxCost is the home assignment's busiest worker). Same checks and errors as
/// assignBlocks.
Assignment assignBlocksNearHome(const std::vector<int64_t>& tokens,
                                const std::vector<double>& costs,
                                const std::vector<int32_t>& home,
                                const DistributorOptions& options);

/// assignBlocksNearHome without the error for blocks that do not pack, as tryAssignBlocks.
std::optional<Assignment> tryAssignBlocksNearHome(const std::vector<int64_t>& tokens,
                                                  const std::vector<double>& costs,
                                                  const std::vector<int32_t>& home,
                                                  const DistributorOptions& options,
                                                  int32_t* unplaced = nullptr);

}  // namespace fcp::plan
