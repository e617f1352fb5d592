#include "fcp/core/random.h"

#include <cmath>

#include "fcp/core/det_math.h"

namespace fcp {
namespace {

uint64_t splitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

constexpr double kTwoPow53Inv = 1.0 / 9007199254740992.0;

}  // namespace

Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (auto& s : state_) s = splitMix64(x);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * kTwoPow53Inv; }

double Rng::uniformOpenZero() { return static_cast<double>((next() >> 11) + 1) * kTwoPow53Inv; }

double Rng::normal() {
  const double u1 = uniformOpenZero();
  const double u2 = uniform();
  return std::sqrt(-2.0 * dmath::log(u1)) * dmath::cosTurns(u2);
}

}  // namespace fcp
