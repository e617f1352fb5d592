// The bandwidth cap (makeThrottledTransport): messages arrive intact and no sooner than their
// link time, a bad rate is named, and withdrawing messages waits for a send the pacer thread
// is handing to the inner transport, so the inner transport withdraws it too (else the caller
// could free a buffer that is posted a moment later).
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/runtime/throttle.h"
#include "thread_transport.h"

namespace fcp::runtime {
namespace {

using Clock = std::chrono::steady_clock;
using testing::runRanks;
using testing::ThreadTransport;

TEST(ThrottledTransportTest, MessagesArriveIntactAfterTheirLinkTime) {
  // Rank 0 sends three messages of 100,000 bytes at 10 MB/s. Rank 1's receive link is capped
  // too: each receive completes no sooner than 10 ms after the one before, the first 10 ms
  // after rank 1's transport was made. So the last cannot complete before 30 ms after rank 1
  // began: a lower bound, whatever the machine's speed.
  constexpr size_t kBytes = 100'000;
  constexpr double kRate = 10e6;
  double elapsedMs = 0;
  runRanks(2, [&](ThreadTransport& inner) {
    const auto start = Clock::now();
    const auto t = makeThrottledTransport(inner, kRate, 30);
    std::vector<std::vector<std::byte>> messages(3, std::vector<std::byte>(kBytes));
    std::vector<RequestId> requests;
    for (size_t m = 0; m < messages.size(); ++m) {
      if (inner.rank() == 0) {
        for (size_t i = 0; i < kBytes; ++i)
          messages[m][i] = static_cast<std::byte>((i * 7 + m) % 251);
        requests.push_back(t->isend(1, static_cast<int>(m), messages[m]));
      } else {
        requests.push_back(t->irecv(0, static_cast<int>(m), messages[m]));
      }
    }
    for (const RequestId r : requests) t->wait(r);
    if (inner.rank() == 1) {
      elapsedMs = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      for (size_t m = 0; m < messages.size(); ++m) {
        for (size_t i = 0; i < kBytes; ++i) {
          ASSERT_EQ(messages[m][i], static_cast<std::byte>((i * 7 + m) % 251)) << m << " " << i;
        }
      }
    }
  });
  EXPECT_GE(elapsedMs, 3 * kBytes / kRate * 1e3 * 0.99);
}

TEST(ThrottledTransportTest, ARateThatIsNotPositiveIsNamed) {
  runRanks(1, [&](ThreadTransport& inner) {
    for (const double rate : {0.0, -1.0}) {
      try {
        makeThrottledTransport(inner, rate);
        ADD_FAILURE() << "rate " << rate << " accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find("expected a positive rate"), std::string::npos)
            << e.what();
      }
    }
  });
}

/// An inner transport whose isend blocks until `release()`, and which records the order of
/// isend's return and cancelPending's call.
class BlockingSendTransport final : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  int maxTag() const override { return 1 << 20; }
  RequestId isend(int, int, std::span<const std::byte>) override {
    std::unique_lock<std::mutex> lock(mu_);
    inSend_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return released_; });
    events_.push_back("isend returned");
    return 7;
  }
  RequestId irecv(int, int, std::span<std::byte>) override { return 8; }
  bool test(RequestId) override { return false; }
  void wait(RequestId) override {}
  bool cancelPending() noexcept override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back("cancelPending");
    return true;
  }
  using Transport::allreduce;
  void allreduce(std::span<int64_t>, ReduceOp, double) override {}
  [[noreturn]] void abort(int) noexcept override { std::abort(); }

  void waitUntilInSend() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return inSend_; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  std::vector<std::string> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool inSend_ = false, released_ = false;
  std::vector<std::string> events_;
};

TEST(ThrottledTransportTest, WithdrawingWaitsForASendThePacerIsPosting) {
  BlockingSendTransport inner;
  const auto t = makeThrottledTransport(inner, 1e12);
  std::vector<std::byte> data(16);
  t->isend(1, 0, data);
  inner.waitUntilInSend();  // the pacer is inside the inner isend, its lock released
  bool safe = false;
  std::thread withdraw([&] { safe = t->cancelPending(); });
  // However long the pacer stays there, the inner transport is not asked to withdraw before
  // the send it is posting is pending there. The pause gives a withdrawal that does not wait
  // time to happen (it would, at once, on any machine not stalled for 50 ms); the test cannot
  // fail for a correct transport, however slow the machine.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(inner.events(), std::vector<std::string>{});
  inner.release();
  withdraw.join();
  EXPECT_TRUE(safe);
  EXPECT_EQ(inner.events(), (std::vector<std::string>{"isend returned", "cancelPending"}));
}

}  // namespace
}  // namespace fcp::runtime
