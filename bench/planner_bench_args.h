#pragma once
// Shared by the planner benchmarks: their common flags.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/units.h"
#include "fcp/core/workload.h"

namespace fcp::bench {

/// --tokens-per-worker T, --block-size B, --seeds K, --workers 16,64,..., --workloads (parsed strictly: a bad
/// value is one line on stderr and exit code 2)
struct PlannerBenchArgs {
  int64_t tokensPerWorker = 32 * 1024;
  int64_t blockSize = 4 * 1024;
  int seeds = 3;
  std::vector<int64_t> workerCounts;
  /// --workloads a,b,...: built-in names or length-list files (fcp::loadWorkload); default the
  /// built-in ones.
  std::vector<Workload> workloads = builtinWorkloads();
};

inline PlannerBenchArgs parsePlannerBenchArgs(int argc, char** argv, PlannerBenchArgs args) {
  try {
    for (int i = 1; i + 1 < argc; i += 2) {
      if (!std::strcmp(argv[i], "--tokens-per-worker")) {
        args.tokensPerWorker = parseTokenCount(argv[i + 1], "--tokens-per-worker");
      } else if (!std::strcmp(argv[i], "--block-size")) {
        args.blockSize = parseTokenCount(argv[i + 1], "--block-size");
      } else if (!std::strcmp(argv[i], "--seeds")) {
        args.seeds = static_cast<int>(parseInteger(argv[i + 1], "--seeds", 1, 1000));
      } else if (!std::strcmp(argv[i], "--workloads")) {
        args.workloads.clear();
        std::stringstream ss(argv[i + 1]);
        for (std::string item; std::getline(ss, item, ',');) args.workloads.push_back(loadWorkload(item));
      } else if (!std::strcmp(argv[i], "--workers")) {
        args.workerCounts.clear();
        std::stringstream ss(argv[i + 1]);
        for (std::string item; std::getline(ss, item, ',');)
          args.workerCounts.push_back(parseInteger(item, "--workers", 1, int64_t{1} << 24));
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    std::exit(2);
  }
  return args;
}

}  // namespace fcp::bench
