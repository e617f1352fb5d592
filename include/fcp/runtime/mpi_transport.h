#pragma once
/// The MPI transport. Its implementation is the only code that includes <mpi.h> (pimpl).

#include <memory>

#include "fcp/runtime/transport.h"

namespace fcp::runtime {

/// Settings of the MPI transport.
struct MpiOptions {
  /// A wait that has not completed after this many seconds throws Error(kTransport): a peer
  /// that stopped answering ends the job with a message instead of a hang.
  double timeoutSeconds = 60;
  /// Drive MPI from a communication thread, so that messages progress while a kernel computes
  /// (OpenMPI moves large messages only inside MPI calls). Off: progress only in test/wait.
  bool progressThread = true;
  /// How long the communication thread sleeps between polls while requests are pending: at
  /// first pollMicroseconds, doubling up to maxPollMicroseconds while polls complete nothing,
  /// and back to the first after a completion or a new request. Polling every 50 us throughout
  /// took 30 % of the kernels' speed with every core busy (docs/runtime.md).
  double pollMicroseconds = 50;
  /// The longest sleep between polls (see pollMicroseconds).
  double maxPollMicroseconds = 1000;
};

/// Initialises MPI (MPI_Init_thread) and returns a transport over a duplicate of
/// MPI_COMM_WORLD with MPI_ERRORS_RETURN; destroying it finalises MPI. One per process.
/// Throws Error(kTransport) when MPI cannot be initialised.
std::unique_ptr<Transport> makeMpiTransport(const MpiOptions& options = {});

}  // namespace fcp::runtime
