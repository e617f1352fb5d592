#pragma once
/// The transcendental functions that decide a plan (the efficiency curve's log2 interpolation,
/// the batch sampler's normal and lognormal draws), written with IEEE-754 basic operations
/// only (+, -, *, /, floor, frexp, ldexp: each exactly specified), so every machine and C
/// library computes the same bits. libm's exp, log and cos may differ by an ulp between
/// implementations, and a plan must not (tests/core/det_math_test.cc pins values; the
/// plan.no_libm test checks that libfcp_core and libfcp_plan call none of libm's).
/// Accuracy: within a few ulp of the true value; identical everywhere is what matters.

namespace fcp::dmath {

/// Natural logarithm; log(0) = -inf, NaN for x < 0 or NaN, +inf for +inf.
double log(double x);

/// Base-2 logarithm, exact for powers of two.
double log2(double x);

/// e^x; +inf above ~709.78, 0 below ~-745.13, NaN for NaN.
double exp(double x);

/// cos(2 pi turns) for a finite `turns` (the angle in whole turns, so no reduction by an
/// irrational pi is needed); NaN for inf or NaN.
double cosTurns(double turns);

}  // namespace fcp::dmath
