// Ulysses inside a node around FCP across nodes (include/fcp/api/ulysses.h).
#include "fcp/api/ulysses.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <sstream>

#include "fcp/core/config.h"
#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"

namespace fcp {
namespace {

/// memcpy, for any count: an empty member's buffers may have no data, and memcpy's pointers
/// must not be null even for 0 bytes.
void copyBytes(void* to, const void* from, size_t bytes) {
  if (bytes > 0) std::memcpy(to, from, bytes);
}

/// A run of heads of a row.
struct Heads {
  int64_t first = 0;
  int64_t count = 0;
};

/// Member j's query heads: a contiguous share.
Heads queryHeads(int64_t heads, int64_t degree, int64_t j) {
  const int64_t h = heads / degree;
  return {j * h, h};
}

/// Member j's key/value heads: a contiguous share, or where the members outnumber them the one
/// its query heads read (GQA), replicated on degree / kvHeads members.
Heads kvHeadsOf(int64_t kvHeads, int64_t degree, int64_t j) {
  if (kvHeads % degree == 0) return {j * (kvHeads / degree), kvHeads / degree};
  return {j * kvHeads / degree, 1};
}

/// A caller's tensor as rows of bytes.
struct Rows {
  std::byte* data = nullptr;
  int64_t stride = 0;  ///< bytes from one row to the next
  int64_t headBytes = 0;
  std::byte* row(int64_t t) const { return data + t * stride; }
};

Rows rowsOf(ConstTensorRef t) {
  const int64_t e = kernels::dtypeBytes(t.dtype);
  return {const_cast<std::byte*>(static_cast<const std::byte*>(t.data)),
          (t.rowStride != 0 ? t.rowStride : t.numHeads * t.headDim) * e, t.headDim * e};
}

/// Appends heads `h` of rows [0, n) of `in` to `out`, row after row.
void appendHeads(const Rows& in, int64_t n, Heads h, std::vector<std::byte>& out) {
  const auto bytes = static_cast<size_t>(h.count * in.headBytes);
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(n) * bytes);
  for (int64_t t = 0; t < n; ++t) {
    copyBytes(out.data() + at + static_cast<size_t>(t) * bytes,
                in.row(t) + h.first * in.headBytes, bytes);
  }
}

/// Writes `n` rows of heads `h` (back to back at `in`) into heads `h` of `out`'s rows.
void writeHeads(const std::byte* in, int64_t n, Heads h, const Rows& out) {
  const auto bytes = static_cast<size_t>(h.count * out.headBytes);
  for (int64_t t = 0; t < n; ++t) {
    copyBytes(out.row(t) + h.first * out.headBytes, in + static_cast<size_t>(t) * bytes, bytes);
  }
}

/// Adds `n` rows of heads `h` of `dtype` (back to back at `in`) into heads `h` of `sum`, fp32
/// rows of `heads` heads of `dim`.
void addHeads(const std::byte* in, DType dtype, int64_t n, Heads h, int64_t heads, int64_t dim,
              std::vector<float>& sum) {
  const int64_t width = h.count * dim;
  for (int64_t t = 0; t < n; ++t) {
    float* to = sum.data() + (t * heads + h.first) * dim;
    if (dtype == DType::kFp32) {
      const auto* from = reinterpret_cast<const float*>(in) + t * width;
      for (int64_t i = 0; i < width; ++i) to[i] += from[i];
    } else {
      const auto* from = reinterpret_cast<const uint16_t*>(in) + t * width;
      for (int64_t i = 0; i < width; ++i) to[i] += kernels::fromBf16(from[i]);
    }
  }
}

/// Writes fp32 rows (n × heads × dim, back to back) into `out`'s rows in its dtype.
void writeRows(const std::vector<float>& in, int64_t n, int64_t heads, int64_t dim, DType dtype,
               const Rows& out) {
  const int64_t width = heads * dim;
  for (int64_t t = 0; t < n; ++t) {
    const float* from = in.data() + t * width;
    if (dtype == DType::kFp32) {
      copyBytes(out.row(t), from, static_cast<size_t>(width) * sizeof(float));
    } else {
      auto* to = reinterpret_cast<uint16_t*>(out.row(t));
      for (int64_t i = 0; i < width; ++i) to[i] = kernels::toBf16(from[i]);
    }
  }
}

std::string rangesText(const std::vector<int64_t>& ends) {
  std::ostringstream text;
  text << '[';
  for (size_t m = 0; m + 1 < ends.size(); m += 2) {
    text << (m ? ", " : "") << '[' << ends[m] << ", " << ends[m + 1] << ')';
  }
  text << ']';
  return text.str();
}

/// The layers' tensor check (AttentionLayer's), for this rank's rows with every head.
void checkShape(const char* name, ConstTensorRef t, int64_t tokens, int64_t heads, int64_t dim,
                DType dtype) {
  detail::checkTensor(name, t, tokens, heads, dim, dtype,
                      "this rank's tokens in the caller's layout, every head");
}

}  // namespace

UlyssesGroup::UlyssesGroup(runtime::Transport& node, const BatchOptions& options)
    : node_(&node),
      options_(options),
      member_(node.rank()),
      heads_(options.numHeadsQ),
      kvHeads_(options.numHeadsKv) {
  const auto degree = static_cast<size_t>(node.size());
  // One allreduce (max) over the node: every member's range in its slot (the others' slots at
  // the least int64), and every setting's hash and its negation, so that members that differ
  // in anything the batch's agreement compares are refused here: that agreement runs over each
  // index's ranks only (over none but this rank when the node is the whole job).
  const std::vector<int64_t> hashes = detail::settingHashes(options);
  const size_t settings = hashes.size();
  std::vector<int64_t> values(2 * degree + 2 * settings, std::numeric_limits<int64_t>::min());
  values[2 * static_cast<size_t>(member_)] = options.localBegin;
  values[2 * static_cast<size_t>(member_) + 1] = options.localEnd;
  for (size_t i = 0; i < settings; ++i) {
    values[2 * degree + 2 * i] = hashes[i];
    values[2 * degree + 2 * i + 1] = -hashes[i];  // hashes are not negative
  }
  // As long as the batch's agreement after a failed call waits: a member may still be inside
  // the failed call's exchange.
  node.allreduce(values, runtime::ReduceOp::kMax, detail::afterFailureSeconds(node));
  const std::vector<int64_t> ends(values.begin(),
                                  values.begin() + static_cast<int64_t>(2 * degree));
  rows_.resize(degree);
  offsets_.assign(degree + 1, 0);
  for (size_t m = 0; m < degree; ++m) {
    rows_[m] = std::max<int64_t>(ends[2 * m + 1] - ends[2 * m], 0);
    offsets_[m + 1] = offsets_[m] + rows_[m];
  }
  const auto d = static_cast<int64_t>(degree);
  for (size_t i = 0; i < settings && error_.empty(); ++i) {
    if (values[2 * degree + 2 * i] != hashes[i] || -values[2 * degree + 2 * i + 1] != hashes[i]) {
      error_ = std::string("the node's members passed different settings (") +
               detail::settingName(i) + "): expected the same on every member";
    }
  }
  for (size_t m = 0; m < degree && error_.empty(); ++m) {
    if (ends[2 * m] > ends[2 * m + 1] || (m + 1 < degree && ends[2 * m + 1] != ends[2 * m + 2])) {
      error_ = "the node's ranges are " + rangesText(ends) +
               ": expected each member's range to end where the next member's begins (the node "
               "holds one run of the stream)";
    }
  }
  const AttentionConfig model{.numHeadsQ = heads_, .numHeadsKv = kvHeads_};
  if (error_.empty() && (heads_ <= 0 || kvHeads_ <= 0 || heads_ % kvHeads_ != 0)) {
    error_ = "numHeadsQ " + std::to_string(heads_) + " and numHeadsKv " + std::to_string(kvHeads_) +
             ": expected positive counts, the key/value heads dividing the query heads";
  }
  if (error_.empty() && !splitsHeads(model, d)) {
    error_ = "a node of " + std::to_string(d) + " ranks with " + std::to_string(heads_) +
             " query and " + std::to_string(kvHeads_) +
             " key/value heads: expected a divisor of the query heads that divides the "
             "key/value heads or is a multiple of them";
  }
  if (error_.empty() && options.layout != Layout::kTransparent) {
    error_ =
        "a dispatched layout with Ulysses inside a node: expected the transparent layout "
        "(each member keeps its own rows; a dispatched layout would be the node's)";
  }
  options_.localBegin = ends[0];
  options_.localEnd = ends[2 * degree - 1];
  if (error_.empty()) {
    options_.numHeadsQ = heads_ / d;
    options_.numHeadsKv = std::max<int64_t>(1, kvHeads_ / d);
    // A node is one worker of the batch across nodes: its budget is its members'.
    if (options_.planConfig.memoryLimitTokens > 0 &&
        options_.planConfig.memoryLimitTokens <= std::numeric_limits<int64_t>::max() / d) {
      options_.planConfig.memoryLimitTokens *= d;
    }
  } else {
    options_.localBegin = options_.localEnd = 0;
  }
}

BatchOptions UlyssesGroup::paired(runtime::Transport& across) const {
  BatchOptions o = this->across();
  std::vector<int64_t> seen = {member_, -member_, degree(), -degree()};
  across.allreduce(seen, runtime::ReduceOp::kMax, detail::afterFailureSeconds(across));
  if (o.localError.empty() &&
      (seen[0] != member_ || -seen[1] != member_ || seen[2] != degree() || -seen[3] != degree())) {
    o.localError = "the across transport joins members " + std::to_string(-seen[1]) + " to " +
                   std::to_string(seen[0]) + " of nodes of " + std::to_string(-seen[3]) + " to " +
                   std::to_string(seen[2]) + " ranks: expected the ranks with this rank's index (" +
                   std::to_string(member_) + ") in every node of " + std::to_string(degree());
  }
  return o;
}

template <typename Made, typename Make>
Made UlyssesGroup::confirmed(Make&& make) const {
  std::optional<Made> made;
  std::exception_ptr error;  // any exception: the node must hear of it before it is rethrown
  try {
    made.emplace(make());
  } catch (...) {
    error = std::current_exception();
  }
  std::vector<int64_t> failed(rows_.size(), 0);
  failed[static_cast<size_t>(member_)] = error ? 1 : 0;
  node_->allreduce(failed, runtime::ReduceOp::kSum, detail::afterFailureSeconds(*node_));
  if (error) std::rethrow_exception(error);
  for (size_t m = 0; m < failed.size(); ++m) {
    if (failed[m] != 0) {
      throwInvalidArgument("member ", m,
                           " of the node could not make the batch (its own error says ",
                           "why): expected every member's batch");
    }
  }
  return std::move(*made);
}

// The pairing check inside confirmed(): its allreduce may throw on one member (a timeout, a
// transport an earlier call abandoned), which must still tell the node.
AttentionBatch UlyssesGroup::batch(runtime::Transport& across) const {
  return confirmed<AttentionBatch>([&] { return AttentionBatch(across, paired(across)); });
}

PendingBatch UlyssesGroup::pending(runtime::Transport& across) const {
  return confirmed<PendingBatch>([&] { return PendingBatch(across, paired(across)); });
}

AttentionBatch UlyssesGroup::batch(PendingBatch&& pending) const {
  return confirmed<AttentionBatch>([&] { return AttentionBatch(std::move(pending)); });
}

void UlyssesGroup::checkBatch(const AttentionBatch& batch) const {
  const auto& share = batch.plan().config.attention;
  const int64_t d = degree();
  if (!error_.empty() || share.numHeadsQ * d != heads_ ||
      share.numHeadsKv != std::max<int64_t>(1, kvHeads_ / d) ||
      numNodeTokens() != batch.numCallTokens() || batch.layout() != Layout::kTransparent) {
    throwInvalidArgument("the batch has ", batch.numCallTokens(), " rows of ", share.numHeadsQ,
                         " query heads: expected the ", numNodeTokens(), " rows of ", heads_ / d,
                         " of this node's UlyssesGroup (a batch made from its across())");
  }
}

BatchOptions UlyssesGroup::across() const {
  BatchOptions o = options_;
  if (!error_.empty() && o.localError.empty()) o.localError = error_;
  return o;
}

namespace {

/// Sends send[j] to member j and receives recv[m] (sized by the caller) from member m over the
/// node; a member's own part is copied. `tag` the same on every member for this exchange. Adds
/// the bytes that left and reached this rank to `stats`.
void exchange(runtime::Transport& node, int tag, std::vector<std::vector<std::byte>>& send,
              std::vector<std::vector<std::byte>>& recv, PassStats& stats) {
  const int me = node.rank();
  for (int m = 0; m < node.size(); ++m) {
    if (m == me) continue;
    stats.sentBytes += static_cast<int64_t>(send[static_cast<size_t>(m)].size());
    stats.recvBytes += static_cast<int64_t>(recv[static_cast<size_t>(m)].size());
  }
  if (recv[static_cast<size_t>(me)].size() != send[static_cast<size_t>(me)].size()) {
    throw Error(ErrorCode::kInternal, "Ulysses exchange: a member's own part changed size");
  }
  std::vector<runtime::RequestId> requests;
  const runtime::PendingGuard guard(node, [&] {
    runtime::keepForever(send);
    runtime::keepForever(recv);
  });
  for (int m = 0; m < node.size(); ++m) {
    // No message where there is nothing to move (an empty member): both ends know the sizes.
    if (m != me && !recv[static_cast<size_t>(m)].empty())
      requests.push_back(node.irecv(m, tag, recv[static_cast<size_t>(m)]));
  }
  for (int j = 0; j < node.size(); ++j) {
    if (j != me && !send[static_cast<size_t>(j)].empty())
      requests.push_back(node.isend(j, tag, send[static_cast<size_t>(j)]));
  }
  recv[static_cast<size_t>(me)] = send[static_cast<size_t>(me)];
  runtime::waitAll(node, requests);
}

/// A pass's stats: the batch's (kernels, FLOPs, bytes across nodes) with the node's exchanges'
/// bytes added and the wall time of the whole call since `start`.
PassStats withExchanges(PassStats s, const PassStats& exchanged,
                        std::chrono::steady_clock::time_point start) {
  s.wallMs =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  s.sentBytes += exchanged.sentBytes;
  s.recvBytes += exchanged.recvBytes;
  return s;
}

/// The tag of a group's next exchange: from the batch's first tag, one per exchange in a window
/// of 2^16.
int nextTag(runtime::Transport& node, int firstTag, int64_t& calls) {
  const int64_t window = 1 << 16;
  if (firstTag < 0 || static_cast<int64_t>(node.maxTag()) < int64_t{firstTag} + window - 1) {
    throwInvalidArgument("the node transport's largest tag is ", node.maxTag(),
                         ": expected at least ", int64_t{firstTag} + window - 1,
                         " (the batch's first tag + 2^16 - 1)");
  }
  return firstTag + static_cast<int>(calls++ % window);
}

}  // namespace

void UlyssesLayer::forward(UlyssesGroup& g, AttentionBatch& batch, ConstTensorRef q,
                           ConstTensorRef k, ConstTensorRef v, TensorRef o, TensorRef lse) {
  const auto start = std::chrono::steady_clock::now();
  PassStats exchanged;
  batch.collective("forward", 0, [&] {
    g.checkBatch(batch);
    const auto& share = batch.plan().config.attention;
    const int64_t d = g.degree(), n = g.numUserTokens(), total = g.numNodeTokens();
    const int64_t dim = share.headDim, sq = share.numHeadsQ, skv = share.numHeadsKv;
    const DType dt = batch.dtype();
    checkShape("q", q, n, g.heads_, dim, dt);
    checkShape("k", k, n, g.kvHeads_, dim, dt);
    checkShape("v", v, n, g.kvHeads_, dim, dt);
    checkShape("o", o, n, g.heads_, dim, dt);
    if (lse.data != nullptr) checkShape("lse", lse, n, g.heads_, 1, DType::kFp32);
    const int64_t e = kernels::dtypeBytes(dt), qRow = sq * dim * e, kvRow = skv * dim * e;
    const auto u = static_cast<size_t>(d);
    std::vector<std::vector<std::byte>> send(u), recv(u);
    for (int64_t j = 0; j < d; ++j) {
      auto& s = send[static_cast<size_t>(j)];
      s.reserve(static_cast<size_t>(n * (qRow + 2 * kvRow)));
      appendHeads(rowsOf(q), n, queryHeads(g.heads_, d, j), s);
      appendHeads(rowsOf(k), n, kvHeadsOf(g.kvHeads_, d, j), s);
      appendHeads(rowsOf(v), n, kvHeadsOf(g.kvHeads_, d, j), s);
      recv[static_cast<size_t>(j)].resize(
          static_cast<size_t>(g.rows_[static_cast<size_t>(j)] * (qRow + 2 * kvRow)));
    }
    const int tagIn = nextTag(*g.node_, g.options_.firstTag, g.calls_);
    const int tagOut = nextTag(*g.node_, g.options_.firstTag, g.calls_);
    batch.reached_ = true;  // messages may be out from here
    exchange(*g.node_, tagIn, send, recv, exchanged);
    // The node's rows of this member's heads, member after member.
    std::vector<std::byte> qs(static_cast<size_t>(total * qRow)),
        ks(static_cast<size_t>(total * kvRow)), vs(static_cast<size_t>(total * kvRow)),
        os(static_cast<size_t>(total * qRow));
    std::vector<float> lses(static_cast<size_t>(total * sq));
    for (size_t m = 0; m < u; ++m) {
      const int64_t r = g.rows_[m], at = g.offsets_[m];
      const std::byte* b = recv[m].data();
      copyBytes(qs.data() + at * qRow, b, static_cast<size_t>(r * qRow));
      copyBytes(ks.data() + at * kvRow, b + r * qRow, static_cast<size_t>(r * kvRow));
      copyBytes(vs.data() + at * kvRow, b + r * (qRow + kvRow), static_cast<size_t>(r * kvRow));
    }
    layer_.forwardChecked(batch, {qs.data(), dt, total, sq, dim}, {ks.data(), dt, total, skv, dim},
                          {vs.data(), dt, total, skv, dim}, {os.data(), dt, total, sq, dim},
                          {lses.data(), DType::kFp32, total, sq, 1});
    // Back: member m gets its rows' o and lse of this member's heads (lse always, so that the
    // messages' sizes never depend on what a member asked for).
    const int64_t lseRow = sq * static_cast<int64_t>(sizeof(float));
    for (size_t m = 0; m < u; ++m) {
      const int64_t r = g.rows_[m], at = g.offsets_[m];
      auto& s = send[m];
      s.resize(static_cast<size_t>(r * (qRow + lseRow)));
      copyBytes(s.data(), os.data() + at * qRow, static_cast<size_t>(r * qRow));
      copyBytes(s.data() + r * qRow, lses.data() + at * sq, static_cast<size_t>(r * lseRow));
      recv[m].assign(static_cast<size_t>(n * (qRow + lseRow)), std::byte{0});
    }
    exchange(*g.node_, tagOut, send, recv, exchanged);
    const Rows oRows = rowsOf(o), lseRows = rowsOf(lse);
    for (int64_t j = 0; j < d; ++j) {
      const Heads h = queryHeads(g.heads_, d, j);
      const std::byte* b = recv[static_cast<size_t>(j)].data();
      writeHeads(b, n, h, oRows);
      if (lse.data != nullptr) writeHeads(b + n * qRow, n, h, lseRows);
    }
  });
  stats_[0] = withExchanges(batch.forwardStats(), exchanged, start);
}

void UlyssesLayer::backward(UlyssesGroup& g, AttentionBatch& batch, ConstTensorRef dO, TensorRef dq,
                            TensorRef dk, TensorRef dv) {
  const auto start = std::chrono::steady_clock::now();
  PassStats exchanged;
  batch.collective("backward", 0, [&] {
    g.checkBatch(batch);
    const auto& share = batch.plan().config.attention;
    const int64_t d = g.degree(), n = g.numUserTokens(), total = g.numNodeTokens();
    const int64_t dim = share.headDim, sq = share.numHeadsQ, skv = share.numHeadsKv;
    const DType dt = batch.dtype();
    checkShape("dO", dO, n, g.heads_, dim, dt);
    checkShape("dq", dq, n, g.heads_, dim, dt);
    checkShape("dk", dk, n, g.kvHeads_, dim, dt);
    checkShape("dv", dv, n, g.kvHeads_, dim, dt);
    batch.executor().checkBackward(layer_.state_);
    const int64_t e = kernels::dtypeBytes(dt), qRow = sq * dim * e, kvRow = skv * dim * e;
    const auto u = static_cast<size_t>(d);
    std::vector<std::vector<std::byte>> send(u), recv(u);
    for (int64_t j = 0; j < d; ++j) {
      appendHeads(rowsOf(dO), n, queryHeads(g.heads_, d, j), send[static_cast<size_t>(j)]);
      recv[static_cast<size_t>(j)].resize(
          static_cast<size_t>(g.rows_[static_cast<size_t>(j)] * qRow));
    }
    const int tagIn = nextTag(*g.node_, g.options_.firstTag, g.calls_);
    const int tagOut = nextTag(*g.node_, g.options_.firstTag, g.calls_);
    batch.reached_ = true;
    exchange(*g.node_, tagIn, send, recv, exchanged);
    std::vector<std::byte> dOs(static_cast<size_t>(total * qRow)), dqs(dOs.size()),
        dks(static_cast<size_t>(total * kvRow)), dvs(dks.size());
    for (size_t m = 0; m < u; ++m) {
      copyBytes(dOs.data() + g.offsets_[m] * qRow, recv[m].data(), recv[m].size());
    }
    layer_.backwardChecked(batch, {dOs.data(), dt, total, sq, dim},
                           {dqs.data(), dt, total, sq, dim}, {dks.data(), dt, total, skv, dim},
                           {dvs.data(), dt, total, skv, dim});
    for (size_t m = 0; m < u; ++m) {
      const int64_t r = g.rows_[m], at = g.offsets_[m];
      auto& s = send[m];
      s.resize(static_cast<size_t>(r * (qRow + 2 * kvRow)));
      copyBytes(s.data(), dqs.data() + at * qRow, static_cast<size_t>(r * qRow));
      copyBytes(s.data() + r * qRow, dks.data() + at * kvRow, static_cast<size_t>(r * kvRow));
      copyBytes(s.data() + r * (qRow + kvRow), dvs.data() + at * kvRow,
                  static_cast<size_t>(r * kvRow));
      recv[m].assign(static_cast<size_t>(n * (qRow + 2 * kvRow)), std::byte{0});
    }
    exchange(*g.node_, tagOut, send, recv, exchanged);
    // dq: each member's heads; dk, dv: summed in fp32 over the members that shared a head.
    std::vector<float> dkSum(static_cast<size_t>(n * g.kvHeads_ * dim), 0.0f),
        dvSum(dkSum.size(), 0.0f);
    for (int64_t j = 0; j < d; ++j) {
      const std::byte* b = recv[static_cast<size_t>(j)].data();
      writeHeads(b, n, queryHeads(g.heads_, d, j), rowsOf(dq));
      const Heads h = kvHeadsOf(g.kvHeads_, d, j);
      addHeads(b + n * qRow, dt, n, h, g.kvHeads_, dim, dkSum);
      addHeads(b + n * (qRow + kvRow), dt, n, h, g.kvHeads_, dim, dvSum);
    }
    writeRows(dkSum, n, g.kvHeads_, dim, dt, rowsOf(dk));
    writeRows(dvSum, n, g.kvHeads_, dim, dt, rowsOf(dv));
  });
  stats_[1] = withExchanges(batch.backwardStats(), exchanged, start);
}

}  // namespace fcp
