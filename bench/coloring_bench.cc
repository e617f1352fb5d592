// Congestion-free solver speed and round quality: colouring time (median of several runs),
// Δ, the two weighted lower bounds on Σ of round maxima and the Σ achieved, for 16 … 4096
// workers and 10K / 100K / 1M transfers on two kinds of random transfer graph (issue 3).
// Prints a table; asserts nothing. Usage: coloring_bench [--runs R] [--workers 16,64,...]
// [--transfers 10000,100000,...] [--graphs realistic,skewed]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "fcp/core/random.h"
#include "fcp/core/statistics.h"
#include "fcp/plan/coloring.h"

namespace {

using fcp::plan::Edge;

constexpr int64_t kFullBlockBytes = int64_t{1} << 24;  // 4K tokens x 8 KV heads x 128 x K,V x bf16

std::vector<int64_t> parseList(const char* text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoll(item));
  return out;
}

int32_t draw(fcp::Rng& rng, int64_t n) {
  return static_cast<int32_t>(rng.next() % static_cast<uint64_t>(n));
}

/// Mostly full KV blocks; some partial (the tail of a sequence) and some a quarter of the
/// size (a packed block of short sequences, or a GQA model with fewer KV heads).
int64_t drawBytes(fcp::Rng& rng) {
  const uint64_t r = rng.next() % 10;
  if (r < 7) return kFullBlockBytes;
  if (r < 9) return 1 + draw(rng, kFullBlockBytes);
  return kFullBlockBytes / 4;
}

/// Picks a worker from `hot` with probability `hotShare`, else uniformly from all.
int32_t pick(fcp::Rng& rng, int64_t n, int64_t hot, double hotShare) {
  if (hot > 0 && rng.uniform() < hotShare) return draw(rng, hot);
  return draw(rng, n);
}

/// realistic: every worker sends and receives about E/N transfers; 1 % of the workers (at
/// least one), owners and users of a long sequence's blocks, take 1 % extra of the traffic
/// each side, about twice the mean. skewed: one giant sequence: N/64 workers (at least one)
/// send 30 % and receive 30 % of all transfers.
std::vector<Edge> makeGraph(const std::string& kind, int64_t n, int64_t count, uint64_t seed) {
  fcp::Rng rng(seed);
  const bool skewed = kind == "skewed";
  const int64_t hot = std::max<int64_t>(1, skewed ? n / 64 : n / 100);
  const double hotShare = skewed ? 0.3 : static_cast<double>(hot) / static_cast<double>(n);
  std::vector<Edge> edges;
  edges.reserve(static_cast<size_t>(count));
  while (static_cast<int64_t>(edges.size()) < count) {
    const int32_t s = pick(rng, n, hot, hotShare);
    // Receivers' hot set sits at the other end of the ids so senders and receivers differ.
    const int32_t r = static_cast<int32_t>(n - 1 - pick(rng, n, hot, hotShare));
    if (s != r) edges.push_back({s, r, drawBytes(rng)});
  }
  return edges;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 5;
  std::vector<int64_t> workerCounts = {16, 64, 256, 1024, 4096};
  std::vector<int64_t> transferCounts = {10000, 100000, 1000000};
  std::vector<std::string> graphs = {"realistic", "skewed"};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--runs")) {
      runs = std::max(1, std::atoi(argv[i + 1]));
    } else if (!std::strcmp(argv[i], "--workers")) {
      workerCounts = parseList(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--transfers")) {
      transferCounts = parseList(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--graphs")) {
      graphs.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string item; std::getline(ss, item, ',');) graphs.push_back(item);
    }
  }
  std::printf("colouring time: median of %d runs; bytes in MiB; sum.max = sum over rounds of the "
              "round's largest transfer; gap = sum.max / max(LB.worker, LB.sorted) - 1\n",
              runs);
  std::printf("%-9s %7s %9s %7s %9s %11s %11s %11s %8s\n", "graph", "workers", "transfers",
              "delta", "color.ms", "LB.worker", "LB.sorted", "sum.max", "gap");
  for (const auto& kind : graphs) {
    for (int64_t n : workerCounts) {
      for (int64_t count : transferCounts) {
        const auto edges = makeGraph(kind, n, count, 42);
        const auto workers = static_cast<int32_t>(n);
        std::vector<double> ms;
        fcp::plan::EdgeColoring coloring;
        for (int run = 0; run < runs; ++run) {
          const auto start = std::chrono::steady_clock::now();
          coloring = fcp::plan::colorEdges(workers, edges);
          const auto stop = std::chrono::steady_clock::now();
          ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
        }
        const auto bounds = fcp::plan::roundCostBounds(workers, edges);
        const int64_t achieved = fcp::plan::sumOfRoundMaxima(edges, coloring);
        const double lb = static_cast<double>(std::max(bounds.maxWorkerBytes,
                                                       bounds.sortedRoundBound));
        constexpr double kMiB = 1024.0 * 1024.0;
        std::printf("%-9s %7lld %9lld %7d %9.2f %11.0f %11.0f %11.0f %7.2f%%\n", kind.c_str(),
                    static_cast<long long>(n), static_cast<long long>(count), coloring.numColors,
                    fcp::median(ms), static_cast<double>(bounds.maxWorkerBytes) / kMiB,
                    static_cast<double>(bounds.sortedRoundBound) / kMiB,
                    static_cast<double>(achieved) / kMiB,
                    100.0 * (static_cast<double>(achieved) / lb - 1.0));
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
