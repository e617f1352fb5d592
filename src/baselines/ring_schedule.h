#pragma once
// Shared by the ring-based baselines (ring, ByteScale, Megatron dynamic CP) and the others:
// everything a Plan needs once its blocks and owners are fixed.

#include <cstdint>
#include <vector>

#include "fcp/core/cost_model.h"
#include "fcp/plan/plan.h"

namespace fcp::baselines::detail {

/// Checks the parts of a baseline's config every planner needs; throws Error(kInvalidArgument).
void checkBaselineConfig(const Batch& batch, const plan::PlanConfig& config);

/// Starts a plan for `strategy`: config, batch, blocks, their pairs under `costModel`, owner.
plan::Plan startPlan(const char* strategy, const Batch& batch, const plan::PlanConfig& config,
                     const CostModel& costModel, std::vector<plan::Block> blocks,
                     std::vector<int32_t> owner);

/// Ring schedule. `rings` partitions (some of) the workers into rings, each listed in ring
/// order; every block's owner must be in a ring, and every worker that needs the block in the
/// owner's ring. A block travels its ring one hop per round: the receiver at ring distance d
/// from the owner gets it in round d−1 from the nearest receiver before it on the ring (a
/// relay), or from the owner if there is none. Each round is one stage (coalesce 1); the
/// receiver computes with the block in the next stage and frees it once it has also passed it
/// on. Local pairs run in stage 0. Backward, a dK/dV partial goes back to its sender in the
/// stage after its last use, and a relay returns its own only after the one it relayed came
/// back. Sets transfers, rounds, stages, reshuffle, loads; raises coalesce and buffer depth
/// when a degenerate chain needs it; clears congestionFree if a round is not a matching or
/// rounds ≠ Δ.
void scheduleRings(plan::Plan& plan, const std::vector<std::vector<int32_t>>& rings);

/// Sets loads and the reshuffle, and raises the memory limit to the busiest worker's tokens
/// if needed (baselines have no memory cap of their own).
void finishLayout(plan::Plan& plan);

/// Raises coalesce and buffer depth to what the stages use, and clears congestionFree when the
/// rounds are not matchings or not Δ of them.
void fitLimits(plan::Plan& plan);

}  // namespace fcp::baselines::detail

namespace fcp::baselines::detail {

/// A plan in which each group of workers runs ring attention with Zig-Zag over its own
/// sequences: group members [m_0..m_{g−1}] cut each of their sequences into 2g chunks and m_i
/// holds chunks i and 2g−1−i of each (one block per worker). Every sequence must be in exactly
/// one group; groups must be disjoint.
plan::Plan groupRingPlan(const char* strategy, const Batch& batch, const plan::PlanConfig& config,
                         const CostModel& costModel, const std::vector<std::vector<int32_t>>& groups,
                         const std::vector<std::vector<int32_t>>& sequencesOfGroup);

}  // namespace fcp::baselines::detail
