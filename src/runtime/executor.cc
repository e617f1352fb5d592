// The executor: one worker's stages of a Plan, forward and backward.
//
// Terms. The *local blocks* are the blocks this rank owns; their tokens are stored one block
// after another in the *FCP layout*: Q, O, dO, dQ as rows of Hq·d elements, LSE and delta as
// rows of Hq, and per block a *KV buffer* [K rows | V rows] (rows of Hkv·d), which is exactly
// what a transfer sends, so a send needs no copy. Q and KV are kept in the storage dtype (a bf16
// transfer moves bf16); O, LSE and the gradients accumulate in fp32. A *remote buffer* holds a
// received transfer's K|V until the stage that releases it. Backward, a *grad partial* of a
// received transfer accumulates the fp32 dK|dV this rank computes with it (and, for a relay,
// the partials its own receivers return) until the plan's sendGrad sends it back.
// A stage is: post its receives and sends, compute its pairs (their KV is local or arrived in
// an earlier stage), wait for its messages, add returned dK/dV partials in, free its releases.
// The reshuffles (reshuffle.h) hide behind compute: a block *travels* when some of its tokens
// come from another rank. The inward reshuffle is one message per block and rank, all sent at
// the start of the pass in the order their receiver's first stage uses them (then that stage's
// KV, then the blocks later stages use); a pair runs as soon as its blocks' rows are in (its
// Q block, and forward a local KV block), so blocks whose tokens are all local start at once.
// Within a stage, pairs of travelling Q blocks go first among those that can run, and a block's
// outputs leave as soon as its remaining count (pairs still to compute, and backward the dK/dV
// returns still to add) reaches zero, while later blocks compute. While a stage waits for its
// messages, later stages' pairs whose KV is local run. A pair never waits for a message it does
// not need, but it does wait for the pairs before it (in plan order) that add into the same
// output, so that every sum is taken in one order: results do not depend on arrival times and
// are bitwise the same run to run and in either layout. In the dispatched layout every piece is
// local: the same code moves nothing.
//
// Tags, from the call's window (setTagKey; options.firstTag by default): 2t a transfer's KV and
// 2t + 1 its dK/dV partial, then per block stream (forward O/LSE, backward dQ, backward dK/dV,
// undispatch, the inward reshuffle of either pass, dispatch) one tag per block.
#include "fcp/runtime/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>

#include "fcp/core/cost_model.h"
#include "fcp/core/error.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/json.h"
#include "reshuffle.h"

namespace fcp::runtime {
namespace {

using Clock = std::chrono::steady_clock;
using detail::Elem;
using detail::Field;
using detail::LayoutIndex;
using detail::Piece;

constexpr int kNumBlockStreams = 6;
enum BlockStream {
  kForwardOut = 0,
  kBackwardQ = 1,
  kBackwardKv = 2,
  kUndispatch = 3,
  kInward = 4,
  kDispatch = 5
};

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::atomic<uint64_t> nextExecutorId{1};

// Throws unless `strideBytes` can step over `rows` rows of `rowBytes` bytes, elements of
// `elemBytes`: 0 (back to back), or a multiple of the element of at least one row whose last row
// an int64 offset still reaches.
void checkStride(const char* name, int64_t strideBytes, int64_t rowBytes, int64_t elemBytes,
                 int64_t rows) {
  if (strideBytes == 0) return;
  const int64_t most = std::numeric_limits<int64_t>::max() / std::max<int64_t>(rows, 1);
  if (strideBytes < rowBytes || strideBytes % elemBytes != 0 || strideBytes > most) {
    throwInvalidArgument(name, "'s row stride of ", strideBytes, " bytes: expected 0 (rows back ",
                         "to back) or ",
                         elemBytes > 1 ? "a multiple of " + std::to_string(elemBytes) + " " : "",
                         "from ", rowBytes, " (one row) to ", most, " (", rows, " rows)");
  }
}

}  // namespace

int64_t rowsExtentBytes(int64_t rows, int64_t rowBytes, int64_t strideBytes) {
  if (rows <= 0 || rowBytes <= 0 || strideBytes < 0) return 0;
  const int64_t step = strideBytes > 0 ? strideBytes : rowBytes;
  if (step > std::numeric_limits<int64_t>::max() / rows) return 0;
  return (rows - 1) * step + rowBytes;
}

struct Executor::State {
  plan::Plan plan;
  Transport& transport;
  ExecutorOptions options;
  uint64_t id = 0;
  int rank = 0;
  int64_t hq = 0, hkv = 0, dim = 0;
  int64_t qRow = 0, kRow = 0;  // elements per token
  int64_t elem = 4;            // bytes per stored element
  Elem storage = Elem::kFp32;
  kernels::MaskKind mask = kernels::MaskKind::kCausal;

  std::vector<int32_t> localIndex;   // block -> local index, or -1
  std::vector<int32_t> localBlocks;  // local index -> block
  std::vector<int64_t> tokenStart;   // local index -> first token in the FCP layout (+ total)
  std::vector<std::vector<kernels::Segment>> segments;  // per block
  LayoutIndex transparent, dispatched;
  std::vector<char> imported;  // per block: some token comes from a rank other than its owner
  std::vector<int32_t> localSeq;
  std::vector<int64_t> localPos;

  // Scratch shared by every layer's passes.
  std::vector<float> partO, partLse, delta, dq, dkv;
  std::vector<std::byte> dO;
  std::unordered_map<int32_t, std::vector<std::byte>> remote;  // transfer -> K|V
  std::unordered_map<int32_t, std::vector<float>> gradPartial, gradIn;
  PassStats fwd, bwd;
  // The pass in progress.
  LayerState* layer = nullptr;
  const LayerState* constLayer = nullptr;
  detail::Outward* qStream = nullptr;   // outputs of Q blocks
  detail::Outward* kvStream = nullptr;  // backward: dK/dV of KV blocks
  detail::Inward* inward = nullptr;
  bool inBackward = false;
  std::vector<char> have;         // per local block: its inward rows are in (backward: D too)
  std::vector<char> done;         // per pair: computed in this pass
  std::vector<char> inStage;      // per pair: one of the running stage's own (computeStage)
  size_t priorityFrom = 0;        // the pass's priority order is done before this index
  std::vector<char> posted;       // per transfer: its KV receive or send was posted (or deferred)
  std::vector<int32_t> deferred;  // the stage's KV sends whose block's rows are not in yet
  std::vector<char> kvArrived;    // per transfer: its KV is here
  // Backward, per transfer this rank receives: the pairs and relayed returns still to add into
  // its dK/dV partial, and the partial's send once posted (it leaves when the count reaches 0).
  std::vector<int64_t> gradRemaining;
  std::unordered_map<int32_t, RequestId> gradSent;
  std::vector<std::pair<RequestId, int32_t>> kvPending;  // KV receives not complete yet
  std::vector<RequestId> preposted;  // the first stage's messages posted with the reshuffle
  std::vector<RequestId>* stageRequests = nullptr;
  // The calls' tags: windows of tagsNeeded() tags from options.firstTag up to the transport's
  // largest tag, and the first tag of the window in use (setTagKey).
  int64_t tagWindows = 1;
  int64_t tagBase = 0;
  // Sums are taken in one order whatever the arrival times, so that results are the same run to
  // run and in either layout. Per pair of this rank's pass: the pair before it in plan order
  // (stage by stage, then as the stage lists them) that adds into the same Q block (O, or dQ)
  // and, backward, into the same dK/dV accumulator (-1: none); a pair runs only after them.
  // Backward, a dK/dV accumulator is a local block's or a transfer's partial (kvAccumulator);
  // the stages whose end adds returned partials into it (ascending) hold back the pairs of
  // later stages until those returns are in.
  std::vector<int32_t> afterQ, afterKv, stageOf, kvAcc;
  std::vector<std::vector<int32_t>> returnStages;
  int32_t currentStage = 0;

  /// After an error the transport could not withdraw from: KV and gradient buffers are never
  /// freed (PendingGuard).
  void keepBuffersForever() {
    keepForever(remote);
    keepForever(gradIn);
    keepForever(gradPartial);
    preposted.clear();
  }

  State(plan::Plan p, Transport& t, const ExecutorOptions& opts)
      : plan(std::move(p)), transport(t), options(opts), id(nextExecutorId++) {}

  const LayoutIndex& index() const {
    return options.layout == Layout::kDispatched ? dispatched : transparent;
  }
  int64_t localTokens() const { return tokenStart.back(); }
  int64_t blockTokens(int32_t block) const {
    return plan.blocks[static_cast<size_t>(block)].numTokens();
  }
  int tag(int64_t offset) const { return static_cast<int>(tagBase + offset); }
  int tagKv(int32_t t) const { return tag(2 * int64_t{t}); }
  int tagGrad(int32_t t) const { return tag(2 * int64_t{t} + 1); }
  int blockTag(BlockStream stream) const {
    return tag(2 * static_cast<int64_t>(plan.transfers.size()) +
               stream * static_cast<int64_t>(plan.blocks.size()));
  }
  int64_t tagsNeeded() const {
    return 2 * static_cast<int64_t>(plan.transfers.size()) +
           kNumBlockStreams * static_cast<int64_t>(plan.blocks.size());
  }
  // The local index of transfer t's block (-1 when this rank relays it).
  int32_t sourceLocal(int32_t t) const {
    return localIndex[static_cast<size_t>(plan.transfers[static_cast<size_t>(t)].block)];
  }
  bool travels(int32_t block) const {
    return options.layout == Layout::kTransparent && imported[static_cast<size_t>(block)];
  }
  detail::ReshuffleContext context(PassStats* stats) {
    return {transport, rank, index(), stats, options.timeline};
  }
  // Row accessors in the FCP layout: a tensor of `rowBytes` per token, or one half of a
  // per-block [K | V] tensor.
  std::function<std::byte*(int32_t, int64_t)> rows(std::byte* base, int64_t rowBytes) const {
    return [this, base, rowBytes](int32_t local, int64_t tok) {
      return base + (tokenStart[static_cast<size_t>(local)] + tok) * rowBytes;
    };
  }
  std::function<std::byte*(int32_t, int64_t)> kvRows(std::byte* base, int64_t rowBytes,
                                                     bool valueHalf) const {
    return [this, base, rowBytes, valueHalf](int32_t local, int64_t tok) {
      const auto l = static_cast<size_t>(local);
      const int64_t n = tokenStart[l + 1] - tokenStart[l];
      return base + (2 * tokenStart[l] + (valueHalf ? n : 0) + tok) * rowBytes;
    };
  }
  const std::byte* kvOf(int32_t local) const {
    return constLayer->kv.data() + 2 * tokenStart[static_cast<size_t>(local)] * kRow * elem;
  }
  float* dkvOf(int32_t local) {
    return dkv.data() + 2 * tokenStart[static_cast<size_t>(local)] * kRow;
  }
  int32_t transferTo(int32_t block, int32_t receiver) const {
    const int32_t t = plan::findTransfer(plan.transfers, block, receiver);
    FCP_CHECK(t >= 0, "no transfer of block ", block, " to rank ", receiver);
    return t;
  }
  kernels::BlockMask maskOf(const plan::BlockPair& pair) const {
    return {mask, segments[static_cast<size_t>(pair.qBlock)],
            segments[static_cast<size_t>(pair.kvBlock)]};
  }

  void setup();
  void indexTransparent();
  std::vector<int64_t> remainingPerBlock(bool backward, bool kvSide) const;
  plan::WorkerStages stagesOf(int worker) const {
    return (inBackward ? plan.backward : plan.forward)[static_cast<size_t>(worker)];
  }
  std::vector<int32_t> pairOrder(const plan::Stage& st) const;
  void needOrder(int worker, std::vector<int32_t>& first, std::vector<int32_t>& later) const;
  void beginPass(bool backward, detail::Inward& in);
  bool haveBlock(int32_t local);
  bool canRun(int32_t p);
  int32_t kvAccumulator(int32_t kvBlock) const {
    const int32_t local = localIndex[static_cast<size_t>(kvBlock)];
    return local >= 0 ? local
                      : static_cast<int32_t>(localBlocks.size()) + transferTo(kvBlock, rank);
  }
  void orderSums();
  bool inOrder(int32_t p) const;
  int32_t missingBlock(int32_t p);
  void pollMessages();
  void postDeferred();
  void runPair(int32_t p) {
    inBackward ? backwardPair(p) : forwardPair(p);
    done[static_cast<size_t>(p)] = 1;
  }
  bool urgent(int32_t p) const;
  std::vector<int32_t> priorityOrder() const;
  size_t computeStage(const plan::Stage& st, const std::vector<int32_t>& priority,
                      const std::vector<RequestId>& requests);
  const std::byte* kvSource(int32_t block);
  struct PairViews {
    const plan::BlockPair& pair;
    int32_t local;  ///< the Q block's index among this rank's blocks
    int64_t row;    ///< first token of the Q block in this rank's FCP layout
    kernels::TensorView q, k, v;
  };
  PairViews pairViews(int32_t p);
  void forwardPair(int32_t p);
  void backwardPair(int32_t p);
  void runStages();
  // Posts the stage's KV receives and sends not posted yet; a send whose block's rows are not
  // in yet is deferred until they are (postDeferred).
  void postKv(const plan::Stage& st, std::vector<RequestId>& requests);
  void postKvSend(int32_t t, std::vector<RequestId>& requests);
  // Backward: counts the partials' contributions; sends a partial (countDownGrad at zero).
  void countGrads();
  void countDownGrad(int32_t t);
  RequestId sendGrad(int32_t t);
  // Backward: D = rowsum(dO ∘ O) of one local block.
  void computeDelta(int32_t local);
};

void Executor::State::setup() {
  const auto& a = plan.config.attention;
  const bool bf16 = options.dtype == kernels::DType::kBf16;
  elem = bf16 ? 2 : 4;
  storage = bf16 ? Elem::kBf16 : Elem::kFp32;
  if (a.elementBytes != elem) {
    throwInvalidArgument("plan made for ", a.elementBytes, "-byte elements run with ",
                         kernels::dtypeName(options.dtype), " tensors: expected element bytes ",
                         elem);
  }
  if (plan.config.numWorkers != transport.size()) {
    throwInvalidArgument("plan for ", plan.config.numWorkers, " workers run on ", transport.size(),
                         " ranks: expected the same number");
  }
  if (options.firstTag < 0) {
    throwInvalidArgument("first tag ", options.firstTag, ": expected 0 or more");
  }
  if (tagsNeeded() > int64_t{transport.maxTag()} - options.firstTag + 1) {
    throwInvalidArgument(
        "plan needs tags ", options.firstTag, " to ", options.firstTag + tagsNeeded() - 1, " (",
        plan.transfers.size(), " transfers, ", plan.blocks.size(),
        " blocks): expected at most the transport's largest tag ", transport.maxTag());
  }
  tagWindows = (int64_t{transport.maxTag()} - options.firstTag + 1) / tagsNeeded();
  tagBase = options.firstTag;
  if (options.numThreads < 1 || options.numThreads > kMaxKernelThreads) {
    throwInvalidArgument("invalid kernel thread count ", options.numThreads, ": expected 1 to ",
                         kMaxKernelThreads);
  }
  kernels::softmaxScaleOf({options.numThreads, options.softmaxScale},
                          static_cast<int>(a.headDim));  // throws on a bad scale
  rank = transport.rank();
  hq = a.numHeadsQ;
  hkv = a.numHeadsKv;
  dim = a.headDim;
  qRow = hq * dim;
  kRow = hkv * dim;
  mask = a.mask == MaskKind::kCausal ? kernels::MaskKind::kCausal : kernels::MaskKind::kFull;

  const size_t numBlocks = plan.blocks.size();
  localIndex.assign(numBlocks, -1);
  tokenStart.assign(1, 0);
  segments.resize(numBlocks);
  for (size_t b = 0; b < numBlocks; ++b) {
    for (const plan::Chunk& c : plan.blocks[b].chunks) {
      segments[b].push_back({c.numTokens(), c.sequence, c.begin});
    }
    if (plan.owner[b] != rank) continue;
    localIndex[b] = static_cast<int32_t>(localBlocks.size());
    localBlocks.push_back(static_cast<int32_t>(b));
    tokenStart.push_back(tokenStart.back() + plan.blocks[b].numTokens());
    for (const plan::Chunk& c : plan.blocks[b].chunks) {
      for (int64_t pos = c.begin; pos < c.end; ++pos) {
        localSeq.push_back(c.sequence);
        localPos.push_back(pos);
      }
    }
  }
  indexTransparent();
  // The dispatched layout: every piece is a whole local block that stays here.
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  dispatched.inbound.assign(n, {});
  dispatched.outbound.assign(n, {});
  for (size_t l = 0; l < localBlocks.size(); ++l) {
    const Piece piece{tokenStart[l], localBlocks[l], static_cast<int32_t>(l), 0,
                      tokenStart[l + 1] - tokenStart[l]};
    dispatched.inbound[static_cast<size_t>(rank)].push_back(piece);
    dispatched.outbound[static_cast<size_t>(rank)].push_back(piece);
  }
  dispatched.numLocalBlocks = static_cast<int32_t>(localBlocks.size());
  dispatched.userTokens = localTokens();

  int64_t maxBlock = 0;
  for (const int32_t b : localBlocks) maxBlock = std::max(maxBlock, blockTokens(b));
  partO.assign(static_cast<size_t>(maxBlock * qRow), 0.f);
  partLse.assign(static_cast<size_t>(maxBlock * hq), 0.f);
}

// Reshuffle pieces of the transparent layout: locate each in its block (a piece lies inside
// one chunk).
void Executor::State::indexTransparent() {
  const std::vector<int64_t> userStart = plan::userLayout(plan);
  const auto seq = plan::sequenceStarts(plan.batch);
  struct ChunkAt {
    int64_t begin, end;
    int32_t block;
    int64_t offset;
  };
  std::vector<ChunkAt> chunks;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    int64_t offset = 0;
    for (const plan::Chunk& c : plan.blocks[b].chunks) {
      const int64_t begin = seq[static_cast<size_t>(c.sequence)] + c.begin;
      chunks.push_back({begin, begin + c.numTokens(), static_cast<int32_t>(b), offset});
      offset += c.numTokens();
    }
  }
  std::sort(chunks.begin(), chunks.end(),
            [](const ChunkAt& x, const ChunkAt& y) { return x.begin < y.begin; });
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  transparent.inbound.assign(n, {});
  transparent.outbound.assign(n, {});
  imported.assign(plan.blocks.size(), 0);
  for (const plan::ReshufflePiece& piece : plan.reshuffle) {
    auto it = std::upper_bound(chunks.begin(), chunks.end(), piece.begin,
                               [](int64_t x, const ChunkAt& c) { return x < c.begin; });
    FCP_CHECK(it != chunks.begin(), "reshuffle piece before every chunk");
    --it;
    if (piece.userWorker != piece.fcpWorker) imported[static_cast<size_t>(it->block)] = 1;
    if (piece.userWorker != rank && piece.fcpWorker != rank) continue;
    Piece out;
    out.userOffset = piece.begin - userStart[static_cast<size_t>(piece.userWorker)];
    out.block = it->block;
    out.blockOffset = it->offset + (piece.begin - it->begin);
    out.numTokens = piece.end - piece.begin;
    if (piece.fcpWorker == rank) {
      out.localBlock = localIndex[static_cast<size_t>(it->block)];
      transparent.inbound[static_cast<size_t>(piece.userWorker)].push_back(out);
    }
    if (piece.userWorker == rank) {
      // The sender only needs user offsets; the block fields describe the receiver's side.
      transparent.outbound[static_cast<size_t>(piece.fcpWorker)].push_back(out);
    }
  }
  transparent.numLocalBlocks = static_cast<int32_t>(localBlocks.size());
  transparent.userTokens =
      userStart[static_cast<size_t>(rank) + 1] - userStart[static_cast<size_t>(rank)];
}

// Per local block, what must happen before its outputs are final: the pairs of its Q block,
// or (`kvSide`) the pairs that use it as KV and the dK/dV returns still to add.
std::vector<int64_t> Executor::State::remainingPerBlock(bool backward, bool kvSide) const {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  std::vector<int64_t> remaining(localBlocks.size(), 0);
  for (const plan::Stage& st : stages) {
    for (const int32_t p : st.compute) {
      const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
      const int32_t local = localIndex[static_cast<size_t>(kvSide ? pair.kvBlock : pair.qBlock)];
      if (local >= 0) ++remaining[static_cast<size_t>(local)];
    }
    if (!kvSide) continue;
    for (const int32_t t : st.recvGrad) {
      const int32_t local = sourceLocal(t);
      if (local >= 0) ++remaining[static_cast<size_t>(local)];
    }
  }
  return remaining;
}

// A stage's pairs in the order they should run: grouped by Q block (stable), so that blocks
// finish one after another and their outputs leave while the rest compute; travelling Q blocks
// first, as their outputs must go back.
std::vector<int32_t> Executor::State::pairOrder(const plan::Stage& st) const {
  std::vector<int32_t> order(st.compute.begin(), st.compute.end());
  const auto key = [&](int32_t p) {
    const int32_t q = plan.pairs[static_cast<size_t>(p)].qBlock;
    return std::pair{!travels(q), q};
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return key(a) < key(b); });
  return order;
}

// The blocks of `worker` in the order its pass first needs their inward rows: those its first
// stage's pairs use (`first`), then those of later stages (`later`). Backward the inward rows
// are dO, which only the Q block's pairs need.
void Executor::State::needOrder(int worker, std::vector<int32_t>& first,
                                std::vector<int32_t>& later) const {
  first.clear();
  later.clear();
  std::vector<char> seen(plan.blocks.size(), 0);
  const auto& stages = stagesOf(worker);
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<int32_t>& into = s == 0 ? first : later;
    for (const int32_t p : pairOrder(stages[s])) {
      const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
      for (const int32_t b : {pair.qBlock, pair.kvBlock}) {
        if (plan.owner[static_cast<size_t>(b)] != worker || seen[static_cast<size_t>(b)]) continue;
        if (inBackward && b != pair.qBlock) continue;
        seen[static_cast<size_t>(b)] = 1;
        into.push_back(b);
      }
    }
  }
}

// Starts a pass: posts every inward receive and send, and the first stage's KV sends whose rows
// are here. A link carries messages in the order they were posted, so the inward blocks every
// peer's first stage uses go first (interleaved over peers by when they are needed), then the
// first stage's KV (needed by the peers' second stage), then the inward blocks of later stages.
void Executor::State::beginPass(bool backward, detail::Inward& in) {
  inBackward = backward;
  inward = &in;
  have.assign(localBlocks.size(), 0);
  done.assign(plan.pairs.size(), 0);
  inStage.assign(plan.pairs.size(), 0);
  priorityFrom = 0;
  posted.assign(plan.transfers.size(), 0);
  kvArrived.assign(plan.transfers.size(), 0);
  kvPending.clear();
  if (backward) countGrads();
  orderSums();
  deferred.clear();
  preposted.clear();
  in.start();
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  std::vector<std::vector<int32_t>> first(n), later(n);
  if (options.layout == Layout::kTransparent) {
    for (size_t peer = 0; peer < n; ++peer) {
      if (static_cast<int>(peer) != rank)
        needOrder(static_cast<int>(peer), first[peer], later[peer]);
    }
  }
  const auto sendInterleaved = [&](const std::vector<std::vector<int32_t>>& blocks) {
    for (size_t i = 0, more = 1; more; ++i) {
      more = 0;
      for (size_t peer = 0; peer < n; ++peer) {
        if (i >= blocks[peer].size()) continue;
        in.send(static_cast<int>(peer), blocks[peer][i]);
        more = 1;
      }
    }
  };
  sendInterleaved(first);
  const auto& stages = stagesOf(rank);
  if (!stages.empty()) {
    for (const int32_t t : stages.front().send) {
      const int32_t local = sourceLocal(t);
      if (local >= 0 && (backward || haveBlock(local))) postKvSend(t, preposted);
    }
  }
  sendInterleaved(later);
  in.sendRest();
}

// Whether local block `local`'s inward rows are in; backward, computes its D when they are.
bool Executor::State::haveBlock(int32_t local) {
  const auto l = static_cast<size_t>(local);
  if (have[l]) return true;
  if (!inward->has(local)) return false;
  if (inBackward) computeDelta(local);
  have[l] = 1;
  return true;
}

void Executor::State::orderSums() {
  const size_t numPairs = plan.pairs.size();
  afterQ.assign(numPairs, -1);
  afterKv.assign(numPairs, -1);
  stageOf.assign(numPairs, -1);
  kvAcc.assign(numPairs, -1);
  const size_t numAcc = localBlocks.size() + plan.transfers.size();
  std::vector<int32_t> lastQ(localBlocks.size(), -1), lastKv(inBackward ? numAcc : 0, -1);
  returnStages.assign(inBackward ? numAcc : 0, {});
  const auto& stages = stagesOf(rank);
  for (size_t s = 0; s < stages.size(); ++s) {
    for (const int32_t p : stages[s].compute) {
      const auto i = static_cast<size_t>(p);
      const plan::BlockPair& pair = plan.pairs[i];
      stageOf[i] = static_cast<int32_t>(s);
      int32_t& q = lastQ[static_cast<size_t>(localIndex[static_cast<size_t>(pair.qBlock)])];
      afterQ[i] = std::exchange(q, p);
      if (!inBackward) continue;
      kvAcc[i] = kvAccumulator(pair.kvBlock);
      afterKv[i] = std::exchange(lastKv[static_cast<size_t>(kvAcc[i])], p);
    }
    if (!inBackward) continue;
    for (const int32_t t : stages[s].recvGrad) {
      const int32_t block = plan.transfers[static_cast<size_t>(t)].block;
      const auto acc = static_cast<size_t>(kvAccumulator(block));
      if (returnStages[acc].empty() || returnStages[acc].back() != static_cast<int32_t>(s))
        returnStages[acc].push_back(static_cast<int32_t>(s));
    }
  }
}

// Whether every sum pair `p` adds into has taken what comes before it (orderSums).
bool Executor::State::inOrder(int32_t p) const {
  const auto i = static_cast<size_t>(p);
  if (afterQ[i] >= 0 && !done[static_cast<size_t>(afterQ[i])]) return false;
  if (!inBackward) return true;
  if (afterKv[i] >= 0 && !done[static_cast<size_t>(afterKv[i])]) return false;
  // The returns of stages before the current one are in; those of later stages before p's are
  // not.
  const std::vector<int32_t>& returns = returnStages[static_cast<size_t>(kvAcc[i])];
  const auto next = std::lower_bound(returns.begin(), returns.end(), currentStage);
  return next == returns.end() || *next >= stageOf[i];
}

// Whether pair `p` may run: its sums are in order (inOrder) and its inputs are here: its Q
// block's rows, and its KV block's (local) or the transfer that brings it (remote).
bool Executor::State::canRun(int32_t p) {
  if (!inOrder(p)) return false;
  const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
  if (!haveBlock(localIndex[static_cast<size_t>(pair.qBlock)])) return false;
  const int32_t kl = localIndex[static_cast<size_t>(pair.kvBlock)];
  if (kl < 0) return kvArrived[static_cast<size_t>(transferTo(pair.kvBlock, rank))] != 0;
  return inBackward || haveBlock(kl);
}

// The local block a pair of the current stage waits for (its KV, if remote, came in an
// earlier stage).
int32_t Executor::State::missingBlock(int32_t p) {
  const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
  const int32_t ql = localIndex[static_cast<size_t>(pair.qBlock)];
  if (!haveBlock(ql)) return ql;
  const int32_t kl = localIndex[static_cast<size_t>(pair.kvBlock)];
  FCP_CHECK(kl >= 0 && !inBackward, "rank ", rank, " waits for pair ", p, " with its inputs in");
  return kl;
}

// Unpacks the inward blocks that arrived, posts the KV sends they allow, notes KV that arrived.
void Executor::State::pollMessages() {
  inward->poll();
  postDeferred();  // also those whose rows came in through waitFor
  std::erase_if(kvPending, [this](const std::pair<RequestId, int32_t>& r) {
    if (!transport.test(r.first)) return false;
    kvArrived[static_cast<size_t>(r.second)] = 1;
    return true;
  });
}

void Executor::State::postDeferred() {
  std::erase_if(deferred, [this](int32_t t) {
    const int32_t local = sourceLocal(t);
    if (!haveBlock(local)) return false;
    postKvSend(t, *stageRequests);
    return true;
  });
}

// A pair whose result must cross a link: its Q block's outputs go to other ranks, or backward
// its dK/dV does (a remote KV block's partial goes back to its sender; a local one's to the
// block's user ranks when its tokens came from elsewhere).
bool Executor::State::urgent(int32_t p) const {
  const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
  if (travels(pair.qBlock)) return true;
  return inBackward && (travels(pair.kvBlock) || localIndex[static_cast<size_t>(pair.kvBlock)] < 0);
}

// Every pair of this rank's pass, in the order it should run when its inputs are in: urgent
// pairs first, then by stage, then as pairOrder puts them.
std::vector<int32_t> Executor::State::priorityOrder() const {
  std::vector<int32_t> order;
  for (const plan::Stage& st : stagesOf(rank)) {
    for (const int32_t p : pairOrder(st)) order.push_back(p);
  }
  std::stable_partition(order.begin(), order.end(), [this](int32_t p) { return urgent(p); });
  return order;
}

// Runs stage `st`'s pairs, and any other pair whose inputs are in, the first in `priority`
// that can run each time; when none can, waits for the first missing block of the stage's
// first unfinished pair (peers send in that order). Once the stage's pairs are done it goes on
// with pairs of later stages only while the stage's messages (`requests`, KV receives) are
// pending and its deferred sends wait for rows. Returns how many of `requests` completed, from
// the front.
size_t Executor::State::computeStage(const plan::Stage& st, const std::vector<int32_t>& priority,
                                     const std::vector<RequestId>& requests) {
  // The stage's own pairs, those left counted rather than erased, and the search in `priority`
  // from the first pair not done: erasing the done pairs and searching from the front on every
  // turn was quadratic in a rank's pairs (one rank, one sequence of 12K tokens: forward 0.33 s
  // in 64-token blocks, 2.3 s in 32, 31.5 s in 16).
  const std::vector<int32_t> required = pairOrder(st);
  size_t left = 0;
  for (const int32_t p : required) {
    inStage[static_cast<size_t>(p)] = 1;
    if (!done[static_cast<size_t>(p)]) ++left;
  }
  size_t firstLeft = 0;  // required[i] is done for every i < firstLeft
  const auto leave = [&](size_t completedRequests) {
    for (const int32_t p : required) inStage[static_cast<size_t>(p)] = 0;
    return completedRequests;
  };
  size_t completed = 0;
  while (true) {
    pollMessages();
    if (left == 0 && deferred.empty()) {
      while (completed < requests.size() && transport.test(requests[completed])) ++completed;
      if (completed == requests.size() && kvPending.empty()) return leave(completed);
    }
    while (priorityFrom < priority.size() && done[static_cast<size_t>(priority[priorityFrom])])
      ++priorityFrom;  // done only turns on within a pass
    const auto next =
        std::find_if(priority.begin() + static_cast<std::ptrdiff_t>(priorityFrom), priority.end(),
                     [this](int32_t p) { return !done[static_cast<size_t>(p)] && canRun(p); });
    if (next != priority.end()) {
      const int32_t p = *next;
      runPair(p);
      if (inStage[static_cast<size_t>(p)]) --left;
    } else if (left > 0) {
      // A pair of the stage in order exists (the first in plan order not done): its inputs are
      // what is missing.
      while (done[static_cast<size_t>(required[firstLeft])]) ++firstLeft;  // left > 0: one isn't
      const auto first =
          std::find_if(required.begin() + static_cast<std::ptrdiff_t>(firstLeft), required.end(),
                       [this](int32_t p) { return !done[static_cast<size_t>(p)] && inOrder(p); });
      FCP_CHECK(first != required.end(), "rank ", rank, " has no pair of its stage in order");
      inward->waitFor(missingBlock(*first));
    } else if (!deferred.empty()) {
      const int32_t t = deferred.front();
      inward->waitFor(sourceLocal(t));
    } else {
      return leave(completed);
    }
  }
}

const std::byte* Executor::State::kvSource(int32_t block) {
  const int32_t local = localIndex[static_cast<size_t>(block)];
  if (local >= 0) return kvOf(local);
  auto it = remote.find(transferTo(block, rank));
  FCP_CHECK(it != remote.end(), "rank ", rank, " computes with block ", block, " it does not hold");
  return it->second.data();
}

Executor::State::PairViews Executor::State::pairViews(int32_t p) {
  const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
  const int32_t local = localIndex[static_cast<size_t>(pair.qBlock)];
  FCP_CHECK(local >= 0, "rank ", rank, " computes pair ", p, " whose Q block it does not own");
  const int64_t nq = blockTokens(pair.qBlock), nk = blockTokens(pair.kvBlock);
  const int64_t row = tokenStart[static_cast<size_t>(local)];
  const std::byte* kvp = kvSource(pair.kvBlock);
  const auto h = static_cast<int>(hq), hk = static_cast<int>(hkv), d = static_cast<int>(dim);
  const std::byte* qp = constLayer->q.data() + row * qRow * elem;
  return {pair,
          local,
          row,
          {qp, nq, h, d, options.dtype},
          {kvp, nk, hk, d, options.dtype},
          {kvp + nk * kRow * elem, nk, hk, d, options.dtype}};
}

void Executor::State::forwardPair(int32_t p) {
  const PairViews pv = pairViews(p);
  const plan::BlockPair& pair = pv.pair;
  const int64_t row = pv.row;
  const double start = Timeline::nowUs();
  kernels::forward(pv.q, pv.k, pv.v, maskOf(pair), partO.data(), partLse.data(),
                   {options.numThreads, options.softmaxScale});
  kernels::mergePartials(pv.q.numTokens, pv.q.numHeads, pv.q.headDim, layer->o.data() + row * qRow,
                         layer->lse.data() + row * hq, partO.data(), partLse.data());
  const double end = Timeline::nowUs();
  fwd.kernelMs += (end - start) / 1e3;
  fwd.flops += forwardFlops(plan.config.attention, pair.visible);
  if (qStream) qStream->countDown(pv.local);
  if (options.timeline) {
    options.timeline->add("fwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock),
                          0, start, end);
  }
}

void Executor::State::backwardPair(int32_t p) {
  const PairViews pv = pairViews(p);
  const plan::BlockPair& pair = pv.pair;
  const int64_t row = pv.row, nk = pv.k.numTokens;
  float* grad = nullptr;
  int32_t gradTransfer = -1;
  const int32_t kvLocal = localIndex[static_cast<size_t>(pair.kvBlock)];
  if (kvLocal >= 0) {
    grad = dkvOf(kvLocal);
  } else {
    gradTransfer = transferTo(pair.kvBlock, rank);
    auto& partial = gradPartial[gradTransfer];
    if (partial.empty()) partial.assign(static_cast<size_t>(2 * nk * kRow), 0.f);
    grad = partial.data();
  }
  const kernels::TensorView dov{dO.data() + row * qRow * elem, pv.q.numTokens, pv.q.numHeads,
                                pv.q.headDim, options.dtype};
  const double start = Timeline::nowUs();
  kernels::backward(pv.q, pv.k, pv.v, dov, constLayer->lse.data() + row * hq,
                    delta.data() + row * hq, maskOf(pair), dq.data() + row * qRow, grad,
                    grad + nk * kRow, {options.numThreads, options.softmaxScale});
  const double end = Timeline::nowUs();
  bwd.kernelMs += (end - start) / 1e3;
  bwd.flops += backwardFlops(plan.config.attention, pair.visible);
  if (qStream) qStream->countDown(pv.local);
  if (kvStream) kvStream->countDown(kvLocal);
  if (gradTransfer >= 0) countDownGrad(gradTransfer);
  if (options.timeline) {
    options.timeline->add("bwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock),
                          0, start, end);
  }
}

// A dK/dV partial is final once every pair this rank computes with the transfer's KV and every
// return of the receivers it relays the block to are added: it leaves then, not at the stage
// the plan names for it (sendGrad), whose wait then covers it. Sent earlier, it crosses the
// link while later pairs compute instead of after them.
void Executor::State::countGrads() {
  gradRemaining.assign(plan.transfers.size(), 0);
  gradSent.clear();
  for (const plan::Stage& st : stagesOf(rank)) {
    for (const int32_t p : st.compute) {
      const int32_t kv = plan.pairs[static_cast<size_t>(p)].kvBlock;
      if (localIndex[static_cast<size_t>(kv)] < 0)
        ++gradRemaining[static_cast<size_t>(transferTo(kv, rank))];
    }
    for (const int32_t t : st.recvGrad) {
      if (sourceLocal(t) >= 0) continue;
      ++gradRemaining[static_cast<size_t>(
          transferTo(plan.transfers[static_cast<size_t>(t)].block, rank))];
    }
  }
}

void Executor::State::countDownGrad(int32_t t) {
  if (--gradRemaining[static_cast<size_t>(t)] == 0) gradSent[t] = sendGrad(t);
}

RequestId Executor::State::sendGrad(int32_t t) {
  const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
  auto& partial = gradPartial[t];
  if (partial.empty()) partial.assign(static_cast<size_t>(2 * blockTokens(tr.block) * kRow), 0.f);
  const auto bytes = static_cast<int64_t>(partial.size() * sizeof(float));
  bwd.sentBytes += bytes;
  bwd.kvBytes += bytes;
  return transport.isend(tr.sender, tagGrad(t), asBytes(std::span<const float>(partial)));
}

void Executor::State::postKv(const plan::Stage& st, std::vector<RequestId>& requests) {
  PassStats& stats = inBackward ? bwd : fwd;
  for (const int32_t t : st.recv) {
    if (posted[static_cast<size_t>(t)]) continue;
    posted[static_cast<size_t>(t)] = 1;
    const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
    auto& buf = remote[t];
    buf.resize(static_cast<size_t>(tr.bytes));
    kvPending.emplace_back(transport.irecv(tr.sender, tagKv(t), buf), t);
    stats.recvBytes += tr.bytes;
  }
  for (const int32_t t : st.send) {
    if (posted[static_cast<size_t>(t)]) continue;
    const int32_t local = sourceLocal(t);
    // Backward, K and V are in place since the forward.
    if (!inBackward && local >= 0 && !haveBlock(local)) {
      posted[static_cast<size_t>(t)] = 1;
      deferred.push_back(t);
      continue;
    }
    postKvSend(t, requests);
  }
}

void Executor::State::postKvSend(int32_t t, std::vector<RequestId>& requests) {
  PassStats& stats = inBackward ? bwd : fwd;
  posted[static_cast<size_t>(t)] = 1;
  const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
  const std::byte* src = kvSource(tr.block);
  requests.push_back(transport.isend(tr.receiver, tagKv(t), {src, static_cast<size_t>(tr.bytes)}));
  stats.sentBytes += tr.bytes;
  stats.kvBytes += tr.bytes;
}

void Executor::State::computeDelta(int32_t local) {
  const auto l = static_cast<size_t>(local);
  const int64_t row = tokenStart[l], n = tokenStart[l + 1] - row;
  const auto h = static_cast<int>(hq), d = static_cast<int>(dim);
  kernels::computeDelta({constLayer->o.data() + row * qRow, n, h, d, kernels::DType::kFp32},
                        {dO.data() + row * qRow * elem, n, h, d, options.dtype},
                        delta.data() + row * hq);
}

void Executor::State::runStages() {
  const auto& stages = stagesOf(rank);
  PassStats& stats = inBackward ? bwd : fwd;
  const std::vector<int32_t> priority = priorityOrder();
  priorityFrom = 0;
  std::vector<RequestId> requests;
  for (size_t s = 0; s < stages.size(); ++s) {
    const plan::Stage& st = stages[s];
    currentStage = static_cast<int32_t>(s);
    requests.clear();
    if (s == 0) requests.swap(preposted);
    stageRequests = &requests;
    postKv(st, requests);
    for (const int32_t t : st.recvGrad) {
      const int64_t floats = 2 * blockTokens(plan.transfers[static_cast<size_t>(t)].block) * kRow;
      auto& buf = gradIn[t];
      buf.resize(static_cast<size_t>(floats));
      stats.recvBytes += floats * static_cast<int64_t>(sizeof(float));
      requests.push_back(transport.irecv(plan.transfers[static_cast<size_t>(t)].receiver,
                                         tagGrad(t), asWritableBytes(std::span<float>(buf))));
    }
    for (const int32_t t : st.sendGrad) {
      const auto sent = gradSent.find(t);
      requests.push_back(sent != gradSent.end() ? sent->second : sendGrad(t));
      gradRemaining[static_cast<size_t>(t)] = -1;  // sent: never again
    }
    const double commPosted = Timeline::nowUs();
    const size_t completed = computeStage(st, priority, requests);
    const double waitStart = Timeline::nowUs();
    waitAll(transport, std::span<const RequestId>(requests).subspan(completed));
    for (const auto& [request, t] : kvPending) {
      transport.wait(request);
      kvArrived[static_cast<size_t>(t)] = 1;
    }
    kvPending.clear();
    const double stageEnd = Timeline::nowUs();
    if (options.timeline) {
      if (!requests.empty()) {
        options.timeline->add(
            "stage " + std::to_string(s) + " messages (" + std::to_string(requests.size()) + ")", 1,
            commPosted, stageEnd);
      }
      if (stageEnd - waitStart > 1.0) options.timeline->add("wait", 2, waitStart, stageEnd);
    }
    for (const int32_t t : st.recvGrad) {
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      const int32_t local = localIndex[static_cast<size_t>(tr.block)];
      const auto& in = gradIn[t];
      float* into = nullptr;
      if (local >= 0) {
        into = dkvOf(local);
      } else {  // a relay: add into its own partial of the block
        auto& partial = gradPartial[transferTo(tr.block, rank)];
        if (partial.empty()) partial.assign(in.size(), 0.f);
        into = partial.data();
      }
      for (size_t i = 0; i < in.size(); ++i) into[i] += in[i];
      gradIn.erase(t);
      if (kvStream) kvStream->countDown(local);
      if (local < 0) countDownGrad(transferTo(tr.block, rank));
    }
    for (const int32_t t : st.sendGrad) {
      gradPartial.erase(t);
      gradSent.erase(t);
    }
    for (const int32_t t : st.release) remote.erase(t);
  }
  stageRequests = nullptr;
  FCP_CHECK(remote.empty() && gradIn.empty(), "rank ", rank, " ends a pass still holding buffers");
}

Executor::Executor(plan::Plan plan, Transport& transport, const ExecutorOptions& options)
    : state_(std::make_unique<State>(std::move(plan), transport, options)) {
  state_->setup();
}

Executor::~Executor() = default;
Executor::Executor(Executor&&) noexcept = default;
Executor& Executor::operator=(Executor&&) noexcept = default;

const plan::Plan& Executor::plan() const { return state_->plan; }
const ExecutorOptions& Executor::options() const { return state_->options; }
uint64_t Executor::id() const { return state_->id; }
int64_t Executor::userTokens() const { return state_->transparent.userTokens; }
int64_t Executor::localTokens() const { return state_->localTokens(); }
int64_t Executor::callTokens() const { return state_->index().userTokens; }
int64_t Executor::tagsNeeded() const { return state_->tagsNeeded(); }

void Executor::setTagKey(uint64_t key) {
  State& s = *state_;
  s.tagBase = s.options.firstTag +
              static_cast<int64_t>(key % static_cast<uint64_t>(s.tagWindows)) * s.tagsNeeded();
}
std::span<const int32_t> Executor::localSequence() const { return state_->localSeq; }
std::span<const int64_t> Executor::localPosition() const { return state_->localPos; }

void Executor::checkMove(bool intoFcp, size_t userBytes, size_t localBytes, int64_t rowBytes,
                         int64_t userStride, int64_t localStride) const {
  const char* what = intoFcp ? "dispatch" : "undispatch";
  if (rowBytes <= 0) {
    throwInvalidArgument(what, " of ", rowBytes, " bytes per token: expected at least 1");
  }
  checkStride(intoFcp ? "dispatch input" : "undispatch output", userStride, rowBytes, 1,
              userTokens());
  checkStride(intoFcp ? "dispatch output" : "undispatch input", localStride, rowBytes, 1,
              localTokens());
  const int64_t user = rowsExtentBytes(userTokens(), rowBytes, userStride),
                local = rowsExtentBytes(localTokens(), rowBytes, localStride);
  if (static_cast<int64_t>(userBytes) == user && static_cast<int64_t>(localBytes) == local) return;
  // The strides that give those sizes, where any is set.
  const auto strides = [](int64_t from, int64_t to) {
    return from == 0 && to == 0
               ? std::string()
               : " (row strides " + std::to_string(from) + " and " + std::to_string(to) + " bytes)";
  };
  if (intoFcp) {
    throwInvalidArgument("dispatch of ", userBytes, " bytes into ", localBytes, " bytes of ",
                         rowBytes, " per token: expected ", user, " and ", local,
                         strides(userStride, localStride));
  }
  throwInvalidArgument("undispatch of ", localBytes, " bytes into ", userBytes, " bytes of ",
                       rowBytes, " per token: expected ", local, " and ", user,
                       strides(localStride, userStride));
}

void Executor::dispatch(std::span<const std::byte> user, std::span<std::byte> local,
                        int64_t rowBytes, int64_t userStride, int64_t localStride) {
  State& s = *state_;
  checkMove(true, user.size(), local.size(), rowBytes, userStride, localStride);
  Field f{user.data(), nullptr,  Elem::kRaw,
          Elem::kRaw,  rowBytes, s.rows(local.data(), localStride > 0 ? localStride : rowBytes),
          userStride};
  detail::Inward in({s.transport, s.rank, s.transparent, nullptr, nullptr}, {f},
                    s.blockTag(kDispatch));
  const PendingGuard guard(s.transport, [&in] { in.keepBuffersForever(); });
  in.start();
  in.finish();
}

void Executor::undispatch(std::span<const std::byte> local, std::span<std::byte> user,
                          int64_t rowBytes, int64_t localStride, int64_t userStride) {
  State& s = *state_;
  checkMove(false, user.size(), local.size(), rowBytes, userStride, localStride);
  // The rows are only read: the accessor's type is shared with the inward direction.
  auto* base = const_cast<std::byte*>(local.data());
  Field f{nullptr,    user.data(), Elem::kRaw,
          Elem::kRaw, rowBytes,    s.rows(base, localStride > 0 ? localStride : rowBytes),
          userStride};
  detail::Outward out({s.transport, s.rank, s.transparent, nullptr, nullptr}, {f},
                      s.blockTag(kUndispatch), std::vector<int64_t>(s.localBlocks.size(), 0));
  const PendingGuard guard(s.transport, [&out] { out.keepBuffersForever(); });
  out.start();
  out.finish();
}

void Executor::forward(LayerState& layer, ConstRows q, ConstRows k, ConstRows v, Rows o, Rows lse) {
  State& s = *state_;
  const int64_t rows = s.index().userTokens;
  checkStride("q", q.strideBytes, s.qRow * s.elem, s.elem, rows);
  checkStride("k", k.strideBytes, s.kRow * s.elem, s.elem, rows);
  checkStride("v", v.strideBytes, s.kRow * s.elem, s.elem, rows);
  checkStride("o", o.strideBytes, s.qRow * s.elem, s.elem, rows);
  if (lse.data != nullptr) checkStride("lse", lse.strideBytes, s.hq * 4, 4, rows);
  s.fwd = {};
  const auto start = Clock::now();
  const double startUs = Timeline::nowUs();
  const auto tokens = static_cast<size_t>(s.localTokens());
  layer.batchId = 0;  // until this forward completes
  layer.q.resize(tokens * static_cast<size_t>(s.qRow * s.elem));
  layer.kv.resize(2 * tokens * static_cast<size_t>(s.kRow * s.elem));
  layer.o.assign(tokens * static_cast<size_t>(s.qRow), 0.f);
  layer.lse.assign(tokens * static_cast<size_t>(s.hq), -std::numeric_limits<float>::infinity());
  s.layer = &layer;
  s.constLayer = &layer;
  const int64_t qBytes = s.qRow * s.elem, kBytes = s.kRow * s.elem;
  auto in8 = [](ConstRows r) { return static_cast<const std::byte*>(r.data); };
  detail::Inward in(s.context(&s.fwd),
                    {{in8(q), nullptr, s.storage, s.storage, s.qRow, s.rows(layer.q.data(), qBytes),
                      q.strideBytes},
                     {in8(k), nullptr, s.storage, s.storage, s.kRow,
                      s.kvRows(layer.kv.data(), kBytes, false), k.strideBytes},
                     {in8(v), nullptr, s.storage, s.storage, s.kRow,
                      s.kvRows(layer.kv.data(), kBytes, true), v.strideBytes}},
                    s.blockTag(kInward));
  // LSE always travels (hq floats per token beside O's hq·d): the messages' layout must not
  // depend on what each rank asked for. A rank that does not want it keeps it in scratch.
  std::vector<float> unwantedLse;
  if (lse.data == nullptr) {
    unwantedLse.resize(static_cast<size_t>(rows * s.hq));
    lse = {unwantedLse.data(), 0};
  }
  std::vector<Field> outFields = {
      {nullptr, static_cast<std::byte*>(o.data), s.storage, Elem::kFp32, s.qRow,
       s.rows(reinterpret_cast<std::byte*>(layer.o.data()), s.qRow * 4), o.strideBytes},
      {nullptr, static_cast<std::byte*>(lse.data), Elem::kFp32, Elem::kFp32, s.hq,
       s.rows(reinterpret_cast<std::byte*>(layer.lse.data()), s.hq * 4), lse.strideBytes}};
  detail::Outward out(s.context(&s.fwd), std::move(outFields), s.blockTag(kForwardOut),
                      s.remainingPerBlock(false, false));
  // Destroyed before the streams when an error unwinds this pass (sends read layer.kv too).
  const PendingGuard guard(s.transport, [&] {
    in.keepBuffersForever();
    out.keepBuffersForever();
    s.keepBuffersForever();
    keepForever(layer.kv);
  });
  out.start();
  s.qStream = &out;
  s.beginPass(false, in);
  s.runStages();
  in.finish();
  out.finish();
  s.qStream = nullptr;
  s.inward = nullptr;
  s.layer = nullptr;
  s.constLayer = nullptr;
  layer.batchId = s.id;
  s.fwd.wallMs = msSince(start);
  if (s.options.timeline) s.options.timeline->add("forward", 2, startUs, Timeline::nowUs());
}

void Executor::checkBackward(const LayerState& layer) const {
  if (layer.batchId == 0) {
    throwInvalidArgument(
        "backward of a layer that holds no forward (none ran, it was released, "
        "or an error lost it): expected a forward with this batch (#",
        state_->id, ") first");
  }
  if (layer.batchId != state_->id) {
    throwInvalidArgument("backward of a layer whose last forward ran with batch #", layer.batchId,
                         ": expected a forward with this batch (#", state_->id, ") first");
  }
}

void Executor::backward(LayerState& layer, ConstRows dO, Rows dq, Rows dk, Rows dv) {
  State& s = *state_;
  checkBackward(layer);
  const int64_t rows = s.index().userTokens;
  checkStride("dO", dO.strideBytes, s.qRow * s.elem, s.elem, rows);
  checkStride("dq", dq.strideBytes, s.qRow * s.elem, s.elem, rows);
  checkStride("dk", dk.strideBytes, s.kRow * s.elem, s.elem, rows);
  checkStride("dv", dv.strideBytes, s.kRow * s.elem, s.elem, rows);
  s.bwd = {};
  const auto start = Clock::now();
  const double startUs = Timeline::nowUs();
  const auto tokens = static_cast<size_t>(s.localTokens());
  s.dO.assign(tokens * static_cast<size_t>(s.qRow * s.elem), std::byte{0});
  s.delta.assign(tokens * static_cast<size_t>(s.hq), 0.f);
  s.dq.assign(tokens * static_cast<size_t>(s.qRow), 0.f);
  s.dkv.assign(2 * tokens * static_cast<size_t>(s.kRow), 0.f);
  s.constLayer = &layer;
  auto f8 = [](std::vector<float>& t) { return reinterpret_cast<std::byte*>(t.data()); };
  detail::Inward in(s.context(&s.bwd),
                    {{static_cast<const std::byte*>(dO.data), nullptr, s.storage, s.storage, s.qRow,
                      s.rows(s.dO.data(), s.qRow * s.elem), dO.strideBytes}},
                    s.blockTag(kInward));
  detail::Outward qOut(s.context(&s.bwd),
                       {{nullptr, static_cast<std::byte*>(dq.data), s.storage, Elem::kFp32, s.qRow,
                         s.rows(f8(s.dq), s.qRow * 4), dq.strideBytes}},
                       s.blockTag(kBackwardQ), s.remainingPerBlock(true, false));
  detail::Outward kvOut(s.context(&s.bwd),
                        {{nullptr, static_cast<std::byte*>(dk.data), s.storage, Elem::kFp32, s.kRow,
                          s.kvRows(f8(s.dkv), s.kRow * 4, false), dk.strideBytes},
                         {nullptr, static_cast<std::byte*>(dv.data), s.storage, Elem::kFp32, s.kRow,
                          s.kvRows(f8(s.dkv), s.kRow * 4, true), dv.strideBytes}},
                        s.blockTag(kBackwardKv), s.remainingPerBlock(true, true));
  // Destroyed before the streams when an error unwinds this pass. The KV sends read the
  // layer's K|V, which the caller would free (a Python layer's, once autograd drops it).
  const PendingGuard guard(s.transport, [&] {
    in.keepBuffersForever();
    qOut.keepBuffersForever();
    kvOut.keepBuffersForever();
    s.keepBuffersForever();
    keepForever(layer.kv);
    layer.batchId = 0;  // its K|V is gone: a backward needs a forward again
  });
  qOut.start();
  kvOut.start();
  s.qStream = &qOut;
  s.kvStream = &kvOut;
  s.beginPass(true, in);
  s.runStages();
  in.finish();
  FCP_CHECK(s.gradPartial.empty(), "rank ", s.rank, " ends the backward holding dK/dV partials");
  qOut.finish();
  kvOut.finish();
  s.qStream = s.kvStream = nullptr;
  s.inward = nullptr;
  s.constLayer = nullptr;
  s.bwd.wallMs = msSince(start);
  if (s.options.timeline) s.options.timeline->add("backward", 2, startUs, Timeline::nowUs());
}

const PassStats& Executor::forwardStats() const { return state_->fwd; }
const PassStats& Executor::backwardStats() const { return state_->bwd; }

namespace {

// The plan agreement's one allreduce (kMax) carries: this rank's digest, its complement (so
// the largest and the smallest digest come back in one call); a failure key, (ranks - rank) *
// 8 + code + 1 on a rank that could not plan and 0 elsewhere, whose maximum names the lowest
// failed rank and its error code; the transport's CallLedger state, its kind and call index,
// and its count of calls, each with its negation.
constexpr size_t kAgreementValues = 9;
constexpr int64_t kCodeSlots = 8;
static_assert(static_cast<int64_t>(ErrorCode::kInternal) + 1 < kCodeSlots);

int64_t failureKey(int rank, int ranks, ErrorCode code) {
  return (int64_t{ranks} - rank) * kCodeSlots + static_cast<int64_t>(code) + 1;
}

}  // namespace

void checkPlanAgreement(const plan::Plan& plan, Transport& transport) {
  checkPlanAgreement(plan::planDigest(plan), transport);
}

void checkPlanAgreement(uint64_t digest, Transport& transport) {
  const CallLedger::State left = transport.calls().state();
  const int64_t calls = transport.calls().count();
  int64_t values[kAgreementValues] = {static_cast<int64_t>(digest >> 1),
                                      static_cast<int64_t>(~(digest >> 1)),
                                      0,
                                      left.kind,
                                      -left.kind,
                                      left.call,
                                      -left.call,
                                      calls,
                                      -calls};
  transport.allreduce(values, ReduceOp::kMax);
  if (values[2] > 0) {
    const int failed = transport.size() - static_cast<int>(values[2] / kCodeSlots);
    const auto code = static_cast<ErrorCode>(values[2] % kCodeSlots - 1);
    throw Error(code, "rank " + std::to_string(transport.rank()) + ": rank " +
                          std::to_string(failed) +
                          " could not plan this batch (its error there, of kind '" +
                          std::string(errorCodeName(code)) +
                          "', says why): expected a batch every rank can plan");
  }
  if (values[3] != 0) {
    // Safe only where every rank threw in the same call before it reached the transport (or
    // there is no other rank): else messages of that call may still arrive (CallLedger).
    const int64_t kindMin = -values[4];
    if (transport.size() > 1 && (values[3] != 1 || kindMin != 1 || values[5] != -values[6])) {
      const char* how = kindMin == 0     ? "on some ranks but not all"
                        : values[3] == 2 ? "after it had sent or posted messages"
                                         : "in different calls on different ranks";
      throw Error(ErrorCode::kTransport,
                  "rank " + std::to_string(transport.rank()) +
                      ": a call of an earlier batch over this transport threw " + how +
                      ", so messages of that call may still arrive (this rank's: " +
                      (left.kind == 0 ? std::string("none threw")
                                      : "call #" + std::to_string(left.call) +
                                            (left.kind == 1 ? " threw in its checks" : " threw")) +
                      "): expected a new transport (a new communicator or process group)");
    }
    transport.calls().clearIf(left);
  }
  if (values[7] != -values[8]) {
    // A call one rank made alone (attention under a condition true on one rank only) pairs
    // with another rank's next call, same kind and batch: its messages match, and nothing
    // failed. It shows here, as a count that differs.
    const std::string counts = "this rank " + std::to_string(calls) + "; from " +
                               std::to_string(-values[8]) + " to " + std::to_string(values[7]) +
                               " over the ranks";
    throw Error(ErrorCode::kTransport,
                "rank " + std::to_string(transport.rank()) +
                    ": the ranks made different numbers of FCP calls over this transport (" +
                    counts +
                    "), so some calls met another rank's other call: expected the same calls in "
                    "the same order on every rank, and a new transport (a new communicator or "
                    "process group)");
  }
  const auto largest = static_cast<uint64_t>(values[0]);
  const auto smallest = static_cast<uint64_t>(~values[1]);
  if (largest != smallest) {
    char text[200];
    std::snprintf(
        text, sizeof(text),
        "rank %d: the ranks built different plans (plan digests range over %016llx..%016llx, "
        "this rank's is %016llx): every rank must use the same batch, seed and flags",
        transport.rank(), static_cast<unsigned long long>(smallest),
        static_cast<unsigned long long>(largest), static_cast<unsigned long long>(digest >> 1));
    throw Error(ErrorCode::kInvalidPlan, text);
  }
}

void failPlanAgreement(std::exception_ptr failure, Transport& transport) {
  ErrorCode code = ErrorCode::kInternal;
  try {
    std::rethrow_exception(failure);
  } catch (const Error& e) {
    code = e.code();
  } catch (...) {
  }
  constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
  int64_t values[kAgreementValues] = {
      kNone, kNone, failureKey(transport.rank(), transport.size(), code),
      kNone, kNone, kNone,
      kNone, kNone, kNone};
  try {
    transport.allreduce(values, ReduceOp::kMax);
  } catch (...) {
    // The planning error is what went wrong here; a transport failing as well is secondary.
  }
  std::rethrow_exception(failure);
}

}  // namespace fcp::runtime
