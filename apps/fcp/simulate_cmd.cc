// `fcp simulate`: plans batches with FCP and the baselines and times them on a hardware model.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "commands.h"
#include "common.h"
#include "fcp/baselines/baselines.h"
#include "fcp/core/config.h"
#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/units.h"
#include "fcp/core/workload.h"
#include "fcp/runtime/timeline.h"
#include "fcp/sim/hardware.h"
#include "fcp/sim/simulator.h"

namespace fcp::app {
namespace {

/// Most workers one simulated cell may have, and most sampled batches per cell.
constexpr int64_t kMaxSimulatedWorkers = int64_t{1} << 20;
constexpr int64_t kMaxBatches = 10000;

struct SimulateArgs {
  std::vector<std::string> strategies = {"fcp",  "ring",     "bytescale", "wlb",
                                         "magi", "megatron", "usp"};
  std::vector<int64_t> workers = {16};
  std::string hardware = "h100";
  std::string workload = "lognormal";
  std::string trace;
  std::string blockSize = "4K";
  std::string tokensPerWorker;  // default 32K for workloads, the trace's share for traces
  int64_t batches = 1;
  uint64_t seed = 0;
  int64_t minSequences = 1;
  std::string mask = "causal";
  int64_t coalesce = 16;
  int64_t buffers = 3;
  double memorySlack = 0.1;
  double commRatio = 0;  // FCP's planner; below 0 ("hardware"): the profile's planCommRatio
  std::string placement = "local";  // FCP's planner, as fcp plan's --placement
  int64_t headsQ = 64;
  int64_t headsKv = 8;
  int64_t headDim = 128;
  std::string dtype = "bf16";
  bool forwardOnly = false;
  bool noReshuffle = false;
  std::string kernelLaunch;  ///< empty: the profile's
  std::string pipeline;      ///< empty: the profile's
  int64_t ulyssesDegree = 0;  ///< usp and fcp+ulysses; 0: theirs (usp tuned, fcp+ulysses a node)
  bool json = false;
  bool csv = false;
  std::string timeline;  ///< a Chrome trace of the one cell's simulated step, if given
};

/// Means over batches of one (strategy, workers) cell.
struct Cell {
  double mfu = 0, mfuForward = 0, mfuBackward = 0, timeMs = 0, forwardMs = 0, backwardMs = 0;
  double computeImbalance = 0, commImbalance = 0, computeMs = 0, idleMs = 0;
  double transferBytes = 0, reshuffleBytes = 0, planMs = 0, simMs = 0;
  int64_t batches = 0;
  std::vector<int64_t> ulyssesDegrees;  ///< per batch, for the head-parallel strategies

  void add(const sim::SimResult& r, double plan, double simulate) {
    mfu += r.mfu;
    mfuForward += r.forward.mfu;
    mfuBackward += r.backward.mfu;
    timeMs += r.timeMs;
    forwardMs += r.forward.timeMs;
    backwardMs += r.backward.timeMs;
    computeImbalance += r.computeImbalance;
    commImbalance += r.commImbalance;
    computeMs += r.meanComputeMs;
    idleMs += r.meanIdleMs;
    transferBytes += static_cast<double>(r.transferBytes);
    reshuffleBytes += static_cast<double>(r.reshuffleBytes);
    planMs += plan;
    simMs += simulate;
    ++batches;
  }
  void finish() {
    const auto k = static_cast<double>(batches);
    for (double* x : {&mfu, &mfuForward, &mfuBackward, &timeMs, &forwardMs, &backwardMs, &computeImbalance,
                      &commImbalance, &computeMs, &idleMs, &transferBytes, &reshuffleBytes, &planMs, &simMs}) {
      *x /= k;
    }
  }
};

int64_t elementBytes(const std::string& dtype) {
  if (dtype == "bf16" || dtype == "fp16") return 2;
  if (dtype == "fp32") return 4;
  throwInvalidArgument("unknown --dtype '", dtype, "': expected bf16, fp16 or fp32");
}

double msSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

/// --tokens-per-worker as given, or 0 when it was not.
int64_t givenTokensPerWorker(const SimulateArgs& a) {
  return a.tokensPerWorker.empty() ? 0 : parseTokenCount(a.tokensPerWorker, "--tokens-per-worker");
}

/// The tokens per worker of a sampled workload: given, or 32K.
int64_t sampledTokensPerWorker(const SimulateArgs& a) {
  const int64_t given = givenTokensPerWorker(a);
  return given > 0 ? given : 32 * 1024;
}

/// --kernel-launch's value, or the profile's when it was not given.
sim::KernelLaunch kernelLaunch(const std::string& text, sim::KernelLaunch profiles) {
  if (text.empty()) return profiles;
  if (const std::optional<sim::KernelLaunch> named = sim::kernelLaunchNamed(text)) return *named;
  throwInvalidArgument("invalid --kernel-launch '", printable(text), "': expected pair or stage");
}

/// --pipeline's value, or the profile's when it was not given.
sim::Pipeline pipeline(const std::string& text, sim::Pipeline profiles) {
  if (text.empty()) return profiles;
  if (const std::optional<sim::Pipeline> named = sim::pipelineNamed(text)) return *named;
  throwInvalidArgument("invalid --pipeline '", printable(text),
                       "': expected lockstep or multibuffer");
}

/// Whether --strategy lists `name`.
bool lists(const SimulateArgs& a, const char* name) {
  return std::find(a.strategies.begin(), a.strategies.end(), name) != a.strategies.end();
}

void checkArgs(const SimulateArgs& a) {
  (void)plan::parsePlacement(a.placement);  // names a bad one before any planning
  (void)kernelLaunch(a.kernelLaunch, sim::KernelLaunch::kPair);
  (void)pipeline(a.pipeline, sim::Pipeline::kLockstep);
  if (a.strategies.empty())
    throwInvalidArgument("empty --strategy: expected at least one strategy");
  for (const std::string& s : a.strategies) {
    static const std::vector<std::string> kAblation = {"fcp-base", "fcp-pipeline", "fcp-cfree", "fcp-coalesce"};
    const auto& known = baselines::strategyNames();
    const auto& heads = baselines::headParallelNames();
    if (std::find(known.begin(), known.end(), s) == known.end() &&
        std::find(heads.begin(), heads.end(), s) == heads.end() &&
        std::find(kAblation.begin(), kAblation.end(), s) == kAblation.end()) {
      throwInvalidArgument("unknown --strategy '", s,
                           "': expected fcp, ring, bytescale, wlb, magi, megatron, ulysses, usp, "
                           "fcp+ulysses (or fcp-base, fcp-pipeline, fcp-cfree, fcp-coalesce)");
    }
  }
  for (auto it = a.strategies.begin(); it != a.strategies.end(); ++it) {
    // Each strategy's cell is keyed by its name: a repeat added its batches into the first's
    // cell and was averaged twice (fcp,fcp printed halved figures), and the simulation is
    // deterministic, so a repeat could only print the same row again.
    if (std::find(a.strategies.begin(), it, *it) != it) {
      throwInvalidArgument("--strategy lists '", *it, "' twice: expected each strategy once");
    }
  }
  if (a.workers.empty()) throwInvalidArgument("empty --workers: expected worker counts such as 16,32");
  for (int64_t w : a.workers) {
    if (w <= 0 || w > (int64_t{1} << 20)) {
      throwInvalidArgument("invalid --workers ", w, ": expected 1 to 2^20");
    }
  }
  if (a.ulyssesDegree != 0 && !lists(a, "usp") && !lists(a, "fcp+ulysses")) {
    throwInvalidArgument("--ulysses-degree ", a.ulyssesDegree,
                         " without usp or fcp+ulysses in --strategy: expected one of them, whose "
                         "Ulysses groups it sizes");
  }
  // Ulysses gives each worker whole heads: a worker count it cannot split the heads over is
  // refused before any cell runs.
  if (lists(a, "ulysses")) {
    for (int64_t w : a.workers) {
      if (!splitsHeads(AttentionConfig{.numHeadsQ = a.headsQ, .numHeadsKv = a.headsKv}, w)) {
        throwInvalidArgument("--strategy ulysses on --workers ", w, " with --heads-q ", a.headsQ,
                             " and --heads-kv ", a.headsKv,
                             ": expected worker counts that divide the query heads and divide or "
                             "are a multiple of the key/value heads (usp runs at any count)");
      }
    }
  }
  // Every cell's batch size, before the first cell runs: a sweep must not plan for minutes and
  // only then refuse its last cell's batch.
  if (a.trace.empty()) {
    const int64_t tokensPerWorker = sampledTokensPerWorker(a);
    for (const int64_t workers : a.workers) {
      if (tokensPerWorker > kMaxBatchTokens / workers) {
        throwInvalidArgument("--workers ", workers, " x --tokens-per-worker ", tokensPerWorker,
                             " passes ", kMaxBatchTokens, " tokens: expected a smaller batch");
      }
    }
  } else {
    givenTokensPerWorker(a);
  }
  if (a.batches <= 0) throwInvalidArgument("invalid --batches ", a.batches, ": expected a positive integer");
  if (a.coalesce <= 0) throwInvalidArgument("invalid --coalesce ", a.coalesce, ": expected a positive integer");
  if (a.buffers < 2) throwInvalidArgument("invalid --buffers ", a.buffers, ": expected at least 2");
  if (!(a.memorySlack >= 0 && a.memorySlack <= 100)) {
    throwInvalidArgument("invalid --memory-slack ", a.memorySlack, ": expected 0 to 100");
  }
  if (a.json && a.csv) throwInvalidArgument("--json and --csv both given: expected at most one");
  if (!a.timeline.empty()) {
    // A trace is one simulated step: one strategy on one worker count and one batch.
    if (a.strategies.size() != 1 || a.workers.size() != 1) {
      throwInvalidArgument("--timeline with ", a.strategies.size(), " strategies and ",
                           a.workers.size(),
                           " worker counts: expected one --strategy and one --workers count");
    }
    if (a.trace.empty() && a.batches != 1) {
      throwInvalidArgument("--timeline with --batches ", a.batches,
                           ": expected 1 (the trace is of one batch; --seed picks it)");
    }
    checkOutputPath(a.timeline, "--timeline file");
    checkNotAnInput(a.timeline, "--timeline file",
                    {{a.trace, "--trace"},
                     {workloadFile(a.workload), "--workload"},
                     {sim::isProfileName(a.hardware) ? "" : a.hardware, "--hardware"}});
  }
}

/// The Chrome trace (Perfetto) of a simulated step: a process per worker, its compute and
/// messages per stage in two lanes and each pass in the third, the backward after the forward.
/// Stages that are no plan stage are named by what they hold (sim::stageName).
std::string simulatedTrace(const sim::SimResult& r) {
  const size_t n = r.forward.timelines.size();
  std::vector<std::vector<runtime::Span>> workers(n);
  const auto name = [](const char* pass, int32_t stage) {
    return std::string(pass) + ' ' + sim::stageName(stage);
  };
  for (const auto& [pass, label, offsetMs] :
       {std::tuple{&r.forward, "forward", 0.0},
        std::tuple{&r.backward, "backward", r.forward.timeMs}}) {
    if (pass->timelines.size() != n) continue;  // no backward pass
    for (size_t w = 0; w < n; ++w) {
      std::vector<runtime::Span>& out = workers[w];
      const auto add = [&](std::string text, int lane, double startMs, double endMs) {
        out.push_back({std::move(text), lane, (offsetMs + startMs) * 1e3, (endMs - startMs) * 1e3});
      };
      add(label, 2, 0, pass->finishMs[w]);
      for (const sim::StageSpan& s : pass->timelines[w]) {
        if (s.computeEndMs > s.computeStartMs)
          add(name(label, s.stage), 0, s.computeStartMs, s.computeEndMs);
        if (s.commEndMs > s.commStartMs)
          add(name(label, s.stage) + " messages", 1, s.commStartMs, s.commEndMs);
      }
    }
  }
  return runtime::chromeTrace(workers, "worker");
}

nlohmann::json record(const std::string& strategy, int64_t workers, const Cell& c,
                      const plan::PlanConfig& config, const sim::HardwareProfile& hardware) {
  return {
      {"strategy", strategy},
      {"workers", workers},
      {"hardware", hardware.name},
      {"kernel_launch", hardware.launch == sim::KernelLaunch::kStage ? "stage" : "pair"},
      {"pipeline", hardware.pipeline == sim::Pipeline::kMultiBuffer ? "multibuffer" : "lockstep"},
      {"tokens_per_worker", config.tokensPerWorker},
      {"block_size", config.blockSize},
      {"batches", c.batches},
      {"mfu", c.mfu},
      {"mfu_forward", c.mfuForward},
      {"mfu_backward", c.mfuBackward},
      {"time_ms", c.timeMs},
      {"forward_ms", c.forwardMs},
      {"backward_ms", c.backwardMs},
      {"imbalance", {{"compute", c.computeImbalance}, {"comm", c.commImbalance}}},
      {"breakdown_ms", {{"compute", c.computeMs}, {"idle", c.idleMs}}},
      {"transfer_bytes", c.transferBytes},
      {"reshuffle_bytes", c.reshuffleBytes},
      {"plan_ms", c.planMs},
      {"sim_ms", c.simMs}};
}

/// record() with each batch's Ulysses degree for the head-parallel strategies (usp's is tuned).
nlohmann::json recordOf(const std::string& strategy, int64_t workers, const Cell& c,
                        const plan::PlanConfig& config, const sim::HardwareProfile& hardware) {
  nlohmann::json r = record(strategy, workers, c, config, hardware);
  if (!c.ulyssesDegrees.empty()) r["ulysses_degree"] = c.ulyssesDegrees;
  return r;
}

/// A head-parallel cell's Ulysses degrees for the table: the batches' distinct degrees,
/// ascending and comma-separated ("-" for the other strategies).
std::string degreesText(std::vector<int64_t> degrees) {
  if (degrees.empty()) return "-";
  std::sort(degrees.begin(), degrees.end());
  degrees.erase(std::unique(degrees.begin(), degrees.end()), degrees.end());
  std::string text;
  for (const int64_t d : degrees) text += (text.empty() ? "" : ",") + std::to_string(d);
  return text;
}

/// What simulate prints, kept until every cell has run: an error in a later cell (a baseline
/// past its size limit, say) then leaves stdout empty instead of half a table.
struct Output {
  std::string text;
  [[gnu::format(printf, 2, 3)]] void printf(const char* format, ...) {
    va_list args, again;
    va_start(args, format);
    va_copy(again, args);
    const int n = std::vsnprintf(nullptr, 0, format, args);
    va_end(args);
    if (n > 0) {
      const size_t at = text.size();
      text.resize(at + static_cast<size_t>(n) + 1);
      std::vsnprintf(text.data() + at, static_cast<size_t>(n) + 1, format, again);
      text.resize(at + static_cast<size_t>(n));
    }
    va_end(again);
  }
};

static_assert(kMaxCommRatio == 1e5, "--comm-ratio's help names the largest ratio");

void runSimulate(const SimulateArgs& a) {
  checkArgs(a);
  Output table;
  const sim::HardwareProfile hw = [&] {
    sim::HardwareProfile h = sim::loadHardwareProfile(a.hardware);
    h.launch = kernelLaunch(a.kernelLaunch, h.launch);
    h.pipeline = pipeline(a.pipeline, h.pipeline);
    return h;
  }();
  plan::PlanConfig base;
  base.blockSize = parseBlockSize(a.blockSize);
  base.coalesce = a.coalesce;
  base.bufferDepth = a.buffers;
  base.memorySlack = a.memorySlack;
  base.placement = plan::parsePlacement(a.placement);
  base.attention = {a.headsQ, a.headsKv, a.headDim, elementBytes(a.dtype), parseMask(a.mask)};
  checkAttentionConfig(base.attention);
  const CostModel costModel = hw.costModel(base.attention);

  Batch traceBatch;
  std::optional<Workload> workload;
  if (!a.trace.empty()) {
    traceBatch = readTrace(a.trace);
  } else {
    workload = loadWorkload(a.workload);
  }
  sim::SimOptions options;
  options.backward = !a.forwardOnly;
  options.reshuffle = !a.noReshuffle;
  std::string timelineText;  // --timeline's, written before anything is printed

  const int64_t batches = a.trace.empty() ? a.batches : 1;
  const size_t total = a.workers.size() * static_cast<size_t>(batches) * a.strategies.size();
  const bool progress = total > 1;
  const bool tty = isatty(STDERR_FILENO) != 0;
  size_t done = 0;
  const auto sweepStart = std::chrono::steady_clock::now();

  if (a.csv) {
    table.printf("strategy,workers,batches,mfu,mfu_forward,mfu_backward,time_ms,forward_ms,backward_ms,"
                "imbalance_compute,imbalance_comm,compute_ms,idle_ms,transfer_bytes,reshuffle_bytes,"
                "plan_ms,sim_ms\n");
  } else if (!a.json) {
    table.printf(
        "hardware %s, %s, block %s%s%s\n", hw.name.c_str(),
        a.trace.empty() ? ("workload " + a.workload).c_str() : ("trace " + a.trace).c_str(),
        a.blockSize.c_str(),
        hw.launch == sim::KernelLaunch::kStage ? ", a launch per stage" : ", a kernel per pair",
        hw.pipeline == sim::Pipeline::kMultiBuffer ? ", multi-buffer pipeline" : "");
    table.printf("%-13s %7s %7s %7s %7s %11s %8s %8s %8s\n", "strategy", "workers", "mfu", "fwd",
                 "bwd", "time_ms", "imb_comp", "imb_comm", "ulysses");
  }
  if (a.ulyssesDegree != 0) {
    // Every cell's degree, before the first cell runs (checkArgs has no profile yet).
    for (const int64_t workers : a.workers) {
      for (const char* s : {"usp", "fcp+ulysses"}) {
        if (lists(a, s))
          baselines::checkUlyssesDegree(s, a.ulyssesDegree, workers, hw.workersPerNode,
                                        base.attention);
      }
    }
  }
  const int64_t givenTokens = givenTokensPerWorker(a);
  const int64_t tokensPerWorker = a.trace.empty() ? sampledTokensPerWorker(a) : givenTokens;
  const bool plansUnderTheCap =
      std::any_of(a.strategies.begin(), a.strategies.end(),
                  [](const std::string& s) { return s.starts_with("fcp"); });
  if (!a.trace.empty() && givenTokens > 0 && plansUnderTheCap) {
    // Before any cell runs, named by simulate's own flags (the planner's message offers a
    // memory limit, which simulate does not take). FCP and its ablation steps plan under the
    // cap; the baselines raise it to what their layout holds, so they alone are not refused.
    for (const int64_t workers : a.workers) {
      plan::PlanConfig config = base;
      config.numWorkers = workers;
      config.tokensPerWorker = givenTokens;
      const plan::DistributorOptions o = plan::distributorOptions(config);
      if (plan::safeBlockTokens(traceBatch.numTokens(), o) > 0) continue;
      throwInvalidArgument("memory cap cannot hold the batch: ", traceBatch.numTokens(),
                           " tokens > ", workers, workers == 1 ? " worker x " : " workers x ",
                           plan::memoryCapTokens(o), " tokens (--tokens-per-worker ",
                           a.tokensPerWorker, " with --trace, and --memory-slack ", a.memorySlack,
                           "): expected more tokens per worker or workers, or a larger slack");
    }
  }
  for (const int64_t workers : a.workers) {
    plan::PlanConfig config = base;
    config.numWorkers = workers;
    config.commRatio = a.commRatio >= 0 ? a.commRatio : hw.planCommRatio(workers);
    // Within kMaxBatchTokens for every cell (checkArgs).
    config.tokensPerWorker = !a.trace.empty() && givenTokens == 0
                                 ? (traceBatch.numTokens() + workers - 1) / workers
                                 : tokensPerWorker;
    std::map<std::string, Cell> cells;
    for (int64_t k = 0; k < batches; ++k) {
      const Batch batch = workload ? sampleBatch(*workload, workers * config.tokensPerWorker,
                                                 a.seed + static_cast<uint64_t>(k), a.minSequences)
                                   : traceBatch;
      for (const std::string& strategy : a.strategies) {
        sim::SimOptions o = options;
        o.overlapReshuffle = strategy.rfind("fcp-", 0) != 0;  // ablation steps 0-3: no reshuffler
        const baselines::PlanOracle oracle = [&](const plan::Plan& p) { return sim::simulate(p, hw, o).timeMs; };
        const auto& heads = baselines::headParallelNames();
        const bool headParallel = std::find(heads.begin(), heads.end(), strategy) != heads.end();
        const auto planStart = std::chrono::steady_clock::now();
        std::optional<baselines::HeadParallelPlan> hp;
        std::optional<plan::Plan> p;
        if (headParallel) {
          const baselines::HeadParallelOracle degrees = [&](const baselines::HeadParallelPlan& h) {
            return sim::simulateHeadParallel(h.ring, config.attention, h.degree, hw, o).timeMs;
          };
          hp = baselines::headParallelPlan(strategy, batch, config, costModel, hw.workersPerNode,
                                           degrees, a.ulyssesDegree);
        } else {
          p = baselines::makePlan(strategy, batch, config, costModel, oracle);
        }
        const double planMs = msSince(planStart);
        const auto simStart = std::chrono::steady_clock::now();
        // Only the cell's own run keeps timelines, for --timeline; the oracle's runs do not.
        sim::SimOptions run = o;
        run.timelines = !a.timeline.empty();
        const sim::SimResult r =
            hp ? sim::simulateHeadParallel(hp->ring, config.attention, hp->degree, hw, run)
               : sim::simulate(*p, hw, run);
        cells[strategy].add(r, planMs, msSince(simStart));
        if (run.timelines) timelineText = simulatedTrace(r);
        if (hp) cells[strategy].ulyssesDegrees.push_back(hp->degree);
        ++done;
        if (progress) {
          std::fprintf(stderr, "%sfcp simulate: %zu/%zu  %s, %lld workers, batch %lld  (%.1f s)%s",
                       tty ? "\r" : "", done, total, strategy.c_str(), static_cast<long long>(workers),
                       static_cast<long long>(k + 1), msSince(sweepStart) / 1e3, tty ? "\033[K" : "\n");
        }
      }
    }
    for (const std::string& strategy : a.strategies) {
      Cell& c = cells[strategy];
      c.finish();
      if (a.json) {
        table.text += recordOf(strategy, workers, c, config, hw).dump() + '\n';
      } else if (a.csv) {
        table.printf("%s,%lld,%lld,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.0f,%.0f,%.3f,%.3f\n",
                    strategy.c_str(), static_cast<long long>(workers), static_cast<long long>(c.batches), c.mfu,
                    c.mfuForward, c.mfuBackward, c.timeMs, c.forwardMs, c.backwardMs, c.computeImbalance,
                    c.commImbalance, c.computeMs, c.idleMs, c.transferBytes, c.reshuffleBytes, c.planMs, c.simMs);
      } else {
        table.printf("%-13s %7lld %7.3f %7.3f %7.3f %11.3f %8.3f %8.3f %8s\n", strategy.c_str(),
                     static_cast<long long>(workers), c.mfu, c.mfuForward, c.mfuBackward, c.timeMs,
                     c.computeImbalance, c.commImbalance, degreesText(c.ulyssesDegrees).c_str());
      }
    }
  }
  if (progress && tty) std::fprintf(stderr, "\n");
  if (!a.timeline.empty()) writeUserFile(a.timeline, "--timeline file", timelineText + "\n");
  std::fputs(table.text.c_str(), stdout);
}

}  // namespace

void addSimulateCommand(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  auto* cmd = app.add_subcommand("simulate", "Time FCP and the baselines on a simulated cluster");
  cmd->add_option_function<std::string>(
         "--strategy",
         [args](const std::string& text) {
           // Split here: CLI11's delimiter would drop an empty item ("fcp,,ring").
           args->strategies.clear();
           size_t begin = 0;
           for (size_t comma; (comma = text.find(',', begin)) != std::string::npos; begin = comma + 1)
             args->strategies.push_back(text.substr(begin, comma - begin));
           args->strategies.push_back(text.substr(begin));
         },
         "Comma-separated: fcp, ring, bytescale, wlb, magi, megatron, ulysses (DeepSpeed-Ulysses, "
         "when the workers divide the heads), usp (Ulysses inside groups, a ring across them, "
         "at the group size that simulates fastest), "
         "fcp+ulysses (Ulysses inside a node, FCP across nodes, as the FCP paper runs it on "
         "rail-optimised clusters) (ablation: fcp-base, fcp-pipeline, fcp-cfree, fcp-coalesce)")
      ->default_str("fcp,ring,bytescale,wlb,magi,megatron,usp");
  addIntegerList(cmd, "--workers", args->workers, 1, kMaxSimulatedWorkers,
                 "Comma-separated worker counts, e.g. 16,32,64");
  addText(cmd, "--hardware", args->hardware,
          "Profile name (h100, gpu-x, gpu-y, cpu) or JSON file; every planner costs blocks with "
          "its efficiency curve (as fcp plan --curve)");
  auto* workload = addText(cmd, "--workload", args->workload, kWorkloadHelp);
  auto* trace = addText(cmd, "--trace", args->trace, "Trace file: one sequence length per line");
  workload->excludes(trace);
  addText(cmd, "--block-size", args->blockSize, "Tokens per block, e.g. 4K");
  addText(cmd, "--tokens-per-worker", args->tokensPerWorker,
                  "Tokens per worker (default 32K; with --trace, the trace's share)");
  // A trace is one batch, used as given: --batches and --seed would change nothing.
  addInteger(cmd, "--batches", args->batches, 1, kMaxBatches,
             "Sampled batches per cell (mean reported)")
      ->excludes(trace);
  addUnsigned(cmd, "--seed", args->seed, std::numeric_limits<uint64_t>::max(),
              "Seed of the first batch")
      ->excludes(trace);
  addInteger(cmd, "--min-sequences", args->minSequences, 1, kMaxBatchTokens,
             "Draw the first batch of the seed's stream with at least this many sequences "
             "(default 1)")
      ->excludes(trace);
  addText(cmd, "--mask", args->mask, "causal or full");
  addInteger(cmd, "--coalesce", args->coalesce, 1, plan::kMaxCoalesce, "FCP: rounds per pipeline stage");
  addInteger(cmd, "--buffers", args->buffers, 2, plan::kMaxBufferDepth, "FCP: stages of remote KV held (>= 2)");
  addNumber(cmd, "--memory-slack", args->memorySlack, 0, 100, "Tolerated overshoot of the memory budget");
  cmd->add_option_function<std::string>(
         "--comm-ratio",
         [args](const std::string& text) {
           if (text == "hardware") {
             args->commRatio = -1;
             return;
           }
           try {
             args->commRatio = parseNumber(text, "--comm-ratio", 0, kMaxCommRatio);
           } catch (const Error&) {
             throwInvalidArgument("invalid --comm-ratio '", text,
                                  "': expected a number from 0 to 100000, or hardware");
           }
         },
         "FCP: the link's speed as its planner takes it (as fcp plan --comm-ratio), cost units "
         "per byte; 'hardware': the profile's, peak FLOP/s / 3.5 / NIC (within one node, "
         "NVLink) bytes/s; 0: balance compute first [0 to 100000, or hardware]")
      ->type_name("NUMBER|hardware")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str("0");
  addInteger(cmd, "--heads-q", args->headsQ, 1, kMaxHeads, "Query heads");
  addInteger(cmd, "--heads-kv", args->headsKv, 1, kMaxHeads, "Key/value heads (GQA)");
  addInteger(cmd, "--head-dim", args->headDim, 1, kMaxHeadDim, "Head dimension");
  addText(cmd, "--dtype", args->dtype, "Element type: bf16, fp16 or fp32");
  cmd->add_flag("--forward-only", args->forwardOnly, "Simulate the forward pass only");
  cmd->add_flag("--no-reshuffle", args->noReshuffle, "Do not charge the reshuffle");
  addText(cmd, "--kernel-launch", args->kernelLaunch,
          "pair (each pair its own kernel and merge) or stage (one launch per worker and stage, "
          "as the paper's coalescer and MagiAttention's FFA run them); default: the profile's "
          "kernel_launch (h100, gpu-x, gpu-y: stage; cpu: pair, as FCP's CPU executor runs)");
  addText(cmd, "--pipeline", args->pipeline,
          "lockstep (a stage's compute and transfers start once the stage before has done both, "
          "as FCP's CPU executor runs) or multibuffer (a stage's compute waits only for the "
          "transfers that brought its KV, --buffers - 1 stages back for FCP: the paper's "
          "multi-buffer pipeline); default: the profile's pipeline (h100, gpu-x, gpu-y: "
          "multibuffer; cpu: lockstep)");
  addText(cmd, "--placement", args->placement,
          "FCP's placement, as for fcp plan: local (blocks stay where the user layout holds "
          "them unless balance needs them elsewhere) or lpt (the paper's Zig-Zag blocks and LPT "
          "greedy; with --no-reshuffle the local placement has nothing to save)");
  addInteger(cmd, "--ulysses-degree", args->ulyssesDegree, 1, kMaxSimulatedWorkers,
             "Workers per Ulysses group of usp and fcp+ulysses (default: usp the degree that "
             "simulates fastest, fcp+ulysses the largest within a node)");
  cmd->add_flag("--json", args->json, "One JSON record per (strategy, workers)");
  cmd->add_flag("--csv", args->csv, "CSV, one row per (strategy, workers)");
  addText(cmd, "--timeline", args->timeline,
          "Also write the simulated step as a Chrome trace (Perfetto) to this file: a process "
          "per worker, each stage's compute and messages, forward then backward (one "
          "--strategy, one --workers count, one batch)");
  cmd->callback([args] { runSimulate(*args); });
}

}  // namespace fcp::app
