#pragma once
/// The Communication Planner's steps (§4.2, §4.3), public so that other planners (the
/// baselines) can build the parts of a Plan they share with FCP. buildPlan runs them in this
/// order: relabelForLocality (optional), buildTransfers, then colorTransfers beside
/// buildReshuffle and the part of buildStages that needs no rounds, then the rest of
/// buildStages.

#include <cstdint>
#include <vector>

#include "fcp/plan/plan.h"

namespace fcp::plan {

/// First token of each user-layout worker's slice of the packed stream, N + 1 entries:
/// worker r holds [start[r], start[r + 1]) = [floor(r T / N), floor((r + 1) T / N)).
std::vector<int64_t> userLayoutStarts(int64_t numTokens, int64_t numWorkers);

/// The user layout of `numTokens` tokens under `config`: config.userStarts, or the even split
/// when that is empty.
std::vector<int64_t> userLayout(const PlanConfig& config, int64_t numTokens);
/// The plan's user layout (the same, for its batch).
std::vector<int64_t> userLayout(const Plan& plan);

/// Throws Error(kInvalidArgument) unless `starts` is a user layout of `numTokens` tokens over
/// `numWorkers` workers (see PlanConfig::userStarts), naming the first bad entry.
void checkUserLayout(const std::vector<int64_t>& starts, int64_t numTokens, int64_t numWorkers);

/// First token of each sequence in the packed stream, numSequences + 1 entries.
std::vector<int64_t> sequenceStarts(const Batch& batch);

/// Renames the workers of Plan::owner so that as many tokens as possible stay where the user
/// layout holds them: a greedy maximum-weight matching of FCP workers to user workers, heaviest
/// (tokens in common) first, ties to lower ids. Loads move with their workers, so balance is
/// unchanged (Plan::loads, when it holds one per worker, is permuted); transfers and reshuffle
/// pieces already built are renamed too (as if built after it), and the stages must not be
/// built yet. Returns the tokens that moved off-worker before
/// the relabelling.
int64_t relabelForLocality(Plan& plan);

/// Tokens of `pieces` whose user and FCP workers differ.
int64_t movedTokens(const std::vector<ReshufflePiece>& pieces);

/// The inward reshuffle: every block's tokens cut at user-slice boundaries, sorted by begin.
std::vector<ReshufflePiece> buildReshuffle(const Plan& plan);

/// Each (KV block, worker owning a Q block that attends to it) once, sorted by (block,
/// receiver), sent by the block's owner; rounds not yet set.
std::vector<Transfer> buildTransfers(const Plan& plan);

/// Index of the transfer of `block` to `receiver` in transfers sorted by (block, receiver),
/// or -1.
int32_t findTransfer(const std::vector<Transfer>& transfers, int32_t block, int32_t receiver);

/// Sets Plan::numRounds and each transfer's round with the congestion-free solver.
void colorTransfers(Plan& plan);

/// Fills Plan::forward and Plan::backward from the transfers' rounds, coalesce and buffer
/// depth (see schedule.h for the pipeline's shape).
void buildStages(Plan& plan);

/// How long the forward pass takes, in cost units, if moving data took no time: stage s of
/// worker w starts when its stage s − 1 has ended, and ends once its pairs are computed (their
/// costs in turn) and each transfer it sends or receives has started, which is when the
/// other end has entered the stage holding it (each end posts a transfer as it enters that
/// stage: the runtime's order, and the simulator's). For stages that compute every pair once
/// (as validate checks), never below the busiest worker's cost (up to rounding); above it when
/// some worker waits for a partner to reach a stage, as with contiguous causal blocks, where
/// the holders of a sequence's late blocks wait for its early ones. Throws Error(kInvalidPlan)
/// when the forward stages do not cover the plan's workers, name a transfer or pair the plan
/// does not have, send or receive a transfer twice or never, or wait on each other in a
/// cycle.
double pipelineSpan(const Plan& plan);

}  // namespace fcp::plan
