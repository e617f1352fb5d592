#pragma once
/// Ring Attention with Zig-Zag, as TransformerEngine runs it in p2p mode (paper, Appendix
/// "Detailed Configurations of Baselines"): every sequence is cut into 2P chunks and rank r
/// holds chunks r and 2P−1−r of each, so every rank carries the same causal work; KV then
/// travels the ring, double-buffered, one hop per step.

#include "fcp/core/cost_model.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"

namespace fcp::baselines {

/// Ring attention's plan for `batch` on config.numWorkers ranks (P). Each sequence of length L
/// is cut into 2P near-equal chunks, [i·L/2P, (i+1)·L/2P); empty chunks (L < 2P) are skipped,
/// nothing is padded. Rank r owns one block holding chunks r and 2P−1−r of every sequence
/// (a rank left without tokens owns no block). In round t = 0..P−2 rank r sends rank r+1
/// the KV block it received in round t−1 (its own in round 0), so blocks are relayed; each
/// stage is one round (coalesce 1) and a rank holds two remote blocks at most (buffer depth 2,
/// double buffering). Backward, dK/dV partials return along the same chain. The plan has
/// strategy "ring"; config's blockSize, coalesce, bufferDepth and locality are ignored, and
/// the memory limit is raised to the busiest rank's tokens if the Zig-Zag split exceeds it.
///
/// Degenerate batches (every sequence shorter than 2P tokens) may leave ranks that need no
/// block from their predecessor; the chain then skips them, a holder keeps a block for more
/// than one step, and coalesce / buffer depth are raised to what the schedule needs (and
/// congestionFree cleared if a round is not a matching). Throws Error(kInvalidArgument) for a
/// non-positive worker count or a batch that fails checkBatch.
plan::Plan ringPlan(const Batch& batch, const plan::PlanConfig& config, const CostModel& costModel);

}  // namespace fcp::baselines
