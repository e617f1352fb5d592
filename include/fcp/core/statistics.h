#pragma once
/// Summaries FCP reports over workers, defined once.

#include <cstdint>
#include <span>

namespace fcp {

/// (max − mean) / max of a per-worker load (the paper's imbalance, §6.2): 0 when every worker
/// carries the same, approaching 1 when one carries everything. 0 for no workers or no load.
double imbalance(std::span<const double> load);
double imbalance(std::span<const int64_t> load);

}  // namespace fcp
