// Saved plans (`--plan-in`): any bytes give a plan or one line; a plan that validate accepts
// has pair costs validateCosts can check, and writes back to the same JSON it reads as.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fcp/core/cost_model.h"
#include "fcp/plan/json.h"
#include "fcp/plan/plan.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const fcp::plan::Plan plan = fcp::plan::planFromJson(text);
    if (!fcp::plan::validate(plan).empty()) return 0;
    fcp::CostModel costModel;
    costModel.attention = plan.config.attention;
    (void)fcp::plan::validateCosts(plan, costModel);
    const std::string once = fcp::plan::planToJson(plan);
    const std::string twice = fcp::plan::planToJson(fcp::plan::planFromJson(once));
    fcp::fuzz::require(once == twice, "a valid plan's JSON reads back to the same JSON");
  } catch (const fcp::Error& e) {
    fcp::fuzz::checkOneLine(e.what());
  }
  return 0;
}
