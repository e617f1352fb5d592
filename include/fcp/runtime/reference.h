#pragma once
/// A single-process float64 reference of attention over a whole packed batch, forward and
/// backward, for checking the distributed runs. O(Σ len² · heads · headDim): test sizes only.

#include <cstdint>
#include <span>
#include <vector>

#include "fcp/core/config.h"
#include "fcp/core/workload.h"

namespace fcp::runtime {

/// Outputs of the reference, in the packed layout of the batch.
struct ReferenceResult {
  std::vector<double> o, dq, dk, dv;
};

/// Attention of every sequence of `batch` over the packed tensors q [T, Hq, d], k, v [T, Hkv, d],
/// dO [T, Hq, d] (fp32 in, float64 arithmetic), with the mask and GQA of `attention` and
/// scores scaled by 1/sqrt(d). Throws Error(kInvalidArgument) when a size does not match.
ReferenceResult referenceAttention(const Batch& batch, const AttentionConfig& attention,
                                   std::span<const float> q, std::span<const float> k,
                                   std::span<const float> v, std::span<const float> dO);

/// ||a − b||₂ / ||b||₂ (0 when both are empty or zero).
double relativeL2(std::span<const float> a, std::span<const double> b);

}  // namespace fcp::runtime
