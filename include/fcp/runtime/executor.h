#pragma once
/// The executor: carries out one worker's part of a `Plan` on real tensors, forward and
/// backward, over a Transport. It never decides anything the plan did not say: the blocks it
/// owns, the KV it sends and receives in each stage, the pairs it computes, when it frees a
/// buffer and where each dK/dV partial goes all come from the plan.
///
/// One Executor serves one batch: it indexes the plan once and every layer of the model shares
/// it; what a layer's backward needs from its forward lives in a LayerState the caller holds per
/// layer. Most callers want the checked front end in fcp/api/attention.h instead.
///
/// Tensors: Q, O, dO, dQ as [tokens, numHeadsQ, headDim], K, V, dK, dV as [tokens, numHeadsKv,
/// headDim] in the storage dtype (fp32 or bf16; arithmetic is fp32), LSE as [tokens, numHeadsQ]
/// fp32 (natural log). Their rows are this rank's tokens in the call layout: the user layout
/// (plan::userLayout, transparent) or the FCP layout (the local blocks' tokens one block after
/// another, dispatched).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <vector>

#include "fcp/kernels/attention.h"
#include "fcp/plan/plan.h"
#include "fcp/runtime/timeline.h"
#include "fcp/runtime/transport.h"

namespace fcp::runtime {

/// Where the tensors of forward and backward live.
enum class Layout {
  kTransparent,  ///< the caller's layout: each call reshuffles in and out
  kDispatched,   ///< FCP's layout: the caller dispatched its tensors once; calls move no tokens
};

/// Most kernel threads per rank (ExecutorOptions::numThreads; `fcp run --threads` too).
inline constexpr int kMaxKernelThreads = 256;

struct ExecutorOptions {
  /// Kernel threads per rank.
  int numThreads = 1;
  /// When set, every kernel call and message is recorded here.
  Timeline* timeline = nullptr;
  /// Storage type of Q, K, V, O, dO, dQ, dK, dV; must match the plan's element bytes.
  kernels::DType dtype = kernels::DType::kFp32;
  Layout layout = Layout::kTransparent;
  /// First message tag; each call uses tagsNeeded() tags from firstTag, or from a later window
  /// up to the transport's largest tag (Executor::setTagKey).
  int firstTag = kFirstFcpTag;
  /// The scale of Q Kᵀ before the softmax; 0 means 1/sqrt(head_dim) (kernels::KernelOptions).
  float softmaxScale = 0;
};

/// A caller's tensor in the call layout, read-only: row t (one token's heads × head_dim, dense)
/// starts at data + t × strideBytes. strideBytes 0 means rows back to back; otherwise it is at
/// least a row's bytes and a multiple of the element's (a view of a fused QKV projection, say).
struct ConstRows {
  const void* data = nullptr;
  int64_t strideBytes = 0;
  ConstRows() = default;
  // Implicit, so that a caller with rows back to back passes a plain pointer.
  ConstRows(const void* rows, int64_t stride = 0) : data(rows), strideBytes(stride) {}  // NOLINT
};

/// A caller's writable tensor in the call layout, likewise.
struct Rows {
  void* data = nullptr;
  int64_t strideBytes = 0;
  Rows() = default;
  // Implicit, as ConstRows's.
  Rows(void* rows, int64_t stride = 0) : data(rows), strideBytes(stride) {}  // NOLINT
};

/// The bytes from the first of `rows` rows of `rowBytes` bytes to the end of the last, rows
/// `strideBytes` apart (0: back to back): what a span of them holds. 0 for no rows, and for a
/// row size or stride that dispatch refuses (negative, or past what an int64 offset reaches).
int64_t rowsExtentBytes(int64_t rows, int64_t rowBytes, int64_t strideBytes);

/// What one pass cost on this rank.
struct PassStats {
  double wallMs = 0;      ///< the whole pass, reshuffles included
  double kernelMs = 0;    ///< time inside attention kernels (and LSE merges)
  double flops = 0;       ///< useful FLOPs computed (DESIGN.md's convention)
  int64_t sentBytes = 0;  ///< bytes this rank sent: KV, dK/dV partials and reshuffle pieces
  int64_t kvBytes = 0;    ///< of which KV blocks and dK/dV partials (the plan's transfers)
  int64_t recvBytes = 0;  ///< bytes this rank received, likewise
};

/// What one layer's backward needs from its forward, in the FCP layout: Q and K|V per block in
/// the storage dtype, O and LSE in fp32. The caller keeps one per layer; `batchId` names the
/// Executor whose forward filled it (0: none yet).
struct LayerState {
  std::vector<std::byte> q, kv;
  std::vector<float> o, lse;
  uint64_t batchId = 0;
};

/// Runs a plan's stages for transport.rank(). The plan must be valid (plan::validate) and
/// identical on every rank (see checkPlanAgreement). The executor owns its copy of the plan.
class Executor {
 public:
  Executor(plan::Plan plan, Transport& transport, const ExecutorOptions& options = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  /// Movable (the plan and buffers move, with the id): a moved-from executor may only be
  /// destroyed or assigned to.
  Executor(Executor&&) noexcept;
  Executor& operator=(Executor&&) noexcept;

  const plan::Plan& plan() const;
  const ExecutorOptions& options() const;
  /// A number unique to this executor in the process (never 0).
  uint64_t id() const;
  /// Tokens this rank holds in the user layout.
  int64_t userTokens() const;
  /// Tokens of this rank's blocks (the FCP layout).
  int64_t localTokens() const;
  /// Rows of the tensors forward and backward take: userTokens or localTokens, by layout.
  int64_t callTokens() const;
  /// Message tags one call of this plan needs (from firstTag, or its window's first tag).
  int64_t tagsNeeded() const;
  /// The calls that follow send and receive in tag window `key` mod W, where W windows of
  /// tagsNeeded() tags fit from firstTag to the transport's largest tag (window 0, from
  /// firstTag, until this is called). fcp::AttentionBatch keys each call by the batch, the call's
  /// kind and its place in the transport's sequence of calls, the same on every rank: calls
  /// that ranks make out of step (another batch's, an extra one) then miss each other's
  /// messages and fail on the timeout, rather than take them (wrong results, no error) unless
  /// their keys meet in one window (1 in W). Every rank must pass the same key for a call.
  void setTagKey(uint64_t key);
  /// For each token of the FCP layout: its sequence (index into the batch) and its position
  /// inside that sequence.
  std::span<const int32_t> localSequence() const;
  std::span<const int64_t> localPosition() const;

  /// Moves a per-token tensor of `rowBytes` bytes per token from the user layout (userTokens
  /// rows) into the FCP layout (localTokens rows), or back. Collective. Rows are `userStride`
  /// and `localStride` bytes apart (0: rowBytes, back to back); each span holds exactly its
  /// rows, from the first row's start to the last row's end.
  void dispatch(std::span<const std::byte> user, std::span<std::byte> local, int64_t rowBytes,
                int64_t userStride = 0, int64_t localStride = 0);
  void undispatch(std::span<const std::byte> local, std::span<std::byte> user, int64_t rowBytes,
                  int64_t localStride = 0, int64_t userStride = 0);
  /// Throws what dispatch (intoFcp) or undispatch throws for these buffers (before any
  /// message: a caller may check first).
  void checkMove(bool intoFcp, size_t userBytes, size_t localBytes, int64_t rowBytes,
                 int64_t userStride = 0, int64_t localStride = 0) const;

  /// Attention forward of one layer: q, k, v in, o (and lse unless its data is null) out, all
  /// callTokens rows; keeps what backward needs in `layer`. Collective: every rank calls it.
  /// A stride that is not 0, not a multiple of the element, under one row or past what an
  /// int64 offset reaches for callTokens rows throws before any message.
  void forward(LayerState& layer, ConstRows q, ConstRows k, ConstRows v, Rows o, Rows lse);
  /// Attention backward of `layer`'s last forward: dO in, dQ, dK, dV out. Collective.
  /// `layer` is not changed, except after an error whose pending sends may still read its K|V
  /// (the transport cannot withdraw them): that K|V is then kept for the life of the process,
  /// and `layer` needs a forward before its next backward.
  void backward(LayerState& layer, ConstRows dO, Rows dq, Rows dk, Rows dv);
  /// Throws what backward throws for a `layer` whose last forward was not with this batch
  /// (before any message: a caller may check first).
  void checkBackward(const LayerState& layer) const;

  /// The last forward's and backward's costs on this rank.
  const PassStats& forwardStats() const;
  const PassStats& backwardStats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Compares this rank's plan digest (plan::planDigest) with every other rank's (one
/// allreduce). Throws Error(kInvalidPlan) on every rank when any two differ, naming this rank's
/// digest and the range seen, so that no rank starts a plan the others do not share. When a
/// rank could not plan (failPlanAgreement), throws instead an Error with that rank's code that
/// names the lowest such rank. The same allreduce compares the ranks' CallLedger states: unless
/// no call threw, or every rank threw in the same call before it reached the transport (then
/// the ledger is cleared), throws Error(kTransport) on every rank, asking for a new transport;
/// so do call counts that differ between the ranks.
void checkPlanAgreement(const plan::Plan& plan, Transport& transport);
/// The same, for a plan whose digest (plan::planDigest) was computed already: on the thread
/// that made the plan, say, so that the thread taking it makes only the allreduce.
void checkPlanAgreement(uint64_t digest, Transport& transport);

/// What a rank whose planning threw calls in place of checkPlanAgreement (the same single
/// allreduce): the other ranks learn that it failed and throw too, so that every rank stops at
/// the same collective rather than wait for one that will not come. Then rethrows `failure`
/// (also when the allreduce itself fails: the planning error is the cause). An fcp::Error
/// passes its code on; any other exception is reported to the others as kInternal.
[[noreturn]] void failPlanAgreement(std::exception_ptr failure, Transport& transport);

}  // namespace fcp::runtime
