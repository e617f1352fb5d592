// Block Distributor quality and speed: compute and memory imbalance, gap to the lower bound and
// planning time for 16 / 64 / 256 / 1024 workers x the three workloads (issue 2's table).
// Prints a table; asserts nothing. Usage: distributor_bench [--tokens-per-worker T]
// [--block-size B] [--seeds K] [--workers 16,64,...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "fcp/core/units.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokensPerWorker = 32 * 1024;
  int64_t blockSize = 4 * 1024;
  int seeds = 5;
  std::vector<int64_t> workerCounts = {16, 64, 256, 1024};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--tokens-per-worker")) {
      tokensPerWorker = fcp::parseTokenCount(argv[i + 1], "--tokens-per-worker");
    } else if (!std::strcmp(argv[i], "--block-size")) {
      blockSize = fcp::parseTokenCount(argv[i + 1], "--block-size");
    } else if (!std::strcmp(argv[i], "--seeds")) {
      seeds = std::max(1, std::atoi(argv[i + 1]));
    } else if (!std::strcmp(argv[i], "--workers")) {
      workerCounts.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string item; std::getline(ss, item, ',');) workerCounts.push_back(std::stoll(item));
    }
  }
  std::printf("tokens/worker %lld, block %lld, causal, 64/8 heads x 128, %d seeds per cell "
              "(worst case over seeds for quality, median for time)\n",
              static_cast<long long>(tokensPerWorker), static_cast<long long>(blockSize), seeds);
  std::printf("%-17s %7s %7s %9s %9s %9s %10s %10s %9s %9s\n", "workload", "workers", "blocks",
              "imb.comp", "imb.mem", "gap.LB", "gap.greedy", "mem/cap", "assign.ms", "total.ms");
  for (const auto& workload : fcp::builtinWorkloads()) {
    for (int64_t n : workerCounts) {
      double worstImb = 0, worstMem = 0, worstGap = 0, worstGreedy = 0, worstMemRatio = 0;
      std::vector<double> assignMs, totalMs;
      size_t blocks = 0;
      for (int seed = 0; seed < seeds; ++seed) {
        fcp::plan::PlanConfig config;
        config.numWorkers = n;
        config.tokensPerWorker = tokensPerWorker;
        config.blockSize = blockSize;
        const fcp::Batch batch =
            fcp::sampleBatch(workload, n * tokensPerWorker, static_cast<uint64_t>(seed));
        fcp::plan::PlanTimings t;
        const auto p = fcp::plan::buildPlan(batch, config, fcp::CostModel{config.attention}, &t);
        const auto s = fcp::plan::computeStats(p);
        blocks = p.blocks.size();
        worstImb = std::max(worstImb, s.computeImbalance);
        worstMem = std::max(worstMem, s.memoryImbalance);
        worstGap = std::max(worstGap, s.lowerBoundGap);
        worstGreedy = std::max(worstGreedy, p.greedyMaxCost / p.lowerBound - 1);
        worstMemRatio = std::max(worstMemRatio, static_cast<double>(s.maxWorkerTokens) /
                                                    static_cast<double>(s.memoryCapTokens));
        assignMs.push_back(t.assignMs);
        totalMs.push_back(t.totalMs);
      }
      std::printf("%-17s %7lld %7zu %8.3f%% %8.3f%% %8.3f%% %9.3f%% %10.3f %9.2f %9.2f\n",
                  workload.name.c_str(), static_cast<long long>(n), blocks, 100 * worstImb,
                  100 * worstMem, 100 * worstGap, 100 * worstGreedy, worstMemRatio,
                  median(assignMs), median(totalMs));
    }
  }
  return 0;
}
