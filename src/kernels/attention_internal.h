#pragma once
// The kernels' task loops, with a switch for calibration: gemmOnly runs exactly the same tile
// products, on the same tiles, threads and order, and nothing else (no mask, softmax or
// write-back), so that its speed is the GEMM reference "on the same tile shapes".
#include "fcp/kernels/attention.h"

namespace fcp::kernels::detail {

/// forward(); returns the FLOPs of the GEMMs executed (masked tiles' waste included).
double runForward(const TensorView& q, const TensorView& k, const TensorView& v,
                  const BlockMask& mask, float* o, float* lse, const KernelOptions& options,
                  bool gemmOnly);

/// backward(); returns the FLOPs of the GEMMs executed.
double runBackward(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& dO, const float* lse, const float* delta,
                   const BlockMask& mask, float* dq, float* dk, float* dv,
                   const KernelOptions& options, bool gemmOnly);

}  // namespace fcp::kernels::detail
