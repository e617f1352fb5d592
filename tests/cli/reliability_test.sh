#!/usr/bin/env bash
# Issue 16, items 1-7, driven as a user would: each case must exit nonzero within its time
# limit, print exactly one line on stderr that contains the expected text and no raw control
# byte, print nothing on stdout, and write nothing (no --plan-out file; a FIFO, symlink or
# device given as output stays what it was).
# Usage: reliability_test.sh FCP
set -u
fcp=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passed=0

# expect NAME TEXT SECONDS ARGS...: run `fcp ARGS`.
expect() {
  local name=$1 text=$2 limit=$3
  shift 3
  local start=$SECONDS
  timeout 60 "$fcp" "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local code=$? elapsed=$((SECONDS - start))
  local why=""
  [ $code -eq 0 ] && why="exit code 0"
  [ $code -eq 124 ] && why="timed out"
  [ $code -ge 128 ] && why="killed by signal $((code - 128))"
  [ "$elapsed" -gt "$limit" ] && why="$why; took ${elapsed}s (limit ${limit}s)"
  [ -s "$tmp/stdout" ] && why="$why; printed on stdout"
  [ "$(wc -l < "$tmp/stderr")" -eq 1 ] || why="$why; stderr is not one line"
  [ "$(wc -c < "$tmp/stderr")" -le 1200 ] || why="$why; stderr is $(wc -c < "$tmp/stderr") bytes"
  LC_ALL=C grep -q '[[:cntrl:]]' <(tr -d '\n' < "$tmp/stderr") && why="$why; stderr has a control byte"
  grep -qF -- "$text" "$tmp/stderr" || why="$why; stderr lacks '$text'"
  if [ -n "$why" ]; then
    echo "FAIL $name:$why"
    head -c 2000 "$tmp/stderr" | sed 's/^/    stderr: /'
    failures=$((failures + 1))
  else
    passed=$((passed + 1))
  fi
}

# 1. Deeply nested JSON: a plan, a curve, a hardware profile.
python3 -c "print('{\"format\": \"fcp-plan\", \"version\": 1, \"workers\": ' + '[' * 70000 + ']' * 70000 + '}')" > "$tmp/deep_plan.json"
python3 -c "print('{\"kind\": \"fcp-efficiency-curve\", \"forward\": ' + '[' * 70000 + ']' * 70000 + '}')" > "$tmp/deep_curve.json"
python3 -c "print('{\"kind\": \"fcp-hardware\", \"note\": ' + '[' * 70000 + ']' * 70000 + '}')" > "$tmp/deep_hw.json"
expect deep_plan "JSON nests arrays and objects more than 64" 10 plan --plan-in "$tmp/deep_plan.json"
expect deep_curve "JSON nests" 10 plan --curve "$tmp/deep_curve.json"
expect deep_hardware "JSON nests" 10 simulate --hardware "$tmp/deep_hw.json"

# 2. --plan-out, --curve-out and --timeline never replace what is not a regular file.
mkfifo "$tmp/fifo"
echo original > "$tmp/target"
ln -s "$tmp/target" "$tmp/link"
expect plan_out_fifo "it is a FIFO, expected a regular file or a new path" 10 plan --workers 2 --plan-out "$tmp/fifo"
expect plan_out_symlink "it is a symbolic link" 10 plan --workers 2 --plan-out "$tmp/link"
expect plan_out_device "it is a character device" 10 plan --workers 2 --plan-out /dev/null
expect plan_out_dir "it is a directory" 10 plan --workers 2 --plan-out "$tmp"
expect curve_out_fifo "it is a FIFO" 10 bench kernel --tokens 256 --min-seconds 0 --curve-out "$tmp/fifo"
expect timeline_fifo "it is a FIFO" 10 run --timeline "$tmp/fifo"
[ -p "$tmp/fifo" ] || { echo "FAIL: the FIFO was replaced"; failures=$((failures + 1)); }
[ -L "$tmp/link" ] || { echo "FAIL: the symlink was replaced"; failures=$((failures + 1)); }
[ "$(cat "$tmp/target")" = original ] || { echo "FAIL: the symlink's target was written"; failures=$((failures + 1)); }
[ -c /dev/null ] || { echo "FAIL: /dev/null is no longer a device"; failures=$((failures + 1)); }
[ "$(ls "$tmp" | grep -c 'fifo\.\|link\.')" -eq 0 ] || { echo "FAIL: a temporary file was left"; failures=$((failures + 1)); }

# 3. --comm-ratio past its range (1e30 overflowed an int64 cast and ran uncapped).
expect comm_ratio_huge "--comm-ratio '1e30': expected a finite number from 0 to 100000" 10 run --comm-ratio 1e30
expect comm_ratio_inf "--comm-ratio 'inf'" 10 run --comm-ratio inf

# 4. Legal input with unbounded cost: refused in one line, in seconds.
echo 67108864 > "$tmp/one_64m.txt"
echo 536870912 > "$tmp/one_512m.txt"
expect sequence_64m "expected a block size of at least 11587 " 20 plan --trace "$tmp/one_64m.txt"
expect sequence_512m "more than 33554432 block pairs" 20 plan --trace "$tmp/one_512m.txt"
expect block_size_1 "--block-size 1: expected 16 to 1073741824 tokens (smaller blocks make more pairs" 10 plan --block-size 1
expect block_size_16 "block pairs" 20 plan --block-size 16
expect simulate_block_size_1 "--block-size 1: expected 16 to 1073741824 tokens (smaller blocks make more pairs" 10 simulate --block-size 1
expect head_dim_1m "--head-dim '1000000': expected an integer from 1 to 1024" 10 bench kernel --head-dim 1000000
expect bench_tensor "FLOP per forward pair: expected at most" 10 bench kernel --head-dim 1024 --heads-q 64 --heads-kv 8
expect bench_tokens "--tokens 1048576: expected at most 16384" 10 bench kernel --tokens 1M
expect min_seconds_inf "--min-seconds 'inf'" 10 bench kernel --min-seconds inf
expect min_seconds_big "--min-seconds '1e9'" 10 bench kernel --min-seconds 1e9
expect plan_in_dev_zero "it is a character device, expected a regular file" 10 plan --plan-in /dev/zero
expect trace_fifo "it is a FIFO, expected a regular file" 10 plan --trace "$tmp/fifo"
expect run_trace_fifo "it is a FIFO" 10 run --trace "$tmp/fifo"
expect simulate_trace_fifo "it is a FIFO" 10 simulate --trace "$tmp/fifo"
echo 614400 > "$tmp/one_600k.txt"
expect run_600k "needs about" 20 run --trace "$tmp/one_600k.txt"

# 5. Numeric flags: no silent wrap, narrowing or empty-as-zero.
expect threads_2p32 "--threads '4294967297': expected an integer from 1 to 256" 10 bench kernel --threads 4294967297
expect threads_2p31 "--threads '2147483648'" 10 bench kernel --threads 2147483648
expect run_threads "--threads '4294967297'" 10 run --threads 4294967297
expect seed_minus_one "--seed '-1': expected an integer from 0 to 18446744073709551615" 10 plan --seed -1
expect seed_huge "--seed '99999999999999999999'" 10 plan --seed 99999999999999999999
expect workers_huge "--workers '99999999999999999999'" 10 plan --workers 99999999999999999999
expect heads_huge "--heads-q '99999999999999999999'" 10 plan --heads-q 99999999999999999999
expect head_dim_huge "--head-dim '99999999999999999999'" 10 simulate --head-dim 99999999999999999999
expect coalesce_huge "--coalesce '99999999999999999999'" 10 run --coalesce 99999999999999999999
expect buffers_huge "--buffers '99999999999999999999'" 10 simulate --buffers 99999999999999999999
expect empty_seed "--seed ''" 10 plan --seed ''
expect empty_tokens "--tokens-per-worker ''" 10 plan --tokens-per-worker ''
expect empty_memory "--memory-limit ''" 10 plan --memory-limit ''
expect empty_comm_ratio "--comm-ratio ''" 10 run --comm-ratio ''
expect empty_comm_slack "--comm-balance-slack ''" 10 plan --comm-balance-slack ''
expect empty_workers_item "--workers item ''" 10 simulate --workers 16,,32
expect trailing_junk "--workers '16x'" 10 plan --workers 16x
expect comm_slack_flag "--comm-balance-slack '50'" 10 plan --comm-balance-slack 50

# 6. Plans that lie: each edit of a good plan is refused by --plan-in.
"$fcp" plan --workers 4 --plan-out "$tmp/good.json" > /dev/null || { echo "FAIL: no good plan"; exit 1; }
"$fcp" plan --plan-in "$tmp/good.json" > /dev/null || { echo "FAIL: the good plan does not load"; failures=$((failures + 1)); }
lie() {
  local name=$1 text=$2 edit=$3
  /usr/bin/python3 - "$tmp/good.json" "$tmp/$name.json" "$edit" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
exec(sys.argv[3])
json.dump(p, open(sys.argv[2], "w"))
PY
  expect "lie_$name" "$text" 10 plan --plan-in "$tmp/$name.json"
}
lie negative_cost "costs -1e+15: expected a finite cost >= 0" \
  'q = p["pairs"][0][0]; w = p["owner"][q]; p["loads"][w][1] -= p["pairs"][0][3] + 1e15; p["pairs"][0][3] = -1e15'
lie lower_bound "plan says lower bound 1e+300" 'p["lower_bound"] = 1e300'
lie block_size "block size -4096" 'p["config"]["block_size"] = -4096'
lie comm_slack "communication balance slack 50" 'p["config"]["comm_balance_slack"] = 50'
lie heads "but the plan's heads, head dim, mask and efficiency curve give" 'p["config"]["heads_q"] = 32'
lie strategy "strategy 'nonsense'" 'p["strategy"] = "nonsense"'
lie improve_steps "improve_steps -1" 'p["improve_steps"] = -1'
lie locality_slack "locality slack 7" 'p["config"]["locality_slack"] = 7'
lie placement "unknown placement 'far'" 'p["config"]["placement"] = "far"'
# A plan made with a curve is checked against that curve: loaded without it, it is refused.
"$fcp" plan --workers 4 --curve cpu --plan-out "$tmp/curve.json" > /dev/null
"$fcp" plan --plan-in "$tmp/curve.json" --curve cpu > /dev/null || { echo "FAIL: a plan does not load with its own curve"; failures=$((failures + 1)); }
expect other_curve "efficiency curve give" 10 plan --plan-in "$tmp/curve.json"

# 7. Messages: bytes escaped, long lines cut, the file's line named, numbers out of range named.
printf '4096\n40\00096\n' > "$tmp/nul.txt"
printf '\xef\xbb\xbf4096\n' > "$tmp/bom.txt"
printf '4096\r8192\n' > "$tmp/cr.txt"
head -c 3000 /dev/urandom > "$tmp/binary.txt"; printf '\x01\n' >> "$tmp/binary.txt"
python3 -c "print('7' * (10 << 20) + 'x')" > "$tmp/long_line.txt"
printf '4096\n\n1073741825\n' > "$tmp/over_long.txt"
expect nul_byte "line 2: '40\\096'" 10 plan --trace "$tmp/nul.txt"
expect bom "line 1: '\\uFEFF4096'" 10 plan --trace "$tmp/bom.txt"
expect lone_cr "line 1: '4096\\r8192'" 10 plan --trace "$tmp/cr.txt"
expect binary "is not a positive integer" 10 plan --trace "$tmp/binary.txt"
expect long_line "...' is not a positive integer" 10 plan --trace "$tmp/long_line.txt"
expect over_long_length "line 3: sequence length 1073741825 is over the limit" 10 plan --trace "$tmp/over_long.txt"
/usr/bin/python3 - "$tmp/good.json" "$tmp/e400.json" <<'PY'
import sys
text = open(sys.argv[1]).read()
at = text.index('"lower_bound":') + len('"lower_bound":')
end = text.index(',', at)
open(sys.argv[2], "w").write(text[:at] + "1e400" + text[end:])
PY
expect number_1e400 "plan JSON has a number out of range" 10 plan --plan-in "$tmp/e400.json"
expect plan_in_dir "it is a directory, expected a regular file" 10 plan --plan-in "$tmp"
expect control_in_flag "workload 'a\\x01b'" 10 plan --workload "$(printf 'a\001b')"

echo "$passed passed, $failures failed"
[ $failures -eq 0 ]
