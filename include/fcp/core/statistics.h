#pragma once
/// The two summaries FCP reports over workers and repeats, defined once.

#include <cstdint>
#include <span>
#include <vector>

namespace fcp {

/// (max − mean) / max of a per-worker load (the paper's imbalance, §6.2): 0 when every worker
/// carries the same, approaching 1 when one carries everything. 0 for no workers or no load.
double imbalance(std::span<const double> load);
double imbalance(std::span<const int64_t> load);

/// The middle value of `values` (for an even count the upper of the two middle ones, so the
/// result is always a measured value); 0 for none.
double median(std::vector<double> values);

}  // namespace fcp
