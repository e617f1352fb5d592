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
// The reshuffles (reshuffle.h) hide behind compute as the plan intends: a block is *ready* when
// none of its tokens come from another rank; the first stage's pairs between ready blocks run
// while the inward reshuffle is in flight, and a block's outputs leave as soon as its
// remaining count (pairs still to compute, and backward the dK/dV returns still to add) reaches
// zero, while later blocks compute. In the dispatched layout every block is ready and every
// piece local: the same code moves nothing.
//
// Tags, from options.firstTag: +0 inward reshuffle, +1 dispatch, +8 + 2t a transfer's KV and
// +8 + 2t + 1 its dK/dV partial, then per outward stream (forward O/LSE, backward dQ, backward
// dK/dV, undispatch) one tag per block.
#include "fcp/runtime/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>

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

constexpr int kInwardTag = 0;
constexpr int kDispatchTag = 1;
constexpr int kFirstTransferTag = 8;
constexpr int kNumOutwardStreams = 4;
enum OutwardStream { kForwardOut = 0, kBackwardQ = 1, kBackwardKv = 2, kUndispatch = 3 };

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::atomic<uint64_t> nextExecutorId{1};

}  // namespace

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
  std::vector<char> posted;             // per transfer: its KV receive or send was posted
  std::vector<RequestId> preposted;

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
  int tag(int64_t offset) const { return static_cast<int>(options.firstTag + offset); }
  int tagKv(int32_t t) const { return tag(kFirstTransferTag + 2 * int64_t{t}); }
  int tagGrad(int32_t t) const { return tag(kFirstTransferTag + 2 * int64_t{t} + 1); }
  int outwardTag(int stream) const {
    return tag(kFirstTransferTag + 2 * static_cast<int64_t>(plan.transfers.size()) +
               stream * static_cast<int64_t>(plan.blocks.size()));
  }
  int64_t tagsNeeded() const {
    return kFirstTransferTag + 2 * static_cast<int64_t>(plan.transfers.size()) +
           kNumOutwardStreams * static_cast<int64_t>(plan.blocks.size());
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
  void runEarlyPairs(bool backward, std::vector<char>& done, detail::Inward& in);
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
  void runStages(bool backward, const std::vector<char>& done);
  // Posts the stage's KV receives and sends not posted yet; with `sendable`, only the sends
  // whose block it accepts (the rest wait for the stage itself).
  void postKv(const plan::Stage& st, std::vector<RequestId>& requests, PassStats& stats,
              const std::function<bool(int32_t)>* sendable);
  // The first stage's KV messages that need no reshuffled tokens go out before the inward
  // reshuffle completes, so that they travel while the early pairs compute.
  void prepostFirstStage(bool backward);
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
  if (options.firstTag < 0 || tagsNeeded() > int64_t{transport.maxTag()} - options.firstTag) {
    throwInvalidArgument(
        "plan needs tags ", options.firstTag, " to ", options.firstTag + tagsNeeded(), " (",
        plan.transfers.size(), " transfers, ", plan.blocks.size(),
        " blocks): expected at most the transport's largest tag ", transport.maxTag());
  }
  if (options.numThreads < 1 || options.numThreads > kMaxKernelThreads) {
    throwInvalidArgument("invalid kernel thread count ", options.numThreads, ": expected 1 to ",
                         kMaxKernelThreads);
  }
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
  dispatched.ready.assign(localBlocks.size(), 1);
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
  for (const plan::ReshufflePiece& piece : plan.reshuffle) {
    if (piece.userWorker != rank && piece.fcpWorker != rank) continue;
    auto it = std::upper_bound(chunks.begin(), chunks.end(), piece.begin,
                               [](int64_t x, const ChunkAt& c) { return x < c.begin; });
    FCP_CHECK(it != chunks.begin(), "reshuffle piece before every chunk");
    --it;
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
  transparent.ready.assign(localBlocks.size(), 1);
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == rank) continue;
    for (const Piece& p : transparent.inbound[peer])
      transparent.ready[static_cast<size_t>(p.localBlock)] = 0;
  }
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
      const int32_t local =
          localIndex[static_cast<size_t>(plan.transfers[static_cast<size_t>(t)].block)];
      if (local >= 0) ++remaining[static_cast<size_t>(local)];
    }
  }
  return remaining;
}

// The first stage's pairs whose Q and KV blocks are both ready run before the inward
// reshuffle completes; `done` marks them so that the stage skips them.
// Pairs of the first stage whose blocks are all local run while the inward reshuffle flies;
// once it has arrived the stages take over, so that the blocks whose results travel back
// (runStages runs them first) are not held behind local work.
void Executor::State::runEarlyPairs(bool backward, std::vector<char>& done, detail::Inward& in) {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  const std::vector<char>& ready = index().ready;
  done.assign(plan.pairs.size(), 0);
  if (stages.empty()) return;
  for (const int32_t p : stages.front().compute) {
    if (in.arrived()) return;
    const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
    const int32_t ql = localIndex[static_cast<size_t>(pair.qBlock)],
                  kl = localIndex[static_cast<size_t>(pair.kvBlock)];
    if (ql < 0 || kl < 0 || !ready[static_cast<size_t>(ql)] || !ready[static_cast<size_t>(kl)])
      continue;
    backward ? backwardPair(p) : forwardPair(p);
    done[static_cast<size_t>(p)] = 1;
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
                   {options.numThreads});
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
  const int32_t kvLocal = localIndex[static_cast<size_t>(pair.kvBlock)];
  if (kvLocal >= 0) {
    grad = dkvOf(kvLocal);
  } else {
    auto& partial = gradPartial[transferTo(pair.kvBlock, rank)];
    if (partial.empty()) partial.assign(static_cast<size_t>(2 * nk * kRow), 0.f);
    grad = partial.data();
  }
  const kernels::TensorView dov{dO.data() + row * qRow * elem, pv.q.numTokens, pv.q.numHeads,
                                pv.q.headDim, options.dtype};
  const double start = Timeline::nowUs();
  kernels::backward(pv.q, pv.k, pv.v, dov, constLayer->lse.data() + row * hq,
                    delta.data() + row * hq, maskOf(pair), dq.data() + row * qRow, grad,
                    grad + nk * kRow, {options.numThreads});
  const double end = Timeline::nowUs();
  bwd.kernelMs += (end - start) / 1e3;
  bwd.flops += backwardFlops(plan.config.attention, pair.visible);
  if (qStream) qStream->countDown(pv.local);
  if (kvStream) kvStream->countDown(kvLocal);
  if (options.timeline) {
    options.timeline->add("bwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock),
                          0, start, end);
  }
}

void Executor::State::postKv(const plan::Stage& st, std::vector<RequestId>& requests,
                             PassStats& stats, const std::function<bool(int32_t)>* sendable) {
  for (const int32_t t : st.recv) {
    if (posted[static_cast<size_t>(t)]) continue;
    posted[static_cast<size_t>(t)] = 1;
    const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
    auto& buf = remote[t];
    buf.resize(static_cast<size_t>(tr.bytes));
    requests.push_back(transport.irecv(tr.sender, tagKv(t), buf));
    stats.recvBytes += tr.bytes;
  }
  for (const int32_t t : st.send) {
    const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
    if (posted[static_cast<size_t>(t)] || (sendable && !(*sendable)(tr.block))) continue;
    posted[static_cast<size_t>(t)] = 1;
    const std::byte* src = kvSource(tr.block);
    requests.push_back(
        transport.isend(tr.receiver, tagKv(t), {src, static_cast<size_t>(tr.bytes)}));
    stats.sentBytes += tr.bytes;
    stats.kvBytes += tr.bytes;
  }
}

void Executor::State::prepostFirstStage(bool backward) {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  posted.assign(plan.transfers.size(), 0);
  preposted.clear();
  if (stages.empty()) return;
  // Backward, K and V are in place since the forward; forward, only ready blocks are.
  const std::function<bool(int32_t)> sendable = [this, backward](int32_t block) {
    const int32_t local = localIndex[static_cast<size_t>(block)];
    return local >= 0 && (backward || index().ready[static_cast<size_t>(local)]);
  };
  postKv(stages.front(), preposted, backward ? bwd : fwd, &sendable);
}

void Executor::State::runStages(bool backward, const std::vector<char>& done) {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  PassStats& stats = backward ? bwd : fwd;
  std::vector<RequestId> requests;
  std::vector<int32_t> order;
  for (size_t s = 0; s < stages.size(); ++s) {
    const plan::Stage& st = stages[s];
    requests.clear();
    if (s == 0) requests.swap(preposted);
    postKv(st, requests, stats, nullptr);
    for (const int32_t t : st.recvGrad) {
      const int64_t floats = 2 * blockTokens(plan.transfers[static_cast<size_t>(t)].block) * kRow;
      auto& buf = gradIn[t];
      buf.resize(static_cast<size_t>(floats));
      stats.recvBytes += floats * static_cast<int64_t>(sizeof(float));
      requests.push_back(transport.irecv(plan.transfers[static_cast<size_t>(t)].receiver,
                                         tagGrad(t), asWritableBytes(std::span<float>(buf))));
    }
    for (const int32_t t : st.sendGrad) {
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      auto& partial = gradPartial[t];
      if (partial.empty())
        partial.assign(static_cast<size_t>(2 * blockTokens(tr.block) * kRow), 0.f);
      requests.push_back(
          transport.isend(tr.sender, tagGrad(t), asBytes(std::span<const float>(partial))));
      const auto bytes = static_cast<int64_t>(partial.size() * sizeof(float));
      stats.sentBytes += bytes;
      stats.kvBytes += bytes;
    }
    const double commPosted = Timeline::nowUs();
    // Within a stage, pairs run grouped by Q block (stable), so that blocks finish one after
    // another and their outputs leave while the rest compute; Q blocks whose tokens came from
    // another rank first, as their outputs must travel back.
    order.assign(st.compute.begin(), st.compute.end());
    const std::vector<char>& ready = index().ready;
    const auto key = [&](int32_t p) {
      const int32_t q = plan.pairs[static_cast<size_t>(p)].qBlock;
      return std::pair{ready[static_cast<size_t>(localIndex[static_cast<size_t>(q)])] != 0, q};
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return key(a) < key(b); });
    for (const int32_t p : order) {
      if (done[static_cast<size_t>(p)]) continue;
      backward ? backwardPair(p) : forwardPair(p);
    }
    const double computeEnd = Timeline::nowUs();
    waitAll(transport, requests);
    const double stageEnd = Timeline::nowUs();
    if (options.timeline) {
      if (!requests.empty()) {
        options.timeline->add(
            "stage " + std::to_string(s) + " messages (" + std::to_string(requests.size()) + ")", 1,
            commPosted, stageEnd);
      }
      if (stageEnd - computeEnd > 1.0) options.timeline->add("wait", 2, computeEnd, stageEnd);
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
    }
    for (const int32_t t : st.sendGrad) gradPartial.erase(t);
    for (const int32_t t : st.release) remote.erase(t);
  }
  FCP_CHECK(remote.empty() && gradIn.empty(), "rank ", rank, " ends a pass still holding buffers");
}

Executor::Executor(plan::Plan plan, Transport& transport, const ExecutorOptions& options)
    : state_(std::make_unique<State>(std::move(plan), transport, options)) {
  state_->setup();
}

Executor::~Executor() = default;

const plan::Plan& Executor::plan() const { return state_->plan; }
const ExecutorOptions& Executor::options() const { return state_->options; }
uint64_t Executor::id() const { return state_->id; }
int64_t Executor::userTokens() const { return state_->transparent.userTokens; }
int64_t Executor::localTokens() const { return state_->localTokens(); }
int64_t Executor::callTokens() const { return state_->index().userTokens; }
int64_t Executor::tagsNeeded() const { return state_->tagsNeeded(); }
std::span<const int32_t> Executor::localSequence() const { return state_->localSeq; }
std::span<const int64_t> Executor::localPosition() const { return state_->localPos; }

void Executor::dispatch(std::span<const std::byte> user, std::span<std::byte> local,
                        int64_t rowBytes) {
  State& s = *state_;
  if (rowBytes <= 0 || static_cast<int64_t>(user.size()) != userTokens() * rowBytes ||
      static_cast<int64_t>(local.size()) != localTokens() * rowBytes) {
    throwInvalidArgument("dispatch of ", user.size(), " bytes into ", local.size(), " bytes of ",
                         rowBytes, " per token: expected ", userTokens() * rowBytes, " and ",
                         localTokens() * rowBytes);
  }
  Field f{user.data(), nullptr, Elem::kRaw, Elem::kRaw, rowBytes, s.rows(local.data(), rowBytes)};
  detail::Inward in({s.transport, s.rank, s.transparent, nullptr, nullptr}, {f},
                    s.tag(kDispatchTag));
  const PendingGuard guard(s.transport, [&in] { in.keepBuffersForever(); });
  in.post();
  in.finish();
}

void Executor::undispatch(std::span<const std::byte> local, std::span<std::byte> user,
                          int64_t rowBytes) {
  State& s = *state_;
  if (rowBytes <= 0 || static_cast<int64_t>(user.size()) != userTokens() * rowBytes ||
      static_cast<int64_t>(local.size()) != localTokens() * rowBytes) {
    throwInvalidArgument("undispatch of ", local.size(), " bytes into ", user.size(), " bytes of ",
                         rowBytes, " per token: expected ", localTokens() * rowBytes, " and ",
                         userTokens() * rowBytes);
  }
  // The rows are only read: the accessor's type is shared with the inward direction.
  auto* base = const_cast<std::byte*>(local.data());
  Field f{nullptr, user.data(), Elem::kRaw, Elem::kRaw, rowBytes, s.rows(base, rowBytes)};
  detail::Outward out({s.transport, s.rank, s.transparent, nullptr, nullptr}, {f},
                      s.outwardTag(kUndispatch), std::vector<int64_t>(s.localBlocks.size(), 0));
  const PendingGuard guard(s.transport, [&out] { out.keepBuffersForever(); });
  out.start();
  out.finish();
}

void Executor::forward(LayerState& layer, const void* q, const void* k, const void* v, void* o,
                       float* lse) {
  State& s = *state_;
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
  auto in8 = [](const void* p) { return static_cast<const std::byte*>(p); };
  detail::Inward in(
      s.context(&s.fwd),
      {{in8(q), nullptr, s.storage, s.storage, s.qRow, s.rows(layer.q.data(), qBytes)},
       {in8(k), nullptr, s.storage, s.storage, s.kRow, s.kvRows(layer.kv.data(), kBytes, false)},
       {in8(v), nullptr, s.storage, s.storage, s.kRow, s.kvRows(layer.kv.data(), kBytes, true)}},
      s.tag(kInwardTag));
  // LSE always travels (hq floats per token beside O's hq·d): the messages' layout must not
  // depend on what each rank asked for. A rank that does not want it keeps it in scratch.
  std::vector<float> unwantedLse;
  if (lse == nullptr) {
    unwantedLse.resize(static_cast<size_t>(s.index().userTokens * s.hq));
    lse = unwantedLse.data();
  }
  std::vector<Field> outFields = {
      {nullptr, static_cast<std::byte*>(o), s.storage, Elem::kFp32, s.qRow,
       s.rows(reinterpret_cast<std::byte*>(layer.o.data()), s.qRow * 4)},
      {nullptr, reinterpret_cast<std::byte*>(lse), Elem::kFp32, Elem::kFp32, s.hq,
       s.rows(reinterpret_cast<std::byte*>(layer.lse.data()), s.hq * 4)}};
  detail::Outward out(s.context(&s.fwd), std::move(outFields), s.outwardTag(kForwardOut),
                      s.remainingPerBlock(false, false));
  // Destroyed before the streams when an error unwinds this pass (sends read layer.kv too).
  const PendingGuard guard(s.transport, [&] {
    in.keepBuffersForever();
    out.keepBuffersForever();
    s.keepBuffersForever();
    keepForever(layer.kv);
  });
  in.post();
  out.start();
  s.qStream = &out;
  s.prepostFirstStage(false);
  std::vector<char> done;
  s.runEarlyPairs(false, done, in);
  in.finish();
  s.runStages(false, done);
  out.finish();
  s.qStream = nullptr;
  s.layer = nullptr;
  s.constLayer = nullptr;
  layer.batchId = s.id;
  s.fwd.wallMs = msSince(start);
  if (s.options.timeline) s.options.timeline->add("forward", 2, startUs, Timeline::nowUs());
}

void Executor::backward(const LayerState& layer, const void* dO, void* dq, void* dk, void* dv) {
  State& s = *state_;
  if (layer.batchId != s.id) {
    throwInvalidArgument(
        "backward of a layer whose last forward ran with ",
        layer.batchId == 0 ? std::string("no batch") : "batch #" + std::to_string(layer.batchId),
        ": expected a forward with this batch (#", s.id, ") first");
  }
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
                    {{static_cast<const std::byte*>(dO), nullptr, s.storage, s.storage, s.qRow,
                      s.rows(s.dO.data(), s.qRow * s.elem)}},
                    s.tag(kInwardTag));
  detail::Outward qOut(s.context(&s.bwd),
                       {{nullptr, static_cast<std::byte*>(dq), s.storage, Elem::kFp32, s.qRow,
                         s.rows(f8(s.dq), s.qRow * 4)}},
                       s.outwardTag(kBackwardQ), s.remainingPerBlock(true, false));
  detail::Outward kvOut(s.context(&s.bwd),
                        {{nullptr, static_cast<std::byte*>(dk), s.storage, Elem::kFp32, s.kRow,
                          s.kvRows(f8(s.dkv), s.kRow * 4, false)},
                         {nullptr, static_cast<std::byte*>(dv), s.storage, Elem::kFp32, s.kRow,
                          s.kvRows(f8(s.dkv), s.kRow * 4, true)}},
                        s.outwardTag(kBackwardKv), s.remainingPerBlock(true, true));
  // Destroyed before the streams when an error unwinds this pass.
  const PendingGuard guard(s.transport, [&] {
    in.keepBuffersForever();
    qOut.keepBuffersForever();
    kvOut.keepBuffersForever();
    s.keepBuffersForever();
  });
  in.post();
  qOut.start();
  kvOut.start();
  s.qStream = &qOut;
  s.kvStream = &kvOut;
  // D = rowsum(dO ∘ O) per block: ready blocks first, so that their pairs can start.
  auto computeDelta = [&s, &layer](bool readyBlocks) {
    for (size_t local = 0; local < s.localBlocks.size(); ++local) {
      if (static_cast<bool>(s.index().ready[local]) != readyBlocks) continue;
      const int64_t row = s.tokenStart[local], n = s.tokenStart[local + 1] - row;
      const auto h = static_cast<int>(s.hq), d = static_cast<int>(s.dim);
      kernels::computeDelta({layer.o.data() + row * s.qRow, n, h, d, kernels::DType::kFp32},
                            {s.dO.data() + row * s.qRow * s.elem, n, h, d, s.options.dtype},
                            s.delta.data() + row * s.hq);
    }
  };
  s.prepostFirstStage(true);
  computeDelta(true);
  std::vector<char> done;
  s.runEarlyPairs(true, done, in);
  in.finish();
  computeDelta(false);
  s.runStages(true, done);
  FCP_CHECK(s.gradPartial.empty(), "rank ", s.rank, " ends the backward holding dK/dV partials");
  qOut.finish();
  kvOut.finish();
  s.qStream = s.kvStream = nullptr;
  s.constLayer = nullptr;
  s.bwd.wallMs = msSince(start);
  if (s.options.timeline) s.options.timeline->add("backward", 2, startUs, Timeline::nowUs());
}

const PassStats& Executor::forwardStats() const { return state_->fwd; }
const PassStats& Executor::backwardStats() const { return state_->bwd; }

uint64_t planDigest(const plan::Plan& plan) {
  uint64_t hash = 14695981039346656037ull;
  for (const char c : plan::planToJson(plan)) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ull;
  }
  return hash;
}

void checkPlanAgreement(const plan::Plan& plan, Transport& transport) {
  const uint64_t digest = planDigest(plan);
  // Max of the digest and of its complement gives the largest and the smallest in one call.
  int64_t values[2] = {static_cast<int64_t>(digest >> 1), static_cast<int64_t>(~(digest >> 1))};
  transport.allreduce(values, ReduceOp::kMax);
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

}  // namespace fcp::runtime
