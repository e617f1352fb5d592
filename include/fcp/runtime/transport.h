#pragma once
/// The transport seam of the runtime (DESIGN.md): non-blocking point-to-point messages of byte
/// spans between ranks, plus the two collectives the runtime needs (an allreduce for plan
/// agreement and verdicts). No MPI type appears here; an NCCL or ibverbs transport would sit
/// behind the same interface.
///
/// Terms. A *request* is one posted send or receive, named by a RequestId until it completes.
/// A send's bytes must stay valid and unchanged, and a receive's buffer untouched, until the
/// request completes (test returned true or wait returned). Messages between one pair of ranks
/// with one tag arrive in the order they were posted. Every failure (a peer that died, an MPI
/// error, a wait past the timeout) throws Error(kTransport) naming the peer.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "fcp/core/error.h"
#include "fcp/core/lifetime.h"

namespace fcp::runtime {

/// Names one posted send or receive; 0 is never a valid id.
using RequestId = uint64_t;

/// FCP's reserved tag range: FCP's messages use tags from kFirstFcpTag up to the transport's
/// largest tag (each call a window of Executor::tagsNeeded tags, Executor::setTagKey), so a
/// caller sharing a communicator or process group with FCP keeps its own point-to-point tags
/// below kFirstFcpTag. (The MPI transport also works on a
/// duplicate of the caller's communicator, where no tag of the caller's can match FCP's.)
inline constexpr int kFirstFcpTag = 1 << 20;

/// Reduction of an allreduce.
enum class ReduceOp { kSum, kMin, kMax };

/// The collective calls of FCP's batches (fcp::AttentionBatch: dispatch, forward, ...) made
/// over one transport on this rank, and the one that threw, so that the next batch's agreement
/// can tell whether that call's messages may still arrive. A call that threw on one rank only
/// can leave the others' messages for it in flight, or already delivered where nothing will
/// receive them (MPI completes a small send before its receive is posted, so the sender may
/// never learn of the failure); a later call's receive could take them where its tag window
/// meets that call's (Executor::setTagKey: 1 in the number of windows). Safe only where every rank
/// threw in the same call before it reached the transport (the same mistake everywhere: nothing was
/// sent). The plan agreement of every batch (runtime::checkPlanAgreement) compares the ranks'
/// ledgers, their counts of calls included. Thread-safe. A ledger belongs to one Transport object:
/// batches made over a wrapper and over what it wraps keep separate ones.
class CallLedger {
 public:
  /// Counts a call; returns its index (0, 1, ... on this transport).
  int64_t begin();
  /// Calls counted so far (the plan agreement compares it between ranks).
  int64_t count() const;
  /// Counts a batch made over the transport (not a call); returns its index (0, 1, ...).
  int64_t newBatch();
  /// Call `index` threw on this rank; `reachedTransport`: after it may have posted messages.
  void failed(int64_t index, bool reachedTransport);
  /// 0: no call threw since the ledger was last cleared; 1: one did, before reaching the
  /// transport (`call` is its index); 2: one did after reaching it, or more than one did.
  struct State {
    int64_t kind = 0;
    int64_t call = -1;
    friend bool operator==(const State&, const State&) = default;
  };
  State state() const;
  /// Forgets the failure, if the state is still `seen` (every rank threw in the same call
  /// before reaching the transport, as the plan agreement found from `seen`).
  void clearIf(const State& seen);

 private:
  mutable std::mutex mu_;
  int64_t calls_ = 0;
  int64_t batches_ = 0;
  State state_;
};

/// Non-blocking messages between the ranks of one job. Implementations are thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;

  /// This process's rank in [0, size()).
  virtual int rank() const = 0;
  /// Number of ranks in the job.
  virtual int size() const = 0;
  /// Largest tag accepted by isend/irecv.
  virtual int maxTag() const = 0;
  /// How long a wait may last before it fails, in seconds; 0 when the transport sets no limit.
  /// After a call threw on this rank, the next batch's agreement waits about twice this for
  /// the ranks still inside that call (fcp::AttentionBatch).
  virtual double timeoutSeconds() const noexcept { return 0; }

  /// Posts a send of `data` to `peer` with `tag`; `data` must outlive the request.
  virtual RequestId isend(int peer, int tag, std::span<const std::byte> data) = 0;
  /// Posts a receive of exactly data.size() bytes from `peer` with `tag` into `data`.
  virtual RequestId irecv(int peer, int tag, std::span<std::byte> data) = 0;
  /// True once the request completed (the id is then retired); never blocks.
  virtual bool test(RequestId request) = 0;
  /// Blocks until the request completes (the id is then retired). Throws Error(kTransport)
  /// when the request fails or does not complete within the transport's timeout.
  virtual void wait(RequestId request) = 0;

  /// Withdraws every request still pending, after an error and before the buffers they name
  /// are freed: returns true when the transport will never touch those buffers again (every
  /// request cancelled or completed), false when it cannot promise that (then the caller must
  /// keep the buffers for the life of the process). Withdrawn ids are retired. A transport that
  /// withdrew a request refuses new ones: a withdrawn message may still arrive and would match
  /// the wrong receive. The default withdraws nothing and returns false.
  virtual bool cancelPending() noexcept { return false; }

  /// Element-wise reduction of `values` over every rank, result on every rank (blocking).
  /// `timeoutSeconds` > 0 replaces the transport's timeout for this call: for a collective
  /// that some ranks reach much later on purpose (after rank 0's reference check, say); 0
  /// keeps the transport's own.
  virtual void allreduce(std::span<int64_t> values, ReduceOp op, double timeoutSeconds) = 0;
  void allreduce(std::span<int64_t> values, ReduceOp op) { allreduce(values, op, 0); }
  /// Ends every process of the job with `exitCode` (used after an error that the other
  /// ranks cannot know about, so that none of them waits forever).
  [[noreturn]] virtual void abort(int exitCode) noexcept = 0;

  /// FCP's record of its batches' calls over this transport (fcp::AttentionBatch keeps it).
  CallLedger& calls() noexcept { return calls_; }

 private:
  CallLedger calls_;
};

/// Throws the one-line Error(kTransport) of a transport that refuses new work after an earlier
/// error, naming `cause` (when not empty) and what the caller must make instead (`remedy`).
/// Inline: the MPI transport's library does not link this module.
[[noreturn]] inline void throwAbandoned(int rank, const std::string& cause, const char* remedy) {
  throw Error(ErrorCode::kTransport,
              "rank " + std::to_string(rank) +
                  ": this transport abandoned messages after an earlier error" +
                  (cause.empty() ? std::string() : " (" + cause + ")") +
                  ", so its messages are out of step with its peers': expected " + remedy);
}

/// Waits for every request in `requests`, in order.
void waitAll(Transport& transport, std::span<const RequestId> requests);

/// Guards the buffers of one pass of messages. Declared after the objects owning the buffers
/// and before the first message is posted, it is destroyed first when an error unwinds the
/// pass: it then withdraws every pending request (Transport::cancelPending) and, if the
/// transport cannot promise to leave their buffers alone, runs `keepBuffers`, which must move
/// them somewhere never freed. Without an error it does nothing.
class PendingGuard {
 public:
  PendingGuard(Transport& transport, std::function<void()> keepBuffers);
  ~PendingGuard();
  PendingGuard(const PendingGuard&) = delete;
  PendingGuard& operator=(const PendingGuard&) = delete;

 private:
  Transport& transport_;
  std::function<void()> keepBuffers_;
  int exceptions_;
};

/// Moves `value` into storage that is never freed: for buffers a transport may still write
/// into after an error (PendingGuard). Never throws (keepUntilExit): a move that allocates
/// nothing, like a vector's, keeps the buffer itself.
template <typename T>
void keepForever(T& value) noexcept {
  std::shared_ptr<T> kept;
  try {
    kept = std::make_shared<T>(std::move(value));
  } catch (...) {
    abortKeeping();
  }
  keepUntilExit(std::move(kept));
}

/// Bytes of a float span, for isend/irecv.
inline std::span<const std::byte> asBytes(std::span<const float> values) {
  return std::as_bytes(values);
}
inline std::span<std::byte> asWritableBytes(std::span<float> values) {
  return std::as_writable_bytes(values);
}

}  // namespace fcp::runtime
