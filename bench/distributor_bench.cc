// Block Distributor quality and speed: compute and memory imbalance, gap to the lower bound and
// planning time for 16 / 64 / 256 / 1024 workers x the three workloads (issue 2's table).
// Prints a table; asserts nothing. Usage: distributor_bench [--tokens-per-worker T]
// [--block-size B] [--seeds K] [--workers 16,64,...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "fcp/core/statistics.h"
#include "fcp/core/units.h"
#include "planner_bench_args.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"


int main(int argc, char** argv) {
  const fcp::bench::PlannerBenchArgs args =
      fcp::bench::parsePlannerBenchArgs(argc, argv, {32 * 1024, 4 * 1024, 5, {16, 64, 256, 1024}});
  const int64_t tokensPerWorker = args.tokensPerWorker;
  const int64_t blockSize = args.blockSize;
  const int seeds = args.seeds;
  const std::vector<int64_t>& workerCounts = args.workerCounts;
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
                  fcp::median(assignMs), fcp::median(totalMs));
    }
  }
  return 0;
}
