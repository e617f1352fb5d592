// Fault injection on real MPI ranks: a transport wrapper makes one rank crash or hang at its
// first send after the batch is planned, and the other ranks must end with
// fcp::Error(kTransport) within seconds instead of waiting forever. faults_test.sh launches this
// program under mpirun and checks the exit status, the time taken and stderr.
//
// Usage: faults_mpi_test {none|exit|stall|short|long|slow|late|pause} FAULT_RANK
//   none   no fault: forward and backward complete on every rank (exit 0); shows the wrapper
//          itself changes nothing. Rank 0 prints a checksum of the outputs and gradients.
//   exit   FAULT_RANK exits (code 3) as a crashed process would.
//   stall  FAULT_RANK stops answering (sleeps until killed) as a hung process would.
//   short  FAULT_RANK's first message is one byte short (a peer on another plan or shape).
//   long   FAULT_RANK's first message is one byte long.
//   slow   every message FAULT_RANK sends leaves 50 ms late (a slow link): the passes complete
//          (exit 0) with the same checksum as without the fault.
//   late   FAULT_RANK comes to its first allreduce (the plan agreement) 5 s late, after the
//          others' 2 s timeout; they then try the batch again on the same transport, which
//          must refuse it (their timed-out allreduce is still posted, and the late rank would
//          meet it as if agreed).
//   pause  FAULT_RANK's first send waits 3 s, past the others' 2 s timeout, then throws
//          instead: every rank's pass fails having posted messages, which their transports
//          withdraw. The ranks meet (on a communicator of their own) and try the batch again on
//          the same transport: every rank must hear the plan agreement's verdict on the failed
//          call (a withdrawn message does not stop an allreduce).
// A surviving rank that catches an fcp::Error prints one line with its code and message and
// ends the job (exit 2 for a transport error, 4 for any other code, which the script rejects).
// A surviving rank that the launcher ends first says so in one line.
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fcp/api/attention.h"
#include "fcp/core/error.h"
#include "fcp/runtime/mpi_transport.h"

namespace {

using namespace fcp;

enum class Fault { kNone, kExit, kStall, kShort, kLong, kSlow, kLate, kPause };

/// Passes everything through to `inner`, except that once armed, rank `faultRank`'s sends go
/// wrong: the next one never happens (the process exits or sleeps instead), is a byte short or
/// long, or every one is late, or the first one waits past the timeout and throws.
class FaultyTransport final : public runtime::Transport {
 public:
  FaultyTransport(runtime::Transport& inner, Fault fault, int faultRank)
      : inner_(inner), fault_(fault), faultRank_(faultRank) {}

  /// From now on the fault fires at this rank's first isend.
  void arm() { armed_ = true; }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int maxTag() const override { return inner_.maxTag(); }

  runtime::RequestId isend(int peer, int tag, std::span<const std::byte> data) override {
    if (armed_ && inner_.rank() == faultRank_) {
      switch (fault_) {
        case Fault::kNone: break;
        case Fault::kExit: std::_Exit(3);
        case Fault::kStall:
          for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // until the launcher kills it
        case Fault::kShort:
          if (!data.empty() && !fired_.exchange(true)) {
            return inner_.isend(peer, tag, data.first(data.size() - 1));
          }
          break;
        case Fault::kLong:
          if (!fired_.exchange(true)) {
            longMessage_.assign(data.begin(), data.end());
            longMessage_.push_back(std::byte{0});
            return inner_.isend(peer, tag, longMessage_);
          }
          break;
        case Fault::kSlow: std::this_thread::sleep_for(std::chrono::milliseconds(50)); break;
        case Fault::kLate:
          break;  // in allreduce
        case Fault::kPause:
          if (!fired_.exchange(true)) {
            std::this_thread::sleep_for(std::chrono::seconds(3));
            throw Error(ErrorCode::kTransport, "rank " + std::to_string(faultRank_) +
                                                   ": a send failed (injected by pause)");
          }
          break;
      }
    }
    return inner_.isend(peer, tag, data);
  }
  runtime::RequestId irecv(int peer, int tag, std::span<std::byte> data) override {
    return inner_.irecv(peer, tag, data);
  }
  bool test(runtime::RequestId request) override { return inner_.test(request); }
  bool cancelPending() noexcept override { return inner_.cancelPending(); }
  void wait(runtime::RequestId request) override { inner_.wait(request); }
  using Transport::allreduce;
  void allreduce(std::span<int64_t> values, runtime::ReduceOp op, double timeoutSeconds) override {
    if (fault_ == Fault::kLate && inner_.rank() == faultRank_ && !fired_.exchange(true)) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
    }
    inner_.allreduce(values, op, timeoutSeconds);
  }
  [[noreturn]] void abort(int exitCode) noexcept override {
    inner_.abort(exitCode);
    std::_Exit(exitCode);  // not reached: tells the compiler so
  }

 private:
  runtime::Transport& inner_;
  const Fault fault_;
  const int faultRank_;
  std::atomic<bool> armed_{false};
  std::atomic<bool> fired_{false};
  std::vector<std::byte> longMessage_;  // outlives its request: kept until the job ends
};

/// One small causal batch (three sequences split evenly over the ranks), planned, then one
/// forward and one backward pass; the fault is armed between the two.
/// Returns the sum of this rank's outputs and gradients.
double runBatch(FaultyTransport& t) {
  const int64_t hq = 2, hkv = 1, dim = 16, total = 2048;
  BatchOptions o;
  o.cuSeqlens = {0, 700, 1000, total};
  o.localBegin = total * t.rank() / t.size();
  o.localEnd = total * (t.rank() + 1) / t.size();
  o.numHeadsQ = hq;
  o.numHeadsKv = hkv;
  o.headDim = dim;
  o.planConfig.blockSize = 256;
  AttentionBatch batch(t, o);
  t.arm();
  const int64_t n = batch.numCallTokens();
  std::vector<float> q(static_cast<size_t>(n * hq * dim), 0.5f),
      kv(static_cast<size_t>(n * hkv * dim), 0.25f);
  std::vector<float> out(q.size()), dq(q.size()), dk(kv.size()), dv(kv.size());
  const DType f = DType::kFp32;
  AttentionLayer layer;
  layer.forward(batch, {q.data(), f, n, hq, dim}, {kv.data(), f, n, hkv, dim},
                {kv.data(), f, n, hkv, dim}, {out.data(), f, n, hq, dim});
  layer.backward(batch, {q.data(), f, n, hq, dim}, {dq.data(), f, n, hq, dim},
                 {dk.data(), f, n, hkv, dim}, {dv.data(), f, n, hkv, dim});
  int64_t done = 1;
  t.allreduce({&done, 1}, runtime::ReduceOp::kMin);
  double sum = 0;
  for (const auto* v : {&out, &dq, &dk, &dv}) {
    for (float x : *v) sum += x;
  }
  return sum;
}

/// The launcher ends the surviving ranks with SIGTERM when a peer exits; say so in one line
/// (only async-signal-safe calls here).
char terminatedMessage[96];
void onTerminate(int) {
  const ssize_t ignored = write(STDERR_FILENO, terminatedMessage, std::strlen(terminatedMessage));
  (void)ignored;
  _exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  const Fault fault = mode == "none"    ? Fault::kNone
                      : mode == "exit"  ? Fault::kExit
                      : mode == "stall" ? Fault::kStall
                      : mode == "short" ? Fault::kShort
                      : mode == "long"  ? Fault::kLong
                      : mode == "slow"  ? Fault::kSlow
                      : mode == "late"  ? Fault::kLate
                      : mode == "pause" ? Fault::kPause
                                        : static_cast<Fault>(-1);
  if (fault == static_cast<Fault>(-1)) {
    std::fprintf(
        stderr, "usage: faults_mpi_test {none|exit|stall|short|long|slow|late|pause} FAULT_RANK\n");
    return 64;
  }
  const int faultRank = std::atoi(argv[2]);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::snprintf(terminatedMessage, sizeof(terminatedMessage),
                "faults_mpi_test: rank %d: ended by the MPI launcher\n", rank);
  std::signal(SIGTERM, onTerminate);
  if (faultRank < 0 || faultRank >= size) {
    if (rank == 0)
      std::fprintf(stderr, "FAULT_RANK %d: expected a rank in [0, %d)\n", faultRank, size);
    MPI_Finalize();
    return 64;
  }
  // The pause case's meeting point, apart from the transport under test.
  MPI_Comm meet = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &meet);
  double checksum = 0;
  {
    // A short timeout, so that a survivor gives up within seconds (a slow link gets a longer
    // one: late is not dead).
    std::unique_ptr<runtime::Transport> mpi = runtime::makeMpiTransport(
        runtime::MpiCommHandle{MPI_Comm_c2f(MPI_COMM_WORLD)},
        {.timeoutSeconds = fault == Fault::kSlow ? 20.0 : 2.0});
    FaultyTransport t(*mpi, fault, faultRank);
    try {
      try {
        checksum = runBatch(t);
      } catch (const Error& e) {
        if (fault == Fault::kPause) {
          std::fprintf(stderr, "faults_mpi_test: rank %d: first attempt: %s\n", rank, e.what());
          MPI_Barrier(meet);
          try {
            checksum = runBatch(t);  // the same transport: its agreement must refuse it
          } catch (const Error& again) {
            // Every rank says what it heard before any of them ends the job.
            std::fprintf(stderr, "faults_mpi_test: rank %d: second attempt: %s error: %s\n", rank,
                         std::string(errorCodeName(again.code())).c_str(), again.what());
            std::fflush(stderr);
            MPI_Barrier(meet);
            t.abort(2);
          }
        }
        if (fault != Fault::kLate || rank == faultRank) throw;
        std::fprintf(stderr, "faults_mpi_test: rank %d: first attempt: %s\n", rank, e.what());
        checksum = runBatch(t);  // the same transport: must refuse
      }
    } catch (const Error& e) {
      std::fprintf(stderr, "faults_mpi_test: rank %d: %s error: %s\n", rank,
                   std::string(errorCodeName(e.code())).c_str(), e.what());
      std::fflush(stderr);
      t.abort(e.code() == ErrorCode::kTransport ? 2 : 4);
    }
  }
  // Only without a fault or with a slow link may a rank get here.
  const bool completes = fault == Fault::kNone || fault == Fault::kSlow;
  if (rank == 0) {
    std::printf("%s: forward and backward completed on %d ranks, checksum %.9e\n",
                completes ? mode.c_str() : "FAILED: the fault never fired", size, checksum);
  }
  MPI_Comm_free(&meet);
  MPI_Finalize();
  return completes ? 0 : 5;
}
