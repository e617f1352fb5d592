// The library front end: checks what the caller hands in, agrees on the batch across ranks,
// plans it and runs the executor.
#include "fcp/api/attention.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include "fcp/baselines/baselines.h"
#include "fcp/core/error.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/distributor.h"
#include "fcp/plan/json.h"
#include "fcp/plan/limits.h"

namespace fcp {
namespace {

/// The dtype's name; a value outside the enum is named as one, never shown as fp32 (a review
/// saw "q is [450, 4, 16] fp32, expected [450, 4, 16] fp32").
std::string dtypeText(DType dtype) {
  if (dtype == DType::kFp32 || dtype == DType::kBf16) return std::string(kernels::dtypeName(dtype));
  return "dtype " + std::to_string(static_cast<int>(dtype)) + " (not fp32 or bf16)";
}

std::string shapeText(int64_t tokens, int64_t heads, int64_t dim, DType dtype) {
  std::ostringstream text;  // (not string operator+: GCC 12 warns falsely on it, -Wrestrict)
  text << '[' << tokens << ", " << heads << ", " << dim << "] " << dtypeText(dtype);
  return text.str();
}

void checkTensor(const char* name, const void* data, DType dtype, int64_t tokens, int64_t heads,
                 int64_t dim, int64_t wantTokens, int64_t wantHeads, int64_t wantDim,
                 DType wantDtype, const char* rows) {
  if (tokens != wantTokens || heads != wantHeads || dim != wantDim || dtype != wantDtype) {
    throwInvalidArgument(name, " is ", shapeText(tokens, heads, dim, dtype), ", expected ",
                         shapeText(wantTokens, wantHeads, wantDim, wantDtype), " (", rows, ")");
  }
  if (data == nullptr && wantTokens * wantHeads * wantDim > 0) {
    throwInvalidArgument(name, " has no data, expected ",
                         shapeText(wantTokens, wantHeads, wantDim, wantDtype));
  }
}

void checkTensor(const char* name, ConstTensorRef t, int64_t tokens, int64_t heads, int64_t dim,
                 DType dtype, const char* rows) {
  checkTensor(name, t.data, t.dtype, t.numTokens, t.numHeads, t.headDim, tokens, heads, dim, dtype,
              rows);
  // The stride's bytes must step to the last row within int64.
  const int64_t most = std::numeric_limits<int64_t>::max() / kernels::dtypeBytes(dtype) /
                       std::max<int64_t>(tokens, 1);
  if (t.rowStride != 0 && (t.rowStride < heads * dim || t.rowStride > most)) {
    throwInvalidArgument(name, " has a row stride of ", t.rowStride, " elements: expected 0 (rows ",
                         "back to back) or from ", heads * dim, " (heads × head_dim) to ", most);
  }
}

// The stride of t's rows in bytes (0: back to back).
int64_t strideBytes(ConstTensorRef t) { return t.rowStride * kernels::dtypeBytes(t.dtype); }

// The bytes from the first of t's `rows` rows of `rowBytes` to the end of its last (checked).
size_t extentBytes(ConstTensorRef t, int64_t rows, int64_t rowBytes) {
  return static_cast<size_t>(runtime::rowsExtentBytes(rows, rowBytes, strideBytes(t)));
}

const char* rowsText(Layout layout) {
  return layout == Layout::kDispatched ? "this rank's tokens in FCP's layout"
                                       : "this rank's tokens in the caller's layout";
}

// The batch's sequence lengths from cu_seqlens, checked: its sequences of at least one token
// (FlashAttention's varlen convention allows empty ones, as padding to a fixed count). Errors
// number sequences as cu_seqlens does.
Batch batchOf(const std::vector<int64_t>& cu) {
  if (cu.size() < 2) {
    throwInvalidArgument("cu_seqlens has ", cu.size(),
                         " entries: expected at least 2 (0 and the end of one sequence)");
  }
  if (cu.size() - 1 > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throwInvalidArgument("cu_seqlens has ", cu.size(), " entries: expected at most ",
                         std::numeric_limits<int32_t>::max(), " sequences");
  }
  if (cu.front() != 0) throwInvalidArgument("cu_seqlens[0] is ", cu.front(), ": expected 0");
  Batch batch;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s + 1] < cu[s]) {
      throwInvalidArgument("cu_seqlens[", s + 1, "] is ", cu[s + 1],
                           ": expected at least cu_seqlens[", s, "] = ", cu[s],
                           " (offsets never decrease)");
    }
    const int64_t length = cu[s + 1] - cu[s];  // cu[s] >= 0: no overflow
    if (length > kMaxSequenceLength) {
      throwInvalidArgument("sequence ", s, " has length ", length, ": expected at most ",
                           kMaxSequenceLength, " tokens (int64 FLOP arithmetic)");
    }
    if (cu[s + 1] > kMaxBatchTokens) {
      throwInvalidArgument("cu_seqlens[", s + 1, "] is ", cu[s + 1], ": expected at most ",
                           kMaxBatchTokens, " tokens in all (int64 FLOP arithmetic)");
    }
    if (length > 0) batch.sequenceLengths.push_back(length);
  }
  if (batch.sequenceLengths.empty()) {
    throwInvalidArgument("cu_seqlens ends at 0: expected a batch of at least one token");
  }
  checkBatch(batch);
  return batch;
}

/// For each sequence of the plan (cu_seqlens' sequences of at least one token, in order), its
/// index in cu_seqlens; empty when every sequence has a token (the numberings are the same).
/// For cu_seqlens that batchOf accepted.
std::vector<int32_t> userSequenceIds(const std::vector<int64_t>& cu) {
  std::vector<int32_t> ids;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    if (cu[s + 1] > cu[s]) ids.push_back(static_cast<int32_t>(s));
  }
  if (ids.size() + 1 == cu.size()) ids.clear();
  return ids;
}

/// Whether the kernels can take softmax scale `scale` (0: the default 1/sqrt(head dim)) as the
/// fp32 they compute with. The agreement refuses any other, on every rank alike; until then it
/// is never cast (that would be undefined).
bool scaleFitsFp32(double scale) {
  return scale == 0 ||
         (scale >= std::numeric_limits<float>::min() && scale <= std::numeric_limits<float>::max());
}

// FNV-1a of everything every rank must pass alike (the batch, the model, the planner's
// settings), so that ranks that differ fail together before planning.
class OptionsHash {
 public:
  void add(int64_t x) {
    for (int i = 0; i < 8; ++i) {
      hash_ ^= static_cast<uint64_t>(x >> (8 * i)) & 0xff;
      hash_ *= 1099511628211ull;
    }
  }
  void add(double x) {
    int64_t bits = 0;
    std::memcpy(&bits, &x, sizeof bits);
    add(bits);
  }
  int64_t value() const { return static_cast<int64_t>(hash_ >> 1); }

 private:
  uint64_t hash_ = 14695981039346656037ull;
};

/// What every rank must pass alike, one hash per setting (named in kSettingNames), so that
/// ranks that differ fail together before planning, with the settings that differ named.
constexpr std::array<const char*, 11> kSettingNames = {
    "cu_seqlens", "heads",     "head dim",     "mask",
    "dtype",      "layout",    "strategy",     "block size or other planner settings",
    "cost model", "first tag", "softmax scale"};
constexpr size_t kSettings = kSettingNames.size();

std::array<int64_t, kSettings> hashSettings(const BatchOptions& o) {
  std::array<OptionsHash, kSettings> h;
  h[0].add(static_cast<int64_t>(o.cuSeqlens.size()));
  for (const int64_t x : o.cuSeqlens) h[0].add(x);
  h[1].add(o.numHeadsQ);
  h[1].add(o.numHeadsKv);
  h[2].add(o.headDim);
  h[3].add(static_cast<int64_t>(o.mask));
  h[4].add(static_cast<int64_t>(o.dtype));
  h[5].add(static_cast<int64_t>(o.layout));
  h[6].add(static_cast<int64_t>(o.strategy.size()));
  for (const char c : o.strategy) h[6].add(int64_t{c});
  const plan::PlanConfig& c = o.planConfig;
  for (const int64_t x :
       {c.blockSize, c.memoryLimitTokens, c.coalesce, c.bufferDepth, c.improveStepsPerBlock,
        int64_t{c.locality}, int64_t{c.costAwareBlocks}, static_cast<int64_t>(c.placement)}) {
    h[7].add(x);
  }
  for (const double x : {c.memorySlack, c.alpha, c.beta, c.improveTarget, c.commBalanceSlack,
                         c.localitySlack, c.commRatio})
    h[7].add(x);
  for (const EfficiencyCurve* curve : {&o.costModel.forward, &o.costModel.backward}) {
    h[8].add(static_cast<int64_t>(curve->points().size()));
    for (const auto& [tokens, fraction] : curve->points()) {
      h[8].add(tokens);
      h[8].add(fraction);
    }
  }
  h[9].add(int64_t{o.firstTag});
  // The scale the kernels will use, as they compute it (kernels::softmaxScaleOf, in fp32): 0 (the
  // default) and the same value given outright are one setting; 1/sqrt(96) in double is not the
  // kernels' (it rounds to another float), so it stays another. A value fp32 cannot hold (the
  // agreement refuses it below) is hashed as given.
  if (scaleFitsFp32(o.softmaxScale) && o.headDim > 0 &&
      o.headDim <= std::numeric_limits<int>::max()) {
    h[10].add(static_cast<double>(kernels::softmaxScaleOf(
        {.softmaxScale = static_cast<float>(o.softmaxScale)}, static_cast<int>(o.headDim))));
  } else {
    h[10].add(o.softmaxScale + 0.0);  // -0 is 0
  }
  std::array<int64_t, kSettings> out;
  for (size_t i = 0; i < kSettings; ++i) out[i] = h[i].value();
  return out;
}

/// How long past twice the transport's timeout the agreement after a failed call waits: the
/// others' wait in that call, then their withdrawing of its messages (MPI: at most 1 s).
constexpr double kAfterFailureSeconds = 5;

/// What every rank has agreed on before planning: the inputs of the planning itself, which
/// talks to no other rank.
struct Agreed {
  Batch batch;
  plan::PlanConfig config;
  CostModel costModel;
  std::string strategy;
  bool budgetSet = false;  ///< the caller set planConfig.memoryLimitTokens
};

/// The collective part before planning: every rank learns the same facts (two allreduces), and
/// a bad input fails on every rank alike.
Agreed agree(runtime::Transport& transport, const BatchOptions& o) {
  const int ranks = transport.size(), rank = transport.rank();
  // Two collectives before any check, so that every rank learns the same facts and a bad
  // input fails on every rank alike (a rank that threw alone would leave the others waiting).
  const std::array<int64_t, kSettings> hashes = hashSettings(o);
  // Each hash and its negation (max and -min at once), then the lowest rank whose binding
  // refused its arguments and the lowest whose thread count is out of range (each as ranks -
  // rank; 0 for none). The thread count may differ between ranks, but one rank refusing its
  // own alone would leave the others waiting.
  const bool threadsValid = o.numThreads >= 1 && o.numThreads <= runtime::kMaxKernelThreads;
  std::array<int64_t, 2 * kSettings + 2> same;
  for (size_t i = 0; i < kSettings; ++i) {
    same[i] = hashes[i];
    same[kSettings + i] = -hashes[i];
  }
  same[2 * kSettings] = o.localError.empty() ? 0 : ranks - rank;
  same[2 * kSettings + 1] = threadsValid ? 0 : ranks - rank;
  // After a call of an earlier batch threw here, the other ranks may still be inside that call,
  // waiting out their timeout for this rank's messages (a tensor of the wrong shape here): wait
  // for them, so that every rank hears the plan agreement's verdict on that call
  // (checkPlanAgreement) rather than a timeout of its own, which it met just before the others
  // arrived (a review: both ranks timed out, 41 s for a 20 s timeout).
  transport.allreduce(
      same, runtime::ReduceOp::kMax,
      transport.calls().state().kind != 0 ? detail::afterFailureSeconds(transport) : 0);
  std::vector<int64_t> ranges(2 * static_cast<size_t>(ranks), 0);
  ranges[2 * static_cast<size_t>(rank)] = o.localBegin;
  ranges[2 * static_cast<size_t>(rank) + 1] = o.localEnd;
  transport.allreduce(ranges, runtime::ReduceOp::kSum);
  if (!o.localError.empty()) throw Error(ErrorCode::kInvalidArgument, o.localError);
  if (same[2 * kSettings] > 0) {
    throwInvalidArgument("rank ", rank, ": rank ", ranks - same[2 * kSettings],
                         "'s arguments were refused there (its own error says why): expected "
                         "valid arguments on every rank");
  }
  if (!threadsValid) {
    throwInvalidArgument("kernel thread count ", o.numThreads, ": expected 1 to ",
                         runtime::kMaxKernelThreads);
  }
  if (same[2 * kSettings + 1] > 0) {
    throwInvalidArgument("rank ", rank, ": rank ", ranks - same[2 * kSettings + 1],
                         "'s kernel thread count is out of range (its own error names it): "
                         "expected 1 to ",
                         runtime::kMaxKernelThreads, " on every rank");
  }
  std::string differ;
  for (size_t i = 0; i < kSettings; ++i) {
    if (same[i] == -same[kSettings + i]) continue;
    if (!differ.empty()) differ += ", ";
    differ += kSettingNames[i];
  }
  if (!differ.empty()) {
    throwInvalidArgument("rank ", rank, ": the ranks passed different batches or settings (",
                         differ, "): expected the same on every rank");
  }
  // Every rank passed these alike (hashed above), so every rank refuses alike. Values outside
  // the enums were taken for one of their members, differently by different layers (a mask of
  // 7 planned as causal and computed as full: wrong output, no error).
  if (o.mask != MaskKind::kCausal && o.mask != MaskKind::kFull)
    throwInvalidArgument("mask ", static_cast<int>(o.mask), ": expected causal or full");
  if (o.dtype != DType::kFp32 && o.dtype != DType::kBf16)
    throwInvalidArgument("dtype ", static_cast<int>(o.dtype), ": expected fp32 or bf16");
  if (o.layout != Layout::kTransparent && o.layout != Layout::kDispatched) {
    throwInvalidArgument("layout ", static_cast<int>(o.layout),
                         ": expected transparent or dispatched");
  }
  // As fcp's --block-size: smaller blocks only make the plan slow or refused for its pairs (in
  // 1-token blocks a 5,000-token sequence alone makes 25M pairs).
  plan::checkBlockSize(o.planConfig.blockSize, "block size");
  if (o.planConfig.memoryLimitTokens < 0) {
    throwInvalidArgument("memory budget ", o.planConfig.memoryLimitTokens,
                         " tokens: expected 0 (the tokens per rank) or more");
  }
  const Batch batch = batchOf(o.cuSeqlens);
  const int64_t total = batch.numTokens();
  std::vector<int64_t> starts(static_cast<size_t>(ranks) + 1, 0);
  for (int r = 0; r < ranks; ++r) {
    const int64_t begin = ranges[2 * static_cast<size_t>(r)],
                  end = ranges[2 * static_cast<size_t>(r) + 1];
    const int64_t expected = starts[static_cast<size_t>(r)];
    if (begin != expected || end < begin || end > total) {
      const std::string before =
          r == 0 ? std::string("the first range must start at 0")
                 : "rank " + std::to_string(r - 1) + "'s range ends at " + std::to_string(expected);
      throwInvalidArgument("rank ", r, "'s token range is [", begin, ", ", end, "): expected [",
                           expected, ", e) with ", expected, " <= e <= ", total, " (", before,
                           ", and cu_seqlens ends at ", total,
                           ": the ranks' ranges, in rank order, must tile the batch)");
    }
    starts[static_cast<size_t>(r) + 1] = end;
  }
  if (starts.back() != total) {
    throwInvalidArgument("the ranks' token ranges end at ", starts.back(), ": expected ", total,
                         " (the ranks' ranges, in rank order, must tile the batch)");
  }
  if (o.numHeadsQ <= 0 || o.numHeadsKv <= 0 || o.numHeadsQ % o.numHeadsKv != 0 || o.headDim <= 0) {
    throwInvalidArgument("heads ", o.numHeadsQ, " (Q) and ", o.numHeadsKv, " (KV), head dim ",
                         o.headDim,
                         ": expected positive counts with Q heads a multiple of KV heads");
  }
  // The kernels take it as a float: a value float cannot hold would become 0 (the default) or
  // infinity.
  if (!scaleFitsFp32(o.softmaxScale)) {
    throwInvalidArgument("softmax scale ", o.softmaxScale,
                         ": expected 0 (for 1/sqrt(head dim)) or ",
                         std::numeric_limits<float>::min(), " to ",
                         std::numeric_limits<float>::max(), " (the kernels' fp32)");
  }
  plan::PlanConfig config = o.planConfig;
  config.numWorkers = ranks;
  config.tokensPerWorker = std::max<int64_t>(1, (total + ranks - 1) / ranks);
  config.attention = {o.numHeadsQ, o.numHeadsKv, o.headDim, kernels::dtypeBytes(o.dtype), o.mask};
  config.userStarts = starts;
  CostModel costModel = o.costModel;
  costModel.attention = config.attention;
  return {batch, config, costModel, o.strategy, o.planConfig.memoryLimitTokens > 0};
}

/// The plan of an agreed batch, checked (plan::checkValid), with its digest; the same on every
/// rank, since planning is deterministic. Touches no transport, so it may run on a thread of
/// its own.
detail::CheckedPlan planAgreed(const Agreed& a) {
  const int64_t total = a.batch.numTokens();
  const plan::PlanConfig& config = a.config;
  // WLB-LLM's oracle here: the busiest worker's compute, then the fewer transfer bytes (the
  // simulator's oracle needs a hardware model the runtime does not have).
  const baselines::PlanOracle oracle = [](const plan::Plan& p) {
    double busiest = 0;
    for (const plan::WorkerLoad& w : p.loads) busiest = std::max(busiest, w.cost);
    return busiest;
  };
  if (a.budgetSet) {
    const plan::DistributorOptions o = plan::distributorOptions(config);
    if (plan::safeBlockTokens(total, o) == 0) {
      // No plan holds the batch under the caller's budget. The planner's message would offer
      // the planner's knobs (workers, tokens per worker), which the batch sets itself: the
      // caller's are the budget and its slack.
      const int64_t ranks = config.numWorkers;
      throwInvalidArgument(
          "memory budget of ", config.memoryLimitTokens, " tokens a rank (a cap of ",
          plan::memoryCapTokens(o), " with its slack of ", config.memorySlack,
          ") cannot hold the batch's ", total, " tokens on ", ranks,
          ranks == 1 ? " rank" : " ranks", ": expected a cap (budget × (1 + slack)) of at least ",
          (total + ranks - 1) / ranks,
          " tokens a rank, or no budget (the even share, which always holds the batch)");
    }
  }
  // Any budget that holds the batch gives a plan: FCP's planner cuts blocks finer where the cap
  // cannot place them (issue 15), and the baselines raise the budget to what their layout
  // holds (plan.config says the budget used).
  plan::Plan plan = baselines::makePlan(a.strategy, a.batch, config, a.costModel, oracle);
  plan::checkValid(plan);
  const uint64_t digest = plan::planDigest(plan);
  return {std::move(plan), digest};
}

/// The plan `make` returns (planAgreed's), once every rank has one and all are the
/// same (one allreduce of their digests). A rank whose `make` throws tells the others in that
/// allreduce, so that every rank throws there together: the ones that planned name it, and it
/// throws its own error.
template <typename Make>
plan::Plan agreedPlan(runtime::Transport& transport, Make&& make) {
  detail::CheckedPlan checked;
  try {
    checked = make();
  } catch (...) {
    runtime::failPlanAgreement(std::current_exception(), transport);
  }
  runtime::checkPlanAgreement(checked.digest, transport);
  return std::move(checked.plan);
}

plan::Plan planNow(runtime::Transport& transport, const BatchOptions& options) {
  const Agreed agreed = agree(transport, options);
  return agreedPlan(transport, [&] { return planAgreed(agreed); });
}

runtime::ExecutorOptions executorOptions(const BatchOptions& o) {
  // Made before the agreement refuses a scale fp32 cannot hold: such a value never reaches a
  // kernel.
  return {o.numThreads, o.timeline,
          o.dtype,      o.layout,
          o.firstTag,   scaleFitsFp32(o.softmaxScale) ? static_cast<float>(o.softmaxScale) : 0.f};
}

}  // namespace

std::vector<int64_t> detail::settingHashes(const BatchOptions& options) {
  const std::array<int64_t, kSettings> h = hashSettings(options);
  return {h.begin(), h.end()};
}

void detail::checkTensor(const char* name, ConstTensorRef t, int64_t tokens, int64_t heads,
                         int64_t dim, DType dtype, const char* rows) {
  fcp::checkTensor(name, t, tokens, heads, dim, dtype, rows);
}

double detail::afterFailureSeconds(const runtime::Transport& t) {
  return t.timeoutSeconds() > 0 ? 2 * t.timeoutSeconds() + kAfterFailureSeconds : 0;
}

const char* detail::settingName(size_t index) {
  return index < kSettings ? kSettingNames[index] : "(no such setting)";
}

PendingBatch::PendingBatch(runtime::Transport& transport, const BatchOptions& options)
    : transport_(&transport), executorOptions_(executorOptions(options)) {
  Agreed agreed = agree(transport, options);
  userSequenceIds_ = userSequenceIds(options.cuSeqlens);
  serial_ = transport.calls().newBatch();
  try {
    plan_ = std::async(std::launch::async, [agreed] { return planAgreed(agreed); });
  } catch (const std::system_error&) {
    // No thread to be had (a process limit) on this rank: plan where the plan is taken, rather
    // than fail here alone while the other ranks go on to the digest check and wait.
    plan_ = std::async(std::launch::deferred,
                       [agreed = std::move(agreed)] { return planAgreed(agreed); });
  }
}

bool PendingBatch::ready() const {
  return plan_.valid() && plan_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

plan::Plan AttentionBatch::takePlan(PendingBatch& pending) {
  if (!pending.plan_.valid()) {
    throwInvalidArgument(
        "this PendingBatch was already used: expected one not yet handed to an "
        "AttentionBatch");
  }
  return agreedPlan(*pending.transport_, [&] { return pending.plan_.get(); });
}

AttentionBatch::AttentionBatch(runtime::Transport& transport, const BatchOptions& options)
    : executor_(planNow(transport, options), transport, executorOptions(options)),
      transport_(&transport),
      rank_(transport.rank()),
      serial_(transport.calls().newBatch()) {
  numberAsUser(userSequenceIds(options.cuSeqlens));
}

AttentionBatch::AttentionBatch(PendingBatch&& pending)
    : executor_(takePlan(pending), *pending.transport_, pending.executorOptions_),
      transport_(pending.transport_),
      rank_(pending.transport_->rank()),
      serial_(pending.serial_) {
  numberAsUser(pending.userSequenceIds_);
}

void AttentionBatch::numberAsUser(const std::vector<int32_t>& ids) {
  if (ids.empty()) return;
  const std::span<const int32_t> planned = executor_.localSequence();
  userSequence_.resize(planned.size());
  for (size_t i = 0; i < planned.size(); ++i)
    userSequence_[i] = ids[static_cast<size_t>(planned[i])];
}

void AttentionBatch::collective(const char* name, int64_t rowKey,
                                const std::function<void()>& call) {
  runtime::CallLedger& ledger = transport_->calls();
  const int64_t index = ledger.begin();
  if (const runtime::CallLedger::State earlier = ledger.state();
      !failure_.empty() || earlier.kind != 0) {
    // A call threw here before, this batch's or another's over the transport: its peers'
    // messages may still arrive, or the other ranks may be inside this call now. Refused, with
    // what the caller needs to go on.
    const Error refused = refusal(name, earlier);
    recordFailure(refused.what());
    throw refused;
  }
  // The call's tags: a window keyed by this batch, the call's kind and its place among the
  // transport's calls, the same on every rank while the ranks' calls are in step. Ranks out of
  // step (one calls another batch's forward, or backward where the other calls forward) then
  // miss each other's messages and time out, rather than take them and compute wrong results.
  // So do ranks that dispatch rows of different sizes or kinds: the ranks agreed on the batch's
  // own tensors' shapes, not on what a caller moves (through a process group, rows of another
  // size were taken as this rank's, or aborted the process).
  OptionsHash key;
  key.add(serial_);
  key.add(index);
  key.add(int64_t{name[0]});  // d, u, f, b: dispatch, undispatch, forward, backward
  key.add(rowKey);
  executor_.setTagKey(static_cast<uint64_t>(key.value()));
  reached_ = false;
  try {
    call();
  } catch (const std::exception& e) {
    ledger.failed(index, reached_);  // first: recordFailure allocates
    failedCall_ = index;
    recordFailure(e.what());
    throw;
  } catch (...) {
    ledger.failed(index, reached_);
    failedCall_ = index;
    recordFailure("an exception that is not a std::exception");
    throw;
  }
}

Error AttentionBatch::refusal(const char* name, const runtime::CallLedger::State& earlier) const {
  // What the caller needs to go on, as the next batch's plan agreement will find (CallLedger):
  // after a call that threw having posted messages (or after a second failure), a new transport,
  // since messages may still arrive; after one that threw in its checks, a new batch, and a new
  // transport too unless that call threw so on every rank. Built only when refusing.
  std::string text = "rank " + std::to_string(rank_) + ": this batch refuses " + name + ": ";
  const std::string which = "call #" + std::to_string(earlier.call) + " over this transport (" +
                            (earlier.call == failedCall_ ? "this batch's" : "another batch's") +
                            ") threw on this rank";
  if (earlier.kind == 2) {
    text += "expected a new transport (a new communicator or process group) and batch, since " +
            which + " after it had sent or posted messages, or after another call had thrown, " +
            "so messages may still arrive";
  } else if (earlier.kind == 1) {
    text += "expected a new batch, since " + which +
            " in its checks (if it did so on every rank, the transport goes on; if not, the other "
            "ranks were inside it, and the next batch's agreement asks for a new transport)";
  } else {
    text += "expected a new batch, since an earlier call on it threw on this rank";
  }
  // The first error last: a long one is cut at the message limit, not what to do.
  if (!failure_.empty()) text += "; this batch's first error: " + failure_;
  return Error(earlier.kind == 2 ? ErrorCode::kTransport : ErrorCode::kInvalidArgument, text);
}

void AttentionBatch::recordFailure(const std::string& message) {
  if (failure_.empty()) failure_ = message.empty() ? "(an error with no message)" : message;
}

void AttentionBatch::fail(const std::string& message) {
  // In place of the call, whose own checks it makes: counted as one, before the transport.
  // Not recorded where collective() would have refused the call unrecorded: this batch
  // failed already, or another batch's call over the transport threw.
  runtime::CallLedger& ledger = transport_->calls();
  const int64_t index = ledger.begin();
  if (failure_.empty() && ledger.state().kind == 0) {
    ledger.failed(index, false);
    failedCall_ = index;
  }
  recordFailure(message);
  throw Error(ErrorCode::kInvalidArgument, message);
}

namespace {

/// A key for rows of `rowBytes` bytes of the caller's kind `rowKind`.
int64_t rowKey(int64_t rowBytes, int64_t rowKind) {
  OptionsHash key;
  key.add(rowBytes);
  key.add(rowKind);
  return key.value();
}

/// A tensor's rows: heads x dim elements of dtype.
int64_t rowKey(int64_t heads, int64_t dim, DType dtype) {
  return rowKey(heads * dim * kernels::dtypeBytes(dtype),
                (heads << 24) ^ (dim << 4) ^ static_cast<int64_t>(dtype));
}

}  // namespace

void AttentionBatch::dispatch(std::span<const std::byte> user, std::span<std::byte> local,
                              int64_t rowBytes, int64_t userStride, int64_t localStride,
                              int64_t rowKind) {
  collective("dispatch", rowKey(rowBytes, rowKind), [&] {
    executor_.checkMove(true, user.size(), local.size(), rowBytes, userStride, localStride);
    reached_ = true;
    executor_.dispatch(user, local, rowBytes, userStride, localStride);
  });
}

void AttentionBatch::undispatch(std::span<const std::byte> local, std::span<std::byte> user,
                                int64_t rowBytes, int64_t localStride, int64_t userStride,
                                int64_t rowKind) {
  collective("undispatch", rowKey(rowBytes, rowKind), [&] {
    executor_.checkMove(false, user.size(), local.size(), rowBytes, userStride, localStride);
    reached_ = true;
    executor_.undispatch(local, user, rowBytes, localStride, userStride);
  });
}

void AttentionBatch::dispatch(ConstTensorRef user, TensorRef local) {
  collective("dispatch", rowKey(user.numHeads, user.headDim, user.dtype),
             [&] { dispatchTensor(user, local); });
}

void AttentionBatch::undispatch(ConstTensorRef local, TensorRef user) {
  collective("undispatch", rowKey(local.numHeads, local.headDim, local.dtype),
             [&] { undispatchTensor(local, user); });
}

/// A tensor that dispatch and undispatch move takes its heads and dim from the caller: they must
/// be positive (0 heads read as a dispatch of 0 bytes "expected 0 and 0"; -1 heads of -4 moved
/// 16-byte rows), and its dtype one the kernels know.
void checkMovedShape(const char* name, int64_t heads, int64_t dim, DType dtype) {
  if (heads <= 0 || dim <= 0 || (dtype != DType::kFp32 && dtype != DType::kBf16)) {
    throwInvalidArgument(name, " has ", heads, " heads of ", dim, " in ", dtypeText(dtype),
                         ": expected positive heads and head dim, fp32 or bf16");
  }
}

void AttentionBatch::dispatchTensor(ConstTensorRef user, TensorRef local) {
  checkMovedShape("dispatch input", user.numHeads, user.headDim, user.dtype);
  checkTensor("dispatch input", user, numUserTokens(), user.numHeads, user.headDim, user.dtype,
              "this rank's tokens in the caller's layout");
  checkTensor("dispatch output", local, numLocalTokens(), user.numHeads, user.headDim, user.dtype,
              "this rank's tokens in FCP's layout");
  const int64_t row = user.numHeads * user.headDim * kernels::dtypeBytes(user.dtype);
  reached_ = true;
  executor_.dispatch(
      {static_cast<const std::byte*>(user.data), extentBytes(user, numUserTokens(), row)},
      {static_cast<std::byte*>(local.data), extentBytes(local, numLocalTokens(), row)}, row,
      strideBytes(user), strideBytes(local));
}

void AttentionBatch::undispatchTensor(ConstTensorRef local, TensorRef user) {
  checkMovedShape("undispatch input", local.numHeads, local.headDim, local.dtype);
  checkTensor("undispatch input", local, numLocalTokens(), local.numHeads, local.headDim,
              local.dtype, "this rank's tokens in FCP's layout");
  checkTensor("undispatch output", user, numUserTokens(), local.numHeads, local.headDim,
              local.dtype, "this rank's tokens in the caller's layout");
  const int64_t row = local.numHeads * local.headDim * kernels::dtypeBytes(local.dtype);
  reached_ = true;
  executor_.undispatch(
      {static_cast<const std::byte*>(local.data), extentBytes(local, numLocalTokens(), row)},
      {static_cast<std::byte*>(user.data), extentBytes(user, numUserTokens(), row)}, row,
      strideBytes(local), strideBytes(user));
}

void AttentionLayer::forward(AttentionBatch& batch, ConstTensorRef q, ConstTensorRef k,
                             ConstTensorRef v, TensorRef o, TensorRef lse) {
  batch.collective("forward", 0, [&] { forwardChecked(batch, q, k, v, o, lse); });
}

void AttentionLayer::backward(AttentionBatch& batch, ConstTensorRef dO, TensorRef dq, TensorRef dk,
                              TensorRef dv) {
  batch.collective("backward", 0, [&] { backwardChecked(batch, dO, dq, dk, dv); });
}

void AttentionLayer::release() { state_ = runtime::LayerState{}; }

void AttentionLayer::forwardChecked(AttentionBatch& batch, ConstTensorRef q, ConstTensorRef k,
                                    ConstTensorRef v, TensorRef o, TensorRef lse) {
  const auto& a = batch.plan().config.attention;
  const int64_t n = batch.numCallTokens();
  const DType dt = batch.dtype();
  const char* rows = rowsText(batch.layout());
  checkTensor("q", q, n, a.numHeadsQ, a.headDim, dt, rows);
  checkTensor("k", k, n, a.numHeadsKv, a.headDim, dt, rows);
  checkTensor("v", v, n, a.numHeadsKv, a.headDim, dt, rows);
  checkTensor("o", o, n, a.numHeadsQ, a.headDim, dt, rows);
  if (lse.data != nullptr) checkTensor("lse", lse, n, a.numHeadsQ, 1, DType::kFp32, rows);
  batch.reached_ = true;
  batch.executor().forward(state_, {q.data, strideBytes(q)}, {k.data, strideBytes(k)},
                           {v.data, strideBytes(v)}, {o.data, strideBytes(o)},
                           {lse.data, lse.data != nullptr ? strideBytes(lse) : 0});
}

void AttentionLayer::backwardChecked(AttentionBatch& batch, ConstTensorRef dO, TensorRef dq,
                                     TensorRef dk, TensorRef dv) {
  const auto& a = batch.plan().config.attention;
  const int64_t n = batch.numCallTokens();
  const DType dt = batch.dtype();
  const char* rows = rowsText(batch.layout());
  checkTensor("dO", dO, n, a.numHeadsQ, a.headDim, dt, rows);
  checkTensor("dq", dq, n, a.numHeadsQ, a.headDim, dt, rows);
  checkTensor("dk", dk, n, a.numHeadsKv, a.headDim, dt, rows);
  checkTensor("dv", dv, n, a.numHeadsKv, a.headDim, dt, rows);
  batch.executor().checkBackward(state_);
  batch.reached_ = true;
  batch.executor().backward(state_, {dO.data, strideBytes(dO)}, {dq.data, strideBytes(dq)},
                            {dk.data, strideBytes(dk)}, {dv.data, strideBytes(dv)});
}

}  // namespace fcp
