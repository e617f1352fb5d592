#include "communication.h"

#include <algorithm>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <utility>

#include "fcp/core/error.h"
#include "fcp/plan/coloring.h"
#include "huge_pages.h"
#include "parallel.h"

namespace fcp::plan {

int32_t findTransfer(const std::vector<Transfer>& transfers, int32_t block, int32_t receiver) {
  const auto it =
      std::lower_bound(transfers.begin(), transfers.end(), std::make_pair(block, receiver),
                       [](const Transfer& t, const std::pair<int32_t, int32_t>& key) {
                         return std::tie(t.block, t.receiver) < std::tie(key.first, key.second);
                       });
  if (it == transfers.end() || it->block != block || it->receiver != receiver) return -1;
  return static_cast<int32_t>(it - transfers.begin());
}

namespace {

using detail::PairsByNeed;
using detail::TransfersByWorker;

/// Transfer ids by one end, their groups left empty (setGroups fills them once the transfers
/// have their rounds); `position`, when given, gets each transfer's index in the list.
TransfersByWorker transfersBy(const Plan& plan, int32_t Transfer::*end,
                              std::vector<uint32_t>* position = nullptr) {
  TransfersByWorker g;
  g.offset.assign(static_cast<size_t>(plan.config.numWorkers) + 1, 0);
  for (const Transfer& t : plan.transfers) ++g.offset[static_cast<size_t>(t.*end) + 1];
  for (size_t w = 1; w < g.offset.size(); ++w) g.offset[w] += g.offset[w - 1];
  detail::resizeHuge(g.ids, plan.transfers.size());
  if (position) detail::resizeHuge(*position, plan.transfers.size());
  std::vector<int64_t> next(g.offset.begin(), g.offset.end() - 1);
  for (size_t t = 0; t < plan.transfers.size(); ++t) {
    const auto at = static_cast<size_t>(next[static_cast<size_t>(plan.transfers[t].*end)]++);
    g.ids[at] = static_cast<int32_t>(t);
    if (position) (*position)[t] = static_cast<uint32_t>(at);
  }
  return g;
}

/// Each transfer's group (round / coalesce) beside its id: the same pass in transfer order as
/// transfersBy, so the same positions.
void setGroups(const Plan& plan, int32_t Transfer::*end, TransfersByWorker& g) {
  FCP_CHECK(g.ids.size() == plan.transfers.size(), "stage lists prepared for ", g.ids.size(),
            " transfers, not the plan's ", plan.transfers.size());
  const int64_t c = plan.config.coalesce;
  detail::resizeHuge(g.group, plan.transfers.size());
  std::vector<int64_t> next(g.offset.begin(), g.offset.end() - 1);
  for (const Transfer& t : plan.transfers) {
    const auto at = static_cast<size_t>(next[static_cast<size_t>(t.*end)]++);
    g.group[at] = static_cast<int32_t>(t.round / c);
  }
}

/// Pairs by what they need (see PairsByNeed), `position[t]` being transfer t's index in the
/// received list (transfersBy). One pass over the pairs in their order;
/// transfers are sorted by (block, receiver), so the transfer of (k, w) is a binary search
/// among block k's few receivers, in a compact copy that stays in cache. Keys and offsets are
/// 32-bit (both are below N + kMaxPairs), and the pairs are placed by their keys from the last
/// down, each key's end moving down to its start, so that no copy of the offsets is made: at
/// 4096 workers the arrays here are the planner's largest fresh memory after the stages.
PairsByNeed groupPairs(const Plan& plan, const std::vector<uint32_t>& position) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  FCP_CHECK(n + plan.transfers.size() < std::numeric_limits<uint32_t>::max() &&
                plan.pairs.size() < std::numeric_limits<uint32_t>::max(),
            "stage lists of ", plan.transfers.size(), " transfers and ", plan.pairs.size(),
            " pairs: expected fewer than 2^32 of each");
  std::vector<int64_t> firstOf(plan.blocks.size() + 1, 0);  // block k: [firstOf[k], firstOf[k + 1])
  std::vector<int32_t> receiver;
  detail::resizeHuge(receiver, plan.transfers.size());
  for (size_t t = 0; t < plan.transfers.size(); ++t) {
    ++firstOf[static_cast<size_t>(plan.transfers[t].block) + 1];
    receiver[t] = plan.transfers[t].receiver;
  }
  for (size_t k = 1; k < firstOf.size(); ++k) firstOf[k] += firstOf[k - 1];
  PairsByNeed g;
  detail::resizeHuge(g.offset, n + plan.transfers.size() + 1);
  std::vector<uint32_t> keyOf;
  detail::resizeHuge(keyOf, plan.pairs.size());
  for (size_t p = 0; p < plan.pairs.size(); ++p) {
    const auto k = static_cast<size_t>(plan.pairs[p].kvBlock);
    const int32_t w = plan.owner[static_cast<size_t>(plan.pairs[p].qBlock)];
    size_t key = static_cast<size_t>(w);
    if (plan.owner[k] != w) {
      const int32_t* first = receiver.data() + firstOf[k];
      const int32_t* last = receiver.data() + firstOf[k + 1];
      const int32_t* at = std::lower_bound(first, last, w);
      FCP_CHECK(at != last && *at == w, "no transfer of block ", k, " to worker ", w);
      key = n + position[static_cast<size_t>(at - receiver.data())];
    }
    keyOf[p] = static_cast<uint32_t>(key);
    ++g.offset[key + 1];
  }
  for (size_t k = 1; k < g.offset.size(); ++k) g.offset[k] += g.offset[k - 1];
  detail::resizeHuge(g.ids, plan.pairs.size());
  // From the last pair down, each to the end of its key's range, which then moves down by
  // one: the ranges fill in ascending pair order, and offset[key + 1] ends at key's start.
  for (size_t p = keyOf.size(); p-- > 0;)
    g.ids[--g.offset[static_cast<size_t>(keyOf[p]) + 1]] = static_cast<int32_t>(p);
  // offset[j + 1] now holds key j's start: shifted back by one, the last is the total again.
  std::copy(g.offset.begin() + 1, g.offset.end(), g.offset.begin());
  g.offset.back() = static_cast<uint32_t>(plan.pairs.size());
  return g;
}

}  // namespace

std::vector<int64_t> userLayoutStarts(int64_t numTokens, int64_t numWorkers) {
  std::vector<int64_t> starts(static_cast<size_t>(numWorkers + 1));
  for (int64_t r = 0; r <= numWorkers; ++r) {
    // r * numTokens < 2^24 * 2^32: no overflow within the limits buildPlan enforces.
    starts[static_cast<size_t>(r)] = r * numTokens / numWorkers;
  }
  return starts;
}

std::vector<int64_t> userLayout(const PlanConfig& config, int64_t numTokens) {
  return config.userStarts.empty() ? userLayoutStarts(numTokens, config.numWorkers)
                                   : config.userStarts;
}

std::vector<int64_t> userLayout(const Plan& plan) {
  return userLayout(plan.config, plan.batch.numTokens());
}

void checkUserLayout(const std::vector<int64_t>& starts, int64_t numTokens, int64_t numWorkers) {
  if (static_cast<int64_t>(starts.size()) != numWorkers + 1) {
    throwInvalidArgument("user layout has ", starts.size(), " slice starts: expected ",
                         numWorkers + 1, " (one per worker and the end)");
  }
  if (starts.front() != 0 || starts.back() != numTokens) {
    throwInvalidArgument("user layout covers tokens [", starts.front(), ", ", starts.back(),
                         "): expected [0, ", numTokens, "), the whole batch");
  }
  for (size_t r = 0; r + 1 < starts.size(); ++r) {
    if (starts[r + 1] < starts[r]) {
      throwInvalidArgument("user layout: worker ", r, "'s slice starts at token ", starts[r],
                           " but ends at ", starts[r + 1], ": expected slices in worker order");
    }
  }
}

std::vector<int64_t> sequenceStarts(const Batch& batch) {
  std::vector<int64_t> starts(batch.sequenceLengths.size() + 1, 0);
  for (size_t s = 0; s < batch.sequenceLengths.size(); ++s) {
    starts[s + 1] = starts[s] + batch.sequenceLengths[s];
  }
  return starts;
}

int64_t movedTokens(const std::vector<ReshufflePiece>& pieces) {
  int64_t moved = 0;
  for (const ReshufflePiece& p : pieces) moved += p.userWorker != p.fcpWorker ? p.end - p.begin : 0;
  return moved;
}

namespace {

/// Tokens each FCP worker has in common with each user worker, as (−tokens, fcp, user) sorted
/// ascending: the heaviest first, ties to lower ids. The blocks' chunks are cut at user-slice
/// boundaries (as buildReshuffle cuts them) in block order, then grouped by FCP worker with a
/// counting sort, so the only comparison sorts are per worker and small; `moved` gets the
/// tokens whose two workers differ.
std::vector<std::tuple<int64_t, int32_t, int32_t>> commonTokens(const Plan& plan, int64_t& moved) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const auto seq = sequenceStarts(plan.batch);
  const auto user = userLayout(plan);
  struct Piece {
    int32_t fcp, user;
    int64_t tokens;
  };
  std::vector<Piece> pieces;
  pieces.reserve(2 * plan.blocks.size());  // Zig-Zag blocks: two chunks, most in one slice
  std::vector<int64_t> offset(n + 1, 0);  // pieces by FCP worker (CSR)
  moved = 0;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    const int32_t f = plan.owner[b];
    detail::forEachUserRun(plan.blocks[b], seq, user, [&](int32_t u, int64_t begin, int64_t stop) {
      pieces.push_back({f, u, stop - begin});
      ++offset[static_cast<size_t>(f) + 1];
      if (u != f) moved += stop - begin;
    });
  }
  for (size_t f = 1; f <= n; ++f) offset[f] += offset[f - 1];
  std::vector<std::pair<int32_t, int64_t>> held(pieces.size());  // (user, tokens) by FCP worker
  std::vector<int64_t> next(offset.begin(), offset.end() - 1);
  for (const Piece& p : pieces)
    held[static_cast<size_t>(next[static_cast<size_t>(p.fcp)]++)] = {p.user, p.tokens};
  std::vector<std::tuple<int64_t, int32_t, int32_t>> edges;
  edges.reserve(held.size());
  for (size_t f = 0; f < n; ++f) {
    const auto first = held.begin() + offset[f], last = held.begin() + offset[f + 1];
    std::sort(first, last);
    for (auto it = first; it != last;) {
      int64_t tokens = 0;
      const int32_t u = it->first;
      for (; it != last && it->first == u; ++it) tokens += it->second;
      edges.push_back({-tokens, static_cast<int32_t>(f), u});
    }
  }
  // Made in (fcp, user) order, so a stable counting sort by tokens, heaviest first, gives the
  // order of a sort by (-tokens, fcp, user): linear where the tokens are few (a worker holds
  // at most its memory cap; this sort took 4 of a 4096-worker relabelling's 9 ms).
  int64_t most = 0;
  for (const auto& e : edges) most = std::max(most, -std::get<0>(e));
  if (most > static_cast<int64_t>(4 * edges.size()) + (int64_t{1} << 16)) {
    std::sort(edges.begin(), edges.end());
    return edges;
  }
  std::vector<size_t> slot(static_cast<size_t>(most) + 2, 0);  // by most - tokens, then + 1
  for (const auto& e : edges) ++slot[static_cast<size_t>(most + std::get<0>(e)) + 1];
  for (size_t k = 1; k < slot.size(); ++k) slot[k] += slot[k - 1];
  std::vector<std::tuple<int64_t, int32_t, int32_t>> sorted(edges.size());
  for (const auto& e : edges) sorted[slot[static_cast<size_t>(most + std::get<0>(e))]++] = e;
  return sorted;
}

}  // namespace

int64_t relabelForLocality(Plan& plan) { return detail::relabelForLocality(plan, nullptr); }

namespace detail {

void renameWorkers(Plan& plan, const std::vector<int32_t>& rename) {
  for (int32_t& o : plan.owner) o = rename[static_cast<size_t>(o)];
  // Each worker's load goes with it: the same blocks and pairs, summed in the same order.
  if (plan.loads.size() == rename.size()) {
    std::vector<WorkerLoad> loads(rename.size());
    for (size_t f = 0; f < rename.size(); ++f)
      loads[static_cast<size_t>(rename[f])] = plan.loads[f];
    plan.loads = std::move(loads);
  }
}

int64_t relabelForLocality(Plan& plan, BlockReceivers* receivers, std::vector<int32_t>* renamed) {
  // Stages name transfers by position: none may be built yet.
  FCP_CHECK(plan.forward.empty() && plan.backward.empty(),
            "relabelForLocality after the stages were built");
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  int64_t moved = 0;
  const std::vector<std::tuple<int64_t, int32_t, int32_t>> edges = commonTokens(plan, moved);
  std::vector<int32_t> rename(n, -1);
  std::vector<bool> taken(n, false);
  for (const auto& [negTokens, f, u] : edges) {
    if (rename[static_cast<size_t>(f)] >= 0 || taken[static_cast<size_t>(u)]) continue;
    rename[static_cast<size_t>(f)] = u;
    taken[static_cast<size_t>(u)] = true;
  }
  size_t nextFree = 0;
  for (size_t f = 0; f < n; ++f) {
    if (rename[f] >= 0) continue;
    while (taken[nextFree]) ++nextFree;
    rename[f] = static_cast<int32_t>(nextFree);
    taken[nextFree] = true;
  }
  renameWorkers(plan, rename);
  // Transfers and reshuffle pieces built already name the same workers, renamed; each block's
  // transfers go back into receiver order, as buildTransfers makes them (receivers are
  // distinct within a block).
  for (Transfer& t : plan.transfers) {
    t.sender = rename[static_cast<size_t>(t.sender)];
    t.receiver = rename[static_cast<size_t>(t.receiver)];
  }
  for (auto first = plan.transfers.begin(); first != plan.transfers.end();) {
    const auto last = std::find_if(first, plan.transfers.end(),
                                   [&](const Transfer& t) { return t.block != first->block; });
    std::sort(first, last,
              [](const Transfer& x, const Transfer& y) { return x.receiver < y.receiver; });
    first = last;
  }
  for (ReshufflePiece& piece : plan.reshuffle)
    piece.fcpWorker = rename[static_cast<size_t>(piece.fcpWorker)];
  if (renamed) *renamed = rename;
  if (receivers) {
    for (size_t k = 0; k + 1 < receivers->first.size(); ++k) {
      const auto list = receivers->receivers.begin() + receivers->first[k];
      const auto end = receivers->receivers.begin() + receivers->last[k];
      for (auto r = list; r != end; ++r) *r = rename[static_cast<size_t>(*r)];
      std::sort(list, end);
    }
  }
  return moved;
}

}  // namespace detail

std::vector<ReshufflePiece> buildReshuffle(const Plan& plan) {
  const auto seq = sequenceStarts(plan.batch);
  const auto user = userLayout(plan);
  std::vector<ReshufflePiece> pieces;
  detail::reserveHuge(pieces,
                      2 * plan.blocks.size());  // Zig-Zag blocks: two chunks, most in one slice
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    detail::forEachUserRun(plan.blocks[b], seq, user, [&](int32_t w, int64_t begin, int64_t stop) {
      pieces.push_back({w, plan.owner[b], begin, stop});
    });
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const ReshufflePiece& x, const ReshufflePiece& y) { return x.begin < y.begin; });
  return pieces;
}

namespace detail {

BlockReceivers blockReceivers(const Plan& plan) {
  // Per KV block, the owners of the Q blocks that pair with it (CSR, filled in one pass over
  // the pairs in their order), each block's list then sorted and deduplicated, its own owner
  // dropped: transfers come out sorted by (block, receiver) without a global sort. The sorts
  // were most of the time, and the blocks of a sequence cut into Zig-Zag blocks are all read by
  // the same Q blocks (each by all of them): where a block's list is the one before it, the
  // sorted list is reused, one sort per sequence rather than per block.
  const auto ownerOf = [&](int32_t b) { return plan.owner[static_cast<size_t>(b)]; };
  BlockReceivers r;
  r.first.assign(plan.blocks.size() + 1, 0);
  for (const BlockPair& p : plan.pairs) ++r.first[static_cast<size_t>(p.kvBlock) + 1];
  for (size_t k = 1; k < r.first.size(); ++k) r.first[k] += r.first[k - 1];
  detail::resizeHuge(r.receivers, static_cast<size_t>(r.first.back()));
  r.last.assign(r.first.begin(), r.first.end() - 1);
  for (const BlockPair& p : plan.pairs)
    r.receivers[static_cast<size_t>(r.last[static_cast<size_t>(p.kvBlock)]++)] = ownerOf(p.qBlock);
  std::vector<int32_t> readers;  // the previous block's list as filled (owners of its readers)
  std::vector<int32_t> sorted;   // its owners, sorted and distinct
  for (size_t k = 0; k + 1 < r.first.size(); ++k) {
    int32_t* const list = r.receivers.data() + r.first[k];
    const auto size = static_cast<size_t>(r.last[k] - r.first[k]);
    if (size != readers.size() || !std::equal(list, list + size, readers.begin())) {
      readers.assign(list, list + size);
      sorted.assign(list, list + size);
      std::sort(sorted.begin(), sorted.end());
      sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    }
    const int32_t own = ownerOf(static_cast<int32_t>(k));
    int32_t* out = list;
    for (const int32_t w : sorted) {
      if (w != own) *out++ = w;
    }
    r.last[k] = out - r.receivers.data();
  }
  return r;
}

std::vector<Transfer> transfersOf(const Plan& plan, const BlockReceivers& r) {
  size_t count = 0;
  for (size_t k = 0; k < r.last.size(); ++k) count += static_cast<size_t>(r.last[k] - r.first[k]);
  std::vector<Transfer> transfers;
  detail::reserveHuge(transfers, count);
  const int64_t bytesPerToken = plan.config.attention.kvBytesPerToken();
  for (size_t k = 0; k < r.last.size(); ++k) {
    const int64_t bytes = plan.blocks[k].numTokens() * bytesPerToken;
    for (int64_t i = r.first[k]; i < r.last[k]; ++i)
      transfers.push_back({.block = static_cast<int32_t>(k),
                           .sender = plan.owner[k],
                           .receiver = r.receivers[static_cast<size_t>(i)],
                           .round = 0,
                           .bytes = bytes});
  }
  return transfers;
}

std::vector<int64_t> bytesByWorker(const Plan& plan, const BlockReceivers& r) {
  std::vector<int64_t> moved(static_cast<size_t>(plan.config.numWorkers), 0);
  const int64_t bytesPerToken = plan.config.attention.kvBytesPerToken();
  for (size_t k = 0; k < r.last.size(); ++k) {
    const int64_t bytes = plan.blocks[k].numTokens() * bytesPerToken;
    moved[static_cast<size_t>(plan.owner[k])] += (r.last[k] - r.first[k]) * bytes;
    for (int64_t i = r.first[k]; i < r.last[k]; ++i)
      moved[static_cast<size_t>(r.receivers[static_cast<size_t>(i)])] += bytes;
  }
  return moved;
}

}  // namespace detail

std::vector<Transfer> buildTransfers(const Plan& plan) {
  return detail::transfersOf(plan, detail::blockReceivers(plan));
}

void colorTransfers(Plan& plan) {
  plan.numRounds =
      detail::colorTransferRounds(static_cast<int32_t>(plan.config.numWorkers), plan.transfers);
}

namespace {

/// What buildStages shares between workers. Terms: a transfer of round r travels in group
/// g = r / coalesce, in stage g; its receiver computes with it `lag` stages later (buffer
/// depth − 1) and frees its buffer then; backward, the dK/dV partial goes back one stage after
/// that. `need` keys a received transfer by N plus its position in `received`.
struct StageInputs {
  const Plan& plan;
  size_t lag;
  int64_t groups;
  size_t fwdStages;
  TransfersByWorker sent, received;
  PairsByNeed need;

  size_t needs(size_t key) const { return static_cast<size_t>(need.end(key) - need.begin(key)); }
};

/// Sizes and fills one worker's lists in both passes (Stages::twoPasses).
/// Forward: a transfer is sent and received in its group's stage; its pairs are computed, and
/// its buffer released, `lag` stages later; the local pairs are split, the first half opening
/// stage 0 (which receives nothing to compute, lag >= 1) and the second closing the last
/// stage. Backward: the forward stages plus one, in which the last group's dK/dV partials go
/// home; the local pairs that closed the forward pipeline move to that last stage, to hide
/// those returns; a partial goes back `lag + 1` stages after its transfer. Every list is in
/// transfer order (ascending ids), the local pairs in their order.
struct WorkerLists {
  const StageInputs& in;
  size_t bwdStages;

  /// Worker w's list sizes: forward at fwd[s * kStageLists + list], backward likewise.
  void size(size_t w, int64_t* fwd, int64_t* bwd) const {
    const auto n = static_cast<size_t>(in.plan.config.numWorkers);
    const auto at = [](int64_t* base, size_t s, StageList list) -> int64_t& {
      return base[s * kStageLists + static_cast<size_t>(list)];
    };
    const TransfersByWorker& out = in.sent;
    const TransfersByWorker& into = in.received;
    for (size_t i = out.begin(w); i < out.end(w); ++i)
      ++at(fwd, static_cast<size_t>(out.group[i]), StageList::kSend);
    for (size_t i = into.begin(w); i < into.end(w); ++i) {
      const auto g = static_cast<size_t>(into.group[i]);
      ++at(fwd, g, StageList::kRecv);
      at(fwd, g + in.lag, StageList::kCompute) += static_cast<int64_t>(in.needs(n + i));
      ++at(fwd, g + in.lag, StageList::kRelease);
    }
    const auto local = static_cast<int64_t>(in.needs(w));
    at(fwd, 0, StageList::kCompute) += (local + 1) / 2;
    at(fwd, in.fwdStages - 1, StageList::kCompute) += local / 2;
    std::copy(fwd, fwd + in.fwdStages * kStageLists, bwd);
    if (in.groups == 0) return;  // nothing received: the backward stages are the forward ones
    at(bwd, in.fwdStages - 1, StageList::kCompute) -= local / 2;
    at(bwd, in.fwdStages, StageList::kCompute) = local / 2;
    for (size_t i = into.begin(w); i < into.end(w); ++i)
      ++at(bwd, static_cast<size_t>(into.group[i]) + in.lag + 1, StageList::kSendGrad);
    for (size_t i = out.begin(w); i < out.end(w); ++i)
      ++at(bwd, static_cast<size_t>(out.group[i]) + in.lag + 1, StageList::kRecvGrad);
  }

  /// Fills worker w's lists, sized by size(); `cursor` is scratch of bwdStages * kStageLists.
  void fill(size_t w, StagesToFill& forward, StagesToFill& backward,
            std::vector<int32_t*>& cursor) const {
    const auto n = static_cast<size_t>(in.plan.config.numWorkers);
    const auto listAt = [&](size_t s, StageList list) -> int32_t*& {
      return cursor[s * kStageLists + static_cast<size_t>(list)];
    };
    for (size_t s = 0; s < in.fwdStages; ++s)
      for (size_t l = 0; l < kStageLists; ++l)
        listAt(s, StageList(l)) = forward.list(w, s, StageList(l)).data();
    const TransfersByWorker& out = in.sent;
    const TransfersByWorker& into = in.received;
    const int32_t* local = in.need.begin(w);
    const auto numLocal = static_cast<size_t>(in.need.end(w) - local);
    const size_t opening = (numLocal + 1) / 2;
    int32_t*& open = listAt(0, StageList::kCompute);
    open = std::copy(local, local + opening, open);
    for (size_t i = out.begin(w); i < out.end(w); ++i)
      *listAt(static_cast<size_t>(out.group[i]), StageList::kSend)++ = out.ids[i];
    for (size_t i = into.begin(w); i < into.end(w); ++i) {
      const auto g = static_cast<size_t>(into.group[i]);
      *listAt(g, StageList::kRecv)++ = into.ids[i];
      int32_t*& use = listAt(g + in.lag, StageList::kCompute);
      use = std::copy(in.need.begin(n + i), in.need.end(n + i), use);
      *listAt(g + in.lag, StageList::kRelease)++ = into.ids[i];
    }
    int32_t*& close = listAt(in.fwdStages - 1, StageList::kCompute);
    close = std::copy(local + opening, local + numLocal, close);
    // Backward: the forward lists (forward has no dK/dV lists), the closing stage's compute
    // without its local pairs (a prefix): Stages::twoPasses shares them with the forward's.
    if (in.groups == 0) return;
    const std::span<int32_t> last = backward.list(w, in.fwdStages, StageList::kCompute);
    std::copy(local + opening, local + numLocal, last.begin());
    for (size_t s = in.lag + 1; s < bwdStages; ++s) {
      listAt(s, StageList::kSendGrad) = backward.list(w, s, StageList::kSendGrad).data();
      listAt(s, StageList::kRecvGrad) = backward.list(w, s, StageList::kRecvGrad).data();
    }
    for (size_t i = into.begin(w); i < into.end(w); ++i)
      *listAt(static_cast<size_t>(into.group[i]) + in.lag + 1, StageList::kSendGrad)++ =
          into.ids[i];
    for (size_t i = out.begin(w); i < out.end(w); ++i)
      *listAt(static_cast<size_t>(out.group[i]) + in.lag + 1, StageList::kRecvGrad)++ = out.ids[i];
  }
};

}  // namespace

namespace detail {

StagePrep prepareStages(const Plan& plan) {
  StagePrep prep;
  std::vector<uint32_t> position;
  prep.received = transfersBy(plan, &Transfer::receiver, &position);
  prep.need = groupPairs(plan, position);
  prep.sent = transfersBy(plan, &Transfer::sender);
  return prep;
}

void buildStages(Plan& plan, StagePrep prep) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const int64_t c = plan.config.coalesce;
  const int64_t groups = (plan.numRounds + c - 1) / c;
  const auto lag = static_cast<size_t>(plan.config.bufferDepth - 1);
  const bool parallel = detail::worthParallel(static_cast<int64_t>(plan.pairs.size()));
  detail::runBoth(
      parallel, [&] { setGroups(plan, &Transfer::receiver, prep.received); },
      [&] { setGroups(plan, &Transfer::sender, prep.sent); });
  // Worker by worker, so that each worker's stages stay in cache while they fill (filled in
  // transfer order, every transfer touched three workers' stages scattered over memory).
  const StageInputs in{plan,
                       lag,
                       groups,
                       groups > 0 ? static_cast<size_t>(groups) + lag : 1,
                       std::move(prep.sent),
                       std::move(prep.received),
                       std::move(prep.need)};
  const size_t fwd = in.fwdStages, bwd = groups > 0 ? fwd + 1 : fwd;
  const WorkerLists lists{in, bwd};
  // All lists sized first, then filled in place: one allocation for both passes.
  std::vector<int64_t> fwdSizes, bwdSizes;
  detail::resizeHuge(fwdSizes, n * fwd * kStageLists);
  detail::resizeHuge(bwdSizes, n * bwd * kStageLists);
  detail::runBoth(
      parallel,
      [&] {
        for (size_t w = 0; w < n / 2; ++w)
          lists.size(w, &fwdSizes[w * fwd * kStageLists], &bwdSizes[w * bwd * kStageLists]);
      },
      [&] {
        for (size_t w = n / 2; w < n; ++w)
          lists.size(w, &fwdSizes[w * fwd * kStageLists], &bwdSizes[w * bwd * kStageLists]);
      });
  // The backward pass's send, receive, compute and release lists are prefixes of the
  // forward's (WorkerLists): stored once, and the storage is not cleared (every other list is
  // written below), so its pages are first touched by the fill, on both threads.
  // Named references, not structured bindings: lambdas capture those only from Clang 16.
  std::pair<StagesToFill, StagesToFill> passes =
      Stages::twoPasses(std::vector<int64_t>(n, static_cast<int64_t>(fwd)), std::move(fwdSizes),
                        std::vector<int64_t>(n, static_cast<int64_t>(bwd)), bwdSizes);
  StagesToFill& forward = passes.first;
  StagesToFill& backward = passes.second;
  // Workers' lists are independent: two halves on two threads for large plans.
  const auto fill = [&](size_t first, size_t last) {
    std::vector<int32_t*> cursor(bwd * kStageLists);
    for (size_t w = first; w < last; ++w) lists.fill(w, forward, backward, cursor);
  };
  detail::runBoth(
      parallel, [&] { fill(0, n / 2); }, [&] { fill(n / 2, n); });
  plan.forward = std::move(forward).done();
  plan.backward = std::move(backward).done();
}

double forwardSpan(const Plan& plan, StagePrep prep) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const int64_t c = plan.config.coalesce;
  const int64_t groups = (plan.numRounds + c - 1) / c;
  const auto lag = static_cast<size_t>(plan.config.bufferDepth - 1);
  FCP_CHECK(lag >= 1, "a buffer depth of ", plan.config.bufferDepth, ": expected at least 2");
  const size_t stages = groups > 0 ? static_cast<size_t>(groups) + lag : 1;
  // Only the received lists are read (a transfer's sending stage is its group, from its round).
  setGroups(plan, &Transfer::receiver, prep.received);
  const auto costOf = [&](int32_t p) { return plan.pairs[static_cast<size_t>(p)].cost; };
  // Each stage's compute, summed in the order forwardStages lists its pairs: stage 0 opens
  // with the first half of the local pairs (nothing received lands there, lag >= 1), the pairs
  // of each received transfer land `lag` stages after its group in received order, and the
  // last stage closes with the second half of the local pairs.
  std::vector<double> compute(n * stages, 0.0);
  for (size_t w = 0; w < n; ++w) {
    double* at = compute.data() + w * stages;
    const int32_t* local = prep.need.begin(w);
    const auto numLocal = static_cast<size_t>(prep.need.end(w) - local);
    const size_t opening = (numLocal + 1) / 2;
    for (size_t k = 0; k < opening; ++k) at[0] += costOf(local[k]);
    for (size_t i = prep.received.begin(w); i < prep.received.end(w); ++i) {
      double& stage = at[static_cast<size_t>(prep.received.group[i]) + lag];
      for (const int32_t* p = prep.need.begin(n + i); p != prep.need.end(n + i); ++p)
        stage += costOf(*p);
    }
    for (size_t k = opening; k < numLocal; ++k) at[stages - 1] += costOf(local[k]);
  }
  // Transfers by group, each sent and received in its group's stage at both ends.
  std::vector<size_t> firstOfGroup(static_cast<size_t>(groups) + 1, 0);
  for (const Transfer& t : plan.transfers) ++firstOfGroup[static_cast<size_t>(t.round / c) + 1];
  for (size_t g = 1; g < firstOfGroup.size(); ++g) firstOfGroup[g] += firstOfGroup[g - 1];
  std::vector<int32_t> byGroup(plan.transfers.size());
  {
    std::vector<size_t> next(firstOfGroup.begin(), firstOfGroup.end() - 1);
    for (size_t t = 0; t < plan.transfers.size(); ++t)
      byGroup[next[static_cast<size_t>(plan.transfers[t].round / c)]++] = static_cast<int32_t>(t);
  }
  // Stage by stage, as pipelineSpan's pass over aligned stages: a stage ends once its entry
  // plus its compute has passed and each transfer it holds has been entered at the other end.
  std::vector<double> before(n, 0.0), after(n, 0.0);
  double span = 0.0;
  for (size_t s = 0; s < stages; ++s) {
    for (size_t w = 0; w < n; ++w) after[w] = before[w] + compute[w * stages + s];
    if (s < static_cast<size_t>(groups)) {
      for (size_t k = firstOfGroup[s]; k < firstOfGroup[s + 1]; ++k) {
        const Transfer& t = plan.transfers[static_cast<size_t>(byGroup[k])];
        const auto from = static_cast<size_t>(t.sender), to = static_cast<size_t>(t.receiver);
        after[from] = std::max(after[from], before[to]);
        after[to] = std::max(after[to], before[from]);
      }
    }
    for (size_t w = 0; w < n; ++w) span = std::max(span, after[w]);
    before.swap(after);
  }
  return span;
}

}  // namespace detail

void buildStages(Plan& plan) { detail::buildStages(plan, detail::prepareStages(plan)); }

namespace {

/// The stages of all workers as nodes, first[w] + s for worker w's stage s: when that stage
/// ends. A node's entry is the end of the node before it at its worker, or 0 for a first
/// stage: node `zero` (= count), a sentinel whose end stays 0.
struct StageNodes {
  explicit StageNodes(const Stages& stages) : first(stages.size() + 1, 0) {
    for (size_t w = 0; w < stages.size(); ++w) first[w + 1] = first[w] + stages[w].size();
    count = zero = first.back();
  }
  std::vector<size_t> first;
  size_t count = 0;
  size_t zero = 0;
};

constexpr size_t kNoEntry = std::numeric_limits<size_t>::max();

/// Where one end holds a transfer: the node its stage is entered from, and the stage.
struct StageEnd {
  size_t entry = kNoEntry;
  size_t stage = 0;
};

}  // namespace

namespace detail {

double linkedPassSpan(const Plan& plan, const Stages& stages, double computeFactor,
                      double costPerByte, double gradPerKvByte) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  FCP_CHECK_EQ(stages.size(), n);
  const StageNodes nodes(stages);
  const std::vector<size_t>& first = nodes.first;
  const size_t numNodes = nodes.count, zero = nodes.zero;
  // Where each end holds each transfer (and, backward, its partial).
  using End = StageEnd;
  constexpr size_t kNone = kNoEntry;
  const size_t numTransfers = plan.transfers.size();
  std::vector<End> ends(4 * numTransfers);  // send, receive, partial send, partial receive
  std::vector<double> duration(numNodes, 0.0);
  const auto bytesOf = [&](int32_t t) {
    return static_cast<double>(plan.transfers[static_cast<size_t>(t)].bytes);
  };
  for (size_t w = 0; w < n; ++w) {
    for (size_t s = 0; s < stages[w].size(); ++s) {
      const Stage& st = stages[w][s];
      const End at{s == 0 ? zero : first[w] + s - 1, s};
      double compute = 0, out = 0, in = 0;
      for (int32_t p : st.compute) {
        FCP_CHECK(p >= 0 && static_cast<size_t>(p) < plan.pairs.size(), "worker ", w, " stage ",
                  s, " names pair ", p, " of ", plan.pairs.size());
        compute += plan.pairs[static_cast<size_t>(p)].cost;
      }
      const auto note = [&](std::span<const int32_t> ids, size_t kind, double scale,
                            double& bytes) {
        for (int32_t t : ids) {
          FCP_CHECK(t >= 0 && static_cast<size_t>(t) < numTransfers, "worker ", w, " stage ", s,
                    " names transfer ", t, " of ", numTransfers);
          End& slot = ends[kind * numTransfers + static_cast<size_t>(t)];
          FCP_CHECK(slot.entry == kNone, "transfer ", t, " is held twice at one end");
          slot = at;
          bytes += scale * bytesOf(t);
        }
      };
      note(st.send, 0, 1.0, out);
      note(st.recv, 1, 1.0, in);
      note(st.sendGrad, 2, gradPerKvByte, out);
      note(st.recvGrad, 3, gradPerKvByte, in);
      duration[first[w] + s] =
          std::max({computeFactor * compute, costPerByte * out, costPerByte * in});
    }
  }
  // Each kind's other end: send <-> receive, partial send <-> partial receive.
  for (size_t t = 0; t < numTransfers; ++t) {
    for (const size_t kind : {size_t{0}, size_t{2}}) {
      const End& a = ends[kind * numTransfers + t];
      const End& b = ends[(kind + 1) * numTransfers + t];
      FCP_CHECK((a.entry == kNone) == (b.entry == kNone), "transfer ", t,
                kind == 0 ? "" : "'s partial", " is held at one end only");
      FCP_CHECK(a.stage == b.stage, "transfer ", t, kind == 0 ? "" : "'s partial",
                " is not in the same stage at both ends");
    }
  }
  std::vector<double> end(numNodes + 1, 0.0);
  size_t most = 0;
  for (size_t w = 0; w < n; ++w) most = std::max(most, stages[w].size());
  // Stage by stage over all workers: every wait is on a stage before (aligned ends).
  for (size_t s = 0; s < most; ++s) {
    for (size_t w = 0; w < n; ++w) {
      if (s >= stages[w].size()) continue;
      const Stage& st = stages[w][s];
      const size_t x = first[w] + s;
      double e = end[s == 0 ? zero : x - 1] + duration[x];
      const auto wait = [&](std::span<const int32_t> ids, size_t otherKind) {
        for (int32_t t : ids)
          e = std::max(e, end[ends[otherKind * numTransfers + static_cast<size_t>(t)].entry]);
      };
      wait(st.send, 1);
      wait(st.recv, 0);
      wait(st.sendGrad, 3);
      wait(st.recvGrad, 2);
      end[x] = e;
    }
  }
  return *std::max_element(end.begin(), end.end());
}

double linkedStepTime(const Plan& plan, double costPerByte) {
  const AttentionConfig& a = plan.config.attention;
  const double gradPerKvByte = 2.0 * static_cast<double>(sizeof(float)) *
                               static_cast<double>(a.numHeadsKv * a.headDim) /
                               static_cast<double>(a.kvBytesPerToken());
  double time = linkedPassSpan(plan, plan.forward, 1.0, costPerByte, 0.0) +
                linkedPassSpan(plan, plan.backward, kBackwardFlopsPerForward, costPerByte,
                               gradPerKvByte);
  int64_t forward = 0, backward = 0;
  for (const WorkerTraffic& w : computeTraffic(plan)) {
    forward = std::max({forward, w.forward.reshuffleSent, w.forward.reshuffleReceived});
    backward = std::max({backward, w.backward.reshuffleSent, w.backward.reshuffleReceived});
  }
  return time + costPerByte * static_cast<double>(forward + backward);
}

}  // namespace detail

double pipelineSpan(const Plan& plan) {
  const auto& stages = plan.forward;
  if (plan.config.numWorkers < 0 ||
      stages.size() != static_cast<size_t>(plan.config.numWorkers)) {
    throw Error(ErrorCode::kInvalidPlan, "forward stages cover " + std::to_string(stages.size()) +
                                             " workers, not the plan's " +
                                             std::to_string(plan.config.numWorkers));
  }
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  // Ids in range, as validate checks: a plan read from a file may name anything.
  const auto inRange = [](int32_t id, size_t count, const char* what, size_t w, size_t s) {
    if (id < 0 || static_cast<size_t>(id) >= count) {
      throw Error(ErrorCode::kInvalidPlan,
                  "forward worker " + std::to_string(w) + " stage " + std::to_string(s) +
                      " names " + what + " " + std::to_string(id) + ": expected 0 to " +
                      std::to_string(count) + " - 1");
    }
    return static_cast<size_t>(id);
  };
  const StageNodes nodes(stages);
  const std::vector<size_t>& first = nodes.first;
  const size_t numNodes = nodes.count, zero = nodes.zero;
  // Where each end holds each transfer.
  using End = StageEnd;
  constexpr size_t kNone = kNoEntry;
  std::vector<End> sender(plan.transfers.size()), receiver(plan.transfers.size());
  std::vector<double> compute(numNodes, 0.0);
  for (size_t w = 0; w < n; ++w) {
    for (size_t s = 0; s < stages[w].size(); ++s) {
      const End at{s == 0 ? zero : first[w] + s - 1, s};
      for (const bool sends : {true, false}) {
        std::vector<End>& ends = sends ? sender : receiver;
        for (int32_t t : sends ? stages[w][s].send : stages[w][s].recv) {
          End& end = ends[inRange(t, ends.size(), "transfer", w, s)];
          if (end.entry != kNone) {
            throw Error(ErrorCode::kInvalidPlan,
                        "transfer " + std::to_string(t) + " is " + (sends ? "sent" : "received") +
                            " twice in the forward stages (again by worker " +
                            std::to_string(w) + " in stage " + std::to_string(s) + ")");
          }
          end = at;
        }
      }
      for (int32_t p : stages[w][s].compute)
        compute[first[w] + s] += plan.pairs[inRange(p, plan.pairs.size(), "pair", w, s)].cost;
    }
  }
  bool aligned = true;  // every transfer in the same stage at both ends
  for (size_t t = 0; t < plan.transfers.size(); ++t) {
    for (const bool sends : {true, false}) {
      if ((sends ? sender : receiver)[t].entry == kNone) {
        throw Error(ErrorCode::kInvalidPlan, "transfer " + std::to_string(t) + " is never " +
                                                 (sends ? "sent" : "received") +
                                                 " in the forward stages");
      }
    }
    aligned = aligned && sender[t].stage == receiver[t].stage;
  }
  // A stage ends once its entry plus its compute has passed and each transfer it holds has
  // been entered at the other end.
  std::vector<double> end(numNodes + 1, 0.0);
  const auto finish = [&](size_t w, size_t s) {
    const size_t x = first[w] + s;
    double e = end[s == 0 ? zero : x - 1] + compute[x];
    for (int32_t t : stages[w][s].send)
      e = std::max(e, end[receiver[static_cast<size_t>(t)].entry]);
    for (int32_t t : stages[w][s].recv) e = std::max(e, end[sender[static_cast<size_t>(t)].entry]);
    end[x] = e;
  };
  if (aligned) {
    // As buildStages places them: every wait is on a stage before, so one pass in stage order
    // (all workers' stages s after all stages s - 1) is exact, and no cycle can form.
    size_t most = 0;
    for (size_t w = 0; w < n; ++w) most = std::max(most, stages[w].size());
    for (size_t s = 0; s < most; ++s) {
      for (size_t w = 0; w < n; ++w) {
        if (s < stages[w].size()) finish(w, s);
      }
    }
  } else {
    // Kahn's order over the waits: a node is finished once every node it waits for is. The
    // same sums and maxima in any order, so the same span as the pass above.
    std::vector<size_t> waitsOn(numNodes, 0), waitersFrom(numNodes + 1, 0);
    const auto forEachWait = [&](auto&& visit) {  // (node waited for, waiting node)
      for (size_t w = 0; w < n; ++w) {
        for (size_t s = 0; s < stages[w].size(); ++s) {
          const size_t x = first[w] + s;
          if (s > 0) visit(x - 1, x);
          for (int32_t t : stages[w][s].send) visit(receiver[static_cast<size_t>(t)].entry, x);
          for (int32_t t : stages[w][s].recv) visit(sender[static_cast<size_t>(t)].entry, x);
        }
      }
    };
    forEachWait([&](size_t from, size_t to) {
      if (from == zero) return;
      ++waitersFrom[from + 1];
      ++waitsOn[to];
    });
    for (size_t x = 1; x <= numNodes; ++x) waitersFrom[x] += waitersFrom[x - 1];
    std::vector<size_t> next(waitersFrom.begin(), waitersFrom.end() - 1);
    std::vector<size_t> dependents(waitersFrom.back());
    forEachWait([&](size_t from, size_t to) {
      if (from != zero) dependents[next[from]++] = to;
    });
    std::vector<std::pair<size_t, size_t>> nodeAt(numNodes);  // (worker, stage)
    for (size_t w = 0; w < n; ++w) {
      for (size_t s = 0; s < stages[w].size(); ++s) nodeAt[first[w] + s] = {w, s};
    }
    std::vector<size_t> queue;
    for (size_t x = 0; x < numNodes; ++x) {
      if (waitsOn[x] == 0) queue.push_back(x);
    }
    for (size_t i = 0; i < queue.size(); ++i) {
      const size_t x = queue[i];
      finish(nodeAt[x].first, nodeAt[x].second);
      for (size_t j = waitersFrom[x]; j < waitersFrom[x + 1]; ++j) {
        if (--waitsOn[dependents[j]] == 0) queue.push_back(dependents[j]);
      }
    }
    if (queue.size() != numNodes) {
      throw Error(ErrorCode::kInvalidPlan,
                  "the forward stages' transfers wait on each other in a cycle");
    }
  }
  return *std::max_element(end.begin(), end.end());
}

namespace detail {

void validateCommunication(const Plan& plan, Violations& v) {
  const int64_t n = plan.config.numWorkers;
  // Transfers: exactly those the pairs need.
  const std::vector<Transfer> expected = buildTransfers(plan);
  if (expected.size() != plan.transfers.size()) {
    v.add("plan has ", plan.transfers.size(), " transfers but its pairs need ", expected.size());
    return;
  }
  for (size_t t = 0; t < expected.size(); ++t) {
    const Transfer& a = plan.transfers[t];
    const Transfer& e = expected[t];
    // The sender may be a relay (ring attention passes blocks on); the stage replay below
    // checks that a relay holds the block when it sends it.
    if (a.block != e.block || a.receiver != e.receiver || a.bytes != e.bytes || a.sender < 0 ||
        a.sender >= n || a.sender == a.receiver) {
      v.add("transfer ", t, " (block ", a.block, " ", a.sender, " -> ", a.receiver, ", ", a.bytes,
            " bytes) is not the needed (block ", e.block, " ", e.sender, " -> ", e.receiver, ", ",
            e.bytes, " bytes)");
      return;
    }
  }
  // Rounds: exactly Δ, each a matching.
  const int32_t delta = maxTransferDegree(static_cast<int32_t>(n), plan.transfers);
  if (plan.congestionFree && plan.numRounds != delta) {
    v.add("plan has ", plan.numRounds, " rounds, but Δ = ", delta);
  }
  bool roundsInRange = true;
  for (size_t t = 0; t < plan.transfers.size(); ++t) {
    const Transfer& tr = plan.transfers[t];
    if (tr.round < 0 || tr.round >= plan.numRounds) {
      v.add("transfer ", t, " is in round ", tr.round, ", not one of 0..",
            static_cast<int64_t>(plan.numRounds) - 1);
      roundsInRange = false;
    }
  }
  // A round is a matching when no worker sends twice or receives twice in it: first a mark per
  // (worker, round) at each end, which finds no repeat in a valid plan; where one repeats,
  // transfers by round (CSR, in id order within a round) name every repeat in round order. A
  // plan file may claim any round count; past one round per transfer (Δ is at most that) the
  // rounds' count above has failed it already.
  const auto repeatsARound = [&] {
    // As many words of marks as transfers at most (a plan file may claim many rounds): else the
    // walk.
    const auto rounds = static_cast<size_t>(plan.numRounds);
    if (rounds == 0 || static_cast<size_t>(n) * rounds / 64 > plan.transfers.size()) return true;
    std::vector<uint64_t> sends(static_cast<size_t>(n) * rounds / 64 + 1), receives(sends.size());
    const auto seen = [&](std::vector<uint64_t>& marks, int32_t worker, int32_t round) {
      const size_t slot = static_cast<size_t>(worker) * rounds + static_cast<size_t>(round);
      const uint64_t bit = uint64_t{1} << (slot % 64);
      const bool was = (marks[slot / 64] & bit) != 0;
      marks[slot / 64] |= bit;
      return was;
    };
    for (const Transfer& tr : plan.transfers) {
      if (seen(sends, tr.sender, tr.round) || seen(receives, tr.receiver, tr.round)) return true;
    }
    return false;
  };
  if (plan.congestionFree && roundsInRange &&
      static_cast<size_t>(plan.numRounds) <= plan.transfers.size() + 1 && repeatsARound()) {
    std::vector<int64_t> roundStart(static_cast<size_t>(plan.numRounds) + 1, 0);
    for (const Transfer& tr : plan.transfers) ++roundStart[static_cast<size_t>(tr.round) + 1];
    for (size_t r = 1; r < roundStart.size(); ++r) roundStart[r] += roundStart[r - 1];
    std::vector<int32_t> byRound(plan.transfers.size());
    std::vector<int64_t> next(roundStart.begin(), roundStart.end() - 1);
    for (size_t t = 0; t < plan.transfers.size(); ++t)
      byRound[static_cast<size_t>(next[static_cast<size_t>(plan.transfers[t].round)]++)] =
          static_cast<int32_t>(t);
    // The transfer each worker last sent and received in the round being checked.
    const auto workers = static_cast<size_t>(n);
    std::vector<int32_t> sending(workers, -1), receiving(workers, -1);
    std::vector<int32_t> sendRound(workers, -1), recvRound(workers, -1);
    for (int32_t r = 0; r < plan.numRounds; ++r) {
      const auto rs = static_cast<size_t>(r);
      for (int64_t i = roundStart[rs]; i < roundStart[rs + 1]; ++i) {
        const int32_t t = byRound[static_cast<size_t>(i)];
        const Transfer& tr = plan.transfers[static_cast<size_t>(t)];
        for (const bool sends : {true, false}) {
          const auto w = static_cast<size_t>(sends ? tr.sender : tr.receiver);
          std::vector<int32_t>& last = sends ? sending : receiving;
          std::vector<int32_t>& in = sends ? sendRound : recvRound;
          if (in[w] == r) {
            v.add("round ", r, " is not a matching: worker ", w, (sends ? " sends" : " receives"),
                  " transfers ", last[w], " and ", t);
          }
          in[w] = r;
          last[w] = t;
        }
      }
    }
  }
  if (!v.empty()) return;
  if (plan.config.coalesce <= 0 || plan.config.bufferDepth < 2) {
    v.add("coalesce ", plan.config.coalesce, " / buffer depth ", plan.config.bufferDepth,
          ": expected >= 1 / >= 2");
    return;
  }

  // Transfers are in (block, receiver) order (they equal buildTransfers' above): each block's
  // are a run, found through its start.
  std::vector<int64_t> blockStart(plan.blocks.size() + 1, 0);
  for (const Transfer& tr : plan.transfers) ++blockStart[static_cast<size_t>(tr.block) + 1];
  for (size_t b = 1; b < blockStart.size(); ++b) blockStart[b] += blockStart[b - 1];
  const auto transferOf = [&](int32_t block, int32_t receiver) -> int32_t {
    const auto first = plan.transfers.begin() + blockStart[static_cast<size_t>(block)];
    const auto last = plan.transfers.begin() + blockStart[static_cast<size_t>(block) + 1];
    const auto it = std::lower_bound(first, last, receiver, [](const Transfer& t, int32_t r) {
      return t.receiver < r;
    });
    if (it == last || it->receiver != receiver) return -1;
    return static_cast<int32_t>(it - plan.transfers.begin());
  };

  // Each worker's transfers, as receiver: with them the replay of a worker's stages finds the
  // transfer bringing a pair's KV block (transferOf) in a table by block.
  const TransfersByWorker into = transfersBy(plan, &Transfer::receiver);

  // Stages, both passes: replay every worker's stages. The passes are independent: on two
  // threads for large plans, each with its own sentences (forward's are reported first).
  const int64_t bufferLimit = plan.config.bufferDepth * plan.config.coalesce;
  const auto replay = [&](auto slotTag, const bool backward, Violations& found) {
    using Slot = decltype(slotTag);
    const auto& stages = backward ? plan.backward : plan.forward;
    const char* pass = backward ? "backward" : "forward";
    if (static_cast<int64_t>(stages.size()) != n) {
      found.add(pass, " stages cover ", stages.size(), " workers, not ", n);
      return;
    }
    // transferOf(block, w) for the worker w being replayed, -1 where there is none.
    std::vector<int32_t> transferTo(plan.blocks.size(), -1);
    const auto blockOf = [&](int32_t t) {
      return static_cast<size_t>(plan.transfers[static_cast<size_t>(t)].block);
    };
    const size_t numT = plan.transfers.size();
    // The stage at which each transfer is sent, received, ... (-1: not yet), side by side: a
    // pair's check reads three of them for one transfer, in one cache line.
    struct When {
      Slot sent = -1, recv = -1, released = -1, lastUse = -1, gradSent = -1, gradRecv = -1;
    };
    std::vector<When> at(numT);
    std::vector<Slot> computedAt(plan.pairs.size(), -1);
    // Records that `id`, of `limit` ids, happens at `stage` in the slot `slotOf(id)` gives;
    // false, with a sentence, when the id is out of range (no slot is read) or happened before.
    auto mark = [&](auto&& slotOf, int32_t id, size_t limit, int64_t stage, const char* what,
                    int64_t worker) {
      if (id < 0 || static_cast<size_t>(id) >= limit) {
        found.add(pass, " worker ", worker, " stage ", stage, " names ", what, " ", id,
                  " out of range");
        return false;
      }
      Slot& when = slotOf(static_cast<size_t>(id));
      if (when >= 0) {
        found.add(pass, ": ", what, " ", id, " happens twice");
        return false;
      }
      when = static_cast<Slot>(stage);
      return true;
    };
    // mark() of a transfer's field of When, and of a pair's computedAt.
    const auto markTransfer = [&](Slot When::*field, int32_t t, int64_t stage, const char* what,
                                  int64_t worker) {
      return mark([&](size_t i) -> Slot& { return at[i].*field; }, t, numT, stage, what, worker);
    };
    const auto markPair = [&](int32_t p, int64_t stage, int64_t worker) {
      return mark([&](size_t i) -> Slot& { return computedAt[i]; }, p, plan.pairs.size(), stage,
                  "pair", worker);
    };
    for (int64_t w = 0; w < n; ++w) {
      int64_t held = 0;
      bool overflowed = false;
      const auto& ws = stages[static_cast<size_t>(w)];
      const auto mine = std::span(into.ids).first(into.end(static_cast<size_t>(w)))
                            .subspan(into.begin(static_cast<size_t>(w)));
      for (const int32_t t : mine) transferTo[blockOf(t)] = t;
      for (int64_t s = 0; s < static_cast<int64_t>(ws.size()); ++s) {
        const Stage& st = ws[static_cast<size_t>(s)];
        if (static_cast<int64_t>(st.send.size()) > plan.config.coalesce ||
            static_cast<int64_t>(st.recv.size()) > plan.config.coalesce ||
            static_cast<int64_t>(st.sendGrad.size()) > plan.config.coalesce ||
            static_cast<int64_t>(st.recvGrad.size()) > plan.config.coalesce) {
          found.add(pass, " worker ", w, " stage ", s, " moves more than ", plan.config.coalesce,
                    " blocks one way");
        }
        for (int32_t t : st.send) {
          if (markTransfer(&When::sent, t, s, "send of transfer", w) &&
              plan.transfers[static_cast<size_t>(t)].sender != w) {
            found.add(pass, ": worker ", w, " sends transfer ", t, " meant to come from another");
          }
        }
        for (int32_t t : st.recv) {
          if (markTransfer(&When::recv, t, s, "receive of transfer", w) &&
              plan.transfers[static_cast<size_t>(t)].receiver != w) {
            found.add(pass, ": worker ", w, " receives transfer ", t, " meant for another");
          }
        }
        held += static_cast<int64_t>(st.recv.size());
        if (held > bufferLimit && !overflowed) {  // once per worker: the first stage says it
          overflowed = true;
          found.add(pass, " worker ", w, " holds ", held, " remote blocks at stage ", s,
                    ", over buffer depth ", plan.config.bufferDepth, " x coalesce ",
                    plan.config.coalesce);
        }
        for (int32_t p : st.compute) {
          if (!markPair(p, s, w)) continue;
          const BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
          if (plan.owner[static_cast<size_t>(pair.qBlock)] != w) {
            found.add(pass, ": worker ", w, " computes pair ", p, " whose Q block it does not own");
            continue;
          }
          if (plan.owner[static_cast<size_t>(pair.kvBlock)] == w) continue;
          const int32_t t = transferTo[static_cast<size_t>(pair.kvBlock)];
          When* const tw = t < 0 ? nullptr : &at[static_cast<size_t>(t)];
          if (!tw || tw->recv < 0 || tw->recv >= s || tw->released >= 0) {
            found.add(pass, ": worker ", w, " computes pair ", p, " at stage ", s,
                      " before its KV block ", pair.kvBlock,
                      " arrived (or after its buffer was freed)");
            continue;
          }
          tw->lastUse = static_cast<Slot>(s);
        }
        for (int32_t t : st.release) {
          if (!markTransfer(&When::released, t, s, "release of transfer", w)) continue;
          const auto ts = static_cast<size_t>(t);
          if (plan.transfers[ts].receiver != w || at[ts].recv < 0 || at[ts].recv > s) {
            found.add(pass, ": worker ", w, " frees the buffer of transfer ", t,
                      " that it has not received");
            continue;
          }
          --held;
        }
        for (int32_t t : st.sendGrad) {
          if (markTransfer(&When::gradSent, t, s, "dK/dV partial of transfer", w) &&
              (plan.transfers[static_cast<size_t>(t)].receiver != w ||
               at[static_cast<size_t>(t)].lastUse < 0 || at[static_cast<size_t>(t)].lastUse >= s)) {
            found.add(pass, ": worker ", w, " sends the dK/dV partial of transfer ", t,
                      " before computing with it, or it is not its to send");
          }
        }
        for (int32_t t : st.recvGrad) {
          if (markTransfer(&When::gradRecv, t, s, "dK/dV return of transfer", w) &&
              plan.transfers[static_cast<size_t>(t)].sender != w) {
            found.add(pass, ": worker ", w,
                      " receives a dK/dV partial of a transfer it did not send");
          }
        }
      }
      for (const int32_t t : mine) transferTo[blockOf(t)] = -1;
    }
    for (size_t t = 0; t < numT; ++t) {
      const When& a = at[t];
      if (a.sent < 0 || a.recv < 0 || a.sent != a.recv) {
        found.add(pass, ": transfer ", t, " is sent at stage ", a.sent, " and received at stage ",
                  a.recv, ": expected once each, in the same stage");
      }
      if (a.released < 0) found.add(pass, ": the buffer of transfer ", t, " is never freed");
      if (backward && (a.gradSent < 0 || a.gradSent != a.gradRecv)) {
        found.add(pass, ": the dK/dV partial of transfer ", t, " is sent at stage ", a.gradSent,
                  " and received at stage ", a.gradRecv, ": expected once each, in the same stage");
      }
      if (!backward && a.gradSent >= 0) found.add("forward stages send a dK/dV partial");
      // A relay must hold the block when it passes it on; backward, it returns its own partial
      // only after the partials of everything it relayed came back (it adds them in).
      const Transfer& tr = plan.transfers[t];
      if (tr.sender == plan.owner[static_cast<size_t>(tr.block)] || a.sent < 0) continue;
      const int32_t in = transferOf(tr.block, tr.sender);
      const When* const ia = in < 0 ? nullptr : &at[static_cast<size_t>(in)];
      if (!ia || ia->recv < 0 || ia->recv >= a.sent || ia->released < a.sent) {
        found.add(pass, ": worker ", tr.sender, " relays block ", tr.block, " at stage ", a.sent,
                  " without holding it then");
      } else if (backward && ia->gradSent >= 0 && a.gradRecv >= 0 && ia->gradSent <= a.gradRecv) {
        found.add(pass, ": worker ", tr.sender, " returns its dK/dV partial of block ", tr.block,
                  " before the partial it relayed came back");
      }
    }
    for (size_t p = 0; p < plan.pairs.size(); ++p) {
      if (computedAt[p] < 0) found.add(pass, ": pair ", p, " is never computed");
    }
  };
  // Each pass's stages as 16-bit slots where it has fewer than 2^15 stages per worker (all but
  // plans with tiny rounds per stage): half the records to miss in cache.
  const auto replayIn = [&](const bool backward, Violations& found) {
    const auto& stages = backward ? plan.backward : plan.forward;
    size_t most = 0;
    for (size_t w = 0; w < stages.size(); ++w) most = std::max(most, stages[w].size());
    if (most < size_t{1} << 15) {
      replay(int16_t{}, backward, found);
    } else {
      replay(int32_t{}, backward, found);
    }
  };
  Violations backwardFound;
  runBoth(
      worthParallelCheck(static_cast<int64_t>(plan.pairs.size())), [&] { replayIn(false, v); },
      [&] { replayIn(true, backwardFound); });
  v.append(std::move(backwardFound));

  // Reshuffle: the pieces tile the stream, each inside one user slice and one chunk of a
  // block owned by its fcpWorker.
  const auto seq = sequenceStarts(plan.batch);
  std::vector<int64_t> user;
  try {
    user = userLayout(plan);
    checkUserLayout(user, plan.batch.numTokens(), n);
  } catch (const Error& e) {
    v.add(e.what());
    return;
  }
  std::vector<std::tuple<int64_t, int64_t, int32_t>> chunks;  // (begin, end, owner)
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    for (const Chunk& c : plan.blocks[b].chunks) {
      chunks.push_back({seq[static_cast<size_t>(c.sequence)] + c.begin,
                        seq[static_cast<size_t>(c.sequence)] + c.end, plan.owner[b]});
    }
  }
  std::sort(chunks.begin(), chunks.end());
  int64_t next = 0;
  for (size_t i = 0; i < plan.reshuffle.size(); ++i) {
    const ReshufflePiece& piece = plan.reshuffle[i];
    if (piece.begin != next || piece.end <= piece.begin) {
      v.add("reshuffle piece ", i, " covers [", piece.begin, ", ", piece.end,
            ") but the next token is ", next);
      return;
    }
    next = piece.end;
    const int32_t holder = userWorkerOf(user, piece.begin);
    if (holder != piece.userWorker || piece.end > user[static_cast<size_t>(holder) + 1]) {
      v.add("reshuffle piece ", i, " says user worker ", piece.userWorker, " but tokens from ",
            piece.begin, " are held by ", holder);
    }
    auto it = std::upper_bound(chunks.begin(), chunks.end(),
                               std::make_tuple(piece.begin, INT64_MAX, INT32_MAX));
    if (it == chunks.begin()) {
      v.add("reshuffle piece ", i, " starts before every block");
      continue;
    }
    --it;
    if (std::get<0>(*it) > piece.begin || std::get<1>(*it) < piece.end ||
        std::get<2>(*it) != piece.fcpWorker) {
      v.add("reshuffle piece ", i, " sends tokens [", piece.begin, ", ", piece.end, ") to worker ",
            piece.fcpWorker, ", not to the owner of their block");
    }
  }
  if (next != plan.batch.numTokens()) {
    v.add("reshuffle stops at token ", next, " of ", plan.batch.numTokens());
  }
}

}  // namespace detail
}  // namespace fcp::plan
