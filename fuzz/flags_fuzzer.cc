// The command line's numeric flags, through the same CLI11 options `fcp` builds
// (apps/fcp/common.h), and the token counts (fcp/core/units.h): any value either lands inside
// the flag's range, exactly as written, or is refused with one line; never a silent fix.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../apps/fcp/common.h"
#include "fcp/core/input.h"
#include "fcp/core/units.h"
#include "fuzz_check.h"

namespace {

using fcp::fuzz::require;

// Parses `--flag value` with the option `add` installs; returns false when refused.
template <typename Add>
bool parseFlag(const std::string& value, Add add) {
  CLI::App app("fuzz");
  add(&app);
  std::vector<std::string> args = {value, "--flag"};  // CLI11 takes them in reverse order
  try {
    app.parse(args);
    return true;
  } catch (const fcp::Error& e) {
    fcp::fuzz::checkOneLine(e.what());
  } catch (const CLI::ParseError&) {
    // CLI11's own refusals (a value that looks like a flag, say); fcp prints them itself.
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte picks the ranges, the rest is the value as typed.
  const uint8_t pick = data[0];
  const std::string value(reinterpret_cast<const char*>(data + 1), size - 1);
  const int64_t min = (pick & 1) ? 1 : -1000;
  const int64_t max = (pick & 2) ? int64_t{1} << 20 : INT64_MAX;

  int64_t integer = 7;
  if (parseFlag(value, [&](CLI::App* app) {
        fcp::app::addInteger(app, "--flag", integer, min, max, "");
      })) {
    require(integer >= min && integer <= max, "integer in range");
    require(std::to_string(integer) == value || value.find_first_not_of("-0123456789") == std::string::npos,
            "an integer flag takes only decimal digits");
  }
  std::vector<int64_t> list = {1};
  if (parseFlag(value, [&](CLI::App* app) {
        fcp::app::addIntegerList(app, "--flag", list, min, max, "");
      })) {
    require(!list.empty(), "a list flag has an item");
    size_t commas = 0;
    for (char c : value) commas += c == ',';
    require(list.size() == commas + 1, "one item per comma-separated field");
    for (int64_t v : list) require(v >= min && v <= max, "list item in range");
  }
  uint64_t unsignedValue = 7;
  const uint64_t umax = (pick & 4) ? 1000 : UINT64_MAX;
  if (parseFlag(value, [&](CLI::App* app) {
        fcp::app::addUnsigned(app, "--flag", unsignedValue, umax, "");
      })) {
    require(unsignedValue <= umax, "unsigned in range");
    require(value.find('-') == std::string::npos, "an unsigned flag has no minus sign");
  }
  double number = 7;
  const double dmin = (pick & 8) ? 0.0 : -1e300;
  const double dmax = (pick & 16) ? 1e5 : 1e300;
  if (parseFlag(value, [&](CLI::App* app) {
        fcp::app::addNumber(app, "--flag", number, dmin, dmax, "");
      })) {
    require(std::isfinite(number) && number >= dmin && number <= dmax, "number finite, in range");
  }
  try {
    const int64_t tokens = fcp::parseTokenCount(value, "--tokens");
    require(tokens > 0, "a token count is positive");
  } catch (const fcp::Error& e) {
    fcp::fuzz::checkOneLine(e.what());
  }
  return 0;
}
