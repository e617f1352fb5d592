// Calibration: times the kernels and the same tile products alone. Every measurement keeps the
// best of its repetitions: on shared machines the best time is the least disturbed one; a
// sustained case keeps the kernel's mean, the speed a long run actually gets.
#include "fcp/kernels/calibration.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_internal.h"
#include "fcp/core/error.h"
#include "fcp/kernels/cpu_dispatch.h"
#include "gemm.h"
#include "parallel.h"

namespace fcp::kernels {
namespace {

double bestSeconds(const std::function<void()>& run, double minSeconds) {
  using Clock = std::chrono::steady_clock;
  double best = 1e30, total = 0;
  for (int rep = 0; rep < 2 || total < minSeconds; ++rep) {
    const auto start = Clock::now();
    run();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::min(best, s);
    total += s;
  }
  return best;
}

// Best times of `a` and `b` run alternately (a, b, a, b, ...), after one untimed warm-up each,
// until both have run three times and `a` for minSeconds.
std::pair<double, double> bestSecondsAlternating(const std::function<void()>& a,
                                                 const std::function<void()>& b,
                                                 double minSeconds) {
  using Clock = std::chrono::steady_clock;
  auto time = [](const std::function<void()>& run) {
    const auto start = Clock::now();
    run();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  a();
  b();
  double bestA = 1e30, bestB = 1e30, totalA = 0;
  for (int rep = 0; rep < 3 || totalA < minSeconds; ++rep) {
    const double sa = time(a);
    bestA = std::min(bestA, sa);
    totalA += sa;
    bestB = std::min(bestB, time(b));
  }
  return {bestA, bestB};
}

// Runs `body` with the bf16 GEMM path forced to `gemm`, restoring the previous setting.
void withBf16Gemm(Bf16Gemm gemm, const std::function<void()>& body) {
  const Bf16Gemm before = activeBf16Gemm();
  setBf16Gemm(gemm);
  try {
    body();
  } catch (...) {
    setBf16Gemm(before);
    throw;
  }
  setBf16Gemm(before);
}

struct Tensor {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  TensorView view;
};

Tensor randomTensor(int64_t tokens, int heads, int dim, DType dtype, std::mt19937& rng) {
  Tensor t;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  t.f32.resize(static_cast<size_t>(tokens) * heads * dim);
  for (float& x : t.f32) x = dist(rng);
  if (dtype == DType::kBf16) {
    t.bf16.resize(t.f32.size());
    for (size_t i = 0; i < t.f32.size(); ++i) t.bf16[i] = toBf16(t.f32[i]);
    t.view = {t.bf16.data(), tokens, heads, dim, dtype};
  } else {
    t.view = {t.f32.data(), tokens, heads, dim, dtype};
  }
  return t;
}

}  // namespace

double detail::meanSeconds(const std::function<void()>& run, double minSeconds) {
  using Clock = std::chrono::steady_clock;
  run();
  double total = 0;
  int reps = 0;
  for (; reps < 3 || total < minSeconds; ++reps) {
    const auto start = Clock::now();
    run();
    total += std::chrono::duration<double>(Clock::now() - start).count();
  }
  return total / reps;
}

CalibrationResult calibrate(const CalibrationCase& c, double minSeconds) {
  if (c.zigzagBlocks < 0 ||
      (c.zigzagBlocks > 0 && (c.blockTokens % 2 != 0 || c.mask != MaskKind::kCausal))) {
    throwInvalidArgument("Zig-Zag calibration of ", c.zigzagBlocks, " blocks of ", c.blockTokens,
                         " tokens: expected a causal mask and an even block length");
  }
  std::mt19937 rng(12345);
  const int64_t n = c.blockTokens;
  // The blocks, each with its own tensors, and the pairs to time.
  const int numBlocks = std::max(c.zigzagBlocks, 1);
  std::vector<std::vector<Segment>> segments(static_cast<size_t>(numBlocks));
  if (c.zigzagBlocks == 0) {
    segments[0] = {Segment{n, 0, 0}};
  } else {
    const int64_t chunk = n / 2, k = c.zigzagBlocks;
    for (int64_t i = 0; i < k; ++i) {
      segments[static_cast<size_t>(i)] = {Segment{chunk, 0, i * chunk},
                                          Segment{chunk, 0, (2 * k - 1 - i) * chunk}};
    }
  }
  struct Block {
    Tensor q, k, v, dO;
  };
  std::vector<Block> blocks;
  blocks.reserve(static_cast<size_t>(numBlocks));  // views point into the blocks' vectors
  for (int b = 0; b < numBlocks; ++b) {
    Block& blk = blocks.emplace_back();
    blk.q = randomTensor(n, c.numHeadsQ, c.headDim, c.dtype, rng);
    blk.k = randomTensor(n, c.numHeadsKv, c.headDim, c.dtype, rng);
    blk.v = randomTensor(n, c.numHeadsKv, c.headDim, c.dtype, rng);
    blk.dO = randomTensor(n, c.numHeadsQ, c.headDim, c.dtype, rng);
  }
  struct Pair {
    size_t q, kv;
    BlockMask mask;
    std::vector<float> lse, delta;  // the pair's own forward statistics, for its backward
  };
  std::vector<Pair> pairs;
  CalibrationResult r;
  for (size_t qb = 0; qb < segments.size(); ++qb) {
    for (size_t kb = 0; kb < segments.size(); ++kb) {
      const BlockMask mask{c.mask, segments[qb], segments[kb]};
      const int64_t visible = countVisiblePairs(mask);
      if (visible == 0) continue;
      r.usefulForwardFlops += 4.0 * static_cast<double>(visible) * c.numHeadsQ * c.headDim;
      pairs.push_back({qb, kb, mask, std::vector<float>(static_cast<size_t>(n * c.numHeadsQ)),
                       std::vector<float>(static_cast<size_t>(n * c.numHeadsQ))});
    }
  }
  r.blockPairs = static_cast<int64_t>(pairs.size());
  const KernelOptions options{c.numThreads};
  const size_t qn = blocks[0].q.f32.size(), kn = blocks[0].k.f32.size();
  std::vector<float> o(qn), lse(n * c.numHeadsQ), dq(qn), dk(kn), dv(kn);
  // Sustained forwards merge each pair's partial output into its Q block's accumulator.
  std::vector<std::vector<float>> accO, accLse;
  if (c.sustained) {
    accO.assign(blocks.size(), std::vector<float>(qn, 0.f));
    accLse.assign(blocks.size(),
                  std::vector<float>(lse.size(), -std::numeric_limits<float>::infinity()));
  }

  r.usedBf16Gemm = c.dtype == DType::kBf16 && activeBf16Gemm() == Bf16Gemm::kNative;
  double fwdGemmFlops = 0, bwdGemmFlops = 0;
  auto forward = [&](bool gemmOnly) {
    double flops = 0;
    for (const Pair& p : pairs) {
      const Block &qb = blocks[p.q], &kb = blocks[p.kv];
      flops += detail::runForward(qb.q.view, kb.k.view, kb.v.view, p.mask, o.data(), lse.data(),
                                  options, gemmOnly);
      if (c.sustained && !gemmOnly) {
        mergePartials(n, c.numHeadsQ, c.headDim, accO[p.q].data(), accLse[p.q].data(), o.data(),
                      lse.data());
      }
    }
    return flops;
  };
  auto backward = [&](bool gemmOnly) {
    double flops = 0;
    for (const Pair& p : pairs) {
      const Block &qb = blocks[p.q], &kb = blocks[p.kv];
      flops += detail::runBackward(qb.q.view, kb.k.view, kb.v.view, qb.dO.view, p.lse.data(),
                                   p.delta.data(), p.mask, dq.data(), dk.data(), dv.data(), options,
                                   gemmOnly);
    }
    return flops;
  };
  auto forwardKernel = [&] { forward(false); };
  auto forwardGemm = [&] { fwdGemmFlops = forward(true); };
  auto backwardKernel = [&] { backward(false); };
  auto backwardGemm = [&] { bwdGemmFlops = backward(true); };
  double fwdGemmSeconds = 0, bwdGemmSeconds = 0;
  auto timeBoth = [&](const std::function<void()>& kernel, const std::function<void()>& gemm) {
    if (!c.sustained) return bestSecondsAlternating(kernel, gemm, minSeconds);
    const double kernelSeconds = detail::meanSeconds(kernel, minSeconds);
    return std::pair{kernelSeconds, bestSeconds(gemm, minSeconds)};
  };
  std::tie(r.forwardSeconds, fwdGemmSeconds) = timeBoth(forwardKernel, forwardGemm);
  // The backward needs each pair's forward LSE and D (the GEMM-only runs leave them unwritten).
  for (Pair& p : pairs) {
    const Block &qb = blocks[p.q], &kb = blocks[p.kv];
    detail::runForward(qb.q.view, kb.k.view, kb.v.view, p.mask, o.data(), p.lse.data(), options,
                       false);
    computeDelta({o.data(), n, c.numHeadsQ, c.headDim, DType::kFp32}, qb.dO.view, p.delta.data());
  }
  std::tie(r.backwardSeconds, bwdGemmSeconds) = timeBoth(backwardKernel, backwardGemm);
  r.forwardGemmGflops = fwdGemmFlops / fwdGemmSeconds * 1e-9;
  r.backwardGemmGflops = bwdGemmFlops / bwdGemmSeconds * 1e-9;
  r.forwardGflops = r.usefulForwardFlops / r.forwardSeconds * 1e-9;
  r.backwardGflops = 2.5 * r.usefulForwardFlops / r.backwardSeconds * 1e-9;
  if (r.usedBf16Gemm) {
    r.forwardBf16GemmGflops = r.forwardGemmGflops;
    r.backwardBf16GemmGflops = r.backwardGemmGflops;
  } else if (c.dtype == DType::kBf16 && bf16GemmSupported()) {
    // The kernel was forced onto the widened path; time the bf16 GEMM on the same tiles anyway.
    withBf16Gemm(Bf16Gemm::kNative, [&] {
      r.forwardBf16GemmGflops = fwdGemmFlops / bestSeconds(forwardGemm, minSeconds) * 1e-9;
      r.backwardBf16GemmGflops = bwdGemmFlops / bestSeconds(backwardGemm, minSeconds) * 1e-9;
    });
  }
  return r;
}

double measurePeakGemmGflops(int numThreads, double minSeconds) {
  const int64_t size = 768;
  const int threads = detail::resolveThreads(numThreads);
  std::vector<std::vector<float>> a(threads, std::vector<float>(size * size, 0.5f));
  std::vector<std::vector<float>> cs(threads, std::vector<float>(size * size, 0.0f));
  const double seconds = bestSeconds(
      [&] {
        detail::parallelFor(threads, threads, [&](int64_t t, int) {
          detail::sgemm('N', 'T', size, size, size, 1.0f, a[t].data(), size, a[t].data(), size,
                        0.0f, cs[t].data(), size);
        });
      },
      minSeconds);
  return 2.0 * static_cast<double>(size * size * size) * threads / seconds * 1e-9;
}

double measureBf16GemmGflops(int64_t m, int64_t n, int64_t k, int numThreads, double minSeconds) {
  if (!bf16GemmSupported()) return -1.0;
  const int threads = detail::resolveThreads(numThreads);
  std::vector<uint16_t> a(m * k, 0x3f80), b(n * k, 0x3f80);
  std::vector<std::vector<float>> cs(threads, std::vector<float>(m * n, 0.0f));
  const double seconds = bestSeconds(
      [&] {
        detail::parallelFor(threads, threads, [&](int64_t t, int) {
          detail::gemmBf16('N', 'T', m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, cs[t].data(),
                           n);
        });
      },
      minSeconds);
  return 2.0 * static_cast<double>(m * n * k) * threads / seconds * 1e-9;
}

std::string cpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) break;
    std::string name = line.substr(colon + 1);
    name.erase(0, name.find_first_not_of(" \t"));
    return name;
  }
  return "unknown";
}

}  // namespace fcp::kernels
