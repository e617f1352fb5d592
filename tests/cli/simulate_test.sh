#!/usr/bin/env bash
# `fcp simulate` from the command line: bad input exits nonzero with exactly one line on stderr
# that names the bad value and nothing on stdout; a small valid run's --json carries the
# documented fields (strategy, workers, mfu, time_ms, imbalance {compute, comm}) with sane values.
set -u
fcp=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passed=0

# expect NAME EXPECTED_TEXT ARGS...: run `fcp simulate ARGS` on a small default cell.
expect() {
  local name=$1 text=$2
  shift 2
  "$fcp" simulate --workers 16 "$@" > "$tmp/stdout" 2> "$tmp/stderr"
  local code=$?
  local why=""
  [ $code -eq 0 ] && why="exit code 0"
  [ -s "$tmp/stdout" ] && why="$why; printed on stdout"
  [ "$(wc -l < "$tmp/stderr")" -eq 1 ] || why="$why; stderr is not one line"
  grep -qF -- "$text" "$tmp/stderr" || why="$why; stderr lacks '$text'"
  if [ -n "$why" ]; then
    echo "FAIL $name:$why"
    sed 's/^/    stderr: /' "$tmp/stderr"
    failures=$((failures + 1))
  else
    passed=$((passed + 1))
  fi
}

expect unknown_strategy "'zigzag'" --strategy fcp,zigzag
printf '40000\n48000\n' > "$tmp/trace_88k.txt"
# Named by simulate's own flags: it has no --memory-limit, which the planner's message offered.
expect trace_over_cap "memory cap cannot hold the batch: 88000 tokens > 2 workers x 9011 tokens (--tokens-per-worker 8K with --trace, and --memory-slack 0.1): expected more tokens per worker or workers, or a larger slack" \
  --trace "$tmp/trace_88k.txt" --workers 2 --tokens-per-worker 8K
# ... by FCP's cells only: a baseline raises the cap to what its layout holds, and runs.
if ! "$fcp" simulate --trace "$tmp/trace_88k.txt" --workers 2 --tokens-per-worker 8K \
     --strategy ring --csv > "$tmp/ring.csv" 2> "$tmp/stderr" || [ "$(wc -l < "$tmp/ring.csv")" -ne 2 ]; then
  echo "FAIL trace_over_cap_ring: expected ring to run"; sed 's/^/    stderr: /' "$tmp/stderr"
  failures=$((failures + 1))
else
  passed=$((passed + 1))
fi
# An unknown name is named as unknown, before any repeat.
expect repeated_unknown_strategy "unknown --strategy 'zig'" --strategy zig,zig
# A repeat was averaged into its first's cell and printed halved figures.
expect repeated_strategy "--strategy lists 'fcp' twice: expected each strategy once" --strategy fcp,ring,fcp
expect zero_workers "--workers item '0'" --workers 0
expect zero_batches "--batches '0'" --batches 0
expect unknown_hardware "'tpu-v9'" --hardware tpu-v9
expect json_and_csv "--json and --csv" --json --csv
expect zero_block "--block-size '0'" --block-size 0
expect missing_trace "$tmp/missing.txt" --trace "$tmp/missing.txt"
expect bad_comm_ratio "--comm-ratio 'fast': expected a number from 0 to 100000, or hardware" \
  --comm-ratio fast
expect negative_comm_ratio "--comm-ratio '-1'" --comm-ratio -1
expect unknown_placement "unknown placement 'far'" --placement far
expect unknown_kernel_launch "invalid --kernel-launch 'fused': expected pair or stage" --kernel-launch fused
# The profile's launch unless told: h100 launches per stage; --kernel-launch pair times each
# pair apart, and a stage of several KV blocks per Q block then runs slower (fewer keys a kernel).
for launch in "" pair; do
  "$fcp" simulate --workers 16 --strategy fcp ${launch:+--kernel-launch $launch} > "$tmp/launch$launch.txt" 2> /dev/null
done
if ! grep -q "a launch per stage" "$tmp/launch.txt" || ! grep -q "a kernel per pair" "$tmp/launchpair.txt" ||
   ! awk 'FNR == 3 { t[FILENAME] = $6 } END { exit !(t[ARGV[1]] < t[ARGV[2]]) }' "$tmp/launch.txt" "$tmp/launchpair.txt"; then
  echo "FAIL kernel_launch: expected h100's stage launch, faster than --kernel-launch pair"
  cat "$tmp/launch.txt" "$tmp/launchpair.txt" | sed 's/^/    /'
  failures=$((failures + 1))
else
  passed=$((passed + 1))
fi
expect unknown_pipeline "invalid --pipeline 'async': expected lockstep or multibuffer" --pipeline async
# Lock-step unless told; the multi-buffer pipeline lets FCP's three buffers compute ahead of the
# stage before's transfers, so its step is shorter here (a stage's compute no longer waits for
# transfers it does not read).
for pipeline in lockstep multibuffer; do
  "$fcp" simulate --workers 32 --strategy fcp --pipeline $pipeline > "$tmp/pipeline_$pipeline.txt" 2> /dev/null
done
if ! awk 'FNR == 3 { t[FILENAME] = $6 } END { exit !(t[ARGV[2]] < t[ARGV[1]]) }' \
     "$tmp/pipeline_lockstep.txt" "$tmp/pipeline_multibuffer.txt"; then
  echo "FAIL pipeline: expected --pipeline multibuffer faster than lockstep"
  cat "$tmp/pipeline_lockstep.txt" "$tmp/pipeline_multibuffer.txt" | sed 's/^/    /'
  failures=$((failures + 1))
else
  passed=$((passed + 1))
fi
# Every cell's batch is checked before the first cell runs (the 1-worker cell used to run, with
# its progress on stderr, before the 2^20-worker one was refused).
expect later_cell_batch_too_large \
  "--workers 1048576 x --tokens-per-worker 8192 passes 4294967296 tokens: expected a smaller batch" \
  --strategy fcp --workers 1,1048576 --tokens-per-worker 8K
# A trace is one batch, used as given: --seed and --batches would be ignored.
printf '4096\n' > "$tmp/trace.txt"
expect seed_and_trace "--seed" --trace "$tmp/trace.txt" --seed 3
expect batches_and_trace "--batches" --trace "$tmp/trace.txt" --batches 2
expect trace_bad_tokens_per_worker "--tokens-per-worker 'garbage'" --trace "$tmp/trace.txt" \
  --tokens-per-worker garbage

# --placement reaches FCP's planner: each placement simulates the plan `fcp plan` makes with
# it (the same KV bytes), and on one 128K-token causal sequence over 16 workers they differ.
printf '131072\n' > "$tmp/one_sequence.txt"
placement_bytes=()
for placement in local lpt; do
  sim=$("$fcp" simulate --csv --trace "$tmp/one_sequence.txt" --workers 16 \
    --tokens-per-worker 8K --strategy fcp --placement $placement 2> /dev/null |
    /usr/bin/python3 -c 'import csv, sys; print(list(csv.DictReader(sys.stdin))[0]["transfer_bytes"])')
  planned=$("$fcp" plan --json --trace "$tmp/one_sequence.txt" --workers 16 \
    --tokens-per-worker 8K --placement $placement 2> /dev/null |
    /usr/bin/python3 -c 'import json, sys; d = json.load(sys.stdin); print(d["placement"], d["comm_bytes"])')
  if [ "$planned" = "$placement $sim" ]; then
    passed=$((passed + 1))
  else
    echo "FAIL placement_$placement: simulate moved '$sim' bytes, plan says '$planned'"
    failures=$((failures + 1))
  fi
  placement_bytes+=("$sim")
done
if [ "${placement_bytes[0]}" != "${placement_bytes[1]}" ]; then
  passed=$((passed + 1))
else
  echo "FAIL placements_differ: both moved ${placement_bytes[0]} bytes"
  failures=$((failures + 1))
fi

# Head-parallel baselines: Ulysses needs workers that split the heads, and is refused before
# any cell runs; USP is in the default list and, on one node of 8, is Ulysses itself.
expect ulysses_past_heads "--strategy ulysses on --workers 128 with --heads-q 64 and --heads-kv 8: expected worker counts that divide the query heads and divide or are a multiple of the key/value heads (usp runs at any count)" \
  --strategy ulysses --workers 16,128
expect ulysses_degree_illegal "usp with Ulysses degree 6 on 12 workers (8 per node) and 64 query and 8 key/value heads: expected a divisor of the workers that splits the heads, its groups each inside a node or whole nodes" \
  --strategy usp --workers 12 --ulysses-degree 6
# Refused before the 16-worker cell runs, as every cell's batch is.
expect ulysses_degree_later_cell "usp with Ulysses degree 8 on 12 workers" --strategy usp --workers 16,12 --ulysses-degree 8
expect ulysses_degree_unused "--ulysses-degree 8 without usp or fcp+ulysses in --strategy" --strategy fcp --ulysses-degree 8
"$fcp" simulate --workers 8 --csv > "$tmp/default.csv" 2> /dev/null
"$fcp" simulate --workers 8 --csv --strategy ulysses,usp,fcp+ulysses > "$tmp/heads.csv" 2> /dev/null
if /usr/bin/python3 - "$tmp/default.csv" "$tmp/heads.csv" <<'PY'; then
import csv, sys
default = [r["strategy"] for r in csv.DictReader(open(sys.argv[1]))]
assert default == ["fcp", "ring", "bytescale", "wlb", "magi", "megatron", "usp"], default
u, s, f = list(csv.DictReader(open(sys.argv[2])))
assert float(u["time_ms"]) > 0 and u["time_ms"] == s["time_ms"] and u["mfu"] == s["mfu"], (u, s)
assert f["strategy"] == "fcp+ulysses" and 0 < float(f["mfu"]) <= 1, f
PY
  passed=$((passed + 1))
else
  echo "FAIL head_parallel: usp missing from the defaults, or not Ulysses on one node"
  failures=$((failures + 1))
fi

# The table names each head-parallel cell's Ulysses degree: usp's tuned one (a fixed one here)
# and fcp+ulysses' node; "-" for the rest.
"$fcp" simulate --workers 16 --strategy fcp,usp,fcp+ulysses --ulysses-degree 4 > "$tmp/degrees" 2> /dev/null
if awk 'NR > 2 { got[$1] = $NF } END { exit !(got["fcp"] == "-" && got["usp"] == "4" && got["fcp+ulysses"] == "4") }' \
    "$tmp/degrees" && sed -n 2p "$tmp/degrees" | grep -q " ulysses$"; then
  passed=$((passed + 1))
else
  echo "FAIL ulysses_degree_column: $(cat "$tmp/degrees")"
  failures=$((failures + 1))
fi

# A refusal in a later cell (bytescale past its worker limit, after the 8-worker cells ran):
# nonzero exit, the error as stderr's last line (after progress lines), nothing on stdout.
"$fcp" simulate --workers 8,8192 --strategy fcp,bytescale --tokens-per-worker 1K \
  > "$tmp/stdout" 2> "$tmp/stderr"
code=$?
if [ $code -ne 0 ] && [ ! -s "$tmp/stdout" ] &&
   tail -1 "$tmp/stderr" | grep -q "bytescale on 8192 workers"; then
  passed=$((passed + 1))
else
  echo "FAIL later_cell_refusal: exit $code, $(wc -c < "$tmp/stdout") bytes on stdout"
  failures=$((failures + 1))
fi

# A small valid run: two strategies on 16 H100s, one batch, forward and backward.
check_json() {
  local why=""
  "$fcp" simulate --strategy fcp,ring --workers 16 --batches 1 --json > "$tmp/run.json" 2> "$tmp/run.err"
  local code=$?
  [ $code -eq 0 ] || why="exit code $code"
  /usr/bin/python3 - "$tmp/run.json" > "$tmp/check.out" 2>&1 <<'PY' || why="$why; $(cat "$tmp/check.out")"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
assert [r["strategy"] for r in rows] == ["fcp", "ring"], [r.get("strategy") for r in rows]
for r in rows:
    s = r["strategy"]
    assert r["workers"] == 16, (s, r["workers"])
    assert 0.01 < r["mfu"] <= 1.0, (s, "mfu", r["mfu"])
    assert r["time_ms"] > 0, (s, "time_ms", r["time_ms"])
    for k in ("compute", "comm"):
        assert 0.0 <= r["imbalance"][k] < 1.0, (s, "imbalance", k, r["imbalance"][k])
    # forward + backward make up the step.
    assert abs(r["forward_ms"] + r["backward_ms"] - r["time_ms"]) <= 1e-6 * r["time_ms"], s
    # How it was timed: h100's stage launch and multi-buffer pipeline.
    assert (r["hardware"], r["kernel_launch"], r["pipeline"]) == ("h100", "stage", "multibuffer"), s
PY
  if [ -n "$why" ]; then
    echo "FAIL valid_json:$why"
    failures=$((failures + 1))
  else
    passed=$((passed + 1))
  fi
}
check_json

# --timeline: one cell only, a writable path that is no input; a refusal writes nothing.
expect timeline_two_strategies "--timeline with 2 strategies and 1 worker counts: expected one --strategy and one --workers count" \
  --strategy fcp,ring --timeline "$tmp/refused.json"
expect timeline_batches "--timeline with --batches 2: expected 1" --strategy fcp --batches 2 --timeline "$tmp/refused.json"
expect timeline_no_directory "--timeline file" --strategy fcp --timeline "$tmp/missing/t.json"
expect timeline_is_trace "--timeline file" --strategy fcp --trace "$tmp/trace_88k.txt" --timeline "$tmp/trace_88k.txt"
if [ -e "$tmp/refused.json" ] || [ "$(cat "$tmp/trace_88k.txt")" != "$(printf '40000\n48000')" ]; then
  echo "FAIL timeline_refusal_wrote: a refused --timeline wrote or replaced a file"
  failures=$((failures + 1))
fi

# A trace against the run's own figures: every worker's passes and stages, the forward's
# busiest worker ending at forward_ms and the backward starting there, each worker's compute
# spans (which never overlap, nor do its message spans but the reshuffle out's two) summing
# on average to its breakdown's compute; the stages that are no plan stage by name (the
# reshuffle's, a head-parallel strategy's all-to-alls).
check_timeline() {
  local strategy=$1 why=""
  "$fcp" simulate --strategy "$strategy" --workers 16 --json --timeline "$tmp/t_$strategy.json" \
    > "$tmp/t_$strategy.out" 2> "$tmp/t.err" || why="exit code $?"
  /usr/bin/python3 - "$tmp/t_$strategy.json" "$tmp/t_$strategy.out" "$strategy" > "$tmp/check.out" 2>&1 <<'PY' || why="$why; $(cat "$tmp/check.out")"
import collections, json, sys
trace = json.load(open(sys.argv[1]))
record = json.loads(open(sys.argv[2]).read())
events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
assert names == {w: "worker %d" % w for w in range(16)}, names
lanes = collections.defaultdict(list)
for e in events:
    lanes[(e["pid"], e["tid"])].append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3, e["name"]))
forward_ms = record["forward_ms"]
ends = []
for w in range(16):
    passes = {name: (a, b) for a, b, name in lanes[(w, 2)]}
    assert set(passes) == {"forward", "backward"}, passes
    assert abs(passes["forward"][0]) < 1e-6, passes
    assert abs(passes["backward"][0] - forward_ms) < 1e-6 * forward_ms, (passes, forward_ms)
    ends.append(passes["forward"][1])
    for lane in (0, 1):
        # The one pair of stages whose messages may fly at once: the reshuffle out's two.
        spans = sorted(x for x in lanes[(w, lane)] if not x[2].endswith("reshuffle out after messages"))
        assert spans, (w, lane)
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            assert b0 <= a1 + 1e-6, ("overlap", w, lane, n0, n1)
assert abs(max(ends) - forward_ms) < 1e-6 * forward_ms, (max(ends), forward_ms)
busy = sum(b - a for w in range(16) for a, b, _ in lanes[(w, 0)]) / 16
compute_ms = record["breakdown_ms"]["compute"]
assert abs(busy - compute_ms) < 1e-6 * compute_ms, (busy, compute_ms)
text = " ".join(n for _, _, n in lanes[(0, 0)] + lanes[(0, 1)])
if sys.argv[3] == "usp":
    assert "forward all-to-all in" in text and "backward all-to-all out messages" in text, text
else:
    assert "forward stage 0" in text and "backward stage 1 messages" in text, text
    # The reshuffle in has its stage before stage 0; the outputs the last stage finishes, one
    # after it.
    for part in ("in", "out after"):
        assert "forward reshuffle %s messages" % part in text, (part, text)
PY
  if [ -n "$why" ]; then
    echo "FAIL timeline_$strategy:$why"
    failures=$((failures + 1))
  else
    passed=$((passed + 1))
  fi
}
check_timeline fcp
check_timeline usp

# --comm-ratio hardware tells FCP's planner the profile's link: H100, 16 workers (past one node,
# so the NIC's 50 GB/s), 989 TFLOP/s / 3.5 / 50 GB/s = 5651.43 cost units per byte, the same
# plan as that number given by hand; on this batch it differs from compute first (0).
check_ratio() {
  local cell="--strategy fcp --workers 16 --workload lognormal --tokens-per-worker 8K"
  cell="$cell --block-size 4K --hardware h100 --seed 3 --json"
  local hardware first byhand
  hardware=$("$fcp" simulate $cell --comm-ratio hardware 2>/dev/null)
  byhand=$("$fcp" simulate $cell --comm-ratio 5651.428571428571 2>/dev/null)
  first=$("$fcp" simulate $cell 2>/dev/null)
  bytes() { /usr/bin/python3 -c 'import json, sys; print(json.loads(sys.argv[1])["transfer_bytes"])' "$1"; }
  if [ -n "$hardware" ] && [ "$(bytes "$hardware")" = "$(bytes "$byhand")" ] &&
     [ "$(bytes "$hardware")" != "$(bytes "$first")" ]; then
    passed=$((passed + 1))
  else
    echo "FAIL hardware_ratio: transfer bytes hardware $(bytes "$hardware"), by hand" \
      "$(bytes "$byhand"), compute first $(bytes "$first")"
    failures=$((failures + 1))
  fi
}
check_ratio

echo "$passed passed, $failures failed"
[ $failures -eq 0 ]
