#include "fcp/core/error.h"

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

}  // namespace fcp
