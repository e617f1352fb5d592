#!/usr/bin/env bash
# What decides a plan (libfcp_core, libfcp_plan, libfcp_baselines) calls none of libm's
# transcendental functions, whose last bits may differ between C libraries: they come from
# fcp::dmath (fcp/core/det_math.h). sqrt, floor, frexp and ldexp are exactly specified by
# IEEE 754 / C and allowed. Usage: no_libm_test.sh LIBRARY...
set -euo pipefail
banned='^(exp|exp2|expm1|log|log2|log10|log1p|pow|sin|cos|tan|sinh|cosh|tanh|asin|acos|atan|atan2|cbrt|erf|erfc|lgamma|tgamma|hypot|sincos)[fl]?(@.*)?$'
status=0
for lib in "$@"; do
  [ -f "$lib" ] || { echo "no library $lib" >&2; exit 1; }
  found=$(nm -u "$lib" | awk '{print $NF}' | grep -E "$banned" | sort -u || true)
  if [ -n "$found" ]; then
    echo "$lib calls libm: $(echo $found)" >&2
    status=1
  fi
done
# The check must see something: the libraries do call some allowed libm function.
all=$(nm -u "$@" | awk '{print $NF}')
grep -Eq '^(sqrt|frexp|ldexp)$' <<<"$all" ||
  { echo "expected the libraries to call sqrt, frexp or ldexp (is nm reading them?)" >&2; exit 1; }
exit $status
