#include "gemm.h"

#include <oneapi/dnnl/dnnl.h>

#include "fcp/core/error.h"

// Exported by libdnnl (2.x) but not declared in its public header: row-major bf16 GEMM with
// fp32 output, the same conventions as dnnl_sgemm.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
                                               dnnl_dim_t N, dnnl_dim_t K, float alpha,
                                               const uint16_t* A, dnnl_dim_t lda,
                                               const uint16_t* B, dnnl_dim_t ldb, float beta,
                                               float* C, dnnl_dim_t ldc);

namespace fcp::kernels::detail {

void sgemm(char transA, char transB, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t status =
      dnnl_sgemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  FCP_CHECK(status == dnnl_success, "dnnl_sgemm failed with status ", static_cast<int>(status),
            " for m=", m, " n=", n, " k=", k);
}

bool gemmBf16(char transA, char transB, int64_t m, int64_t n, int64_t k, float alpha,
              const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
              int64_t ldc) {
  const dnnl_status_t status =
      dnnl_gemm_bf16bf16f32(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (status == dnnl_unimplemented) return false;
  FCP_CHECK(status == dnnl_success, "dnnl_gemm_bf16bf16f32 failed with status ",
            static_cast<int>(status), " for m=", m, " n=", n, " k=", k);
  return true;
}

bool bf16GemmAvailable() {
  static const bool available = [] {
    const uint16_t one = 0x3f80;
    float c = 0.0f;
    return gemmBf16('N', 'N', 1, 1, 1, 1.0f, &one, 1, &one, 1, 0.0f, &c, 1);
  }();
  return available;
}

}  // namespace fcp::kernels::detail
