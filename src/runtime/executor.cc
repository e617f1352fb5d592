// The executor: one worker's stages of a Plan, forward and backward.
//
// Terms. The *local blocks* are the blocks this rank owns; their tokens are stored one block
// after another in the *FCP layout*: Q, O, dO, dQ as rows of Hq·d floats, LSE and delta as rows
// of Hq, and per block a *KV buffer* [K rows | V rows] (rows of Hkv·d), which is exactly what a
// transfer sends, so a send needs no copy. A *remote buffer* holds a received transfer's K|V
// until the stage that releases it. Backward, a *grad partial* of a received transfer
// accumulates the dK|dV this rank computes with it (and, for a relay, the partials its own
// receivers return) until the plan's sendGrad sends it back to the transfer's sender.
// A stage is: post its receives and sends, compute its pairs (their KV is local or arrived in
// an earlier stage), wait for its messages, add returned dK/dV partials in, free its releases.
// The reshuffles hide behind compute as the plan intends: a block is *ready* when none of its
// tokens come from another rank; the first stage's pairs between ready blocks run while the
// inward reshuffle is in flight, and a block's outputs leave (one message per block and user
// rank) as soon as its *remaining* count (pairs still to compute, and backward the dK/dV
// returns still to add) reaches zero, while later blocks compute.
#include "fcp/runtime/executor.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>

#include "fcp/core/cost_model.h"
#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/json.h"

namespace fcp::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// Tags: the reshuffles use the first few, transfer t uses kFirstTransferTag + 2t (its KV) and
// kFirstTransferTag + 2t + 1 (its dK/dV partial).
constexpr int kReshuffleInTag = 1;
constexpr int kReshuffleOutTag = 2;
constexpr int kFirstTransferTag = 8;

/// A run of consecutive tokens moving between the user layout and the FCP layout.
struct Piece {
  int64_t userOffset = 0;  ///< token index inside the user worker's slice
  int32_t block = 0;       ///< the block the tokens belong to
  int32_t localBlock = 0;  ///< index among the FCP worker's local blocks (on the FCP worker)
  int64_t blockOffset = 0; ///< token index inside that block
  int64_t numTokens = 0;
};

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

struct Executor::State {
  const plan::Plan& plan;
  Transport& transport;
  ExecutorOptions options;
  int rank = 0;
  int64_t hq = 0, hkv = 0, dim = 0;
  int64_t qRow = 0, kRow = 0;  // floats per token
  kernels::MaskKind mask = kernels::MaskKind::kCausal;

  std::vector<int64_t> userStart;
  std::vector<int32_t> localIndex;  // block -> local index, or -1
  std::vector<int32_t> localBlocks; // local index -> block
  std::vector<int64_t> tokenStart;  // local index -> first token in the FCP layout (+ total)
  std::vector<std::vector<kernels::Segment>> segments;  // per block (only local + needed)
  std::vector<std::vector<Piece>> inbound;   // [user worker] pieces this rank receives
  std::vector<std::vector<Piece>> outbound;  // [fcp worker] pieces this rank sends

  // FCP-layout tensors.
  std::vector<float> q, kv, o, lse, dO, delta, dq, dkv;
  std::vector<float> partO, partLse;
  std::unordered_map<int32_t, std::vector<float>> remote;  // transfer -> K|V
  std::unordered_map<int32_t, std::vector<float>> gradPartial, gradIn;
  PassStats fwd, bwd;

  State(const plan::Plan& p, Transport& t, const ExecutorOptions& opts)
      : plan(p), transport(t), options(opts) {}

  int64_t localTokens() const { return tokenStart.back(); }
  int64_t blockTokens(int32_t block) const { return plan.blocks[static_cast<size_t>(block)].numTokens(); }
  float* kvOf(int32_t local) { return kv.data() + 2 * tokenStart[static_cast<size_t>(local)] * kRow; }
  float* dkvOf(int32_t local) { return dkv.data() + 2 * tokenStart[static_cast<size_t>(local)] * kRow; }
  int tagKv(int32_t t) const { return kFirstTransferTag + 2 * t; }
  // Outward streams after the transfers' tags: stream i uses one tag per block.
  int outwardTag(int stream) const {
    return kFirstTransferTag + 2 * static_cast<int>(plan.transfers.size()) +
           stream * static_cast<int>(plan.blocks.size());
  }
  // Row of token `tok` of local block `local` in an FCP-layout tensor of `width` floats per token.
  std::function<float*(int32_t, int64_t)> rowOf(std::vector<float>& t, int64_t width) {
    return [this, &t, width](int32_t local, int64_t tok) {
      return t.data() + (tokenStart[static_cast<size_t>(local)] + tok) * width;
    };
  }
  // Row of K (or V) of a block in a per-block [K | V] tensor.
  std::function<float*(int32_t, int64_t)> kRowOf(std::vector<float>& t, bool valueHalf) {
    return [this, &t, valueHalf](int32_t local, int64_t tok) {
      const auto l = static_cast<size_t>(local);
      const int64_t n = tokenStart[l + 1] - tokenStart[l];
      return t.data() + (2 * tokenStart[l] + (valueHalf ? n : 0) + tok) * kRow;
    };
  }
  int tagGrad(int32_t t) const { return kFirstTransferTag + 2 * t + 1; }
  int32_t transferTo(int32_t block, int32_t receiver) const {
    const int32_t t = plan::findTransfer(plan.transfers, block, receiver);
    FCP_CHECK(t >= 0, "no transfer of block ", block, " to rank ", receiver);
    return t;
  }

  void setup();
  // A tensor that moves between layouts: its user-layout rows (`user` inward, `userOut`
  // outward), floats per row, and its row in the FCP layout (local block, token).
  struct Field {
    const float* user = nullptr;
    float* userOut = nullptr;
    int64_t width = 0;
    std::function<float*(int32_t, int64_t)> fcp;
  };
  // The inward reshuffle in flight.
  struct Inward {
    std::vector<Field> fields;
    std::vector<std::vector<float>> sendBufs, recvBufs;
    std::vector<RequestId> requests;
    double startUs = 0;
  };
  // One outward stream: blocks leave as their remaining count reaches zero.
  struct Outward {
    std::vector<Field> fields;
    int tagBase = 0;
    std::vector<int64_t> remaining;  // per local block
    std::vector<std::vector<float>> sendBufs;
    std::vector<RequestId> requests;
    struct Incoming {
      int peer;
      int32_t block;
      std::vector<float> buffer;
      RequestId request;
    };
    std::vector<Incoming> incoming;
  };
  std::vector<char> ready;  // per local block: no token comes from another rank
  Outward* qStream = nullptr;   // outputs of Q blocks in the current pass
  Outward* kvStream = nullptr;  // backward: dK/dV of KV blocks
  int64_t rowWidth(const std::vector<Field>& fields) const {
    int64_t total = 0;
    for (const Field& f : fields) total += f.width;
    return total;
  }
  void postInward(Inward& in, PassStats& stats);
  void finishInward(Inward& in);
  void startOutward(Outward& out, bool backward, bool kvSide, PassStats& stats);
  void blockDone(Outward& out, int32_t local, PassStats& stats);
  void finishOutward(Outward& out);
  void runEarlyPairs(bool backward, std::vector<char>& done);
  const float* kvSource(int32_t block);
  kernels::BlockMask maskOf(const plan::BlockPair& pair) const {
    return {mask, segments[static_cast<size_t>(pair.qBlock)], segments[static_cast<size_t>(pair.kvBlock)]};
  }
  /// What both passes need to compute pair p: its Q rows here and its K, V (local or received).
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
  std::vector<char> posted;  // per transfer: its KV receive or send was posted this pass
  std::vector<RequestId> preposted;
  void postKv(const plan::Stage& st, std::vector<RequestId>& requests, PassStats& stats,
              const std::function<bool(int32_t)>* sendable);
  // The first stage's KV messages that need no reshuffled tokens go out before the inward
  // reshuffle completes, so that they travel while the early pairs compute.
  void prepostFirstStage(bool backward);
  // One contribution to a block of `out` is in; the block leaves when none remain.
  void countDown(Outward* out, int32_t local, PassStats& stats) {
    if (out == nullptr || local < 0) return;
    if (--out->remaining[static_cast<size_t>(local)] == 0) blockDone(*out, local, stats);
  }
};

void Executor::State::setup() {
  const auto& a = plan.config.attention;
  if (a.elementBytes != 4) {
    throwInvalidArgument("the executor runs fp32 tensors (elementBytes 4), not elementBytes ",
                         a.elementBytes);
  }
  if (plan.config.numWorkers != transport.size()) {
    throwInvalidArgument("plan for ", plan.config.numWorkers, " workers run on ", transport.size(),
                         " ranks: expected the same number");
  }
  const int64_t lastTag = kFirstTransferTag + 2 * static_cast<int64_t>(plan.transfers.size()) +
                          3 * static_cast<int64_t>(plan.blocks.size());
  if (lastTag > transport.maxTag()) {
    throwInvalidArgument("plan has ", plan.transfers.size(), " transfers, more than the transport's ",
                         transport.maxTag(), " tags can name");
  }
  rank = transport.rank();
  hq = a.numHeadsQ;
  hkv = a.numHeadsKv;
  dim = a.headDim;
  qRow = hq * dim;
  kRow = hkv * dim;
  mask = a.mask == MaskKind::kCausal ? kernels::MaskKind::kCausal : kernels::MaskKind::kFull;
  const int64_t numTokens = plan.batch.numTokens();
  userStart = plan::userLayoutStarts(numTokens, plan.config.numWorkers);

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
  }

  // Reshuffle pieces: locate each in its block (a piece lies inside one chunk).
  const auto seq = plan::sequenceStarts(plan.batch);
  struct ChunkAt {
    int64_t begin, end;
    int32_t block;
    int64_t offset;
  };
  std::vector<ChunkAt> chunks;
  for (size_t b = 0; b < numBlocks; ++b) {
    int64_t offset = 0;
    for (const plan::Chunk& c : plan.blocks[b].chunks) {
      const int64_t begin = seq[static_cast<size_t>(c.sequence)] + c.begin;
      chunks.push_back({begin, begin + c.numTokens(), static_cast<int32_t>(b), offset});
      offset += c.numTokens();
    }
  }
  std::sort(chunks.begin(), chunks.end(), [](const ChunkAt& x, const ChunkAt& y) { return x.begin < y.begin; });
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  inbound.assign(n, {});
  outbound.assign(n, {});
  for (const plan::ReshufflePiece& piece : plan.reshuffle) {
    if (piece.userWorker != rank && piece.fcpWorker != rank) continue;
    auto it = std::upper_bound(chunks.begin(), chunks.end(), piece.begin,
                               [](int64_t x, const ChunkAt& c) { return x < c.begin; });
    FCP_CHECK(it != chunks.begin(), "reshuffle piece before every chunk");
    --it;
    Piece out;
    out.userOffset = piece.begin - userStart[static_cast<size_t>(piece.userWorker)];
    out.block = it->block;
    out.localBlock = -1;
    out.blockOffset = it->offset + (piece.begin - it->begin);
    out.numTokens = piece.end - piece.begin;
    if (piece.fcpWorker == rank) {
      out.localBlock = localIndex[static_cast<size_t>(it->block)];
      inbound[static_cast<size_t>(piece.userWorker)].push_back(out);
    }
    if (piece.userWorker == rank) {
      // The sender only needs user offsets; the block fields describe the receiver's side.
      outbound[static_cast<size_t>(piece.fcpWorker)].push_back(out);
    }
  }
  ready.assign(localBlocks.size(), 1);
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == rank) continue;
    for (const Piece& p : inbound[peer]) ready[static_cast<size_t>(p.localBlock)] = 0;
  }
  const auto tokens = static_cast<size_t>(localTokens());
  q.assign(tokens * static_cast<size_t>(qRow), 0.f);
  kv.assign(2 * tokens * static_cast<size_t>(kRow), 0.f);
  o.assign(q.size(), 0.f);
  lse.assign(tokens * static_cast<size_t>(hq), 0.f);
  int64_t maxBlock = 0;
  for (const int32_t b : localBlocks) maxBlock = std::max(maxBlock, blockTokens(b));
  partO.assign(static_cast<size_t>(maxBlock * qRow), 0.f);
  partLse.assign(static_cast<size_t>(maxBlock * hq), 0.f);
}

// Inward: every field's rows for one destination rank are packed into one message, fields one
// after another, pieces in stream order; pieces that stay on this rank are copied at once.
void Executor::State::postInward(Inward& in, PassStats& stats) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const int64_t row = rowWidth(in.fields);
  in.startUs = Timeline::nowUs();
  in.sendBufs.assign(n, {});
  in.recvBufs.assign(n, {});
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == rank || inbound[peer].empty()) continue;
    int64_t tokens = 0;
    for (const Piece& p : inbound[peer]) tokens += p.numTokens;
    in.recvBufs[peer].resize(static_cast<size_t>(tokens * row));
    in.requests.push_back(transport.irecv(static_cast<int>(peer), kReshuffleInTag, asWritableBytes(in.recvBufs[peer])));
  }
  for (size_t peer = 0; peer < n; ++peer) {
    const bool local = static_cast<int>(peer) == rank;
    std::vector<float>& buf = in.sendBufs[peer];
    for (const Field& f : in.fields) {
      const auto w = static_cast<size_t>(f.width);
      for (const Piece& p : outbound[peer]) {
        for (int64_t i = 0; i < p.numTokens; ++i) {
          const float* src = f.user + (p.userOffset + i) * f.width;
          if (local) {
            std::memcpy(f.fcp(p.localBlock, p.blockOffset + i), src, w * sizeof(float));
          } else {
            buf.insert(buf.end(), src, src + w);
          }
        }
      }
    }
    if (local || buf.empty()) continue;
    stats.sentBytes += static_cast<int64_t>(buf.size() * sizeof(float));
    in.requests.push_back(transport.isend(static_cast<int>(peer), kReshuffleInTag, asBytes(buf)));
  }
}

void Executor::State::finishInward(Inward& in) {
  const double waitStart = Timeline::nowUs();
  waitAll(transport, in.requests);
  if (options.timeline) options.timeline->add("wait", 2, waitStart, Timeline::nowUs());
  for (size_t peer = 0; peer < in.recvBufs.size(); ++peer) {
    const float* src = in.recvBufs[peer].data();
    if (in.recvBufs[peer].empty()) continue;
    for (const Field& f : in.fields) {
      const auto w = static_cast<size_t>(f.width);
      for (const Piece& p : inbound[peer]) {
        for (int64_t i = 0; i < p.numTokens; ++i, src += w) {
          std::memcpy(f.fcp(p.localBlock, p.blockOffset + i), src, w * sizeof(float));
        }
      }
    }
  }
  if (options.timeline) options.timeline->add("reshuffle in", 1, in.startUs, Timeline::nowUs());
}

// Outward: one message per (block, user rank), tagged by the block, posted when the block is
// done; the user side posts every receive first. `kvSide` counts, per local block, the pairs
// that use it as KV and the dK/dV returns still to add; otherwise the pairs of its Q block.
void Executor::State::startOutward(Outward& out, bool backward, bool kvSide, PassStats& stats) {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  out.remaining.assign(localBlocks.size(), 0);
  for (const plan::Stage& st : stages) {
    for (const int32_t p : st.compute) {
      const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
      const int32_t local = localIndex[static_cast<size_t>(kvSide ? pair.kvBlock : pair.qBlock)];
      if (local >= 0) ++out.remaining[static_cast<size_t>(local)];
    }
    if (!kvSide) continue;
    for (const int32_t t : st.recvGrad) {
      const int32_t local = localIndex[static_cast<size_t>(plan.transfers[static_cast<size_t>(t)].block)];
      if (local >= 0) ++out.remaining[static_cast<size_t>(local)];
    }
  }
  const int64_t row = rowWidth(out.fields);
  for (size_t peer = 0; peer < outbound.size(); ++peer) {
    if (static_cast<int>(peer) == rank) continue;
    // A block's pieces need not be adjacent (a Zig-Zag block has two chunks): one message
    // per block, sized by all of them.
    std::map<int32_t, int64_t> tokensOf;
    for (const Piece& p : outbound[peer]) tokensOf[p.block] += p.numTokens;
    for (const auto& [block, tokens] : tokensOf) {
      Outward::Incoming in{static_cast<int>(peer), block, std::vector<float>(static_cast<size_t>(tokens * row)), 0};
      in.request = transport.irecv(in.peer, out.tagBase + in.block, asWritableBytes(in.buffer));
      out.incoming.push_back(std::move(in));
    }
  }
  for (size_t local = 0; local < localBlocks.size(); ++local) {
    if (out.remaining[local] == 0) blockDone(out, static_cast<int32_t>(local), stats);
  }
}

void Executor::State::blockDone(Outward& out, int32_t local, PassStats& stats) {
  const int32_t block = localBlocks[static_cast<size_t>(local)];
  for (size_t peer = 0; peer < inbound.size(); ++peer) {
    const bool here = static_cast<int>(peer) == rank;
    std::vector<float> buf;
    for (const Field& f : out.fields) {
      const auto w = static_cast<size_t>(f.width);
      for (const Piece& p : inbound[peer]) {
        if (p.localBlock != local) continue;
        for (int64_t i = 0; i < p.numTokens; ++i) {
          const float* src = f.fcp(local, p.blockOffset + i);
          if (here) {
            std::memcpy(f.userOut + (p.userOffset + i) * f.width, src, w * sizeof(float));
          } else {
            buf.insert(buf.end(), src, src + w);
          }
        }
      }
    }
    if (here || buf.empty()) continue;
    stats.sentBytes += static_cast<int64_t>(buf.size() * sizeof(float));
    out.sendBufs.push_back(std::move(buf));
    out.requests.push_back(transport.isend(static_cast<int>(peer), out.tagBase + block, asBytes(out.sendBufs.back())));
  }
}

void Executor::State::finishOutward(Outward& out) {
  const double start = Timeline::nowUs();
  for (size_t local = 0; local < out.remaining.size(); ++local) {
    FCP_CHECK(out.remaining[local] == 0, "rank ", rank, " ends a pass with block ", localBlocks[local],
              " unfinished");
  }
  waitAll(transport, out.requests);
  for (auto& in : out.incoming) {
    transport.wait(in.request);
    const float* src = in.buffer.data();
    for (const Field& f : out.fields) {
      const auto w = static_cast<size_t>(f.width);
      for (const Piece& p : outbound[static_cast<size_t>(in.peer)]) {
        if (p.block != in.block) continue;
        for (int64_t i = 0; i < p.numTokens; ++i, src += w) {
          std::memcpy(f.userOut + (p.userOffset + i) * f.width, src, w * sizeof(float));
        }
      }
    }
  }
  if (options.timeline) {
    options.timeline->add("reshuffle out (rest)", 1, start, Timeline::nowUs());
    options.timeline->add("wait", 2, start, Timeline::nowUs());
  }
}

// The first stage's pairs whose Q and KV blocks are both ready run before the inward
// reshuffle completes; `done` marks them so that the stage skips them.
void Executor::State::runEarlyPairs(bool backward, std::vector<char>& done) {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  done.assign(plan.pairs.size(), 0);
  if (stages.empty()) return;
  for (const int32_t p : stages.front().compute) {
    const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
    const int32_t ql = localIndex[static_cast<size_t>(pair.qBlock)], kl = localIndex[static_cast<size_t>(pair.kvBlock)];
    if (ql < 0 || kl < 0 || !ready[static_cast<size_t>(ql)] || !ready[static_cast<size_t>(kl)]) continue;
    backward ? backwardPair(p) : forwardPair(p);
    done[static_cast<size_t>(p)] = 1;
  }
}

const float* Executor::State::kvSource(int32_t block) {
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
  const float* kvp = kvSource(pair.kvBlock);
  const auto h = static_cast<int>(hq), hk = static_cast<int>(hkv), d = static_cast<int>(dim);
  return {pair, local, row, {q.data() + row * qRow, nq, h, d}, {kvp, nk, hk, d},
          {kvp + nk * kRow, nk, hk, d}};
}

void Executor::State::forwardPair(int32_t p) {
  const PairViews pv = pairViews(p);
  const plan::BlockPair& pair = pv.pair;
  const int64_t row = pv.row;
  const double start = Timeline::nowUs();
  kernels::forward(pv.q, pv.k, pv.v, maskOf(pair), partO.data(), partLse.data(), {options.numThreads});
  kernels::mergePartials(pv.q.numTokens, pv.q.numHeads, pv.q.headDim, o.data() + row * qRow,
                         lse.data() + row * hq, partO.data(), partLse.data());
  const double end = Timeline::nowUs();
  fwd.kernelMs += (end - start) / 1e3;
  fwd.flops += forwardFlops(plan.config.attention, pair.visible);
  countDown(qStream, pv.local, fwd);
  if (options.timeline) {
    options.timeline->add("fwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock), 0, start, end);
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
  const kernels::TensorView dov{dO.data() + row * qRow, pv.q.numTokens, pv.q.numHeads, pv.q.headDim};
  const double start = Timeline::nowUs();
  kernels::backward(pv.q, pv.k, pv.v, dov, lse.data() + row * hq, delta.data() + row * hq,
                    maskOf(pair), dq.data() + row * qRow, grad, grad + nk * kRow, {options.numThreads});
  const double end = Timeline::nowUs();
  bwd.kernelMs += (end - start) / 1e3;
  bwd.flops += backwardFlops(plan.config.attention, pair.visible);
  countDown(qStream, pv.local, bwd);
  countDown(kvStream, kvLocal, bwd);
  if (options.timeline) {
    options.timeline->add("bwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock), 0, start, end);
  }
}

void Executor::State::postKv(const plan::Stage& st, std::vector<RequestId>& requests, PassStats& stats,
                             const std::function<bool(int32_t)>* sendable) {
  for (const int32_t t : st.recv) {
    if (posted[static_cast<size_t>(t)]) continue;
    posted[static_cast<size_t>(t)] = 1;
    const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
    auto& buf = remote[t];
    buf.resize(static_cast<size_t>(tr.bytes) / sizeof(float));
    requests.push_back(transport.irecv(tr.sender, tagKv(t), asWritableBytes(buf)));
  }
  for (const int32_t t : st.send) {
    const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
    if (posted[static_cast<size_t>(t)] || (sendable && !(*sendable)(tr.block))) continue;
    posted[static_cast<size_t>(t)] = 1;
    const float* src = kvSource(tr.block);
    requests.push_back(transport.isend(tr.receiver, tagKv(t),
                                       asBytes({src, static_cast<size_t>(tr.bytes) / sizeof(float)})));
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
    return local >= 0 && (backward || ready[static_cast<size_t>(local)]);
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
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      auto& buf = gradIn[t];
      buf.resize(static_cast<size_t>(tr.bytes) / sizeof(float));
      requests.push_back(transport.irecv(tr.receiver, tagGrad(t), asWritableBytes(buf)));
    }
    for (const int32_t t : st.sendGrad) {
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      auto& partial = gradPartial[t];
      if (partial.empty()) partial.assign(static_cast<size_t>(tr.bytes) / sizeof(float), 0.f);
      requests.push_back(transport.isend(tr.sender, tagGrad(t), asBytes(partial)));
      stats.sentBytes += tr.bytes;
      stats.kvBytes += tr.bytes;
    }
    const double commPosted = Timeline::nowUs();
    // Within a stage, pairs run grouped by Q block (stable), so that blocks finish one after
    // another and their outputs leave while the rest compute.
    order.assign(st.compute.begin(), st.compute.end());
    std::stable_sort(order.begin(), order.end(), [this](int32_t a, int32_t b) {
      return plan.pairs[static_cast<size_t>(a)].qBlock < plan.pairs[static_cast<size_t>(b)].qBlock;
    });
    for (const int32_t p : order) {
      if (done[static_cast<size_t>(p)]) continue;
      backward ? backwardPair(p) : forwardPair(p);
    }
    const double computeEnd = Timeline::nowUs();
    waitAll(transport, requests);
    const double stageEnd = Timeline::nowUs();
    if (options.timeline) {
      if (!requests.empty()) {
        options.timeline->add("stage " + std::to_string(s) + " messages (" +
                                  std::to_string(requests.size()) + ")",
                              1, commPosted, stageEnd);
      }
      if (stageEnd - computeEnd > 1.0) options.timeline->add("wait", 2, computeEnd, stageEnd);
    }
    for (const int32_t t : st.recvGrad) {
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      const int32_t local = localIndex[static_cast<size_t>(tr.block)];
      float* into = nullptr;
      if (local >= 0) {
        into = dkvOf(local);
      } else {  // a relay: add into its own partial of the block
        auto& partial = gradPartial[transferTo(tr.block, rank)];
        if (partial.empty()) partial.assign(static_cast<size_t>(tr.bytes) / sizeof(float), 0.f);
        into = partial.data();
      }
      const auto& in = gradIn[t];
      for (size_t i = 0; i < in.size(); ++i) into[i] += in[i];
      gradIn.erase(t);
      countDown(kvStream, local, stats);
    }
    for (const int32_t t : st.sendGrad) gradPartial.erase(t);
    for (const int32_t t : st.release) remote.erase(t);
  }
  FCP_CHECK(remote.empty() && gradIn.empty(), "rank ", rank, " ends a pass still holding buffers");
}

Executor::Executor(const plan::Plan& plan, Transport& transport, const ExecutorOptions& options)
    : state_(std::make_unique<State>(plan, transport, options)) {
  state_->setup();
}

Executor::~Executor() = default;

int64_t Executor::userTokens() const {
  const State& s = *state_;
  return s.userStart[static_cast<size_t>(s.rank) + 1] - s.userStart[static_cast<size_t>(s.rank)];
}

void Executor::forward(std::span<const float> q, std::span<const float> k, std::span<const float> v,
                       std::span<float> o, std::span<float> lse) {
  State& s = *state_;
  const int64_t tokens = userTokens();
  if (static_cast<int64_t>(q.size()) != tokens * s.qRow || static_cast<int64_t>(k.size()) != tokens * s.kRow ||
      static_cast<int64_t>(v.size()) != tokens * s.kRow || static_cast<int64_t>(o.size()) != tokens * s.qRow ||
      static_cast<int64_t>(lse.size()) != tokens * s.hq) {
    throwInvalidArgument("rank ", s.rank, " holds ", tokens, " tokens: forward tensors of the wrong size");
  }
  s.fwd = {};
  const auto start = Clock::now();
  const double startUs = Timeline::nowUs();
  std::fill(s.o.begin(), s.o.end(), 0.f);
  std::fill(s.lse.begin(), s.lse.end(), -std::numeric_limits<float>::infinity());
  State::Inward in;
  in.fields = {{q.data(), nullptr, s.qRow, s.rowOf(s.q, s.qRow)},
               {k.data(), nullptr, s.kRow, s.kRowOf(s.kv, false)},
               {v.data(), nullptr, s.kRow, s.kRowOf(s.kv, true)}};
  State::Outward out;
  out.fields = {{nullptr, o.data(), s.qRow, s.rowOf(s.o, s.qRow)}, {nullptr, lse.data(), s.hq, s.rowOf(s.lse, s.hq)}};
  out.tagBase = s.outwardTag(0);
  s.postInward(in, s.fwd);
  s.startOutward(out, false, false, s.fwd);
  s.qStream = &out;
  s.prepostFirstStage(false);
  std::vector<char> done;
  s.runEarlyPairs(false, done);
  s.finishInward(in);
  s.runStages(false, done);
  s.finishOutward(out);
  s.qStream = nullptr;
  s.fwd.wallMs = msSince(start);
  if (s.options.timeline) s.options.timeline->add("forward", 2, startUs, Timeline::nowUs());
}

void Executor::backward(std::span<const float> dO, std::span<float> dq, std::span<float> dk,
                        std::span<float> dv) {
  State& s = *state_;
  const int64_t tokens = userTokens();
  if (static_cast<int64_t>(dO.size()) != tokens * s.qRow || static_cast<int64_t>(dq.size()) != tokens * s.qRow ||
      static_cast<int64_t>(dk.size()) != tokens * s.kRow || static_cast<int64_t>(dv.size()) != tokens * s.kRow) {
    throwInvalidArgument("rank ", s.rank, " holds ", tokens, " tokens: backward tensors of the wrong size");
  }
  s.bwd = {};
  const auto start = Clock::now();
  const double startUs = Timeline::nowUs();
  const auto localTokens = static_cast<size_t>(s.localTokens());
  s.dO.assign(localTokens * static_cast<size_t>(s.qRow), 0.f);
  s.delta.assign(localTokens * static_cast<size_t>(s.hq), 0.f);
  s.dq.assign(localTokens * static_cast<size_t>(s.qRow), 0.f);
  s.dkv.assign(2 * localTokens * static_cast<size_t>(s.kRow), 0.f);
  State::Inward in;
  in.fields = {{dO.data(), nullptr, s.qRow, s.rowOf(s.dO, s.qRow)}};
  State::Outward qOut, kvOut;
  qOut.fields = {{nullptr, dq.data(), s.qRow, s.rowOf(s.dq, s.qRow)}};
  qOut.tagBase = s.outwardTag(1);
  kvOut.fields = {{nullptr, dk.data(), s.kRow, s.kRowOf(s.dkv, false)},
                  {nullptr, dv.data(), s.kRow, s.kRowOf(s.dkv, true)}};
  kvOut.tagBase = s.outwardTag(2);
  s.postInward(in, s.bwd);
  s.startOutward(qOut, true, false, s.bwd);
  s.startOutward(kvOut, true, true, s.bwd);
  s.qStream = &qOut;
  s.kvStream = &kvOut;
  // D = rowsum(dO ∘ O) per block: ready blocks first, so that their pairs can start.
  auto computeDelta = [&s](bool readyBlocks) {
    for (size_t local = 0; local < s.localBlocks.size(); ++local) {
      if (static_cast<bool>(s.ready[local]) != readyBlocks) continue;
      const int64_t row = s.tokenStart[local], n = s.tokenStart[local + 1] - row;
      const auto h = static_cast<int>(s.hq), d = static_cast<int>(s.dim);
      kernels::computeDelta({s.o.data() + row * s.qRow, n, h, d}, {s.dO.data() + row * s.qRow, n, h, d},
                            s.delta.data() + row * s.hq);
    }
  };
  s.prepostFirstStage(true);
  computeDelta(true);
  std::vector<char> done;
  s.runEarlyPairs(true, done);
  s.finishInward(in);
  computeDelta(false);
  s.runStages(true, done);
  FCP_CHECK(s.gradPartial.empty(), "rank ", s.rank, " ends the backward holding dK/dV partials");
  s.finishOutward(qOut);
  s.finishOutward(kvOut);
  s.qStream = s.kvStream = nullptr;
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
    std::snprintf(text, sizeof(text),
                  "rank %d: the ranks built different plans (plan digests range over %016llx..%016llx, "
                  "this rank's is %016llx): every rank must use the same batch, seed and flags",
                  transport.rank(), static_cast<unsigned long long>(smallest),
                  static_cast<unsigned long long>(largest), static_cast<unsigned long long>(digest >> 1));
    throw Error(ErrorCode::kInvalidPlan, text);
  }
}

}  // namespace fcp::runtime
