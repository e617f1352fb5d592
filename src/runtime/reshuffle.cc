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

Inward::Inward(const ReshuffleContext& context, std::vector<Field> fields, int tag)
    : ctx_(context), fields_(std::move(fields)), tag_(tag) {}

// Every field's rows for one destination rank are packed into one message, fields one after
// another, pieces in stream order; pieces that stay on this rank are copied at once.
void Inward::keepBuffersForever() {
  keepForever(sendBufs_);
  keepForever(recvBufs_);
}

void Inward::post() {
  const LayoutIndex& index = ctx_.index;
  const size_t n = index.inbound.size();
  const int64_t row = rowBytes(fields_);
  startUs_ = Timeline::nowUs();
  sendBufs_.assign(n, {});
  recvBufs_.assign(n, {});
  for (size_t peer = 0; peer < n; ++peer) {
    if (static_cast<int>(peer) == ctx_.rank || index.inbound[peer].empty()) continue;
    int64_t tokens = 0;
    for (const Piece& p : index.inbound[peer]) tokens += p.numTokens;
    recvBufs_[peer].resize(static_cast<size_t>(tokens * row));
    if (ctx_.stats) ctx_.stats->recvBytes += tokens * row;
    requests_.push_back(ctx_.transport.irecv(static_cast<int>(peer), tag_, recvBufs_[peer]));
  }
  for (size_t peer = 0; peer < n; ++peer) {
    const bool local = static_cast<int>(peer) == ctx_.rank;
    std::vector<std::byte>& buf = sendBufs_[peer];
    int64_t tokens = 0;
    for (const Piece& p : index.outbound[peer]) tokens += p.numTokens;
    if (tokens == 0) continue;
    if (!local) buf.resize(static_cast<size_t>(tokens * row));
    std::byte* dst = buf.data();
    for (const Field& f : fields_) {
      const int64_t w = f.wireBytes();
      for (const Piece& p : index.outbound[peer]) {
        for (int64_t i = 0; i < p.numTokens; ++i) {
          const std::byte* src = f.user + (p.userOffset + i) * w;
          if (local) {
            copyElements(f.fcp(p.localBlock, p.blockOffset + i), f.fcpElem, src, f.userElem,
                         f.elements);
          } else {
            std::memcpy(dst, src, static_cast<size_t>(w));
            dst += w;
          }
        }
      }
    }
    if (local) continue;
    if (ctx_.stats) ctx_.stats->sentBytes += static_cast<int64_t>(buf.size());
    requests_.push_back(ctx_.transport.isend(static_cast<int>(peer), tag_, buf));
  }
}

bool Inward::arrived() {
  while (completed_ < requests_.size() && ctx_.transport.test(requests_[completed_])) ++completed_;
  return completed_ == requests_.size();
}

void Inward::finish() {
  const double waitStart = Timeline::nowUs();
  waitAll(ctx_.transport, std::span<const RequestId>(requests_).subspan(completed_));
  completed_ = requests_.size();
  if (ctx_.timeline) ctx_.timeline->add("wait", 2, waitStart, Timeline::nowUs());
  for (size_t peer = 0; peer < recvBufs_.size(); ++peer) {
    const std::byte* src = recvBufs_[peer].data();
    if (recvBufs_[peer].empty()) continue;
    for (const Field& f : fields_) {
      const int64_t w = f.wireBytes();
      for (const Piece& p : ctx_.index.inbound[peer]) {
        for (int64_t i = 0; i < p.numTokens; ++i, src += w) {
          copyElements(f.fcp(p.localBlock, p.blockOffset + i), f.fcpElem, src, f.userElem,
                       f.elements);
        }
      }
    }
  }
  if (ctx_.timeline) ctx_.timeline->add("reshuffle in", 1, startUs_, Timeline::nowUs());
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
      const int64_t w = f.wireBytes();
      for (const Piece& p : index.inbound[peer]) {
        if (p.localBlock != local) continue;
        block = p.block;
        for (int64_t i = 0; i < p.numTokens; ++i) {
          const std::byte* src = f.fcp(local, p.blockOffset + i);
          std::byte* dst = nullptr;
          if (here) {
            dst = f.userOut + (p.userOffset + i) * w;
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
      const int64_t w = f.wireBytes();
      for (const Piece& p : ctx_.index.outbound[static_cast<size_t>(in.peer)]) {
        if (p.block != in.block) continue;
        std::memcpy(f.userOut + p.userOffset * w, src, static_cast<size_t>(p.numTokens * w));
        src += p.numTokens * w;
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
