#pragma once
// The kernels' own vector code (everything but the tile products), as a table of functions.
// The same source (vector_ops_impl.h) is compiled once per instruction set, each in its own TU
// with its own target flags; cpu_dispatch.cc picks the table at run time. Nothing here names an
// intrinsic: the loops are written so that the compiler vectorises them for each target.
//
// Terms: a *row* is one (token, head) of a tile; `cols` is the number of keys in the tile, `ld`
// the distance between rows. Scores are in the log2 domain (already multiplied by
// log2(e) times the softmax scale), so every exponential is an exp2.

#include <cstdint>

#include "fcp/kernels/cpu_dispatch.h"

namespace fcp::kernels::detail {

struct VectorOps {
  /// Online-softmax step on `rows` rows of scores s (in place: s becomes exp2(s - newRef)).
  /// rowMax/rowSum carry a running *reference* max and the sum of exp2(s - ref): the reference
  /// is the first finite max and moves to a tile's max only when that exceeds it by more than a
  /// slack of 8, so it may lie below the true max (by at most 8) and LSE2 = ref + log2(sum)
  /// still holds. correction receives exp2(oldRef - newRef), the factor by which the caller
  /// must scale its output accumulator: exactly 1 when the reference did not move. A row whose
  /// reference stays -inf (nothing visible yet) gets s = 0, correction = 1.
  void (*softmaxStep)(float* s, int64_t rows, int64_t cols, int64_t ld, float* rowMax,
                      float* rowSum, float* correction);
  /// Backward probabilities: s <- exp2(s - lse2[r]) per row r; a row with lse2 = -inf becomes 0.
  void (*probabilities)(float* s, int64_t rows, int64_t cols, int64_t ld, const float* lse2);
  /// dS = P * (dP - delta[r]), written over dp.
  void (*scoreGradients)(const float* p, float* dp, int64_t rows, int64_t cols, int64_t ld,
                         const float* delta);
  /// x[r][c] *= factor[r] for `cols` columns (rows with factor 1 are not touched).
  void (*scaleRows)(float* x, int64_t rows, int64_t cols, int64_t ld, const float* factor);
  /// s[c] <- -inf where key c is invisible to a query of sequence seqQ at position posQ.
  void (*maskRow)(float* s, int64_t cols, int64_t seqQ, int64_t posQ, const int64_t* seqK,
                  const int64_t* posK, bool causal);
  /// dst[i] = float(src[i]) for bf16 src.
  void (*bf16ToFp32)(const uint16_t* src, float* dst, int64_t n);
  /// dst[i] = bf16(src[i]), round to nearest even.
  void (*fp32ToBf16)(const float* src, uint16_t* dst, int64_t n);
  /// sum of a[i] * b[i].
  float (*dot)(const float* a, const float* b, int64_t n);
  /// y[i] = alpha * y[i] + beta * x[i].
  void (*axpby)(float alpha, float* y, float beta, const float* x, int64_t n);
  /// y[i] += x[i].
  void (*add)(float* y, const float* x, int64_t n);
};

const VectorOps& vectorOpsPortable();
const VectorOps& vectorOpsAvx2();
const VectorOps& vectorOpsAvx512();

/// The table of the active path (cpu_dispatch.cc).
const VectorOps& vectorOps();

}  // namespace fcp::kernels::detail
