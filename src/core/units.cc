#include "fcp/core/units.h"

#include <cctype>
#include <limits>

#include "fcp/core/error.h"
#include "fcp/core/input.h"

namespace fcp {

int64_t parseTokenCount(std::string_view text, std::string_view what) {
  auto fail = [&](const char* why) {
    throwInvalidArgument("invalid ", what, " '", printable(text), "': expected ", why);
  };
  constexpr const char* kExpected = "a positive integer with an optional K, M or G suffix";
  if (text.empty()) fail(kExpected);
  int64_t multiplier = 1;
  std::string_view digits = text;
  switch (std::toupper(static_cast<unsigned char>(text.back()))) {
    case 'K':
      multiplier = int64_t{1} << 10;
      break;
    case 'M':
      multiplier = int64_t{1} << 20;
      break;
    case 'G':
      multiplier = int64_t{1} << 30;
      break;
    default:
      break;
  }
  if (multiplier != 1) digits.remove_suffix(1);
  if (digits.empty()) fail(kExpected);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') fail(kExpected);
    const int64_t digit = c - '0';
    if (value > (kMax - digit) / 10) fail("a value that fits in 64-bit token arithmetic");
    value = value * 10 + digit;
  }
  if (value > kMax / multiplier) fail("a value that fits in 64-bit token arithmetic");
  value *= multiplier;
  if (value <= 0) fail(kExpected);
  return value;
}

std::string formatTokenCount(int64_t numTokens) {
  if (numTokens > 0 && numTokens % (int64_t{1} << 30) == 0) {
    return std::to_string(numTokens >> 30) + "G";
  }
  if (numTokens > 0 && numTokens % (int64_t{1} << 20) == 0) {
    return std::to_string(numTokens >> 20) + "M";
  }
  if (numTokens > 0 && numTokens % (int64_t{1} << 10) == 0) {
    return std::to_string(numTokens >> 10) + "K";
  }
  return std::to_string(numTokens);
}

}  // namespace fcp
