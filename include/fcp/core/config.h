#pragma once
/// The attention problem FCP parallelises: head counts, head size, element size and mask.

#include <cstdint>
#include <string>
#include <string_view>

namespace fcp {

/// Which (query, key) entries of one sequence take part in attention.
enum class MaskKind {
  kCausal,  ///< token q sees keys 0..q of its own sequence
  kFull,    ///< token q sees every key of its own sequence
};

/// "causal" / "full".
std::string_view maskName(MaskKind mask);
/// Parses "causal" or "full"; throws Error(kInvalidArgument) otherwise.
MaskKind parseMask(std::string_view text);

/// Shape of one attention layer. Defaults: Llama-3-70B attention (64 Q heads, 8 KV heads,
/// head dim 128, bf16), causal.
struct AttentionConfig {
  int64_t numHeadsQ = 64;
  int64_t numHeadsKv = 8;
  int64_t headDim = 128;
  int64_t elementBytes = 2;
  MaskKind mask = MaskKind::kCausal;

  /// Bytes one token occupies in Q (and in O, dQ, dO: same shape).
  int64_t qBytesPerToken() const { return numHeadsQ * headDim * elementBytes; }
  /// Bytes one token occupies in K (and in V, dK, dV: same shape).
  int64_t kBytesPerToken() const { return numHeadsKv * headDim * elementBytes; }
  /// Bytes of one token's K and V together: what a KV transfer moves per token.
  int64_t kvBytesPerToken() const { return 2 * kBytesPerToken(); }
  /// Bytes one token occupies in O.
  int64_t oBytesPerToken() const { return qBytesPerToken(); }

  friend bool operator==(const AttentionConfig&, const AttentionConfig&) = default;
};

/// Largest head count, head dim and element size accepted: bytes per token stay below 2^24,
/// so bytes of any batch (at most 2^32 tokens) fit in int64.
inline constexpr int64_t kMaxHeads = 1024;
inline constexpr int64_t kMaxHeadDim = 1024;
inline constexpr int64_t kMaxElementBytes = 8;

/// Throws Error(kInvalidArgument) naming the bad field unless every count is positive and at
/// most its limit above, and numHeadsQ is a multiple of numHeadsKv.
void checkAttentionConfig(const AttentionConfig& config);

/// Whether `degree` workers can each take whole heads of `attention`: degree (at least 1)
/// divides the query heads and divides or is a multiple of the key/value heads.
bool splitsHeads(const AttentionConfig& attention, int64_t degree);

/// The heads one worker of a head-parallel group of `degree` workers computes: the query heads
/// ÷ degree, and the key/value heads ÷ degree, or one when degree is a multiple of them (each
/// key/value head then replicated on degree ÷ heads workers, as DeepSpeed-Ulysses does under
/// GQA). Throws Error(kInvalidArgument) unless degree divides the query heads and divides or is
/// a multiple of the key/value heads.
AttentionConfig headShare(const AttentionConfig& attention, int64_t degree);

}  // namespace fcp
