#include "fcp/core/statistics.h"

#include <algorithm>

namespace fcp {
namespace {

template <typename T>
double imbalanceOf(std::span<const T> load) {
  T max = 0, sum = 0;
  for (const T x : load) {
    max = std::max(max, x);
    sum += x;
  }
  if (!(max > 0)) return 0;
  const auto top = static_cast<double>(max);
  return (top - static_cast<double>(sum) / static_cast<double>(load.size())) / top;
}

}  // namespace

double imbalance(std::span<const double> load) { return imbalanceOf(load); }
double imbalance(std::span<const int64_t> load) { return imbalanceOf(load); }

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

}  // namespace fcp
