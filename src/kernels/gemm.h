#pragma once
// Tile products through oneDNN. Row-major, BLAS conventions (op(A) is M x K, op(B) K x N):
// C = alpha * op(A) op(B) + beta * C. Called from inside the kernels' own parallel loop, where
// each worker has set its OpenMP thread count to 1, so oneDNN runs sequentially.
#include <cstdint>

namespace fcp::kernels::detail {

/// fp32 GEMM (dnnl_sgemm). Throws fcp::Error if oneDNN reports a failure.
void sgemm(char transA, char transB, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// bf16 x bf16 -> fp32 GEMM (dnnl_gemm_bf16bf16f32). Returns false, computing nothing, if this
/// oneDNN build cannot run it on this CPU (oneDNN 2.6 needs AVX-512 for it).
bool gemmBf16(char transA, char transB, int64_t m, int64_t n, int64_t k, float alpha,
              const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
              int64_t ldc);

/// C = alpha op(A) op(B) + beta C with A and B both bf16 (gemmBf16; the caller has checked
/// that it is supported) or both fp32 (sgemm).
void gemm(bool bf16, char transA, char transB, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
          int64_t ldc);

}  // namespace fcp::kernels::detail
