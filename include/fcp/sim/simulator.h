#pragma once
/// Event-driven cluster simulator: times any `Plan` on a hardware model, never computing
/// attention and never knowing which planner made the plan.
///
/// Model. Each worker runs its stages in order. Entering a stage it starts the stage's compute
/// (its pairs one after another: a pair takes its cost / peak forward, and backward
/// 2.5 × flops / (peak × backward efficiency)) and posts the stage's sends and receives
/// (backward also the dK/dV returns). A transfer starts once both its sender and receiver
/// have posted it, and moves its bytes over the link it uses: NVLink inside a node, the NICs
/// across nodes. Every worker has an out and an in port of each kind; concurrent transfers
/// through one port share it equally, a transfer running at the smallest share of its two
/// ports (so two transfers into one NIC take twice as long), plus a fixed latency. A stage
/// ends when its compute and all its transfers are done (the profile's Pipeline::kLockstep).
/// Compute thus overlaps communication exactly as far as the plan's stages (and their buffer
/// depth) allow; with Pipeline::kMultiBuffer a stage's compute waits only for the transfers
/// that brought the KV it reads, not for the previous stage's. The reshuffle moves
/// its off-worker bytes (forward: Q, K, V in and O out; backward: dO in and dQ, dK, dV out)
/// during the first and the last stage, or, with overlapReshuffle off, in a stage of its own
/// before and after. Overlapped, it holds what it carries: the reshuffle in has a stage of its
/// own, computing beside it the first stage's pairs whose blocks no piece moves, before stage 0
/// (the rest of its pairs and its transfers); the results already final leave once the last
/// stage's messages are done, beside its compute, and those it completes once it has computed.

#include <cstdint>
#include <string>
#include <vector>

#include "fcp/plan/plan.h"
#include "fcp/sim/hardware.h"

namespace fcp::sim {

struct SimOptions {
  bool backward = true;          ///< simulate the backward pass too
  bool reshuffle = true;         ///< charge the reshuffle's bytes
  bool overlapReshuffle = true;  ///< reshuffle during the first / last stage (else apart)
  bool timelines = false;        ///< keep per-worker stage timelines
};

/// StageSpan::stage of the stages that are no plan stage.
inline constexpr int32_t kReshuffleIn = -1;  ///< the reshuffle in, in a stage of its own
/// the reshuffle out, in a stage of its own (overlapped: the results already final, beside the
/// last stage's compute)
inline constexpr int32_t kReshuffleOut = -2;
/// overlapped, the reshuffle out of the results the last stage's compute finishes, after it
inline constexpr int32_t kReshuffleOutAfter = -7;
inline constexpr int32_t kAllToAllIn = -3;   ///< head-parallel: the all-to-all before the attention
inline constexpr int32_t kAllToAllOut = -4;  ///< and after it
inline constexpr int32_t kPermuteIn = -5;   ///< head-parallel: the permute before the all-to-all in
inline constexpr int32_t kPermuteOut = -6;  ///< and after the all-to-all out

/// A StageSpan::stage by what it holds: "stage 3", "reshuffle in", "all-to-all out", ...
std::string stageName(int32_t stage);

/// One stage of one worker on the timeline, in milliseconds from the pass's start: when each of
/// the worker's two streams (compute, communication) entered and left it. A stream with
/// nothing to do in the stage leaves it as it enters.
struct StageSpan {
  /// plan stage index, or one of the codes above (kReshuffleIn, ...)
  int32_t stage = 0;
  double startMs = 0;         ///< the earlier of the two streams' entries
  double computeStartMs = 0;  ///< its compute began
  double computeEndMs = 0;    ///< its compute finished
  double commStartMs = 0;     ///< its messages were posted
  double commEndMs = 0;       ///< its messages (all of them) were done
  double endMs = 0;           ///< the later of the two streams' ends
};

/// One pass (forward or backward).
struct PassResult {
  double timeMs = 0;
  double usefulFlops = 0;
  double mfu = 0;  ///< usefulFlops / (workers × peak × time)
  std::vector<double> computeMs;      ///< per worker, busy computing
  std::vector<double> finishMs;       ///< per worker, when its last stage ended
  std::vector<std::vector<StageSpan>> timelines;  ///< per worker, if asked for
};

struct SimResult {
  PassResult forward;
  PassResult backward;  ///< empty unless SimOptions::backward
  double timeMs = 0;    ///< forward + backward
  double mfu = 0;       ///< useful FLOPs of both passes / (workers × peak × time)
  /// (max − mean) / max over workers of compute time (both passes) and of KV bytes sent plus
  /// received (forward transfers, the paper's "network traffic").
  double computeImbalance = 0;
  double commImbalance = 0;
  /// Breakdown, in ms of the whole step: mean compute per worker, the mean time a worker is
  /// not computing (waiting on transfers or on slower workers), and the reshuffle's share of
  /// the network bytes.
  double meanComputeMs = 0;
  double meanIdleMs = 0;
  int64_t transferBytes = 0;   ///< forward KV bytes over the network
  int64_t reshuffleBytes = 0;  ///< forward, off-worker
  int64_t numTransfers = 0;
};

/// Simulates `plan` on `hardware`. Compute is timed from the plan's blocks on the hardware's
/// own curves, as its `launch` says (a plan made with another curve is timed on these); a pair
/// whose visible entries are not its blocks' is Error(kInvalidPlan). Throws Error(kInvalidPlan) if
/// the plan's stages cannot all finish (a transfer posted by only one side) and
/// Error(kInvalidArgument) for a bad profile.
SimResult simulate(const plan::Plan& plan, const HardwareProfile& hardware,
                   const SimOptions& options = {});

/// Simulates head-parallel context parallelism: DeepSpeed-Ulysses, USP (its hybrid with a
/// ring), and FCP across groups with Ulysses inside each (`ring` is then an FCP plan over the
/// groups; any valid plan is timed alike). The job's workers are ring.config.numWorkers groups
/// of `degree` consecutive workers;
/// group i holds the tokens ring worker i holds (each member 1/degree of them, all heads).
/// Each pass opens with an all-to-all inside every group that gives each member its head share
/// (fcp::headShare) of the group's tokens (forward Q, K and V; backward dO), then runs `ring` (a
/// plan over the groups with the share's heads; one worker for pure Ulysses) on each of the
/// degree copies, copy j on the j-th member of every group, and closes with the all-to-all
/// back (forward O; backward dQ, dK and dV, replicated key/value heads' gradients summed where
/// they land). The all-to-alls overlap nothing, as in both systems. Compute, transfers, the
/// reshuffle (of `ring`, carried by the copies) and the links are timed as `simulate` times
/// them; usefulFlops counts `attention`'s heads; transferBytes and commImbalance count the
/// forward's ring transfers and all-to-all bytes. Throws Error(kInvalidArgument) when ring's
/// heads are not headShare(attention, degree) or the workers pass 2^24, and as `simulate`.
SimResult simulateHeadParallel(const plan::Plan& ring, const AttentionConfig& attention,
                               int64_t degree, const HardwareProfile& hardware,
                               const SimOptions& options = {});

}  // namespace fcp::sim
