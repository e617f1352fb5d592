// One body of the kernels' vector code, included by vector_ops_{portable,avx2,avx512}.cc, each
// compiled with its own target flags and defining FCP_VECTOR_OPS_NAME (the getter it exports).
// The exponentials use explicit vector types; the simple loops carry `omp simd` so that the
// compiler vectorises them (and their reductions, which it would not reorder on its own).
//
// exp2 is computed as 2^n * p(f), n = round(x), f = x - n in [-0.5, 0.5], p a degree-5 minimax
// polynomial of 2^f (relative error 1.0e-7, 1.8e-7 with fp32 evaluation: as good as the degree-6
// Taylor polynomial it replaced, one FMA shorter). Inputs below -127 give exactly 0 (masked
// scores are -inf), so no select is needed; inputs must not exceed 127 (the callers' are at most
// kRescaleSlack: scores minus a reference max, or minus the row's LSE).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>

#include "vector_ops.h"

#ifndef FCP_VECTOR_OPS_NAME
#error "define FCP_VECTOR_OPS_NAME before including vector_ops_impl.h"
#endif

namespace fcp::kernels::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// How far (log2 units) a row's scores may exceed the online softmax's reference max before the
// reference moves: probabilities up to 2^8 lose nothing in fp32 and cannot overflow its sums.
constexpr float kRescaleSlack = 8.0f;

// One SIMD register of floats (GCC/Clang vector extensions): FCP_VECTOR_BYTES is set per TU
// (16 portable, 32 AVX2, 64 AVX-512), and the compiler lowers the operators to that target.
// `omp simd` alone did not vectorise exp2 (GCC 12 kept the clamps as branches).
#ifndef FCP_VECTOR_BYTES
#define FCP_VECTOR_BYTES 16
#endif
constexpr int64_t kLanes = FCP_VECTOR_BYTES / 4;
typedef float VecF __attribute__((vector_size(FCP_VECTOR_BYTES)));
typedef int32_t VecI __attribute__((vector_size(FCP_VECTOR_BYTES)));

inline VecF load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }
inline VecF splat(float x) { return VecF{} + x; }
inline VecF vmax(VecF a, VecF b) { return a > b ? a : b; }

// The polynomial in f of 2^f; shared by the vector and the scalar (tail) exp2. Coefficients: a
// relative-error minimax fit on [-0.5, 0.5] with p(0) = 1.
template <typename T>
inline T exp2Poly(T f) {
  T p = f * 1.3292919704571901e-3f + 9.6715090406901270e-3f;
  p = p * f + 5.5506369048530124e-2f;
  p = p * f + 2.4022242186264003e-1f;
  p = p * f + 6.9314705080549180e-1f;
  return p * f + 1.0f;
}

// x + kRoundBias (1.5 * 2^23 + 127) rounds x + 127 to the integer m = n + 127 held in the low
// mantissa bits (x in [-127, 127]), so the bits of that sum shifted left by 23 are the fp32
// 2^n directly (n = -127 gives 0.0); no float-to-int conversion is needed.
constexpr float kRoundBias = 12583039.0f;

inline VecF exp2v(VecF x) {
  x = vmax(x, splat(-127.0f));
  const VecF t = x + kRoundBias;
  const VecF n = t - kRoundBias;
  const VecI bits = std::bit_cast<VecI>(t) << 23;
  return exp2Poly(x - n) * std::bit_cast<VecF>(bits);
}

inline float exp2s(float x) {
  x = std::max(x, -127.0f);
  const float t = x + kRoundBias;
  const float n = t - kRoundBias;
  const uint32_t bits = std::bit_cast<uint32_t>(t) << 23;
  return exp2Poly(x - n) * std::bit_cast<float>(bits);
}

float rowMaxOf(const float* row, int64_t cols) {
  int64_t c = 0;
  float best = kNegInf;
  if (cols >= kLanes) {
    VecF m = load(row);
    for (c = kLanes; c + kLanes <= cols; c += kLanes) m = vmax(m, load(row + c));
    for (int64_t l = 0; l < kLanes; ++l) best = std::max(best, m[l]);
  }
  for (; c < cols; ++c) best = std::max(best, row[c]);
  return best;
}

// row[c] = exp2(row[c] - shift); returns the sum.
float expShiftedRow(float* row, int64_t cols, float shift) {
  const VecF vs = splat(shift);
  VecF acc = splat(0.0f);
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes) {
    const VecF p = exp2v(load(row + c) - vs);
    store(row + c, p);
    acc += p;
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  for (; c < cols; ++c) {
    row[c] = exp2s(row[c] - shift);
    sum += row[c];
  }
  return sum;
}

void softmaxStep(float* s, int64_t rows, int64_t cols, int64_t ld, float* rowMax, float* rowSum,
                 float* correction) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const float tileMax = rowMaxOf(row, cols);
    const float oldMax = rowMax[r];
    if (tileMax == kNegInf && oldMax == kNegInf) {
      // Nothing visible so far: exp2(-inf - -inf) would be NaN.
      std::fill_n(row, cols, 0.0f);
      correction[r] = 1.0f;
      continue;
    }
    // The reference max moves only when this tile exceeds it by more than the slack (always
    // when it was -inf): exp2(s - ref) stays below 2^kRescaleSlack, and most steps leave the
    // accumulator unscaled (correction exactly 1).
    const float newMax = tileMax > oldMax + kRescaleSlack ? tileMax : oldMax;
    const float sum = expShiftedRow(row, cols, newMax);
    const float corr = newMax == oldMax     ? 1.0f
                       : oldMax == kNegInf ? 0.0f
                                           : std::exp2(oldMax - newMax);
    correction[r] = corr;
    rowSum[r] = rowSum[r] * corr + sum;
    rowMax[r] = newMax;
  }
}

void probabilities(float* s, int64_t rows, int64_t cols, int64_t ld, const float* lse2) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    if (lse2[r] == kNegInf) {
      // The row sees no key anywhere: P = 0 (exp2(s - -inf) would be inf or NaN).
      std::fill_n(row, cols, 0.0f);
      continue;
    }
    expShiftedRow(row, cols, lse2[r]);
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
    if (f == 1.0f) continue;
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
