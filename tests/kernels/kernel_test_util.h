#pragma once
// Shared pieces of the kernel tests: inputs, masks, and the float64 reference the kernels are
// checked against. The reference is the definition, written for clarity: for every query row,
// scores over the visible keys, a max-shifted softmax, then O, LSE and the gradients.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../test_seed.h"
#include "fcp/kernels/attention.h"
#include "fcp/kernels/cpu_dispatch.h"

namespace fcp::kernels::testing {

using fcp::testing::testSeed;

/// The bf16 GEMM paths a test of `dtype` runs: for bf16, the widened (fp32 sgemm) path always
/// and oneDNN's bf16 GEMM where this CPU runs it; for fp32, just kAuto (the setting is unused).
inline std::vector<Bf16Gemm> bf16GemmsFor(DType dtype) {
  if (dtype != DType::kBf16) return {Bf16Gemm::kAuto};
  if (bf16GemmSupported()) return {Bf16Gemm::kWiden, Bf16Gemm::kNative};
  return {Bf16Gemm::kWiden};
}

/// A host tensor [tokens, heads, dim] in fp32 with an optional bf16 copy.
struct HostTensor {
  int64_t tokens = 0;
  int heads = 0;
  int dim = 0;
  std::vector<float> f32;
  std::vector<uint16_t> bf16;

  HostTensor() = default;
  HostTensor(int64_t t, int h, int d) : tokens(t), heads(h), dim(d), f32(t * h * d) {}

  void randomize(std::mt19937_64& rng, float scale = 1.0f) {
    std::normal_distribution<float> dist(0.0f, scale);
    for (float& x : f32) x = dist(rng);
    bf16.resize(f32.size());
    for (size_t i = 0; i < f32.size(); ++i) bf16[i] = toBf16(f32[i]);
  }
  /// The values the kernel sees for `dtype` (bf16 rounds them), as float64.
  std::vector<double> asDouble(DType dtype) const {
    std::vector<double> out(f32.size());
    for (size_t i = 0; i < f32.size(); ++i)
      out[i] = dtype == DType::kBf16 ? fromBf16(bf16[i]) : f32[i];
    return out;
  }
  TensorView view(DType dtype) const {
    const void* data = dtype == DType::kBf16 ? static_cast<const void*>(bf16.data())
                                             : static_cast<const void*>(f32.data());
    return {data, tokens, heads, dim, dtype};
  }
};

/// Per-token sequence id and position, as the reference reads them.
struct Tokens {
  std::vector<int64_t> seq, pos;
};

inline Tokens expand(const std::vector<Segment>& segments) {
  Tokens t;
  for (const Segment& s : segments)
    for (int64_t i = 0; i < s.numTokens; ++i) {
      t.seq.push_back(s.sequenceId);
      t.pos.push_back(s.firstPosition + i);
    }
  return t;
}

/// Segments of tokens [begin, end) of a block described by `segments`.
inline std::vector<Segment> sliceSegments(const std::vector<Segment>& segments, int64_t begin,
                                          int64_t end) {
  std::vector<Segment> out;
  int64_t at = 0;
  for (const Segment& s : segments) {
    const int64_t lo = std::max(begin, at), hi = std::min(end, at + s.numTokens);
    if (lo < hi) out.push_back({hi - lo, s.sequenceId, s.firstPosition + (lo - at)});
    at += s.numTokens;
  }
  return out;
}

struct Reference {
  std::vector<double> o, lse;       // [Nq][Hq][d], [Nq][Hq]
  std::vector<double> dq, dk, dv;   // filled by referenceBackward
};

inline bool refVisible(const Tokens& q, int64_t i, const Tokens& k, int64_t j, bool causal) {
  return q.seq[i] == k.seq[j] && (!causal || k.pos[j] <= q.pos[i]);
}

/// Forward reference for the query tokens in `rows` (all if empty); other rows stay NaN.
/// Scores are scaled by `softmaxScale`, 0 meaning 1/sqrt(d).
inline Reference referenceForward(const std::vector<double>& q, const std::vector<double>& k,
                                  const std::vector<double>& v, int64_t nq, int64_t nk, int hq,
                                  int hkv, int d, const Tokens& qt, const Tokens& kt, bool causal,
                                  std::vector<int64_t> rows = {}, double softmaxScale = 0) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Reference ref;
  ref.o.assign(nq * hq * d, nan);
  ref.lse.assign(nq * hq, nan);
  if (rows.empty())
    for (int64_t i = 0; i < nq; ++i) rows.push_back(i);
  const double scale = softmaxScale > 0 ? softmaxScale : 1.0 / std::sqrt(static_cast<double>(d));
  const int g = hq / hkv;
  std::vector<double> s(nk);
  for (int64_t i : rows) {
    for (int h = 0; h < hq; ++h) {
      const int kh = h / g;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < nk; ++j) {
        if (!refVisible(qt, i, kt, j, causal)) continue;
        double dotv = 0;
        for (int c = 0; c < d; ++c) dotv += q[(i * hq + h) * d + c] * k[(j * hkv + kh) * d + c];
        s[j] = dotv * scale;
        m = std::max(m, s[j]);
      }
      double* o = &ref.o[(i * hq + h) * d];
      for (int c = 0; c < d; ++c) o[c] = 0;
      if (m == -std::numeric_limits<double>::infinity()) {
        ref.lse[i * hq + h] = m;
        continue;
      }
      double sum = 0;
      for (int64_t j = 0; j < nk; ++j) {
        if (!refVisible(qt, i, kt, j, causal)) continue;
        const double p = std::exp(s[j] - m);
        sum += p;
        for (int c = 0; c < d; ++c) o[c] += p * v[(j * hkv + kh) * d + c];
      }
      for (int c = 0; c < d; ++c) o[c] /= sum;
      ref.lse[i * hq + h] = m + std::log(sum);
    }
  }
  return ref;
}

/// Full forward and backward reference for upstream gradient dO.
inline Reference referenceBackward(const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, const std::vector<double>& dO,
                                   int64_t nq, int64_t nk, int hq, int hkv, int d, const Tokens& qt,
                                   const Tokens& kt, bool causal, double softmaxScale = 0) {
  Reference ref = referenceForward(q, k, v, nq, nk, hq, hkv, d, qt, kt, causal, {}, softmaxScale);
  ref.dq.assign(nq * hq * d, 0);
  ref.dk.assign(nk * hkv * d, 0);
  ref.dv.assign(nk * hkv * d, 0);
  const double scale = softmaxScale > 0 ? softmaxScale : 1.0 / std::sqrt(static_cast<double>(d));
  const int g = hq / hkv;
  for (int64_t i = 0; i < nq; ++i) {
    for (int h = 0; h < hq; ++h) {
      const double l = ref.lse[i * hq + h];
      if (std::isinf(l)) continue;
      const int kh = h / g;
      const double* qi = &q[(i * hq + h) * d];
      const double* doi = &dO[(i * hq + h) * d];
      const double* oi = &ref.o[(i * hq + h) * d];
      double delta = 0;
      for (int c = 0; c < d; ++c) delta += doi[c] * oi[c];
      for (int64_t j = 0; j < nk; ++j) {
        if (!refVisible(qt, i, kt, j, causal)) continue;
        const double* kj = &k[(j * hkv + kh) * d];
        const double* vj = &v[(j * hkv + kh) * d];
        double sdot = 0, dp = 0;
        for (int c = 0; c < d; ++c) {
          sdot += qi[c] * kj[c];
          dp += doi[c] * vj[c];
        }
        const double p = std::exp(sdot * scale - l);
        const double ds = p * (dp - delta) * scale;
        double* dqi = &ref.dq[(i * hq + h) * d];
        double* dkj = &ref.dk[(j * hkv + kh) * d];
        double* dvj = &ref.dv[(j * hkv + kh) * d];
        for (int c = 0; c < d; ++c) {
          dqi[c] += ds * kj[c];
          dkj[c] += ds * qi[c];
          dvj[c] += p * doi[c];
        }
      }
    }
  }
  return ref;
}

/// ||a - b|| / ||b|| over the elements where b is finite; NaN if a has a NaN or inf there, or
/// if a is not -inf exactly where b is. `stride`/`rows` restrict to sampled rows when given.
inline double relativeL2(const float* a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (std::isnan(b[i])) continue;  // row not sampled by the reference
    if (std::isinf(b[i])) {
      if (a[i] != static_cast<float>(b[i])) return std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (den == 0) return num == 0 ? 0.0 : std::sqrt(num);
  return std::sqrt(num / den);
}

}  // namespace fcp::kernels::testing
