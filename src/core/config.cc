#include "fcp/core/config.h"

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
  if (config.numHeadsQ % config.numHeadsKv != 0) {
    throwInvalidArgument("invalid head counts: ", config.numHeadsQ, " Q heads is not a multiple of ",
                         config.numHeadsKv, " KV heads");
  }
}

}  // namespace fcp
