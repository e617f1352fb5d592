#include "comm_balance.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <span>

#include "fcp/core/error.h"
#include "fcp/core/statistics.h"
#include "huge_pages.h"

namespace fcp::plan::detail {
namespace {

/// The first p with pairs[p - 1] and pairs[p] not in strict (Q block, KV block) order, as
/// blockPairs makes them (one pair per block pair); 0 when they all are.
size_t pairOutOfOrder(const std::vector<BlockPair>& pairs) {
  for (size_t p = 1; p < pairs.size(); ++p) {
    const BlockPair &a = pairs[p - 1], &b = pairs[p];
    if (!(a.qBlock < b.qBlock || (a.qBlock == b.qBlock && a.kvBlock < b.kvBlock))) return p;
  }
  return 0;
}

/// Max over workers with its argmax (lowest id on ties), O(log N) per update.
class MaxTree {
 public:
  explicit MaxTree(const std::vector<int64_t>& values) : n_(values.size()) {
    while (leaves_ < n_) leaves_ *= 2;
    value_.assign(2 * leaves_, std::numeric_limits<int64_t>::min());
    arg_.assign(2 * leaves_, 0);
    for (size_t w = 0; w < n_; ++w) {
      value_[leaves_ + w] = values[w];
      arg_[leaves_ + w] = static_cast<int32_t>(w);
    }
    for (size_t v = leaves_ - 1; v >= 1; --v) pull(v);
  }
  void set(size_t w, int64_t value) {
    size_t v = leaves_ + w;
    value_[v] = value;
    for (v /= 2; v >= 1; v /= 2) pull(v);
  }
  int64_t max() const { return value_[1]; }
  int32_t argMax() const { return arg_[1]; }

 private:
  void pull(size_t v) {
    const bool right = value_[2 * v + 1] > value_[2 * v];
    value_[v] = value_[2 * v + right];
    arg_[v] = arg_[2 * v + right];
  }
  size_t n_;
  size_t leaves_ = 1;
  std::vector<int64_t> value_;
  std::vector<int32_t> arg_;
};

/// Blocks x workers up to which CommState finds need entries through a dense index (16 MB)
/// rather than by searching each block's list. A swap tried on a block of a long sequence
/// looks up hundreds of entries: a local placement of 32 workers x 128K tokens in 1K blocks
/// (bimodal, seed 3) spent 2.7 s balancing its communication, 1.8 s with the index.
constexpr size_t kDenseSlots = size_t{1} << 22;

class CommState {
 public:
  CommState(Plan& plan, const std::vector<double>& blockCost)
      : plan_(plan), cost_(blockCost), n_(static_cast<size_t>(plan.config.numWorkers)) {
    const size_t numBlocks = plan.blocks.size();
    kvBytes_.resize(numBlocks);
    tokens_.resize(numBlocks);
    for (size_t b = 0; b < numBlocks; ++b) {
      tokens_[b] = plan.blocks[b].numTokens();
      kvBytes_[b] = tokens_[b] * plan.config.attention.kvBytesPerToken();
    }
    // KV blocks each Q block reads (CSR), and the need counts. SwapBound counts on one pair
    // per (Q block, KV block), which blockPairs makes (sorted by both).
    const size_t unordered = pairOutOfOrder(plan.pairs);
    FCP_CHECK(unordered == 0, "pairs ", unordered - 1, " and ", unordered,
              " are not in strict (Q block, KV block) order");
    qOffset_.assign(numBlocks + 1, 0);
    for (const BlockPair& p : plan.pairs) ++qOffset_[static_cast<size_t>(p.qBlock) + 1];
    for (size_t b = 1; b <= numBlocks; ++b) qOffset_[b] += qOffset_[b - 1];
    resizeHuge(kvOf_, plan.pairs.size());
    std::vector<int64_t> next(qOffset_.begin(), qOffset_.end() - 1);
    for (const BlockPair& p : plan.pairs) {
      kvOf_[static_cast<size_t>(next[static_cast<size_t>(p.qBlock)]++)] = p.kvBlock;
    }
    mem_.assign(n_, 0);
    load_.assign(n_, 0.0);
    comm_.assign(n_, 0);
    for (size_t b = 0; b < numBlocks; ++b) {
      const int32_t w = plan.owner[b];
      mem_[static_cast<size_t>(w)] += tokens_[b];
      load_[static_cast<size_t>(w)] += cost_[b];
    }
    countNeeds();
    tree_ = std::make_unique<MaxTree>(comm_);
  }

  int64_t maxComm() const { return tree_->max(); }
  int64_t comm(int32_t w) const { return comm_[static_cast<size_t>(w)]; }
  int32_t busiest() const { return tree_->argMax(); }
  int64_t mem(int32_t w) const { return mem_[static_cast<size_t>(w)]; }
  double load(int32_t w) const { return load_[static_cast<size_t>(w)]; }
  int64_t tokens(int32_t b) const { return tokens_[static_cast<size_t>(b)]; }
  /// Bytes of the transfers block b takes part in where it is: sent as a KV block, plus read
  /// from other workers as a Q block (shared reads counted per block, so an upper bound).
  int64_t traffic(int32_t b) const {
    const auto bs = static_cast<size_t>(b);
    const int32_t owner = plan_.owner[bs];
    int64_t bytes = sentBytes(b);
    for (int64_t i = qOffset_[bs]; i < qOffset_[bs + 1]; ++i) {
      const auto k = static_cast<size_t>(kvOf_[static_cast<size_t>(i)]);
      bytes += plan_.owner[k] != owner ? kvBytes_[k] : 0;
    }
    return bytes;
  }
  /// Bytes KV block b is sent where it is: once to each worker other than its owner that
  /// reads it.
  int64_t sentBytes(int32_t b) const {
    const auto bs = static_cast<size_t>(b);
    int64_t bytes = 0;
    for (const auto& [w, count] : need_[bs])
      bytes += (count > 0 && w != plan_.owner[bs]) ? kvBytes_[bs] : 0;
    return bytes;
  }
  /// Imbalance of the per-worker bytes.
  double imbalance() const { return fcp::imbalance(comm_); }
  int64_t kvBytes(int32_t b) const { return kvBytes_[static_cast<size_t>(b)]; }
  /// Sets worker w's compute load back to `value`, read before a trial swap and its undoing.
  void restoreLoad(int32_t w, double value) { load_[static_cast<size_t>(w)] = value; }
  /// The KV blocks Q block b reads (one entry per pair).
  std::span<const int32_t> readsOf(int32_t b) const {
    const auto bs = static_cast<size_t>(b);
    return {kvOf_.data() + qOffset_[bs], static_cast<size_t>(qOffset_[bs + 1] - qOffset_[bs])};
  }
  /// (worker, how many of its Q blocks read KV block k) for each worker that ever did.
  const std::vector<std::pair<int32_t, int>>& needOf(int32_t k) const {
    return need_[static_cast<size_t>(k)];
  }
  /// need[k][w]: how many of worker w's Q blocks read KV block k.
  int needCount(int32_t k, int32_t w) const {
    const auto& list = need_[static_cast<size_t>(k)];
    const size_t at = entryOf(k, w);
    return at < list.size() ? list[at].second : 0;
  }

  /// Pair entries moved so far (balanceWorkBudget).
  int64_t work() const { return work_; }

  void move(int32_t b, int32_t to) {
    const auto bs = static_cast<size_t>(b);
    const int32_t from = plan_.owner[bs];
    work_ += (qOffset_[bs + 1] - qOffset_[bs]) + static_cast<int64_t>(need_[bs].size());
    // As a Q block: its reads now come to `to`.
    for (int64_t i = qOffset_[bs]; i < qOffset_[bs + 1]; ++i) {
      addNeed(kvOf_[static_cast<size_t>(i)], from, -1);
      addNeed(kvOf_[static_cast<size_t>(i)], to, +1);
    }
    // As a KV block: its transfers now leave from `to`.
    for (const auto& [w, count] : need_[bs]) {
      if (count <= 0) continue;
      if (w != from) addComm(from, w, -kvBytes_[bs]);
      if (w != to) addComm(to, w, +kvBytes_[bs]);
    }
    plan_.owner[bs] = to;
    for (int32_t w : dirty_) {
      tree_->set(static_cast<size_t>(w), comm_[static_cast<size_t>(w)]);
      isDirty_[static_cast<size_t>(w)] = false;
    }
    dirty_.clear();
    mem_[static_cast<size_t>(from)] -= tokens_[bs];
    mem_[static_cast<size_t>(to)] += tokens_[bs];
    load_[static_cast<size_t>(from)] -= cost_[bs];
    load_[static_cast<size_t>(to)] += cost_[bs];
  }

 private:
  /// need[k][w]: how many of worker w's Q blocks read KV block k, each list sized once (the
  /// owners of k's readers gathered per k, sorted, counted), and the transfer bytes they
  /// imply. Equal to adding each pair with addNeed; the order within a list does not matter.
  void countNeeds() {
    const size_t numBlocks = tokens_.size();
    std::vector<int64_t> offset(numBlocks + 1, 0);
    for (const BlockPair& p : plan_.pairs) ++offset[static_cast<size_t>(p.kvBlock) + 1];
    for (size_t k = 1; k <= numBlocks; ++k) offset[k] += offset[k - 1];
    std::vector<int32_t> readers;
    resizeHuge(readers, plan_.pairs.size());
    std::vector<int64_t> next(offset.begin(), offset.end() - 1);
    for (const BlockPair& p : plan_.pairs) {
      readers[static_cast<size_t>(next[static_cast<size_t>(p.kvBlock)]++)] =
          plan_.owner[static_cast<size_t>(p.qBlock)];
    }
    need_.resize(numBlocks);
    if (numBlocks * n_ <= kDenseSlots) slot_.assign(numBlocks * n_, -1);
    for (size_t k = 0; k < numBlocks; ++k) {
      const auto first = readers.begin() + offset[k], last = readers.begin() + offset[k + 1];
      std::sort(first, last);
      size_t runs = 0;
      for (auto it = first; it != last; ++it) runs += it == first || *it != *(it - 1);
      auto& list = need_[k];
      list.reserve(runs);
      for (auto it = first; it != last;) {
        const int32_t w = *it;
        const auto end = std::find_if(it, last, [&](int32_t x) { return x != w; });
        if (!slot_.empty())
          slot_[k * n_ + static_cast<size_t>(w)] = static_cast<int32_t>(list.size());
        list.push_back({w, static_cast<int>(end - it)});
        if (w != plan_.owner[k]) addComm(plan_.owner[k], w, +kvBytes_[k]);
        it = end;
      }
    }
  }

  // Changes need[k][w] by delta, adding or removing the transfer of k to w as it appears or
  // disappears.
  void addNeed(int32_t k, int32_t w, int delta) {
    auto& list = need_[static_cast<size_t>(k)];
    auto it = list.begin();
    if (!slot_.empty()) {
      it += static_cast<std::ptrdiff_t>(entryOf(k, w));
      if (it == list.end()) {
        slot_[static_cast<size_t>(k) * n_ + static_cast<size_t>(w)] =
            static_cast<int32_t>(list.size());
        it = list.insert(list.end(), {w, 0});
      }
    } else {
      it = firstNotBelow(list, w);
      if (it == list.end() || it->first != w) it = list.insert(it, {w, 0});  // kept sorted
    }
    const int before = it->second;
    it->second += delta;
    const int32_t owner = plan_.owner[static_cast<size_t>(k)];
    if (w == owner) return;
    if (before == 0 && it->second > 0) addComm(owner, w, +kvBytes_[static_cast<size_t>(k)]);
    if (before > 0 && it->second == 0) addComm(owner, w, -kvBytes_[static_cast<size_t>(k)]);
  }

  /// Where worker w's entry is in need[k], or the list's size when it has none.
  size_t entryOf(int32_t k, int32_t w) const {
    const auto& list = need_[static_cast<size_t>(k)];
    if (!slot_.empty()) {
      const int32_t at = slot_[static_cast<size_t>(k) * n_ + static_cast<size_t>(w)];
      return at >= 0 ? static_cast<size_t>(at) : list.size();
    }
    const auto it = firstNotBelow(list, w);
    return it != list.end() && it->first == w ? static_cast<size_t>(it - list.begin())
                                              : list.size();
  }

  /// Without the dense index each list is kept sorted by worker (countNeeds makes it so,
  /// addNeed inserts in place) and searched by halves. A linear search made each entry a swap
  /// moves cost up to the number of workers reading its block, which the work limit does not
  /// see: the local placement of 1024 workers x 64 tokens (5,679 blocks of 11-22 tokens, 9.6M
  /// pairs, 5.8M blocks x workers) spent 37 s on the 1.7e8 entries of its budget, 7 s so.
  /// Only sums are read from a list, so its order changes no swap.
  template <typename List>
  static auto firstNotBelow(List& list, int32_t w) -> decltype(list.begin()) {
    return std::lower_bound(list.begin(), list.end(), w,
                            [](const auto& e, int32_t x) { return e.first < x; });
  }

  void addComm(int32_t sender, int32_t receiver, int64_t bytes) {
    for (int32_t w : {sender, receiver}) {
      comm_[static_cast<size_t>(w)] += bytes;
      // The tree is refreshed once per move, for each worker touched.
      if (tree_ && !isDirty_[static_cast<size_t>(w)]) {
        isDirty_[static_cast<size_t>(w)] = true;
        dirty_.push_back(w);
      }
    }
  }

  Plan& plan_;
  const std::vector<double>& cost_;
  size_t n_;
  std::vector<int64_t> kvBytes_, tokens_;
  std::vector<int64_t> qOffset_;
  std::vector<int32_t> kvOf_;
  std::vector<std::vector<std::pair<int32_t, int>>> need_;
  /// slot_[k * N + w]: where worker w's entry is in need_[k], or -1 (entries are never
  /// removed, so a slot stays valid); empty above kDenseSlots, where the sorted list is
  /// searched (firstNotBelow).
  std::vector<int32_t> slot_;
  std::vector<int64_t> mem_;
  std::vector<double> load_;
  std::vector<int64_t> comm_;
  std::unique_ptr<MaxTree> tree_;
  std::vector<int32_t> dirty_;
  std::vector<bool> isDirty_ = std::vector<bool>(n_, false);
  int64_t work_ = 0;
};

/// A floor under the busiest worker w's bytes after a swap of its block b with block b2 of
/// worker u, read from the state before it, moving nothing. A swap that cannot bring w below
/// its bytes before cannot be kept and is not tried: trying moves b's and b2's pairs four
/// times, the floor reads b2's once, and almost every swap tried fails this way (bimodal, 32
/// workers x 128K in 1K blocks, local placement: 687K of the 689K tried; the floor turns
/// away 676K of them). So the same swaps are kept, faster.
/// With r[k] = how many of w's Q blocks read KV block k:
///   shed(b)       = kv(b) x the workers other than w that read b, plus kv(k) for every KV
///                   block k not w's that b alone among w's blocks reads: the most w stops
///                   sending or receiving because b leaves;
///   arrival(b2)   = kv(b2) x the workers other than w and u that read b2 (w sends it to
///                   them now), plus kv(k) for every KV block k that b2 reads, not w's, not
///                   b2, with r[k] = 0 (w receives it now); minus kv(b2) when r[b2] > 0 (w
///                   no longer receives it), and minus kv(k) for each of w's blocks k other
///                   than b that b2 alone among u's blocks reads (w may no longer send it to u).
/// w after >= w before − shed(b) + arrival(b2): every other change to w only adds (w's
/// blocks b reads are now sent to u; w's blocks that read b now receive it; u's other reads).
/// Needs one pair per (Q block, KV block), which CommState checks.
class SwapBound {
 public:
  SwapBound(const CommState& state, const Plan& plan)
      : state_(state), owner_(plan.owner), reads_(plan.blocks.size(), 0) {}

  /// Takes the busiest worker w, holding `blocks`.
  void look(int32_t w, const std::vector<int32_t>& blocks) {
    for (int32_t k : readTouched_) reads_[static_cast<size_t>(k)] = 0;
    readTouched_.clear();
    w_ = w;
    for (int32_t q : blocks) {
      for (int32_t k : state_.readsOf(q)) {
        if (reads_[static_cast<size_t>(k)]++ == 0) readTouched_.push_back(k);
      }
    }
  }

  int64_t shed(int32_t b) const {
    int64_t bytes = state_.sentBytes(b);  // b is w's
    for (int32_t k : state_.readsOf(b)) {
      if (owner(k) != w_ && reads_[static_cast<size_t>(k)] == 1) bytes += state_.kvBytes(k);
    }
    return bytes;
  }

  /// arrival(b2) above: the least w's bytes rise by as b2 comes (and b goes to u).
  int64_t arrival(int32_t b, int32_t b2, int32_t u) const {
    int64_t bytes = reads_[static_cast<size_t>(b2)] > 0 ? -state_.kvBytes(b2) : 0;
    for (const auto& [v, count] : state_.needOf(b2)) {
      if (count > 0 && v != w_ && v != u) bytes += state_.kvBytes(b2);
    }
    for (int32_t k : state_.readsOf(b2)) {
      if (owner(k) == w_) {
        // b2 alone read it on u (b's own sends are in shed already).
        if (k != b && state_.needCount(k, u) == 1) bytes -= state_.kvBytes(k);
      } else if (k != b2 && reads_[static_cast<size_t>(k)] == 0) {
        bytes += state_.kvBytes(k);
      }
    }
    return bytes;
  }

 private:
  int32_t owner(int32_t k) const { return owner_[static_cast<size_t>(k)]; }
  const CommState& state_;
  const std::vector<int32_t>& owner_;
  int32_t w_ = -1;
  std::vector<int32_t> reads_;  ///< r[k], for the worker looked at
  std::vector<int32_t> readTouched_;
};

/// How many blocks nearest in cost are tried as swap partners.
constexpr size_t kPartnerWindow = 48;
constexpr size_t kWidePartnerWindow = 2048;

}  // namespace

int64_t balanceWorkBudget(size_t pairs) {
  constexpr int64_t kPassesOverPairs = 16, kSmallPlanWork = int64_t{1} << 24;
  return kPassesOverPairs * static_cast<int64_t>(pairs) + kSmallPlanWork;
}

int64_t balanceCommunication(Plan& plan, const std::vector<double>& blockCost, double computeCap,
                             int64_t memoryCap, int64_t maxSteps, SwapSearch search,
                             int64_t maxWork) {
  if (plan.config.numWorkers < 2 || plan.blocks.empty()) return 0;
  CommState state(plan, blockCost);
  const int64_t budget = maxWork >= 0 ? maxWork : balanceWorkBudget(plan.pairs.size());
  std::vector<int32_t> byCost(plan.blocks.size());
  for (size_t b = 0; b < byCost.size(); ++b) byCost[b] = static_cast<int32_t>(b);
  std::sort(byCost.begin(), byCost.end(), [&](int32_t x, int32_t y) {
    const double cx = blockCost[static_cast<size_t>(x)], cy = blockCost[static_cast<size_t>(y)];
    return cx != cy ? cx < cy : x < y;
  });
  std::vector<size_t> rank(byCost.size());
  for (size_t i = 0; i < byCost.size(); ++i) rank[static_cast<size_t>(byCost[i])] = i;

  std::vector<std::vector<int32_t>> blocksOf(static_cast<size_t>(plan.config.numWorkers));
  for (size_t b = 0; b < plan.owner.size(); ++b) {
    blocksOf[static_cast<size_t>(plan.owner[b])].push_back(static_cast<int32_t>(b));
  }
  SwapBound bound(state, plan);
  int64_t steps = 0;
  bool spent = false;  // past the work limit: no further swap is tried
  for (; steps < maxSteps && state.imbalance() > kCommTargetImbalance; ++steps) {
    const int32_t w = state.busiest();
    const int64_t before = state.maxComm();
    bound.look(w, blocksOf[static_cast<size_t>(w)]);
    std::pair<int32_t, int32_t> best{-1, -1};
    // Nearest partners first; only when none helps, a much wider look (rare, and it is what
    // unsticks a busiest worker whose neighbours in cost all carry as much traffic).
    for (const size_t window : {kPartnerWindow, kWidePartnerWindow}) {
      for (int32_t b : blocksOf[static_cast<size_t>(w)]) {
        const int64_t traffic = state.traffic(b);
        if (traffic == 0) continue;
        const double cb = blockCost[static_cast<size_t>(b)];
        const int64_t shed = bound.shed(b);
        // Partners nearest b in cost, alternating below and above.
        const size_t r = rank[static_cast<size_t>(b)];
        for (size_t step = 1, tried = 0; tried < window && step <= byCost.size(); ++step) {
          const size_t half = (step + 1) / 2;
          const bool below = step % 2 == 1;
          if (below ? half > r : r + half >= byCost.size()) continue;
          const int32_t b2 = byCost[below ? r - half : r + half];
          ++tried;
          const int32_t u = plan.owner[static_cast<size_t>(b2)];
          if (u == w) continue;
          const double c2 = blockCost[static_cast<size_t>(b2)];
          if (state.load(w) - cb + c2 > computeCap || state.load(u) - c2 + cb > computeCap)
            continue;
          if (state.mem(w) - state.tokens(b) + state.tokens(b2) > memoryCap ||
              state.mem(u) - state.tokens(b2) + state.tokens(b) > memoryCap ||
              state.traffic(b2) >= traffic) {  // only a quieter block can help w
            continue;
          }
          const int64_t floor = state.comm(w) - shed + bound.arrival(b, b2, u);
          if (search == SwapSearch::kBounded && floor >= before) continue;
          const double loadW = state.load(w), loadU = state.load(u);
          state.move(b, u);
          state.move(b2, w);
          FCP_CHECK(state.comm(w) >= floor, "the swap floor ", floor, " is above worker ", w, "'s ",
                    state.comm(w), " bytes after the swap");
          // Kept if w drops and nobody rises to w's old level: with several workers tied at
          // the top (equal-size blocks make ties common), the maximum itself falls only after
          // each of them has been relieved in turn.
          const bool better =
              state.comm(w) < before && state.maxComm() <= before && state.comm(u) < before;
          state.move(b2, u);
          state.move(b, w);
          // As they were, not a rounding step away: so the caps test the same numbers however
          // many swaps were tried.
          state.restoreLoad(w, loadW);
          state.restoreLoad(u, loadU);
          if (better) {  // first improvement: keeps each step cheap
            best = {b, b2};
            break;
          }
          if (state.work() > budget) {
            spent = true;
            break;
          }
        }
        if (best.first >= 0 || spent) break;
      }
      if (best.first >= 0 || spent) break;
    }
    if (best.first < 0) break;
    const int32_t u = plan.owner[static_cast<size_t>(best.second)];
    state.move(best.first, u);
    state.move(best.second, w);
    auto& mine = blocksOf[static_cast<size_t>(w)];
    auto& theirs = blocksOf[static_cast<size_t>(u)];
    *std::find(mine.begin(), mine.end(), best.first) = best.second;
    *std::find(theirs.begin(), theirs.end(), best.second) = best.first;
  }
  return steps;
}

}  // namespace fcp::plan::detail

namespace fcp::plan::detail {

// For each block b, on whatever worker w holds it:
// - w receives every KV block b's Q reads that w does not hold. w holds at most capTokens
//   tokens and maxCost cost, b's included; the KV blocks it can hold besides b are at most
//   the tokens a fractional knapsack packs into the cost room (cheapest cost per token first)
//   and into the token room, whichever is fewer.
// - w sends b to every other worker holding a Q block that reads b. What w cannot hold of
//   those blocks (their tokens past its token room, their cost past its cost room) needs at
//   least that much over capTokens (over maxCost) other workers, and there are N - 1.
// Both are lower bounds whatever else w holds, so their sum is one on w's bytes.
int64_t commFloorBytes(const Plan& plan, int64_t capTokens, double maxCost, FloorSearch search) {
  if (capTokens <= 0) {
    throwInvalidArgument("communication floor under a cap of ", capTokens,
                         " tokens: expected at least 1");
  }
  if (!(maxCost >= 0)) {
    throwInvalidArgument("communication floor under a busiest cost of ", maxCost,
                         ": expected at least 0");
  }
  if (const size_t p = pairOutOfOrder(plan.pairs); p != 0) {
    throwInvalidArgument("communication floor: pairs ", p - 1, " and ", p,
                         " are not in strict (Q block, KV block) order");
  }
  for (const Transfer& t : plan.transfers) {
    if (t.sender != plan.owner[static_cast<size_t>(t.block)]) return 0;  // relayed
  }
  const size_t n = plan.blocks.size();
  std::vector<int64_t> tokens(n);
  for (size_t b = 0; b < n; ++b) tokens[b] = plan.blocks[b].numTokens();
  const std::vector<double> cost = blockCosts(static_cast<int64_t>(n), plan.pairs);
  // Per block: its pairs as a Q block (pairs[firstPair[b]] .. pairs[firstPair[b + 1]]), the
  // tokens of the KV blocks it reads, and the tokens and cost of the Q blocks reading it,
  // itself left out.
  std::vector<size_t> firstPair(n + 1, 0);
  std::vector<int64_t> readTokens(n, 0), readerTokens(n, 0);
  std::vector<double> readerCost(n, 0);
  for (const BlockPair& p : plan.pairs) {
    const auto q = static_cast<size_t>(p.qBlock), kv = static_cast<size_t>(p.kvBlock);
    ++firstPair[q + 1];
    if (q == kv) continue;
    readTokens[q] += tokens[kv];
    readerTokens[kv] += tokens[q];
    readerCost[kv] += cost[q];
  }
  for (size_t b = 0; b < n; ++b) firstPair[b + 1] += firstPair[b];

  // Sums of costs in another order differ in their last bits: the rooms are widened by a
  // part in 1e9 of the busiest cost, and the worker counts narrowed as much.
  constexpr double kTolerance = 1e-9;
  const double otherWorkers = static_cast<double>(plan.config.numWorkers - 1);
  auto tokenRoom = [&](size_t b) { return std::max<int64_t>(0, capTokens - tokens[b]); };
  auto costRoom = [&](size_t b) { return std::max(0.0, maxCost * (1 + kTolerance) - cost[b]); };
  // Other workers that must hold a Q block reading b.
  auto readerHolders = [&](size_t b) {
    const int64_t restTokens = readerTokens[b] - tokenRoom(b);
    const int64_t byTokens = restTokens > 0 ? (restTokens + capTokens - 1) / capTokens : 0;
    const double restCost = readerCost[b] - costRoom(b);
    const double byCost =
        restCost > 0 && maxCost > 0 ? std::ceil(restCost / maxCost * (1 - kTolerance)) : 0;
    return std::min(otherWorkers, std::max(static_cast<double>(byTokens), byCost));
  };
  std::vector<std::pair<double, double>> kv;  // (cost per token, tokens) of b's KV blocks
  auto received = [&](size_t b) {
    kv.clear();
    for (size_t i = firstPair[b]; i < firstPair[b + 1]; ++i) {
      const auto k = static_cast<size_t>(plan.pairs[i].kvBlock);
      if (k != b) {
        kv.emplace_back(cost[k] / static_cast<double>(tokens[k]), static_cast<double>(tokens[k]));
      }
    }
    std::sort(kv.begin(), kv.end());
    double room = costRoom(b), held = 0;
    for (const auto& [rate, t] : kv) {
      if (rate * t <= room) {
        held += t;
        room -= rate * t;
      } else {
        held += room / rate;  // rate > 0: a block of no cost always fits
        break;
      }
    }
    held = std::min(static_cast<double>(tokenRoom(b)), std::floor(held));
    return std::max(0.0, static_cast<double>(readTokens[b]) - held);
  };
  auto sent = [&](size_t b) { return static_cast<double>(tokens[b]) * readerHolders(b); };

  // Largest first by an upper bound on each block's value (all it reads, nothing held): the
  // knapsack runs only for blocks that could still raise the floor.
  std::vector<std::pair<double, size_t>> order(n);
  for (size_t b = 0; b < n; ++b) order[b] = {static_cast<double>(readTokens[b]) + sent(b), b};
  if (search == FloorSearch::kBounded) std::sort(order.begin(), order.end(), std::greater<>());
  double floorTokens = 0;
  for (const auto& [most, b] : order) {
    if (search == FloorSearch::kBounded && most <= floorTokens) break;
    floorTokens = std::max(floorTokens, received(b) + sent(b));
  }
  return static_cast<int64_t>(floorTokens) * plan.config.attention.kvBytesPerToken();
}

}  // namespace fcp::plan::detail

namespace fcp::plan {

int64_t commFloorBytes(const Plan& plan, int64_t capTokens, double maxCost) {
  return detail::commFloorBytes(plan, capTokens, maxCost, detail::FloorSearch::kBounded);
}

}  // namespace fcp::plan
