#pragma once
// Hardware profiles simple enough to time simulations by hand, for the simulator's tests.
#include <cstdint>

#include "fcp/sim/hardware.h"

namespace fcp::testing {

/// 1 TFLOP/s at every block size, NVLink 4 GB/s and NICs 1 GB/s, no latency, every worker its
/// own node unless told.
inline sim::HardwareProfile unitHardware(int64_t perNode = 1) {
  sim::HardwareProfile h;
  h.name = "unit";
  h.peakFlops = 1e12;
  h.forward = h.backward = EfficiencyCurve({{1, 1.0}});
  h.workersPerNode = perNode;
  h.intraNodeBytesPerSecond = 4e9;
  h.interNodeBytesPerSecond = 1e9;
  h.intraNodeLatencySeconds = 0;
  h.interNodeLatencySeconds = 0;
  return h;
}

/// unitHardware on curves rising over the whole range (forward 0.05 at 64 tokens to 1.0 at
/// 64K, backward 0.04 to 0.8), so that which tokens a kernel loops over shows in its time.
inline sim::HardwareProfile risingCurveHardware(int64_t perNode = 1) {
  sim::HardwareProfile h = unitHardware(perNode);
  h.forward = EfficiencyCurve({{64, 0.05}, {65536, 1.0}});
  h.backward = EfficiencyCurve({{64, 0.04}, {65536, 0.8}});
  return h;
}

}  // namespace fcp::testing
