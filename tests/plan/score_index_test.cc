// ScoreIndex (src/plan/score_index.h): the greedy's argmin of Algorithm 1's score, against a
// scan of every worker.
#include "score_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../test_seed.h"

namespace fcp::plan::detail {
namespace {

/// Algorithm 1's score of a block of mi tokens and cost ci on a worker with mem and cost.
double score(double a, double b, int64_t mem, double cost, int64_t mi, double ci) {
  return std::max(a * (static_cast<double>(mem) + static_cast<double>(mi)), b * (cost + ci));
}

/// The worker a scan of all of them chooses: the least (score, w) among those with
/// m_w <= memLimit; -1 when none has room.
int32_t scanArgMin(const std::vector<int64_t>& mem, const std::vector<double>& cost, double a,
                   double b, int64_t memLimit, int64_t mi, double ci) {
  std::pair<double, int32_t> best{std::numeric_limits<double>::infinity(), -1};
  for (size_t w = 0; w < mem.size(); ++w) {
    if (mem[w] > memLimit) continue;
    best = std::min(best, {score(a, b, mem[w], cost[w], mi, ci), static_cast<int32_t>(w)});
  }
  return best.second;
}

/// Random updates and queries on `n` workers. With `exact`, the scales are powers of two and
/// every value a small integer, so every score is exact and ties (to the lower id) are
/// common; otherwise the values are arbitrary doubles.
void checkAgainstScan(int32_t n, bool exact, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double a = exact ? std::ldexp(1.0, static_cast<int>(rng() % 5) - 2) : 0.1 + unit(rng);
  const double b = exact ? std::ldexp(1.0, static_cast<int>(rng() % 5) - 2) : 0.1 + unit(rng);
  SCOPED_TRACE("n=" + std::to_string(n) + " a=" + std::to_string(a) + " b=" + std::to_string(b));
  ScoreIndex index(n, a, b);
  std::vector<int64_t> mem(static_cast<size_t>(n), 0);
  std::vector<double> cost(static_cast<size_t>(n), 0.0);
  const auto value = [&](int64_t range) {
    return exact ? static_cast<double>(static_cast<int64_t>(rng() % static_cast<uint64_t>(range)))
                 : unit(rng) * static_cast<double>(range);
  };
  for (int step = 0; step < 40 * n + 200; ++step) {
    if (rng() % 3 == 0) {
      // Mostly growth, as in the greedy, sometimes any value (the index allows both).
      const auto w = static_cast<int32_t>(rng() % static_cast<uint64_t>(n));
      const auto ws = static_cast<size_t>(w);
      const bool grow = rng() % 4 != 0;
      mem[ws] =
          grow ? mem[ws] + static_cast<int64_t>(rng() % 16) : static_cast<int64_t>(rng() % 64);
      cost[ws] = grow ? cost[ws] + value(16) : value(64);
      index.update(w, mem[ws], cost[ws]);
    } else {
      const int64_t mi = static_cast<int64_t>(rng() % 16);
      const double ci = value(16);
      const int64_t limit = static_cast<int64_t>(rng() % 96) - 8;  // sometimes no room at all
      const int32_t want = scanArgMin(mem, cost, a, b, limit, mi, ci);
      const int32_t got = index.argMin(limit, mi, ci);
      if (exact) {
        ASSERT_EQ(got, want) << "step " << step << ", limit " << limit << ", mi " << mi << ", ci "
                             << ci;
      } else {
        // Arbitrary doubles: the index orders by A + x and B + y, the scan by the score as
        // written; both must reach the same least score.
        ASSERT_EQ(got < 0, want < 0) << "step " << step;
        if (got < 0) continue;
        const auto scoreOf = [&](int32_t w) {
          const auto ws = static_cast<size_t>(w);
          return score(a, b, mem[ws], cost[ws], mi, ci);
        };
        ASSERT_LE(mem[static_cast<size_t>(got)], limit) << "step " << step;
        ASSERT_NEAR(scoreOf(got), scoreOf(want), 1e-12 * std::max(1.0, scoreOf(want)))
            << "step " << step;
      }
    }
  }
}

TEST(ScoreIndexTest, ChoosesWhatAScanOfEveryWorkerChooses) {
  // Sizes around the bucket size (16 workers at least, √N / 2 above 1024), groups of buckets
  // (1000 and 2000 workers make 8 and more groups) and the splits and merges of buckets that
  // many updates cause; a fixed seed and a fresh one.
  const uint64_t fresh = testing::testSeed();
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(fresh));
  for (const uint64_t seed : {uint64_t{1}, fresh}) {
    std::mt19937_64 rng(seed);
    for (const int32_t n : {1, 2, 15, 16, 17, 33, 100, 300, 1000, 2000}) {
      checkAgainstScan(n, true, rng);
      checkAgainstScan(n, false, rng);
    }
  }
}

}  // namespace
}  // namespace fcp::plan::detail
