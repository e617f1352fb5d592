#include "fcp/core/det_math.h"

#include <cmath>
#include <limits>

// Every rank must compute the same plan, so the arithmetic that decides one follows IEEE-754
// exactly: a build that lets the compiler reassociate, take reciprocals or assume finite
// values (-ffast-math, -Ofast and their parts) could plan differently from another build.
#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__) || \
    (defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__)
#error \
    "FCP's planner must be built without -ffast-math or its parts (plans would differ between builds)"
#endif

namespace fcp::dmath {
namespace {

// ln 2 in two parts: kLn2Hi has only 32 significant bits, so k * kLn2Hi is exact for every
// |k| < 2^21 and x - k ln 2 loses nothing to cancellation.
constexpr double kLn2Hi = 6.93147180369123816490e-01;
constexpr double kLn2Lo = 1.90821492927058770002e-10;
constexpr double kLog2E = 1.44269504088896338700e+00;
constexpr double kSqrtHalf = 7.07106781186547572737e-01;
constexpr double kTwoPi = 6.28318530717958623200e+00;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// log(m) / 2 for m in [sqrt(1/2), sqrt(2)): atanh(s) with s = (m - 1) / (m + 1), |s| < 0.1716,
// as s (1 + s^2/3 + s^4/5 + ...); 14 terms put the remainder below 2^-64.
double halfLogNearOne(double m) {
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double sum = 0.0;
  for (int k = 13; k >= 0; --k) sum = sum * s2 + 1.0 / (2.0 * k + 1.0);
  return s * sum;
}

// x = m 2^e with m in [sqrt(1/2), sqrt(2)), for finite x > 0.
double reduce(double x, int& e) {
  double m = std::frexp(x, &e);  // [0.5, 1)
  if (m < kSqrtHalf) {
    m *= 2.0;
    --e;
  }
  return m;
}

}  // namespace

double log(double x) {
  if (std::isnan(x) || x < 0) return kNaN;
  if (x == 0) return -kInf;
  if (std::isinf(x)) return kInf;
  int e = 0;
  const double m = reduce(x, e);
  const double logM = 2.0 * halfLogNearOne(m);
  return e * kLn2Hi + (e * kLn2Lo + logM);
}

double log2(double x) {
  if (std::isnan(x) || x < 0) return kNaN;
  if (x == 0) return -kInf;
  if (std::isinf(x)) return kInf;
  int e = 0;
  const double m = reduce(x, e);
  return e + 2.0 * halfLogNearOne(m) * kLog2E;
}

double exp(double x) {
  if (std::isnan(x)) return x;
  if (x > 709.782712893384) return kInf;
  if (x < -745.1332191019412) return 0.0;
  // x = k ln 2 + r with |r| <= ln 2 / 2; e^r by its Taylor series (18 terms: remainder below
  // 2^-70), then scaled by 2^k exactly.
  const double k = std::floor(x * kLog2E + 0.5);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  double p = 1.0;
  for (int n = 18; n >= 1; --n) p = 1.0 + p * r / n;
  return std::ldexp(p, static_cast<int>(k));
}

double cosTurns(double turns) {
  if (!std::isfinite(turns)) return kNaN;
  const double f = turns - std::floor(turns);      // [0, 1), exact
  const double q = std::floor(f * 4.0 + 0.5);      // nearest quarter turn, 0..4
  const double a = (f - q * 0.25) * kTwoPi;        // |a| <= pi / 4; the subtraction is exact
  const double a2 = a * a;
  // cos(q pi/2 + a) is cos a, -sin a, -cos a or sin a; both by Taylor series, 12 terms
  // (remainder below 2^-80 for |a| <= pi/4).
  double c = 1.0;
  double s = 1.0;
  for (int n = 12; n >= 1; --n) {
    c = 1.0 - c * a2 / ((2.0 * n - 1.0) * (2.0 * n));
    s = 1.0 - s * a2 / ((2.0 * n) * (2.0 * n + 1.0));
  }
  s *= a;
  switch (static_cast<int>(q) & 3) {
    case 0: return c;
    case 1: return -s;
    case 2: return -c;
    default: return s;
  }
}

}  // namespace fcp::dmath
