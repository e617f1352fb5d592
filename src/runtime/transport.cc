// Helpers shared by every transport.
#include "fcp/runtime/transport.h"

#include <exception>

namespace fcp::runtime {

int64_t CallLedger::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_++;
}

int64_t CallLedger::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_;
}

int64_t CallLedger::newBatch() {
  std::lock_guard<std::mutex> lock(mu_);
  return batches_++;
}

void CallLedger::failed(int64_t index, bool reachedTransport) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.kind = state_.kind == 0 && !reachedTransport ? 1 : 2;
  state_.call = index;
}

CallLedger::State CallLedger::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

void CallLedger::clearIf(const State& seen) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == seen) state_ = {};
}

void waitAll(Transport& transport, std::span<const RequestId> requests) {
  for (const RequestId id : requests) transport.wait(id);
}

PendingGuard::PendingGuard(Transport& transport, std::function<void()> keepBuffers)
    : transport_(transport),
      keepBuffers_(std::move(keepBuffers)),
      exceptions_(std::uncaught_exceptions()) {}

PendingGuard::~PendingGuard() {
  if (std::uncaught_exceptions() <= exceptions_ || transport_.cancelPending()) return;
  try {
    keepBuffers_();
  } catch (...) {
    // No memory to keep them in: freeing them could corrupt the heap, so the job ends here.
    transport_.abort(70);
  }
}

}  // namespace fcp::runtime
