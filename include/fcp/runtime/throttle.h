#pragma once
/// A transport wrapper that caps each rank's send and receive bandwidth, so that a run on one
/// machine (where ranks exchange data through shared memory at tens of GB/s) reproduces a
/// cluster's compute-to-communication ratio.

#include <memory>

#include "fcp/runtime/transport.h"

namespace fcp::runtime {

/// Wraps `inner` (which must outlive the wrapper). Sends leave this rank one after another at
/// `bytesPerSecond`: a send of n bytes is handed to `inner` when it would have finished on a
/// link of that rate, n / rate after the link became free. Receives complete no earlier than
/// the data arrives and no sooner than n / rate after the previous receive completed, so a
/// rank receiving from several peers at once is capped too. Collectives pass through
/// unthrottled. Throws Error(kInvalidArgument) for a rate that is not positive.
std::unique_ptr<Transport> makeThrottledTransport(Transport& inner, double bytesPerSecond,
                                                  double timeoutSeconds = 60);

}  // namespace fcp::runtime
