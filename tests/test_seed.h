#pragma once
// The seed of a test run's fresh random inputs, shared by every test binary.

#include <cstdint>
#include <cstdlib>
#include <random>

namespace fcp::testing {

/// Seed of this test run: FCP_TEST_SEED if set (to replay a failure), else fresh.
inline uint64_t testSeed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FCP_TEST_SEED"))
      return static_cast<uint64_t>(std::strtoull(env, nullptr, 10));
    return (static_cast<uint64_t>(std::random_device{}()) << 32) ^
           static_cast<uint64_t>(std::random_device{}());
  }();
  return seed;
}

}  // namespace fcp::testing
