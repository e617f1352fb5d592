#pragma once
/// The Communication Planner's output (§4.2, §4.3): transfers, rounds, per-worker pipeline
/// stages for the forward and backward pass, and the reshuffle between the user layout and the
/// FCP layout.
///
/// Terms. A *transfer* sends one KV block from its owner to a worker owning a Q block that
/// needs it, once per (block, worker). Transfers are coloured into Δ *rounds* (matchings).
/// The *coalescer* merges `coalesce` consecutive rounds into one *group*; group g is received
/// during stage g. With a buffer depth of D (in groups, D >= 2), the pairs that use group g's
/// blocks are computed in stage g + D − 1 and its buffers released after that stage, so a
/// worker holds at most D groups of remote KV at once and always receives ahead of computing.
/// Pairs needing no remote KV are split between the first stage and the last, where they hide
/// the reshuffle in and out. Backward: the same KV flow, and each received block's dK/dV
/// partial goes back to its owner in the stage after the block's pairs were recomputed; a
/// reversed matching is a matching, so those returns are congestion-free too.

#include <cstdint>
#include <vector>

namespace fcp::plan {

/// One KV block sent to one worker that needs it.
struct Transfer {
  int32_t block = 0;
  /// The block's owner, or a relay that received the block earlier and still holds it (ring
  /// attention passes blocks on). Backward, the receiver's dK/dV partial goes back to the
  /// sender; a relay adds it to its own partial before returning that along its own transfer.
  int32_t sender = 0;
  int32_t receiver = 0;  ///< a worker owning a Q block that attends to it
  int64_t bytes = 0;     ///< K and V of the block's tokens
  int32_t round = 0;     ///< in [0, Δ)
  friend bool operator==(const Transfer&, const Transfer&) = default;
};

/// What one worker does in one pipeline stage. Ids index Plan::transfers and Plan::pairs.
struct Stage {
  std::vector<int32_t> send;     ///< transfers this worker sends
  std::vector<int32_t> recv;     ///< transfers this worker receives
  std::vector<int32_t> compute;  ///< pairs computed (this worker owns their Q block)
  std::vector<int32_t> release;  ///< received transfers whose buffers are freed after it
  /// Backward only: the dK/dV partials of received transfers sent back to their owners, and
  /// those this worker receives for its own blocks (and adds in).
  std::vector<int32_t> sendGrad;
  std::vector<int32_t> recvGrad;
  friend bool operator==(const Stage&, const Stage&) = default;
};

/// One piece of the reshuffle: tokens [begin, end) of the packed batch stream move between the
/// user layout's holder and the block's owner (inward: user -> FCP; outward: the reverse).
struct ReshufflePiece {
  int32_t userWorker = 0;
  int32_t fcpWorker = 0;
  int64_t begin = 0;
  int64_t end = 0;
  friend bool operator==(const ReshufflePiece&, const ReshufflePiece&) = default;
};

}  // namespace fcp::plan
