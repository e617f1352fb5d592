#include "fcp/core/error.h"

#include "fcp/core/input.h"

namespace fcp {

std::string_view errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kInvalidPlan:
      return "invalid plan";
    case ErrorCode::kTransport:
      return "transport";
    case ErrorCode::kInternal:
      return "internal";
  }
  return "unknown";
}

namespace detail {
std::string oneLine(const std::string& message) {
  return printable(message, kMaxErrorMessageChars);
}
}  // namespace detail

}  // namespace fcp
