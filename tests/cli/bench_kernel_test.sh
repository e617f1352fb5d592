#!/usr/bin/env bash
# `fcp bench kernel --json` on tiny blocks: every record carries the documented fields; bf16
# records say which GEMM the kernel used and report oneDNN's bf16 GEMM as a positive number
# exactly when the kernel used it (auto picks it wherever it runs) and as null, never 0, where
# it is unavailable; forcing the native bf16 GEMM either runs on it or fails with one line that
# says it is unavailable on this CPU. Timing values are only checked to be positive.
set -u
fcp=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

run() {
  local name=$1
  shift
  if ! "$fcp" bench kernel --tokens 64 --mask causal full --min-seconds 0 --json "$@" \
      > "$tmp/$name.json" 2> "$tmp/$name.err"; then
    echo "FAIL $name: exit code nonzero"
    sed 's/^/    stderr: /' "$tmp/$name.err"
    failures=$((failures + 1))
    return 1
  fi
}

check() {
  /usr/bin/python3 - "$@" <<'PY' || failures=$((failures + 1))
import json, sys
path, dtype, expect_gemm = sys.argv[1], sys.argv[2], sys.argv[3]
records = [json.loads(line) for line in open(path)]
problems = []
if len(records) != 4:  # {causal, full} x {forward, backward}
    problems.append(f"{len(records)} records, expected 4")
for r in records:
    for key in ("gflops", "gemm_gflops", "seconds", "peak_gflops"):
        if not (isinstance(r.get(key), (int, float)) and r[key] > 0):
            problems.append(f"{key} = {r.get(key)!r}, expected a positive number")
    if r.get("dtype") != dtype:
        problems.append(f"dtype {r.get('dtype')!r}, expected {dtype}")
    if dtype == "fp32":
        if r.get("gemm") != "dnnl_sgemm" or "bf16_gemm_gflops" in r:
            problems.append(f"fp32 record with gemm {r.get('gemm')!r} / a bf16 GEMM field")
        continue
    if "bf16_gemm_gflops" not in r:
        problems.append("bf16 record without bf16_gemm_gflops")
        continue
    g = r["bf16_gemm_gflops"]
    if r.get("gemm") == "dnnl_gemm_bf16bf16f32":
        if not (isinstance(g, (int, float)) and g > 0):
            problems.append(f"kernel used the bf16 GEMM but bf16_gemm_gflops = {g!r}")
    elif r.get("gemm") == "dnnl_sgemm":
        if g is not None:
            problems.append(f"bf16 GEMM unused under auto but bf16_gemm_gflops = {g!r}, "
                            "expected null")
    else:
        problems.append(f"gemm = {r.get('gemm')!r}")
    if expect_gemm != "any" and r.get("gemm") != expect_gemm:
        problems.append(f"gemm = {r.get('gemm')!r}, expected {expect_gemm}")
for p in problems:
    print(f"FAIL {path}: {p}")
sys.exit(1 if problems else 0)
PY
}

run fp32 --dtype fp32 && check "$tmp/fp32.json" fp32 any
run bf16 --dtype bf16 && check "$tmp/bf16.json" bf16 any

# Forcing the native bf16 GEMM: it runs (and the records say so) or is refused in one line.
if "$fcp" bench kernel --tokens 64 --mask full --min-seconds 0 --json --dtype bf16 \
    --bf16-gemm native > "$tmp/native.json" 2> "$tmp/native.err"; then
  /usr/bin/python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    assert r["gemm"] == "dnnl_gemm_bf16bf16f32" and r["bf16_gemm_gflops"] > 0, r
' "$tmp/native.json" || {
    echo "FAIL native: records do not show the bf16 GEMM"
    failures=$((failures + 1))
  }
else
  if [ -s "$tmp/native.json" ] || [ "$(wc -l < "$tmp/native.err")" -ne 1 ] ||
      ! grep -q "unavailable on this CPU" "$tmp/native.err"; then
    echo "FAIL native: refused without one line saying the bf16 GEMM is unavailable"
    sed 's/^/    stderr: /' "$tmp/native.err"
    failures=$((failures + 1))
  fi
fi

# Zig-Zag cases: records named zigzag, and the curve made from them when they are measured.
if "$fcp" bench kernel --tokens 64 128 --mask causal zigzag --min-seconds 0 --json \
    --curve-out "$tmp/zigzag_curve.json" > "$tmp/zigzag.json" 2> "$tmp/zigzag.err"; then
  /usr/bin/python3 - "$tmp/zigzag.json" "$tmp/zigzag_curve.json" <<'PY' || failures=$((failures + 1))
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
masks = sorted({r["mask"] for r in records})
assert masks == ["causal", "zigzag"], masks
curve = json.load(open(sys.argv[2]))
zig = {r["tokens"]: r["gflops"] / r["peak_gflops"] for r in records
       if r["mask"] == "zigzag" and r["direction"] == "forward"}
assert [t for t, _ in curve["forward"]] == [64, 128], curve
assert curve["timing"] == "best" and all(r["timing"] == "best" for r in records), curve
for t, f in curve["forward"]:
    assert abs(f - zig[t]) < 1e-9, (t, f, zig[t])
PY
else
  echo "FAIL zigzag: exit code nonzero"; sed 's/^/    stderr: /' "$tmp/zigzag.err"; failures=$((failures + 1))
fi
# --sustained: the records and the curve say how they were timed.
if "$fcp" bench kernel --tokens 64 --mask zigzag --min-seconds 0 --json --sustained \
    --curve-out "$tmp/sustained_curve.json" > "$tmp/sustained.json" 2> "$tmp/sustained.err"; then
  /usr/bin/python3 - "$tmp/sustained.json" "$tmp/sustained_curve.json" <<'PY' || failures=$((failures + 1))
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
assert len(records) == 2 and all(r["timing"] == "sustained" and r["gflops"] > 0 for r in records), records
assert json.load(open(sys.argv[2]))["timing"] == "sustained"
PY
else
  echo "FAIL sustained: exit code nonzero"; sed 's/^/    stderr: /' "$tmp/sustained.err"; failures=$((failures + 1))
fi
"$fcp" bench kernel --tokens 63 --mask zigzag --min-seconds 0 > "$tmp/odd.out" 2> "$tmp/odd.err"
if [ $? -eq 0 ] || [ -s "$tmp/odd.out" ] || [ "$(wc -l < "$tmp/odd.err")" -ne 1 ] || ! grep -q "63" "$tmp/odd.err"; then
  echo "FAIL odd zigzag block: expected one line naming 63 and a nonzero exit"
  sed 's/^/    stderr: /' "$tmp/odd.err"
  failures=$((failures + 1))
fi

# A length or mask listed twice (after the suffixes: 1K is 1024) is refused in one line before
# any measurement, writing no curve: the curve's loader takes strictly increasing lengths only.
refuse_repeat() {
  local name=$1 text=$2
  shift 2
  rm -f "$tmp/repeat_curve.json"
  "$fcp" bench kernel --min-seconds 0 --heads-q 1 --head-dim 16 "$@" \
    --curve-out "$tmp/repeat_curve.json" > "$tmp/$name.out" 2> "$tmp/$name.err"
  if [ $? -eq 0 ] || [ -s "$tmp/$name.out" ] || [ "$(wc -l < "$tmp/$name.err")" -ne 1 ] ||
     ! grep -qF -- "$text" "$tmp/$name.err" || [ -e "$tmp/repeat_curve.json" ]; then
    echo "FAIL $name: expected one line with '$text', a nonzero exit and no curve"
    sed 's/^/    stderr: /' "$tmp/$name.err"
    failures=$((failures + 1))
  fi
}
refuse_repeat repeated_tokens "--tokens lists 64 twice: expected distinct lengths" --tokens 64 64
refuse_repeat repeated_suffixed_tokens "--tokens lists 1024 twice ('1K' and '1024')" --tokens 1K 128 1024
refuse_repeat repeated_mask "--mask lists full twice" --tokens 64 --mask full full

if [ $failures -ne 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "bench kernel checks passed"
