// `fcp plan`: build a batch, shard it, assign its blocks, print the summary (and the plan).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <tuple>

#include "commands.h"
#include "common.h"
#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/statistics.h"
#include "fcp/core/units.h"
#include "fcp/core/workload.h"
#include "fcp/plan/json.h"
#include "fcp/plan/limits.h"
#include "fcp/plan/plan.h"
#include "fcp/sim/hardware.h"

namespace fcp::app {
namespace {

struct PlanArgs {
  std::string workload = "lognormal";
  std::string curve;
  std::string trace;
  int64_t workers = 16;
  std::string tokensPerWorker;  // default 32K for workloads, the trace's share for traces
  std::string blockSize = "4K";
  std::string memoryLimit;  // default: tokens per worker
  double memorySlack = 0.1;
  double alpha = 1.0;
  double beta = 1.0;
  uint64_t seed = 0;
  int64_t minSequences = 1;
  std::string mask = "causal";
  int64_t headsQ = 64;
  int64_t headsKv = 8;
  int64_t headDim = 128;
  std::string dtype = "bf16";
  int64_t coalesce = 16;
  int64_t buffers = 3;
  bool noLocality = false;
  bool noCostAwareBlocks = false;
  std::string placement = "local";
  double localitySlack = 0.01;
  double commRatio = 0;
  double commBalanceSlack = 0.002;
  bool json = false;
  std::string planOut;
  std::string planIn;
};

int64_t elementBytes(const std::string& dtype) {
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp32") return 4;
  throwInvalidArgument("unknown --dtype '", dtype, "': expected bf16, fp16 or fp32");
}

/// A fraction as a percentage for %.4f: a rounding residue prints as 0.0000, not -0.0000
/// (one worker's gap to its bound came out at -1e-16).
double percent(double fraction) {
  const double p = 100 * fraction;
  return std::fabs(p) < 5e-5 ? 0.0 : p;
}

/// One line when the sharding differs from the configured block size: what the memory cap
/// and cost-aware blocks did.
void printSharding(const plan::Plan& p) {
  if (p.memoryRetries > 0) {
    std::printf(
        "  memory cap: blocks of %s did not pack under it; every block cut to %s "
        "(%lld retries)\n",
        formatTokenCount(p.config.blockSize).c_str(), formatTokenCount(p.shardBlockSize).c_str(),
        static_cast<long long>(p.memoryRetries));
  }
  if (p.costCutSequences > 0) {
    std::printf(
        "  cost-aware blocks: %lld sequences cut finer (smallest blocks %s): their "
        "blocks were too costly to balance\n",
        static_cast<long long>(p.costCutSequences), formatTokenCount(p.smallestBlockSize).c_str());
  }
  if (p.packedBlockSize > 0 && p.packedBlockSize < p.shardBlockSize) {
    std::printf(
        "  memory-aware packing: short sequences packed into blocks of at most %s, to fill "
        "the room the memory cap leaves\n",
        formatTokenCount(p.packedBlockSize).c_str());
  }
}

/// `t` is null for a plan loaded from a file: it was not planned here, so there are no times.
void printSummary(const plan::Plan& p, const plan::PlanStats& s, const plan::PlanTimings* t,
                  const std::string& source) {
  const auto& c = p.config;
  std::printf("FCP plan: %s, %lld sequences, %lld tokens\n", source.c_str(),
              static_cast<long long>(p.batch.numSequences()),
              static_cast<long long>(p.batch.numTokens()));
  std::printf(
      "  workers %lld, %s tokens per worker, %s blocks, %s mask, %lld/%lld heads x %lld\n",
      static_cast<long long>(c.numWorkers), formatTokenCount(c.tokensPerWorker).c_str(),
      formatTokenCount(c.blockSize).c_str(), std::string(maskName(c.attention.mask)).c_str(),
      static_cast<long long>(c.attention.numHeadsQ), static_cast<long long>(c.attention.numHeadsKv),
      static_cast<long long>(c.attention.headDim));
  std::printf("  blocks %zu, pairs %zu, forward %.3g FLOP\n", p.blocks.size(), p.pairs.size(),
              s.totalForwardFlops);
  printSharding(p);
  std::printf("  imbalance: compute %.4f, memory %.4f (max - mean) / max\n", s.computeImbalance,
              s.memoryImbalance);
  std::printf(
      "  busiest worker %.4f%% above the lower bound (greedy alone: %.4f%%, %lld "
      "improvement steps)\n",
      percent(s.lowerBoundGap), percent(p.greedyMaxCost / p.lowerBound - 1),
      static_cast<long long>(p.improveSteps));
  if (s.memoryLowerBound > p.lowerBound) {
    std::printf(
        "  the memory cap raises the bound %.4f%% (no assignment of these blocks does "
        "better): busiest worker %.4f%% above it\n",
        percent(s.memoryLowerBound / p.lowerBound - 1), percent(s.memoryBoundGap));
  }
  std::printf("  memory: max %lld tokens per worker, cap %lld\n",
              static_cast<long long>(s.maxWorkerTokens), static_cast<long long>(s.memoryCapTokens));
  std::printf(
      "  communication: %lld transfers, %.3g bytes, %d rounds (= max degree %d), %d "
      "forward stages, imbalance %.4f\n",
      static_cast<long long>(p.transfers.size()), static_cast<double>(s.commBytes), p.numRounds,
      s.maxDegree, s.numForwardStages, s.commImbalance);
  if (s.commFloorBytes > 0) {
    std::printf(
        "  communication floor: %.4g bytes at the busiest worker for these blocks "
        "(imbalance at least %.4f without moving more bytes)\n",
        static_cast<double>(s.commFloorBytes), s.commImbalanceFloor);
  }
  std::printf("  round maxima: sum %.4g bytes; lower bounds %.4g (busiest worker), %.4g (sorted)\n",
              static_cast<double>(s.sumRoundMaxima), static_cast<double>(s.maxWorkerCommBytes),
              static_cast<double>(s.sortedRoundBound));
  std::printf("  reshuffle: %.4g bytes\n", static_cast<double>(s.reshuffleBytes));
  // Only the local placement starts from the home workers; LPT's count of moves is not one.
  const std::string moves =
      p.placement == plan::Placement::kLocal
          ? " (" + std::to_string(p.localityMoves) + " blocks moved off their home worker)"
          : "";
  std::printf(
      "  placement %s%s; a step (forward and backward) moves %.4g bytes, the busiest worker "
      "%.4g\n",
      std::string(plan::placementName(p.placement)).c_str(), moves.c_str(),
      static_cast<double>(s.stepBytes), static_cast<double>(s.maxWorkerStepBytes));
  if (!t) {
    std::printf("  loaded, not planned here: no planning times\n");
    return;
  }
  std::printf(
      "  planned in %.2f ms (shard %.2f, assign %.2f, balance %.2f, transfers %.2f, "
      "colour %.2f, schedule %.2f)\n",
      t->totalMs, t->shardMs, t->assignMs, t->balanceMs, t->transfersMs, t->colorMs, t->scheduleMs);
}

/// The plan's digest as the ranks compare it and name it when they disagree: its top 63 bits,
/// 16 hex digits.
std::string digestHex(uint64_t digest) {
  char text[24];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(digest >> 1));
  return text;
}

/// `fcp plan --plan-in FILE`: a saved plan, checked, then summarised like a new one.
/// Its pair costs are recomputed with --curve (the paper-shaped curve by default), so a plan
/// made with `--curve X` must be loaded with `--curve X`. Its JSON has no plan_ms: the plan was
/// not made here.
void runLoadedPlan(const PlanArgs& a) {
  const plan::Plan p =
      plan::planFromJson(readUserFile(a.planIn, "--plan-in file", kMaxPlanFileBytes));
  auto violations = plan::validate(p);
  if (violations.empty()) {
    CostModel costModel{p.config.attention};
    if (!a.curve.empty())
      std::tie(costModel.forward, costModel.backward) = sim::loadEfficiencyCurves(a.curve);
    violations = plan::validateCosts(p, costModel);
  }
  if (!violations.empty()) {
    throw Error(ErrorCode::kInvalidPlan, "plan '" + printable(a.planIn) +
                                             "' is invalid: " + violations.front() +
                                             (violations.size() > 1 ? " (and more)" : ""));
  }
  const plan::PlanStats s = plan::computeStats(p);
  if (a.json) {
    std::cout << nlohmann::json({{"workers", p.config.numWorkers},
                                 {"valid", true},
                                 {"digest", digestHex(plan::planDigest(p))},
                                 {"imbalance",
                                  {{"compute", s.computeImbalance},
                                   {"memory", s.memoryImbalance},
                                   {"comm", s.commImbalance},
                                   {"comm_floor", s.commImbalanceFloor}}}})
                     .dump()
              << '\n';
  } else {
    printSummary(p, s, nullptr, "loaded from " + a.planIn);
    std::printf("  digest %s\n", digestHex(plan::planDigest(p)).c_str());
  }
}

/// Refuses an option given with --plan-in that a loaded plan does not use (every one but
/// --curve and --json): it would be silently ignored, the plan keeping its own settings.
void checkPlanInOptions(const CLI::App& cmd) {
  for (const CLI::Option* o : cmd.get_options()) {
    const std::string name = o->get_name();
    if (o->count() == 0 || name == "--plan-in" || name == "--curve" || name == "--json") continue;
    throwInvalidArgument("--plan-in with ", name,
                         ": expected only --curve and --json beside it (a loaded plan is "
                         "checked as saved, not planned again)");
  }
}

void runPlan(const PlanArgs& a) {
  // Refuse an output that is not a regular file before any work, and again when writing.
  if (!a.planOut.empty()) {
    checkOutputPath(a.planOut, "--plan-out file");
    checkNotAnInput(a.planOut, "--plan-out file",
                    {{a.trace, "--trace"},
                     {workloadFile(a.workload), "--workload"},
                     {sim::isProfileName(a.curve) ? "" : a.curve, "--curve"}});
  }
  if (!a.planIn.empty()) return runLoadedPlan(a);
  plan::PlanConfig config;
  config.numWorkers = a.workers;
  config.blockSize = parseBlockSize(a.blockSize);
  config.memorySlack = a.memorySlack;
  config.alpha = a.alpha;
  config.beta = a.beta;
  config.coalesce = a.coalesce;
  config.bufferDepth = a.buffers;
  config.locality = !a.noLocality;
  config.costAwareBlocks = !a.noCostAwareBlocks;
  config.placement = plan::parsePlacement(a.placement);
  config.localitySlack = a.localitySlack;
  config.commRatio = a.commRatio;
  config.commBalanceSlack = a.commBalanceSlack;
  config.attention = {a.headsQ, a.headsKv, a.headDim, elementBytes(a.dtype), parseMask(a.mask)};
  checkAttentionConfig(config.attention);

  Batch batch;
  std::string source;
  if (!a.trace.empty()) {
    batch = readTrace(a.trace);
    source = "trace " + a.trace;
    const int64_t share = (batch.numTokens() + a.workers - 1) / a.workers;
    config.tokensPerWorker = a.tokensPerWorker.empty()
                                 ? share
                                 : parseTokenCount(a.tokensPerWorker, "--tokens-per-worker");
  } else {
    const Workload workload = loadWorkload(a.workload);
    config.tokensPerWorker = parseTokenCount(a.tokensPerWorker.empty() ? "32K" : a.tokensPerWorker,
                                             "--tokens-per-worker");
    if (config.tokensPerWorker > kMaxBatchTokens / a.workers) {
      throwInvalidArgument("--workers ", a.workers, " x --tokens-per-worker ",
                           config.tokensPerWorker, " passes ", kMaxBatchTokens,
                           " tokens: expected a smaller batch");
    }
    batch = sampleBatch(workload, a.workers * config.tokensPerWorker, a.seed, a.minSequences);
    source = describeDraw(workload.name, a.seed, a.minSequences);
  }
  config.memoryLimitTokens =
      a.memoryLimit.empty() ? 0 : parseTokenCount(a.memoryLimit, "--memory-limit");

  CostModel costModel{config.attention};
  if (!a.curve.empty())
    std::tie(costModel.forward, costModel.backward) = sim::loadEfficiencyCurves(a.curve);
  plan::PlanTimings timings;
  const plan::Plan p = plan::buildPlan(batch, config, costModel, &timings);
  // What a batch of the library costs after its plan (AttentionBatch): the invariants checked,
  // and the digest the ranks compare.
  const auto msFrom = [](std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  };
  const auto validateStart = std::chrono::steady_clock::now();
  plan::checkValid(p);
  const double validateMs = msFrom(validateStart);
  const auto digestStart = std::chrono::steady_clock::now();
  const uint64_t digest = plan::planDigest(p);
  const double digestMs = msFrom(digestStart);
  const std::string digestText = digestHex(digest);
  const plan::PlanStats s = plan::computeStats(p);
  if (!a.planOut.empty()) writeUserFile(a.planOut, "--plan-out file", plan::planToJson(p) + "\n");

  if (!a.json) {
    printSummary(p, s, &timings, source);
    std::printf("  checked in %.2f ms; digest %s in %.2f ms\n", validateMs, digestText.c_str(),
                digestMs);
    std::printf("  reshuffle without the locality preference: %.4g bytes\n",
                static_cast<double>(s.reshuffleBytesWithoutLocality));
    return;
  }
  nlohmann::json traffic = nlohmann::json::array();
  for (const plan::WorkerTraffic& w : plan::computeTraffic(p)) {
    nlohmann::json passes;
    for (const auto& [name, t] :
         {std::pair{"forward", w.forward}, std::pair{"backward", w.backward}}) {
      passes[name] = {{"reshuffle_sent", t.reshuffleSent},
                      {"reshuffle_received", t.reshuffleReceived},
                      {"kv_sent", t.kvSent},
                      {"kv_received", t.kvReceived}};
    }
    traffic.push_back(std::move(passes));
  }
  const nlohmann::json out = {
      {"workers", config.numWorkers},
      {"placement", std::string(plan::placementName(p.placement))},
      {"locality_moves", p.localityMoves},
      {"step_bytes", s.stepBytes},
      {"max_worker_step_bytes", s.maxWorkerStepBytes},
      {"traffic", std::move(traffic)},
      {"tokens_per_worker", config.tokensPerWorker},
      {"block_size", config.blockSize},
      {"sharding",
       {{"block_size", p.shardBlockSize},
        {"memory_retries", p.memoryRetries},
        {"cost_cut_sequences", p.costCutSequences},
        {"smallest_block_size", p.smallestBlockSize},
        {"packed_block_size", p.packedBlockSize}}},
      {"mask", std::string(maskName(config.attention.mask))},
      {"sequences", p.batch.numSequences()},
      {"median_sequence_length",
       median(std::vector<double>(p.batch.sequenceLengths.begin(), p.batch.sequenceLengths.end()))},
      {"tokens", p.batch.numTokens()},
      {"blocks", p.blocks.size()},
      {"pairs", p.pairs.size()},
      {"forward_flops", s.totalForwardFlops},
      {"imbalance",
       {{"compute", s.computeImbalance},
        {"memory", s.memoryImbalance},
        {"comm", s.commImbalance},
        {"comm_floor", s.commImbalanceFloor}}},
      {"comm_floor_bytes", s.commFloorBytes},
      {"rounds", p.numRounds},
      {"max_degree", s.maxDegree},
      {"stages", s.numForwardStages},
      {"coalesce", config.coalesce},
      {"buffers", config.bufferDepth},
      {"transfers", p.transfers.size()},
      {"comm_bytes", s.commBytes},
      {"reshuffle_bytes", s.reshuffleBytes},
      {"reshuffle_bytes_without_locality", s.reshuffleBytesWithoutLocality},
      {"round_max_bytes_sum", s.sumRoundMaxima},
      {"round_max_bytes_lower_bounds",
       {{"busiest_worker", s.maxWorkerCommBytes}, {"sorted_transfers", s.sortedRoundBound}}},
      {"lower_bound_gap", s.lowerBoundGap},
      {"lower_bound", p.lowerBound},
      {"memory_lower_bound", s.memoryLowerBound},
      {"memory_bound_gap", s.memoryBoundGap},
      {"max_worker_cost", (1 + s.lowerBoundGap) * p.lowerBound},
      {"greedy_lower_bound_gap", p.greedyMaxCost / p.lowerBound - 1},
      {"improve_steps", p.improveSteps},
      {"max_worker_tokens", s.maxWorkerTokens},
      {"memory_cap_tokens", s.memoryCapTokens},
      {"plan_ms", timings.totalMs},
      {"plan_ms_by_phase",
       {{"shard", timings.shardMs},
        {"assign", timings.assignMs},
        {"balance", timings.balanceMs},
        {"transfers", timings.transfersMs},
        {"colour", timings.colorMs},
        {"schedule", timings.scheduleMs}}},
      {"digest", digestText},
      {"check_ms", {{"validate", validateMs}, {"digest", digestMs}}}};
  std::cout << out.dump() << '\n';
}

}  // namespace

void addPlanCommand(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd =
      app.add_subcommand("plan", "Shard a batch into blocks and assign them to workers");
  auto* workload = addText(cmd, "--workload", args->workload, kWorkloadHelp);
  auto* trace = addText(cmd, "--trace", args->trace,
                        "File of sequence lengths, one per line (# comments allowed)");
  workload->excludes(trace);
  addInteger(cmd, "--workers", args->workers, 1, plan::kMaxWorkers, "Number of workers (ranks)");
  addText(cmd, "--tokens-per-worker", args->tokensPerWorker,
          "Tokens per worker, e.g. 32K (default 32K; for a trace, its total / workers)");
  addText(cmd, "--block-size", args->blockSize, "Tokens per block, e.g. 4K");
  addText(cmd, "--memory-limit", args->memoryLimit,
          "Per-worker memory budget M in tokens (default: tokens per worker)");
  addNumber(cmd, "--memory-slack", args->memorySlack, 0, 100, "Tolerated overshoot delta of M");
  addNumber(cmd, "--alpha", args->alpha, 1e-6, 1e6, "Weight of memory in the distributor's score");
  addNumber(cmd, "--beta", args->beta, 1e-6, 1e6, "Weight of compute in the distributor's score");
  // A trace is used as given: a seed would change nothing.
  addUnsigned(cmd, "--seed", args->seed, std::numeric_limits<uint64_t>::max(),
              "Seed of the batch sampler")
      ->excludes(trace);
  addInteger(cmd, "--min-sequences", args->minSequences, 1, kMaxBatchTokens,
             "Draw the first batch of the seed's stream with at least this many sequences "
             "(default 1)")
      ->excludes(trace);
  addText(cmd, "--curve", args->curve,
          "Kernel efficiency f(B) to plan with: a file from `fcp bench kernel --curve-out`, or a "
          "hardware profile (h100, gpu-x, gpu-y, cpu or a JSON file); default: the paper-shaped "
          "GPU curve");
  addText(cmd, "--mask", args->mask, "causal or full");
  addInteger(cmd, "--heads-q", args->headsQ, 1, kMaxHeads, "Query heads");
  addInteger(cmd, "--heads-kv", args->headsKv, 1, kMaxHeads, "Key/value heads (GQA)");
  addInteger(cmd, "--head-dim", args->headDim, 1, kMaxHeadDim, "Head dimension");
  addText(cmd, "--dtype", args->dtype, "Element type: bf16, fp16 or fp32");
  cmd->add_flag("--json", args->json, "Print one JSON object instead of the summary");
  addInteger(cmd, "--coalesce", args->coalesce, 1, plan::kMaxCoalesce,
             "Rounds merged into one pipeline stage");
  addInteger(cmd, "--buffers", args->buffers, 2, plan::kMaxBufferDepth,
             "Stages of remote KV a worker may hold (>= 2)");
  addNumber(cmd, "--comm-balance-slack", args->commBalanceSlack, plan::kMinCommBalanceSlack,
            plan::kMaxCommBalanceSlack,
            "Compute above LB allowed to even out communication (negative: off)");
  addText(cmd, "--placement", args->placement,
          "local: blocks stay where the user layout holds their tokens unless balance "
          "needs them elsewhere; lpt: the paper's Zig-Zag blocks and LPT greedy");
  addNumber(cmd, "--locality-slack", args->localitySlack, 0, 1,
            "With --placement local: compute above the lower bound the busiest worker may "
            "keep rather than move more bytes (0 to 1)");
  addNumber(cmd, "--comm-ratio", args->commRatio, 0, kMaxCommRatio,
            "With --placement local: cost units (forward FLOPs at peak) per byte of the link, "
            "i.e. peak FLOP/s / 3.5 / link bytes/s (GPU-X about 1700; 0: unknown); the placement "
            "then wins on estimated step time, not compute balance alone");
  cmd->add_flag("--no-locality", args->noLocality,
                "For an LPT placement (--placement lpt, or local where it falls back to LPT): "
                "do not relabel workers to keep blocks where the user layout holds them");
  cmd->add_flag("--no-cost-aware-blocks", args->noCostAwareBlocks,
                "Keep every block of a long sequence at the block size, even when one costs a "
                "large part of a worker's share");
  addText(cmd, "--plan-out", args->planOut, "Also write the whole plan as JSON to this file");
  addText(cmd, "--plan-in", args->planIn,
          "Check and summarise a plan written by --plan-out instead of planning (only --curve "
          "and --json go with it)");
  cmd->callback([args, cmd] {
    if (!args->planIn.empty()) checkPlanInOptions(*cmd);
    runPlan(*args);
  });
}

}  // namespace fcp::app
