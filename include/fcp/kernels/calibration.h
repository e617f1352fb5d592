#pragma once
/// Measuring the kernels: useful GFLOP/s of forward and backward on one block pair, side by side
/// with the GEMM they are built on, on the same tile shapes in the same run. This is what
/// `fcp bench kernel` and bench/kernel_bench print, and what the efficiency curve is made of.

#include <cstdint>
#include <string>

#include "fcp/kernels/attention.h"

namespace fcp::kernels {

/// One measured configuration: a self pair of `blockTokens` tokens of one sequence (causal: the
/// diagonal pair, about half the pairs visible; full: all visible).
struct CalibrationCase {
  DType dtype = DType::kFp32;
  MaskKind mask = MaskKind::kCausal;
  int64_t blockTokens = 1024;
  int numHeadsQ = 8;
  int numHeadsKv = 1;
  int headDim = 128;
  int numThreads = 1;
};

/// Speeds of one case. Kernel GFLOP/s count useful FLOPs only (DESIGN.md); GEMM GFLOP/s count
/// the FLOPs the same tile products execute (diagonal tiles in full), run alone.
struct CalibrationResult {
  double forwardGflops = 0;
  double backwardGflops = 0;
  double forwardGemmGflops = 0;   ///< the kernel's forward tile products through dnnl_sgemm
  double backwardGemmGflops = 0;  ///< the kernel's backward tile products through dnnl_sgemm
  double forwardSeconds = 0;      ///< best time of one forward call
  double backwardSeconds = 0;     ///< best time of one backward call (computeDelta excluded)
  double usefulForwardFlops = 0;  ///< 4 * visible pairs * heads_q * head_dim
};

/// Runs `c` repeatedly (at least twice, and for at least minSeconds per measurement) and keeps
/// the best time of each measurement.
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

}  // namespace fcp::kernels
