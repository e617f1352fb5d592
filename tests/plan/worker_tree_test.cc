// The improvement pass's least-loaded workers (src/plan/worker_tree.h): the tree's search and
// the list kept across steps, both against a sort of every worker.
#include "worker_tree.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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
