#pragma once
/// Ulysses inside a node, FCP across nodes: the FCP paper's deployment on rail-optimised
/// clusters ("we enable Ulysess with FCP to avoid two-hop communication"; `fcp simulate
/// --strategy fcp+ulysses`, fcp.torch's Batch(..., ulysses_group=)). The members of a node (a
/// group of ranks, in member order) hold consecutive token ranges of the caller's layout; each
/// attention call exchanges a member's rows with every head for the node's rows of one member's
/// share of the heads (one all-to-all over the node's transport), runs FCP across the nodes on
/// that share, and exchanges back.
///
///   once per batch:  UlyssesGroup node(nodeTransport, options);        // collective, the node
///                    AttentionBatch batch = node.batch(acrossTransport);  // across the nodes
///   per layer:       layer[i].forward(node, batch, q, k, v, o, lse);    // q, k, v, o: this
///                    layer[i].backward(node, batch, dO, dq, dk, dv);    // rank's rows, all heads
///
/// `options` is what an AttentionBatch over all ranks would take: this rank's own range
/// [localBegin, localEnd) and the model's heads. `acrossTransport` joins the members of one
/// index on every node (member j of every node, in node order). Member j computes query heads
/// [j·h, (j+1)·h), h = numHeadsQ / degree, and the key/value heads those read (GQA), replicated
/// on degree / numHeadsKv members where the members outnumber them (fcp::headShare); their
/// gradients are summed. The transparent layout only. Errors: the group's checks (ranges that do
/// not tile one run, heads the node cannot split, a dispatched layout) go into across()'s
/// localError, so the batch's agreement fails on every rank of every node (batch()); a layer call
/// that fails its checks on one rank leaves that node's members waiting in the exchange until the
/// node transport's timeout, as AttentionLayer's calls leave the other ranks (attention.h).

#include <cstdint>
#include <string>
#include <vector>

#include "fcp/api/attention.h"
#include "fcp/runtime/transport.h"

namespace fcp {

/// One node's members and the layout they share. Keep it (and its transport) alive while its
/// layers run.
class UlyssesGroup {
 public:
  /// Gathers the members' ranges and settings over `node` (collective over the node; one
  /// allreduce) and checks them: ranges that tile one run, the same settings on every member
  /// (what a batch's agreement compares: it runs over each index's ranks only), heads the node
  /// can split, the transparent layout.
  UlyssesGroup(runtime::Transport& node, const BatchOptions& options);

  /// The batch across nodes over `across` (the ranks with this member's index on every node),
  /// planned from across(): collective over `across`, then over the node. It checks that
  /// `across` pairs with the nodes (every rank of it the same member index of a node of this
  /// degree; else each node would read another's heads), and a batch that any member of the
  /// node could not make (its index's agreement refused it) fails on every member, naming it,
  /// rather than leave the others to time out in the first exchange.
  AttentionBatch batch(runtime::Transport& across) const;
  /// Planning ahead (PendingBatch): batch()'s pairing check and the batch's agreement over
  /// `across`, then the plan on a thread of its own; the node confirms that every member's
  /// began. Collective over `across`, then over the node. The batch is then
  /// batch(std::move(pending)), on this group, between or after this step's layer calls (each
  /// of these is a collective on the same transports):
  ///
  ///   UlyssesGroup nextNode(nodeTransport, nextOptions);
  ///   PendingBatch next = nextNode.pending(acrossTransport);
  ///   ... this step's layers ...
  ///   AttentionBatch batch = nextNode.batch(std::move(next));
  PendingBatch pending(runtime::Transport& across) const;
  /// The batch this group's pending() planned: waits for its plan, checks that the ranks of
  /// `across` reached the same one, then confirms over the node as batch() does. Collective.
  AttentionBatch batch(PendingBatch&& pending) const;
  /// The options of the batch across nodes: the node's range, one member's share of the heads,
  /// the node's budget (memoryLimitTokens × degree), and the group's error, if any, as
  /// localError (the batch then fails on every rank of its index). batch() and pending() plan
  /// with them; a PendingBatch or AttentionBatch made from them directly skips the pairing check
  /// and the node's confirmation.
  BatchOptions across() const;

  int64_t degree() const { return static_cast<int64_t>(rows_.size()); }
  int64_t member() const { return member_; }
  /// This rank's rows (localEnd − localBegin) and the node's.
  int64_t numUserTokens() const { return rows_.empty() ? 0 : rows_[static_cast<size_t>(member_)]; }
  int64_t numNodeTokens() const { return offsets_.empty() ? 0 : offsets_.back(); }
  /// Empty unless the group's checks failed; then their one-line message.
  const std::string& error() const { return error_; }

 private:
  friend class UlyssesLayer;
  /// Throws unless `batch` is this group's batch across the nodes (its rows and head share).
  void checkBatch(const AttentionBatch& batch) const;
  /// across(), with an error unless `across` pairs with the nodes (collective over it).
  BatchOptions paired(runtime::Transport& across) const;
  /// make() (collective across the nodes), then whether every member made it (over the node):
  /// a member's failure fails every member, naming it.
  template <typename Made, typename Make>
  Made confirmed(Make&& make) const;

  runtime::Transport* node_;
  BatchOptions options_;  ///< the caller's, with the node's range and the share's heads
  int64_t member_ = 0;
  int64_t heads_ = 0, kvHeads_ = 0;  ///< the model's
  std::vector<int64_t> rows_;        ///< per member
  std::vector<int64_t> offsets_;     ///< prefix sums of rows_
  std::string error_;
  int64_t calls_ = 0;  ///< exchanges made: each takes its own tag (TagWindow)
};

/// One attention layer run with Ulysses inside a node and FCP across nodes.
class UlyssesLayer {
 public:
  /// o (and lse, unless its data is null) = attention(q, k, v) of this rank's rows, every head.
  /// Collective over the node and across the nodes.
  void forward(UlyssesGroup& node, AttentionBatch& batch, ConstTensorRef q, ConstTensorRef k,
               ConstTensorRef v, TensorRef o, TensorRef lse = {});
  /// dq, dk, dv of this layer's last forward, which ran with `node` and `batch`. Collective.
  void backward(UlyssesGroup& node, AttentionBatch& batch, ConstTensorRef dO, TensorRef dq,
                TensorRef dk, TensorRef dv);
  /// Frees what backward reads (AttentionLayer::release). Local.
  void release() { layer_.release(); }
  /// The last forward's and backward's costs on this rank: the whole call's wall time, the
  /// batch's kernels and FLOPs, and its bytes with the node's exchanges added.
  const PassStats& forwardStats() const { return stats_[0]; }
  const PassStats& backwardStats() const { return stats_[1]; }

 private:
  AttentionLayer layer_;
  PassStats stats_[2];
};

}  // namespace fcp
