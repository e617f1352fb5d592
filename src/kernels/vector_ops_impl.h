// One body of the kernels' vector code, included by vector_ops_{portable,avx2,avx512}.cc, each
// compiled with its own target flags and defining FCP_VECTOR_OPS_NAME (the getter it exports).
// The loops are branch-free inside and carry `omp simd` so that the compiler vectorises the
// reductions (float max and sum are not associative, so it would not do so on its own).
//
// exp2 is computed as 2^n * p(f), n = round(x), f = x - n in [-0.5, 0.5], p the degree-6 Taylor
// polynomial of 2^f (relative error below 1.3e-7, under fp32 rounding of the sums it feeds).
// Inputs below -127 give exactly 0 (masked scores are -inf), so no select is needed.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vector_ops.h"

#ifndef FCP_VECTOR_OPS_NAME
#error "define FCP_VECTOR_OPS_NAME before including vector_ops_impl.h"
#endif

namespace fcp::kernels::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp declare simd
inline float exp2Poly(float x) {
  x = x < -127.0f ? -127.0f : x;
  x = x > 127.0f ? 127.0f : x;
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer (|x| <= 127).
  const float n = (x + 12582912.0f) - 12582912.0f;
  const float f = x - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  // n = -127 gives the bit pattern 0, i.e. exactly 0.
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

void softmaxStep(float* s, int64_t rows, int64_t cols, int64_t ld, float* rowMax, float* rowSum,
                 float* correction) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    float tileMax = kNegInf;
#pragma omp simd reduction(max : tileMax)
    for (int64_t c = 0; c < cols; ++c) tileMax = row[c] > tileMax ? row[c] : tileMax;
    const float oldMax = rowMax[r];
    const float newMax = tileMax > oldMax ? tileMax : oldMax;
    if (newMax == kNegInf) {
      // Nothing visible so far: exp2(-inf - -inf) would be NaN.
      for (int64_t c = 0; c < cols; ++c) row[c] = 0.0f;
      correction[r] = 1.0f;
      continue;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < cols; ++c) {
      const float p = exp2Poly(row[c] - newMax);
      row[c] = p;
      sum += p;
    }
    const float corr = oldMax == kNegInf ? 0.0f : std::exp2(oldMax - newMax);
    correction[r] = corr;
    rowSum[r] = rowSum[r] * corr + sum;
    rowMax[r] = newMax;
  }
}

void probabilities(float* s, int64_t rows, int64_t cols, int64_t ld, const float* lse2) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const float l = lse2[r];
    if (l == kNegInf) {
      // The row sees no key anywhere: P = 0 (exp2(s - -inf) would be inf or NaN).
      for (int64_t c = 0; c < cols; ++c) row[c] = 0.0f;
      continue;
    }
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) row[c] = exp2Poly(row[c] - l);
  }
}

void scoreGradients(const float* p, float* dp, int64_t rows, int64_t cols, int64_t ld,
                    const float* delta) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* pr = p + r * ld;
    float* dr = dp + r * ld;
    const float dl = delta[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) dr[c] = pr[c] * (dr[c] - dl);
  }
}

void scaleRows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* factor) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * ld;
    const float f = factor[r];
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) row[c] *= f;
  }
}

void maskRow(float* s, int64_t cols, int64_t seqQ, int64_t posQ, const int64_t* seqK,
             const int64_t* posK, bool causal) {
  if (causal) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
      s[c] = (seqK[c] == seqQ && posK[c] <= posQ) ? s[c] : kNegInf;
  } else {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) s[c] = seqK[c] == seqQ ? s[c] : kNegInf;
  }
}

void bf16ToFp32(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
}

void fp32ToBf16(const float* src, uint16_t* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(src[i]);
    const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    // NaN stays NaN (quiet bit set) instead of rounding into infinity.
    const bool isNan = (bits & 0x7fffffffu) > 0x7f800000u;
    dst[i] = static_cast<uint16_t>(isNan ? ((bits >> 16) | 0x40u) : (rounded >> 16));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpby(float alpha, float* y, float beta, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = alpha * y[i] + beta * x[i];
}

void add(float* y, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

constexpr VectorOps kOps = {softmaxStep, probabilities, scoreGradients, scaleRows, maskRow,
                            bf16ToFp32,  fp32ToBf16,    dot,            axpby,     add};

}  // namespace

const VectorOps& FCP_VECTOR_OPS_NAME() { return kOps; }

}  // namespace fcp::kernels::detail
