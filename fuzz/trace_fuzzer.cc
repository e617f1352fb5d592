// Trace files (`--trace`): any bytes give a batch that checkBatch accepts, or one line.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fcp/core/workload.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const fcp::Batch batch = fcp::parseTrace(text, "fuzz.trace");
    fcp::fuzz::require(!batch.sequenceLengths.empty(), "a parsed trace has a sequence");
    fcp::checkBatch(batch);  // must not throw: parseTrace checked the same
  } catch (const fcp::Error& e) {
    fcp::fuzz::checkOneLine(e.what());
  }
  return 0;
}
