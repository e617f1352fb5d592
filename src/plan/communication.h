#pragma once
// Private to the plan module: validate()'s communication half, and walking blocks over the
// user layout.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fcp/plan/communication.h"
#include "violations.h"

namespace fcp::plan::detail {

/// The user-layout worker holding global token `token` (`starts` as PlanConfig::userStarts):
/// the last r with starts[r] <= token. Layouts are usually even (userLayoutStarts), so the
/// search starts where an even layout would put the token and steps a few slices; a layout
/// far from even ends in a binary search. (The binary search alone, ~12 probes at 4096
/// workers, was most of cutting a 4096-worker plan's blocks at user slices.)
inline int32_t userWorkerOf(const std::vector<int64_t>& starts, int64_t token) {
  const size_t n = starts.size() - 1;
  const int64_t total = starts.back();
  if (n > 0 && starts.front() <= token && token < total) {
    const double share = static_cast<double>(token - starts.front()) /
                         static_cast<double>(total - starts.front());
    size_t r = std::min(n - 1, static_cast<size_t>(share * static_cast<double>(n)));
    for (int step = 0; step < 4; ++step) {
      if (starts[r] > token) {
        --r;  // r > 0: starts[0] <= token
      } else if (starts[r + 1] <= token) {
        ++r;  // r + 1 < n: starts[n] = total > token
      } else {
        return static_cast<int32_t>(r);
      }
    }
  }
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
    if (begin >= end) continue;
    auto w = static_cast<size_t>(userWorkerOf(user, begin));
    for (;;) {
      const int64_t stop = std::min(end, user[w + 1]);
      f(static_cast<int32_t>(w), begin, stop);
      if (stop == end) break;
      begin = stop;
      // The next run is on the next worker whose slice is not empty.
      for (++w; user[w + 1] <= begin; ++w) {
      }
    }
  }
}

/// Each KV block's receivers: the owners of the Q blocks that pair with it, other than its own,
/// sorted and distinct; block k's are receivers[first[k]] .. receivers[last[k]] (the array
/// holds a place for each pair reading the block, and the entries from last[k] to first[k + 1]
/// mean nothing).
struct BlockReceivers {
  std::vector<int64_t> first, last;
  std::vector<int32_t> receivers;
};
BlockReceivers blockReceivers(const Plan& plan);

/// The transfers `r` implies, in (block, receiver) order: buildTransfers(plan) is
/// transfersOf(plan, blockReceivers(plan)).
std::vector<Transfer> transfersOf(const Plan& plan, const BlockReceivers& r);

/// Worker f becomes rename[f] (a permutation) in the owners, and in the loads when there is
/// one per worker; nothing else (relabelForLocality renames the rest it finds built).
void renameWorkers(Plan& plan, const std::vector<int32_t>& rename);

/// relabelForLocality(plan), also renaming `receivers` (when not null: blockReceivers of the
/// plan's owners), each block's list sorted again; `renamed`, when not null, gets each old
/// worker's new id.
int64_t relabelForLocality(Plan& plan, BlockReceivers* receivers,
                           std::vector<int32_t>* renamed = nullptr);

/// Bytes each worker sends plus receives through those transfers, without building them.
std::vector<int64_t> bytesByWorker(const Plan& plan, const BlockReceivers& r);

/// Pairs grouped, in CSR form (ids[offset[k]] .. ids[offset[k + 1]]), by what they need:
/// key k < N is worker k's local pairs (KV its own), key N + i those using the transfer at
/// position i of the received list (TransfersByWorker by receiver).
struct PairsByNeed {
  std::vector<uint32_t> offset;
  std::vector<int32_t> ids;

  const int32_t* begin(size_t key) const { return ids.data() + offset[key]; }
  const int32_t* end(size_t key) const { return ids.data() + offset[key + 1]; }
};

/// Transfer ids by one end (CSR): those worker w sends (or receives) are
/// ids[offset[w]] .. ids[offset[w + 1]], ascending, each with its group (round / coalesce)
/// beside it once the rounds are set (empty before), so that a worker's transfers read as one
/// sequence.
struct TransfersByWorker {
  std::vector<int64_t> offset;
  std::vector<int32_t> ids;
  std::vector<int32_t> group;

  size_t begin(size_t w) const { return static_cast<size_t>(offset[w]); }
  size_t end(size_t w) const { return static_cast<size_t>(offset[w + 1]); }
};

/// What buildStages reads that the transfers' rounds do not change: both ends' transfer
/// lists (their groups not yet set) and the pairs by what they need. Built while the transfers
/// are coloured (buildPlan, spanOf), from the plan's owners, pairs and transfers in (block,
/// receiver) order; it reads no transfer's round, which colorTransfers may be writing.
struct StagePrep {
  TransfersByWorker sent, received;
  PairsByNeed need;
};
StagePrep prepareStages(const Plan& plan);

/// buildStages(plan) from `prep`, which prepareStages made for the same plan's transfers (now
/// coloured).
void buildStages(Plan& plan, StagePrep prep);

/// pipelineSpan of the forward stages buildStages(plan, prep) would build, without building
/// them: the same sums in the same order and the same waits, so the same value. For spans that
/// only compare plans (refineCosts), where the stages are dropped anyway; a plan's stages are
/// about a hundred small vectors per worker.
double forwardSpan(const Plan& plan, StagePrep prep);

/// A step's estimated time in cost units (forward FLOPs at peak) where a byte on a worker's
/// link costs `costPerByte`: the forward and backward passes' spans, as pipelineSpan but with
/// each stage taking the longest of its compute (backward: kBackwardFlopsPerForward times the
/// forward cost), the bytes it sends and the bytes it receives (backward: the KV blocks again
/// and the fp32 dK/dV partials going back), plus the reshuffle of each pass at its busiest
/// worker (busier direction). Needs the plan's stages (buildStages: a transfer sits in the same
/// stage at both ends) and reshuffle.
double linkedStepTime(const Plan& plan, double costPerByte);

/// One pass of linkedStepTime: `stages` (a transfer, and a dK/dV partial, in the same stage at
/// both ends), each stage taking the longest of `computeFactor` times its pairs' cost and
/// `costPerByte` times the bytes it sends or receives, the partials at `gradPerKvByte` times
/// their transfer's bytes; a stage waits for the stage before it and for the other end of
/// each transfer it holds to be entered, as pipelineSpan. The last stage's end.
double linkedPassSpan(const Plan& plan, const Stages& stages, double computeFactor,
                      double costPerByte, double gradPerKvByte);

/// colorEdges on the transfers' ends and bytes, in place: sets each transfer's round and
/// returns Δ, the number of rounds (the same colouring as colorEdges of the same edges).
int32_t colorTransferRounds(int32_t numWorkers, std::vector<Transfer>& transfers);

/// maxDegree of the transfers' ends (the Δ colorTransferRounds colours them with).
int32_t maxTransferDegree(int32_t numWorkers, const std::vector<Transfer>& transfers);

/// Appends the communication invariants' violations (see validate).
void validateCommunication(const Plan& plan, Violations& v);

}  // namespace fcp::plan::detail
