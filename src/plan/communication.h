#pragma once
// Private to the plan module: validate()'s communication half.

#include "fcp/plan/communication.h"
#include "violations.h"

namespace fcp::plan::detail {

/// Appends the communication invariants' violations (see validate).
void validateCommunication(const Plan& plan, Violations& v);

}  // namespace fcp::plan::detail
