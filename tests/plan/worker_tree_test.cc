// The improvement pass's view of the workers (src/plan/worker_tree.h): the least-loaded
// workers, from the tree and from the list kept across steps, and the searches for room
// bounded by tracked limits, against scans of every worker and the untracked tree.
#include "worker_tree.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../test_seed.h"

namespace fcp::plan::detail {
namespace {

using Entry = std::pair<double, int32_t>;

/// The kSwapCandidates least (compute, id) entries of every worker but `exclude`.
std::vector<Entry> scanLeast(const std::vector<double>& cost, int32_t exclude) {
  std::vector<Entry> all;
  for (size_t w = 0; w < cost.size(); ++w)
    if (static_cast<int32_t>(w) != exclude) all.push_back({cost[w], static_cast<int32_t>(w)});
  std::sort(all.begin(), all.end());
  all.resize(std::min(all.size(), static_cast<size_t>(kSwapCandidates)));
  return all;
}

template <typename List>
std::vector<Entry> entries(const List& list) {
  return {list.begin(), list.end()};
}

/// Random changes to `n` workers, as the improvement pass makes them (one to four workers a
/// step, the changed ones often the least loaded, costs up and down), each followed by a query
/// excluding a random worker (or the busiest). Costs are small integers when `ties`, so equal
/// costs are common and the lower id must come first.
void checkAgainstScan(int32_t n, bool ties, std::mt19937_64& rng) {
  SCOPED_TRACE("n=" + std::to_string(n) + (ties ? " with ties" : ""));
  WorkerTree tree(n);
  LeastLoaded kept;
  std::vector<double> cost(static_cast<size_t>(n), 0.0);
  std::uniform_real_distribution<double> unit(0.0, 100.0);
  const auto value = [&] { return ties ? static_cast<double>(rng() % 12) : unit(rng); };
  for (int32_t w = 0; w < n; ++w) {  // a start as the greedy leaves it
    cost[static_cast<size_t>(w)] = value();
    tree.set(w, 0, cost[static_cast<size_t>(w)]);
  }
  for (int step = 0; step < std::min(30 * n + 300, 4000); ++step) {
    const int32_t exclude = rng() % 2 == 0
                                ? tree.busiest()
                                : static_cast<int32_t>(rng() % static_cast<uint64_t>(n)) -
                                      static_cast<int32_t>(rng() % 2);  // -1 sometimes
    const auto want = scanLeast(cost, exclude);
    ASSERT_EQ(entries(tree.leastLoaded<kSwapCandidates>(exclude)), want) << "step " << step;
    ASSERT_EQ(entries(kept.get(tree, exclude)), want) << "step " << step;
    const auto changes = 1 + rng() % 4;
    for (uint64_t k = 0; k < changes; ++k) {
      // Half the time one of the least loaded (as a move or swap lands there).
      const auto w = static_cast<int32_t>(
          rng() % 2 == 0 && !want.empty() ? want[rng() % want.size()].second
                                          : static_cast<int32_t>(rng() % static_cast<uint64_t>(n)));
      const auto ws = static_cast<size_t>(w);
      cost[ws] = rng() % 3 == 0 ? value() : cost[ws] + (ties ? 1.0 : unit(rng) / 10.0);
      tree.set(w, 0, cost[ws]);
      kept.changed(w, cost[ws]);
    }
  }
}

/// Random changes to `n` workers' memory and compute in two trees, one tracking room under a
/// few limits; searches for the least compute with room under random limits (some tracked,
/// some between, some above all) must give what the untracked tree gives (the same worker,
/// ties included) and a least-compute worker with room by a scan.
void checkRoomSearches(int32_t n, bool ties, std::mt19937_64& rng) {
  SCOPED_TRACE("n=" + std::to_string(n) + (ties ? " with ties" : ""));
  constexpr int64_t kCap = 64;
  WorkerTree plain(n), tracking(n);
  tracking.trackRoom({kCap - 16, kCap - 12, kCap - 8, kCap - 4});
  std::vector<int64_t> mem(static_cast<size_t>(n), 0);
  std::vector<double> cost(static_cast<size_t>(n), 0.0);
  std::uniform_real_distribution<double> unit(0.0, 100.0);
  const auto byCost = [](int64_t, double c) { return c; };
  for (int step = 0; step < std::min(30 * n + 300, 4000); ++step) {
    const auto w = static_cast<int32_t>(rng() % static_cast<uint64_t>(n));
    const auto ws = static_cast<size_t>(w);
    mem[ws] = static_cast<int64_t>(rng() % (kCap + 1));
    cost[ws] = ties ? static_cast<double>(rng() % 12) : unit(rng);
    plain.set(w, mem[ws], cost[ws]);
    tracking.set(w, mem[ws], cost[ws]);
    const int64_t limit = static_cast<int64_t>(rng() % (kCap + 8)) - 4;
    const int32_t exclude = static_cast<int32_t>(rng() % static_cast<uint64_t>(n + 1)) - 1;
    const int32_t got = tracking.argMin(limit, exclude, byCost);
    ASSERT_EQ(got, plain.argMin(limit, exclude, byCost)) << "step " << step << " limit " << limit;
    double least = std::numeric_limits<double>::infinity();
    for (size_t v = 0; v < mem.size(); ++v)
      if (static_cast<int32_t>(v) != exclude && mem[v] <= limit) least = std::min(least, cost[v]);
    if (least == std::numeric_limits<double>::infinity()) {
      ASSERT_EQ(got, -1) << "step " << step;
    } else {
      ASSERT_GE(got, 0) << "step " << step;
      ASSERT_NE(got, exclude);
      ASSERT_LE(mem[static_cast<size_t>(got)], limit) << "step " << step;
      ASSERT_EQ(cost[static_cast<size_t>(got)], least) << "step " << step;
    }
  }
}

TEST(WorkerTreeTest, SearchesForRoomBoundedByTrackedLimitsFindWhatTheBoundsAloneFind) {
  const uint64_t fresh = testing::testSeed();
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(fresh));
  for (const uint64_t seed : {uint64_t{1}, fresh}) {
    std::mt19937_64 rng(seed);
    for (const int32_t n : {1, 2, 3, 16, 17, 100, 1000}) {
      checkRoomSearches(n, true, rng);
      checkRoomSearches(n, false, rng);
    }
  }
}

TEST(LeastLoadedTest, KeptListIsTheTreesAndAScansLeastLoaded) {
  // Fewer workers than the list keeps, about as many, and many; a fixed seed and a fresh one.
  const uint64_t fresh = testing::testSeed();
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(fresh));
  for (const uint64_t seed : {uint64_t{1}, fresh}) {
    std::mt19937_64 rng(seed);
    for (const int32_t n : {1, 2, 8, 9, 16, 17, 40, 300, 1000}) {
      checkAgainstScan(n, true, rng);
      checkAgainstScan(n, false, rng);
    }
  }
}

}  // namespace
}  // namespace fcp::plan::detail
