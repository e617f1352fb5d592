// The MPI transport: the only file that includes <mpi.h>.
//
// Terms. A *slot* is the state of one posted request: its MPI_Request, whether it completed
// and, if MPI reported a failure, the message. The *communication thread* polls every pending
// slot with MPI_Test while the compute thread runs kernels, because OpenMPI advances a large
// (rendezvous) message only inside MPI calls: without it a send posted before a kernel would
// move only when the kernel ends. Every MPI call, from either thread, holds one mutex, so the
// transport needs MPI_THREAD_SERIALIZED at least.
#include "fcp/runtime/mpi_transport.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/core/lifetime.h"

namespace fcp::runtime {
namespace {

using Clock = std::chrono::steady_clock;
/// How long cancelPending waits for withdrawn messages to let go of their buffers.
constexpr double kWithdrawSeconds = 1.0;

std::string mpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

// Transports alive that FCP's own MPI_Init_thread is for: MPI is finalised when the last ends.
std::mutex initMutex;
int ownedTransports = 0;
bool fcpInitialisedMpi = false;

/// Why `options` are refused, or empty: checked before any collective (MPI_Comm_dup, like
/// MPI_Comm_split, has no timeout).
std::string optionsRefusal(const MpiOptions& options) {
  if (options.timeoutSeconds > 0 && options.timeoutSeconds <= 86400) return {};
  std::ostringstream text;
  text << "MPI transport timeout " << options.timeoutSeconds
       << " s: expected above 0 and at most 86400";
  return text.str();
}

class MpiTransport final : public Transport {
 public:
  /// Over a duplicate of `comm` (MPI_COMM_NULL: of MPI_COMM_WORLD, initialising MPI if no one
  /// has). The duplicate gives FCP a communication context of its own: no message of the
  /// caller's on `comm` can match one of FCP's, whatever its tag.
  MpiTransport(MPI_Comm comm, const MpiOptions& options) : options_(options) {
    if (const std::string refusal = optionsRefusal(options); !refusal.empty()) {
      throw Error(ErrorCode::kInvalidArgument, refusal);
    }
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (finalised)
      throw Error(ErrorCode::kTransport, "MPI was already finalised: expected it running");
    {
      std::lock_guard<std::mutex> lock(initMutex);
      if (!initialised) {
        if (comm != MPI_COMM_NULL) {
          throwInvalidArgument(
              "an MPI communicator was given but MPI is not initialised: expected the "
              "caller that made it to have initialised MPI");
        }
        int provided = 0;
        if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
          throw Error(ErrorCode::kTransport, "MPI_Init_thread failed");
        }
        fcpInitialisedMpi = true;
      }
      if (fcpInitialisedMpi) {
        ++ownedTransports;
        ownsInit_ = true;
      }
    }
    // The communication thread calls MPI while the caller's thread may call it too (inside
    // FCP, under one mutex, or outside FCP, unknown to it): that needs MPI_THREAD_MULTIPLE.
    // Below it, FCP calls MPI only from the thread that calls FCP.
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level < MPI_THREAD_MULTIPLE) options_.progressThread = false;
    const MPI_Comm base = comm == MPI_COMM_NULL ? MPI_COMM_WORLD : comm;
    // The caller's own communicator keeps its error handler; WORLD returns errors as before.
    if (comm == MPI_COMM_NULL) MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    check(MPI_Comm_dup(base, &comm_), "MPI_Comm_dup", -1);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    int* tagUb = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tagUb, &found);
    maxTag_ = found && tagUb ? *tagUb : 32767;
    if (options_.progressThread) progress_ = std::thread([this] { progressLoop(); });
  }

  /// FCP's duplicate of the caller's communicator (makeMpiSplitTransport splits it).
  MPI_Comm communicator() const { return comm_; }

  ~MpiTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (progress_.joinable()) progress_.join();
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised) MPI_Comm_free(&comm_);
    if (ownsInit_) {
      std::lock_guard<std::mutex> lock(initMutex);
      if (--ownedTransports == 0 && !finalised) MPI_Finalize();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int maxTag() const override { return maxTag_; }
  double timeoutSeconds() const noexcept override { return options_.timeoutSeconds; }

  RequestId isend(int peer, int tag, std::span<const std::byte> data) override {
    return post(true, peer, tag, const_cast<std::byte*>(data.data()), data.size());
  }
  RequestId irecv(int peer, int tag, std::span<std::byte> data) override {
    return post(false, peer, tag, data.data(), data.size());
  }

  bool test(RequestId request) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(request);
    if (it == slots_.end()) {
      throw Error(ErrorCode::kInternal, "test of unknown request " + std::to_string(request));
    }
    Slot& slot = it->second;
    if (!slot.done) pollSlot(slot);
    if (!slot.error.empty()) {
      const std::string message = slot.error;
      slots_.erase(it);
      throw Error(ErrorCode::kTransport, message);
    }
    if (!slot.done) return false;
    slots_.erase(it);
    return true;
  }

  void wait(RequestId request) override {
    const auto deadline = Clock::now() + std::chrono::duration<double>(options_.timeoutSeconds);
    // Sleep between tests while a kernel thread may want the core; spin briefly first.
    for (int spins = 0;; ++spins) {
      if (test(request)) return;
      if (Clock::now() > deadline) {
        std::string what;
        {
          std::lock_guard<std::mutex> lock(mu_);
          what = describe(slots_.at(request));
        }
        throw Error(ErrorCode::kTransport,
                    "rank " + std::to_string(rank_) + ": timed out after " +
                        std::to_string(static_cast<int>(options_.timeoutSeconds)) +
                        " s waiting for " + what +
                        " (did that rank die, stop, run slower than the timeout, make its "
                        "FCP calls in another order, or dispatch rows of another shape or dtype?)");
      }
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Receives are cancelled reliably unless already matched; a matched one, or a send, is
  // cancelled or completes as soon as its peer moves the data. A peer that stopped midway
  // leaves it pending: after a short grace (kWithdrawSeconds, or the timeout if shorter) the
  // buffers are declared unsafe (false) and kept. Waiting a whole timeout more would double
  // the time a rank takes to report a peer that failed (a user's timeout_seconds of 4 took 8).
  bool cancelPending() noexcept override {
    std::unique_lock<std::mutex> lock(mu_);
    bool any = false;
    for (auto& [id, slot] : slots_) {
      if (slot.done) continue;
      MPI_Cancel(&slot.request);
      any = true;
    }
    if (any) withdrew_ = true;
    const auto deadline = Clock::now() + std::chrono::duration<double>(
                                             std::min(kWithdrawSeconds, options_.timeoutSeconds));
    for (;;) {
      bool all = true;
      for (auto& [id, slot] : slots_) {
        if (slot.done) continue;
        int flag = 0;
        if (MPI_Test(&slot.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
          slot.done = true;
        } else {
          all = false;
        }
      }
      if (all || Clock::now() > deadline) {
        slots_.clear();
        return all;
      }
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
    }
  }

  // Non-blocking, tested under the same deadline as wait: a rank that stops answering makes
  // the others fail with a message instead of blocking inside a collective forever.
  using Transport::allreduce;
  void allreduce(std::span<int64_t> values, ReduceOp op, double timeoutSeconds) override {
    const double seconds = timeoutSeconds > 0 ? timeoutSeconds : options_.timeoutSeconds;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Withdrawn messages do not stop a collective (MPI never matches one with the other), so
      // the next batch's agreement can still tell every rank what happened.
      if (!abandonedCollective_.empty())
        throwAbandoned(rank_, abandonedCollective_, "a new communicator");
    }
    const MPI_Op mpiOp = op == ReduceOp::kSum ? MPI_SUM : op == ReduceOp::kMin ? MPI_MIN : MPI_MAX;
    MPI_Request request = MPI_REQUEST_NULL;
    // MPI reduces into a buffer of the transport's: if the wait times out, the collective
    // cannot be cancelled, and that buffer (not the caller's) is kept until the process ends.
    auto buffer = std::make_shared<std::vector<int64_t>>(values.begin(), values.end());
    {
      std::lock_guard<std::mutex> lock(mu_);
      check(MPI_Iallreduce(MPI_IN_PLACE, buffer->data(), static_cast<int>(buffer->size()),
                           MPI_INT64_T, mpiOp, comm_, &request),
            "MPI_Iallreduce", -1);
    }
    const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
    for (int spins = 0;; ++spins) {
      int flag = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        try {
          check(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), "MPI_Test of an allreduce", -1);
        } catch (const Error& e) {
          // Whether MPI let go of the request is not said: as after a timeout, below.
          abandonCollective(buffer, e.what());
          throw;
        }
      }
      if (flag) {
        std::copy(buffer->begin(), buffer->end(), values.begin());
        return;
      }
      if (Clock::now() > deadline) {
        const std::string message =
            "rank " + std::to_string(rank_) + ": timed out after " +
            std::to_string(static_cast<int>(seconds)) +
            " s waiting for an allreduce with every rank (did a rank die or stop?)";
        std::lock_guard<std::mutex> lock(mu_);
        abandonCollective(buffer, message);
        throw Error(ErrorCode::kTransport, message);
      }
      // Back off from 20 us to 1 ms: some ranks wait here long on purpose (rank 0's --check).
      if (spins > 64)
        std::this_thread::sleep_for(
            std::chrono::microseconds(std::min(20 << std::min((spins - 64) / 64, 6), 1000)));
    }
  }

  [[noreturn]] void abort(int exitCode) noexcept override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(comm_, exitCode);
    std::_Exit(exitCode);
  }

 private:
  struct Slot {
    MPI_Request request = MPI_REQUEST_NULL;
    bool isSend = false;
    bool done = false;
    int peer = 0;
    int tag = 0;
    size_t bytes = 0;
    std::string error;
  };

  void check(int code, const char* call, int peer) const {
    if (code == MPI_SUCCESS) return;
    std::ostringstream os;
    os << "rank " << rank_ << ": " << call;
    if (peer >= 0) os << " with rank " << peer;
    os << " failed: " << mpiErrorText(code);
    throw Error(ErrorCode::kTransport, os.str());
  }

  std::string describe(const Slot& slot) const {
    std::ostringstream os;
    os << (slot.isSend ? "a send of " : "a receive of ") << slot.bytes << " bytes "
       << (slot.isSend ? "to" : "from") << " rank " << slot.peer << " (tag " << slot.tag << ")";
    return os.str();
  }

  /// An allreduce left posted (it cannot be cancelled): a late rank would meet it and go on
  /// as if agreed, and every later collective would be out of step, so nothing more goes out.
  /// Its buffer is kept. The caller holds mu_.
  void abandonCollective(const std::shared_ptr<std::vector<int64_t>>& buffer,
                         const std::string& cause) noexcept {
    keepUntilExit(buffer);
    try {
      abandonedCollective_ = cause;
    } catch (...) {
      abandonedCollective_ = "no memory";  // short: no allocation
    }
  }

  RequestId post(bool isSend, int peer, int tag, std::byte* data, size_t bytes) {
    if (peer < 0 || peer >= size_ || tag < 0 || tag > maxTag_) {
      throwInvalidArgument("rank ", rank_, ": message to rank ", peer, " with tag ", tag,
                           ": expected a rank in [0, ", size_, ") and a tag in [0, ", maxTag_, "]");
    }
    if (bytes > static_cast<size_t>(INT32_MAX)) {
      throwInvalidArgument("message of ", bytes, " bytes: at most 2^31 - 1 per message");
    }
    Slot slot;
    slot.isSend = isSend;
    slot.peer = peer;
    slot.tag = tag;
    slot.bytes = bytes;
    RequestId id = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (withdrew_ || !abandonedCollective_.empty())
        throwAbandoned(rank_, abandonedCollective_, "a new communicator");
      const int count = static_cast<int>(bytes);
      const int code = isSend ? MPI_Isend(data, count, MPI_BYTE, peer, tag, comm_, &slot.request)
                              : MPI_Irecv(data, count, MPI_BYTE, peer, tag, comm_, &slot.request);
      check(code, isSend ? "MPI_Isend" : "MPI_Irecv", peer);
      id = nextId_++;
      slots_.emplace(id, std::move(slot));
      posted_ = true;
    }
    cv_.notify_one();
    return id;
  }

  /// Tests one slot; the caller holds mu_.
  void pollSlot(Slot& slot) {
    int flag = 0;
    MPI_Status status;
    const int code = MPI_Test(&slot.request, &flag, &status);
    if (code != MPI_SUCCESS) {
      slot.error = "rank " + std::to_string(rank_) + ": " + describe(slot) +
                   " failed: " + mpiErrorText(code);
      slot.done = true;
      return;
    }
    if (!flag) return;
    slot.done = true;
    // A receive takes exactly the bytes it was posted for: a longer message fails above
    // (MPI_ERR_TRUNCATE), a shorter one is caught here rather than leaving stale bytes.
    int count = 0;
    if (!slot.isSend && MPI_Get_count(&status, MPI_BYTE, &count) == MPI_SUCCESS &&
        static_cast<size_t>(count) != slot.bytes) {
      slot.error = "rank " + std::to_string(rank_) + ": " + describe(slot) + " got " +
                   std::to_string(count) + " bytes: expected " + std::to_string(slot.bytes) +
                   " (do the ranks run the same plan and tensor shapes?)";
    }
  }

  bool anyPending() const {
    for (const auto& [id, slot] : slots_) {
      if (!slot.done) return true;
    }
    return false;
  }

  /// Polls pending requests, sleeping between polls. The sleep starts at pollMicroseconds
  /// and doubles, up to maxPollMicroseconds, while polls complete nothing; a completion or a
  /// newly posted request resets it. Each wake-up of this thread takes a core from a kernel
  /// thread (every core runs one), so a fixed short interval costs compute.
  void progressLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    const double shortest = options_.pollMicroseconds;
    const double longest = std::max(shortest, options_.maxPollMicroseconds);
    double pause = shortest;
    while (!stop_) {
      cv_.wait(lock, [this] { return stop_ || anyPending(); });
      if (stop_) break;
      bool completed = false;
      for (auto& [id, slot] : slots_) {
        if (slot.done) continue;
        pollSlot(slot);
        completed |= slot.done;
      }
      pause = completed || posted_ ? shortest : std::min(2 * pause, longest);
      posted_ = false;
      // A request posted meanwhile ends the pause at once (post() notifies).
      cv_.wait_for(lock, std::chrono::duration<double, std::micro>(pause),
                   [this] { return stop_ || posted_; });
    }
  }

  MpiOptions options_;
  bool ownsInit_ = false;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int maxTag_ = 32767;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool posted_ = false;  ///< a request was posted since the progress thread's last poll
  bool withdrew_ = false;            ///< cancelPending withdrew a request: no new messages
  std::string abandonedCollective_;  ///< why an allreduce was left posted: nothing new at all
  RequestId nextId_ = 1;
  std::unordered_map<RequestId, Slot> slots_;
  std::thread progress_;
};

}  // namespace

std::unique_ptr<Transport> makeMpiTransport(const MpiOptions& options) {
  return std::make_unique<MpiTransport>(MPI_COMM_NULL, options);
}

std::unique_ptr<Transport> makeMpiTransport(MpiCommHandle comm, const MpiOptions& options) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    throwInvalidArgument(
        "an MPI communicator was given but MPI is not initialised: expected the caller "
        "that made it to have initialised MPI");
  }
  const MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(comm.fortran));
  if (c == MPI_COMM_NULL)
    throwInvalidArgument("MPI communicator handle ", comm.fortran, " is MPI_COMM_NULL");
  return std::make_unique<MpiTransport>(c, options);
}

std::unique_ptr<Transport> makeMpiSplitTransport(Transport& parent, int color, int key,
                                                 const MpiOptions& options) {
  auto* mpi = dynamic_cast<MpiTransport*>(&parent);
  std::string refusal;
  if (mpi == nullptr) {
    refusal =
        "a split of a transport that is not an MPI transport: expected one makeMpiTransport "
        "made";
  } else if (color < 0) {
    refusal = "split colour " + std::to_string(color) + ": expected 0 or more";
  } else {
    refusal = optionsRefusal(options);
  }
  // MPI_Comm_split (and the new transport's MPI_Comm_dup) has no timeout: a rank that refused
  // here alone would leave the others waiting in it for ever. So the ranks first agree (the
  // lowest rank that refused, over the parent, bounded by its timeout), and every rank throws
  // or none does.
  std::vector<int64_t> lowest = {refusal.empty() ? parent.size() : parent.rank()};
  parent.allreduce(lowest, ReduceOp::kMin);
  if (!refusal.empty()) throw Error(ErrorCode::kInvalidArgument, refusal);
  if (lowest[0] < parent.size()) {
    throwInvalidArgument("rank ", parent.rank(), ": rank ", lowest[0],
                         "'s split arguments were refused there (its own error says why): "
                         "expected valid arguments on every rank");
  }
  MPI_Comm split = MPI_COMM_NULL;
  if (MPI_Comm_split(mpi->communicator(), color, key, &split) != MPI_SUCCESS ||
      split == MPI_COMM_NULL) {
    throw Error(ErrorCode::kTransport,
                "rank " + std::to_string(parent.rank()) + ": MPI_Comm_split failed");
  }
  std::unique_ptr<Transport> t;
  try {
    t = std::make_unique<MpiTransport>(split, options);  // over a duplicate of the split
  } catch (...) {
    MPI_Comm_free(&split);
    throw;
  }
  MPI_Comm_free(&split);
  return t;
}

}  // namespace fcp::runtime
