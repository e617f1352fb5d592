#pragma once
/// The MPI transport. Its implementation is the only code that includes <mpi.h> (pimpl).

#include <cstdint>
#include <memory>

#include "fcp/runtime/transport.h"

namespace fcp::runtime {

/// Settings of the MPI transport.
struct MpiOptions {
  /// A wait that has not completed after this many seconds throws Error(kTransport): a peer
  /// that stopped answering ends the job with a message instead of a hang. Withdrawing the
  /// call's other messages then takes at most 1 s more (Transport::cancelPending).
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

/// An MPI communicator named by its Fortran handle (an integer), so that this header needs no
/// <mpi.h>: from C or C++ pass MPI_Comm_c2f(comm), from mpi4py comm.py2f().
struct MpiCommHandle {
  int64_t fortran = 0;
};

/// A transport over a duplicate of MPI_COMM_WORLD with MPI_ERRORS_RETURN. Initialises MPI
/// (MPI_Init_thread, asking for MPI_THREAD_MULTIPLE) unless the caller has; MPI that FCP
/// initialised is finalised when the last transport FCP made ends (MPI cannot be initialised
/// twice in a process). Throws Error(kTransport) when MPI cannot be initialised.
std::unique_ptr<Transport> makeMpiTransport(const MpiOptions& options = {});

/// A transport over a duplicate of the caller's communicator `comm` (any: a split of WORLD, a
/// context-parallel group). MPI must have been initialised by the caller, who also finalises
/// it after destroying the transport. The duplicate keeps FCP's messages apart from the
/// caller's on `comm`, whatever their tags. The communication thread runs only if MPI provides
/// MPI_THREAD_MULTIPLE; below it FCP calls MPI only from the thread that calls FCP (enough for
/// MPI_THREAD_SERIALIZED, and for MPI_THREAD_FUNNELED when that is the main thread).
std::unique_ptr<Transport> makeMpiTransport(MpiCommHandle comm, const MpiOptions& options = {});

/// A transport over the ranks of `parent` (an MPI transport) that pass the same `color`,
/// ordered by `key` (MPI_Comm_split; collective over parent's ranks): a node's members, say, or
/// the members of one index across nodes (fcp::UlyssesGroup). Throws Error(kInvalidArgument)
/// when `parent` is not an MPI transport, `color` is negative or `options` are invalid, on
/// every rank: the ranks agree first (one allreduce over `parent`, within its timeout), since
/// MPI_Comm_split has no timeout; the rank that refused names its argument, the others name
/// that rank. (A rank that reaches the split after that allreduce timed out on the others is
/// not covered: it may still enter MPI_Comm_split alone.)
std::unique_ptr<Transport> makeMpiSplitTransport(Transport& parent, int color, int key,
                                                 const MpiOptions& options = {});

}  // namespace fcp::runtime
