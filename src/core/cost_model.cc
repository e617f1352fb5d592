#include "fcp/core/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "fcp/core/det_math.h"
#include "fcp/core/error.h"

namespace fcp {

int64_t detail::visibleEntriesWide(MaskKind mask, int64_t qBegin, int64_t qEnd, int64_t kBegin,
                                   int64_t kEnd) {
  // Counted in unsigned 128 bits: every factor below is a non-negative difference of int64
  // positions (under 2^64, or 2^65 / 2), so each product stays under 2^128; each term is capped
  // at INT64_MAX before they are added, so the count saturates instead of wrapping.
  __extension__ typedef unsigned __int128 Wide;  // __extension__: no -Wpedantic warning
  constexpr Wide kMax = std::numeric_limits<int64_t>::max();
  const auto span = [](int64_t from, int64_t to) { return static_cast<Wide>(Wide(to) - Wide(from)); };
  const Wide width = span(kBegin, kEnd);
  if (mask == MaskKind::kFull) return static_cast<int64_t>(std::min(span(qBegin, qEnd) * width, kMax));
  // Causal: query i sees keys j <= i, so it sees clamp(i + 1 - kBegin, 0, width) keys of the
  // range. Queries in [kBegin, kEnd) see a growing prefix (an arithmetic series); queries at or
  // past kEnd see all `width` keys; queries before kBegin see none.
  Wide series = 0, rest = 0;
  const int64_t a = std::max(qBegin, kBegin);
  const int64_t b = std::min(qEnd, kEnd);
  if (a < b) {
    // sum_{i=a}^{b-1} (i + 1 - kBegin) = n * (first + last) / 2; n + (first + last) is odd, so
    // exactly one factor is even and the division is exact.
    const Wide n = span(a, b);
    const Wide ends = span(kBegin, a) + 1 + span(kBegin, b);
    series = std::min((n % 2 == 0) ? (n / 2) * ends : n * (ends / 2), kMax);
  }
  const int64_t fullFrom = std::max(qBegin, kEnd);
  if (fullFrom < qEnd) rest = std::min(span(fullFrom, qEnd) * width, kMax);
  return static_cast<int64_t>(std::min(series + rest, kMax));
}

double forwardFlops(const AttentionConfig& config, int64_t visible) {
  return 4.0 * static_cast<double>(visible) * static_cast<double>(config.numHeadsQ * config.headDim);
}

double backwardFlops(const AttentionConfig& config, int64_t visible) {
  return kBackwardFlopsPerForward * forwardFlops(config, visible);
}

EfficiencyCurve::EfficiencyCurve(std::vector<std::pair<int64_t, double>> points)
    : points_(std::move(points)) {
  if (points_.empty()) throwInvalidArgument("efficiency curve has no points: expected at least one");
  for (size_t i = 0; i < points_.size(); ++i) {
    const auto [tokens, fraction] = points_[i];
    if (tokens <= 0) {
      throwInvalidArgument("efficiency curve point ", i, " has ", tokens, " tokens: expected > 0");
    }
    if (!(fraction >= kMinEfficiency && fraction <= 1)) {
      throwInvalidArgument("efficiency curve point ", i, " has efficiency ", fraction,
                           ": expected a fraction of peak from ", kMinEfficiency, " to 1");
    }
    if (i > 0 && tokens <= points_[i - 1].first) {
      throwInvalidArgument("efficiency curve point ", i, " has ", tokens,
                           " tokens: expected more than the previous point's ",
                           points_[i - 1].first);
    }
  }
}

EfficiencyCurve EfficiencyCurve::paperDefault() {
  return EfficiencyCurve({{128, 0.07},
                          {256, 0.14},
                          {512, 0.25},
                          {1024, 0.40},
                          {2048, 0.56},
                          {4096, 0.68},
                          {8192, 0.73},
                          {16384, 0.75}});
}

double EfficiencyCurve::at(int64_t tokens) const {
  if (tokens <= points_.front().first) return points_.front().second;
  if (tokens >= points_.back().first) return points_.back().second;
  const auto upper = std::upper_bound(points_.begin(), points_.end(), tokens,
                                      [](int64_t t, const auto& p) { return t < p.first; });
  const auto lower = upper - 1;
  const double x = dmath::log2(static_cast<double>(tokens));
  const double x0 = dmath::log2(static_cast<double>(lower->first));
  const double x1 = dmath::log2(static_cast<double>(upper->first));
  const double w = (x - x0) / (x1 - x0);
  return lower->second + w * (upper->second - lower->second);
}

}  // namespace fcp
