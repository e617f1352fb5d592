// Block-attention kernels against their own GEMM and against Debian torch 1.13's attention, in
// one run: head_dim 128, GQA 8:1 (8 Q heads, 1 KV head), self pairs of 1K, 2K and 4K tokens,
// causal and full, fp32 and bf16, 1 and 2 threads. Prints a table; asserts nothing.
//
// Columns: kernel useful GFLOP/s (masked-out work not counted), the GEMM the kernel used
// (dnnl_sgemm; oneDNN's bf16 GEMM for bf16 where the CPU runs it) running the same tile products
// alone (same tiles, threads and order, alternating with the kernel), their ratio, the same for
// the backward, then torch's forward and backward useful GFLOP/s and our speed-up over it, and
// for bf16 rows oneDNN's bf16 GEMM on the forward's tiles ("unavail." where the CPU cannot).
//
// usage: kernel_bench [--tokens N...] [--threads T...] [--torch-tokens N...] [--min-seconds S]
//                     [--no-torch]
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/kernels/attention.h"
#include "fcp/kernels/calibration.h"
#include "fcp/kernels/cpu_dispatch.h"

using namespace fcp::kernels;

namespace {

struct Args {
  std::vector<int64_t> tokens{1024, 2048, 4096};
  std::vector<int> threads{1, 2};
  // torch 1.13 runs ~1-4 GFLOP/s here: 4K tokens would take ~15 minutes for its column alone.
  std::vector<int64_t> torchTokens{1024, 2048};
  double minSeconds = 0.3;
  bool torch = true;
};

/// Numbers parsed strictly (fcp/core/input.h): a block of at most 16K tokens, 1 to 256
/// threads, at most 60 s per measurement; anything else is one line and exit code 2.
Args parse(int argc, char** argv) {
  Args a;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      auto list = [&](auto& out, int64_t max) {
        out.clear();
        while (i + 1 < argc && argv[i + 1][0] != '-') {
          using T = typename std::decay_t<decltype(out)>::value_type;
          out.push_back(static_cast<T>(fcp::parseInteger(argv[++i], flag, 1, max)));
        }
      };
      if (flag == "--tokens") list(a.tokens, 16 * 1024);
      else if (flag == "--threads") list(a.threads, 256);
      else if (flag == "--torch-tokens") list(a.torchTokens, 16 * 1024);
      else if (flag == "--min-seconds" && i + 1 < argc) a.minSeconds = fcp::parseNumber(argv[++i], flag, 0, 60);
      else if (flag == "--no-torch") a.torch = false;
      else {
        std::fprintf(stderr, "kernel_bench: unknown argument '%s'\n", fcp::printable(flag).c_str());
        std::exit(2);
      }
    }
  } catch (const fcp::Error& e) {
    std::fprintf(stderr, "kernel_bench: %s\n", e.what());
    std::exit(2);
  }
  return a;
}

using Key = std::tuple<std::string, std::string, int64_t, int>;  // dtype, mask, tokens, threads

// Torch's numbers, from bench/torch_attention_bench.py run with Debian's /usr/bin/python3.
std::map<Key, std::pair<double, double>> runTorch(const Args& a) {
  std::string cmd = "/usr/bin/python3 " FCP_BENCH_DIR "/torch_attention_bench.py --tokens";
  // Appended piece by piece: `" " + std::to_string(t)` trips GCC 12's -Wrestrict false positive.
  for (int64_t t : a.torchTokens) cmd.append(" ").append(std::to_string(t));
  cmd += " --threads";
  for (int t : a.threads) cmd.append(" ").append(std::to_string(t));
  std::map<Key, std::pair<double, double>> out;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return out;
  char line[4096];
  while (std::fgets(line, sizeof line, pipe)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("dtype")) continue;
    out[{j["dtype"], j["mask"], j["tokens"], j["threads"]}] = {j["forward_gflops"],
                                                               j["backward_gflops"]};
  }
  pclose(pipe);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  std::printf("CPU: %s; vector path: %s; head_dim 128, 8 Q heads, 1 KV head\n",
              cpuModelName().c_str(), std::string(cpuPathName(activeCpuPath())).c_str());
  for (int t : a.threads)
    std::printf("peak dnnl_sgemm (768^3 per thread), %d thread(s): %.1f GFLOP/s\n", t,
                measurePeakGemmGflops(t, a.minSeconds));
  for (int t : a.threads) {
    const double bf16 = measureBf16GemmGflops(256, 128, 128, t, a.minSeconds);
    if (bf16 < 0)
      std::printf("bf16 GEMM (dnnl_gemm_bf16bf16f32), %d thread(s): unavailable on this CPU "
                  "(oneDNN 2.6 implements it only with AVX-512)\n", t);
    else
      std::printf("bf16 GEMM (256x128x128 per thread), %d thread(s): %.1f GFLOP/s\n", t, bf16);
  }
  std::printf("gemm columns: the kernel's own tile products alone, through the GEMM it used: "
              "dnnl_sgemm for fp32 rows; for bf16 rows %s\n",
              activeBf16Gemm() == Bf16Gemm::kNative
                  ? "dnnl_gemm_bf16bf16f32 (oneDNN's bf16 GEMM)"
                  : "dnnl_sgemm on widened tiles (no bf16 GEMM here: bf16GEMM column "
                    "'unavail.')");
  std::map<Key, std::pair<double, double>> torch;
  if (a.torch) {
    std::printf("running torch 1.13 (this takes minutes)...\n");
    std::fflush(stdout);
    torch = runTorch(a);
  }
  std::printf("\n%-5s %-6s %6s %3s | %8s %8s %5s | %8s %8s %5s | %8s %8s %7s | %9s\n",
              "dtype", "mask", "tokens", "thr", "fwd", "gemm", "ratio", "bwd", "gemm", "ratio",
              "torchF", "torchB", "x torch", "bf16GEMMf");
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    for (MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
      for (int64_t n : a.tokens) {
        for (int t : a.threads) {
          const CalibrationResult r = calibrate({dtype, mask, n, 8, 1, 128, t}, a.minSeconds);
          const std::string maskName = mask == MaskKind::kCausal ? "causal" : "full";
          std::printf("%-5s %-6s %6lld %3d | %8.1f %8.1f %5.2f | %8.1f %8.1f %5.2f |",
                      std::string(dtypeName(dtype)).c_str(), maskName.c_str(),
                      static_cast<long long>(n), t, r.forwardGflops, r.forwardGemmGflops,
                      r.forwardGflops / r.forwardGemmGflops, r.backwardGflops,
                      r.backwardGemmGflops, r.backwardGflops / r.backwardGemmGflops);
          const auto it = torch.find({std::string(dtypeName(dtype)), maskName, n, t});
          if (it == torch.end()) {
            std::printf(" %8s %8s %7s |", "-", "-", "-");
          } else {
            const auto [tf, tb] = it->second;
            std::printf(" %8.2f %8.2f %7.1f |", tf, tb,
                        (r.forwardSeconds + r.backwardSeconds) > 0
                            ? (r.forwardGflops / tf + r.backwardGflops / tb) / 2
                            : 0.0);
          }
          if (dtype == DType::kFp32) std::printf(" %9s\n", "-");
          else if (r.forwardBf16GemmGflops) std::printf(" %9.1f\n", *r.forwardBf16GemmGflops);
          else std::printf(" %9s\n", "unavail.");
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
