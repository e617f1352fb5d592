// Bandwidth cap over any transport.
//
// Terms. The *send link* and the *receive link* of this rank are each busy until a time
// (sendFree_, recvFree_). A send of n bytes occupies the send link for n / rate from
// max(now, sendFree_); its *release time* is when that ends, and only then does the
// *pacer thread* post it on the inner transport, so the peer sees the data when a real link
// would have delivered it. A receive completes at max(arrival, recvFree_ + n / rate), its
// arrival noted by the pacer thread's polling (never by the caller's, which may come late).
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <map>
#include <optional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/runtime/throttle.h"

namespace fcp::runtime {
namespace {

using Clock = std::chrono::steady_clock;

class ThrottledTransport final : public Transport {
 public:
  ThrottledTransport(Transport& inner, double bytesPerSecond, double timeoutSeconds)
      : inner_(inner), rate_(bytesPerSecond), timeoutSeconds_(timeoutSeconds) {
    if (!(bytesPerSecond > 0)) {
      throwInvalidArgument("bandwidth cap ", bytesPerSecond, " bytes/s: expected a positive rate");
    }
    sendFree_ = recvFree_ = Clock::now();
    pacer_ = std::thread([this] { paceLoop(); });
  }

  ~ThrottledTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    pacer_.join();
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  int maxTag() const override { return inner_.maxTag(); }
  double timeoutSeconds() const noexcept override { return timeoutSeconds_; }  // its own waits

  RequestId isend(int peer, int tag, std::span<const std::byte> data) override {
    std::lock_guard<std::mutex> lock(mu_);
    const auto start = std::max(Clock::now(), sendFree_);
    sendFree_ = start + linkTime(data.size());
    const RequestId id = nextId_++;
    Request& r = requests_[id];
    r.isSend = true;
    r.peer = peer;
    r.tag = tag;
    r.send = data;
    queue_.emplace(sendFree_, id);
    cv_.notify_all();
    return id;
  }

  RequestId irecv(int peer, int tag, std::span<std::byte> data) override {
    const RequestId innerId = inner_.irecv(peer, tag, data);
    std::lock_guard<std::mutex> lock(mu_);
    const RequestId id = nextId_++;
    Request& r = requests_[id];
    r.inner = innerId;
    r.bytes = data.size();
    pendingRecvs_.push_back(id);
    freshRecv_ = true;
    cv_.notify_all();
    return id;
  }

  bool test(RequestId request) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = requests_.find(request);
    FCP_CHECK(it != requests_.end(), "test of unknown request ", request);
    Request& r = it->second;
    if (r.isSend) {
      if (!r.posted) return false;
      if (r.failed) {
        const Error error = *r.failed;
        requests_.erase(it);
        throw error;
      }
      const RequestId innerId = r.inner;
      lock.unlock();
      const bool done = inner_.test(innerId);  // throws on failure
      lock.lock();
      if (done) requests_.erase(request);
      return done;
    }
    // Receives are polled by the pacer thread, which notes when their data arrived.
    if (r.failed) {
      const Error error = *r.failed;
      requests_.erase(it);
      throw error;
    }
    if (!r.arrived) return false;
    if (Clock::now() < r.completeAt) return false;
    requests_.erase(request);
    return true;
  }

  void wait(RequestId request) override {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeoutSeconds_);
    while (!test(request)) {
      if (Clock::now() > deadline) {
        throw Error(ErrorCode::kTransport, "rank " + std::to_string(rank()) +
                                               ": timed out waiting for a throttled message");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Sends still waiting for their release time are dropped; what reached the inner transport
  // is withdrawn there (a send the pacer is posting right now is in flight below or refused).
  bool cancelPending() noexcept override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // The pacer may be posting a send (or testing a receive) with the lock released: wait
      // for it, so that what it posts is pending below when the inner transport withdraws
      // (else the guard could free a buffer the pacer then posts).
      cv_.wait(lock, [this] { return !busy_; });
      queue_.clear();
      pendingRecvs_.clear();
      requests_.clear();
    }
    return inner_.cancelPending();
  }

  using Transport::allreduce;
  void allreduce(std::span<int64_t> values, ReduceOp op, double timeoutSeconds) override {
    inner_.allreduce(values, op, timeoutSeconds);
  }
  [[noreturn]] void abort(int exitCode) noexcept override {
    inner_.abort(exitCode);
    std::_Exit(exitCode);
  }

 private:
  struct Request {
    bool isSend = false;
    bool posted = false;
    bool arrived = false;
    int peer = 0;
    int tag = 0;
    size_t bytes = 0;
    std::span<const std::byte> send;
    RequestId inner = 0;
    Clock::time_point completeAt;
    std::optional<Error> failed;
  };

  Clock::duration linkTime(size_t bytes) const {
    return std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / rate_));
  }

  // Posts sends at their release times and polls pending receives, so that a receive's link
  // time counts from when its data arrived, not from when someone asked. The poll interval
  // starts at 50 us and doubles up to 1 ms while polls find nothing (an arrival or a new
  // receive resets it): every wake-up takes a core from a kernel thread, and polling every
  // 50 us throughout slowed the kernels by a third (docs/runtime.md). An arrival is noticed
  // at most 1 ms late, against link times of tens of ms per block at GPU-X's ratio.
  void paceLoop() {
    constexpr auto kShortest = std::chrono::microseconds(50), kLongest = std::chrono::microseconds(1000);
    auto poll = std::chrono::duration_cast<Clock::duration>(kShortest);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (queue_.empty() && pendingRecvs_.empty()) {
        cv_.wait(lock);
        continue;
      }
      if (freshRecv_) poll = kShortest;
      freshRecv_ = false;
      auto wake = Clock::now() + poll;
      if (!queue_.empty()) wake = pendingRecvs_.empty() ? queue_.begin()->first : std::min(wake, queue_.begin()->first);
      if (Clock::now() < wake) cv_.wait_until(lock, wake);
      if (stop_) break;
      const size_t pending = pendingRecvs_.size();
      pollReceives(lock);
      const bool arrived = pendingRecvs_.size() < pending;
      poll = arrived ? std::chrono::duration_cast<Clock::duration>(kShortest)
                     : std::min<Clock::duration>(2 * poll, kLongest);
      while (!queue_.empty() && queue_.begin()->first <= Clock::now()) postSend(lock);
    }
  }

  void pollReceives(std::unique_lock<std::mutex>& lock) {
    const std::vector<RequestId> ids = pendingRecvs_;
    for (const RequestId id : ids) {
      const auto found = requests_.find(id);
      if (found == requests_.end()) continue;  // withdrawn (cancelPending)
      const RequestId innerId = found->second.inner;
      busy_ = true;
      lock.unlock();
      bool arrived = false;
      std::optional<Error> failed;
      try {
        arrived = inner_.test(innerId);
      } catch (const Error& e) {
        failed = e;
      }
      lock.lock();
      busy_ = false;
      cv_.notify_all();
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;  // withdrawn meanwhile (cancelPending)
      Request& r = it->second;
      if (!arrived && !failed) continue;
      r.failed = failed;
      r.arrived = true;
      r.completeAt = std::max(Clock::now(), recvFree_ + linkTime(r.bytes));
      recvFree_ = r.completeAt;
      pendingRecvs_.erase(std::find(pendingRecvs_.begin(), pendingRecvs_.end(), id));
    }
  }

  void postSend(std::unique_lock<std::mutex>& lock) {
    const RequestId id = queue_.begin()->second;
    queue_.erase(queue_.begin());
    Request& r = requests_.at(id);
    const auto data = r.send;
    const int peer = r.peer, tag = r.tag;
    busy_ = true;
    lock.unlock();
    RequestId innerId = 0;
    std::optional<Error> failed;
    try {
      innerId = inner_.isend(peer, tag, data);
    } catch (const Error& e) {
      failed = e;
    }
    lock.lock();
    busy_ = false;
    cv_.notify_all();
    auto it = requests_.find(id);
    if (it == requests_.end()) return;  // not reached: cancelPending waits for busy_
    Request& again = it->second;
    again.inner = innerId;
    again.failed = failed;
    again.posted = true;
  }

  Transport& inner_;
  double rate_;
  double timeoutSeconds_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool freshRecv_ = false;  ///< a receive was posted since the pacer last looked
  bool busy_ = false;       ///< the pacer is in the inner transport with the lock released
  Clock::time_point sendFree_, recvFree_;
  RequestId nextId_ = 1;
  std::unordered_map<RequestId, Request> requests_;
  std::multimap<Clock::time_point, RequestId> queue_;
  std::vector<RequestId> pendingRecvs_;
  std::thread pacer_;
};

}  // namespace

std::unique_ptr<Transport> makeThrottledTransport(Transport& inner, double bytesPerSecond,
                                                  double timeoutSeconds) {
  return std::make_unique<ThrottledTransport>(inner, bytesPerSecond, timeoutSeconds);
}

}  // namespace fcp::runtime
