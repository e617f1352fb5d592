// PendingGuard: an error unwinding a pass withdraws its pending messages before their buffers
// go, and keeps the buffers when the transport cannot promise to leave them alone; a pass that
// ends normally touches nothing. (On real ranks: mpi.faults' one-byte-short message, whose
// survivor used to free buffers that MPI still wrote into.)
#include <gtest/gtest.h>

#include <stdexcept>

#include "fcp/runtime/transport.h"

namespace fcp::runtime {
namespace {

/// Counts cancelPending calls and answers them with `safe`; nothing else is called.
class CountingTransport final : public Transport {
 public:
  explicit CountingTransport(bool safe) : safe_(safe) {}
  int cancels = 0;
  int rank() const override { return 0; }
  int size() const override { return 1; }
  int maxTag() const override { return 1; }
  RequestId isend(int, int, std::span<const std::byte>) override { return 0; }
  RequestId irecv(int, int, std::span<std::byte>) override { return 0; }
  bool test(RequestId) override { return true; }
  void wait(RequestId) override {}
  bool cancelPending() noexcept override {
    ++cancels;
    return safe_;
  }
  using Transport::allreduce;
  void allreduce(std::span<int64_t>, ReduceOp, double) override {}
  [[noreturn]] void abort(int) noexcept override { std::abort(); }

 private:
  bool safe_;
};

TEST(PendingGuardTest, NormalEndWithdrawsNothing) {
  CountingTransport t(false);
  int kept = 0;
  { const PendingGuard guard(t, [&] { ++kept; }); }
  EXPECT_EQ(t.cancels, 0);
  EXPECT_EQ(kept, 0);
}

TEST(PendingGuardTest, ErrorWithdrawsAndKeepsBuffersOnlyWhenUnsafe) {
  for (const bool safe : {true, false}) {
    CountingTransport t(safe);
    int kept = 0;
    try {
      const PendingGuard guard(t, [&] { ++kept; });
      throw std::runtime_error("transport error");
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(t.cancels, 1) << "safe " << safe;
    EXPECT_EQ(kept, safe ? 0 : 1) << "safe " << safe;
  }
}

TEST(PendingGuardTest, GuardMadeDuringUnwindingOnlyReactsToItsOwnError) {
  // A pass run from a destructor while another error unwinds ends normally: nothing withdrawn.
  CountingTransport t(false);
  struct RunsAPass {
    CountingTransport& t;
    ~RunsAPass() { const PendingGuard guard(t, [] {}); }
  };
  try {
    RunsAPass pass{t};
    throw std::runtime_error("other error");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(t.cancels, 0);
}

TEST(PendingGuardTest, KeepForeverLeavesTheBufferWhereTheTransportWrites) {
  std::vector<std::byte> buffer(64);
  std::byte* const where = buffer.data();
  keepForever(buffer);
  EXPECT_TRUE(buffer.empty());  // moved out: destroying `buffer` frees nothing
  where[63] = std::byte{1};     // still allocated (ASan would see a use after free)
}

}  // namespace
}  // namespace fcp::runtime
