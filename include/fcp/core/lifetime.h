#pragma once
/// Objects that must outlive every owner: buffers a network may still write into after an
/// error (the runtime's PendingGuard, an allreduce that timed out).

#include <memory>

namespace fcp {

/// Keeps `value` alive until the process ends (reachable, so leak checkers stay quiet). Never
/// throws: where there is no memory left to keep it, freeing it could let a message write into
/// freed memory, so the process ends with one line on stderr instead (abort; the other ranks
/// then see a peer that died: MPI's launcher ends them, a process group times out).
void keepUntilExit(std::shared_ptr<void> value) noexcept;

/// What keepUntilExit does when it cannot keep a value: one line on stderr, then abort.
[[noreturn]] void abortKeeping() noexcept;

}  // namespace fcp
