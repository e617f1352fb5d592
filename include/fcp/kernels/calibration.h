#pragma once
/// Measuring the kernels: useful GFLOP/s of forward and backward on one block pair, side by side
/// with the GEMM they are built on, on the same tile shapes in the same run. This is what
/// `fcp bench kernel` and bench/kernel_bench print, and what the efficiency curve is made of.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "fcp/kernels/attention.h"

namespace fcp::kernels {

/// One measured configuration: a self pair of `blockTokens` tokens of one sequence (causal: the
/// diagonal pair, about half the pairs visible; full: all visible); or, with zigzagBlocks = k
/// > 0, every visible pair of a causal sequence of k × blockTokens tokens cut into k Zig-Zag
/// blocks (block i holds chunks i and 2k − 1 − i of blockTokens / 2 tokens), each block in
/// its own buffers, timed together: the pairs a plan's long sequences give the runtime.
struct CalibrationCase {
  DType dtype = DType::kFp32;
  MaskKind mask = MaskKind::kCausal;
  int64_t blockTokens = 1024;
  int numHeadsQ = 8;
  int numHeadsKv = 1;
  int headDim = 128;
  int numThreads = 1;
  int zigzagBlocks = 0;
  /// Time the kernels as the runtime runs them instead of at their best: repetitions back to
  /// back, each forward pair followed by the merge of its partial output into the block's
  /// accumulator (the runtime does both per pair), the mean over the repetitions kept. The
  /// GEMM reference is still timed at its best, apart. For profiles a simulator predicts a run
  /// with (bench/sim_vs_real.sh); kernel-versus-GEMM comparisons use the default.
  bool sustained = false;
};

/// Speeds of one case. Kernel GFLOP/s count useful FLOPs only (DESIGN.md); GEMM GFLOP/s count
/// the FLOPs the same tile products execute (diagonal tiles' visible column spans), run alone.
struct CalibrationResult {
  double forwardGflops = 0;
  double backwardGflops = 0;
  /// The kernel's forward tile products alone, through the GEMM the kernel used: dnnl_sgemm
  /// for fp32 and for bf16 widened to fp32, dnnl_gemm_bf16bf16f32 for bf16 on the native path.
  double forwardGemmGflops = 0;
  double backwardGemmGflops = 0;  ///< the same for the backward's tile products
  /// bf16 cases: oneDNN's bf16 GEMM on the same tile products; empty where this CPU cannot run
  /// it (and for fp32 cases).
  std::optional<double> forwardBf16GemmGflops;
  std::optional<double> backwardBf16GemmGflops;
  bool usedBf16Gemm = false;  ///< the kernel's tile products went through the bf16 GEMM
  /// Best (sustained: mean) time of one forward call (of every pair, for Zig-Zag).
  double forwardSeconds = 0;
  double backwardSeconds = 0;     ///< the same of one backward call (computeDelta excluded)
  double usefulForwardFlops = 0;  ///< 4 * visible pairs * heads_q * head_dim
  int64_t blockPairs = 0;         ///< block pairs with a visible entry, each timed once per call
};

/// Throws Error(kInvalidArgument) for a Zig-Zag case with an odd blockTokens or a full mask.
/// Runs `c` repeatedly (at least three times, and for at least minSeconds per measurement) and
/// keeps the best time of each measurement. The kernel and its GEMM reference alternate, rep by
/// rep, so that a shared machine's slow spells hit both alike. A sustained case keeps the
/// kernel's mean time instead (CalibrationCase::sustained).
CalibrationResult calibrate(const CalibrationCase& c, double minSeconds = 0.3);

/// Best dnnl_sgemm GFLOP/s on large square tiles, one sequential GEMM per thread, all threads
/// at once: the measured peak that efficiency fractions are relative to.
double measurePeakGemmGflops(int numThreads, double minSeconds = 0.3);

/// GFLOP/s of oneDNN's bf16 GEMM (dnnl_gemm_bf16bf16f32) on an m x n x k product per thread,
/// or a negative number if this oneDNN cannot run it on this CPU (2.6 needs AVX-512 for it).
double measureBf16GemmGflops(int64_t m, int64_t n, int64_t k, int numThreads,
                             double minSeconds = 0.3);

/// The CPU's model name (lscpu's "Model name", from /proc/cpuinfo), or "unknown".
std::string cpuModelName();

namespace detail {
/// Mean seconds of `run` repeated back to back after one untimed warm-up, over at least three
/// timed repetitions and at least minSeconds in all: a sustained case's kernel timing.
double meanSeconds(const std::function<void()>& run, double minSeconds);
}  // namespace detail

}  // namespace fcp::kernels
