// `fcp bench kernel`: calibrates the CPU block-attention kernels. Measures forward and backward
// useful GFLOP/s against block length beside the same tile products run through dnnl_sgemm,
// prints a table (or JSON records), and writes the efficiency curve the cost model loads.
//
// bf16 runs say which GEMM the kernel's tile products used (oneDNN's bf16 GEMM where the CPU runs
// it, else sgemm on widened tiles) and report the bf16 GEMM on the same tiles, or that it is
// unavailable (JSON: "bf16_gemm_gflops": null).
//
// Curve format (fcp::core reads it): {"kind": "fcp-efficiency-curve", "device", "dtype",
// "threads", "peak_gflops", "forward": [[tokens, fraction], ...], "backward": [...]}, where
// fraction = kernel GFLOP/s / peak_gflops and peak_gflops is the best GEMM GFLOP/s measured in
// the same run: sgemm on large tiles, or the GEMM on the kernels' own tiles (bf16's own GEMM
// where the CPU has it). The curve is made from the full-mask pairs: a causal plan's
// pairs are mostly off-diagonal, i.e. full.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "fcp/core/config.h"
#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/units.h"
#include "fcp/kernels/attention.h"
#include "fcp/kernels/calibration.h"
#include "fcp/kernels/cpu_dispatch.h"

namespace fcp::app {
namespace {

struct KernelBenchArgs {
  std::string dtype = "fp32";
  std::vector<std::string> masks{"causal", "full"};
  std::vector<std::string> tokens{"256", "512", "1K", "2K", "4K", "8K"};
  int64_t threads = 1;
  int64_t headsQ = 8;
  int64_t headsKv = 1;
  int64_t headDim = 128;
  double minSeconds = 0.2;
  std::string path = "auto";
  std::string bf16Gemm = "auto";
  bool json = false;
  bool sustained = false;
  std::string curveOut;
};

kernels::DType parseDtype(const std::string& text) {
  if (text == "fp32") return kernels::DType::kFp32;
  if (text == "bf16") return kernels::DType::kBf16;
  throwInvalidArgument("unknown --dtype '", text, "': expected fp32 or bf16");
}

/// Zig-Zag cases: the pairs of a causal sequence cut into this many blocks.
constexpr int kZigzagBlocks = 4;

kernels::MaskKind parseMask(const std::string& text) {
  if (text == "causal" || text == "zigzag") return kernels::MaskKind::kCausal;
  if (text == "full") return kernels::MaskKind::kFull;
  throwInvalidArgument("unknown --mask '", text, "': expected causal, full or zigzag");
}

kernels::CpuPath parsePath(const std::string& text) {
  for (kernels::CpuPath p : {kernels::CpuPath::kAuto, kernels::CpuPath::kPortable,
                             kernels::CpuPath::kAvx2, kernels::CpuPath::kAvx512})
    if (text == kernels::cpuPathName(p)) return p;
  throwInvalidArgument("unknown --path '", text, "': expected auto, portable, avx2 or avx512");
}

kernels::Bf16Gemm parseBf16Gemm(const std::string& text) {
  for (kernels::Bf16Gemm g :
       {kernels::Bf16Gemm::kAuto, kernels::Bf16Gemm::kNative, kernels::Bf16Gemm::kWiden})
    if (text == kernels::bf16GemmName(g)) return g;
  throwInvalidArgument("unknown --bf16-gemm '", text, "': expected auto, native or widen");
}

// What the GEMM columns of a run of `dtype` measure, in words.
std::string gemmDescription(kernels::DType dtype) {
  if (dtype == kernels::DType::kFp32) return "dnnl_sgemm";
  if (kernels::activeBf16Gemm() == kernels::Bf16Gemm::kNative)
    return "dnnl_gemm_bf16bf16f32 (oneDNN's bf16 GEMM)";
  return std::string("dnnl_sgemm on bf16 tiles widened to fp32; oneDNN's bf16 GEMM ") +
         (kernels::bf16GemmSupported()
              ? "is bypassed (--bf16-gemm widen)"
              : "(dnnl_gemm_bf16bf16f32) is unavailable on this CPU (oneDNN implements it only "
                "with AVX-512)");
}

std::string formatOptional(const std::optional<double>& value) {
  if (!value) return "unavail.";
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", *value);
  return text;
}

void runKernelBench(const KernelBenchArgs& a) {
  const kernels::DType dtype = parseDtype(a.dtype);
  if (!a.curveOut.empty()) checkOutputPath(a.curveOut, "--curve-out file");
  for (size_t i = 0; i < a.masks.size(); ++i) {
    parseMask(a.masks[i]);
    // A mask measured twice would give the curve each length twice.
    const auto at = a.masks.begin() + static_cast<std::ptrdiff_t>(i);
    if (std::find(a.masks.begin(), at, *at) != at)
      throwInvalidArgument("--mask lists ", a.masks[i], " twice: expected distinct masks");
  }
  std::vector<int64_t> tokens;
  for (const std::string& t : a.tokens) {
    const int64_t n = parseTokenCount(t, "--tokens");
    // The curve's lengths must increase strictly (its loader refuses a repeated one), and a
    // length measured twice says nothing new: refuse it here, before minutes of measurement.
    // Compared after the suffixes, so "1K 1024" is a repeat.
    const auto same = std::find(tokens.begin(), tokens.end(), n);
    if (same != tokens.end()) {
      const std::string& first = a.tokens[static_cast<size_t>(same - tokens.begin())];
      throwInvalidArgument("--tokens lists ", n, " twice",
                           first == t ? std::string() : " ('" + first + "' and '" + t + "')",
                           ": expected distinct lengths");
    }
    tokens.push_back(n);
    if (tokens.back() > kMaxBenchTokens) {
      throwInvalidArgument("invalid --tokens ", tokens.back(), ": expected at most ", kMaxBenchTokens,
                           " (one measurement of a larger block takes minutes)");
    }
    const double flops = 4.0 * static_cast<double>(tokens.back()) *
                         static_cast<double>(tokens.back()) * static_cast<double>(a.headsQ) *
                         static_cast<double>(a.headDim);
    if (flops > kMaxBenchPairFlops) {
      throwInvalidArgument("--tokens ", tokens.back(), " x --heads-q ", a.headsQ, " x --head-dim ",
                           a.headDim, " is ", flops, " FLOP per forward pair: expected at most ",
                           kMaxBenchPairFlops, " (8K tokens, 8 heads of 128; a measurement "
                           "would take minutes): a smaller block, fewer heads or a smaller head dim");
    }
  }
  std::sort(tokens.begin(), tokens.end());
  if (std::find(a.masks.begin(), a.masks.end(), "zigzag") != a.masks.end()) {
    for (const int64_t n : tokens) {
      if (n % 2 != 0)
        throwInvalidArgument("invalid --tokens ", n,
                             " with --mask zigzag: expected an even block length");
    }
  }
  if (a.headsQ % a.headsKv != 0)
    throwInvalidArgument("invalid --heads-q ", a.headsQ, ": expected a multiple of --heads-kv ",
                         a.headsKv);
  if (!(a.minSeconds >= 0.0))
    throwInvalidArgument("invalid --min-seconds ", a.minSeconds, ": expected >= 0");
  kernels::setCpuPath(parsePath(a.path));
  kernels::setBf16Gemm(parseBf16Gemm(a.bf16Gemm));
  const bool bf16 = dtype == kernels::DType::kBf16;
  // The flags' ranges (common.h, fcp/core/config.h) fit int.
  const int threads = static_cast<int>(a.threads), headsQ = static_cast<int>(a.headsQ),
            headsKv = static_cast<int>(a.headsKv), headDim = static_cast<int>(a.headDim);

  const std::string device = kernels::cpuModelName();
  if (!a.json) {
    std::printf("fcp bench kernel: %s, vector path %s, %s, %d/%d heads x %d, %d thread(s), %s\n",
                device.c_str(), std::string(kernels::cpuPathName(kernels::activeCpuPath())).c_str(),
                a.dtype.c_str(), headsQ, headsKv, headDim, threads,
                a.sustained ? "sustained (mean, forward with merges)" : "best of repeats");
    std::printf("gemm columns: %s\n", gemmDescription(dtype).c_str());
    if (bf16)
      std::printf("bf16 GEMM columns: dnnl_gemm_bf16bf16f32 on the same tiles%s\n",
                  kernels::bf16GemmSupported() ? "" : ": unavailable on this CPU");
    std::printf("%-6s %7s | %8s %8s %6s | %8s %8s %6s", "mask", "tokens", "fwd", "gemm", "ratio",
                "bwd", "gemm", "ratio");
    std::printf(bf16 ? " | %9s %9s\n" : "\n", "bf16GEMMf", "bf16GEMMb");
  }
  // Peak: the best GEMM speed seen in this run, on large tiles before and after the kernels
  // and on the kernels' own tiles, so that a disturbed measurement cannot inflate fractions.
  double peak = kernels::measurePeakGemmGflops(threads, a.minSeconds);
  struct Row {
    std::string mask;
    int64_t tokens;
    kernels::CalibrationResult r;
  };
  std::vector<Row> rows;
  for (const std::string& maskName : a.masks) {
    const kernels::MaskKind mask = parseMask(maskName);
    const int zigzag = maskName == "zigzag" ? kZigzagBlocks : 0;
    for (int64_t n : tokens) {
      const kernels::CalibrationResult r = kernels::calibrate(
          {dtype, mask, n, headsQ, headsKv, headDim, threads, zigzag, a.sustained},
          a.minSeconds);
      rows.push_back({maskName, n, r});
      peak = std::max({peak, r.forwardGemmGflops, r.backwardGemmGflops});
      if (a.json) continue;
      std::printf("%-6s %7s | %8.1f %8.1f %6.2f | %8.1f %8.1f %6.2f", maskName.c_str(),
                  formatTokenCount(n).c_str(), r.forwardGflops, r.forwardGemmGflops,
                  r.forwardGflops / r.forwardGemmGflops, r.backwardGflops, r.backwardGemmGflops,
                  r.backwardGflops / r.backwardGemmGflops);
      if (bf16)
        std::printf(" | %9s %9s", formatOptional(r.forwardBf16GemmGflops).c_str(),
                    formatOptional(r.backwardBf16GemmGflops).c_str());
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  peak = std::max(peak, kernels::measurePeakGemmGflops(threads, a.minSeconds));
  if (!a.json)
    std::printf(
        "peak (best GEMM GFLOP/s of this run: dnnl_sgemm on large tiles, or a gemm "
        "column): %.1f\n",
        peak);

  nlohmann::json forwardCurve = nlohmann::json::array(), backwardCurve = nlohmann::json::array();
  // The curve: from the Zig-Zag cases if measured (what a plan's long sequences run), else the
  // full ones (a causal plan's pairs are mostly off-diagonal), else the causal ones.
  const auto measured = [&](const char* m) {
    return std::find(a.masks.begin(), a.masks.end(), m) != a.masks.end();
  };
  const std::string curveMask = measured("zigzag") ? "zigzag"
                                : measured("full") ? "full"
                                                   : "causal";
  for (const Row& row : rows) {
    const kernels::CalibrationResult& r = row.r;
    if (a.json) {
      for (const char* direction : {"forward", "backward"}) {
        const bool fwd = direction[0] == 'f';
        const double gflops = fwd ? r.forwardGflops : r.backwardGflops;
        nlohmann::json record = {{"dtype", a.dtype},
                                 {"mask", row.mask},
                                 {"direction", direction},
                                 {"tokens", row.tokens},
                                 {"threads", threads},
                                 {"heads_q", headsQ},
                                 {"heads_kv", headsKv},
                                 {"head_dim", headDim},
                                 {"gflops", gflops},
                                 {"gemm_gflops", fwd ? r.forwardGemmGflops : r.backwardGemmGflops},
                                 {"seconds", fwd ? r.forwardSeconds : r.backwardSeconds},
                                 {"timing", a.sustained ? "sustained" : "best"},
                                 {"fraction_of_peak", gflops / peak},
                                 {"peak_gflops", peak},
                                 {"gemm", r.usedBf16Gemm ? "dnnl_gemm_bf16bf16f32" : "dnnl_sgemm"}};
        if (bf16) {
          // null, not 0, where this CPU cannot run oneDNN's bf16 GEMM.
          const std::optional<double>& g = fwd ? r.forwardBf16GemmGflops : r.backwardBf16GemmGflops;
          record["bf16_gemm_gflops"] = g ? nlohmann::json(*g) : nlohmann::json(nullptr);
        }
        std::cout << record.dump() << '\n';
      }
    }
    if (row.mask == curveMask) {
      forwardCurve.push_back({row.tokens, r.forwardGflops / peak});
      backwardCurve.push_back({row.tokens, r.backwardGflops / peak});
    }
  }
  if (a.curveOut.empty()) return;
  const nlohmann::json curve = {{"kind", "fcp-efficiency-curve"},
                                {"device", device},
                                {"dtype", a.dtype},
                                {"threads", threads},
                                {"peak_gflops", peak},
                                {"timing", a.sustained ? "sustained" : "best"},
                                {"forward", forwardCurve},
                                {"backward", backwardCurve}};
  writeUserFile(a.curveOut, "--curve-out file", curve.dump(2) + "\n");
  if (!a.json) std::printf("efficiency curve written to %s\n", a.curveOut.c_str());
}

}  // namespace

void addBenchCommand(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Measure FCP's components on this machine");
  bench->require_subcommand(1);
  auto args = std::make_shared<KernelBenchArgs>();
  CLI::App* kernel = bench->add_subcommand(
      "kernel",
      "Block-attention kernels: GFLOP/s vs block length, beside dnnl_sgemm on the same "
      "tiles; writes the efficiency curve");
  addText(kernel, "--dtype", args->dtype, "fp32 or bf16");
  kernel
      ->add_option(
          "--mask", args->masks,
          "causal, full (self pairs of one sequence) and/or zigzag (every pair of a causal "
          "sequence cut into 4 Zig-Zag blocks of this length)")
      ->capture_default_str();
  kernel->add_option("--tokens", args->tokens, "block lengths (e.g. 256 1K 8K)")
      ->capture_default_str();
  addInteger(kernel, "--threads", args->threads, 1, kMaxThreads, "worker threads");
  addInteger(kernel, "--heads-q", args->headsQ, 1, kMaxHeads, "query heads");
  addInteger(kernel, "--heads-kv", args->headsKv, 1, kMaxHeads, "key/value heads");
  addInteger(kernel, "--head-dim", args->headDim, 1, kMaxHeadDim, "head dimension");
  addNumber(kernel, "--min-seconds", args->minSeconds, 0, kMaxMinSeconds, "time per measurement");
  addText(kernel, "--path", args->path, "vector path: auto, portable, avx2, avx512");
  kernel
      ->add_option("--bf16-gemm", args->bf16Gemm,
                   "bf16 tile products: auto, native (oneDNN's bf16 GEMM), widen (fp32 sgemm)")
      ->capture_default_str();
  kernel->add_flag(
      "--sustained", args->sustained,
      "time the kernels as a run does: back to back, each forward pair with the merge of "
      "its partial output, mean of the repeats (default: best of the repeats, alternating "
      "with the GEMM)");
  kernel->add_flag("--json", args->json,
                   "one JSON record per (dtype, mask, direction, tokens, threads)");
  addText(kernel, "--curve-out", args->curveOut, "write the efficiency curve (JSON) here");
  kernel->callback([args] { runKernelBench(*args); });
}

}  // namespace fcp::app
