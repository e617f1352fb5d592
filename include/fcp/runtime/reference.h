#pragma once
/// A single-process float64 reference of attention over a whole packed batch, forward and
/// backward, for checking the distributed runs: gather the ranks' outputs to rank 0, compute the
/// reference there and compare. O(Σ len² · heads · headDim) time and the whole batch's tensors
/// on rank 0: test sizes only.

#include <cstdint>
#include <span>
#include <vector>

#include "fcp/core/config.h"
#include "fcp/core/workload.h"
#include "fcp/runtime/transport.h"

namespace fcp::runtime {

/// Outputs of the reference, in the packed layout of the batch.
struct ReferenceResult {
  std::vector<double> o, dq, dk, dv;
};

/// Attention of every sequence of `batch` over the packed tensors q [T, Hq, d], k, v [T, Hkv, d],
/// dO [T, Hq, d] (fp32 in, float64 arithmetic), with the mask and GQA of `attention` and
/// scores scaled by `softmaxScale` (0: 1/sqrt(d)). Throws Error(kInvalidArgument) when a size
/// does not match.
ReferenceResult referenceAttention(const Batch& batch, const AttentionConfig& attention,
                                   std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, std::span<const float> dO,
                                   double softmaxScale = 0);

/// ||a − b||₂ / ||b||₂; where b is all zeros (no relative error exists: dQ and dK of a batch of
/// one-token sequences, whose softmax has one entry), the RMS error ||a − b||₂ / sqrt(n), so
/// that a run's rounding residue there is held to the tolerance in absolute terms rather than
/// reported as infinite (0 when both are empty or zero).
double relativeL2(std::span<const float> a, std::span<const double> b);

/// Relative L2 error (relativeL2) of each output of a run against the reference.
struct ReferenceErrors {
  double o = 0, dq = 0, dk = 0, dv = 0;
};

/// Compares a run's outputs over the whole batch, in the reference's packed layout, with
/// `reference`. Throws Error(kInternal) when a size differs from the reference's.
ReferenceErrors compareWithReference(const ReferenceResult& reference, std::span<const float> o,
                                     std::span<const float> dq, std::span<const float> dk,
                                     std::span<const float> dv);

/// Collective: gathers rows of `rowWidth` floats to rank 0. Rank r holds rows [rowStarts[r],
/// rowStarts[r + 1]) in `mine` (rowStarts has one entry more than there are ranks, starting at
/// 0: the user layout's starts, say). Rank 0 returns every rank's rows in rank order once they
/// all arrived; the other ranks return an empty vector once their rows are sent, so nothing is
/// left in flight while rank 0 goes on to compute the reference. Throws
/// Error(kInvalidArgument) when `rowStarts` or the size of `mine` does not match, and
/// Error(kTransport) as the transport's waits do.
std::vector<float> gatherToRoot(Transport& transport, std::span<const float> mine,
                                std::span<const int64_t> rowStarts, int64_t rowWidth, int tag);

}  // namespace fcp::runtime
