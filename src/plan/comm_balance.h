#pragma once
// Private to the plan module: evening out communication after the distributor.

#include <cstdint>

#include "fcp/plan/plan.h"

namespace fcp::plan::detail {

/// balanceCommunication stops once (max − mean) / max of the per-worker bytes is this low.
inline constexpr double kCommTargetImbalance = 0.03;

/// How balanceCommunication looks for a swap. kBounded (the planner's) does not try a swap
/// when a floor on the busiest worker's bytes after it, read without moving anything, shows
/// it cannot lower them; kEvery tries each one, and checks after each that the floor was not
/// above the bytes it got. Without a work limit (maxWork = INT64_MAX) both keep the same swaps:
/// kEvery is the reference for tests. With one, kEvery, which tries more, may stop sooner.
enum class SwapSearch { kBounded, kEvery };

/// The work balanceCommunication may do on a plan of `pairs` pairs, in pair entries moved by
/// its swaps, tried or kept (one per pair of a block moved, and one per worker reading it):
/// 16 × pairs + 2^24, sixteen passes over the pairs and room for small plans. Each swap tried
/// moves both blocks there and back with all their pairs; where a block pairs with thousands
/// (one sequence of 23.7M tokens in 4K blocks on 16 workers), the balancer's 15 swaps cost
/// 5.5e9 entries and 42 s. The plans of the workloads here stay far below it (at most 2.4e6,
/// 8 to 4096 workers).
int64_t balanceWorkBudget(size_t pairs);

/// Lowers the largest per-worker communication (bytes sent plus received by KV transfers) by
/// swapping blocks of near-equal cost between the busiest-communicating worker and others.
///
/// Terms. need[k][w] counts worker w's Q blocks that pair with KV block k; block k is sent to
/// every w != owner(k) with need > 0 (one transfer). A swap exchanges block b of the worker
/// with the most communication for block b' elsewhere; it is kept when compute stays at most
/// `computeCap` and memory at most `memoryCap` on both workers, and the largest communication
/// over all workers drops (third parties can change too: the owners of the blocks b's pairs
/// read). Typically a sequence block goes out and a packed block of short sequences, which
/// needs no transfers, comes in. Partners are searched among the blocks nearest b in cost.
/// Deterministic; at most `maxSteps` swaps. The work limit (`maxWork`, -1 for
/// balanceWorkBudget(pairs)) is looked at after each trial swap that does not help: past it,
/// the balancer stops there, undone trial and all, keeping the swaps it made. So it makes the
/// first swaps of a run without the limit; a trial that helps is kept whatever the work, and one
/// trial may pass the limit by its blocks' pairs. Plan::loads is not updated: recompute it.
/// `search`: see SwapSearch.
int64_t balanceCommunication(Plan& plan, const std::vector<double>& blockCost, double computeCap,
                             int64_t memoryCap, int64_t maxSteps,
                             SwapSearch search = SwapSearch::kBounded, int64_t maxWork = -1);

/// How commFloorBytes looks for the block whose holder must move the most. kBounded (the
/// planner's) costs blocks in descending order of an upper bound on their value and stops once
/// that bound cannot raise the floor; kEvery costs every block. Both give the same floor:
/// kEvery is the reference for tests.
enum class FloorSearch { kBounded, kEvery };

/// fcp::plan::commFloorBytes, searching as `search` says.
int64_t commFloorBytes(const Plan& plan, int64_t capTokens, double maxCost, FloorSearch search);

}  // namespace fcp::plan::detail
