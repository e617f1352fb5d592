#pragma once
// What every fuzz target asserts about a parser's failure: it throws fcp::Error (anything
// else escapes LLVMFuzzerTestOneInput and the fuzzer reports it as a crash) whose message is
// one printable line, because FCP prints it as the whole of its error output.

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "fcp/core/error.h"

namespace fcp::fuzz {

/// Aborts (a crash the fuzzer keeps) unless `message` is a non-empty line of printable text:
/// no byte below 0x20, no DEL.
inline void checkOneLine(std::string_view message) {
  bool ok = !message.empty();
  for (unsigned char c : message) ok = ok && c >= 0x20 && c != 0x7f;
  if (!ok) {
    std::fprintf(stderr, "error message is not one printable line (%zu bytes)\n", message.size());
    std::abort();
  }
}

/// Aborts when `condition` is false, naming what was expected.
inline void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "fuzz check failed: %s\n", what);
    std::abort();
  }
}

}  // namespace fcp::fuzz
