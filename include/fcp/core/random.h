#pragma once
/// A seeded random source whose output is the same on every machine and compiler.
///
/// std::*_distribution output is implementation-defined, so FCP draws its own: xoshiro256**
/// seeded through splitmix64, uniform doubles from the top 53 bits, normals by Box–Muller.

#include <cstdint>

namespace fcp {

class Rng {
 public:
  explicit Rng(uint64_t seed);
  /// Next 64 random bits.
  uint64_t next();
  /// Uniform in (0, 1]: never 0, so log() of it is finite.
  double uniformOpenZero();
  /// Uniform in [0, 1).
  double uniform();
  /// Standard normal, one Box–Muller draw per call (the sine half is discarded so the stream
  /// has no hidden state).
  double normal();

 private:
  uint64_t state_[4];
};

}  // namespace fcp
