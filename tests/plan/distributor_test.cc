#include "fcp/plan/distributor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <string>

#include "../test_seed.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "plan_threads.h"

namespace fcp::plan {
namespace {

struct Blocks {
  std::vector<int64_t> tokens;
  std::vector<double> costs;
};

Blocks randomBlocks(Rng& rng, int count, int64_t maxTokens) {
  Blocks b;
  for (int i = 0; i < count; ++i) {
    b.tokens.push_back(1 + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(maxTokens)));
    // Long-tailed costs, like blocks of long and short sequences.
    b.costs.push_back(std::exp(3.0 * rng.uniform()) * static_cast<double>(b.tokens.back()));
  }
  return b;
}

/// Algorithm 1 without the improvement pass, written plainly: O(K * N) scan, ties to the
/// lowest worker id.
std::vector<int32_t> naiveGreedy(const Blocks& b, const DistributorOptions& o) {
  const auto n = static_cast<size_t>(o.numWorkers);
  const int64_t cap = memoryCapTokens(o);
  const double mHat = static_cast<double>(std::accumulate(b.tokens.begin(), b.tokens.end(), int64_t{0})) / static_cast<double>(n);
  const double cHat = std::accumulate(b.costs.begin(), b.costs.end(), 0.0) / static_cast<double>(n);
  std::vector<size_t> order(b.tokens.size());
  std::iota(order.begin(), order.end(), 0);
  auto key = [&](size_t i) { return std::max(static_cast<double>(b.tokens[i]) / mHat, b.costs[i] / cHat); };
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return key(x) > key(y); });
  std::vector<int64_t> mem(n, 0);
  std::vector<double> cost(n, 0);
  std::vector<int32_t> owner(b.tokens.size(), -1);
  for (size_t i : order) {
    double best = 1e300;
    size_t bestW = n;
    for (size_t w = 0; w < n; ++w) {
      if (mem[w] + b.tokens[i] > cap) continue;
      // Same arithmetic as the distributor (scale first), so near-ties round alike.
      const double score = std::max((o.alpha / mHat) * (static_cast<double>(mem[w]) + static_cast<double>(b.tokens[i])),
                                    (o.beta / cHat) * (cost[w] + b.costs[i]));
      if (score < best) {
        best = score;
        bestW = w;
      }
    }
    EXPECT_LT(bestW, n);
    owner[i] = static_cast<int32_t>(bestW);
    mem[bestW] += b.tokens[i];
    cost[bestW] += b.costs[i];
  }
  return owner;
}

struct Loads {
  std::vector<int64_t> mem;
  std::vector<double> cost;
};

Loads loadsOf(const Blocks& b, const std::vector<int32_t>& owner, int64_t n) {
  Loads l{std::vector<int64_t>(static_cast<size_t>(n), 0), std::vector<double>(static_cast<size_t>(n), 0)};
  for (size_t i = 0; i < owner.size(); ++i) {
    l.mem[static_cast<size_t>(owner[i])] += b.tokens[i];
    l.cost[static_cast<size_t>(owner[i])] += b.costs[i];
  }
  return l;
}

TEST(DistributorTest, GreedyMatchesAPlainImplementationOfAlgorithm1) {
  Rng rng(2);
  for (int trial = 0; trial < 30; ++trial) {
    DistributorOptions o;
    o.numWorkers = 1 + static_cast<int64_t>(rng.next() % 40);
    // Small token counts, so that many workers tie (equal memory, or still empty): ties must
    // go to the lowest id, as in the plain version.
    const Blocks b = randomBlocks(rng, static_cast<int>(o.numWorkers * (1 + rng.next() % 10)),
                                  trial % 2 ? 64 : 4096);
    o.memoryLimitTokens =
        std::accumulate(b.tokens.begin(), b.tokens.end(), int64_t{0}) / o.numWorkers + 4096;
    o.alpha = trial % 3 == 0 ? 0.5 : 1.0;
    o.improveStepsPerBlock = 0;
    const Assignment a = assignBlocks(b.tokens, b.costs, o);
    const std::vector<int32_t> reference = naiveGreedy(b, o);
    ASSERT_EQ(a.owner, reference) << "trial " << trial;
  }
}

TEST(DistributorTest, EveryBlockPlacedUnderTheCapAndNearTheLowerBound) {
  Rng rng(4);
  for (int trial = 0; trial < 20; ++trial) {
    DistributorOptions o;
    o.numWorkers = 8 + static_cast<int64_t>(rng.next() % 200);
    const Blocks b = randomBlocks(rng, static_cast<int>(o.numWorkers * 8), 4096);
    o.memoryLimitTokens = std::accumulate(b.tokens.begin(), b.tokens.end(), int64_t{0}) / o.numWorkers + 1;
    o.memorySlack = 0.15;
    const Assignment a = assignBlocks(b.tokens, b.costs, o);
    ASSERT_EQ(a.owner.size(), b.tokens.size());
    const Loads l = loadsOf(b, a.owner, o.numWorkers);
    for (int64_t m : l.mem) ASSERT_LE(m, memoryCapTokens(o));
    const double maxCost = *std::max_element(l.cost.begin(), l.cost.end());
    const double total = std::accumulate(b.costs.begin(), b.costs.end(), 0.0);
    const double lb = std::max(*std::max_element(b.costs.begin(), b.costs.end()), total / static_cast<double>(o.numWorkers));
    EXPECT_DOUBLE_EQ(a.lowerBound, lb);
    EXPECT_GE(maxCost, lb * (1 - 1e-12));
    EXPECT_LE(maxCost, a.greedyMaxCost * (1 + 1e-12));  // improvement never makes it worse
    EXPECT_LE(maxCost, lb * 1.01) << "trial " << trial << " workers " << o.numWorkers;
  }
}

TEST(DistributorTest, SameInputSameAssignment) {
  Rng rng(6);
  const Blocks b = randomBlocks(rng, 3000, 4096);
  DistributorOptions o;
  o.numWorkers = 300;
  o.memoryLimitTokens = 4096 * 6;
  const Assignment x = assignBlocks(b.tokens, b.costs, o);
  const Assignment y = assignBlocks(b.tokens, b.costs, o);
  EXPECT_EQ(x.owner, y.owner);
  EXPECT_EQ(x.improveSteps, y.improveSteps);
}

TEST(DistributorTest, MemoryThatCannotHoldTheBatchIsAnError) {
  DistributorOptions o;
  o.numWorkers = 2;
  o.memoryLimitTokens = 100;
  o.memorySlack = 0;
  EXPECT_THROW(assignBlocks({60, 60, 60, 60}, {1, 1, 1, 1}, o), Error);  // 240 > 2 x 100
  EXPECT_THROW(assignBlocks({101}, {1}, o), Error);                      // one block over the cap
  // Fits in total, but no packing does: three blocks of 60 into two workers of 100.
  try {
    assignBlocks({60, 60, 60}, {1, 1, 1}, o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no worker has room"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(assignBlocks({50, 50, 50, 50}, {1, 1, 1, 1}, o));
}

TEST(DistributorTest, RepairsMemoryWhenTheGreedyPaintsItselfIntoACorner) {
  // Two sequences of 7650 and 8734 tokens in ~2K blocks on 2 workers of 8K (cap 9011): the
  // compute-led greedy leaves no room for the last block, yet {1913, 4 x 1747} and
  // {3 x 1913, 1747} fit. Moves and swaps must find a packing under the cap.
  const std::vector<int64_t> tokens = {1913, 1913, 1912, 1912, 1747, 1747, 1747, 1747, 1746};
  std::vector<double> costs;
  for (size_t i = 0; i < tokens.size(); ++i) costs.push_back(i < 4 ? 7650.0 : 8734.0);
  DistributorOptions o;
  o.numWorkers = 2;
  o.memoryLimitTokens = 8192;
  const Assignment a = assignBlocks(tokens, costs, o);
  std::vector<int64_t> mem(2, 0);
  for (size_t i = 0; i < tokens.size(); ++i) mem[static_cast<size_t>(a.owner[i])] += tokens[i];
  EXPECT_LE(mem[0], memoryCapTokens(o));
  EXPECT_LE(mem[1], memoryCapTokens(o));
  EXPECT_TRUE(a.memoryRepaired);
}

/// The least possible busiest-worker cost under the cap, by trying every assignment.
double bruteForceOptimum(const Blocks& b, int32_t n, int64_t cap) {
  const size_t k = b.tokens.size();
  int64_t combos = 1;
  for (size_t i = 0; i < k; ++i) combos *= n;
  double best = std::numeric_limits<double>::infinity();
  for (int64_t z = 0; z < combos; ++z) {
    std::vector<int64_t> mem(static_cast<size_t>(n), 0);
    std::vector<double> cost(static_cast<size_t>(n), 0);
    bool fits = true;
    for (int64_t q = z, i = 0; i < static_cast<int64_t>(k); ++i, q /= n) {
      const auto w = static_cast<size_t>(q % n);
      mem[w] += b.tokens[static_cast<size_t>(i)];
      cost[w] += b.costs[static_cast<size_t>(i)];
      fits = fits && mem[w] <= cap;
    }
    if (fits) best = std::min(best, *std::max_element(cost.begin(), cost.end()));
  }
  return best;
}

/// Each case (blocks, cap with no slack) assigned on `workers` workers: under the cap without
/// repair, and its busiest worker at the optimum.
void expectTheOptimum(const std::vector<std::pair<Blocks, int64_t>>& cases, int32_t workers) {
  for (const auto& [b, cap] : cases) {
    DistributorOptions o;
    o.numWorkers = workers;
    o.memoryLimitTokens = cap;
    o.memorySlack = 0;
    const Assignment a = assignBlocks(b.tokens, b.costs, o);
    const Loads l = loadsOf(b, a.owner, o.numWorkers);
    for (int64_t m : l.mem) EXPECT_LE(m, o.memoryLimitTokens);
    EXPECT_FALSE(a.memoryRepaired);
    EXPECT_EQ(*std::max_element(l.cost.begin(), l.cost.end()),
              bruteForceOptimum(b, workers, o.memoryLimitTokens));
  }
}

TEST(DistributorTest, TradesWhenNoSingleMoveOrSwapLowersTheBusiest) {
  // Memory (nearly) full: no costly block can move alone, and the swaps of
  // one block for one block leave the busiest worker above the optimum. A trade (a costly block
  // out, the other worker's least dense blocks back) reaches it. Instances found by a search
  // over small random batches where the pass without trades stopped above the optimum
  // (31 and 55 without).
  const std::vector<std::pair<Blocks, int64_t>> cases = {  // blocks, cap
      {{{3, 6, 2, 5, 6, 3}, {11, 10, 3, 1, 19, 10}}, 13},
      {{{2, 1, 4, 2, 1, 6, 1, 1}, {5, 10, 7, 12, 17, 19, 12, 14}}, 9},
  };
  expectTheOptimum(cases, 2);
}

TEST(DistributorTest, ChainsWhenNoTradeLowersTheBusiest) {
  // Every worker near the cap: the busiest worker's block fits on a lighter worker only once
  // that worker passes one of its own blocks on to a third (a chain). Instances found by a
  // search over random batches on 3 workers where the pass with trades but no chains stopped
  // above the optimum (21 and 20 without; 1,047 of 200,000 such batches reach it only now,
  // none is made worse).
  const std::vector<std::pair<Blocks, int64_t>> cases = {  // blocks, cap
      {{{3, 1, 4, 4, 3, 6}, {3, 4, 3, 18, 12, 12}}, 9},
      {{{4, 5, 1, 6, 6, 1, 2}, {2, 18, 4, 13, 2, 2, 9}}, 10},
  };
  expectTheOptimum(cases, 3);
}

/// FNV-1a of an assignment's owners.
uint64_t ownersHash(const std::vector<int32_t>& owner) {
  uint64_t h = 14695981039346656037ull;
  for (const int32_t w : owner) {
    h ^= static_cast<uint32_t>(w);
    h *= 1099511628211ull;
  }
  return h;
}

TEST(DistributorTest, TradesOnTwoThreadsChooseWhatOneChooses) {
  // From kParallelTradeWorkers workers the trade search runs on two threads, the even workers
  // on one and the odd on the other (bestTrade). The assignment must be the one the search on
  // one thread makes, to the block, and for the fixed batches the one d747bfb made, before the
  // search was split and pruned (its owners' hash, pinned). 8,192 blocks on 1024 workers, 5 %
  // memory slack: long-tailed costs; and costs of 10 exact values (tokens of 1K, 2K, 3K or 4K,
  // at 1, 2, 4 or 8 per token), where the two threads' best trades often tie and the lower
  // worker must win. Two batches of each kind whose improvement needs trades, and one drawn
  // fresh (FCP_TEST_SEED replays it), which may need none.
  static_assert(kParallelTradeWorkers <= 1024, "the batches below must take the split search");
  const uint64_t fresh = testing::testSeed();
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(fresh));
  struct Pinned {
    bool exactValues;
    uint64_t seed, hash;
  };
  const Pinned pinned[] = {{false, 1, 0x04eb57573dabe823},
                           {false, 2, 0x034371c9a7ae9e38},
                           {true, 1, 0xc1c18c195414274a},
                           {true, 2, 0x48557f92d9aea9e9}};
  for (const bool exactValues : {false, true}) {
    for (const uint64_t seed : {uint64_t{1}, uint64_t{2}, fresh}) {
      SCOPED_TRACE((exactValues ? "exact values, seed " : "long-tailed, seed ") +
                   std::to_string(seed));
      Rng rng(seed);
      Blocks b;
      for (int i = 0; i < 8 * 1024; ++i) {
        if (exactValues) {
          b.tokens.push_back(1024 * static_cast<int64_t>(1 + rng.next() % 4));
          b.costs.push_back(static_cast<double>(b.tokens.back() << (rng.next() % 4)));
        } else {
          b.tokens.push_back(1 + static_cast<int64_t>(rng.next() % 4096));
          b.costs.push_back(std::exp(3.0 * rng.uniform()) * static_cast<double>(b.tokens.back()));
        }
      }
      DistributorOptions o;
      o.numWorkers = 1024;
      const int64_t total = std::accumulate(b.tokens.begin(), b.tokens.end(), int64_t{0});
      o.memoryLimitTokens = (total + o.numWorkers - 1) / o.numWorkers;
      o.memorySlack = 0.05;
      std::optional<Assignment> one, two;
      {
        const testing::PlanThreads threads("1");
        one = tryAssignBlocks(b.tokens, b.costs, o);
      }
      {
        const testing::PlanThreads threads("2");
        two = tryAssignBlocks(b.tokens, b.costs, o);
      }
      ASSERT_EQ(one.has_value(), two.has_value());
      if (!one) {  // the greedy found no room (a fresh batch, rarely): nothing to improve
        EXPECT_EQ(seed, fresh);
        continue;
      }
      for (const Pinned& p : pinned) {
        if (p.exactValues == exactValues && p.seed == seed && seed != fresh) {
          EXPECT_GT(one->tradeSteps, 0) << "no trade to compare";
          EXPECT_EQ(ownersHash(one->owner), p.hash);
        }
      }
      EXPECT_EQ(one->tradeSteps, two->tradeSteps);
      EXPECT_EQ(one->improveSteps, two->improveSteps);
      EXPECT_EQ(one->owner, two->owner);
    }
  }
}

TEST(DistributorTest, TheMemoryAwareBoundCountsWhatTheCapForcesOntoGiantHolders) {
  // By hand: 3 workers of 10 tokens; two giants (2 tokens, cost 10) and four small blocks (5
  // tokens, cost 1). LB = max(10, 24 / 3) = 10. The third worker holds at most 10 of the 20
  // small tokens, so the giants' holders carry the other 10 (cost 2 at the least): 11, which
  // a giant and a small block each, and two small blocks on the third worker, reach.
  const Blocks b{{2, 2, 5, 5, 5, 5}, {10, 10, 1, 1, 1, 1}};
  EXPECT_DOUBLE_EQ(memoryAwareLowerBound(b.tokens, b.costs, 3, 10), 11.0);
  EXPECT_DOUBLE_EQ(bruteForceOptimum(b, 3, 10), 11.0);
  // Room for everything beside the giants: the paper's bound.
  EXPECT_DOUBLE_EQ(memoryAwareLowerBound(b.tokens, b.costs, 3, 20), 10.0);
  EXPECT_EQ(memoryAwareLowerBound({}, {}, 3, 10), 0.0);
}

TEST(DistributorTest, TheMemoryAwareBoundIsBelowEveryAssignmentUnderTheCap) {
  // Against the optimum by exhaustion on random small batches with tight caps; the bound must
  // never pass it, and must beat max(largest, average) on some (else it says nothing new).
  Rng rng(20261126);
  int raised = 0, tried = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const auto n = static_cast<int32_t>(2 + rng.next() % 3);
    const int count = 3 + static_cast<int>(rng.next() % (n == 4 ? 4 : 5));
    const Blocks b = randomBlocks(rng, count, 8);
    const int64_t total = std::accumulate(b.tokens.begin(), b.tokens.end(), int64_t{0});
    const int64_t cap = (total + n - 1) / n + static_cast<int64_t>(rng.next() % 4);
    const double optimum = bruteForceOptimum(b, n, cap);
    if (std::isinf(optimum)) continue;  // no assignment fits
    ++tried;
    const double bound = memoryAwareLowerBound(b.tokens, b.costs, n, cap);
    const double paper =
        std::max(*std::max_element(b.costs.begin(), b.costs.end()),
                 std::accumulate(b.costs.begin(), b.costs.end(), 0.0) / n);
    ASSERT_LE(bound, optimum * (1 + 1e-12)) << "trial " << trial;
    ASSERT_GE(bound, paper * (1 - 1e-12)) << "trial " << trial;
    raised += bound > paper * (1 + 1e-9);
  }
  EXPECT_GT(tried, 2000);
  EXPECT_GT(raised, tried / 50) << raised << " of " << tried;
}

TEST(DistributorTest, BadOptionsAreErrors) {
  DistributorOptions o;
  o.memoryLimitTokens = 10;
  o.numWorkers = 0;
  EXPECT_THROW(assignBlocks({1}, {1}, o), Error);
  o.numWorkers = 1;
  o.memorySlack = -0.1;
  EXPECT_THROW(assignBlocks({1}, {1}, o), Error);
  o.memorySlack = 0.1;
  o.alpha = 0;
  o.beta = 0;
  EXPECT_THROW(assignBlocks({1}, {1}, o), Error);
}

TEST(DistributorTest, BadBlocksAreNamed) {
  // A block with negative tokens, or a cost that is negative, NaN or infinite: one line naming
  // the block and its values, from both entry points and both placements' assignments.
  DistributorOptions o;
  o.numWorkers = 2;
  o.memoryLimitTokens = 10;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto& [tokens, cost] :
       {std::pair<int64_t, double>{-1, 1.0}, {1, -1.0}, {1, nan}, {1, inf}}) {
    const std::vector<int64_t> t{2, tokens};
    const std::vector<double> c{1.0, cost};
    for (int entry = 0; entry < 3; ++entry) {
      try {
        if (entry == 0) assignBlocks(t, c, o);
        if (entry == 1) (void)tryAssignBlocks(t, c, o);
        if (entry == 2) (void)tryAssignBlocksNearHome(t, c, {0, 1}, o);
        ADD_FAILURE() << "accepted " << tokens << " tokens at cost " << cost;
      } catch (const Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("block 1 has " + std::to_string(tokens) + " tokens and cost"),
                  std::string::npos)
            << what;
        EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      }
    }
  }
}

TEST(DistributorTest, NoBlocksIsFine) {
  DistributorOptions o;
  o.numWorkers = 4;
  o.memoryLimitTokens = 10;
  EXPECT_TRUE(assignBlocks({}, {}, o).owner.empty());
}

// Blocks of no tokens at all: the greedy's memory scale (tokens per worker) is 0, and
// dividing by it made every key NaN, which ordered nothing (the greedy's index then looked for
// a worker in the wrong bucket). On more workers than one bucket of the index holds, both
// placements spread the blocks by their costs alone.
TEST(DistributorTest, BlocksOfNoTokensArePlacedByTheirCosts) {
  DistributorOptions o;
  o.numWorkers = 40;
  o.memoryLimitTokens = 10;
  const std::vector<int64_t> tokens(5, 0);
  const std::vector<double> costs = {1, 2, 3, 4, 5};
  const auto busiest = [&](const Assignment& a) {
    std::vector<double> load(40, 0.0);
    for (size_t i = 0; i < a.owner.size(); ++i) {
      EXPECT_GE(a.owner[i], 0);
      EXPECT_LT(a.owner[i], 40);
      load[static_cast<size_t>(a.owner[i])] += costs[i];
    }
    return *std::max_element(load.begin(), load.end());
  };
  EXPECT_EQ(busiest(assignBlocks(tokens, costs, o)), 5.0);
  EXPECT_EQ(busiest(assignBlocksNearHome(tokens, costs, {0, 39, 39, 39, 20}, o)), 5.0);
}

}  // namespace
}  // namespace fcp::plan

namespace fcp::plan {
namespace {

// Homes that already balance: nothing moves.
TEST(NearHomeTest, BalancedHomesMoveNothing) {
  const std::vector<int64_t> tokens = {100, 100, 100, 100, 50, 50};
  const std::vector<double> costs = {4, 4, 3, 5, 1, 1};
  const std::vector<int32_t> home = {0, 1, 0, 1, 2, 2};
  DistributorOptions o;
  o.numWorkers = 3;
  o.memoryLimitTokens = 200;
  // Worker 2 holds 2 of the 18: unbalanced on purpose below; here its blocks are heavy.
  const std::vector<double> even = {4, 4, 4, 4, 4, 4};
  const Assignment a = assignBlocksNearHome(tokens, even, home, o);
  EXPECT_EQ(a.owner, home);
  EXPECT_EQ(a.localityMoves, 0);
  // Unbalanced homes: the busiest ends within the slack of LB, under the cap, deterministic.
  const Assignment b = assignBlocksNearHome(tokens, costs, home, o);
  std::vector<double> load(3, 0);
  std::vector<int64_t> mem(3, 0);
  for (size_t i = 0; i < home.size(); ++i) {
    load[static_cast<size_t>(b.owner[i])] += costs[i];
    mem[static_cast<size_t>(b.owner[i])] += tokens[i];
  }
  EXPECT_LE(*std::max_element(load.begin(), load.end()), 7.0);  // LB 6; best possible 7
  EXPECT_LE(*std::max_element(mem.begin(), mem.end()), memoryCapTokens(o));
  EXPECT_EQ(assignBlocksNearHome(tokens, costs, home, o).owner, b.owner);
}

// Random instances: the cap always holds, and the result never depends on anything but input.
TEST(NearHomeTest, RandomInstancesHoldTheCapAndRepeat) {
  Rng rng(9);
  for (int trial = 0; trial < 100; ++trial) {
    const int n = 1 + static_cast<int>(rng.next() % 8);
    const int blocks = 1 + static_cast<int>(rng.next() % 60);
    std::vector<int64_t> tokens;
    std::vector<double> costs;
    std::vector<int32_t> home;
    std::vector<int64_t> held(static_cast<size_t>(n), 0);
    for (int i = 0; i < blocks; ++i) {
      tokens.push_back(1 + static_cast<int64_t>(rng.next() % 64));
      costs.push_back(rng.uniform() * 10);
      home.push_back(static_cast<int32_t>(rng.next() % static_cast<uint64_t>(n)));
      held[static_cast<size_t>(home.back())] += tokens.back();
    }
    DistributorOptions o;
    o.numWorkers = n;
    int64_t total = 0;
    for (const int64_t t : tokens) total += t;
    // Room for any block beside a fair share (tight caps are the greedy tests' subject).
    o.memoryLimitTokens = (total + n - 1) / n + 64;
    const Assignment a = assignBlocksNearHome(tokens, costs, home, o);
    std::vector<int64_t> mem(static_cast<size_t>(n), 0);
    for (size_t i = 0; i < tokens.size(); ++i) mem[static_cast<size_t>(a.owner[i])] += tokens[i];
    EXPECT_LE(*std::max_element(mem.begin(), mem.end()), memoryCapTokens(o)) << "trial " << trial;
    EXPECT_EQ(assignBlocksNearHome(tokens, costs, home, o).owner, a.owner);
  }
}

}  // namespace
}  // namespace fcp::plan
