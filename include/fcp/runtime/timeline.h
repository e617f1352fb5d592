#pragma once
/// Spans of compute and communication on one rank, written as a Chrome-trace JSON (opens in
/// Perfetto and chrome://tracing) with one process per rank.

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fcp/runtime/transport.h"

namespace fcp::runtime {

/// One interval of work on a rank. `lane` 0 is compute, 1 communication, 2 the pass itself.
struct Span {
  std::string name;
  int lane = 0;
  double startUs = 0;  ///< since the steady clock's epoch (the same on every process of a machine)
  double durationUs = 0;
};

/// Collects spans on one rank.
class Timeline {
 public:
  /// Microseconds on the steady clock.
  static double nowUs() {
    return std::chrono::duration<double, std::micro>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void add(std::string name, int lane, double startUs, double endUs) {
    spans_.push_back({std::move(name), lane, startUs, endUs - startUs});
  }
  void clear() { spans_.clear(); }
  const std::vector<Span>& spans() const { return spans_; }

 private:
  std::vector<Span> spans_;
};

/// The Chrome-trace JSON of `processes`' spans, process i named "<processName> i" with the
/// three lanes as its threads; times start at the earliest span of any process. A span's lane
/// must be 0, 1 or 2.
std::string chromeTrace(const std::vector<std::vector<Span>>& processes,
                        std::string_view processName);

/// A rank's serialised spans (one line each) that gatherChromeTrace accepts, at most.
inline constexpr int64_t kMaxTraceBytes = int64_t{1} << 30;

/// Gathers every rank's spans on rank 0 (collective) and returns the Chrome-trace JSON there,
/// an empty string on the other ranks. Times start at the earliest span of any rank. A rank
/// whose serialised spans exceed `maxBytesPerRank` (every rank passes the same, at most
/// kMaxTraceBytes) throws Error(kInvalidArgument), and so does rank 0, naming the first such
/// rank (or a rank whose limit is out of range or differs from rank 0's); the others return,
/// and no message of the gather is left behind on the transport.
std::string gatherChromeTrace(Transport& transport, const Timeline& timeline,
                              int64_t maxBytesPerRank = kMaxTraceBytes);

}  // namespace fcp::runtime
