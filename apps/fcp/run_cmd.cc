// `fcp run`: execute plans on real ranks (under mpirun), forward and backward, and compare
// strategies side by side on the same batch and the same tensors.
//
// Terms. Each rank makes its own user-layout slice of Q, K, V and dO from (seed, rank). A
// *repeat* is one forward and one backward pass; the time of a pass is the slowest rank's.
// Repeats of the strategies alternate, so that the machine's slow spells hit each alike.
// *Kernel time* is time inside attention kernels; η = wall time / the busiest rank's kernel
// time. *Ideal* = the batch's useful FLOPs / ranks / the kernel's FLOP/s measured in the same
// run (all ranks' FLOPs over all ranks' kernel time).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "commands.h"
#include "common.h"
#include "fcp/api/attention.h"
#include "fcp/api/ulysses.h"
#include "fcp/baselines/baselines.h"
#include "fcp/core/config.h"
#include "fcp/core/cost_model.h"
#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/random.h"
#include "fcp/core/statistics.h"
#include "fcp/core/units.h"
#include "fcp/core/workload.h"
#include "fcp/kernels/attention.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/distributor.h"
#include "fcp/plan/plan.h"
#include "fcp/runtime/executor.h"
#include "fcp/runtime/mpi_transport.h"
#include "fcp/runtime/reference.h"
#include "fcp/runtime/throttle.h"
#include "fcp/sim/hardware.h"

namespace fcp::app {
namespace {

constexpr int kGatherTag = 5;
static_assert(kMaxThreads == runtime::kMaxKernelThreads, "--threads and the runtime agree");

/// Tokens per rank of a sampled workload unless --tokens-per-worker says otherwise.
constexpr const char* kDefaultTokensPerWorker = "8K";
/// --check's default tolerance per storage type. fp32 runs land at 3.8e-7 to 4.5e-7 and bf16
/// runs at 2.4e-3 to 2.6e-3 (mpi.api_*_ranks, docs/runtime.md): bf16's own rounding of the
/// outputs, 2^-9 relative, so 1e-5 would fail every bf16 run; 1e-2 leaves 4x over the worst
/// seen, as the library's bf16 tests allow.
constexpr double kFp32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;
/// Largest --tolerance.
constexpr double kMaxTolerance = 1e6;
/// How much longer than --timeout the ranks wait for rank 0 to write --timeline (before the
/// verdict they share).
constexpr double kTimelineSeconds = 60;

struct RunArgs {
  std::string workload = "lognormal";
  std::string curve;
  std::string trace;
  std::string tokensPerWorker;  // default kDefaultTokensPerWorker, the trace's share for traces
  std::string blockSize = "2K";
  std::string memoryLimit;
  // As `fcp plan`. (The default 2-rank batch, 9 blocks of up to 2K under a 9011-token cap,
  // needs the distributor's memory repair at this slack.)
  double memorySlack = 0.1;
  uint64_t seed = 0;
  int64_t minSequences = 1;
  std::string mask = "causal";
  // CPU-sized model (README): 2·B·(Hq/Hkv)/bytes = 2·2048·8/4 = 8192 FLOP per KV byte, above
  // GPU-X's 5920; the head size does not change that ratio, and 64 keeps a run near a minute.
  int64_t headsQ = 8;
  int64_t headsKv = 1;
  int64_t headDim = 64;
  std::string dtype = "fp32";
  std::string layout = "transparent";
  int64_t coalesce = 16;
  int64_t buffers = 3;
  std::string strategies = "fcp,ring";
  int64_t ulyssesDegree = 0;  // ranks per node of fcp+ulysses; 0: not given (2)
  int64_t warmup = 1;
  int64_t repeats = 3;
  int64_t threads = 1;
  double commRatio = 0;
  bool check = false;
  double tolerance = 0;  // 0: not given, by --dtype (kFp32Tolerance, kBf16Tolerance)
  bool json = false;
  std::string timeline;
  double timeoutSeconds = 60;
};

std::vector<std::string> splitStrategies(const std::string& text) {
  std::vector<std::string> out;
  // Split by hand, as fcp simulate does: std::getline would drop a trailing empty item
  // ("fcp,"), which must be refused like any unknown name.
  size_t begin = 0;
  for (;;) {
    const size_t comma = text.find(',', begin);
    const std::string item = text.substr(begin, comma == std::string::npos ? comma : comma - begin);
    const auto& names = baselines::strategyNames();
    const bool ablation = item == "fcp-base" || item == "fcp-pipeline" || item == "fcp-cfree" ||
                          item == "fcp-coalesce";
    const auto& heads = baselines::headParallelNames();
    if (item != "fcp+ulysses" && std::find(heads.begin(), heads.end(), item) != heads.end()) {
      // They move heads, not KV blocks: no plan of theirs exists for the executor to run.
      throwInvalidArgument("--strategy ", item,
                           " is simulated only (fcp simulate): expected fcp, ring, bytescale, wlb, "
                           "magi, megatron, fcp+ulysses, fcp-base, fcp-pipeline, fcp-cfree or "
                           "fcp-coalesce");
    }
    if (!ablation && item != "fcp+ulysses" &&
        std::find(names.begin(), names.end(), item) == names.end()) {
      throwInvalidArgument(
          "unknown --strategy '", item,
          "': expected fcp, ring, bytescale, wlb, magi, megatron, fcp+ulysses, "
          "fcp-base, fcp-pipeline, fcp-cfree, fcp-coalesce or a list like fcp,ring");
    }
    out.push_back(item);
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return out;
}

/// Everything checked before MPI starts, so bad input fails like `fcp plan`: one line.
struct Setup {
  Batch batch;
  Workload workload;  ///< without a trace: what the batch is drawn from
  plan::PlanConfig config;  // numWorkers and tokensPerWorker set once the rank count is known
  EfficiencyCurve forward = EfficiencyCurve::paperDefault(),
                  backward = EfficiencyCurve::paperDefault();
  std::vector<std::string> strategies;
  std::string source;
  DType dtype = DType::kFp32;
  Layout layout = Layout::kTransparent;
  double tolerance = kFp32Tolerance;  ///< --check's: --tolerance, or by dtype
  /// --tokens-per-worker, or kDefaultTokensPerWorker for a workload; 0: a trace's share.
  int64_t tokensPerWorker = 0;
  bool ulysses = false;  ///< fcp+ulysses is among the strategies
};

Setup validate(const RunArgs& a) {
  Setup s;
  s.strategies = splitStrategies(a.strategies);
  if (!a.curve.empty()) std::tie(s.forward, s.backward) = sim::loadEfficiencyCurves(a.curve);
  if (a.dtype != "fp32" && a.dtype != "bf16") {
    throwInvalidArgument("unknown --dtype '", a.dtype, "': expected fp32 or bf16");
  }
  s.dtype = a.dtype == "bf16" ? DType::kBf16 : DType::kFp32;
  if (a.layout != "transparent" && a.layout != "dispatched") {
    throwInvalidArgument("unknown --layout '", a.layout, "': expected transparent or dispatched");
  }
  s.layout = a.layout == "dispatched" ? Layout::kDispatched : Layout::kTransparent;
  s.ulysses =
      std::find(s.strategies.begin(), s.strategies.end(), "fcp+ulysses") != s.strategies.end();
  if (a.ulyssesDegree != 0 && !s.ulysses) {
    throwInvalidArgument("--ulysses-degree ", a.ulyssesDegree,
                         " without fcp+ulysses in --strategy: expected it with fcp+ulysses");
  }
  if (s.ulysses && s.layout == Layout::kDispatched) {
    throwInvalidArgument(
        "--strategy fcp+ulysses with --layout dispatched: expected the transparent "
        "layout (each rank keeps its own rows; a dispatched layout is the node's)");
  }
  for (auto [value, flag] : {std::pair{a.headsQ, "--heads-q"},
                             {a.headsKv, "--heads-kv"},
                             {a.headDim, "--head-dim"},
                             {a.repeats, "--repeats"},
                             {a.threads, "--threads"},
                             {a.coalesce, "--coalesce"}}) {
    if (value <= 0)
      throwInvalidArgument("invalid ", flag, " ", value, ": expected a positive integer");
  }
  if (a.warmup < 0) throwInvalidArgument("invalid --warmup ", a.warmup, ": expected 0 or more");
  if (a.buffers < 2) throwInvalidArgument("invalid --buffers ", a.buffers, ": expected at least 2");
  if (!(a.commRatio >= 0))
    throwInvalidArgument("invalid --comm-ratio ", a.commRatio, ": expected FLOP per byte >= 0");
  if (a.tolerance > 0 && !a.check) {
    throwInvalidArgument(
        "--tolerance ", a.tolerance,
        " without --check: expected --check too (the tolerance is what it accepts)");
  }
  s.tolerance = a.tolerance > 0           ? a.tolerance
                : s.dtype == DType::kBf16 ? kBf16Tolerance
                                          : kFp32Tolerance;
  auto& c = s.config;
  c.blockSize = parseBlockSize(a.blockSize);
  c.memorySlack = a.memorySlack;
  c.coalesce = a.coalesce;
  c.bufferDepth = a.buffers;
  c.attention = {a.headsQ, a.headsKv, a.headDim, s.dtype == DType::kBf16 ? 2 : 4,
                 parseMask(a.mask)};
  checkAttentionConfig(c.attention);
  c.memoryLimitTokens =
      a.memoryLimit.empty() ? 0 : parseTokenCount(a.memoryLimit, "--memory-limit");
  if (!a.trace.empty()) {
    s.batch = readTrace(a.trace);
    s.source = "trace " + a.trace;
  } else {
    s.workload = loadWorkload(a.workload);
    s.source = describeDraw(a.workload, a.seed, a.minSequences);
  }
  // As fcp plan: a trace's share unless given, and a bad value refused with or without a trace.
  if (a.trace.empty() || !a.tokensPerWorker.empty()) {
    s.tokensPerWorker =
        parseTokenCount(a.tokensPerWorker.empty() ? kDefaultTokensPerWorker : a.tokensPerWorker,
                        "--tokens-per-worker");
  }
  return s;
}

/// This rank's user-layout tensors, seeded by (seed, rank).
struct Tensors {
  std::vector<float> q, k, v, dO;
};

/// With bf16 storage the values are bf16-rounded, so that the float64 reference sees exactly
/// the inputs the run does.
Tensors makeInputs(uint64_t seed, int rank, int64_t tokens, const AttentionConfig& a) {
  Rng rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank) + 1);
  Tensors t;
  const bool bf16 = a.elementBytes == 2;
  auto fill = [&rng, bf16](std::vector<float>& x, int64_t n) {
    x.resize(static_cast<size_t>(n));
    for (float& value : x) {
      value = static_cast<float>(rng.normal());
      if (bf16) value = kernels::fromBf16(kernels::toBf16(value));
    }
  };
  fill(t.q, tokens * a.numHeadsQ * a.headDim);
  fill(t.k, tokens * a.numHeadsKv * a.headDim);
  fill(t.v, tokens * a.numHeadsKv * a.headDim);
  fill(t.dO, tokens * a.numHeadsQ * a.headDim);
  return t;
}

/// One fp32 block of min(blockSize, 2K) tokens with random inputs, and the buffers a forward
/// and backward over it write: what the two rate probes below time.
struct ProbeBlock {
  int64_t tokens;
  int h, hk, d;
  Tensors in;
  std::vector<float> o, lse, delta, dq, dk, dv;
  kernels::Segment seg;

  ProbeBlock(const AttentionConfig& a, int64_t blockSize, uint64_t seed)
      : tokens(std::min<int64_t>(blockSize, 2048)),
        h(static_cast<int>(a.numHeadsQ)),
        hk(static_cast<int>(a.numHeadsKv)),
        d(static_cast<int>(a.headDim)),
        seg{tokens, 0, 0} {
    AttentionConfig fp32 = a;
    fp32.elementBytes = 4;
    in = makeInputs(seed, 0, tokens, fp32);
    const auto rows = static_cast<size_t>(tokens * a.numHeadsQ);
    for (auto* x : {&o, &dq}) x->resize(in.q.size());
    for (auto* x : {&lse, &delta}) x->resize(rows);
    dk.resize(in.k.size());
    dv.resize(in.v.size());
  }
  kernels::BlockMask mask(kernels::MaskKind kind) const { return {kind, {&seg, 1}, {&seg, 1}}; }
  kernels::TensorView q() const { return {in.q.data(), tokens, h, d}; }
  kernels::TensorView k() const { return {in.k.data(), tokens, hk, d}; }
  kernels::TensorView v() const { return {in.v.data(), tokens, hk, d}; }
  kernels::TensorView dO() const { return {in.dO.data(), tokens, h, d}; }
};

/// The least of three timings of `run`, in seconds.
template <typename Run>
double fastestOfThree(Run&& run) {
  double least = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    const double start = runtime::Timeline::nowUs();
    run();
    least = std::min(least, (runtime::Timeline::nowUs() - start) / 1e6);
  }
  return least;
}

/// Forward FLOP/s of this rank's kernel on one full-mask block pair, the best of three.
double measureKernelFlops(const AttentionConfig& a, int64_t blockSize, int threads) {
  ProbeBlock p(a, blockSize, 12345);
  const kernels::BlockMask mask = p.mask(kernels::MaskKind::kFull);
  const double seconds = fastestOfThree([&] {
    kernels::forward(p.q(), p.k(), p.v(), mask, p.o.data(), p.lse.data(), {threads});
  });
  return 4.0 * static_cast<double>(p.tokens * p.tokens) *
         static_cast<double>(a.numHeadsQ * a.headDim) / seconds;
}

/// The planner's cost units this rank's kernels get through per second of a training step: one
/// causal block of min(blockSize, 2K) tokens, forward and backward, fp32, best of 3. A pair's
/// cost is its forward's FLOPs at the kernels' peak (blockPairs; the backward is proportional),
/// so the block's forward cost is divided by the time of both passes. With the link's bytes per
/// second it gives the ratio the planner weighs bytes against compute by
/// (PlanConfig::commRatio), in the units of the model it plans with, whatever curve that is.
double measureCostRate(const AttentionConfig& a, const CostModel& costModel, int64_t blockSize,
                       int threads) {
  ProbeBlock p(a, blockSize, 54321);
  const kernels::BlockMask mask = p.mask(kernels::MaskKind::kCausal);
  const double cost = costModel.forwardCost(kernels::countVisiblePairs(mask), p.tokens);
  const double seconds = fastestOfThree([&] {
    kernels::forward(p.q(), p.k(), p.v(), mask, p.o.data(), p.lse.data(), {threads});
    kernels::computeDelta({p.o.data(), p.tokens, p.h, p.d}, p.dO(), p.delta.data());
    kernels::backward(p.q(), p.k(), p.v(), p.dO(), p.lse.data(), p.delta.data(), mask,
                      p.dq.data(), p.dk.data(), p.dv.data(), {threads});
  });
  return cost / seconds;
}

/// Largest value over ranks, for doubles stored as integer nanoseconds / units.
double maxOverRanks(runtime::Transport& t, double value, double unit) {
  int64_t v = std::llround(value / unit);
  t.allreduce({&v, 1}, runtime::ReduceOp::kMax);
  return static_cast<double>(v) * unit;
}
/// Returns once every rank has called it (an allreduce; its waits back off to 1 ms, so ranks
/// leave within about a millisecond of each other).
void barrier(runtime::Transport& t) {
  int64_t token = 0;
  t.allreduce({&token, 1}, runtime::ReduceOp::kMax);
}
double sumOverRanks(runtime::Transport& t, double value, double unit) {
  int64_t v = std::llround(value / unit);
  t.allreduce({&v, 1}, runtime::ReduceOp::kSum);
  return static_cast<double>(v) * unit;
}

/// Bytes per second one rank moves to the next and from the previous at once (64 MB each way,
/// best of three, the slowest rank's), the uncapped link of the bound; 0 on one rank.
double measureLinkBandwidth(runtime::Transport& t) {
  if (t.size() < 2) return 0;
  const int next = (t.rank() + 1) % t.size(), prev = (t.rank() + t.size() - 1) % t.size();
  std::vector<std::byte> out(64 << 20), in(out.size());
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    barrier(t);
    const double start = runtime::Timeline::nowUs();
    const runtime::RequestId requests[2] = {t.irecv(prev, kGatherTag, in),
                                            t.isend(next, kGatherTag, out)};
    runtime::waitAll(t, requests);
    best = std::max(best,
                    static_cast<double>(out.size()) / ((runtime::Timeline::nowUs() - start) / 1e6));
  }
  int64_t rate = std::llround(best);
  t.allreduce({&rate, 1}, runtime::ReduceOp::kMin);
  return static_cast<double>(rate);
}

struct StrategyResult {
  std::string strategy;
  double fwdMs = 0, bwdMs = 0, eta = 0, gflopsPerRank = 0, idealMs = 0, kernelGflops = 0;
  int64_t commBytes = 0, kvBytes = 0;
  /// The physical bound of each pass, summed: max(busiest rank's kernel time, busiest rank's
  /// bytes sent or received / link bandwidth), and the busiest rank's bytes (both passes).
  double boundMs = 0;
  int64_t maxRankBytes = 0;
  bool checked = false;
  double errOut = 0, errDq = 0, errDk = 0, errDv = 0;
};

/// One strategy's plan, executors, outputs and measurements. The strategies' repeats are
/// interleaved (fcp, ring, fcp, ring, ...) so that a slow spell of this shared machine hits
/// both alike.
struct StrategyRun {
  std::string strategy;
  std::unique_ptr<AttentionBatch> batch, traced;
  AttentionLayer layer;
  /// fcp+ulysses: the node's members and the layer that exchanges heads inside it (batch is
  /// then the batch across the nodes; no traced one).
  std::unique_ptr<UlyssesGroup> group;
  UlyssesLayer ulysses;
  /// The tensors the attention calls take, in the run's dtype and the batch's call layout
  /// (dispatched: moved into FCP's layout once, as a training step would).
  std::vector<std::byte> q, k, v, dO, o, dq, dk, dv;
  /// This rank's outputs in the user layout, fp32, for --check.
  std::vector<float> userO, userDq, userDk, userDv;
  std::vector<double> fwd, bwd;
  double flops = 0;
  int64_t sent = 0, kv = 0;
  // Per pass (forward, backward): this rank's kernel time in each measured repeat, and its
  // bytes summed over them.
  std::vector<double> passKernelMs[2];
  double passBytes[2] = {0, 0};  // max(sent, received)
  /// fcp+ulysses: the same over the link between nodes only (the batch's own bytes), which is
  /// what --comm-ratio caps; the node's exchanges run uncapped.
  double passAcrossBytes[2] = {0, 0};
};

/// The FLOPs of the float64 reference (forward and backward) of `batch`: how long rank 0 may
/// keep the other ranks waiting for the check's verdict.
double referenceFlops(const Batch& batch, const AttentionConfig& att) {
  double flops = 0;
  for (const int64_t length : batch.sequenceLengths) {
    const int64_t visible = visibleEntries(att.mask, 0, length, 0, length);
    flops += forwardFlops(att, visible) + backwardFlops(att, visible);
  }
  return flops;
}

// A memory budget from the flags that no plan can hold the batch under, named by the flag that
// set it (the library's own message names its options), on every rank alike.
void checkBudget(int64_t tokens, const plan::PlanConfig& c, const RunArgs& a, int ranks) {
  if (c.memoryLimitTokens == 0) return;
  const plan::DistributorOptions o = plan::distributorOptions(c);
  if (plan::safeBlockTokens(tokens, o) > 0) return;
  const std::string flag = a.memoryLimit.empty()
                               ? "--tokens-per-worker " + a.tokensPerWorker + " sets with --trace"
                               : "--memory-limit " + a.memoryLimit + " sets";
  throwInvalidArgument("memory cap cannot hold the batch: ", tokens, " tokens > ", ranks,
                       ranks == 1 ? " rank x " : " ranks x ", plan::memoryCapTokens(o),
                       " tokens (the budget ", flag, ", and --memory-slack ", c.memorySlack,
                       "): expected a larger budget or slack, or more ranks");
}

/// Refuses, in one line that every rank prints alike, a batch `fcp run` could not finish in
/// bounded time and memory: its attention FLOPs per rank (forward and backward of every warm-up
/// and timed repeat of every strategy) past kMaxRunFlopsPerRank, or its tensors per rank past
/// kMaxRunBytesPerRank. A 600K-token sequence on 2 ranks needs ~10 PFLOP: days on a CPU.
void checkRunSize(const Setup& s, const RunArgs& a, int ranks) {
  const auto& att = s.config.attention;
  const double passes = static_cast<double>(s.strategies.size()) *
                        static_cast<double>(a.warmup + a.repeats);
  const double flops = passes * referenceFlops(s.batch, att) / ranks;
  if (flops > kMaxRunFlopsPerRank) {
    throwInvalidArgument(
        "the batch needs about ", std::llround(flops / 1e12), " TFLOP of attention per rank (",
        s.strategies.size(), " strategies x ", a.warmup + a.repeats,
        " forward and backward passes; ~", std::llround(flops / 20e9 / 3600),
        " hours at 20 GFLOP/s): expected at most ", kMaxRunFlopsPerRank / 1e12,
        " TFLOP; use shorter sequences, more ranks or fewer --repeats");
  }
  // Per token, fp32 q, k, v, dO (inputs), each strategy's eight call tensors and the runtime's
  // buffers of about as many: a rough upper bound of what a rank holds.
  const int64_t tokens = (s.batch.numTokens() + ranks - 1) / ranks;
  const double rowBytes = 4.0 * static_cast<double>(2 * att.qBytesPerToken() / att.elementBytes +
                                                    2 * att.kBytesPerToken() / att.elementBytes);
  const double bytes = static_cast<double>(tokens) * rowBytes *
                       (1.0 + 4.0 * static_cast<double>(s.strategies.size()));
  if (bytes > kMaxRunBytesPerRank) {
    throwInvalidArgument("the batch needs about ", std::llround(bytes / (1 << 20)),
                         " MiB of tensors per rank (", tokens, " tokens per rank): expected at most ",
                         std::llround(kMaxRunBytesPerRank / (1 << 20)),
                         " MiB; use fewer tokens, more ranks, fewer heads or a smaller head dim");
  }
}

/// Rank 0 gathers every rank's outputs of every strategy first (so no rank waits on a message
/// while it computes), then computes the float64 reference once and compares each strategy
/// with it. The other ranks only send. Errors land in `results` on rank 0.
void checkAgainstReference(runtime::Transport& t, const Setup& s, const RunArgs& a,
                           const std::vector<std::unique_ptr<StrategyRun>>& runs,
                           std::vector<StrategyResult>& results) {
  const auto& att = s.config.attention;
  const int64_t qRow = att.numHeadsQ * att.headDim, kRow = att.numHeadsKv * att.headDim;
  const std::vector<int64_t> userStart = plan::userLayoutStarts(s.batch.numTokens(), t.size());
  struct Outputs {
    std::vector<float> o, dq, dk, dv;
  };
  std::vector<Outputs> got;  // per strategy, the whole batch's (on rank 0)
  for (const auto& run : runs) {
    auto gather = [&](const std::vector<float>& mine, int64_t width) {
      return runtime::gatherToRoot(t, mine, userStart, width, kGatherTag);
    };
    got.push_back({gather(run->userO, qRow), gather(run->userDq, qRow), gather(run->userDk, kRow),
                   gather(run->userDv, kRow)});
  }
  if (t.rank() != 0) return;
  Tensors all;
  for (int rank = 0; rank < t.size(); ++rank) {
    const Tensors in = makeInputs(
        a.seed, rank,
        userStart[static_cast<size_t>(rank) + 1] - userStart[static_cast<size_t>(rank)], att);
    for (auto [dst, src] :
         {std::pair{&all.q, &in.q}, {&all.k, &in.k}, {&all.v, &in.v}, {&all.dO, &in.dO}}) {
      dst->insert(dst->end(), src->begin(), src->end());
    }
  }
  const runtime::ReferenceResult ref =
      runtime::referenceAttention(s.batch, att, all.q, all.k, all.v, all.dO);
  for (size_t i = 0; i < runs.size(); ++i) {
    const runtime::ReferenceErrors e =
        runtime::compareWithReference(ref, got[i].o, got[i].dq, got[i].dk, got[i].dv);
    StrategyResult& r = results[i];
    r.checked = true;
    r.errOut = e.o;
    r.errDq = e.dq;
    r.errDk = e.dk;
    r.errDv = e.dv;
  }
}

/// `values` in the storage type of `dtype`.
std::vector<std::byte> toStorage(const std::vector<float>& values, DType dtype) {
  if (dtype == DType::kFp32) {
    const auto* p = reinterpret_cast<const std::byte*>(values.data());
    return {p, p + values.size() * sizeof(float)};
  }
  std::vector<std::byte> out(values.size() * 2);
  kernels::toBf16(values, {reinterpret_cast<uint16_t*>(out.data()), values.size()});
  return out;
}

std::vector<float> fromStorage(const std::vector<std::byte>& bytes, DType dtype) {
  if (dtype == DType::kFp32) {
    std::vector<float> out(bytes.size() / sizeof(float));
    if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
  std::vector<float> out(bytes.size() / 2);
  kernels::fromBf16({reinterpret_cast<const uint16_t*>(bytes.data()), out.size()}, out);
  return out;
}

BatchOptions batchOptions(const Setup& s, const RunArgs& a, const std::string& strategy, int rank,
                          const std::vector<int64_t>& starts, runtime::Timeline* timeline) {
  BatchOptions o;
  o.cuSeqlens = plan::sequenceStarts(s.batch);
  o.localBegin = starts[static_cast<size_t>(rank)];
  o.localEnd = starts[static_cast<size_t>(rank) + 1];
  const auto& att = s.config.attention;
  o.numHeadsQ = att.numHeadsQ;
  o.numHeadsKv = att.numHeadsKv;
  o.headDim = att.headDim;
  o.mask = att.mask;
  o.dtype = s.dtype;
  o.layout = s.layout;
  o.strategy = strategy;
  o.planConfig = s.config;
  o.costModel = {att, s.forward, s.backward};
  o.numThreads = static_cast<int>(a.threads);
  o.timeline = timeline;
  return o;
}

/// The transports fcp+ulysses runs over: a node's members and the members of one index across
/// the nodes (capped like `data` when --comm-ratio caps it: the link between nodes).
struct UlyssesTransports {
  std::unique_ptr<runtime::Transport> node, across, throttled;
  runtime::Transport& data() { return throttled ? *throttled : *across; }
};

std::unique_ptr<StrategyRun> prepareStrategy(runtime::Transport& net, runtime::Transport& data,
                                             const Setup& s, const RunArgs& a,
                                             const std::string& strategy, const Tensors& in,
                                             const std::vector<int64_t>& starts,
                                             runtime::Timeline* timeline,
                                             UlyssesTransports* nodes) {
  auto run = std::make_unique<StrategyRun>();
  run->strategy = strategy;
  const int rank = net.rank();
  if (strategy == "fcp+ulysses") {
    run->group = std::make_unique<UlyssesGroup>(*nodes->node,
                                                batchOptions(s, a, "fcp", rank, starts, nullptr));
    run->batch = std::make_unique<AttentionBatch>(run->group->batch(nodes->data()));
  } else {
    run->batch =
        std::make_unique<AttentionBatch>(data, batchOptions(s, a, strategy, rank, starts, nullptr));
  }
  // The last repeat runs on a second batch that records the timeline.
  if (timeline && !run->group) {
    run->traced = std::make_unique<AttentionBatch>(
        data, batchOptions(s, a, strategy, rank, starts, timeline));
  }
  AttentionBatch& b = *run->batch;
  const auto& att = s.config.attention;
  const int64_t elem = s.dtype == DType::kBf16 ? 2 : 4;
  const int64_t qRow = att.numHeadsQ * att.headDim * elem,
                kRow = att.numHeadsKv * att.headDim * elem;
  auto place = [&](std::vector<std::byte>& dst, const std::vector<float>& user, int64_t row) {
    std::vector<std::byte> bytes = toStorage(user, s.dtype);
    if (s.layout == Layout::kTransparent) {
      dst = std::move(bytes);
      return;
    }
    dst.resize(static_cast<size_t>(b.numLocalTokens() * row));
    b.dispatch(bytes, dst, row);
  };
  place(run->q, in.q, qRow);
  place(run->k, in.k, kRow);
  place(run->v, in.v, kRow);
  place(run->dO, in.dO, qRow);
  const auto n = static_cast<size_t>(run->group ? run->group->numUserTokens() : b.numCallTokens());
  run->o.resize(n * static_cast<size_t>(qRow));
  run->dq.resize(n * static_cast<size_t>(qRow));
  run->dk.resize(n * static_cast<size_t>(kRow));
  run->dv.resize(n * static_cast<size_t>(kRow));
  return run;
}

/// Copies the run's outputs to the user layout in fp32 (undispatching them if need be).
void collectOutputs(const Setup& s, StrategyRun& run) {
  AttentionBatch& b = *run.batch;
  auto user = [&](const std::vector<std::byte>& call) {
    if (s.layout == Layout::kTransparent) return fromStorage(call, s.dtype);
    const int64_t row =
        static_cast<int64_t>(call.size()) / std::max<int64_t>(1, b.numLocalTokens());
    std::vector<std::byte> out(static_cast<size_t>(b.numUserTokens() * row));
    b.undispatch(call, out, row);
    return fromStorage(out, s.dtype);
  };
  run.userO = user(run.o);
  run.userDq = user(run.dq);
  run.userDk = user(run.dk);
  run.userDv = user(run.dv);
}

void repeatStrategy(runtime::Transport& net, StrategyRun& run, const Setup& s, bool measured,
                    bool last, runtime::Timeline* timeline) {
  AttentionBatch& b = last && run.traced ? *run.traced : *run.batch;
  const auto& att = s.config.attention;
  const int64_t n = run.group ? run.group->numUserTokens() : b.numCallTokens(), hq = att.numHeadsQ,
                hk = att.numHeadsKv, d = att.headDim;
  const DType dt = s.dtype;
  // Each pass starts together on every rank: in a model, other layers run between attention's
  // forward and backward, so one pass's imbalance does not carry into the other's time (the
  // simulator times each pass from a common start, too). The traced span includes the wait.
  barrier(net);
  const double start = runtime::Timeline::nowUs();
  if (run.group) {
    run.ulysses.forward(*run.group, b, {run.q.data(), dt, n, hq, d}, {run.k.data(), dt, n, hk, d},
                        {run.v.data(), dt, n, hk, d}, {run.o.data(), dt, n, hq, d});
  } else {
    run.layer.forward(b, {run.q.data(), dt, n, hq, d}, {run.k.data(), dt, n, hk, d},
                      {run.v.data(), dt, n, hk, d}, {run.o.data(), dt, n, hq, d});
  }
  barrier(net);
  if (run.group) {
    run.ulysses.backward(*run.group, b, {run.dO.data(), dt, n, hq, d},
                         {run.dq.data(), dt, n, hq, d}, {run.dk.data(), dt, n, hk, d},
                         {run.dv.data(), dt, n, hk, d});
  } else {
    run.layer.backward(b, {run.dO.data(), dt, n, hq, d}, {run.dq.data(), dt, n, hq, d},
                       {run.dk.data(), dt, n, hk, d}, {run.dv.data(), dt, n, hk, d});
  }
  if (timeline && last) timeline->add(run.strategy, 2, start, runtime::Timeline::nowUs());
  // fcp+ulysses: the whole call, the node's exchanges included.
  const PassStats& fs = run.group ? run.ulysses.forwardStats() : b.forwardStats();
  const PassStats& bs = run.group ? run.ulysses.backwardStats() : b.backwardStats();
  const double f = maxOverRanks(net, fs.wallMs, 1e-6);
  const double bw = maxOverRanks(net, bs.wallMs, 1e-6);
  if (!measured) return;
  run.fwd.push_back(f);
  run.bwd.push_back(bw);
  for (int pass = 0; pass < 2; ++pass) {
    const PassStats& st = pass == 0 ? fs : bs;
    run.passKernelMs[pass].push_back(st.kernelMs);
    run.passBytes[pass] += static_cast<double>(std::max(st.sentBytes, st.recvBytes));
    const PassStats& own = pass == 0 ? b.forwardStats() : b.backwardStats();
    run.passAcrossBytes[pass] += static_cast<double>(std::max(own.sentBytes, own.recvBytes));
  }
  run.flops = fs.flops + bs.flops;
  run.sent = fs.sentBytes + bs.sentBytes;
  run.kv = fs.kvBytes + bs.kvBytes;
}

StrategyResult summarize(runtime::Transport& net, const RunArgs& a, StrategyRun& run,
                         double linkBytesPerSecond) {
  StrategyResult r;
  r.strategy = run.strategy;
  r.fwdMs = median(run.fwd);
  r.bwdMs = median(run.bwd);
  // Kernel times are medians over the repeats too, pass by pass as the wall times: a mean let
  // one slow repeat put a rank's kernels above the median wall time (η and × bound under 1).
  // Each repeat's wall time is at least every rank's kernel time, so the medians keep that.
  const double passKernelMs[2] = {median(run.passKernelMs[0]), median(run.passKernelMs[1])};
  const double kernelMs = passKernelMs[0] + passKernelMs[1];
  const double busiestKernelMs = maxOverRanks(net, kernelMs, 1e-6);
  const double totalFlops = sumOverRanks(net, run.flops, 1.0);
  const double totalKernelMs = sumOverRanks(net, kernelMs, 1e-6);
  const double ranks = net.size();
  r.eta = busiestKernelMs > 0 ? (r.fwdMs + r.bwdMs) / busiestKernelMs : 0;
  r.gflopsPerRank = totalFlops / ranks / ((r.fwdMs + r.bwdMs) * 1e6);
  r.kernelGflops = totalKernelMs > 0 ? totalFlops / (totalKernelMs * 1e6) : 0;
  r.idealMs = r.kernelGflops > 0 ? totalFlops / ranks / (r.kernelGflops * 1e6) : 0;
  r.commBytes = static_cast<int64_t>(sumOverRanks(net, static_cast<double>(run.sent), 1.0));
  r.kvBytes = static_cast<int64_t>(sumOverRanks(net, static_cast<double>(run.kv), 1.0));
  const auto repeats = static_cast<double>(a.repeats);
  for (int pass = 0; pass < 2; ++pass) {
    const double kernel = maxOverRanks(net, passKernelMs[pass], 1e-6);
    const double bytes = maxOverRanks(net, run.passBytes[pass] / repeats, 1.0);
    // Under a cap, fcp+ulysses's node exchanges are not on the capped link: only its bytes
    // between nodes bound it there.
    const double linkBytes = run.group && a.commRatio > 0
                                 ? maxOverRanks(net, run.passAcrossBytes[pass] / repeats, 1.0)
                                 : bytes;
    r.boundMs +=
        std::max(kernel, linkBytesPerSecond > 0 ? linkBytes / linkBytesPerSecond * 1e3 : 0.0);
    r.maxRankBytes += static_cast<int64_t>(bytes);
  }
  return r;
}

std::string formatNumber(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

void printTable(const std::vector<StrategyResult>& results, const Setup& s, const RunArgs& a,
                int ranks, double capBytesPerSecond) {
  const auto& att = s.config.attention;
  std::printf("fcp run: %s, %lld sequences, %lld tokens on %d ranks x %lld thread(s)\n",
              s.source.c_str(), static_cast<long long>(s.batch.numSequences()),
              static_cast<long long>(s.batch.numTokens()), ranks,
              static_cast<long long>(a.threads));
  std::printf("  model: %lld/%lld heads x %lld, %s, %s mask, %s blocks, %s layout; bandwidth %s\n",
              static_cast<long long>(att.numHeadsQ), static_cast<long long>(att.numHeadsKv),
              static_cast<long long>(att.headDim), a.dtype.c_str(),
              std::string(maskName(att.mask)).c_str(), formatTokenCount(s.config.blockSize).c_str(),
              a.layout.c_str(),
              capBytesPerSecond > 0 ? (std::to_string(capBytesPerSecond / 1e9).substr(0, 6) +
                                       " GB/s per rank (--comm-ratio " + formatNumber(a.commRatio) +
                                       "; FCP plans with a byte worth " +
                                       formatNumber(std::round(s.config.commRatio)) +
                                       " cost units)")
                                          .c_str()
                                    : "uncapped (shared memory)");
  std::printf("  median of %lld repeats after %lld warm-up\n", static_cast<long long>(a.repeats),
              static_cast<long long>(a.warmup));
  std::printf("  %-12s %10s %10s %12s %7s %10s %9s %10s %10s %8s", "strategy", "fwd ms", "bwd ms",
              "GFLOP/s/rank", "eta", "ideal ms", "x ideal", "comm MB", "bound ms", "x bound");
  if (a.check) std::printf(" %9s %9s %9s %9s", "err out", "err dq", "err dk", "err dv");
  std::printf("\n");
  for (const StrategyResult& r : results) {
    std::printf("  %-12s %10.1f %10.1f %12.2f %7.3f %10.1f %9.3f %10.2f %10.1f %8.3f",
                r.strategy.c_str(), r.fwdMs, r.bwdMs, r.gflopsPerRank, r.eta, r.idealMs,
                (r.fwdMs + r.bwdMs) / r.idealMs, static_cast<double>(r.commBytes) / 1e6, r.boundMs,
                r.boundMs > 0 ? (r.fwdMs + r.bwdMs) / r.boundMs : 0.0);
    if (r.checked) std::printf(" %9.2e %9.2e %9.2e %9.2e", r.errOut, r.errDq, r.errDk, r.errDv);
    std::printf("\n");
  }
  if (results.size() == 2) {
    const double t0 = results[0].fwdMs + results[0].bwdMs, t1 = results[1].fwdMs + results[1].bwdMs;
    std::printf("  %s / %s time: fwd %.3f, bwd %.3f, total %.3f\n", results[1].strategy.c_str(),
                results[0].strategy.c_str(), results[1].fwdMs / results[0].fwdMs,
                results[1].bwdMs / results[0].bwdMs, t1 / t0);
  }
}

nlohmann::json toJson(const StrategyResult& r) {
  nlohmann::json j = {{"strategy", r.strategy},
                      {"fwd_ms", r.fwdMs},
                      {"bwd_ms", r.bwdMs},
                      {"gflops_per_rank", r.gflopsPerRank},
                      {"eta", r.eta},
                      {"ideal_ms", r.idealMs},
                      {"kernel_gflops", r.kernelGflops},
                      {"comm_bytes", r.commBytes},
                      {"kv_bytes", r.kvBytes},
                      {"max_rank_bytes", r.maxRankBytes},
                      {"bound_ms", r.boundMs},
                      {"wall_over_bound", r.boundMs > 0 ? (r.fwdMs + r.bwdMs) / r.boundMs : 0}};
  if (r.checked)
    j["rel_error"] = {{"out", r.errOut}, {"dq", r.errDq}, {"dk", r.errDk}, {"dv", r.errDv}};
  return j;
}

/// The launcher ends the surviving ranks with SIGTERM when a peer dies; say so in one line
/// (only async-signal-safe calls here).
char terminatedMessage[128];
void onTerminate(int) {
  const ssize_t ignored = write(STDERR_FILENO, terminatedMessage, std::strlen(terminatedMessage));
  (void)ignored;
  _exit(1);
}

/// Once this rank has printed its error, a launcher's SIGTERM (a peer that exited first) ends
/// it without a second line.
void onTerminateQuietly(int) { _exit(1); }

void runRun(const RunArgs& a) {
  Setup s = validate(a);
  std::unique_ptr<runtime::Transport> net =
      runtime::makeMpiTransport({.timeoutSeconds = a.timeoutSeconds});
  const int ranks = net->size();
  std::snprintf(terminatedMessage, sizeof(terminatedMessage),
                "fcp: error: rank %d: ended by the MPI launcher (another rank exited or failed)\n",
                net->rank());
  std::signal(SIGTERM, onTerminate);
  bool verdictError = false;  // the Error thrown is the verdict every rank shares
  try {
    // Only rank 0 writes --timeline, so only its directory must exist (on a multi-node job the
    // others' may not); checked before the work, and every rank refuses alike.
    if (!a.timeline.empty()) {
      std::string why;
      if (net->rank() == 0) {
        try {
          checkOutputPath(a.timeline, "--timeline file");
          checkNotAnInput(a.timeline, "--timeline file",
                          {{a.trace, "--trace"},
                           {workloadFile(a.workload), "--workload"},
                           {sim::isProfileName(a.curve) ? "" : a.curve, "--curve"}});
        } catch (const Error& e) {
          why = e.what();
        }
      }
      int64_t refused = why.empty() ? 0 : 1;
      net->allreduce({&refused, 1}, runtime::ReduceOp::kMax);
      if (refused) {
        throw Error(
            ErrorCode::kInvalidArgument,
            net->rank() == 0 ? why : "the --timeline file cannot be written: rank 0 says why");
      }
    }
    auto& c = s.config;
    c.numWorkers = ranks;
    if (a.trace.empty()) {
      c.tokensPerWorker = s.tokensPerWorker;
      // As fcp plan's check, with the ranks for its --workers: every rank refuses alike.
      if (c.tokensPerWorker > kMaxBatchTokens / ranks) {
        throwInvalidArgument(ranks, ranks == 1 ? " rank" : " ranks", " x --tokens-per-worker ",
                             c.tokensPerWorker, " passes ", kMaxBatchTokens,
                             " tokens: expected a smaller batch");
      }
      s.batch = sampleBatch(s.workload, ranks * c.tokensPerWorker, a.seed, a.minSequences);
    } else if (s.tokensPerWorker == 0) {
      c.tokensPerWorker = (s.batch.numTokens() + ranks - 1) / ranks;
    } else {
      // As fcp plan --trace: the flag's value is each rank's share, and so the memory budget
      // unless --memory-limit sets one. AttentionBatch plans with the even share of the trace
      // as the budget, so the flag's value reaches the planner as the budget.
      c.tokensPerWorker = s.tokensPerWorker;
      if (c.memoryLimitTokens == 0) c.memoryLimitTokens = c.tokensPerWorker;
    }
    checkBudget(s.batch.numTokens(), c, a, ranks);
    checkRunSize(s, a, ranks);
    double cap = 0;
    std::unique_ptr<runtime::Transport> throttled;
    if (a.commRatio > 0) {
      int64_t flops =
          std::llround(measureKernelFlops(c.attention, c.blockSize, static_cast<int>(a.threads)));
      net->allreduce({&flops, 1}, runtime::ReduceOp::kMin);
      cap = static_cast<double>(flops) / a.commRatio;
      throttled = runtime::makeThrottledTransport(*net, cap, a.timeoutSeconds);
      // FCP's planner is told how many of its cost units one byte over this link is worth
      // (every rank the same, so that every rank makes the same plan).
      const CostModel costModel{c.attention, s.forward, s.backward};
      int64_t costRate = std::llround(
          measureCostRate(c.attention, costModel, c.blockSize, static_cast<int>(a.threads)));
      net->allreduce({&costRate, 1}, runtime::ReduceOp::kMin);
      c.commRatio = std::min(plan::kMaxCommRatio, static_cast<double>(costRate) / cap);
    }
    runtime::Transport& data = throttled ? *throttled : *net;
    const auto starts = plan::userLayoutStarts(s.batch.numTokens(), ranks);
    const int rank = net->rank();
    UlyssesTransports nodes;
    if (s.ulysses) {
      // Every rank refuses alike, before any split.
      const int64_t degree = a.ulyssesDegree != 0 ? a.ulyssesDegree : 2;
      if (ranks % degree != 0 || !splitsHeads(c.attention, degree)) {
        throwInvalidArgument("--strategy fcp+ulysses with --ulysses-degree ", degree, " on ", ranks,
                             ranks == 1 ? " rank" : " ranks", " and ", c.attention.numHeadsQ,
                             " query and ", c.attention.numHeadsKv,
                             " key/value heads: expected a divisor of the ranks that divides the "
                             "query heads and divides or is a multiple of the key/value heads");
      }
      const runtime::MpiOptions mpi{.timeoutSeconds = a.timeoutSeconds};
      const auto d = static_cast<int>(degree);
      nodes.node = runtime::makeMpiSplitTransport(*net, rank / d, rank % d, mpi);
      nodes.across = runtime::makeMpiSplitTransport(*net, rank % d, rank / d, mpi);
      // The link between nodes is the capped one, as NVLink is to a NIC.
      if (cap > 0)
        nodes.throttled = runtime::makeThrottledTransport(*nodes.across, cap, a.timeoutSeconds);
    }
    const Tensors in = makeInputs(
        a.seed, rank, starts[static_cast<size_t>(rank) + 1] - starts[static_cast<size_t>(rank)],
        c.attention);
    runtime::Timeline timeline;
    runtime::Timeline* recorder = a.timeline.empty() ? nullptr : &timeline;
    std::vector<std::unique_ptr<StrategyRun>> runs;
    for (const std::string& strategy : s.strategies) {
      runs.push_back(prepareStrategy(*net, data, s, a, strategy, in, starts, recorder, &nodes));
    }
    for (int64_t i = 0; i < a.warmup + a.repeats; ++i) {
      for (auto& run : runs)
        repeatStrategy(*net, *run, s, i >= a.warmup, i + 1 == a.warmup + a.repeats, recorder);
    }
    if (a.check) {
      for (auto& run : runs) collectOutputs(s, *run);
    }
    std::vector<StrategyResult> results;
    // The link the bound divides bytes by: the cap, or this machine's own rank-to-rank rate.
    const double link = cap > 0 ? cap : measureLinkBandwidth(*net);
    for (auto& run : runs) results.push_back(summarize(*net, a, *run, link));
    std::string trace;
    if (!a.timeline.empty()) trace = runtime::gatherChromeTrace(*net, timeline);
    // Rank 0 judges the check; every rank returns the same verdict. The others wait for it as
    // long as the reference may take at 0.1 GFLOP/s (float64, one core: ~2 on the default
    // batch here, under 0.5 in the AddressSanitizer build on a loaded machine, where 0.5 once
    // timed out), on top of --timeout. A failure inside rank 0's check is not one the
    // others share: it ends the job.
    enum : int64_t { kCheckFailed = 1, kWriteFailed = 2 };
    int64_t failed = 0;  // kCheckFailed | kWriteFailed, set on rank 0 only
    double verdictTimeout = 0;
    if (a.check) {
      try {
        checkAgainstReference(*net, s, a, runs, results);
      } catch (const Error& e) {
        throw Error(ErrorCode::kInternal,
                    "rank " + std::to_string(rank) + "'s reference check failed: " + e.what());
      }
      verdictTimeout = a.timeoutSeconds + referenceFlops(s.batch, c.attention) / 1e8;
      if (rank == 0) {
        for (const auto& r : results) {
          for (double e : {r.errOut, r.errDq, r.errDk, r.errDv}) {
            if (!(e <= s.tolerance)) failed |= kCheckFailed;
          }
        }
      }
    }
    // Rank 0 writes its file before the verdict, and a failure joins the verdict: every rank
    // then ends with its line and exit 1, together. After the verdict the others may have
    // finished already (MPI_Finalize, exit 0), and rank 0, failing alone, would wait for them
    // in the error path's barrier until --timeout.
    std::string writeError;
    if (rank == 0 && !a.timeline.empty()) {
      try {
        writeUserFile(a.timeline, "--timeline file", trace + "\n");
      } catch (const Error& e) {
        writeError = e.what();
        failed |= kWriteFailed;
      }
    }
    // Only rank 0 sets bits, so the largest value is its value.
    // The others wait for rank 0's file too: a large timeline on a busy disk may take longer
    // than --timeout (the verdict's own wait when there is no --check).
    if (!a.timeline.empty())
      verdictTimeout = (verdictTimeout > 0 ? verdictTimeout : a.timeoutSeconds) + kTimelineSeconds;
    net->allreduce({&failed, 1}, runtime::ReduceOp::kMax, verdictTimeout);
    if (rank == 0) {
      if (a.json) {
        for (const auto& r : results) std::cout << toJson(r).dump() << '\n';
      } else {
        printTable(results, s, a, ranks, cap);
      }
      std::cout.flush();
      std::fflush(stdout);
    }
    if (failed) {
      std::ostringstream os;
      if (failed & kCheckFailed) {
        os << "--check: relative L2 error (RMS where the reference is all zeros) above --tolerance "
           << s.tolerance << (a.json ? " (see rel_error in the JSON records)" : " (see the table)");
      }
      if (failed & kWriteFailed) {
        if (failed & kCheckFailed) os << "; and ";
        os << (rank == 0 ? writeError : "the --timeline file was not written: rank 0 says why");
      }
      verdictError = true;
      throw Error(ErrorCode::kInternal, os.str());
    }
  } catch (const Error& e) {
    // Errors every rank meets together (bad batch, plan disagreement, the verdict) end
    // normally; anything else may leave peers waiting, so it ends the whole job.
    const bool shared = verdictError || e.code() == ErrorCode::kInvalidPlan ||
                        e.code() == ErrorCode::kInvalidArgument;
    if (shared) {
      // Every rank prints its line before any exits: the launcher kills the others as soon
      // as one rank exits nonzero, which could cut a slower rank's message.
      printErrorLine("error", e.what());
      std::signal(SIGTERM, onTerminateQuietly);  // a rank exiting first may have us killed
      int64_t barrier = 0;
      net->allreduce({&barrier, 1}, runtime::ReduceOp::kMax);
      net.reset();  // MPI_Finalize
      std::exit(1);
    }
    printErrorLine("error", e.what());
    net->abort(1);
  } catch (const std::exception& e) {
    printErrorLine("internal error", e.what());
    net->abort(1);
  }
}

}  // namespace

void addRunCommand(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Execute plans on MPI ranks (run under mpirun -n P), forward and backward");
  auto* workload = addText(cmd, "--workload", args->workload, kWorkloadHelp);
  auto* trace = addText(cmd, "--trace", args->trace, "File of sequence lengths, one per line");
  workload->excludes(trace);
  addText(cmd, "--tokens-per-worker", args->tokensPerWorker,
          "Tokens per rank, e.g. 8K (default 8K; with --trace, its total / ranks)")
      ->default_str(kDefaultTokensPerWorker);
  addText(cmd, "--block-size", args->blockSize, "Tokens per block");
  addText(cmd, "--memory-limit", args->memoryLimit, "Per-rank memory budget in tokens");
  addNumber(cmd, "--memory-slack", args->memorySlack, 0, 100,
            "Tolerated overshoot of the memory budget");
  addUnsigned(cmd, "--seed", args->seed, std::numeric_limits<uint64_t>::max(),
              "Seed of the batch and of the tensors");
  addInteger(cmd, "--min-sequences", args->minSequences, 1, kMaxBatchTokens,
             "Draw the first batch of the seed's stream with at least this many sequences "
             "(default 1)")
      ->excludes(trace);
  addText(
      cmd, "--curve", args->curve,
      "Kernel efficiency f(B) to plan with: a file from `fcp bench kernel --curve-out`, or a "
      "hardware profile (h100, gpu-x, gpu-y, cpu or a JSON file); default: the paper-shaped GPU "
      "curve");
  addText(cmd, "--mask", args->mask, "causal or full");
  addInteger(cmd, "--heads-q", args->headsQ, 1, kMaxHeads, "Query heads");
  addInteger(cmd, "--heads-kv", args->headsKv, 1, kMaxHeads, "Key/value heads (GQA)");
  addInteger(cmd, "--head-dim", args->headDim, 1, kMaxHeadDim, "Head dimension");
  addText(cmd, "--dtype", args->dtype, "Storage type of the tensors: fp32 or bf16");
  addText(cmd, "--layout", args->layout,
                  "transparent (tensors in the user layout, each call reshuffles) or dispatched "
                  "(tensors moved into FCP's layout once; calls move no tokens)");
  addInteger(cmd, "--coalesce", args->coalesce, 1, plan::kMaxCoalesce,
             "Rounds merged into one stage (FCP)");
  addInteger(cmd, "--buffers", args->buffers, 2, plan::kMaxBufferDepth,
             "Stages of remote KV a rank may hold (FCP, >= 2)");
  addText(cmd, "--strategy", args->strategies,
          "Strategies to run, comma-separated: fcp, ring, bytescale, wlb, magi, megatron, "
          "fcp+ulysses (Ulysses inside nodes of --ulysses-degree ranks, FCP across them; "
          "transparent layout), fcp-base, fcp-pipeline, fcp-cfree, fcp-coalesce");
  addInteger(cmd, "--ulysses-degree", args->ulyssesDegree, 1, kMaxHeads,
             "Ranks per node of fcp+ulysses (default 2): consecutive ranks exchange heads, and "
             "--comm-ratio caps the link between nodes only");
  addInteger(cmd, "--warmup", args->warmup, 0, kMaxRepeats, "Untimed repeats first");
  addInteger(cmd, "--repeats", args->repeats, 1, kMaxRepeats, "Timed forward+backward repeats");
  addInteger(cmd, "--threads", args->threads, 1, kMaxThreads, "Kernel threads per rank");
  addNumber(cmd, "--comm-ratio", args->commRatio, 0, kMaxCommRatio,
            "Cap each rank's bandwidth at kernel FLOP/s / R (FLOP per byte; GPU-X 5920, GPU-Y "
            "2500; 0 = uncapped); FCP's planner is told the capped link's speed in its own cost "
            "units (fcp plan --comm-ratio)");
  cmd->add_flag("--check", args->check,
                "Compare outputs and dQ/dK/dV with a float64 reference computed on rank 0 (the "
                "default batch: minutes)");
  addPositiveNumber(cmd, "--tolerance", args->tolerance, kMaxTolerance,
                    "Largest relative L2 error --check accepts (default 1e-5 with --dtype fp32, "
                    "1e-2 with bf16, whose own rounding gives about 2.5e-3)",
                    "1e-5 (fp32), 1e-2 (bf16)");
  cmd->add_flag("--json", args->json, "Print one JSON object per strategy");
  addText(cmd, "--timeline", args->timeline, "Write a Chrome-trace JSON of the last repeat");
  addPositiveNumber(cmd, "--timeout", args->timeoutSeconds, kMaxTimeoutSeconds,
                    "Seconds a rank waits for a message before failing",
                    formatNumber(args->timeoutSeconds));
  cmd->callback([args] { runRun(*args); });
}

}  // namespace fcp::app
