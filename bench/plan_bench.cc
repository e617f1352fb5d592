// The whole planner (shard, assign, transfers, colour, schedule) and its communication quality:
// time by phase, Δ, communication imbalance, round maxima against their lower bounds, and the
// reshuffle with and without the locality preference (issue 3's table). Prints; asserts nothing.
// Usage: plan_bench [--workers 16,64,...] [--seeds K] [--tokens-per-worker T] [--block-size B]
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
  int seeds = 3;
  std::vector<int64_t> workerCounts = {16, 64, 256, 1024, 4096};
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
  std::printf("tokens/worker %lld, block %lld, causal, 64/8 heads x 128, coalesce 16, 3 buffers; "
              "%d seeds: worst case for quality, median for times (ms)\n",
              static_cast<long long>(tokensPerWorker), static_cast<long long>(blockSize), seeds);
  std::printf("%-16s %5s %8s %5s %7s %8s %8s %8s %7s %7s %7s %7s %7s %7s\n", "workload", "N",
              "transfers", "rounds", "imb.comm", "rmax/lb", "reshuf", "no-loc", "shard", "assign",
              "xfers", "colour", "sched", "total");
  for (const auto& workload : fcp::builtinWorkloads()) {
    for (int64_t n : workerCounts) {
      double worstComm = 0, worstRoundRatio = 0;
      int64_t transfers = 0, rounds = 0;
      double reshuffle = 0, reshuffleNoLocality = 0;
      std::vector<double> shard, assign, xfers, colour, sched, total;
      for (int seed = 0; seed < seeds; ++seed) {
        fcp::plan::PlanConfig config;
        config.numWorkers = n;
        config.tokensPerWorker = tokensPerWorker;
        config.blockSize = blockSize;
        const fcp::Batch batch =
            fcp::sampleBatch(workload, n * tokensPerWorker, static_cast<uint64_t>(seed));
        fcp::plan::PlanTimings t;
        const fcp::CostModel model{config.attention};
        const auto p = fcp::plan::buildPlan(batch, config, model, &t);
        const auto s = fcp::plan::computeStats(p);
        config.locality = false;
        const auto q = fcp::plan::buildPlan(batch, config, model);
        worstComm = std::max(worstComm, s.commImbalance);
        const double bound = static_cast<double>(std::max(s.maxWorkerCommBytes, s.sortedRoundBound));
        worstRoundRatio = std::max(worstRoundRatio, bound > 0 ? static_cast<double>(s.sumRoundMaxima) / bound : 1.0);
        transfers = static_cast<int64_t>(p.transfers.size());
        rounds = p.numRounds;
        reshuffle += static_cast<double>(s.reshuffleBytes) / seeds;
        reshuffleNoLocality += static_cast<double>(fcp::plan::computeStats(q).reshuffleBytes) / seeds;
        shard.push_back(t.shardMs);
        assign.push_back(t.assignMs);
        xfers.push_back(t.transfersMs);
        colour.push_back(t.colorMs);
        sched.push_back(t.scheduleMs);
        total.push_back(t.totalMs);
      }
      std::printf("%-16s %5lld %8lld %5lld %6.2f%% %8.3f %7.3gG %7.3gG %7.2f %7.2f %7.2f %7.2f %7.2f %7.2f\n",
                  workload.name.c_str(), static_cast<long long>(n), static_cast<long long>(transfers),
                  static_cast<long long>(rounds), 100 * worstComm, worstRoundRatio, reshuffle / 1e9,
                  reshuffleNoLocality / 1e9, median(shard), median(assign), median(xfers),
                  median(colour), median(sched), median(total));
      std::fflush(stdout);
    }
  }
  return 0;
}
