#include "reshuffle.h"

#include <cstring>
#include <map>

#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"

namespace fcp::runtime::detail {

int64_t elemBytes(Elem e) { return e == Elem::kFp32 ? 4 : e == Elem::kBf16 ? 2 : 1; }

void copyElements(std::byte* dst, Elem to, const std::byte* src, Elem from, int64_t count) {
  if (to == from) {
    std::memcpy(dst, src, static_cast<size_t>(count * elemBytes(to)));
    return;
  }
  FCP_CHECK(to != Elem::kRaw && from != Elem::kRaw, "raw rows converted to a typed field");
  const auto n = static_cast<size_t>(count);
  if (to == Elem::kBf16) {
    kernels::toBf16({reinterpret_cast<const float*>(src), n},
                    {reinterpret_cast<uint16_t*>(dst), n});
  } else {
    kernels::fromBf16({reinterpret_cast<const uint16_t*>(src), n},
                      {reinterpret_cast<float*>(dst), n});
  }
}

namespace {

int64_t rowBytes(const std::vector<Field>& fields) {
  int64_t total = 0;
  for (const Field& f : fields) total += f.wireBytes();
  return total;
}

}  // namespace

Inward::Inward(const ReshuffleContext& context, std::vector<Field> fields, int tagBase)
    : ctx_(context), fields_(std::move(fields)), tagBase_(tagBase) {}

void Inward::keepBuffersForever() {
  keepForever(sendBufs_);
  keepForever(incoming_);
}

// A message holds one block's rows for one FCP rank: every field's rows, fields one after
// another, the block's pieces in stream order (the receiver's inbound pieces of that block, in
// the same order). Pieces that stay on this rank are copied at once.
void Inward::start() {
  const LayoutIndex& index = ctx_.index;
  const size_t n = index.inbound.size();
  const int64_t row = rowBytes(fields_);
  startUs_ = lastArrivalUs_ = Timeline::nowUs();
  missing_.assign(static_cast<size_t>(index.numLocalBlocks), 0);
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == ctx_.rank) continue;
    std::map<int32_t, std::pair<int32_t, int64_t>> tokensOf;  // block -> (local, tokens)
    for (const Piece& p : index.inbound[peer]) {
      auto& [local, tokens] = tokensOf[p.block];
      local = p.localBlock;
      tokens += p.numTokens;
    }
    for (const auto& [block, what] : tokensOf) {
      Incoming in{static_cast<int>(peer), block, what.first,
                  std::vector<std::byte>(static_cast<size_t>(what.second * row)), 0};
      in.request = ctx_.transport.irecv(in.peer, tagBase_ + block, in.buffer);
      if (ctx_.stats) ctx_.stats->recvBytes += what.second * row;
      ++missing_[static_cast<size_t>(in.local)];
      pending_.push_back(incoming_.size());
      incoming_.push_back(std::move(in));
    }
  }
  sent_.assign(n, {});
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == ctx_.rank) continue;
    for (const Piece& p : index.outbound[peer]) sent_[peer][p.block] = false;
  }
  for (const Field& f : fields_) {
    const int64_t step = f.userStep();
    for (const Piece& p : index.outbound[static_cast<size_t>(ctx_.rank)]) {
      for (int64_t i = 0; i < p.numTokens; ++i) {
        copyElements(f.fcp(p.localBlock, p.blockOffset + i), f.fcpElem,
                     f.user + (p.userOffset + i) * step, f.userElem, f.elements);
      }
    }
  }
}

void Inward::send(int peer, int32_t block) {
  auto& sent = sent_[static_cast<size_t>(peer)];
  const auto it = sent.find(block);
  if (it == sent.end() || it->second) return;
  it->second = true;
  std::vector<std::byte> buf;
  for (const Field& f : fields_) {
    const int64_t w = f.wireBytes(), step = f.userStep();
    for (const Piece& p : ctx_.index.outbound[static_cast<size_t>(peer)]) {
      if (p.block != block) continue;
      const std::byte* src = f.user + p.userOffset * step;
      if (step == w) {
        buf.insert(buf.end(), src, src + p.numTokens * w);
        continue;
      }
      for (int64_t i = 0; i < p.numTokens; ++i) {
        const std::byte* row = src + i * step;
        buf.insert(buf.end(), row, row + w);
      }
    }
  }
  if (ctx_.stats) ctx_.stats->sentBytes += static_cast<int64_t>(buf.size());
  sendBufs_.push_back(std::move(buf));
  sends_.push_back(ctx_.transport.isend(peer, tagBase_ + block, sendBufs_.back()));
}

void Inward::sendRest() {
  for (size_t peer = 0; peer < sent_.size(); ++peer) {
    for (const auto& [block, sent] : sent_[peer]) {
      if (!sent) send(static_cast<int>(peer), block);
    }
  }
}

void Inward::unpack(Incoming& in) {
  const std::byte* src = in.buffer.data();
  for (const Field& f : fields_) {
    const int64_t w = f.wireBytes();
    for (const Piece& p : ctx_.index.inbound[static_cast<size_t>(in.peer)]) {
      if (p.block != in.block) continue;
      for (int64_t i = 0; i < p.numTokens; ++i, src += w) {
        copyElements(f.fcp(p.localBlock, p.blockOffset + i), f.fcpElem, src, f.userElem,
                     f.elements);
      }
    }
  }
  in.buffer = {};
  --missing_[static_cast<size_t>(in.local)];
  lastArrivalUs_ = Timeline::nowUs();
}

int Inward::poll() {
  int arrived = 0;
  for (size_t i = 0; i < pending_.size();) {
    Incoming& in = incoming_[pending_[i]];
    if (!ctx_.transport.test(in.request)) {
      ++i;
      continue;
    }
    unpack(in);
    ++arrived;
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  return arrived;
}

void Inward::waitFor(int32_t local) {
  if (has(local)) return;
  const double start = Timeline::nowUs();
  for (size_t i = 0; i < pending_.size();) {
    Incoming& in = incoming_[pending_[i]];
    if (in.local != local) {
      ++i;
      continue;
    }
    ctx_.transport.wait(in.request);
    unpack(in);
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
  }
  if (ctx_.timeline) ctx_.timeline->add("wait", 2, start, Timeline::nowUs());
}

void Inward::finish() {
  sendRest();
  const double waitStart = Timeline::nowUs();
  for (const size_t i : pending_) {
    ctx_.transport.wait(incoming_[i].request);
    unpack(incoming_[i]);
  }
  pending_.clear();
  waitAll(ctx_.transport, sends_);
  sends_.clear();
  if (ctx_.timeline) {
    const double end = Timeline::nowUs();
    if (end - waitStart > 1.0) ctx_.timeline->add("wait", 2, waitStart, end);
    ctx_.timeline->add("reshuffle in", 1, startUs_, lastArrivalUs_);
  }
}

Outward::Outward(const ReshuffleContext& context, std::vector<Field> fields, int tagBase,
                 std::vector<int64_t> remaining)
    : ctx_(context),
      fields_(std::move(fields)),
      tagBase_(tagBase),
      remaining_(std::move(remaining)) {}

void Outward::start() {
  const LayoutIndex& index = ctx_.index;
  const int64_t row = rowBytes(fields_);
  for (size_t peer = 0; peer < index.outbound.size(); ++peer) {
    if (static_cast<int>(peer) == ctx_.rank) continue;
    // A block's pieces need not be adjacent (a Zig-Zag block has two chunks): one message
    // per block, sized by all of them.
    std::map<int32_t, int64_t> tokensOf;
    for (const Piece& p : index.outbound[peer]) tokensOf[p.block] += p.numTokens;
    for (const auto& [block, tokens] : tokensOf) {
      Incoming in{static_cast<int>(peer), block,
                  std::vector<std::byte>(static_cast<size_t>(tokens * row)), 0};
      in.request = ctx_.transport.irecv(in.peer, tagBase_ + in.block, in.buffer);
      if (ctx_.stats) ctx_.stats->recvBytes += tokens * row;
      incoming_.push_back(std::move(in));
    }
  }
  for (size_t local = 0; local < remaining_.size(); ++local) {
    if (remaining_[local] == 0) blockDone(static_cast<int32_t>(local));
  }
}

void Outward::countDown(int32_t local) {
  if (local < 0) return;
  if (--remaining_[static_cast<size_t>(local)] == 0) blockDone(local);
}

void Outward::blockDone(int32_t local) {
  const LayoutIndex& index = ctx_.index;
  for (size_t peer = 0; peer < index.inbound.size(); ++peer) {
    const bool here = static_cast<int>(peer) == ctx_.rank;
    std::vector<std::byte> buf;
    int32_t block = -1;
    for (const Field& f : fields_) {
      const int64_t w = f.wireBytes(), step = f.userStep();
      for (const Piece& p : index.inbound[peer]) {
        if (p.localBlock != local) continue;
        block = p.block;
        for (int64_t i = 0; i < p.numTokens; ++i) {
          const std::byte* src = f.fcp(local, p.blockOffset + i);
          std::byte* dst = nullptr;
          if (here) {
            dst = f.userOut + (p.userOffset + i) * step;
          } else {
            buf.resize(buf.size() + static_cast<size_t>(w));
            dst = buf.data() + buf.size() - static_cast<size_t>(w);
          }
          copyElements(dst, f.userElem, src, f.fcpElem, f.elements);
        }
      }
    }
    if (here || buf.empty()) continue;
    if (ctx_.stats) ctx_.stats->sentBytes += static_cast<int64_t>(buf.size());
    sendBufs_.push_back(std::move(buf));
    requests_.push_back(
        ctx_.transport.isend(static_cast<int>(peer), tagBase_ + block, sendBufs_.back()));
  }
}

void Outward::finish() {
  const double start = Timeline::nowUs();
  for (size_t local = 0; local < remaining_.size(); ++local) {
    FCP_CHECK(remaining_[local] == 0, "rank ", ctx_.rank, " ends a pass with local block ", local,
              " unfinished");
  }
  waitAll(ctx_.transport, requests_);
  for (auto& in : incoming_) {
    ctx_.transport.wait(in.request);
    const std::byte* src = in.buffer.data();
    for (const Field& f : fields_) {
      const int64_t w = f.wireBytes(), step = f.userStep();
      for (const Piece& p : ctx_.index.outbound[static_cast<size_t>(in.peer)]) {
        if (p.block != in.block) continue;
        std::byte* dst = f.userOut + p.userOffset * step;
        if (step == w) {
          std::memcpy(dst, src, static_cast<size_t>(p.numTokens * w));
          src += p.numTokens * w;
          continue;
        }
        for (int64_t i = 0; i < p.numTokens; ++i, src += w) {
          std::memcpy(dst + i * step, src, static_cast<size_t>(w));
        }
      }
    }
  }
  if (ctx_.timeline) {
    ctx_.timeline->add("reshuffle out (rest)", 1, start, Timeline::nowUs());
    ctx_.timeline->add("wait", 2, start, Timeline::nowUs());
  }
}

void Outward::keepBuffersForever() {
  keepForever(sendBufs_);
  keepForever(incoming_);
}

}  // namespace fcp::runtime::detail
