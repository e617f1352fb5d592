#pragma once
/// Hardware profiles for the cluster simulator: peak compute, the kernel-efficiency curve, and
/// the links between workers (NVLink-class inside a node, one NIC per worker across nodes).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "fcp/core/config.h"
#include "fcp/core/cost_model.h"

namespace fcp::sim {

/// How a worker's kernels run the pairs of a stage.
enum class KernelLaunch {
  /// Each pair is its own kernel: each sequence's visible entries in it at f(that sequence's
  /// tokens in the Q block), and a merge of partials after every pair that reads remote KV (as
  /// FCP's CPU executor runs them; it merges after local pairs too, a cost the cpu profile's
  /// curve includes).
  kPair,
  /// One launch per worker and stage over all its pairs, as the paper's coalescer ("merged
  /// into a larger stage") and MagiAttention's FFA run them. The forward's work for a (Q
  /// block, sequence) loops over every key of that sequence that the stage's KV blocks hold
  /// for it, at f(those keys); the backward's for a (KV block, sequence) over every query of
  /// it that the stage's Q blocks hold, at f(those queries) (FlashAttention parallelises the
  /// forward over query tiles and the backward over key tiles). One merge per stage for each
  /// Q block that reads remote KV there. A stage of one square pair per Q block (a ring step
  /// with pieces of one length) times the same either way.
  kStage,
};

/// The launch named `name` ("pair" or "stage", as a profile's kernel_launch and fcp simulate's
/// --kernel-launch spell it), or nullopt for any other name.
std::optional<KernelLaunch> kernelLaunchNamed(std::string_view name);

/// How a worker's compute waits for its communication.
enum class Pipeline {
  /// Stage by stage: a stage's compute and its transfers start together once the stage before
  /// has done both (as FCP's CPU executor runs; the default).
  kLockstep,
  /// The FCP paper's multi-buffer pipeline ("launches several communication operation
  /// concurrently ... we use three buffers"): a stage's compute waits only for the stage whose
  /// transfers brought the KV it reads (FCP with D buffers computes D − 1 stages behind what it
  /// receives), while the transfers still go stage by stage, each after the compute that frees
  /// its buffers. A schedule that computes with the stage before's KV (ring attention's double
  /// buffering, FCP with two buffers) times the same either way.
  kMultiBuffer,
};

/// The pipeline named `name` ("lockstep" or "multibuffer", as a profile's pipeline and fcp
/// simulate's --pipeline spell it), or nullopt for any other name.
std::optional<Pipeline> pipelineNamed(std::string_view name);

/// One worker type and its network. Bandwidths are bytes per second each way per worker.
struct HardwareProfile {
  std::string name = "h100";
  std::string note;                       ///< where the numbers come from
  double peakFlops = 989e12;              ///< dense FLOP/s of one worker at the plan's dtype
  int64_t workersPerNode = 8;             ///< workers sharing the intra-node fabric
  double intraNodeBytesPerSecond = 450e9; ///< per worker, each way (NVLink through NVSwitch)
  double interNodeBytesPerSecond = 50e9;  ///< per worker NIC, each way
  double intraNodeLatencySeconds = 3e-6;  ///< added once per transfer
  double interNodeLatencySeconds = 10e-6;
  /// Seconds per output element (query token × query head × head dim) to merge partials into
  /// a worker's accumulator (O and LSE forward, dQ backward), a memory-bound pass outside the
  /// kernel: after every pair that computes with remote KV, or under KernelLaunch::kStage once
  /// per stage for every Q block that does. 0 when the curve already includes it (the CPU
  /// profile's calibration merges every pair).
  double mergeSecondsPerElement = 0;
  /// Device memory bandwidth, bytes per second (JSON "hbm_gbps"): what the head-parallel
  /// exchanges' permutes between token-major rows and per-destination chunks are charged at
  /// (simulateHeadParallel). 0: not charged.
  double memoryBytesPerSecond = 0;
  KernelLaunch launch = KernelLaunch::kPair;  ///< JSON "kernel_launch": "pair" or "stage"
  Pipeline pipeline = Pipeline::kLockstep;    ///< JSON "pipeline": "lockstep" or "multibuffer"
  /// Kernel efficiency f(block tokens) of the forward and backward kernels.
  EfficiencyCurve forward = EfficiencyCurve::paperDefault();
  EfficiencyCurve backward = EfficiencyCurve::paperDefault();

  /// The cost model planners must use for plans this profile simulates (pair costs are then
  /// FLOPs at this device's peak).
  CostModel costModel(const AttentionConfig& attention) const;
  /// Compute-to-communication ratio: peak FLOP/s over NIC bytes/s (the paper's Table).
  double flopsPerByte() const { return peakFlops / interNodeBytesPerSecond; }
  /// The link's speed in the units FCP's planner takes (PlanConfig::commRatio: cost units,
  /// i.e. forward FLOPs at peak, per byte) for a job on `workers` workers: peak FLOP/s over
  /// 3.5 (forward plus a backward of 2.5x its FLOPs) over the NIC's bytes/s, or NVLink's when
  /// the job fits in one node.
  double planCommRatio(int64_t workers) const;
};

/// Parses a profile from JSON text:
///   {"kind": "fcp-hardware", "name": ..., "note": ..., "peak_tflops": 989,
///    "workers_per_node": 8, "intra_node_gbps": 450, "inter_node_gbps": 50,
///    "intra_node_latency_us": 3, "inter_node_latency_us": 10, "merge_ps_per_element": 0,
///    "hbm_gbps": 0, "kernel_launch": "pair" (or "stage"; KernelLaunch),
///    "pipeline": "lockstep" (or "multibuffer"; Pipeline),
///    "forward": [[tokens, fraction], ...], "backward": [[tokens, fraction], ...]}
/// (GB/s = 1e9 bytes/s). Throws Error(kInvalidArgument) naming the bad or missing field.
HardwareProfile parseHardwareProfile(const std::string& jsonText, const std::string& source);

/// Reads a profile: a path to a JSON file, or a built-in name ("h100", "gpu-x", "gpu-y"),
/// which is looked up as data/hardware/<name>.json under the directory FCP_DATA_DIR names,
/// else the source tree's data/ directory. Throws Error(kInvalidArgument) for an unknown
/// name or an unreadable file.
HardwareProfile loadHardwareProfile(const std::string& nameOrPath);

/// Whether `nameOrPath` names a built-in profile rather than a file: no '/' and no ".json", and
/// either a built-in profile of that name exists (it wins over a file of the same name here, as
/// built-in workloads do: `./h100` names the file) or no such file exists here (an unknown
/// name).
bool isProfileName(const std::string& nameOrPath);

/// The forward and backward kernel-efficiency curves of a curve file written by `fcp bench
/// kernel --curve-out` ({"kind": "fcp-efficiency-curve", "forward": [[tokens, fraction], ...],
/// "backward": [...]}) or of a hardware profile (a built-in name or a file), so that planners
/// plan with a device's own f(B). Throws Error(kInvalidArgument) naming the file and what was
/// expected.
std::pair<EfficiencyCurve, EfficiencyCurve> loadEfficiencyCurves(const std::string& nameOrPath);

/// The curves of the text of a curve or hardware-profile file (what loadEfficiencyCurves reads
/// from a file); `source` names it in messages.
std::pair<EfficiencyCurve, EfficiencyCurve> parseEfficiencyCurves(const std::string& jsonText,
                                                                  const std::string& source);

}  // namespace fcp::sim
