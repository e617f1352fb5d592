// Hardware profiles (`--hardware FILE`) and efficiency curves (`--curve FILE`): any bytes give
// a profile or curves with every fraction in (0, 1], or one line.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fcp/sim/hardware.h"
#include "fuzz_check.h"

namespace {

void checkCurve(const fcp::EfficiencyCurve& curve) {
  for (int64_t tokens : {int64_t{1}, int64_t{512}, int64_t{4096}, int64_t{1} << 40}) {
    const double f = curve.at(tokens);
    fcp::fuzz::require(std::isfinite(f) && f > 0 && f <= 1, "efficiency in (0, 1]");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const fcp::sim::HardwareProfile h = fcp::sim::parseHardwareProfile(text, "fuzz.json");
    checkCurve(h.forward);
    checkCurve(h.backward);
  } catch (const fcp::Error& e) {
    fcp::fuzz::checkOneLine(e.what());
  }
  try {
    const auto [forward, backward] = fcp::sim::parseEfficiencyCurves(text, "fuzz.json");
    checkCurve(forward);
    checkCurve(backward);
  } catch (const fcp::Error& e) {
    fcp::fuzz::checkOneLine(e.what());
  }
  return 0;
}
