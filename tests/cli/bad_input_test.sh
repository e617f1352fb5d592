#!/usr/bin/env bash
# Bad input to `fcp plan`: each case must exit nonzero with exactly one line on stderr that
# names the bad value, print nothing on stdout, and leave no --plan-out file behind.
set -u
fcp=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passed=0

printf '4096\n# comment\n\n12x\n' > "$tmp/bad_line.txt"
printf '4096\n-3\n' > "$tmp/negative.txt"
printf '99999999999999999999\n' > "$tmp/huge.txt"
printf '1073741824\n1073741824\n1073741824\n1073741824\n1073741824\n' > "$tmp/total.txt"
printf '# only comments\n\n' > "$tmp/empty.txt"
mkdir "$tmp/dir.txt"

# expect NAME EXPECTED_TEXT ARGS...: run `fcp plan ARGS --plan-out FILE` (without --plan-out
# when ARGS has --plan-in, which refuses it, or their own --plan-out).
expect() {
  local name=$1 text=$2
  shift 2
  local out="$tmp/plan_$name.json"
  local extra=(--plan-out "$out")
  case " $* " in *" --plan-out "* | *" --plan-in "*) extra=() ;; esac
  "$fcp" plan "$@" "${extra[@]}" > "$tmp/stdout" 2> "$tmp/stderr"
  local code=$?
  local why=""
  [ $code -eq 0 ] && why="exit code 0"
  [ -s "$tmp/stdout" ] && why="$why; printed on stdout"
  [ "$(wc -l < "$tmp/stderr")" -eq 1 ] || why="$why; stderr is not one line"
  grep -qF -- "$text" "$tmp/stderr" || why="$why; stderr lacks '$text'"
  [ -e "$out" ] && why="$why; left $out behind"
  if [ -n "$why" ]; then
    echo "FAIL $name:$why"
    sed 's/^/    stderr: /' "$tmp/stderr"
    failures=$((failures + 1))
  else
    passed=$((passed + 1))
  fi
}

expect unknown_workload "'zipf'" --workload zipf
expect unknown_flag "--frobnicate" --frobnicate 3
expect missing_trace "$tmp/missing.txt" --trace "$tmp/missing.txt"
expect unreadable_trace "$tmp/dir.txt" --trace "$tmp/dir.txt"
expect bad_trace_line "line 4: '12x'" --trace "$tmp/bad_line.txt"
expect negative_trace_line "line 2: '-3'" --trace "$tmp/negative.txt"
expect huge_trace_line "line 1" --trace "$tmp/huge.txt"
expect trace_total "batch passes" --trace "$tmp/total.txt"
expect empty_trace "no sequence lengths" --trace "$tmp/empty.txt"
expect workload_and_trace "--trace" --workload lognormal --trace "$tmp/bad_line.txt"
expect zero_workers "--workers '0'" --workers 0
expect negative_workers "--workers '-4'" --workers -4
expect zero_block "--block-size '0'" --block-size 0
expect negative_block "--block-size '-4K'" --block-size -4K
expect bad_suffix_block "--block-size '4Q'" --block-size 4Q
expect zero_tokens "--tokens-per-worker '0'" --tokens-per-worker 0
expect overflow_tokens "--tokens-per-worker '9999999999999999999K'" --tokens-per-worker 9999999999999999999K
expect batch_too_large "passes" --workers 1000000 --tokens-per-worker 1M
expect memory_cannot_hold "cannot hold the batch" --memory-limit 16K
expect zero_min_sequences "--min-sequences '0'" --min-sequences 0
expect impossible_min_sequences "minimum of 70 sequences: expected 1 to 64" --workers 2 --tokens-per-worker 32K --min-sequences 70
expect unlikely_min_sequences "had 60 sequences in" --workers 2 --tokens-per-worker 32K --min-sequences 60
expect min_sequences_and_trace "--min-sequences" --trace "$tmp/bad_line.txt" --min-sequences 2
# Blocks over the cap are no longer an error (they are cut finer): see plan_test.sh.
expect bad_mask "'diagonal'" --mask diagonal
expect bad_heads "not a multiple" --heads-q 12 --heads-kv 8
expect bad_dtype "'int3'" --dtype int3
expect bad_slack "--memory-slack '-1'" --memory-slack -1

expect huge_heads "--head-dim '4294967296'" --head-dim 4294967296
expect huge_workers "--workers '9223372036854775807'" --workers 9223372036854775807
expect huge_buffers "--buffers '10000000'" --buffers 10000000
expect huge_memory "memory limit" --memory-limit 9223372036854775807
printf '4096\n100\n' > "$tmp/small.txt"
expect huge_trace_share "memory limit" --trace "$tmp/small.txt" --workers 3 --tokens-per-worker 9223372036854775807
expect nan_slack "slack" --comm-balance-slack nan
expect unwritable_plan_out "cannot write --plan-out" --workers 2 --plan-out "$tmp/no/such/dir/plan.json"
# An output that is one of the inputs (the trace, by a symlink too) is refused; the trace stays.
printf '1000\n2000\n' > "$tmp/trace_in.txt"
ln -s "$tmp/trace_in.txt" "$tmp/trace_link.txt"
expect plan_out_is_trace "cannot write --plan-out file '$tmp/trace_in.txt': it is the --trace file" \
  --workers 2 --trace "$tmp/trace_link.txt" --plan-out "$tmp/trace_in.txt"
[ "$(cat "$tmp/trace_in.txt")" = "$(printf '1000\n2000')" ] ||
  { echo "FAIL plan_out_is_trace: the trace was written"; failures=$((failures + 1)); }
expect zero_coalesce "--coalesce '0'" --coalesce 0
expect one_buffer "--buffers '1'" --buffers 1
expect missing_plan_in "$tmp/none.json" --plan-in "$tmp/none.json"
printf '{"format": "fcp-plan", "version": 1}' > "$tmp/partial.json"
expect partial_plan_in "missing field" --plan-in "$tmp/partial.json"
# A plan that parses but breaks an invariant: one transfer moved into another's round.
"$fcp" plan --workers 8 --plan-out "$tmp/good.json" > /dev/null
/usr/bin/python3 - "$tmp/good.json" "$tmp/bad.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
t = p["transfers"]
first = next(i for i in range(1, len(t)) if t[i][1] == t[0][1])
t[first][4] = t[0][4]
json.dump(p, open(sys.argv[2], "w"))
PY
expect invalid_plan_in "is not a matching" --plan-in "$tmp/bad.json"
# --plan-in uses only --curve and --json: any other option would be silently ignored.
expect plan_in_workers "--plan-in with --workers" --plan-in "$tmp/good.json" --workers 4
expect plan_in_block_size "--plan-in with --block-size" --plan-in "$tmp/good.json" --block-size 7
expect plan_in_trace "--plan-in with --trace" --plan-in "$tmp/good.json" --trace "$tmp/small.txt"
expect plan_in_plan_out "--plan-in with --plan-out" --plan-in "$tmp/good.json" \
  --plan-out "$tmp/plan_plan_in_plan_out.json"
# A trace is used as given: a --seed would be ignored (the default seed still works: plan_test).
expect seed_and_trace "--seed" --trace "$tmp/small.txt" --seed 3

# --curve: a file that is missing, of another kind, or with a bad point.
printf '{"kind": "something-else"}\n' > "$tmp/other_kind.json"
printf '{"kind": "fcp-efficiency-curve", "forward": [[1024, "fast"]]}\n' > "$tmp/bad_point.json"
expect missing_curve "$tmp/no_curve.json" --curve "$tmp/no_curve.json"
expect curve_kind "fcp-efficiency-curve" --curve "$tmp/other_kind.json"
expect curve_point '[1024,"fast"]' --curve "$tmp/bad_point.json"
expect unknown_curve_profile "'tpu-v9'" --curve tpu-v9

echo "$passed passed, $failures failed"
[ $failures -eq 0 ]
