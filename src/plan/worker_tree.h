#pragma once
// Private to the Block Distributor: the improvement pass's view of the workers' loads.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace fcp::plan::detail {

/// How many of the least-loaded workers the improvement pass tries swaps with.
inline constexpr int32_t kSwapCandidates = 8;

/// A leaf past the last worker: no memory left, so every search skips it.
inline constexpr int64_t kNoRoom = std::numeric_limits<int64_t>::max();
inline constexpr double kInfiniteCost = std::numeric_limits<double>::infinity();

/// Segment tree over workers holding, per subtree, the least memory, the least compute and
/// the largest compute (with the lowest worker id reaching it), and, once trackRoom is called,
/// the least compute of the workers with room under each tracked limit. Leaves past the last
/// worker hold "no memory left" so every search skips them.
class WorkerTree {
 public:
  explicit WorkerTree(int32_t numWorkers) : numWorkers_(numWorkers) {
    while (leaves_ < numWorkers) leaves_ *= 2;
    const auto nodes = static_cast<size_t>(2 * leaves_);
    minMem_.assign(nodes, kNoRoom);
    minCost_.assign(nodes, kInfiniteCost);
    maxCost_.assign(nodes, -kInfiniteCost);
    argMax_.assign(nodes, -1);
    for (int32_t w = 0; w < numWorkers; ++w) set(w, 0, 0.0);
  }

  void set(int32_t worker, int64_t mem, double cost) {
    auto node = static_cast<size_t>(leaves_ + worker);
    minMem_[node] = mem;
    minCost_[node] = cost;
    maxCost_[node] = cost;
    argMax_[node] = worker;
    if (!roomLimits_.empty()) setRoomLeaf(node);
    for (node /= 2; node >= 1; node /= 2) {
      const size_t l = 2 * node, r = 2 * node + 1;
      minMem_[node] = std::min(minMem_[l], minMem_[r]);
      minCost_[node] = std::min(minCost_[l], minCost_[r]);
      const bool right = maxCost_[r] > maxCost_[l];  // ties keep the left (lower id)
      maxCost_[node] = right ? maxCost_[r] : maxCost_[l];
      argMax_[node] = right ? argMax_[r] : argMax_[l];
      if (!roomLimits_.empty()) combineRoom(node);
    }
  }

  /// From now on, keeps per subtree and per limit in `limits` (ascending) the least compute
  /// of the workers with memory within it: argMin then bounds a subtree by its workers with
  /// room under the least of these limits at or above its own, not by all of them. Where the
  /// memory cap binds, the least-loaded workers are full, and a search for room bounded by
  /// all workers entered most subtrees (about 900 of 8K nodes at 4096 workers).
  void trackRoom(const std::vector<int64_t>& limits) {
    roomLimits_ = limits;
    roomCost_.assign(minCost_.size() * limits.size(), kInfiniteCost);
    for (auto leaf = static_cast<size_t>(leaves_); leaf < minCost_.size(); ++leaf)
      setRoomLeaf(leaf);
    for (auto node = static_cast<size_t>(leaves_) - 1; node >= 1; --node) combineRoom(node);
  }

  int32_t busiest() const { return argMax_[1]; }

  /// The (up to) K workers other than `exclude` (-1: none) with the least compute, in
  /// ascending (compute, id) order: a depth-first search that enters only subtrees whose
  /// least compute could still make the list, O(K log N), no allocation.
  template <int32_t K>
  struct Least {
    std::array<std::pair<double, int32_t>, K> list;
    int32_t size = 0;
    const std::pair<double, int32_t>* begin() const { return list.data(); }
    const std::pair<double, int32_t>* end() const { return list.data() + size; }
  };
  template <int32_t K>
  Least<K> leastLoaded(int32_t exclude) const {
    Least<K> c;
    collect(1, 0, leaves_, exclude, c);
    return c;
  }
  /// The worker minimising score(mem, cost) among those with mem <= memLimit other than
  /// `exclude`; among ties, the first one a fixed traversal order meets; -1 if none. `score` must
  /// be nondecreasing in both arguments, so score(subtree minima) bounds every leaf below.
  template <typename Score>
  int32_t argMin(int64_t memLimit, int32_t exclude, const Score& score) const {
    // The least tracked limit at or above memLimit: its workers include every one with room.
    const auto level = static_cast<size_t>(
        std::lower_bound(roomLimits_.begin(), roomLimits_.end(), memLimit) - roomLimits_.begin());
    Search<Score> s{*this, memLimit, exclude, score, level < roomLimits_.size(), level};
    if (const double b = s.bound(1); !s.prune(1, b)) s.visit(1, 0, leaves_, b);
    return s.bestWorker;
  }

 private:
  template <typename Score>
  struct Search {
    const WorkerTree& tree;
    int64_t memLimit;
    int32_t exclude;
    const Score& score;
    bool tracked;  ///< whether a tracked limit covers memLimit: `level`, trackRoom's index
    size_t level;
    double best = kInfiniteCost;
    int32_t bestWorker = -1;

    double bound(size_t node) const { return score(tree.minMem_[node], tree.minCost_[node]); }

    // Ties are pruned too: the first worker the (deterministic) traversal reaches with the
    // best score wins. Exploring ties for the lowest id costs O(N) when many workers tie.
    // The traversal order is the bounds' (b); a subtree is also pruned when its workers with
    // room under the tracked limit cannot beat the best: no worker in it could replace the
    // best (ties do not), so the answer is the one the bounds alone give.
    bool prune(size_t node, double b) const {
      if (tree.minMem_[node] > memLimit) return true;
      if (bestWorker < 0) return false;
      if (b >= best) return true;
      return tracked && score(tree.minMem_[node],
                              tree.roomCost_[node * tree.roomLimits_.size() + level]) >= best;
    }

    // `first` is the lowest worker id under `node`; `span` the number of leaves under it;
    // `b` its bound. Children are pruned before the call (most are), with `best` as it
    // stands when their turn comes.
    void visit(size_t node, int32_t first, int32_t span, double b) {
      if (span == 1) {
        if (first != exclude && first < tree.numWorkers_) {
          best = b;
          bestWorker = first;
        }
        return;
      }
      const int32_t half = span / 2;
      const size_t l = 2 * node, r = 2 * node + 1;
      const double bl = bound(l), br = bound(r);
      if (br < bl) {
        if (!prune(r, br)) visit(r, first + half, half, br);
        if (!prune(l, bl)) visit(l, first, half, bl);
      } else {
        if (!prune(l, bl)) visit(l, first, half, bl);
        if (!prune(r, br)) visit(r, first + half, half, br);
      }
    }
  };

  template <int32_t K>
  void collect(size_t node, int32_t first, int32_t span, int32_t exclude, Least<K>& c) const {
    const double least = minCost_[node];
    if (least == kInfiniteCost) return;
    if (c.size == K && !(least < c.list[K - 1].first)) {
      // Ties with the last entry matter only for lower ids; the subtree's first id decides.
      if (least > c.list[K - 1].first || first > c.list[K - 1].second) return;
    }
    if (span == 1) {
      if (first == exclude || first >= numWorkers_) return;
      const std::pair<double, int32_t> entry{least, first};
      int32_t pos = std::min(c.size, K - 1);
      if (c.size == K && !(entry < c.list[K - 1])) return;
      while (pos > 0 && entry < c.list[static_cast<size_t>(pos - 1)]) {
        c.list[static_cast<size_t>(pos)] = c.list[static_cast<size_t>(pos - 1)];
        --pos;
      }
      c.list[static_cast<size_t>(pos)] = entry;
      c.size = std::min(c.size + 1, K);
      return;
    }
    const int32_t half = span / 2;
    // The side with the smaller minimum first, so the list fills with good entries early.
    if (minCost_[2 * node + 1] < minCost_[2 * node]) {
      collect(2 * node + 1, first + half, half, exclude, c);
      collect(2 * node, first, half, exclude, c);
    } else {
      collect(2 * node, first, half, exclude, c);
      collect(2 * node + 1, first + half, half, exclude, c);
    }
  }

  void setRoomLeaf(size_t leaf) {
    const bool worker = leaf - static_cast<size_t>(leaves_) < static_cast<size_t>(numWorkers_);
    const size_t k = roomLimits_.size();
    for (size_t i = 0; i < k; ++i) {
      roomCost_[leaf * k + i] =
          worker && minMem_[leaf] <= roomLimits_[i] ? minCost_[leaf] : kInfiniteCost;
    }
  }
  void combineRoom(size_t node) {
    const size_t k = roomLimits_.size();
    for (size_t i = 0; i < k; ++i) {
      roomCost_[node * k + i] =
          std::min(roomCost_[2 * node * k + i], roomCost_[(2 * node + 1) * k + i]);
    }
  }

  int32_t numWorkers_;
  int32_t leaves_ = 1;
  std::vector<int64_t> roomLimits_;  ///< trackRoom's limits, ascending
  std::vector<double> roomCost_;     ///< per node, per limit: the least compute with room
  std::vector<int64_t> minMem_;
  std::vector<double> minCost_;
  std::vector<double> maxCost_;
  std::vector<int32_t> argMax_;
};

/// The kSwapCandidates least-loaded workers other than the busiest (WorkerTree::leastLoaded),
/// for the improvement pass: a step changes two to four workers, so the list of the
/// kLeastKept least-loaded workers by (compute, id) is kept across steps and mended as each
/// worker changes, and collected again from the tree only when too few remain. It holds, at
/// every point, the exact s least entries of all workers for its size s: a changed worker
/// leaves the list, and comes back in if it is below the last entry (a worker that was not in
/// the list displaces the last), so every worker outside stays no lower than the last. The
/// improvement took 1 of its 5 us a step collecting the list (4096 workers).
class LeastLoaded {
 public:
  using Candidates = WorkerTree::Least<kSwapCandidates>;

  /// As loads.tree.leastLoaded<kSwapCandidates>(exclude).
  Candidates get(const WorkerTree& tree, int32_t exclude) {
    if (!valid_ || usable(exclude) < kSwapCandidates) {
      kept_ = tree.leastLoaded<kLeastKept>(-1);
      valid_ = true;
    }
    Candidates c;
    for (const auto& entry : kept_) {
      if (c.size == kSwapCandidates) break;
      if (entry.second != exclude) c.list[static_cast<size_t>(c.size++)] = entry;
    }
    return c;
  }

  /// Worker w's compute is now `cost` (the tree holds it already).
  void changed(int32_t w, double cost) {
    if (!valid_) return;
    auto* first = kept_.list.data();
    auto* last = first + kept_.size;
    auto* at = std::find_if(first, last, [&](const auto& e) { return e.second == w; });
    const bool held = at != last;
    if (held) {
      std::copy(at + 1, last, at);
      --kept_.size;
    }
    if (kept_.size == 0) {
      valid_ = false;
      return;
    }
    const std::pair<double, int32_t> entry{cost, w};
    if (!(entry < kept_.list[static_cast<size_t>(kept_.size - 1)])) return;
    if (!held) --kept_.size;  // w displaces the last entry
    auto pos = static_cast<size_t>(kept_.size);
    while (pos > 0 && entry < kept_.list[pos - 1]) {
      kept_.list[pos] = kept_.list[pos - 1];
      --pos;
    }
    kept_.list[pos] = entry;
    ++kept_.size;
  }

 private:
  static constexpr int32_t kLeastKept = 4 * kSwapCandidates;

  int32_t usable(int32_t exclude) const {
    int32_t count = 0;
    for (const auto& entry : kept_) count += entry.second != exclude;
    return count;
  }

  WorkerTree::Least<kLeastKept> kept_;
  bool valid_ = false;
};

}  // namespace fcp::plan::detail
