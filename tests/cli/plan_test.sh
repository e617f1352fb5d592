#!/usr/bin/env bash
# `fcp plan` as a user runs it: the summary, the JSON fields, and the same plan from two
# separate processes given the same seed.
set -u
fcp=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passed=0
check() {  # check NAME COMMAND...: the command must succeed
  local name=$1
  shift
  if "$@"; then passed=$((passed + 1)); else echo "FAIL $name"; failures=$((failures + 1)); fi
}

# The version, as the CMake project names it, on stdout, exit 0.
version=$(sed -n 's/^project(fcp VERSION \([0-9.]*\).*/\1/p' "$(dirname "$0")/../../CMakeLists.txt")
check version_found test -n "$version"
check version_printed test "$("$fcp" --version)" = "fcp $version"

check summary_runs "$fcp" plan --workers 8 > "$tmp/summary.txt"
check summary_mentions_imbalance grep -q "imbalance: compute" "$tmp/summary.txt"

check json_runs "$fcp" plan --workers 32 --workload bimodal --seed 4 --json \
  --plan-out "$tmp/a.json" > "$tmp/summary.json"
"$fcp" plan --workers 32 --workload bimodal --seed 4 --plan-out "$tmp/b.json" --json > "$tmp/b_summary.json"
check same_seed_same_plan cmp -s "$tmp/a.json" "$tmp/b.json"
"$fcp" plan --workers 32 --workload bimodal --seed 5 --plan-out "$tmp/c.json" --json > "$tmp/c_summary.json"
check other_seed_other_plan bash -c "! cmp -s '$tmp/a.json' '$tmp/c.json'"
# The digest the ranks compare: the same for the same plan (made again, or read back from its
# file), another for another.
"$fcp" plan --plan-in "$tmp/a.json" --json > "$tmp/a_loaded.json"
check digests /usr/bin/python3 -c "
import json
a, b, c, l = (json.load(open('$tmp/' + n + '.json'))['digest']
              for n in ('summary', 'b_summary', 'c_summary', 'a_loaded'))
assert a == l, (a, l)
assert len(a) == 16 and all(ch in '0123456789abcdef' for ch in a), a
assert a == b != c, (a, b, c)"

# The summary JSON has the documented fields, with sane values.
check json_fields /usr/bin/python3 - "$tmp/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
for key in ["workers", "sequences", "blocks", "imbalance", "lower_bound_gap", "plan_ms",
            "rounds", "max_degree", "stages", "comm_bytes", "reshuffle_bytes",
            "round_max_bytes_sum", "round_max_bytes_lower_bounds", "plan_ms_by_phase"]:
    assert key in s, key
assert s["rounds"] == s["max_degree"] > 0
assert 0 <= s["imbalance"]["comm"] < 0.5
b = s["round_max_bytes_lower_bounds"]
assert s["round_max_bytes_sum"] >= max(b["busiest_worker"], b["sorted_transfers"]) > 0
assert s["reshuffle_bytes"] <= s["reshuffle_bytes_without_locality"]
assert set(s["plan_ms_by_phase"]) == {"shard", "assign", "balance", "transfers", "colour", "schedule"}
assert set(s["check_ms"]) == {"validate", "digest"} and min(s["check_ms"].values()) > 0
assert s["workers"] == 32 and s["tokens"] == 32 * 32768
assert 0 <= s["imbalance"]["compute"] < 0.05 and 0 <= s["imbalance"]["memory"] < 1
assert s["lower_bound_gap"] >= 0 and s["plan_ms"] > 0
PY

# --curve: the GPU-X profile's curve is the default one (same plan; h100's is FA3's measured curve
# since issue 15, docs/fidelity.md); a curve that makes small
# kernels very slow changes the pair costs and so where blocks go.
"$fcp" plan --workers 32 --workload bimodal --seed 4 --curve gpu-x --plan-out "$tmp/gpux.json" > /dev/null
check curve_gpu_x_is_default cmp -s "$tmp/a.json" "$tmp/gpux.json"
printf '{"kind": "fcp-efficiency-curve", "forward": [[256, 0.01], [4096, 0.9]]}\n' > "$tmp/steep.json"
"$fcp" plan --workers 32 --workload bimodal --seed 4 --curve "$tmp/steep.json" --plan-out "$tmp/steep_plan.json" > /dev/null
check curve_changes_assignment /usr/bin/python3 -c "
import json
a, b = json.load(open('$tmp/a.json')), json.load(open('$tmp/steep_plan.json'))
assert a['owner'] != b['owner'], 'the steep curve left every block where it was'"

# A trace: lengths as given, memory budget defaulting to the trace's share.
printf '# lengths\n100000\n\n5000\n300\n300\n' > "$tmp/trace.txt"
check trace_runs "$fcp" plan --trace "$tmp/trace.txt" --workers 4 --json > "$tmp/trace.json"
check trace_fields /usr/bin/python3 -c "
import json; s = json.load(open('$tmp/trace.json'))
assert s['sequences'] == 4 and s['tokens'] == 105600, s"

# Issue 15 item 3: --workload FILE draws the batch from a length list, seeded; the batch
# fills workers x tokens per worker from the listed lengths (the last one cut to fit).
printf '# lengths\n300\n5000\n# more\n700\n' > "$tmp/lengths.txt"
check workload_file_runs "$fcp" plan --workload "$tmp/lengths.txt" --workers 4 --tokens-per-worker 8K \
  --seed 3 --json > "$tmp/wf.json"
check workload_file_fields /usr/bin/python3 -c "
import json; s = json.load(open('$tmp/wf.json'))
assert s['tokens'] == 32768 and s['sequences'] >= 32768 // 5000, s"
check workload_file_plan_has_only_listed_lengths bash -c "
  '$fcp' plan --workload '$tmp/lengths.txt' --workers 4 --tokens-per-worker 8K --seed 3 \
    --plan-out '$tmp/wf_plan.json' > /dev/null &&
  /usr/bin/python3 -c \"
import json; p = json.load(open('$tmp/wf_plan.json'))
lens = p['batch']
assert set(lens[:-1]) <= {300, 5000, 700} and sum(lens) == 32768, lens
\""
"$fcp" plan --workload "$tmp/lengths.txt" --workers 4 --tokens-per-worker 8K --seed 3 \
  --plan-out "$tmp/wf_plan2.json" > /dev/null
check workload_file_same_seed_same_plan cmp -s "$tmp/wf_plan.json" "$tmp/wf_plan2.json"
check workload_file_corpus_runs "$fcp" plan --workload "$(dirname "$0")/../../data/workloads/code-corpus.txt" --workers 8 \
  --json > /dev/null

# A saved plan loads back and validates.
check plan_in_runs "$fcp" plan --plan-in "$tmp/a.json" --json > "$tmp/loaded.json"
check plan_in_valid grep -q '"valid":true' "$tmp/loaded.json"
# A loaded plan was not planned here: no planning times in its summary or its JSON.
"$fcp" plan --plan-in "$tmp/a.json" > "$tmp/loaded.txt"
check plan_in_says_loaded grep -q "loaded, not planned here: no planning times" "$tmp/loaded.txt"
check plan_in_no_times bash -c "! grep -q 'planned in' '$tmp/loaded.txt'"
check plan_in_json_no_times /usr/bin/python3 -c "
import json; s = json.load(open('$tmp/loaded.json'))
assert not any(k.startswith('plan_ms') for k in s), s"

# Issue 15: batches whose blocks the memory cap cannot place are planned with finer blocks,
# and the plan says so (seed 5979 once failed with "no worker has room for block 1").
check seed_5979_plans "$fcp" plan --seed 5979 --placement lpt > "$tmp/seed5979.txt"
check seed_5979_says_cut grep -q "memory cap: blocks of 4K did not pack under it" "$tmp/seed5979.txt"
check block_over_cap_plans "$fcp" plan --workers 4 --tokens-per-worker 2K --block-size 4K --json \
  > "$tmp/over_cap.json"
check block_over_cap_fields /usr/bin/python3 -c "
import json; s = json.load(open('$tmp/over_cap.json'))['sharding']
assert 0 < s['block_size'] <= 2253 and s['memory_retries'] >= 1, s"
check help_exits_zero "$fcp" plan --help > /dev/null

# Output that does not reach stdout (a full disk: /dev/full) is an error, one line, exit 1; it
# was exit 0, leaving a truncated file behind `> out.csv` (a review). Help and the JSON too.
for args in "plan --workers 4" "plan --workers 4 --json" "simulate --strategy fcp --workers 4 --csv" \
    "plan --help"; do
  # shellcheck disable=SC2086
  "$fcp" $args > /dev/full 2> "$tmp/full.err"
  code=$?
  if [ $code -eq 1 ] && [ "$(wc -l < "$tmp/full.err")" -eq 1 ] &&
     grep -q "^fcp: error: cannot write standard output: No space left on device" "$tmp/full.err"; then
    passed=$((passed + 1))
  else
    echo "FAIL stdout_full ($args): exit $code"; sed 's/^/    stderr: /' "$tmp/full.err"
    failures=$((failures + 1))
  fi
done

echo "$passed passed, $failures failed"
[ $failures -eq 0 ]
