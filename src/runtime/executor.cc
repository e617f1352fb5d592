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
#include "fcp/runtime/executor.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
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
  int32_t localBlock = 0;  ///< index among the FCP worker's local blocks
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
  int tagGrad(int32_t t) const { return kFirstTransferTag + 2 * t + 1; }
  int32_t transferTo(int32_t block, int32_t receiver) const {
    const int32_t t = plan::findTransfer(plan.transfers, block, receiver);
    FCP_CHECK(t >= 0, "no transfer of block ", block, " to rank ", receiver);
    return t;
  }

  void setup();
  void reshuffle(bool inward, const std::vector<std::pair<const float*, int64_t>>& userIn,
                 const std::vector<std::function<float*(int32_t, int64_t)>>& fcp,
                 const std::vector<std::pair<float*, int64_t>>& userOut, PassStats& stats);
  const float* kvSource(int32_t block);
  kernels::BlockMask maskOf(const plan::BlockPair& pair) const {
    return {mask, segments[static_cast<size_t>(pair.qBlock)], segments[static_cast<size_t>(pair.kvBlock)]};
  }
  void forwardPair(int32_t p);
  void backwardPair(int32_t p);
  void runStages(bool backward);
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
  const int64_t lastTag = kFirstTransferTag + 2 * static_cast<int64_t>(plan.transfers.size()) + 1;
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

// Moves tensors between the user layout and the FCP layout. Inward: `userIn` (pointer, row
// floats) per field are packed per destination rank, rows of one field after another, and
// unpacked through `fcp` (local block, token) -> row pointer. Outward: the reverse into
// `userOut`. Pieces that stay on this rank are copied directly.
void Executor::State::reshuffle(bool inward,
                                const std::vector<std::pair<const float*, int64_t>>& userIn,
                                const std::vector<std::function<float*(int32_t, int64_t)>>& fcp,
                                const std::vector<std::pair<float*, int64_t>>& userOut,
                                PassStats& stats) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  int64_t rowFloats = 0;
  std::vector<int64_t> widths;
  for (size_t f = 0; f < fcp.size(); ++f) {
    widths.push_back(inward ? userIn[f].second : userOut[f].second);
    rowFloats += widths.back();
  }
  // Which pieces this rank sends (as the user worker inward, the FCP worker outward).
  const auto& sendLists = inward ? outbound : inbound;
  const auto& recvLists = inward ? inbound : outbound;
  std::vector<std::vector<float>> sendBufs(n), recvBufs(n);
  std::vector<RequestId> requests;
  const int tag = inward ? kReshuffleInTag : kReshuffleOutTag;
  auto count = [](const std::vector<Piece>& pieces) {
    int64_t total = 0;
    for (const Piece& p : pieces) total += p.numTokens;
    return total;
  };
  auto fcpRow = [&](size_t f, const Piece& p, int64_t i) { return fcp[f](p.localBlock, p.blockOffset + i); };
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == rank || recvLists[peer].empty()) continue;
    recvBufs[peer].resize(static_cast<size_t>(count(recvLists[peer]) * rowFloats));
    requests.push_back(transport.irecv(static_cast<int>(peer), tag, asWritableBytes(recvBufs[peer])));
  }
  for (size_t peer = 0; peer < n; ++peer) {
    if (sendLists[peer].empty()) continue;
    if (static_cast<int>(peer) == rank) {
      for (const Piece& p : sendLists[peer]) {
        for (size_t f = 0; f < fcp.size(); ++f) {
          const auto w = static_cast<size_t>(widths[f]);
          for (int64_t i = 0; i < p.numTokens; ++i) {
            if (inward) {
              std::memcpy(fcpRow(f, p, i), userIn[f].first + (p.userOffset + i) * widths[f], w * sizeof(float));
            } else {
              std::memcpy(userOut[f].first + (p.userOffset + i) * widths[f], fcpRow(f, p, i), w * sizeof(float));
            }
          }
        }
      }
      continue;
    }
    auto& buf = sendBufs[peer];
    buf.resize(static_cast<size_t>(count(sendLists[peer]) * rowFloats));
    float* out = buf.data();
    for (size_t f = 0; f < fcp.size(); ++f) {
      const auto w = static_cast<size_t>(widths[f]);
      for (const Piece& p : sendLists[peer]) {
        for (int64_t i = 0; i < p.numTokens; ++i, out += w) {
          const float* src = inward ? userIn[f].first + (p.userOffset + i) * widths[f] : fcpRow(f, p, i);
          std::memcpy(out, src, w * sizeof(float));
        }
      }
    }
    stats.sentBytes += static_cast<int64_t>(buf.size() * sizeof(float));
    requests.push_back(transport.isend(static_cast<int>(peer), tag, asBytes(buf)));
  }
  waitAll(transport, requests);
  for (size_t peer = 0; peer < n; ++peer) {
    if (recvBufs[peer].empty()) continue;
    const float* in = recvBufs[peer].data();
    for (size_t f = 0; f < fcp.size(); ++f) {
      const auto w = static_cast<size_t>(widths[f]);
      for (const Piece& p : recvLists[peer]) {
        for (int64_t i = 0; i < p.numTokens; ++i, in += w) {
          float* dst = inward ? fcpRow(f, p, i) : userOut[f].first + (p.userOffset + i) * widths[f];
          std::memcpy(dst, in, w * sizeof(float));
        }
      }
    }
  }
}

const float* Executor::State::kvSource(int32_t block) {
  const int32_t local = localIndex[static_cast<size_t>(block)];
  if (local >= 0) return kvOf(local);
  auto it = remote.find(transferTo(block, rank));
  FCP_CHECK(it != remote.end(), "rank ", rank, " computes with block ", block, " it does not hold");
  return it->second.data();
}

void Executor::State::forwardPair(int32_t p) {
  const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
  const int32_t local = localIndex[static_cast<size_t>(pair.qBlock)];
  FCP_CHECK(local >= 0, "rank ", rank, " computes pair ", p, " whose Q block it does not own");
  const int64_t nq = blockTokens(pair.qBlock), nk = blockTokens(pair.kvBlock);
  const int64_t row = tokenStart[static_cast<size_t>(local)];
  const float* kvp = kvSource(pair.kvBlock);
  const auto h = static_cast<int>(hq), hk = static_cast<int>(hkv), d = static_cast<int>(dim);
  const kernels::TensorView qv{q.data() + row * qRow, nq, h, d};
  const kernels::TensorView kView{kvp, nk, hk, d}, vView{kvp + nk * kRow, nk, hk, d};
  const double start = Timeline::nowUs();
  kernels::forward(qv, kView, vView, maskOf(pair), partO.data(), partLse.data(), {options.numThreads});
  kernels::mergePartials(nq, h, d, o.data() + row * qRow, lse.data() + row * hq, partO.data(),
                         partLse.data());
  const double end = Timeline::nowUs();
  fwd.kernelMs += (end - start) / 1e3;
  fwd.flops += forwardFlops(plan.config.attention, pair.visible);
  if (options.timeline) {
    options.timeline->add("fwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock), 0, start, end);
  }
}

void Executor::State::backwardPair(int32_t p) {
  const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
  const int32_t local = localIndex[static_cast<size_t>(pair.qBlock)];
  FCP_CHECK(local >= 0, "rank ", rank, " computes pair ", p, " whose Q block it does not own");
  const int64_t nq = blockTokens(pair.qBlock), nk = blockTokens(pair.kvBlock);
  const int64_t row = tokenStart[static_cast<size_t>(local)];
  const float* kvp = kvSource(pair.kvBlock);
  float* grad = nullptr;
  const int32_t kvLocal = localIndex[static_cast<size_t>(pair.kvBlock)];
  if (kvLocal >= 0) {
    grad = dkvOf(kvLocal);
  } else {
    auto& partial = gradPartial[transferTo(pair.kvBlock, rank)];
    if (partial.empty()) partial.assign(static_cast<size_t>(2 * nk * kRow), 0.f);
    grad = partial.data();
  }
  const auto h = static_cast<int>(hq), hk = static_cast<int>(hkv), d = static_cast<int>(dim);
  const kernels::TensorView qv{q.data() + row * qRow, nq, h, d};
  const kernels::TensorView dov{dO.data() + row * qRow, nq, h, d};
  const kernels::TensorView kView{kvp, nk, hk, d}, vView{kvp + nk * kRow, nk, hk, d};
  const double start = Timeline::nowUs();
  kernels::backward(qv, kView, vView, dov, lse.data() + row * hq, delta.data() + row * hq,
                    maskOf(pair), dq.data() + row * qRow, grad, grad + nk * kRow, {options.numThreads});
  const double end = Timeline::nowUs();
  bwd.kernelMs += (end - start) / 1e3;
  bwd.flops += backwardFlops(plan.config.attention, pair.visible);
  if (options.timeline) {
    options.timeline->add("bwd " + std::to_string(pair.qBlock) + "x" + std::to_string(pair.kvBlock), 0, start, end);
  }
}

void Executor::State::runStages(bool backward) {
  const auto& stages = (backward ? plan.backward : plan.forward)[static_cast<size_t>(rank)];
  PassStats& stats = backward ? bwd : fwd;
  std::vector<RequestId> requests;
  std::vector<std::pair<int32_t, const char*>> posted;  // for the timeline
  for (size_t s = 0; s < stages.size(); ++s) {
    const plan::Stage& st = stages[s];
    const double stageStart = Timeline::nowUs();
    requests.clear();
    for (const int32_t t : st.recv) {
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      auto& buf = remote[t];
      buf.resize(static_cast<size_t>(tr.bytes) / sizeof(float));
      requests.push_back(transport.irecv(tr.sender, tagKv(t), asWritableBytes(buf)));
    }
    for (const int32_t t : st.send) {
      const plan::Transfer& tr = plan.transfers[static_cast<size_t>(t)];
      const float* src = kvSource(tr.block);
      requests.push_back(transport.isend(tr.receiver, tagKv(t),
                                         asBytes({src, static_cast<size_t>(tr.bytes) / sizeof(float)})));
      stats.sentBytes += tr.bytes;
      stats.kvBytes += tr.bytes;
    }
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
    for (const int32_t p : st.compute) backward ? backwardPair(p) : forwardPair(p);
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
    (void)stageStart;
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
  auto qRowOf = [&s](std::vector<float>& t) {
    return [&s, &t](int32_t local, int64_t tok) {
      return t.data() + (s.tokenStart[static_cast<size_t>(local)] + tok) * s.qRow;
    };
  };
  auto kOf = [&s](int32_t local, int64_t tok) { return s.kvOf(local) + tok * s.kRow; };
  auto vOf = [&s](int32_t local, int64_t tok) {
    const int64_t n = s.tokenStart[static_cast<size_t>(local) + 1] - s.tokenStart[static_cast<size_t>(local)];
    return s.kvOf(local) + (n + tok) * s.kRow;
  };
  s.reshuffle(true, {{q.data(), s.qRow}, {k.data(), s.kRow}, {v.data(), s.kRow}},
              {qRowOf(s.q), kOf, vOf}, {}, s.fwd);
  if (s.options.timeline) s.options.timeline->add("reshuffle in", 1, startUs, Timeline::nowUs());
  std::fill(s.o.begin(), s.o.end(), 0.f);
  std::fill(s.lse.begin(), s.lse.end(), -std::numeric_limits<float>::infinity());
  s.runStages(false);
  const double outStart = Timeline::nowUs();
  auto lseOf = [&s](int32_t local, int64_t tok) {
    return s.lse.data() + (s.tokenStart[static_cast<size_t>(local)] + tok) * s.hq;
  };
  s.reshuffle(false, {}, {qRowOf(s.o), lseOf}, {{o.data(), s.qRow}, {lse.data(), s.hq}}, s.fwd);
  if (s.options.timeline) s.options.timeline->add("reshuffle out", 1, outStart, Timeline::nowUs());
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
  auto dORow = [&s](int32_t local, int64_t tok) {
    return s.dO.data() + (s.tokenStart[static_cast<size_t>(local)] + tok) * s.qRow;
  };
  s.reshuffle(true, {{dO.data(), s.qRow}}, {dORow}, {}, s.bwd);
  if (s.options.timeline) s.options.timeline->add("reshuffle in", 1, startUs, Timeline::nowUs());
  s.delta.assign(localTokens * static_cast<size_t>(s.hq), 0.f);
  if (localTokens > 0) {
    const auto h = static_cast<int>(s.hq), d = static_cast<int>(s.dim);
    kernels::computeDelta({s.o.data(), static_cast<int64_t>(localTokens), h, d},
                          {s.dO.data(), static_cast<int64_t>(localTokens), h, d}, s.delta.data());
  }
  s.dq.assign(localTokens * static_cast<size_t>(s.qRow), 0.f);
  s.dkv.assign(2 * localTokens * static_cast<size_t>(s.kRow), 0.f);
  s.runStages(true);
  FCP_CHECK(s.gradPartial.empty(), "rank ", s.rank, " ends the backward holding dK/dV partials");
  const double outStart = Timeline::nowUs();
  auto dqRow = [&s](int32_t local, int64_t tok) {
    return s.dq.data() + (s.tokenStart[static_cast<size_t>(local)] + tok) * s.qRow;
  };
  auto dkRow = [&s](int32_t local, int64_t tok) { return s.dkvOf(local) + tok * s.kRow; };
  auto dvRow = [&s](int32_t local, int64_t tok) {
    const int64_t n = s.tokenStart[static_cast<size_t>(local) + 1] - s.tokenStart[static_cast<size_t>(local)];
    return s.dkvOf(local) + (n + tok) * s.kRow;
  };
  s.reshuffle(false, {}, {dqRow, dkRow, dvRow},
              {{dq.data(), s.qRow}, {dk.data(), s.kRow}, {dv.data(), s.kRow}}, s.bwd);
  if (s.options.timeline) s.options.timeline->add("reshuffle out", 1, outStart, Timeline::nowUs());
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
