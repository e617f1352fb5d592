#pragma once
// The message of the fcp::Error a call throws, for tests of one-line errors.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "fcp/core/error.h"

namespace fcp::testing {

/// Runs `f`; returns the message of the Error it throws (which must have code `code`), or
/// records a failure and returns "" when it throws none.
inline std::string errorOf(const std::function<void()>& f,
                           ErrorCode code = ErrorCode::kInvalidArgument) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

}  // namespace fcp::testing
