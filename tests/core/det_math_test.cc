// fcp::dmath against libm (an independent implementation) within a few ulp, and the values
// that must be exact.
#include "fcp/core/det_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "fcp/core/random.h"

namespace fcp {
namespace {

// |a - b| in units of b's last place.
double ulps(double a, double b) {
  if (a == b) return 0;
  const double ulp = std::nextafter(std::fabs(b), std::numeric_limits<double>::infinity()) - std::fabs(b);
  return std::fabs(a - b) / ulp;
}

TEST(DetMathTest, LogAndLog2AgreeWithLibmOverTheWholeRange) {
  Rng rng(1);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    // Mantissas uniform, exponents from -1074 to 1023: subnormals to the largest doubles.
    const double x = std::ldexp(0.5 + 0.5 * rng.uniform(), static_cast<int>(rng.next() % 2098) - 1073);
    if (x == 0 || !std::isfinite(x)) continue;
    const double expected = std::log(x);
    // Near x = 1 the log is tiny: compare absolutely there.
    if (std::fabs(expected) > 1e-3) worst = std::max(worst, ulps(dmath::log(x), expected));
    else EXPECT_NEAR(dmath::log(x), expected, 1e-18) << x;
    if (std::fabs(std::log2(x)) > 1e-3) worst = std::max(worst, ulps(dmath::log2(x), std::log2(x)));
  }
  EXPECT_LE(worst, 4.0);
}

TEST(DetMathTest, Log2OfPowersOfTwoIsExact) {
  for (int e = -1074; e <= 1023; ++e) EXPECT_EQ(dmath::log2(std::ldexp(1.0, e)), e) << e;
  EXPECT_EQ(dmath::log(1.0), 0.0);
}

TEST(DetMathTest, ExpAgreesWithLibm) {
  Rng rng(2);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const double x = -745.0 + 1454.0 * rng.uniform();
    const double expected = std::exp(x);
    if (expected < std::numeric_limits<double>::min()) {  // subnormal results: absolute error
      EXPECT_NEAR(dmath::exp(x), expected, 4 * std::numeric_limits<double>::denorm_min()) << x;
      continue;
    }
    worst = std::max(worst, ulps(dmath::exp(x), expected));
  }
  EXPECT_LE(worst, 4.0);
  EXPECT_EQ(dmath::exp(0.0), 1.0);
  EXPECT_EQ(dmath::exp(1000.0), std::numeric_limits<double>::infinity());
  EXPECT_EQ(dmath::exp(-1000.0), 0.0);
}

TEST(DetMathTest, CosTurnsAgreesWithLibm) {
  Rng rng(3);
  for (int i = 0; i < 200000; ++i) {
    const double t = rng.uniform();
    // The reference in long double, so that rounding 2 pi t does not dominate its error.
    const long double turn = 6.283185307179586476925286766559005768L;
    const auto expected = static_cast<double>(std::cos(turn * static_cast<long double>(t)));
    EXPECT_NEAR(dmath::cosTurns(t), expected, 3e-16) << t;
  }
  EXPECT_EQ(dmath::cosTurns(0.0), 1.0);
  EXPECT_EQ(dmath::cosTurns(0.5), -1.0);
  EXPECT_EQ(dmath::cosTurns(0.25), 0.0);
  EXPECT_EQ(dmath::cosTurns(-3.0), 1.0);
}

TEST(DetMathTest, SpecialValues) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(dmath::log(0.0), -inf);
  EXPECT_TRUE(std::isnan(dmath::log(-1.0)));
  EXPECT_EQ(dmath::log(inf), inf);
  EXPECT_TRUE(std::isnan(dmath::exp(std::nan(""))));
  EXPECT_TRUE(std::isnan(dmath::cosTurns(inf)));
}

}  // namespace
}  // namespace fcp
