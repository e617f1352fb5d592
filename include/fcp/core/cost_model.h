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
///
/// Defined here so that callers in loops inline it: the planner counts millions of ranges at
/// 4096 workers, and a call each was a tenth of making the pairs. Positions in [0, 2^31) are
/// counted in 64 bits (every product stays under 2^62 and the sum under 2^63), others in 128
/// (detail::visibleEntriesWide).
inline int64_t visibleEntries(MaskKind mask, int64_t qBegin, int64_t qEnd, int64_t kBegin,
                              int64_t kEnd);

namespace detail {
/// visibleEntries for non-empty ranges at any positions, counted in 128 bits (cost_model.cc;
/// visibleEntries returns 0 for empty ranges before it calls this).
int64_t visibleEntriesWide(MaskKind mask, int64_t qBegin, int64_t qEnd, int64_t kBegin,
                           int64_t kEnd);
}  // namespace detail

inline int64_t visibleEntries(MaskKind mask, int64_t qBegin, int64_t qEnd, int64_t kBegin,
                              int64_t kEnd) {
  if (qEnd <= qBegin || kEnd <= kBegin) return 0;
  constexpr int64_t kSmall = int64_t{1} << 31;
  if (!(qBegin >= 0 && kBegin >= 0 && qEnd < kSmall && kEnd < kSmall))
    return detail::visibleEntriesWide(mask, qBegin, qEnd, kBegin, kEnd);
  const int64_t width = kEnd - kBegin;
  if (mask == MaskKind::kFull) return (qEnd - qBegin) * width;
  int64_t series = 0, rest = 0;
  const int64_t a = qBegin > kBegin ? qBegin : kBegin;
  const int64_t b = qEnd < kEnd ? qEnd : kEnd;
  if (a < b) {
    // sum_{i=a}^{b-1} (i + 1 - kBegin) = n (first + last) / 2, exactly one factor even.
    const int64_t n = b - a;
    const int64_t ends = (a - kBegin) + 1 + (b - kBegin);
    series = (n % 2 == 0) ? (n / 2) * ends : n * (ends / 2);
  }
  const int64_t fullFrom = qBegin > kEnd ? qBegin : kEnd;
  if (fullFrom < qEnd) rest = (qEnd - fullFrom) * width;
  return series + rest;
}

/// Useful forward FLOPs for `visible` entries: 4 · visible · numHeadsQ · headDim (QKᵀ and PV,
/// a multiply-add counted as two).
double forwardFlops(const AttentionConfig& config, int64_t visible);
/// Useful backward FLOPs per forward FLOP (DESIGN.md's convention).
inline constexpr double kBackwardFlopsPerForward = 2.5;
/// Useful backward FLOPs: kBackwardFlopsPerForward × forward.
double backwardFlops(const AttentionConfig& config, int64_t visible);

/// The least efficiency a curve may give: a block's cost is its FLOPs over it, and 1e-300 made
/// costs infinite (a planner error naming a block, not the curve).
inline constexpr double kMinEfficiency = 1e-6;

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
