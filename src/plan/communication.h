#pragma once
// Private to the plan module: validate()'s communication half, and walking blocks over the
// user layout.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fcp/plan/communication.h"
#include "violations.h"

namespace fcp::plan::detail {

/// The user-layout worker holding global token `token` (`starts` as PlanConfig::userStarts).
inline int32_t userWorkerOf(const std::vector<int64_t>& starts, int64_t token) {
  return static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end(), token) -
                              starts.begin() - 1);
}

/// Calls f(userWorker, begin, end) for each run of `block`'s tokens that one user worker holds
/// (positions in the packed stream, chunk by chunk); `sequenceStart` as sequenceStarts.
template <typename F>
void forEachUserRun(const Block& block, const std::vector<int64_t>& sequenceStart,
                    const std::vector<int64_t>& user, F&& f) {
  for (const Chunk& c : block.chunks) {
    int64_t begin = sequenceStart[static_cast<size_t>(c.sequence)] + c.begin;
    const int64_t end = sequenceStart[static_cast<size_t>(c.sequence)] + c.end;
    while (begin < end) {
      const int32_t w = userWorkerOf(user, begin);
      const int64_t stop = std::min(end, user[static_cast<size_t>(w) + 1]);
      f(w, begin, stop);
      begin = stop;
    }
  }
}

/// Each KV block's receivers: the owners of the Q blocks that pair with it, other than its own,
/// sorted and distinct; block k's are receivers[first[k]] .. receivers[last[k]].
struct BlockReceivers {
  std::vector<int64_t> first, last;
  std::vector<int32_t> receivers;
};
BlockReceivers blockReceivers(const Plan& plan);

/// The transfers `r` implies, in (block, receiver) order: buildTransfers(plan) is
/// transfersOf(plan, blockReceivers(plan)).
std::vector<Transfer> transfersOf(const Plan& plan, const BlockReceivers& r);

/// Bytes each worker sends plus receives through those transfers, without building them.
std::vector<int64_t> bytesByWorker(const Plan& plan, const BlockReceivers& r);

/// Appends the communication invariants' violations (see validate).
void validateCommunication(const Plan& plan, Violations& v);

}  // namespace fcp::plan::detail
