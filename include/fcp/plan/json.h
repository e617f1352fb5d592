#pragma once
/// A Plan as JSON, out and back in. The text is canonical: the same plan always gives the same
/// bytes, so plans can be compared (and digested) as text.

#include <string>
#include <string_view>

#include "fcp/plan/plan.h"

namespace fcp::plan {

/// The whole plan as one JSON document (compact, no whitespace).
std::string planToJson(const Plan& plan);

/// Parses planToJson's output. Throws Error(kInvalidArgument) naming the field that is
/// missing or of the wrong type. Does not validate the invariants: call `validate`.
Plan planFromJson(std::string_view text);

}  // namespace fcp::plan
