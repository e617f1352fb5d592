#include "fcp/plan/coloring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "fcp/core/error.h"
#include "fcp/core/random.h"

namespace fcp::plan {
namespace {

int32_t draw(Rng& rng, int32_t n) { return static_cast<int32_t>(rng.next() % static_cast<uint64_t>(n)); }

/// Δ counted plainly with maps, independently of the solver.
int32_t plainMaxDegree(const std::vector<Edge>& edges) {
  std::map<int32_t, int32_t> out, in;
  int32_t best = 0;
  for (const Edge& e : edges) best = std::max({best, ++out[e.sender], ++in[e.receiver]});
  return best;
}

/// The independent check: exactly Δ colours, each edge's colour in range, and no two edges of
/// one colour share a sender or a receiver.
::testing::AssertionResult isProperWithDeltaColors(const std::vector<Edge>& edges,
                                                   const EdgeColoring& c) {
  const int32_t delta = plainMaxDegree(edges);
  if (c.numColors != delta) {
    return ::testing::AssertionFailure() << "numColors " << c.numColors << " != Δ " << delta;
  }
  if (c.color.size() != edges.size()) return ::testing::AssertionFailure() << "size mismatch";
  std::set<std::pair<int32_t, int32_t>> sends, receives;  // (colour, worker)
  for (size_t i = 0; i < edges.size(); ++i) {
    const int32_t k = c.color[i];
    if (k < 0 || k >= delta) return ::testing::AssertionFailure() << "edge " << i << " colour " << k;
    if (!sends.insert({k, edges[i].sender}).second) {
      return ::testing::AssertionFailure() << "worker " << edges[i].sender << " sends twice in round " << k;
    }
    if (!receives.insert({k, edges[i].receiver}).second) {
      return ::testing::AssertionFailure() << "worker " << edges[i].receiver << " receives twice in round " << k;
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<Edge> randomEdges(Rng& rng, int32_t n, int32_t count, int64_t maxBytes) {
  std::vector<Edge> edges;
  while (static_cast<int32_t>(edges.size()) < count) {
    const int32_t s = draw(rng, n), r = draw(rng, n);
    if (s != r) edges.push_back({s, r, 1 + static_cast<int64_t>(rng.next() % static_cast<uint64_t>(maxBytes))});
  }
  return edges;
}

/// Like a plan's transfers: every worker sends and receives about `perWorker` blocks, and a few
/// hot workers (owners of a giant sequence's blocks) send `hotFactor` times as many.
std::vector<Edge> skewedEdges(Rng& rng, int32_t n, int32_t perWorker, int32_t hot, int32_t hotFactor) {
  std::vector<Edge> edges;
  for (int32_t s = 0; s < n; ++s) {
    const int32_t count = s < hot ? perWorker * hotFactor : perWorker;
    for (int32_t i = 0; i < count; ++i) {
      int32_t r = draw(rng, n);
      if (r == s) r = (r + 1) % n;
      edges.push_back({s, r, (rng.next() % 4 == 0) ? 1024 : 4096});
    }
  }
  return edges;
}

void expectProperAndDeterministic(int32_t n, const std::vector<Edge>& edges) {
  const EdgeColoring c = colorEdges(n, edges);
  EXPECT_TRUE(isProperWithDeltaColors(edges, c));
  EXPECT_EQ(c, colorEdges(n, edges));
  EXPECT_EQ(maxDegree(n, edges), plainMaxDegree(edges));
}

TEST(ColoringTest, EveryRoundIsAMatchingOnRandomGraphs) {
  Rng rng(1);
  for (int trial = 0; trial < 300; ++trial) {
    const int32_t n = 2 + draw(rng, 40);
    const auto edges = randomEdges(rng, n, draw(rng, 400), 1 + draw(rng, 5000));
    expectProperAndDeterministic(n, edges);
  }
}

TEST(ColoringTest, EveryRoundIsAMatchingOnDenseRegularGraphs) {
  // Every worker sends to and receives from every other: Δ = N − 1 with no slack anywhere, the
  // case where greedy colouring fails most and alternating paths are longest.
  for (int32_t n : {2, 3, 17, 64}) {
    std::vector<Edge> edges;
    for (int32_t s = 0; s < n; ++s)
      for (int32_t r = 0; r < n; ++r)
        if (s != r) edges.push_back({s, r, 100 + (s * 7 + r * 13) % 50});
    expectProperAndDeterministic(n, edges);
  }
}

TEST(ColoringTest, EveryRoundIsAMatchingOnSkewedGraphs) {
  Rng rng(2);
  expectProperAndDeterministic(64, skewedEdges(rng, 64, 8, 2, 16));
  expectProperAndDeterministic(256, skewedEdges(rng, 256, 20, 4, 8));
  expectProperAndDeterministic(100, skewedEdges(rng, 100, 3, 1, 99));
}

TEST(ColoringTest, OneVertexWithAllEdges) {
  // A star with parallel edges: Δ is the number of edges, far above N.
  Rng rng(3);
  std::vector<Edge> out, in;
  for (int i = 0; i < 500; ++i) {
    out.push_back({0, 1 + draw(rng, 7), 10 + i % 3});
    in.push_back({1 + draw(rng, 7), 5, 7});
  }
  for (Edge& e : in)
    if (e.sender == 5) e.sender = 0;
  expectProperAndDeterministic(8, out);
  expectProperAndDeterministic(8, in);
  const EdgeColoring c = colorEdges(8, out);
  EXPECT_EQ(c.numColors, 500);
}

TEST(ColoringTest, ParallelEdges) {
  std::vector<Edge> edges(5, Edge{0, 1, 3});
  edges.push_back({1, 0, 3});
  edges.push_back({2, 1, 3});
  expectProperAndDeterministic(3, edges);
  EXPECT_EQ(colorEdges(3, edges).numColors, 6);
}

TEST(ColoringTest, SmallAndEmptyGraphs) {
  expectProperAndDeterministic(1, {});                       // one worker, nothing to send
  expectProperAndDeterministic(4096, {});                    // many workers, no transfers
  expectProperAndDeterministic(2, {{0, 1, 5}});              // two workers, one transfer
  expectProperAndDeterministic(2, {{0, 1, 5}, {1, 0, 9}});   // both directions: one round
  EXPECT_EQ(colorEdges(2, {{0, 1, 5}, {1, 0, 9}}).numColors, 1);
  expectProperAndDeterministic(5, {{0, 1, 1}, {2, 1, 1}, {3, 4, 0}});  // worker with no edges... and zero bytes
  EXPECT_EQ(colorEdges(1, {}).numColors, 0);
  EXPECT_TRUE(colorEdges(1, {}).color.empty());
}

TEST(ColoringTest, LargeRandomAndSkewedGraphs) {
  Rng rng(4);
  expectProperAndDeterministic(512, randomEdges(rng, 512, 60000, 1 << 20));
  expectProperAndDeterministic(1024, skewedEdges(rng, 1024, 30, 8, 20));
  // Highly skewed: a handful of workers send to everybody, everybody else sends little.
  expectProperAndDeterministic(1024, skewedEdges(rng, 1024, 2, 4, 500));
}

TEST(ColoringTest, SameInputsGiveTheSameColoringAcrossCalls) {
  Rng a(9), b(9);
  const auto ea = skewedEdges(a, 300, 12, 3, 10), eb = skewedEdges(b, 300, 12, 3, 10);
  EXPECT_EQ(colorEdges(300, ea), colorEdges(300, eb));
}

// colorEdges keeps per-thread scratch between calls; leftovers from a larger graph, a
// different Δ or a rejected input must not change a later colouring.
TEST(ColoringTest, ReusedScratchGivesTheColoringOfAFreshThread) {
  Rng rng(11);
  const std::vector<std::pair<int32_t, std::vector<Edge>>> graphs = {
      {1024, skewedEdges(rng, 1024, 30, 8, 20)},
      {64, randomEdges(rng, 64, 3000, 1 << 20)},
      {2, {{0, 1, 5}}},
      {512, randomEdges(rng, 512, 60000, 1 << 20)},
      {300, skewedEdges(rng, 300, 12, 3, 10)},
  };
  std::vector<EdgeColoring> fresh;
  for (const auto& [n, edges] : graphs) {
    std::thread([&, n = n] { fresh.push_back(colorEdges(n, edges)); }).join();
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t g = 0; g < graphs.size(); ++g) {
      EXPECT_THROW(colorEdges(4, {{0, 1, 1}, {2, 2, 1}}), Error);
      EXPECT_EQ(colorEdges(graphs[g].first, graphs[g].second), fresh[g]) << "graph " << g;
    }
  }
}

TEST(ColoringTest, BadInputThrows) {
  EXPECT_THROW(colorEdges(4, {{0, 4, 1}}), Error);
  EXPECT_THROW(colorEdges(4, {{-1, 2, 1}}), Error);
  EXPECT_THROW(colorEdges(4, {{1, -2, 1}}), Error);
  EXPECT_THROW(colorEdges(4, {{2, 2, 1}}), Error);
  EXPECT_THROW(colorEdges(4, {{0, 1, -1}}), Error);
  EXPECT_THROW(colorEdges(0, {}), Error);
  EXPECT_THROW(maxDegree(4, {{3, 3, 1}}), Error);
  EXPECT_THROW(roundCostBounds(2, {{0, 2, 1}}), Error);
  try {
    colorEdges(4, {{2, 2, 1}});
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

/// The best Σ of round maxima over every proper Δ-colouring, by exhaustive search.
int64_t bruteForceOptimum(const std::vector<Edge>& edges, int32_t delta) {
  std::vector<int32_t> color(edges.size(), -1);
  int64_t best = -1;
  std::function<void(size_t)> go = [&](size_t i) {
    if (i == edges.size()) {
      std::vector<int64_t> m(static_cast<size_t>(delta), 0);
      for (size_t j = 0; j < edges.size(); ++j) {
        m[static_cast<size_t>(color[j])] = std::max(m[static_cast<size_t>(color[j])], edges[j].bytes);
      }
      int64_t sum = 0;
      for (int64_t x : m) sum += x;
      if (best < 0 || sum < best) best = sum;
      return;
    }
    for (int32_t k = 0; k < delta; ++k) {
      bool ok = true;
      for (size_t j = 0; j < i && ok; ++j) {
        ok = !(color[j] == k &&
               (edges[j].sender == edges[i].sender || edges[j].receiver == edges[i].receiver));
      }
      if (!ok) continue;
      color[i] = k;
      go(i + 1);
    }
  };
  go(0);
  return best;
}

TEST(ColoringTest, BoundsMatchBruteForceAndBoundTheOptimum) {
  Rng rng(5);
  for (int trial = 0; trial < 60; ++trial) {
    const int32_t n = 2 + draw(rng, 3);
    const auto edges = randomEdges(rng, n, 1 + draw(rng, 7), 100);
    const int32_t delta = plainMaxDegree(edges);
    // (a) plainly: bytes per worker and direction.
    std::map<std::pair<int, int32_t>, int64_t> load;
    for (const Edge& e : edges) {
      load[{0, e.sender}] += e.bytes;
      load[{1, e.receiver}] += e.bytes;
    }
    int64_t maxLoad = 0;
    for (const auto& [key, bytes] : load) maxLoad = std::max(maxLoad, bytes);
    // (b) plainly: the ((k−1)·N+1)-th largest via a multiset walked from the top.
    std::multiset<int64_t, std::greater<>> sizes;
    for (const Edge& e : edges) sizes.insert(e.bytes);
    int64_t sorted = 0;
    for (int32_t k = 1; k <= delta; ++k) {
      const auto rank = static_cast<size_t>((k - 1) * n);
      if (rank < sizes.size()) sorted += *std::next(sizes.begin(), static_cast<long>(rank));
    }
    const RoundCostBounds b = roundCostBounds(n, edges);
    EXPECT_EQ(b.maxWorkerBytes, maxLoad);
    EXPECT_EQ(b.sortedRoundBound, sorted);
    const int64_t optimum = bruteForceOptimum(edges, delta);
    EXPECT_LE(b.maxWorkerBytes, optimum);
    EXPECT_LE(b.sortedRoundBound, optimum);
    const EdgeColoring c = colorEdges(n, edges);
    EXPECT_GE(sumOfRoundMaxima(edges, c), optimum);
  }
}

TEST(ColoringTest, SumOfRoundMaximaAddsEachRoundsLargest) {
  const std::vector<Edge> edges = {{0, 1, 5}, {1, 0, 7}, {0, 2, 3}, {2, 1, 4}};
  EXPECT_EQ(sumOfRoundMaxima(edges, {2, {0, 0, 1, 1}}), 7 + 4);
  EXPECT_THROW(sumOfRoundMaxima(edges, {2, {0, 0, 2, 1}}), Error);
  EXPECT_THROW(sumOfRoundMaxima(edges, {2, {0, 0}}), Error);
}

TEST(ColoringTest, RoundsComeInDescendingOrderOfTheirLargestTransfer) {
  Rng rng(6);
  const auto edges = randomEdges(rng, 50, 2000, 1 << 16);
  const EdgeColoring c = colorEdges(50, edges);
  std::vector<int64_t> m(static_cast<size_t>(c.numColors), 0);
  for (size_t i = 0; i < edges.size(); ++i) {
    m[static_cast<size_t>(c.color[i])] = std::max(m[static_cast<size_t>(c.color[i])], edges[i].bytes);
  }
  EXPECT_TRUE(std::is_sorted(m.begin(), m.end(), std::greater<>()));
}

}  // namespace
}  // namespace fcp::plan
