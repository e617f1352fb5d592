#pragma once
/// What attention costs: visible (query, key) entries, useful FLOPs, bytes, and time through a
/// kernel-efficiency curve.

#include <cstdint>
#include <utility>
#include <vector>

#include "fcp/core/config.h"

namespace fcp {

/// Number of (query, key) entries the mask lets through between query positions
/// [qBegin, qEnd) and key positions [kBegin, kEnd) of one sequence (positions count from the
/// sequence's first token). Exact, O(1); empty ranges give 0. Counts past int64 (ranges far
/// beyond kMaxSequenceLength) saturate at INT64_MAX rather than overflow.
int64_t visibleEntries(MaskKind mask, int64_t qBegin, int64_t qEnd, int64_t kBegin, int64_t kEnd);

/// Useful forward FLOPs for `visible` entries: 4 · visible · numHeadsQ · headDim (QKᵀ and PV,
/// a multiply-add counted as two).
double forwardFlops(const AttentionConfig& config, int64_t visible);
/// Useful backward FLOPs per forward FLOP (DESIGN.md's convention).
inline constexpr double kBackwardFlopsPerForward = 2.5;
/// Useful backward FLOPs: kBackwardFlopsPerForward × forward.
double backwardFlops(const AttentionConfig& config, int64_t visible);

/// Kernel efficiency f(tokens): the fraction of peak a kernel reaches on blocks of `tokens`
/// tokens. Piecewise linear in log2(tokens) between measured or assumed points, constant
/// beyond the ends.
class EfficiencyCurve {
 public:
  /// `points` are (tokens, fraction in (0, 1]) with strictly increasing tokens; throws
  /// Error(kInvalidArgument) otherwise.
  explicit EfficiencyCurve(std::vector<std::pair<int64_t, double>> points);

  /// The default, shaped like the paper's Fig. compute-efficiency (FA3 on Hopper): about 25 %
  /// of peak at 512-token blocks, rising steeply to 4K and saturating near 75 % above it.
  static EfficiencyCurve paperDefault();

  double at(int64_t tokens) const;
  const std::vector<std::pair<int64_t, double>>& points() const { return points_; }

 private:
  std::vector<std::pair<int64_t, double>> points_;
};

/// Turns useful FLOPs into time units for planning. The planner compares costs only with each
/// other, so a cost is "FLOPs at peak": flops / f(tokens). Divide by a device's peak FLOP/s
/// to get seconds.
struct CostModel {
  AttentionConfig attention;
  EfficiencyCurve forward = EfficiencyCurve::paperDefault();
  EfficiencyCurve backward = EfficiencyCurve::paperDefault();

  /// Forward cost of `visible` entries computed in kernels over `kernelTokens`-token blocks.
  double forwardCost(int64_t visible, int64_t kernelTokens) const {
    return forwardFlops(attention, visible) / forward.at(kernelTokens);
  }
  /// Backward cost, likewise.
  double backwardCost(int64_t visible, int64_t kernelTokens) const {
    return backwardFlops(attention, visible) / backward.at(kernelTokens);
  }
};

}  // namespace fcp
