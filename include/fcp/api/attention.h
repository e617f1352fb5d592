#pragma once
/// FCP as a library: the attention a training loop calls, over the caller's communicator,
/// token layout and dtype (docs/api.md says why it is shaped this way).
///
///   once per batch:  AttentionBatch batch(transport, options);   // plans, digest-checked
///   per layer:       layer[i].forward(batch, q, k, v, o, lse);    // any number of layers
///                    layer[i].backward(batch, dO, dq, dk, dv);    // in any order after
///
/// Or plan the next batch while this one runs (PendingBatch):
///   PendingBatch next(transport, nextOptions);   // checks, then plans on a thread of its own
///   ... this step's layers ...
///   AttentionBatch batch(std::move(next));       // waits for the plan, digest-checked
///
/// Terms. The *caller's layout*: rank r holds the contiguous token range [localBegin,
/// localEnd) of the batch's packed stream (sequences one after another as cu_seqlens says); the
/// ranges, in rank order, tile the stream (uneven, starting mid-sequence or empty are all fine).
/// *Transparent* layout: q, k, v, o, dO, ... have the caller's rows; each call reshuffles in and
/// out. *Dispatched* layout: the caller moves its per-token tensors into FCP's layout once per
/// batch (dispatch) and back (undispatch); localSequence()/localPosition() say where each row
/// of that layout belongs (for RoPE, embeddings and the loss), and attention calls move no
/// tokens. Tensors are [tokens, heads, head_dim], row major, each token's row dense and rows
/// back to back or a stride apart (ConstTensorRef::rowStride); q, o, dO, dq have
/// numHeadsQ heads, k, v, dk, dv numHeadsKv; lse is [tokens, numHeadsQ] fp32. Storage is fp32
/// or bf16 (options.dtype), arithmetic fp32.
///
/// Every call here is collective over the transport's ranks (all ranks call it, in the same
/// order). Errors throw fcp::Error with one line naming the bad value and the expected one.
/// Planning a batch fails on every rank or on none: a rank whose planning throws (a bad
/// FCP_PLAN_THREADS in its environment, memory exhausted) says so in the plan agreement, and
/// the other ranks throw there too, naming it, with its error code. The ranks then remain in
/// step, so a training loop may catch the error and go on to the next batch.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <span>
#include <string>
#include <vector>

#include "fcp/core/cost_model.h"
#include "fcp/core/error.h"
#include "fcp/kernels/attention.h"
#include "fcp/plan/plan.h"
#include "fcp/runtime/executor.h"
#include "fcp/runtime/transport.h"

namespace fcp {

using kernels::DType;
using runtime::Layout;
using runtime::PassStats;

/// A caller's read-only tensor [numTokens, numHeads, headDim] (lse: headDim 1). Each token's
/// row of numHeads × headDim elements is dense; rows are rowStride elements apart, 0 meaning
/// back to back (contiguous). A larger stride takes a view without a copy: q, k and v of a
/// fused [tokens, 3, heads, headDim] projection have rowStride 3 × heads × headDim.
struct ConstTensorRef {
  const void* data = nullptr;
  DType dtype = DType::kFp32;
  int64_t numTokens = 0;
  int64_t numHeads = 0;
  int64_t headDim = 0;
  int64_t rowStride = 0;
};

/// A caller's writable tensor, likewise. Outputs with a stride leave the elements between
/// rows as they were.
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kFp32;
  int64_t numTokens = 0;
  int64_t numHeads = 0;
  int64_t headDim = 0;
  int64_t rowStride = 0;
  operator ConstTensorRef() const { return {data, dtype, numTokens, numHeads, headDim, rowStride}; }
};

/// What a batch is and how to plan it.
struct BatchOptions {
  /// Offsets of the sequences in the packed stream: 0, len0, len0 + len1, ... (one more entry
  /// than sequences). A sequence may be empty (a repeated offset, as FlashAttention's varlen
  /// padding has): the plan leaves it out, and localSequence() still numbers sequences as
  /// here. At least one token in all. The same on every rank.
  std::vector<int64_t> cuSeqlens;
  /// This rank's token range [localBegin, localEnd) in the caller's layout.
  int64_t localBegin = 0;
  int64_t localEnd = 0;
  int64_t numHeadsQ = 8;
  int64_t numHeadsKv = 1;
  int64_t headDim = 64;
  MaskKind mask = MaskKind::kCausal;
  DType dtype = DType::kFp32;
  Layout layout = Layout::kTransparent;
  /// The planner: fcp, ring, bytescale, wlb, magi, megatron, or an ablation step fcp-base,
  /// fcp-pipeline, fcp-cfree, fcp-coalesce (baselines::makePlan).
  std::string strategy = "fcp";
  /// Planner settings. The batch fills in numWorkers, tokensPerWorker (the even share, rounded
  /// up: also the memory budget unless memoryLimitTokens is set), attention and userStarts.
  plan::PlanConfig planConfig;
  /// Pair costs for the planner; the default is the paper-shaped efficiency curve.
  CostModel costModel;
  /// Kernel threads per rank.
  int numThreads = 1;
  /// When set, every kernel call and message is recorded here.
  runtime::Timeline* timeline = nullptr;
  /// First tag of FCP's messages (runtime::kFirstFcpTag; see transport.h).
  int firstTag = runtime::kFirstFcpTag;
  /// The scale of Q Kᵀ before the softmax in every layer's forward and backward; 0 (the
  /// default) means 1/sqrt(headDim). Finite and not negative; the same on every rank.
  double softmaxScale = 0;
  /// Set by a binding whose own checks of this rank's arguments failed, to their one-line
  /// message (the other fields may then hold anything valid). The batch then fails on every
  /// rank in the agreement, this rank with this message and the others naming it, rather than
  /// on this rank alone before it, which would leave the others waiting in the agreement.
  std::string localError;
};

namespace detail {
/// One hash per setting every rank of a batch must pass alike (everything in BatchOptions but
/// the rank's own range, threads, timeline and localError), and each setting's name: what the
/// batch's agreement compares, for groups that must agree beyond it (api/ulysses.h).
std::vector<int64_t> settingHashes(const BatchOptions& options);
const char* settingName(size_t index);
/// Throws Error(kInvalidArgument) naming `name` unless `t` is [tokens, heads, dim] of `dtype`
/// with data and a row stride that fits, `rows` saying whose rows (the layers' own check).
void checkTensor(const char* name, ConstTensorRef t, int64_t tokens, int64_t heads, int64_t dim,
                 DType dtype, const char* rows);
/// How long a collective over `t` waits after a call threw: the ranks still inside that call
/// wait out their timeout first (twice the transport's timeout and 5 s; 0, the transport's own,
/// when it sets none).
double afterFailureSeconds(const runtime::Transport& t);

/// A batch's plan, checked (plan::checkValid), with its digest (plan::planDigest): what the
/// planning thread hands over, so that the thread taking the plan only compares digests.
struct CheckedPlan {
  plan::Plan plan;
  uint64_t digest = 0;
};
}  // namespace detail

/// A batch whose plan is being made on a thread of its own, so that a training loop can plan
/// step k + 1 while step k runs. The constructor is collective and does everything that talks
/// to other ranks before planning (the same two allreduces and checks as AttentionBatch's);
/// the planning thread then touches no transport, so the caller's calls on the same transport
/// (this step's attention, its own collectives) go on meanwhile. AttentionBatch(PendingBatch&&)
/// waits for the plan and checks that every rank reached the same one. The plan is the one
/// AttentionBatch(transport, options) makes; an error in planning is thrown there, on every
/// rank (each rank's own where its planning failed; elsewhere one naming it). The constructor is
/// a collective like any other: every rank makes it at the same point of its sequence of calls
/// on the transport, on the thread that makes the others (not on a prefetching thread). Destroying
/// or assigning over a pending batch that was never used waits for its planning to end.
/// `transport` and options.timeline must outlive it and the batch made from it.
class PendingBatch {
 public:
  PendingBatch(runtime::Transport& transport, const BatchOptions& options);
  PendingBatch(PendingBatch&&) noexcept = default;
  PendingBatch& operator=(PendingBatch&&) noexcept = default;
  ~PendingBatch() = default;  // the future's destructor waits for the planning thread

  /// Whether the plan is made (or planning failed): AttentionBatch(PendingBatch&&) would not
  /// wait. False once the pending batch has been used.
  bool ready() const;

 private:
  friend class AttentionBatch;
  runtime::Transport* transport_ = nullptr;
  runtime::ExecutorOptions executorOptions_;
  std::future<detail::CheckedPlan> plan_;  ///< planned, checked and hashed; not yet agreed
  /// Per planned sequence, its index in cu_seqlens (empty: the same numbering).
  std::vector<int32_t> userSequenceIds_;
  int64_t serial_ = 0;  ///< the batch's place among the transport's batches (CallLedger)
};

/// One batch: its plan (the same on every rank, checked) and the plan indexed for this rank.
/// Every layer of the model shares it. Keep it alive while its layers run forward or backward.
class AttentionBatch {
 public:
  /// Plans the batch on every rank and checks that all ranks reached the same plan (an
  /// allreduce of the ranks' ranges, one of a digest). Collective. `transport` must outlive it.
  AttentionBatch(runtime::Transport& transport, const BatchOptions& options);
  /// The batch a PendingBatch planned: waits for its plan, then checks that all ranks reached
  /// the same one (one allreduce). Collective. Throws if `pending` was already used.
  explicit AttentionBatch(PendingBatch&& pending);
  /// A batch moves like a value (a training loop may keep the step's batch in one variable and
  /// assign the next step's to it): its plan, buffers and id move with it, so a layer whose
  /// forward ran with it runs backward with the batch it moved to. A moved-from batch may only
  /// be destroyed or assigned to.
  AttentionBatch(AttentionBatch&&) noexcept = default;
  AttentionBatch& operator=(AttentionBatch&&) noexcept = default;

  const plan::Plan& plan() const { return executor_.plan(); }
  Layout layout() const { return executor_.options().layout; }
  DType dtype() const { return executor_.options().dtype; }
  /// A number unique to this batch in the process.
  uint64_t id() const { return executor_.id(); }
  /// Tokens of this rank in the caller's layout, in FCP's layout, and in the layout attention
  /// calls take (one of the two, by layout()).
  int64_t numUserTokens() const { return executor_.userTokens(); }
  int64_t numLocalTokens() const { return executor_.localTokens(); }
  int64_t numCallTokens() const { return executor_.callTokens(); }
  /// Per row of FCP's layout: the sequence it belongs to (its index in cu_seqlens) and its
  /// position inside it. plan() numbers only the sequences that have tokens.
  std::span<const int32_t> localSequence() const {
    // Empty where nothing was renumbered, or this rank has no rows (both spans empty then).
    return userSequence_.empty() ? executor_.localSequence()
                                 : std::span<const int32_t>(userSequence_);
  }
  std::span<const int64_t> localPosition() const { return executor_.localPosition(); }

  /// Moves a per-token tensor of any element type (`rowBytes` bytes per token) from the
  /// caller's layout (numUserTokens rows) into FCP's (numLocalTokens rows), or back. Rows are
  /// the strides' bytes apart (0: rowBytes, back to back); each span runs from its first row's
  /// start to its last row's end. `rowKind` is the caller's code for what a row holds (its
  /// element type and shape; 0 if it does not say). Each rank's rowBytes and rowKind key the
  /// call's tags, so ranks whose rows differ time out (a transport error) rather than move one
  /// another's bytes as their own, unless the two keys share a tag window (1 in the number of
  /// windows, docs/api.md).
  void dispatch(std::span<const std::byte> user, std::span<std::byte> local, int64_t rowBytes,
                int64_t userStride = 0, int64_t localStride = 0, int64_t rowKind = 0);
  void undispatch(std::span<const std::byte> local, std::span<std::byte> user, int64_t rowBytes,
                  int64_t localStride = 0, int64_t userStride = 0, int64_t rowKind = 0);
  /// The same for a tensor: shapes [numUserTokens | numLocalTokens, heads, dim], same dtype.
  void dispatch(ConstTensorRef user, TensorRef local);
  void undispatch(ConstTensorRef local, TensorRef user);

  /// The last forward's and backward's costs on this rank (any layer).
  const PassStats& forwardStats() const { return executor_.forwardStats(); }
  const PassStats& backwardStats() const { return executor_.backwardStats(); }

  /// The executor (for callers that need more than the checked calls above).
  runtime::Executor& executor() { return executor_; }

  /// Empty while no call on this batch has thrown on this rank; else the first one's error.
  /// Dispatch, undispatch and the layers' forward and backward are collectives: one that throws
  /// on this rank only (a tensor of the wrong shape here) leaves the other ranks inside it,
  /// waiting for this rank's messages until their timeout. A later call's messages could be
  /// taken for the first call's where their tag windows meet (each call has its own, keyed by
  /// the batch, the call's kind and its place: Executor::setTagKey): so once a call has thrown,
  /// the batch refuses every call on this rank, naming that error. Messages the other ranks
  /// sent for the failed call may still arrive on this transport, where a new batch's could
  /// match them likewise: continue on a new transport (a new
  /// communicator or process group) and a new batch. Where every rank failed the same call in
  /// its checks, before any message (the same mistake on every rank), a new batch on the same
  /// transport is safe. The transport keeps count (runtime::CallLedger): the next batch's
  /// agreement makes every rank throw unless that is so, and until then this rank's other
  /// batches over the transport refuse their calls too. A rank whose call succeeded cannot
  /// know that the call threw elsewhere (MPI completes a small send before its receive is
  /// posted): the agreement tells it.
  const std::string& failure() const { return failure_; }
  /// Records `message` as the batch's failure (unless it has one) and throws it as
  /// Error(kInvalidArgument): for a binding's own checks of a call, made before the call
  /// reaches the batch.
  [[noreturn]] void fail(const std::string& message);

 private:
  friend class AttentionLayer;
  friend class UlyssesLayer;  // its calls are collectives of the batch too (api/ulysses.h)
  static plan::Plan takePlan(PendingBatch& pending);
  /// Runs `call`, a collective on this batch named `name`: refused once a call has thrown, and
  /// its own error recorded if it throws. `rowKey` (dispatch's rows; 0 otherwise) keys its tags
  /// with the call's.
  void collective(const char* name, int64_t rowKey, const std::function<void()>& call);
  /// Keeps `message` (or a placeholder for an empty one) as failure() unless there is one.
  void recordFailure(const std::string& message);
  /// The error a call `name` throws, refused after a failure (this batch's, or one that
  /// `earlier`, the transport's ledger, records).
  Error refusal(const char* name, const runtime::CallLedger::State& earlier) const;
  void dispatchTensor(ConstTensorRef user, TensorRef local);
  void undispatchTensor(ConstTensorRef local, TensorRef user);
  /// Numbers localSequence() as cu_seqlens does, given each planned sequence's index there
  /// (userSequenceIds; nothing to do when empty).
  void numberAsUser(const std::vector<int32_t>& ids);

  runtime::Executor executor_;
  runtime::Transport* transport_;
  int rank_;
  int64_t serial_;  ///< the batch's place among the transport's batches: keys its tags
  std::string failure_;
  int64_t failedCall_ = -1;  ///< the transport's index of this batch's call that threw, if any
  bool reached_ = false;  ///< the running call has reached the executor (messages may be out)
  /// localSequence() in cu_seqlens' numbering, where some sequence is empty (else empty).
  std::vector<int32_t> userSequence_;
};

/// One attention layer: what its backward needs from its forward. Reusable across batches.
class AttentionLayer {
 public:
  /// o (and lse, unless its data is null) = attention(q, k, v) over `batch`. Collective.
  void forward(AttentionBatch& batch, ConstTensorRef q, ConstTensorRef k, ConstTensorRef v,
               TensorRef o, TensorRef lse = {});
  /// dq, dk, dv of this layer's last forward, which must have run with `batch`. Collective.
  /// What it reads (Q, K, V in FCP's layout, O, LSE) stays until the next forward or release(),
  /// so backward may run again on it, with another dO, say. (fcp.torch frees it after one
  /// backward and refuses a second, as autograd does without retain_graph.)
  void backward(AttentionBatch& batch, ConstTensorRef dO, TensorRef dq, TensorRef dk, TensorRef dv);
  /// Frees what backward reads, this rank's Q, K, V, O and LSE of the last forward, as soon as
  /// no backward needs it (before the optimizer step, say); a backward then throws until the
  /// next forward. Local: not a collective.
  void release();

 private:
  friend class UlyssesLayer;  // runs the checked calls on a node's head share (api/ulysses.h)
  void forwardChecked(AttentionBatch& batch, ConstTensorRef q, ConstTensorRef k, ConstTensorRef v,
                      TensorRef o, TensorRef lse);
  void backwardChecked(AttentionBatch& batch, ConstTensorRef dO, TensorRef dq, TensorRef dk,
                       TensorRef dv);

  runtime::LayerState state_;
};

}  // namespace fcp
