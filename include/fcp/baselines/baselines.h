#pragma once
/// The baselines FCP is compared with (paper §6, Appendix "Detailed Configurations of
/// Baselines"), each a planner emitting a `Plan` that `validate` accepts, so one executor and
/// one simulator run every strategy. Each ignores the FCP-only parts of PlanConfig (block
/// distributor weights, locality) and sets its own coalesce and buffer depth; where its layout
/// holds more tokens on a worker than the memory limit, the limit is raised to that (the
/// baselines have no cap of their own).

#include <functional>
#include <string>
#include <vector>

#include "fcp/baselines/ring.h"
#include "fcp/core/cost_model.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"

namespace fcp::baselines {

/// ByteScale, HDP-balanced (its Algorithm 2 without pipeline parallelism): with C the
/// average tokens per worker, a sequence longer than C gets its own group of ceil(L / C)
/// consecutive workers (k× longer, k× more workers) and runs ring attention (Zig-Zag) inside
/// it; every worker left over is a group of one, and the shorter sequences go, longest first,
/// to the group with the least compute per worker among those with room for them (else the
/// least tokens per worker). Strategy "bytescale".
plan::Plan bytescalePlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel);

/// Megatron-style dynamic CP: each sequence's CP size is the power of two
/// ≥ ceil(L / tokensPerWorker) (at most the largest power of two ≤ N); sequences, longest
/// first, join the least-loaded (fewest tokens) group of their size that has room, else open a
/// new aligned group of that size, else join the least-loaded group of at least that size.
/// Ring attention (Zig-Zag) runs inside each group. Strategy "megatron".
plan::Plan megatronPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel);

/// MagiAttention-like, configured as MagiAttention's own distributed benchmark runs it
/// (exps/dist_attn/benchmark_conf.py: chunk_size 2048, MinHeapDispatchAlg, overlap degree 2):
/// the packed stream cut into contiguous 2048-token chunks (a chunk may hold the end of one
/// sequence and the start of the next), each a block; a min-heap greedy gives each block,
/// largest compute area (visible entries) first, to the worker with the least area so far,
/// ignoring communication. Remote KV moves in `kMagiStages` all-to-all-v stages (each
/// receiver's needed blocks split evenly over them, in block order), overlapped with the
/// previous stage's compute, with no congestion-free ordering (congestionFree = false).
/// Strategy "magi".
inline constexpr int64_t kMagiChunkTokens = 2048;
inline constexpr int32_t kMagiStages = 2;
plan::Plan magiPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel);

/// Estimates a plan's step time (lower is better); WLB-LLM's oracle.
using PlanOracle = std::function<double(const plan::Plan&)>;

/// WLB-LLM as the paper runs it: per batch, the better by `oracle` of per-document sharding
/// (ring attention) and per-sequence sharding (ByteScale). Strategy "wlb"; the chosen plan is
/// otherwise unchanged.
plan::Plan wlbPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel,
                   const PlanOracle& oracle);

/// The paper's ablation (§6.5, Table ablation): FCP with its components added one at a time.
/// step 0 "base": FCP's blocks and assignment, all transfers fetched before any compute, in
///   each sender's own order (no pipelining, no congestion-free rounds, no coalescing);
/// step 1 "+pipelining": one transfer per sender per round in sender order, coalesce 1;
/// step 2 "+congestion-free": rounds from the congestion-free solver, coalesce 1;
/// step 3 "+coalescer": config.coalesce rounds per stage;
/// step 4 "+reshuffler": the locality relabelling (steps 0-3 use the plain layout); the caller
///   also overlaps the reshuffle with the first and last stage only at step 4.
/// Steps 0 and 1 may break validate's per-stage receive limit (that is what they model).
plan::Plan fcpAblationPlan(const Batch& batch, const plan::PlanConfig& config,
                           const CostModel& costModel, int step);

/// Head-parallel strategies, which move heads rather than KV blocks and so are no Plan of their
/// own: a plan over groups of `degree` consecutive workers with one worker's head share
/// (fcp::headShare), which sim::simulateHeadParallel times with the groups' all-to-alls. A
/// group never straddles a node part-way: each sits inside one node or is whole nodes.
/// - "ulysses": DeepSpeed-Ulysses; one group of every worker (a ring of one), so the workers
///   must divide the query heads and divide or be a multiple of the key/value heads.
/// - "usp": USP (Unified Sequence Parallelism, yunchang's long-context-attention): Ulysses
///   inside each group, Zig-Zag ring attention across the groups. Its degree is the user's to
///   tune: given an `oracle`, the degree of the least oracle time among every legal one (the
///   smallest on a tie); without, the largest legal degree within a node, as its authors
///   advise.
/// - "fcp+ulysses": FCP as its paper deploys it on rail-optimised clusters ("we enable Ulysses
///   with FCP to avoid two-hop communication"): Ulysses inside a node at the largest legal
///   degree within it, never tuned, and FCP's planner across the groups, each group one FCP
///   worker holding its members' tokens (tokens per worker × degree: the same memory per
///   member) with one member's heads.
/// A `degree` other than 0 fixes usp's and fcp+ulysses's degree instead (Error
/// kInvalidArgument unless it is a legal one); ulysses ignores it.
/// The ring and ulysses keep the other baselines' rules: no memory cap, Zig-Zag pieces of each
/// sequence across the ring.
struct HeadParallelPlan {
  /// The plan over the groups, with one member's heads: Zig-Zag ring attention (strategy
  /// "ring"), or FCP's ("fcp"), which plan::validate accepts as such.
  plan::Plan ring;
  int64_t degree = 1;
};
/// Throws Error(kInvalidArgument), naming them, unless `degree` is a legal Ulysses degree for
/// `name` (usp or fcp+ulysses) on `workers` workers: a divisor of the workers that splits the
/// heads (fcp::headShare), its groups of consecutive workers each inside a node or whole nodes.
void checkUlyssesDegree(const std::string& name, int64_t degree, int64_t workers,
                        int64_t workersPerNode, const AttentionConfig& attention);
/// Estimates a head-parallel plan's step time (lower is better); USP's choice of degree.
using HeadParallelOracle = std::function<double(const HeadParallelPlan&)>;
HeadParallelPlan headParallelPlan(const std::string& name, const Batch& batch,
                                  const plan::PlanConfig& config, const CostModel& costModel,
                                  int64_t workersPerNode, const HeadParallelOracle& oracle = {},
                                  int64_t degree = 0);

/// Names accepted by headParallelPlan: ulysses, usp, fcp+ulysses.
const std::vector<std::string>& headParallelNames();

/// Names accepted by makePlan: fcp, ring, bytescale, wlb, magi, megatron.
const std::vector<std::string>& strategyNames();

/// Builds the plan of strategy `name` (one of strategyNames(), or fcp-base, fcp-pipeline,
/// fcp-cfree, fcp-coalesce for the ablation steps 0-3). `oracle` is needed for "wlb" only.
/// Throws Error(kInvalidArgument) for an unknown name.
plan::Plan makePlan(const std::string& name, const Batch& batch, const plan::PlanConfig& config,
                    const CostModel& costModel, const PlanOracle& oracle = {});

}  // namespace fcp::baselines
