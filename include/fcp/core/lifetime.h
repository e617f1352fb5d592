#pragma once
/// Objects that must outlive every owner: buffers a network may still write into after an
/// error (the runtime's PendingGuard, an allreduce that timed out).

#include <memory>

namespace fcp {

/// Keeps `value` alive until the process ends (reachable, so leak checkers stay quiet).
void keepUntilExit(std::shared_ptr<void> value);

}  // namespace fcp
