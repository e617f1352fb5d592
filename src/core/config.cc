#include "fcp/core/config.h"

#include <algorithm>

#include "fcp/core/error.h"

namespace fcp {

std::string_view maskName(MaskKind mask) {
  return mask == MaskKind::kCausal ? "causal" : "full";
}

MaskKind parseMask(std::string_view text) {
  if (text == "causal") return MaskKind::kCausal;
  if (text == "full") return MaskKind::kFull;
  throwInvalidArgument("unknown mask '", text, "': expected causal or full");
}

void checkAttentionConfig(const AttentionConfig& config) {
  auto positive = [](int64_t value, const char* name) {
    if (value <= 0) throwInvalidArgument("invalid ", name, " ", value, ": expected a positive integer");
  };
  positive(config.numHeadsQ, "Q head count");
  positive(config.numHeadsKv, "KV head count");
  positive(config.headDim, "head dim");
  positive(config.elementBytes, "element bytes");
  // Bounds that keep bytes per token times any batch (2^32 tokens) inside int64.
  auto atMost = [](int64_t value, int64_t limit, const char* name) {
    if (value > limit) throwInvalidArgument("invalid ", name, " ", value, ": expected at most ", limit);
  };
  atMost(config.numHeadsQ, kMaxHeads, "Q head count");
  atMost(config.numHeadsKv, kMaxHeads, "KV head count");
  atMost(config.headDim, kMaxHeadDim, "head dim");
  atMost(config.elementBytes, kMaxElementBytes, "element bytes");
  if (config.numHeadsQ % config.numHeadsKv != 0) {
    throwInvalidArgument("invalid head counts: ", config.numHeadsQ, " Q heads is not a multiple of ",
                         config.numHeadsKv, " KV heads");
  }
}

bool splitsHeads(const AttentionConfig& attention, int64_t degree) {
  const int64_t hq = attention.numHeadsQ, hkv = attention.numHeadsKv;
  return degree >= 1 && hq % degree == 0 && (hkv % degree == 0 || degree % hkv == 0);
}

AttentionConfig headShare(const AttentionConfig& attention, int64_t degree) {
  const int64_t hq = attention.numHeadsQ, hkv = attention.numHeadsKv;
  if (!splitsHeads(attention, degree)) {
    throwInvalidArgument("head-parallel degree ", degree, " with ", hq, " query and ", hkv,
                         " key/value heads: expected a divisor of the query heads that divides "
                         "the key/value heads or is a multiple of them");
  }
  AttentionConfig share = attention;
  share.numHeadsQ = hq / degree;
  share.numHeadsKv = std::max<int64_t>(hkv / degree, 1);
  return share;
}

}  // namespace fcp
