#pragma once
/// Block attention for one (Q block, KV block) pair: the forward partial, the log-space merge of
/// partials, and the FlashAttention-2 style backward.
///
/// This header is the kernel seam of FCP (DESIGN.md): plain structs and free functions, no CPU
/// types, so a CUDA implementation can sit behind the same declarations. The CPU implementation
/// dispatches at run time between an AVX-512, an AVX2 and a portable path (see cpu_dispatch.h).
///
/// Terms. A *block* is a set of tokens laid out as a tensor [tokens, heads, head_dim], row major,
/// contiguous. Each token carries a *sequence id* and a *position* inside its sequence, described
/// by *segments*: runs of consecutive tokens of one sequence with consecutive positions. A Zig-Zag
/// block is two segments of one sequence; a varlen block is one segment per packed sequence.
/// Token q sees token k iff they share a sequence id and (the mask is full or pos_k <= pos_q).
/// Scores are scaled by KernelOptions::softmaxScale, by default 1/sqrt(head_dim). GQA: Q has `g`
/// times as many heads as K and V, and Q head h reads KV head h / g.
///
/// A *partial* is (O, LSE) for one pair: O = softmax(S) V over the visible keys of that pair and
/// LSE = log(sum exp(S)) per (token, head), natural log. A row with no visible key has LSE = -inf
/// and O = 0, so that merging it changes nothing.

#include <cstdint>
#include <span>
#include <string_view>

namespace fcp::kernels {

/// Storage type of a tensor. Accumulation is always fp32.
enum class DType {
  kFp32,
  kBf16,  ///< bfloat16: the upper 16 bits of an IEEE fp32, stored as uint16_t
};

/// Name of a dtype ("fp32", "bf16").
std::string_view dtypeName(DType dtype);
/// Bytes of one element of `dtype` (4 or 2).
int64_t dtypeBytes(DType dtype);

/// A read-only tensor [numTokens, numHeads, headDim], row major and contiguous.
struct TensorView {
  const void* data = nullptr;
  int64_t numTokens = 0;
  int numHeads = 0;
  int headDim = 0;
  DType dtype = DType::kFp32;
};

/// Consecutive tokens of one sequence: the next `numTokens` tokens of the block hold positions
/// firstPosition, firstPosition + 1, ... of sequence `sequenceId`.
struct Segment {
  int64_t numTokens = 0;
  int64_t sequenceId = 0;
  int64_t firstPosition = 0;
};

/// Causal: k visible to q iff same sequence and pos_k <= pos_q. Full: iff same sequence.
enum class MaskKind { kCausal, kFull };

/// The mask of one pair. `q` and `k` list the segments of the Q and KV blocks in token order;
/// their numTokens must add up to the blocks' token counts. The spans must outlive the call.
struct BlockMask {
  MaskKind kind = MaskKind::kCausal;
  std::span<const Segment> q;
  std::span<const Segment> k;
};

/// Execution settings of the CPU kernels.
struct KernelOptions {
  /// Worker threads; 0 means all the threads OpenMP would use (omp_get_max_threads()).
  int numThreads = 0;
  /// The scale of Q Kᵀ before the softmax; 0 means 1/sqrt(head_dim). Forward and backward of a
  /// pair must use the same. Finite and not negative (softmaxScaleOf).
  float softmaxScale = 0;
};

/// The scale KernelOptions::softmaxScale asks for with head dim `headDim`; throws
/// Error(kInvalidArgument) naming the value when it is negative, infinite or NaN.
float softmaxScaleOf(const KernelOptions& options, int headDim);

/// Number of visible (q, k) token pairs of `mask` (per head). Useful forward FLOPs of a pair are
/// 4 * visiblePairs * numHeadsQ * headDim; the backward counts 2.5 times that (DESIGN.md).
int64_t countVisiblePairs(const BlockMask& mask);

/// Forward partial of one pair. `q` is [Nq, Hq, d], `k` and `v` are [Nk, Hkv, d] with Hq a
/// multiple of Hkv; q, k, v share one dtype. Writes every element of `o` ([Nq, Hq, d], fp32) and
/// `lse` ([Nq, Hq], fp32, natural log). Throws fcp::Error on inconsistent shapes or masks.
void forward(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
             float* o, float* lse, const KernelOptions& options = {});

/// Merges a partial (o, lse) into an accumulator (accO, accLse) in log space, in place:
/// acc <- (acc, part) combined as if one pass had covered both key sets. Exact up to rounding,
/// order-independent, safe for -inf (an empty partial changes nothing). Shapes [numTokens,
/// numHeads, headDim] and [numTokens, numHeads].
void mergePartials(int64_t numTokens, int numHeads, int headDim, float* accO, float* accLse,
                   const float* o, const float* lse);

/// D = rowsum(dO * O) per (token, head), computed once per Q block before its backward pairs.
/// `o` and `dO` are [Nq, Hq, d] (either dtype); writes `delta` [Nq, Hq] fp32.
void computeDelta(const TensorView& o, const TensorView& dO, float* delta);

/// Backward of one pair, FlashAttention-2 style (recomputes P from Q, K and the final LSE).
/// `lse` and `delta` are the *final* values of the Q block (after merging every pair), so that
/// per-pair gradients add up to the full gradient. Accumulates (+=) into dq [Nq, Hq, d],
/// dk [Nk, Hkv, d] and dv [Nk, Hkv, d], all fp32. `dO` has the shape of q (either dtype).
void backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& dO,
              const float* lse, const float* delta, const BlockMask& mask, float* dq, float* dk,
              float* dv, const KernelOptions& options = {});

/// Rounds fp32 to bf16 (round to nearest even), for callers preparing bf16 inputs.
uint16_t toBf16(float value);
/// Widens bf16 to fp32 (exact).
float fromBf16(uint16_t value);
/// The same for arrays of equal length (the CPU's fastest path; throws on a length mismatch).
void toBf16(std::span<const float> in, std::span<uint16_t> out);
void fromBf16(std::span<const uint16_t> in, std::span<float> out);

}  // namespace fcp::kernels
