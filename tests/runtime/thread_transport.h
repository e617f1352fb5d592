#pragma once
// An in-process transport: N ranks as threads of one test, messages through shared mailboxes
// (gloo's habit: many ranks as threads, so executor tests need no mpirun). Sends are buffered
// (complete at once); a receive completes when a message from its peer with its tag is there,
// in posting order.
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/runtime/transport.h"

namespace fcp::runtime::testing {

class ThreadWorld {
 public:
  explicit ThreadWorld(int size,
                       std::chrono::milliseconds receiveTimeout = std::chrono::seconds(30))
      : timeout(receiveTimeout), size_(size) {}
  int size() const { return size_; }

  const std::chrono::milliseconds timeout;  ///< how long a wait for a receive lasts

  std::mutex mu;
  std::condition_variable cv;
  std::map<std::tuple<int, int, int>, std::deque<std::vector<std::byte>>>
      mailboxes;  // (src, dst, tag)
  // allreduce: generation counter, the accumulation of the current generation, and the results
  // of the last two by parity. A rank that finishes generation g may start g + 1 (and reset
  // `acc`) before the others have copied g's result; g + 2 cannot complete before every rank
  // has returned from g, so two result slots suffice.
  int64_t generation = 0;
  int arrived = 0;
  std::vector<int64_t> acc;
  std::array<std::vector<int64_t>, 2> results;

 private:
  int size_;
};

class ThreadTransport final : public Transport {
 public:
  ThreadTransport(ThreadWorld& world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }
  int maxTag() const override { return 1 << 30; }

  RequestId isend(int peer, int tag, std::span<const std::byte> data) override {
    std::lock_guard<std::mutex> lock(world_.mu);
    world_.mailboxes[{rank_, peer, tag}].emplace_back(data.begin(), data.end());
    world_.cv.notify_all();
    return 0;  // complete
  }
  RequestId irecv(int peer, int tag, std::span<std::byte> data) override {
    std::lock_guard<std::mutex> lock(world_.mu);
    const RequestId id = next_++;
    pending_[id] = {peer, tag, data};
    order_[{peer, tag}].push_back(id);
    return id;
  }
  bool test(RequestId request) override {
    if (request == 0) return true;
    std::lock_guard<std::mutex> lock(world_.mu);
    return tryComplete(request);
  }
  void wait(RequestId request) override {
    if (request == 0) return;
    std::unique_lock<std::mutex> lock(world_.mu);
    if (!world_.cv.wait_for(lock, world_.timeout, [&] { return tryComplete(request); })) {
      throw Error(ErrorCode::kTransport, "thread transport: receive timed out");
    }
  }
  using Transport::allreduce;
  void allreduce(std::span<int64_t> values, ReduceOp op, double /*timeoutSeconds*/) override {
    std::unique_lock<std::mutex> lock(world_.mu);
    const int64_t gen = world_.generation;
    if (world_.arrived > 0) FCP_CHECK_EQ(values.size(), world_.acc.size());
    if (world_.arrived == 0) {
      world_.acc.assign(values.begin(), values.end());
    } else {
      for (size_t i = 0; i < values.size(); ++i) {
        int64_t& a = world_.acc[i];
        a = op == ReduceOp::kSum   ? a + values[i]
            : op == ReduceOp::kMin ? std::min(a, values[i])
                                   : std::max(a, values[i]);
      }
    }
    std::vector<int64_t>& result = world_.results[static_cast<size_t>(gen & 1)];
    if (++world_.arrived == world_.size()) {
      world_.arrived = 0;
      result = world_.acc;
      ++world_.generation;
      world_.cv.notify_all();
    } else {
      world_.cv.wait(lock, [&] { return world_.generation != gen; });
    }
    std::copy(result.begin(), result.begin() + static_cast<std::ptrdiff_t>(values.size()),
              values.begin());
  }
  /// Sends complete at once; a pending receive is simply forgotten (nothing writes into it).
  bool cancelPending() noexcept override {
    std::lock_guard<std::mutex> lock(world_.mu);
    pending_.clear();
    order_.clear();
    return true;
  }
  [[noreturn]] void abort(int) noexcept override { std::abort(); }

 private:
  struct Pending {
    int peer;
    int tag;
    std::span<std::byte> data;
  };
  // Completes `request` if it is the oldest receive for its (peer, tag) and a message waits.
  bool tryComplete(RequestId request) {
    auto it = pending_.find(request);
    if (it == pending_.end()) return true;
    auto& queue = order_[{it->second.peer, it->second.tag}];
    auto& box = world_.mailboxes[{it->second.peer, rank_, it->second.tag}];
    const std::tuple<int, int, int> boxKey{it->second.peer, rank_, it->second.tag};
    const std::pair<int, int> queueKey{it->second.peer, it->second.tag};
    while (!queue.empty() && !box.empty()) {
      Pending& head = pending_.at(queue.front());
      FCP_CHECK(box.front().size() == head.data.size(), "rank ", rank_, " receives ",
                head.data.size(), " bytes from rank ", head.peer, " with tag ", head.tag, " but ",
                box.front().size(), " were sent");
      if (!head.data.empty()) std::memcpy(head.data.data(), box.front().data(), head.data.size());
      box.pop_front();
      pending_.erase(queue.front());
      queue.pop_front();
    }
    // Each call has tags of its own (Executor::setTagKey): forget the empty ones.
    if (box.empty()) world_.mailboxes.erase(boxKey);
    if (queue.empty()) order_.erase(queueKey);
    return pending_.find(request) == pending_.end();
  }

  ThreadWorld& world_;
  int rank_;
  RequestId next_ = 1;
  std::map<RequestId, Pending> pending_;
  std::map<std::pair<int, int>, std::deque<RequestId>> order_;
};

/// Runs `body(transport)` on `size` thread ranks; rethrows the first exception of any rank. A
/// receive waits at most `timeout`, then throws Error(kTransport).
template <typename Body>
void runRanks(int size, Body body, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  ThreadWorld world(size, timeout);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      ThreadTransport t(world, r);
      try {
        body(t);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace fcp::runtime::testing
