#pragma once
/// Which instruction-set path the CPU kernels run. Detection happens at run time; tests and
/// benchmarks may force a path to compare every path with the same reference. This is the only
/// CPU-specific public header of the kernels module, and it names paths, not intrinsics.

#include <string_view>

namespace fcp::kernels {

/// The compiled paths of the CPU kernels' own vector code (softmax, exp, masks, conversions).
/// Tile products always go to oneDNN, which dispatches on its own.
enum class CpuPath {
  kAuto,      ///< the best path this CPU supports
  kPortable,  ///< plain C++ for the baseline x86-64 (or any) target
  kAvx2,      ///< AVX2 + FMA
  kAvx512,    ///< AVX-512 F/BW/DQ/VL
};

/// Name of a path ("auto", "portable", "avx2", "avx512").
std::string_view cpuPathName(CpuPath path);

/// True if this CPU can run `path` (kAuto and kPortable always can).
bool cpuSupports(CpuPath path);

/// Forces `path` for every following kernel call in the process; kAuto restores detection.
/// Throws fcp::Error (invalid argument) if the CPU cannot run it. Not for use while kernels run.
void setCpuPath(CpuPath path);

/// The path kernel calls use now (never kAuto).
CpuPath activeCpuPath();

}  // namespace fcp::kernels
