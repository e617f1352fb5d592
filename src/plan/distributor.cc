#include "fcp/plan/distributor.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>

#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "parallel.h"
#include "radix_sort.h"
#include "score_index.h"
#include "worker_tree.h"

namespace fcp::plan {
namespace {

using detail::kSwapCandidates;

constexpr double kInf = std::numeric_limits<double>::infinity();
/// assignBlocksNearHome: the fraction of the target each worker's kept home blocks leave free.
constexpr double kLocalityReserve = 0.1;
/// How many of the least-loaded workers bestTrade tries two blocks back from.
constexpr size_t kPairTradeWorkers = 64;

using detail::LeastLoaded;
using detail::WorkerTree;

void checkOptions(const DistributorOptions& o, size_t numBlocks, size_t numCosts) {
  FCP_CHECK_EQ(numBlocks, numCosts);
  checkDistributorOptions(o);
}

}  // namespace

void checkDistributorOptions(const DistributorOptions& o) {
  if (o.numWorkers <= 0 || o.numWorkers > (int64_t{1} << 24)) {
    throwInvalidArgument("invalid worker count ", o.numWorkers, ": expected 1 to ", 1 << 24);
  }
  if (o.memoryLimitTokens <= 0 || o.memoryLimitTokens > kMaxBatchTokens) {
    throwInvalidArgument("invalid memory limit ", o.memoryLimitTokens, " tokens: expected 1 to ",
                         kMaxBatchTokens);
  }
  if (!(o.memorySlack >= 0 && o.memorySlack <= 100)) {
    throwInvalidArgument("invalid memory slack ", o.memorySlack, ": expected 0 to 100");
  }
  if (!(o.alpha > 0 && o.beta > 0 && std::isfinite(o.alpha) && std::isfinite(o.beta))) {
    throwInvalidArgument("invalid weights alpha ", o.alpha, ", beta ", o.beta,
                         ": expected finite and positive");
  }
  if (!(o.improveTarget >= 0 && std::isfinite(o.improveTarget))) {
    throwInvalidArgument("invalid improvement target ", o.improveTarget, ": expected >= 0");
  }
  if (!(o.localitySlack >= 0 && o.localitySlack <= 1)) {
    throwInvalidArgument("invalid locality slack ", o.localitySlack, ": expected 0 to 1");
  }
  if (o.improveStepsPerBlock < 0) {
    throwInvalidArgument("invalid improvement budget ", o.improveStepsPerBlock,
                         " steps per block: expected >= 0");
  }
}

namespace {

/// Per-worker state shared by both phases.
struct Loads {
  std::vector<int64_t> mem;
  std::vector<double> cost;
  std::vector<std::vector<int32_t>> blocks;
  WorkerTree tree;

  explicit Loads(int32_t n)
      : mem(static_cast<size_t>(n), 0), cost(static_cast<size_t>(n), 0.0),
        blocks(static_cast<size_t>(n)), tree(n) {}

  void add(int32_t w, int32_t block, int64_t m, double c) {
    addUntracked(w, block, m, c);
    tree.set(w, mem[static_cast<size_t>(w)], cost[static_cast<size_t>(w)]);
  }

  /// add() without the tree update; call syncTree() before the tree is read again.
  void addUntracked(int32_t w, int32_t block, int64_t m, double c) {
    mem[static_cast<size_t>(w)] += m;
    cost[static_cast<size_t>(w)] += c;
    blocks[static_cast<size_t>(w)].push_back(block);
  }

  void syncTree() {
    for (size_t w = 0; w < mem.size(); ++w) tree.set(static_cast<int32_t>(w), mem[w], cost[w]);
  }

  void removeUntracked(int32_t w, int32_t block, int64_t m, double c) {
    auto& list = blocks[static_cast<size_t>(w)];
    list.erase(std::find(list.begin(), list.end(), block));
    mem[static_cast<size_t>(w)] -= m;
    cost[static_cast<size_t>(w)] -= c;
  }

  void remove(int32_t w, int32_t block, int64_t m, double c) {
    auto& list = blocks[static_cast<size_t>(w)];
    list.erase(std::find(list.begin(), list.end(), block));
    mem[static_cast<size_t>(w)] -= m;
    cost[static_cast<size_t>(w)] -= c;
    tree.set(w, mem[static_cast<size_t>(w)], cost[static_cast<size_t>(w)]);
  }
};

/// One candidate change off the busiest worker: move `block` to `to`, or swap it with `other`.
struct Change {
  double newMax = kInf;
  int32_t block = -1;
  int32_t to = -1;
  int32_t other = -1;  ///< -1 for a move
};

/// The tree's least-cost worker with room (WorkerTree::argMin by cost), remembered across the
/// blocks of one bestChange, where the tree does not change. The search returns the first
/// worker, in a traversal order fixed by the tree, among the cheapest with memory <= the
/// limit; so the answer v for a limit L is also the answer for any smaller limit L' that v
/// still meets (the cheapest under L' cost no less, and no tied worker comes before v), and
/// "none" for L is "none" for L'. The improvement pass used to spend most of its time in
/// these searches (about 2 per step, each visiting ~900 of 8K nodes at 4096 workers, before
/// the tree bounded them by the workers with room: WorkerTree::trackRoom).
class TreeSearches {
 public:
  int32_t find(const Loads& loads, int64_t limit, int32_t exclude) {
    for (int32_t k = 0; k < size_; ++k) {
      const auto& [known, v] = done_[static_cast<size_t>(k)];
      if (limit <= known && (v < 0 || loads.mem[static_cast<size_t>(v)] <= limit)) return v;
    }
    const int32_t v = loads.tree.argMin(limit, exclude, [](int64_t, double c) { return c; });
    if (size_ < kKept) done_[static_cast<size_t>(size_++)] = {limit, v};
    return v;
  }

 private:
  static constexpr int32_t kKept = 16;
  std::array<std::pair<int64_t, int32_t>, kKept> done_;
  int32_t size_ = 0;
};

/// The best move or swap off the busiest worker: the least new maximum of the two workers'
/// costs, the first found in (block, move before swaps, candidate, partner) order on ties.
/// Every change off block i leaves the busiest worker at least cw − ci and the other worker
/// at least its own cost (for a move, the least cost of all) plus the difference: changes that
/// cannot beat the best so far are skipped unexamined, which changes nothing that is chosen.
Change bestChange(const Loads& loads, int32_t busiest, const std::vector<int64_t>& tokens,
                  const std::vector<double>& costs, int64_t cap,
                  const LeastLoaded::Candidates& candidates) {
  const auto w = static_cast<size_t>(busiest);
  const double cw = loads.cost[w];
  Change best;
  if (candidates.size == 0) return best;
  const double leastCost = candidates.list[0].first;
  // The candidates' blocks with their tokens and costs, side by side: every block of w reads
  // them all (about 9 x 8 x 9 at 4096 workers), and each read was two lookups by block id.
  struct Partner {
    double cost;
    int64_t tokens;
    int32_t block;
  };
  thread_local std::vector<Partner> partners;
  std::array<size_t, kSwapCandidates + 1> firstPartner{};
  partners.clear();
  for (int32_t k = 0; k < candidates.size; ++k) {
    for (int32_t j :
         loads.blocks[static_cast<size_t>(candidates.list[static_cast<size_t>(k)].second)])
      partners.push_back({costs[static_cast<size_t>(j)], tokens[static_cast<size_t>(j)], j});
    firstPartner[static_cast<size_t>(k) + 1] = partners.size();
  }
  TreeSearches searches;
  for (int32_t i : loads.blocks[w]) {
    const int64_t mi = tokens[static_cast<size_t>(i)];
    const double ci = costs[static_cast<size_t>(i)];
    if (!(cw - ci < best.newMax)) continue;
    // Move: the least-loaded worker with room for the block — usually one of the candidates
    // (in ascending load), else a search of the whole tree.
    if (leastCost + ci < best.newMax) {
      int32_t v = -1;
      for (const auto& [unusedCost, u] : candidates) {
        if (loads.mem[static_cast<size_t>(u)] + mi <= cap) {
          v = u;
          break;
        }
      }
      if (v < 0) v = searches.find(loads, cap - mi, busiest);
      if (v >= 0) {
        const double newMax = std::max(cw - ci, loads.cost[static_cast<size_t>(v)] + ci);
        if (newMax < best.newMax) best = {newMax, i, v, -1};
      }
    }
    // Swap: with a lighter block on one of the least-loaded workers (memory is usually near
    // the cap by now, so a swap of like-sized blocks is often the only way down).
    for (int32_t k = 0; k < candidates.size; ++k) {
      const auto& [costU, u] = candidates.list[static_cast<size_t>(k)];
      // A partner j lighter than i leaves u at (costU − cj) + ci ≥ (costU − ci) + ci in floating
      // point too (rounding is monotonic), and candidates ascend: none from here can do better.
      if (!((costU - ci) + ci < best.newMax)) break;
      const auto us = static_cast<size_t>(u);
      const int64_t memW = loads.mem[w], memU = loads.mem[us];
      for (size_t at = firstPartner[static_cast<size_t>(k)];
           at < firstPartner[static_cast<size_t>(k) + 1]; ++at) {
        const auto& [cj, mj, j] = partners[at];
        if (cj >= ci) continue;
        if (memW - mi + mj > cap || memU - mj + mi > cap) continue;
        const double newMax = std::max(cw - ci + cj, costU - cj + ci);
        if (newMax < best.newMax) best = {newMax, i, u, j};
      }
    }
  }
  return best;
}

/// A trade off the busiest worker w, for when no single move or swap lowers it (bestChange
/// looks at the few least-loaded workers only, and those are full in memory: their blocks
/// are light but small, and a costly block of w fits on none of them). Block i of w goes to
/// some worker u, and blocks of u come back to w so that u has room for i: its least dense
/// blocks (least cost per token) until it does, or any one of its blocks, or (on the
/// kPairTradeWorkers least-loaded workers) any two. Every worker is weighed (skipping those
/// that provably cannot beat the best trade found so far): this runs only once the cheap
/// changes are spent.
/// The least new maximum of the two workers' costs wins (ties: the first in (worker, block)
/// order); `block` is -1 when no trade lowers w.
struct Trade {
  double newMax = kInf;
  int32_t block = -1;
  int32_t to = -1;
  std::vector<int32_t> back;  ///< u's blocks that come back to w
};

/// Each worker's blocks in ascending density (cost per token; ties: lower id), rebuilt for a
/// worker only after a change touched it.
class SparseFirst {
 public:
  SparseFirst(size_t numWorkers, const std::vector<int64_t>& tokens,
              const std::vector<double>& costs)
      : lists_(numWorkers),
        fresh_(numWorkers, 0),
        range_(numWorkers),
        prefix_(numWorkers),
        tokens_(tokens),
        costs_(costs) {}

  const std::vector<int32_t>& of(const Loads& loads, int32_t worker) {
    const auto w = static_cast<size_t>(worker);
    if (!fresh_[w]) {
      lists_[w] = loads.blocks[w];
      // One rounded quotient per block, so that the order is a strict weak order (products of
      // two blocks' figures, each rounded, need not be transitive, and std::sort may then read
      // out of bounds). Block tokens are positive.
      const auto density = [&](int32_t i) {
        return costs_[static_cast<size_t>(i)] /
               static_cast<double>(tokens_[static_cast<size_t>(i)]);
      };
      std::sort(lists_[w].begin(), lists_[w].end(), [&](int32_t a, int32_t b) {
        const double da = density(a), db = density(b);
        return da != db ? da < db : a < b;
      });
      // Running sums in list order, added one block at a time as a loop over the list would,
      // and the least and largest cost.
      prefix_[w].assign(1, {0, 0.0});
      range_[w] = {kInf, -kInf};
      for (int32_t b : lists_[w]) {
        const double c = costs_[static_cast<size_t>(b)];
        const auto [m, sum] = prefix_[w].back();
        prefix_[w].push_back({m + tokens_[static_cast<size_t>(b)], sum + c});
        range_[w] = {std::min(range_[w].first, c), std::max(range_[w].second, c)};
      }
      fresh_[w] = 1;
    }
    return lists_[w];
  }

  /// The shortest prefix of the worker's list holding at least `need` tokens (its least dense
  /// blocks, as many as make that room: the least cost for it), as of the last of(); `count`
  /// is -1 when the whole list holds fewer.
  struct Prefix {
    std::ptrdiff_t count = -1;
    int64_t tokens = 0;
    double cost = 0;
  };
  Prefix covering(int32_t worker, int64_t need) const {
    const auto& sums = prefix_[static_cast<size_t>(worker)];
    const auto enough = std::lower_bound(
        sums.begin(), sums.end(), need,
        [](const std::pair<int64_t, double>& p, int64_t m) { return p.first < m; });
    if (enough == sums.end()) return {};
    return {enough - sums.begin(), enough->first, enough->second};
  }

  /// The least and the largest cost of the worker's blocks, as of the last of().
  std::pair<double, double> costRange(int32_t worker) const {
    return range_[static_cast<size_t>(worker)];
  }

  void changed(int32_t worker) { fresh_[static_cast<size_t>(worker)] = 0; }

 private:
  std::vector<std::vector<int32_t>> lists_;
  std::vector<char> fresh_;
  std::vector<std::pair<double, double>> range_;
  std::vector<std::vector<std::pair<int64_t, double>>> prefix_;
  const std::vector<int64_t>& tokens_;
  const std::vector<double>& costs_;
};

/// bestTrade over the workers first, first + step, ...: the first best in (worker, block)
/// order.
Trade bestTradeAmong(const Loads& loads, int32_t busiest, const std::vector<int64_t>& tokens,
                     const std::vector<double>& costs, int64_t cap, SparseFirst& sparseFirst,
                     const std::vector<char>& pairsHere, int32_t first, int32_t step) {
  const auto w = static_cast<size_t>(busiest);
  const double cw = loads.cost[w];
  const int64_t mw = loads.mem[w];
  Trade best;
  // Block i of w to u, `set` back: kept if it fits both caps and lowers the pair's maximum.
  const auto consider = [&](int32_t i, int32_t u, int64_t mBack, double cBack, auto&& set) {
    const auto us = static_cast<size_t>(u);
    const int64_t mi = tokens[static_cast<size_t>(i)];
    const double ci = costs[static_cast<size_t>(i)];
    if (loads.mem[us] + mi - mBack > cap || mw - mi + mBack > cap || !(cBack < ci)) return;
    const double newMax = std::max(cw - ci + cBack, loads.cost[us] + ci - cBack);
    if (newMax < cw && newMax < best.newMax) {
      best.newMax = newMax;
      best.block = i;
      best.to = u;
      set(best.back);
    }
  };
  const auto n = static_cast<int32_t>(loads.cost.size());
  for (int32_t u = first; u < n; u += step) {
    const auto us = static_cast<size_t>(u);
    const double cu = loads.cost[us];
    if (u == busiest || !(cu < cw)) continue;
    // A trade gives u block i and takes back blocks costing cBack < ci: with t = ci - cBack,
    // the two end at max(cw - t, cu + t) >= (cw + cu) / 2 (a margin far above rounding).
    if ((cw + cu) / 2 >= best.newMax + 1e-9 * (cw + cu + best.newMax)) continue;
    const std::vector<int32_t>& theirs = sparseFirst.of(loads, u);
    for (int32_t i : loads.blocks[w]) {
      const double ci = costs[static_cast<size_t>(i)];
      if (!(cw - ci < best.newMax)) continue;  // w keeps at least cw - ci
      const int64_t need = loads.mem[us] + tokens[static_cast<size_t>(i)] - cap;
      if (need <= 0) continue;  // a plain move, which bestChange has weighed
      // u's least dense blocks, as many as make room: the least cost back for the room.
      if (const auto room = sparseFirst.covering(u, need); room.count >= 0) {
        consider(i, u, room.tokens, room.cost, [&](std::vector<int32_t>& v) {
          v.assign(theirs.begin(), theirs.begin() + room.count);
        });
      }
      // One block back beats the best so far only if its cost c is in (cu + ci - best,
      // min(ci, best - cw + ci)): where no block of u is (with a margin far above rounding),
      // none is tried. Pairs of blocks are tried as before.
      if (!pairsHere[us]) {
        const auto [least, largest] = sparseFirst.costRange(u);
        const double b = best.newMax;
        const double margin = 1e-9 * (cw + ci + cu + (b < kInf ? b : 0.0));
        if (largest <= cu + ci - b - margin || least >= std::min(ci, b - cw + ci) + margin)
          continue;
      }
      // One block or two of any cost: the cost back may need to be near i's to help.
      for (size_t x = 0; x < theirs.size(); ++x) {
        const int32_t j = theirs[x];
        const int64_t mj = tokens[static_cast<size_t>(j)];
        const double cj = costs[static_cast<size_t>(j)];
        consider(i, u, mj, cj, [&](std::vector<int32_t>& v) { v.assign(1, j); });
        if (!pairsHere[us]) continue;
        for (size_t y = x + 1; y < theirs.size(); ++y) {
          const int32_t k = theirs[y];
          consider(i, u, mj + tokens[static_cast<size_t>(k)], cj + costs[static_cast<size_t>(k)],
                   [&](std::vector<int32_t>& v) { v = {j, k}; });
        }
      }
    }
  }
  return best;
}

/// `helper`, when given, may take half the workers (when the thread budget has a thread free).
/// From kParallelTradeWorkers workers: a trade at 4096 workers takes about 0.4 ms on one
/// thread, and handing half to the other costs tens of microseconds.
Trade bestTrade(const Loads& loads, int32_t busiest, const std::vector<int64_t>& tokens,
                const std::vector<double>& costs, int64_t cap, SparseFirst& sparseFirst,
                detail::HelperThread* helper) {
  const double cw = loads.cost[static_cast<size_t>(busiest)];
  const auto n = static_cast<int32_t>(loads.cost.size());
  // Pairs of blocks coming back are tried on the kPairTradeWorkers least-loaded workers only
  // (the search is quadratic in a worker's blocks).
  std::vector<int32_t> byLoad;
  byLoad.reserve(static_cast<size_t>(n));
  for (int32_t u = 0; u < n; ++u)
    if (u != busiest && loads.cost[static_cast<size_t>(u)] < cw) byLoad.push_back(u);
  const size_t pairWorkers = std::min<size_t>(byLoad.size(), kPairTradeWorkers);
  std::partial_sort(byLoad.begin(), byLoad.begin() + static_cast<std::ptrdiff_t>(pairWorkers),
                    byLoad.end(), [&](int32_t x, int32_t y) {
                      const double cx = loads.cost[static_cast<size_t>(x)];
                      const double cy = loads.cost[static_cast<size_t>(y)];
                      return cx != cy ? cx < cy : x < y;
                    });
  std::vector<char> pairsHere(static_cast<size_t>(n), 0);
  for (size_t k = 0; k < pairWorkers; ++k) pairsHere[static_cast<size_t>(byLoad[k])] = 1;
  if (helper == nullptr)
    return bestTradeAmong(loads, busiest, tokens, costs, cap, sparseFirst, pairsHere, 0, 1);
  // The even workers and the odd ones side by side (halves by id were uneven: the upper half
  // took 2.2x the lower at 4096 workers, code corpus seed 1). Each side's first best; of two as
  // good, the lower worker's is the first in (worker, block) order. SparseFirst::of writes only the
  // entries of the workers it is asked for.
  Trade even, odd;
  helper->runBoth(
      [&] {
        even = bestTradeAmong(loads, busiest, tokens, costs, cap, sparseFirst, pairsHere, 0, 2);
      },
      [&] {
        odd = bestTradeAmong(loads, busiest, tokens, costs, cap, sparseFirst, pairsHere, 1, 2);
      });
  const bool oddFirst =
      odd.newMax < even.newMax || (odd.newMax == even.newMax && odd.block >= 0 && odd.to < even.to);
  return oddFirst ? std::move(odd) : std::move(even);
}

/// A trade through a third worker, for when no trade lowers the busiest worker w: w and the
/// workers that could take its block are all at the memory cap (a causal batch's cheap
/// blocks hold many tokens per unit of work, and they fill the least-loaded workers). Block i
/// of w goes to some worker u, and u's least dense blocks, as many as make room, or any one
/// block of u that makes room, go on to the least-loaded worker v with room for them (none
/// come back to w; a chain whose least-loaded worker with room is u itself is not taken). The
/// least new maximum of the three workers' costs wins (ties: the first in (worker, block)
/// order); `block` is -1 when none lowers w. Lognormal 1024 workers seed 8: the busiest
/// worker holds one giant block and three packed blocks of short sequences, which no trade
/// could place (1.31 % above LB; 0.88 % with chains).
struct Chain {
  double newMax = kInf;
  int32_t block = -1;
  int32_t to = -1;
  int32_t onTo = -1;         ///< v, which takes u's blocks
  std::vector<int32_t> out;  ///< u's blocks that go on to v
};

Chain bestChain(const Loads& loads, int32_t busiest, const std::vector<int64_t>& tokens,
                const std::vector<double>& costs, int64_t cap, SparseFirst& sparseFirst,
                const LeastLoaded::Candidates& candidates) {
  const auto w = static_cast<size_t>(busiest);
  const double cw = loads.cost[w];
  const auto n = static_cast<int32_t>(loads.cost.size());
  if (candidates.size == 0) return {};
  const double leastCost = candidates.list[0].first;
  TreeSearches searches;
  Chain best;
  // Block i to u, and blocks of u holding mOut tokens at cost cOut on to the least-loaded
  // worker v other than w with room for them (`set` names them); when that worker is u
  // itself, this chain is not taken.
  const auto consider = [&](int32_t i, int32_t u, int64_t mOut, double cOut, auto&& set) {
    const double ci = costs[static_cast<size_t>(i)];
    const double cu = loads.cost[static_cast<size_t>(u)];
    // v costs at least the least-loaded worker's cost: skip what cannot beat the best.
    const double floor = std::max({cw - ci, cu + ci - cOut, leastCost + cOut});
    if (!(floor < cw && floor < best.newMax)) return;
    int32_t v = -1;
    for (const auto& [unusedCost, x] : candidates) {
      if (x != u && loads.mem[static_cast<size_t>(x)] + mOut <= cap) {
        v = x;
        break;
      }
    }
    if (v < 0) v = searches.find(loads, cap - mOut, busiest);
    if (v < 0 || v == u) return;
    const double newMax =
        std::max({cw - ci, cu + ci - cOut, loads.cost[static_cast<size_t>(v)] + cOut});
    if (newMax < cw && newMax < best.newMax) {
      best.newMax = newMax;
      best.block = i;
      best.to = u;
      best.onTo = v;
      set(best.out);
    }
  };
  for (int32_t u = 0; u < n; ++u) {
    const auto us = static_cast<size_t>(u);
    if (u == busiest || !(loads.cost[us] < cw)) continue;
    const std::vector<int32_t>& theirs = sparseFirst.of(loads, u);
    for (int32_t i : loads.blocks[w]) {
      if (!(cw - costs[static_cast<size_t>(i)] < best.newMax)) continue;  // w keeps cw - ci
      const int64_t need = loads.mem[us] + tokens[static_cast<size_t>(i)] - cap;
      if (need <= 0) continue;  // a plain move, which bestChange has weighed
      // u's least dense blocks, as many as make room.
      if (const auto room = sparseFirst.covering(u, need); room.count >= 0) {
        consider(i, u, room.tokens, room.cost, [&](std::vector<int32_t>& out) {
          out.assign(theirs.begin(), theirs.begin() + room.count);
        });
      }
      // Or any one block of u that makes room: a small one fits where room is scattered.
      for (int32_t j : theirs) {
        const int64_t mj = tokens[static_cast<size_t>(j)];
        if (mj < need) continue;
        consider(i, u, mj, costs[static_cast<size_t>(j)],
                 [&](std::vector<int32_t>& out) { out.assign(1, j); });
      }
    }
  }
  return best;
}

/// Brings every worker under the memory cap after the greedy had to overfill some: while a
/// worker is over, apply the single move or swap off the fullest worker that lowers its
/// overflow most without pushing the other worker over (ties: the smaller compute change,
/// then the lower ids). Deterministic; false if it gets stuck. A rare path (tight caps with
/// blocks near the block size), so it scans all workers.
bool repairMemory(Loads& loads, std::vector<int32_t>& owner, const std::vector<int64_t>& tokens,
                  const std::vector<double>& costs, int64_t cap) {
  const auto n = static_cast<int32_t>(loads.mem.size());
  for (int64_t step = 0; step < 64 * static_cast<int64_t>(owner.size()) + 64; ++step) {
    const auto w = static_cast<int32_t>(std::max_element(loads.mem.begin(), loads.mem.end()) -
                                        loads.mem.begin());
    const int64_t over = loads.mem[static_cast<size_t>(w)] - cap;
    if (over <= 0) return true;
    struct Fix {
      int64_t gain = 0;
      double drift = 0;
      int32_t block = -1, to = -1, other = -1;
    } best;
    const auto consider = [&](int64_t gain, double drift, int32_t i, int32_t u, int32_t j) {
      if (gain <= 0) return;
      if (gain > best.gain || (gain == best.gain && drift < best.drift)) best = {gain, drift, i, u, j};
    };
    for (int32_t i : loads.blocks[static_cast<size_t>(w)]) {
      const int64_t mi = tokens[static_cast<size_t>(i)];
      for (int32_t u = 0; u < n; ++u) {
        if (u == w) continue;
        const int64_t roomU = cap - loads.mem[static_cast<size_t>(u)];
        if (mi <= roomU) consider(std::min(mi, over), costs[static_cast<size_t>(i)], i, u, -1);
        for (int32_t j : loads.blocks[static_cast<size_t>(u)]) {
          const int64_t mj = tokens[static_cast<size_t>(j)];
          if (mj >= mi || mi - mj > roomU) continue;
          consider(std::min(mi - mj, over),
                   std::abs(costs[static_cast<size_t>(i)] - costs[static_cast<size_t>(j)]), i, u, j);
        }
      }
    }
    if (best.block < 0) return false;
    const auto mOf = [&](int32_t b) { return tokens[static_cast<size_t>(b)]; };
    const auto cOf = [&](int32_t b) { return costs[static_cast<size_t>(b)]; };
    loads.removeUntracked(w, best.block, mOf(best.block), cOf(best.block));
    if (best.other >= 0) {
      loads.removeUntracked(best.to, best.other, mOf(best.other), cOf(best.other));
      loads.addUntracked(w, best.other, mOf(best.other), cOf(best.other));
      owner[static_cast<size_t>(best.other)] = w;
    }
    loads.addUntracked(best.to, best.block, mOf(best.block), cOf(best.block));
    owner[static_cast<size_t>(best.block)] = best.to;
  }
  return false;
}

}  // namespace

int64_t memoryCapTokens(const DistributorOptions& options) {
  const double extra = std::floor(static_cast<double>(options.memoryLimitTokens) * options.memorySlack);
  return options.memoryLimitTokens + static_cast<int64_t>(extra);
}

int64_t safeBlockTokens(int64_t batchTokens, const DistributorOptions& options) {
  const int64_t cap = memoryCapTokens(options);
  if (options.numWorkers <= 1) return batchTokens <= cap ? cap : 0;
  // floor((N (cap + 1) - T - 1) / (N - 1)) = cap + 1 + floor((cap - T) / (N - 1)), without
  // the product N (cap + 1), which can overflow.
  const int64_t d = options.numWorkers - 1;
  const int64_t num = cap - batchTokens;
  const int64_t floorDiv = num >= 0 ? num / d : -((-num + d - 1) / d);
  return std::clamp<int64_t>(cap + 1 + floorDiv, 0, cap);
}

double memoryAwareLowerBound(const std::vector<int64_t>& tokens, const std::vector<double>& costs,
                             int64_t numWorkers, int64_t cap) {
  FCP_CHECK(tokens.size() == costs.size(), "tokens for ", tokens.size(), " blocks, costs for ",
            costs.size());
  FCP_CHECK(cap >= 0, "memory cap ", cap, " tokens");
  const size_t numBlocks = costs.size();
  if (numBlocks == 0 || numWorkers <= 0) return 0;
  int64_t batchTokens = 0;
  double total = 0, largest = 0;
  for (size_t i = 0; i < numBlocks; ++i) {
    FCP_CHECK(tokens[i] >= 0 && costs[i] >= 0, "block ", i, " of ", tokens[i], " tokens, cost ",
              costs[i]);
    batchTokens += tokens[i];
    total += costs[i];
    largest = std::max(largest, costs[i]);
  }
  double bound = std::max(largest, total / static_cast<double>(numWorkers));

  std::vector<int32_t> byCost(numBlocks), byDensity(numBlocks);
  std::iota(byCost.begin(), byCost.end(), 0);
  std::iota(byDensity.begin(), byDensity.end(), 0);
  const auto cost = [&](int32_t i) { return costs[static_cast<size_t>(i)]; };
  const auto size = [&](int32_t i) { return tokens[static_cast<size_t>(i)]; };
  std::sort(byCost.begin(), byCost.end(), [&](int32_t a, int32_t b) {
    return cost(a) != cost(b) ? cost(a) > cost(b) : a < b;
  });
  // Cost per token ascending; a block of no tokens covers nothing and goes last.
  const auto density = [&](int32_t i) {
    return size(i) > 0 ? cost(i) / static_cast<double>(size(i))
                       : std::numeric_limits<double>::infinity();
  };
  std::sort(byDensity.begin(), byDensity.end(), [&](int32_t a, int32_t b) {
    const double da = density(a), db = density(b);
    return da != db ? da < db : a < b;
  });
  // coveredTokens[j], coverCost[j]: the j least dense blocks' tokens and cost.
  std::vector<int64_t> coveredTokens(numBlocks + 1, 0);
  std::vector<double> coverCost(numBlocks + 1, 0.0);
  for (size_t j = 0; j < numBlocks; ++j) {
    coveredTokens[j + 1] = coveredTokens[j] + size(byDensity[j]);
    coverCost[j + 1] = coverCost[j] + cost(byDensity[j]);
  }
  // The least cost of `need` tokens, taking blocks in order of density (the last in part).
  const auto cheapestCover = [&](int64_t need) {
    const auto j = static_cast<size_t>(
        std::lower_bound(coveredTokens.begin(), coveredTokens.end(), need) -
        coveredTokens.begin());
    if (j == 0) return 0.0;
    const int32_t last = byDensity[j - 1];
    return coverCost[j - 1] +
           static_cast<double>(need - coveredTokens[j - 1]) * density(last);
  };

  double costOfG = 0;
  int64_t tokensOfG = 0;
  const auto most =
      static_cast<size_t>(std::min<int64_t>(numWorkers, static_cast<int64_t>(numBlocks)));
  for (size_t g = 1; g <= most; ++g) {
    costOfG += cost(byCost[g - 1]);
    tokensOfG += size(byCost[g - 1]);
    const double twoCheapest = g >= 2 ? cost(byCost[g - 2]) + cost(byCost[g - 1])
                                      : std::numeric_limits<double>::infinity();
    if (twoCheapest <= bound) break;  // it only falls as g grows
    // E = T - (N - g) cap - tokens of G, without forming (N - g) cap past T.
    const int64_t others = numWorkers - static_cast<int64_t>(g);
    const int64_t rest = batchTokens - tokensOfG;
    if (others > 0 && cap > rest / others) continue;  // the others can hold all the rest
    const int64_t extra = rest - others * cap;
    if (extra <= 0) continue;
    const double average = (costOfG + cheapestCover(extra)) / static_cast<double>(g);
    bound = std::max(bound, std::min(twoCheapest, average));
  }
  return bound;
}

namespace {

/// The batch's totals, after checking that the whole batch fits under the cap; `oversized`
/// is the first block over the cap (-1 if none), which no placement can hold.
struct Totals {
  int64_t tokens = 0;
  double cost = 0;
  double maxBlockCost = 0;
  int32_t oversized = -1;
};

Totals checkTotals(const std::vector<int64_t>& tokens, const std::vector<double>& costs,
                   int32_t n, int64_t cap) {
  Totals t;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t m = tokens[i];
    if (m < 0 || !(costs[i] >= 0 && costs[i] < kInf)) {
      throwInvalidArgument("block ", i, " has ", m, " tokens and cost ", costs[i],
                           ": expected tokens >= 0 and a finite cost >= 0");
    }
    if (m > cap && t.oversized < 0) t.oversized = static_cast<int32_t>(i);
    t.tokens += m;
    t.cost += costs[i];
    t.maxBlockCost = std::max(t.maxBlockCost, costs[i]);
  }
  if ((t.tokens + n - 1) / n > cap) {  // t.tokens > cap * n, without the product
    throwInvalidArgument("memory limit cannot hold the batch: ", t.tokens, " tokens > ", n,
                         " workers x ", cap, " tokens (M(1+delta)); raise the tokens per worker, "
                         "the memory slack or the number of workers");
  }
  return t;
}

void throwOversized(const std::vector<int64_t>& tokens, int32_t block, int64_t cap) {
  throwInvalidArgument("block ", block, " has ", tokens[static_cast<size_t>(block)],
                       " tokens: more than the memory cap of ", cap,
                       " tokens per worker (M(1+delta)); raise the tokens per worker or lower "
                       "the block size");
}

/// The error of a block no placement found room for: over the cap, or the greedy and its
/// repair got stuck.
[[noreturn]] void throwUnplaced(const std::vector<int64_t>& tokens, int32_t block, int64_t cap) {
  if (tokens[static_cast<size_t>(block)] > cap) throwOversized(tokens, block, cap);
  throwInvalidArgument("no worker has room for block ", block, " (",
                       tokens[static_cast<size_t>(block)], " tokens) under the memory "
                       "cap of ", cap, " tokens, and no moves or swaps could make room: raise "
                       "the memory slack or the tokens per worker, or lower the block size");
}

/// The improvement pass: while the busiest worker is above `target`, apply the best single
/// move or swap off it (bestChange), or when none lowers it the best trade (bestTrade), or
/// when none lowers it the best chain (bestChain), at most `budget` steps.
void improve(Loads& loads, Assignment& result, const std::vector<int64_t>& tokens,
             const std::vector<double>& costs, int64_t cap, double target, int64_t budget) {
  const auto mOf = [&](int32_t blk) { return tokens[static_cast<size_t>(blk)]; };
  const auto cOf = [&](int32_t blk) { return costs[static_cast<size_t>(blk)]; };
  SparseFirst sparseFirst(loads.cost.size(), tokens, costs);
  // A second thread for the trades' search on large plans, started at the first trade that
  // finds the thread budget's second thread free.
  std::optional<detail::HelperThread> helper;
  if (static_cast<int64_t>(loads.cost.size()) >= kParallelTradeWorkers && detail::planThreads() > 1)
    helper.emplace();
  LeastLoaded leastLoaded;
  // The searches for room are for a block (or blocks) of up to the largest block's tokens:
  // the tree tracks the workers with room for a quarter, a half, three quarters and all of it.
  if (!tokens.empty()) {
    const int64_t largest = *std::max_element(tokens.begin(), tokens.end());
    loads.tree.trackRoom(
        {cap - largest, cap - largest * 3 / 4, cap - largest / 2, cap - largest / 4});
  }
  // Moves block `block` from worker `from` to worker `to`.
  const auto move = [&](int32_t block, int32_t from, int32_t to) {
    loads.remove(from, block, mOf(block), cOf(block));
    loads.add(to, block, mOf(block), cOf(block));
    result.owner[static_cast<size_t>(block)] = to;
    sparseFirst.changed(from);
    sparseFirst.changed(to);
    leastLoaded.changed(from, loads.cost[static_cast<size_t>(from)]);
    leastLoaded.changed(to, loads.cost[static_cast<size_t>(to)]);
  };
  while (result.improveSteps < budget) {
    const int32_t busiest = loads.tree.busiest();
    const double cw = loads.cost[static_cast<size_t>(busiest)];
    if (cw <= target) break;
    const LeastLoaded::Candidates candidates = leastLoaded.get(loads.tree, busiest);
    const Change c = bestChange(loads, busiest, tokens, costs, cap, candidates);
    if (c.block >= 0 && c.newMax < cw) {
      // The partner leaves first, so neither worker passes the cap in between.
      if (c.other >= 0) move(c.other, c.to, busiest);
      move(c.block, busiest, c.to);
    } else {
      const Trade t =
          bestTrade(loads, busiest, tokens, costs, cap, sparseFirst, helper ? &*helper : nullptr);
      if (t.block >= 0) {
        for (int32_t j : t.back) move(j, t.to, busiest);
        move(t.block, busiest, t.to);
      } else {
        const Chain ch = bestChain(loads, busiest, tokens, costs, cap, sparseFirst, candidates);
        if (ch.block < 0) break;
        for (int32_t j : ch.out) move(j, ch.to, ch.onTo);
        move(ch.block, busiest, ch.to);
      }
      ++result.tradeSteps;
    }
    ++result.improveSteps;
  }
}

/// Of each worker's home blocks, the least dense (least cost per token: the most tokens to
/// move per unit of work) stay, up to `keep` cost and the `cap` in tokens; the rest are
/// returned.
std::vector<int32_t> keepLeastDense(Loads& loads, std::vector<int32_t>& owner,
                                    const std::vector<int64_t>& tokens,
                                    const std::vector<double>& costs,
                                    const std::vector<int32_t>& home, double keep, int64_t cap) {
  const auto n = static_cast<int32_t>(loads.cost.size());
  std::vector<std::vector<int32_t>> byHome(static_cast<size_t>(n));
  for (int32_t i = 0; i < static_cast<int32_t>(home.size()); ++i)
    byHome[static_cast<size_t>(home[static_cast<size_t>(i)])].push_back(i);
  const auto density = [&](int32_t i) {
    return costs[static_cast<size_t>(i)] /
           static_cast<double>(std::max<int64_t>(1, tokens[static_cast<size_t>(i)]));
  };
  std::vector<int32_t> rest;
  for (int32_t w = 0; w < n; ++w) {
    auto& list = byHome[static_cast<size_t>(w)];
    std::sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
      const double da = density(a), db = density(b);
      return da != db ? da < db : a < b;
    });
    size_t kept = 0;
    for (; kept < list.size(); ++kept) {
      const int32_t i = list[kept];
      if (loads.cost[static_cast<size_t>(w)] + costs[static_cast<size_t>(i)] > keep ||
          loads.mem[static_cast<size_t>(w)] + tokens[static_cast<size_t>(i)] > cap) {
        break;
      }
      loads.addUntracked(w, i, tokens[static_cast<size_t>(i)], costs[static_cast<size_t>(i)]);
      owner[static_cast<size_t>(i)] = w;
    }
    rest.insert(rest.end(), list.begin() + static_cast<std::ptrdiff_t>(kept), list.end());
  }
  return rest;
}

}  // namespace

namespace {

/// The greedy of §4.1 over `order`'s blocks (the others already placed in `loads`): blocks in
/// descending max(m_i / m̂, c_i / ĉ) (ties: lower id), each to `home[i]` when `home` is given
/// and that worker stays under `homeTarget` and the cap, else to the worker minimising the
/// score among those with room. A block no worker has room for goes to the emptiest worker,
/// and repairMemory must then bring every worker back under the cap. Sets greedyMaxCost and
/// memoryRepaired; counts blocks placed away from `home` in localityMoves. Returns false,
/// leaving `result` partial, when the repair gets stuck.
bool placeGreedily(std::vector<int32_t> order, const std::vector<int64_t>& tokens,
                   const std::vector<double>& costs, const std::vector<int32_t>* home,
                   double homeTarget, const Totals& totals, const DistributorOptions& options,
                   int64_t cap, Loads& loads, Assignment& result) {
  const auto n = static_cast<int32_t>(options.numWorkers);
  // As cHat: blocks of no tokens at all (0 / 0) would make every key NaN.
  const double mHat = totals.tokens > 0 ? static_cast<double>(totals.tokens) / n : 1.0;
  const double cHat = totals.cost > 0 ? totals.cost / n : 1.0;
  // Each block's key, finite and >= 0 (tokens and costs are, and at most their totals).
  std::vector<std::pair<double, int32_t>> keyed;
  keyed.reserve(order.size());
  for (const int32_t i : order) {
    keyed.push_back({std::max(static_cast<double>(tokens[static_cast<size_t>(i)]) / mHat,
                              costs[static_cast<size_t>(i)] / cHat),
                     i});
  }
  detail::sortByKeyDescending(keyed);  // descending key, ties by id
  for (size_t k = 0; k < keyed.size(); ++k) order[k] = keyed[k].second;
  detail::ScoreIndex index(n, options.alpha / mHat, options.beta / cHat);
  for (int32_t w = 0; home && w < n; ++w)  // blocks kept at home are already placed
    index.update(w, loads.mem[static_cast<size_t>(w)], loads.cost[static_cast<size_t>(w)]);
  int32_t firstHomeless = -1;
  for (const int32_t i : order) {
    const int64_t mi = tokens[static_cast<size_t>(i)];
    const double ci = costs[static_cast<size_t>(i)];
    int32_t w = home ? (*home)[static_cast<size_t>(i)] : -1;
    if (w >= 0 && (loads.cost[static_cast<size_t>(w)] + ci > homeTarget ||
                   loads.mem[static_cast<size_t>(w)] + mi > cap)) {
      w = -1;
    }
    if (w < 0) {
      if (home) ++result.localityMoves;
      w = index.argMin(cap - mi, mi, ci);
    }
    if (w < 0) {
      // No room anywhere: the greedy has painted itself into a corner (large blocks against a
      // tight cap). Place the block on the emptiest worker for now.
      if (firstHomeless < 0) firstHomeless = i;
      w = static_cast<int32_t>(std::min_element(loads.mem.begin(), loads.mem.end()) -
                               loads.mem.begin());
    }
    result.owner[static_cast<size_t>(i)] = w;
    loads.addUntracked(w, i, mi, ci);  // the greedy reads the index, not the tree
    index.update(w, loads.mem[static_cast<size_t>(w)], loads.cost[static_cast<size_t>(w)]);
  }
  if (firstHomeless >= 0 && !repairMemory(loads, result.owner, tokens, costs, cap)) {
    result.firstHomeless = firstHomeless;
    return false;
  }
  result.memoryRepaired = firstHomeless >= 0;
  loads.syncTree();
  result.greedyMaxCost = loads.cost[static_cast<size_t>(loads.tree.busiest())];
  return true;
}

/// What both assignments start from: the checked options and totals, and an assignment with
/// no block placed yet and its lower bound.
struct Start {
  Totals totals;
  Assignment result;
};

/// Nullopt, with *unplaced naming the first block over the memory cap, when one is.
std::optional<Start> startAssignment(const std::vector<int64_t>& tokens,
                                     const std::vector<double>& costs,
                                     const DistributorOptions& options, int32_t* unplaced) {
  checkOptions(options, tokens.size(), costs.size());
  const auto n = static_cast<int32_t>(options.numWorkers);
  Start s{checkTotals(tokens, costs, n, memoryCapTokens(options)), {}};
  if (unplaced) *unplaced = s.totals.oversized;
  if (s.totals.oversized >= 0) return std::nullopt;
  s.result.owner.assign(tokens.size(), -1);
  s.result.lowerBound = std::max(s.totals.maxBlockCost, s.totals.cost / n);
  return s;
}

}  // namespace

std::optional<Assignment> tryAssignBlocks(const std::vector<int64_t>& tokens,
                                          const std::vector<double>& costs,
                                          const DistributorOptions& options, int32_t* unplaced) {
  std::optional<Start> start = startAssignment(tokens, costs, options, unplaced);
  if (!start) return std::nullopt;
  auto& [totals, result] = *start;
  const auto n = static_cast<int32_t>(options.numWorkers);
  const int64_t cap = memoryCapTokens(options);
  const auto numBlocks = static_cast<int32_t>(tokens.size());
  if (numBlocks == 0) return std::move(result);
  std::vector<int32_t> order(static_cast<size_t>(numBlocks));
  std::iota(order.begin(), order.end(), 0);
  Loads loads(n);
  if (!placeGreedily(std::move(order), tokens, costs, nullptr, 0, totals, options, cap, loads,
                     result)) {
    if (unplaced) *unplaced = result.firstHomeless;
    return std::nullopt;
  }
  improve(loads, result, tokens, costs, cap, result.lowerBound * (1.0 + options.improveTarget),
          options.improveStepsPerBlock * numBlocks);
  return std::move(result);
}

Assignment assignBlocks(const std::vector<int64_t>& tokens, const std::vector<double>& costs,
                        const DistributorOptions& options) {
  int32_t unplaced = -1;
  std::optional<Assignment> a = tryAssignBlocks(tokens, costs, options, &unplaced);
  if (!a) throwUnplaced(tokens, unplaced, memoryCapTokens(options));
  return std::move(*a);
}

std::optional<Assignment> tryAssignBlocksNearHome(const std::vector<int64_t>& tokens,
                                                  const std::vector<double>& costs,
                                                  const std::vector<int32_t>& home,
                                                  const DistributorOptions& options,
                                                  int32_t* unplaced) {
  FCP_CHECK_EQ(home.size(), tokens.size());
  const auto n = static_cast<int32_t>(options.numWorkers);
  const auto numBlocks = static_cast<int32_t>(tokens.size());
  for (int32_t i = 0; i < numBlocks; ++i) {
    const int32_t w = home[static_cast<size_t>(i)];
    FCP_CHECK(w >= 0 && w < n, "block ", i, " has home worker ", w, " of ", n);
  }
  std::optional<Start> start = startAssignment(tokens, costs, options, unplaced);
  if (!start) return std::nullopt;
  auto& [totals, result] = *start;
  const int64_t cap = memoryCapTokens(options);
  if (numBlocks == 0) return std::move(result);
  const double target = result.lowerBound * (1.0 + options.improveTarget);
  const double tolerance = result.lowerBound * (1.0 + std::max(options.improveTarget,
                                                               options.localitySlack));
  // Each worker keeps its least dense home blocks up to most of the target (the rest of its
  // room is left for the greedy to fill precisely); the rest go through the greedy, home first.
  Loads loads(n);
  std::vector<int32_t> rest = keepLeastDense(loads, result.owner, tokens, costs, home,
                                             target * (1.0 - kLocalityReserve), cap);
  if (!placeGreedily(std::move(rest), tokens, costs, &home, target, totals, options, cap, loads,
                     result)) {
    if (unplaced) *unplaced = result.firstHomeless;
    return std::nullopt;
  }
  improve(loads, result, tokens, costs, cap, tolerance, options.improveStepsPerBlock * numBlocks);
  return std::move(result);
}

Assignment assignBlocksNearHome(const std::vector<int64_t>& tokens,
                                const std::vector<double>& costs, const std::vector<int32_t>& home,
                                const DistributorOptions& options) {
  int32_t unplaced = -1;
  std::optional<Assignment> a = tryAssignBlocksNearHome(tokens, costs, home, options, &unplaced);
  if (!a) throwUnplaced(tokens, unplaced, memoryCapTokens(options));
  return std::move(*a);
}

}  // namespace fcp::plan
