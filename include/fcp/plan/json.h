#pragma once
/// A Plan as JSON, out and back in. The text is canonical: the same plan always gives the same
/// bytes, so plans can be compared (and digested) as text.

#include <cstdint>
#include <string>
#include <string_view>

#include "fcp/plan/plan.h"

namespace fcp::plan {

/// The whole plan as one JSON document (compact, no whitespace).
std::string planToJson(const Plan& plan);

/// A 64-bit digest of everything planToJson writes, without writing it (at 4096 workers the
/// JSON is some 80 MB and takes most of a second to build): two plans with the same JSON (and
/// finite doubles) have the same digest, and any change to what the JSON says changes it but
/// for hash collisions. The same on every machine (fixed-width words, doubles by their bits).
/// The ranks compare its top 63 bits (runtime::checkPlanAgreement), which `fcp plan` prints.
uint64_t planDigest(const Plan& plan);

/// Parses planToJson's output. Throws Error(kInvalidArgument) naming the field that is
/// missing or of the wrong type. Does not validate the invariants: call `validate`.
Plan planFromJson(std::string_view text);

}  // namespace fcp::plan
