// Run-time choice of the vector-code path. Detection uses the compiler's CPU probe, which also
// checks that the OS saves the wide registers (XSAVE state), so a hypervisor that hides AVX-512
// gets the AVX2 path.
#include "fcp/kernels/cpu_dispatch.h"

#include <atomic>

#include "fcp/core/error.h"
#include "vector_ops.h"

namespace fcp::kernels {
namespace {

CpuPath detectBest() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return CpuPath::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuPath::kAvx2;
#endif
  return CpuPath::kPortable;
}

std::atomic<CpuPath>& forcedPath() {
  static std::atomic<CpuPath> path{CpuPath::kAuto};
  return path;
}

std::atomic<Bf16Gemm>& forcedBf16Gemm() {
  static std::atomic<Bf16Gemm> gemm{Bf16Gemm::kAuto};
  return gemm;
}

}  // namespace

std::string_view cpuPathName(CpuPath path) {
  switch (path) {
    case CpuPath::kAuto: return "auto";
    case CpuPath::kPortable: return "portable";
    case CpuPath::kAvx2: return "avx2";
    case CpuPath::kAvx512: return "avx512";
  }
  return "unknown";
}

bool cpuSupports(CpuPath path) {
  static const CpuPath best = detectBest();
  switch (path) {
    case CpuPath::kAuto:
    case CpuPath::kPortable: return true;
    case CpuPath::kAvx2: return best == CpuPath::kAvx2 || best == CpuPath::kAvx512;
    case CpuPath::kAvx512: return best == CpuPath::kAvx512;
  }
  return false;
}

void setCpuPath(CpuPath path) {
  if (!cpuSupports(path))
    throwInvalidArgument("CPU path '", cpuPathName(path), "' is not supported by this CPU; expected ",
                         "one of auto, portable", cpuSupports(CpuPath::kAvx2) ? ", avx2" : "");
  forcedPath().store(path);
}

CpuPath activeCpuPath() {
  static const CpuPath best = detectBest();
  const CpuPath forced = forcedPath().load();
  return forced == CpuPath::kAuto ? best : forced;
}

std::string_view bf16GemmName(Bf16Gemm gemm) {
  switch (gemm) {
    case Bf16Gemm::kAuto: return "auto";
    case Bf16Gemm::kNative: return "native";
    case Bf16Gemm::kWiden: return "widen";
  }
  return "unknown";
}

void setBf16Gemm(Bf16Gemm gemm) {
  if (gemm == Bf16Gemm::kNative && !bf16GemmSupported())
    throwInvalidArgument("bf16 GEMM path 'native' is unavailable on this CPU (oneDNN's ",
                         "dnnl_gemm_bf16bf16f32 is unimplemented here); expected auto or widen");
  forcedBf16Gemm().store(gemm);
}

Bf16Gemm activeBf16Gemm() {
  const Bf16Gemm forced = forcedBf16Gemm().load();
  if (forced != Bf16Gemm::kAuto) return forced;
  return bf16GemmSupported() ? Bf16Gemm::kNative : Bf16Gemm::kWiden;
}

namespace detail {

const VectorOps& vectorOps() {
  switch (activeCpuPath()) {
    case CpuPath::kAvx512: return vectorOpsAvx512();
    case CpuPath::kAvx2: return vectorOpsAvx2();
    default: return vectorOpsPortable();
  }
}

}  // namespace detail
}  // namespace fcp::kernels
