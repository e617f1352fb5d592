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

/// How the kernels multiply bf16 tiles.
enum class Bf16Gemm {
  kAuto,    ///< kNative where oneDNN's bf16 GEMM runs on this CPU, else kWiden
  kNative,  ///< oneDNN's bf16 GEMM (bf16 x bf16 -> fp32): Q, K, V, dO stay bf16, and the
            ///< probabilities P and score gradients dS are rounded to bf16 for their products
  kWiden,   ///< tiles widened to fp32 and multiplied with dnnl_sgemm: bf16 storage, fp32 compute
};

/// Name of a bf16 GEMM path ("auto", "native", "widen").
std::string_view bf16GemmName(Bf16Gemm gemm);

/// True if oneDNN's bf16 GEMM (dnnl_gemm_bf16bf16f32) runs on this CPU and returns the exact
/// product of a small integer-valued probe. Probed once per process, thread-safe. oneDNN 2.6
/// implements it only on AVX-512 CPUs; elsewhere it reports "unimplemented" and this is false.
bool bf16GemmSupported();

/// Forces a bf16 GEMM path for every following kernel call; kAuto restores detection. Throws
/// fcp::Error (invalid argument) for kNative where bf16GemmSupported() is false. Not for use
/// while kernels run.
void setBf16Gemm(Bf16Gemm gemm);

/// The path bf16 kernel calls use now (never kAuto).
Bf16Gemm activeBf16Gemm();

}  // namespace fcp::kernels
