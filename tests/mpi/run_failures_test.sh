#!/usr/bin/env bash
# `fcp run` failure paths: bad input gives one line and a nonzero exit (nothing written); a
# plan mismatch (one rank's seed differs) ends the job with a clear error on every rank within
# seconds; --check passes with a reference slower than --timeout and fails every rank above
# --tolerance. (A peer that exits or stops answering: faults_test.sh, through the library.)
# Usage: run_failures_test.sh FCP MPIEXEC
set -u
fcp=$1
mpirun=$2
tiny=(run --tokens-per-worker 2K --block-size 512 --heads-q 2 --heads-kv 1 --head-dim 16
      --warmup 0 --repeats 1)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
fail() { echo "FAILED: $*"; failures=$((failures + 1)); }

# expect_error NAME PATTERN MAX_SECONDS COMMAND...: nonzero exit within MAX_SECONDS and stderr
# matching PATTERN.
expect_error() {
  local name=$1 pattern=$2 limit=$3
  shift 3
  local start=$SECONDS
  timeout 60 "$@" >"$dir/out" 2>"$dir/err"
  local rc=$? elapsed=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then fail "$name: exit code 0"; return; fi
  if [ "$elapsed" -gt "$limit" ]; then fail "$name: took ${elapsed}s, more than ${limit}s"; fi
  if ! grep -qE "$pattern" "$dir/err"; then fail "$name: stderr lacks /$pattern/:"; cat "$dir/err"; fi
  echo "ok: $name (exit $rc after ${elapsed}s): $(grep -E "$pattern" "$dir/err" | head -1)"
}

# Bad input, without mpirun (one line, exit 1, no timeline written).
for args in "--strategy magic" "--dtype fp16" "--layout zigzag" "--repeats 0" "--block-size 0" "--workload nope" \
            "--trace $dir/missing.txt" "--comm-ratio -1" "--heads-q 3 --heads-kv 2" "--buffers 1" \
            "--curve $dir/missing_curve.json" "--curve tpu-v9"; do
  rm -f "$dir/trace.json"
  # shellcheck disable=SC2086
  "$fcp" run $args --timeline "$dir/trace.json" >"$dir/out" 2>"$dir/err"
  rc=$?
  if [ "$rc" -eq 0 ] || [ "$(wc -l <"$dir/err")" -ne 1 ] || [ -e "$dir/trace.json" ]; then
    fail "bad input '$args': exit $rc, stderr:"; cat "$dir/err"
  else
    echo "ok: bad input '$args': $(cat "$dir/err")"
  fi
done

# refuse NAME TEXT ARGS...: `fcp run ARGS` without mpirun gives one line containing TEXT, a
# nonzero exit, nothing on stdout and no timeline.
refuse() {
  local name=$1 text=$2
  shift 2
  rm -f "$dir/trace.json"
  "$fcp" run "$@" --timeline "$dir/trace.json" >"$dir/out" 2>"$dir/err"
  local rc=$?
  if [ "$rc" -eq 0 ] || [ -s "$dir/out" ] || [ "$(wc -l <"$dir/err")" -ne 1 ] ||
     ! grep -qF -- "$text" "$dir/err" || [ -e "$dir/trace.json" ]; then
    fail "$name: exit $rc, expected one line with '$text', stderr:"; cat "$dir/err"
  else
    echo "ok: $name: $(cat "$dir/err")"
  fi
}
echo 4096 >"$dir/trace_4k.txt"
model=(--block-size 512 --heads-q 2 --heads-kv 1 --head-dim 16 --warmup 0 --repeats 1)
# A trailing comma is an empty strategy name, as in fcp simulate (it used to be dropped).
refuse "--strategy fcp," "unknown --strategy '': expected fcp" --strategy fcp,
# Ulysses and USP move heads, not KV blocks: the simulator times them, no executor runs them.
refuse "--strategy usp" "--strategy usp is simulated only (fcp simulate): expected fcp" --strategy fcp,usp
# FCP with Ulysses inside nodes runs (below); its degree needs it, and the transparent layout.
refuse "--ulysses-degree without fcp+ulysses" \
  "--ulysses-degree 2 without fcp+ulysses in --strategy: expected it with fcp+ulysses" --ulysses-degree 2
refuse "fcp+ulysses dispatched" "--strategy fcp+ulysses with --layout dispatched: expected the transparent" \
  --strategy fcp+ulysses --layout dispatched
# With --trace, --tokens-per-worker is parsed and used as in fcp plan --trace: the share and so
# the memory budget (it used to be ignored, even 'garbage').
refuse "--trace with --tokens-per-worker garbage" "invalid --tokens-per-worker 'garbage'" \
  --trace "$dir/trace_4k.txt" --tokens-per-worker garbage
refuse "--trace with --tokens-per-worker 1K" "memory cap cannot hold the batch: 4096 tokens > 1 rank x 1126 tokens (the budget --tokens-per-worker 1K sets with --trace, and --memory-slack 0.1): expected a larger budget or slack, or more ranks" \
  --trace "$dir/trace_4k.txt" --tokens-per-worker 1K "${model[@]}"
refuse "--memory-limit 1K" "memory cap cannot hold the batch: 4096 tokens > 1 rank x 1126 tokens (the budget --memory-limit 1K sets, and --memory-slack 0.1): expected a larger budget or slack, or more ranks" \
  --trace "$dir/trace_4k.txt" --memory-limit 1K "${model[@]}"
# A batch past 2^32 tokens is named by its flag, as in fcp plan.
refuse "--tokens-per-worker 5G" \
  "1 rank x --tokens-per-worker 5368709120 passes 4294967296 tokens: expected a smaller batch" \
  --tokens-per-worker 5G
refuse "--tolerance 0" "invalid --tolerance '0': expected a finite number above 0, up to 1e+06" \
  --tolerance 0
refuse "--timeout 0" "invalid --timeout '0': expected a finite number above 0, up to 86400" --timeout 0
refuse "--tolerance without --check" \
  "--tolerance 0.001 without --check: expected --check too (the tolerance is what it accepts)" \
  --tolerance 1e-3
# One-token sequences: the exact dQ and dK are zero, so the check holds the run's rounding to
# the tolerance as an RMS error (it was infinite, and the check failed).
printf '1\n1\n' >"$dir/ones.txt"
if ! "$fcp" run --trace "$dir/ones.txt" --check --json "${model[@]}" >"$dir/out" 2>"$dir/err" ||
   grep -q null "$dir/out"; then
  fail "--check of one-token sequences: expected a pass with finite errors"; cat "$dir/out" "$dir/err"
else
  echo "ok: --check of one-token sequences passes"
fi
# The help gives the ranges the flags accept (0 is refused) and the tolerance by dtype.
"$fcp" run --help >"$dir/help"
if grep -E -A1 -- "--(tolerance|timeout) " "$dir/help" | grep -q "\[0 to" ||
   [ "$(grep -c "\[above 0, up to" "$dir/help")" -ne 2 ] ||
   ! grep -q "default 1e-5 with --dtype fp32, 1e-2 with bf16" "$dir/help"; then
  fail "fcp run --help: --tolerance and --timeout should read [above 0, up to ...]"
  grep -E -A1 -- "--(tolerance|timeout) " "$dir/help"
else
  echo "ok: fcp run --help gives --tolerance and --timeout as above 0"
fi

# A batch past 2^32 tokens on 2 ranks: every rank names the flag (it used to say "invalid batch
# size 8589934592 tokens").
expect_error "--tokens-per-worker 4G on 2 ranks" \
  "2 ranks x --tokens-per-worker 4294967296 passes 4294967296 tokens: expected a smaller batch" 30 \
  "$mpirun" -n 2 "$fcp" run --tokens-per-worker 4G
if [ "$(grep -cE '^fcp: error: rank [01]: 2 ranks x --tokens-per-worker' "$dir/err")" -ne 2 ]; then
  fail "--tokens-per-worker 4G: expected the error on both ranks"; cat "$dir/err"
fi

# A budget is checked against every rank's cap, not one rank's: 2K a rank holds a 4096-token
# batch on 2 ranks (it was refused as "4096 tokens > 2 ranks x 2252 tokens"), 1K does not.
if ! timeout 60 "$mpirun" -n 2 "$fcp" run --trace "$dir/trace_4k.txt" --memory-limit 2K \
     "${model[@]}" >"$dir/out" 2>"$dir/err" || ! grep -q "^  fcp " "$dir/out"; then
  fail "--memory-limit 2K on 2 ranks: expected a run, stderr:"; cat "$dir/err"
else
  echo "ok: --memory-limit 2K holds 4096 tokens on 2 ranks"
fi
expect_error "--memory-limit 1K on 2 ranks" \
  "rank [01]: memory cap cannot hold the batch: 4096 tokens > 2 ranks x 1126 tokens \\(the budget --memory-limit 1K sets" \
  30 "$mpirun" -n 2 "$fcp" run --trace "$dir/trace_4k.txt" --memory-limit 1K "${model[@]}"

# Batch mismatch: rank 1 samples its batch with another seed. Both ranks must say so.
expect_error "batch mismatch" "the ranks passed different batches" 20 \
  "$mpirun" -n 1 "$fcp" "${tiny[@]}" --seed 1 : -n 1 "$fcp" "${tiny[@]}" --seed 2
if [ "$(grep -c 'the ranks passed different batches' "$dir/err")" -ne 2 ]; then
  fail "batch mismatch: expected the error on both ranks"; cat "$dir/err"
fi

# And the happy path agrees with the reference.
if ! "$mpirun" -n 2 "$fcp" "${tiny[@]}" --check --json >"$dir/out" 2>"$dir/err"; then
  fail "2-rank --check run"; cat "$dir/err"
elif [ "$(grep -c '"rel_error"' "$dir/out")" -ne 2 ]; then
  fail "--json: expected one object per strategy with rel_error"; cat "$dir/out"
else
  echo "ok: 2-rank --check --json"
fi

# FCP with Ulysses inside nodes of 2 ranks on 4 ranks (2 nodes; 2 query heads and 1 key/value
# head, replicated on both members) agrees with the reference too, with its node's exchanges
# counted in its bytes; a degree that does not divide the ranks is refused on every rank.
if ! "$mpirun" -n 4 "$fcp" "${tiny[@]}" --strategy fcp,fcp+ulysses --check --json >"$dir/out" 2>"$dir/err"; then
  fail "4-rank fcp+ulysses --check run"; cat "$dir/err"
elif ! /usr/bin/python3 -c '
import json, sys
fcp, uly = [json.loads(line) for line in open(sys.argv[1])]
assert uly["strategy"] == "fcp+ulysses" and max(uly["rel_error"].values()) <= 1e-5, uly
assert uly["comm_bytes"] > 0 and uly["fwd_ms"] > 0, uly' "$dir/out"; then
  fail "fcp+ulysses --check --json"; cat "$dir/out"
else
  echo "ok: 4-rank fcp+ulysses --check"
fi
expect_error "--ulysses-degree 3 on 4 ranks" \
  "fcp\+ulysses with --ulysses-degree 3 on 4 ranks and 2 query and 1 key/value heads: expected a divisor" \
  30 "$mpirun" -n 4 "$fcp" "${tiny[@]}" --strategy fcp+ulysses --ulysses-degree 3
if [ "$(grep -c 'expected a divisor of the ranks' "$dir/err")" -ne 4 ]; then
  fail "--ulysses-degree 3: expected the error on all 4 ranks"; cat "$dir/err"
fi

# A reference slower than --timeout: one causal sequence of 4096 tokens with 128-wide heads is
# ~30 GFLOP of float64 reference on rank 0 (~5 s here, over 60 s under ASan on a loaded machine:
# hence the long guard), while each pass takes well under a
# second. The other ranks wait for the verdict as long as the reference may take, so the check
# passes with --timeout 1. The run must take longer than the timeout, or the case would test
# nothing (a much faster reference would need a larger batch here).
echo 4096 >"$dir/one_sequence.txt"
start=$SECONDS
if ! timeout 400 "$mpirun" -n 2 "$fcp" run --trace "$dir/one_sequence.txt" --block-size 512 \
     --heads-q 2 --heads-kv 1 --head-dim 128 --warmup 0 --repeats 1 --check --timeout 1 --json \
     >"$dir/out" 2>"$dir/err"; then
  fail "--check slower than --timeout"; cat "$dir/err"
elif [ "$(grep -c '"rel_error"' "$dir/out")" -ne 2 ]; then
  fail "--check slower than --timeout: expected rel_error per strategy"; cat "$dir/out"
elif [ $((SECONDS - start)) -lt 3 ]; then
  fail "--check slower than --timeout: only $((SECONDS - start)) s: the reference may not have outlasted --timeout 1"
else
  echo "ok: --check slower than --timeout ($((SECONDS - start))s)"
fi

# A check that fails (an impossible tolerance) is a nonzero exit on every rank, not a hang.
expect_error "check above tolerance" "relative L2 error \(RMS where the reference is all zeros\) above --tolerance" 30 \
  "$mpirun" -n 2 "$fcp" "${tiny[@]}" --check --tolerance 1e-15
# With --json there is no table: the error points at the records' rel_error.
expect_error "check above tolerance, --json" \
  "relative L2 error \(RMS where the reference is all zeros\) above --tolerance 1e-15 \(see rel_error in the JSON records\)" 30 \
  "$mpirun" -n 2 "$fcp" "${tiny[@]}" --check --tolerance 1e-15 --json
if grep -q "see the table" "$dir/err"; then fail "--check --json: the error names a table"; fi

# bf16 passes --check at its default tolerance (1e-2; its own rounding gives ~2.5e-3, so the
# fp32 default 1e-5 failed every bf16 run).
if ! "$mpirun" -n 2 "$fcp" "${tiny[@]}" --dtype bf16 --check --json >"$dir/out" 2>"$dir/err"; then
  fail "bf16 --check at the default tolerance"; cat "$dir/err"
elif [ "$(grep -c '"rel_error"' "$dir/out")" -ne 2 ]; then
  fail "bf16 --check --json: expected rel_error per strategy"; cat "$dir/out"
else
  echo "ok: bf16 --check at the default tolerance"
fi

# Rank 0 fails to write --timeline after the run (a name the up-front check accepts, 250
# bytes, whose temporary name, 7 bytes longer, passes NAME_MAX): rank 0 says why, the other
# rank says the file was not written, one line each, every rank exits 1, in seconds (rank 0
# used to wait --timeout for a rank that had finished and print a second line).
long="$dir/$(printf 't%.0s' $(seq 1 250))"
expect_error "--timeline unwritable after the run" \
  "^fcp: error: rank 0: cannot write --timeline file .*File name too long" 25 \
  "$mpirun" -n 2 "$fcp" "${tiny[@]}" --timeline "$long" --timeout 40
if [ "$(grep -c '^fcp:' "$dir/err")" -ne 2 ] ||
   [ "$(grep -c '^fcp: error: rank 1: the --timeline file was not written: rank 0 says why$' "$dir/err")" -ne 1 ]; then
  fail "--timeline unwritable: expected one line from each rank"; cat "$dir/err"
fi
# The failure came after the run (its table printed), not from the up-front check.
grep -q "^fcp run: " "$dir/out" || fail "--timeline unwritable: the run did not complete"
[ -e "$long" ] && fail "--timeline unwritable: a file was written"

# Only rank 0 writes --timeline, so only rank 0's directory is checked: a relative path whose
# directory exists where rank 0 runs and not where rank 1 does (a node-local directory on a
# multi-node job) runs and writes (every rank used to check, and rank 1 refused). Where rank 0
# lacks the directory, every rank refuses before the run, one line each.
mkdir -p "$dir/here/out" "$dir/there"
if ! "$mpirun" -n 1 --wdir "$dir/here" "$fcp" "${tiny[@]}" --timeline out/t.json : \
     -n 1 --wdir "$dir/there" "$fcp" "${tiny[@]}" --timeline out/t.json >"$dir/out" 2>"$dir/err" ||
   [ ! -s "$dir/here/out/t.json" ]; then
  fail "--timeline directory only on rank 0's side: the run failed or wrote nothing"; cat "$dir/err"
else
  echo "ok: --timeline directory only on rank 0's side: written"
fi
expect_error "--timeline directory missing on rank 0" \
  "^fcp: error: rank 0: cannot write --timeline file 'out/t.json': its directory 'out': No such file" 25 \
  "$mpirun" -n 1 --wdir "$dir/there" "$fcp" "${tiny[@]}" --timeline out/t.json : \
  -n 1 --wdir "$dir/here" "$fcp" "${tiny[@]}" --timeline out/t.json
if [ "$(grep -c '^fcp:' "$dir/err")" -ne 2 ] ||
   [ "$(grep -c '^fcp: error: rank 1: the --timeline file cannot be written: rank 0 says why$' "$dir/err")" -ne 1 ]; then
  fail "--timeline directory missing on rank 0: expected one line from each rank"; cat "$dir/err"
fi
grep -q "^fcp run: " "$dir/out" && fail "--timeline directory missing on rank 0: the run went ahead"

# Error lines of several ranks never interleave (issue 16: in 5 of 40 runs of `--heads-q abc`
# under mpirun two ranks' lines were mixed mid-line): each line goes out in one write and names
# its rank. The launcher may stop the other ranks before they print, so at least one line, and
# every line whole.
mixed=0
for i in $(seq 1 10); do
  "$mpirun" -n 4 "$fcp" run --heads-q abc >"$dir/out" 2>"$dir/err"
  whole=$(grep -cxE "fcp: error: rank [0-3]: invalid --heads-q 'abc': expected an integer from 1 to 1024" "$dir/err")
  if [ "$whole" -lt 1 ] || [ "$(grep -c 'fcp' "$dir/err")" -ne "$whole" ]; then
    mixed=$((mixed + 1)); cat "$dir/err"
  fi
done
[ "$mixed" -eq 0 ] && echo "ok: 10 runs of --heads-q abc on 4 ranks: every error line whole" ||
  fail "--heads-q abc on 4 ranks: $mixed of 10 runs had a line that was not whole"

# A batch too large to run (one 600K-token sequence: ~10 PFLOP) is refused in seconds, one
# whole line per rank, instead of filling memory for hours (issue 16).
echo 614400 >"$dir/one_600k.txt"
expect_error "600K-token sequence" "the batch needs about [0-9]+ TFLOP of attention per rank" 20 \
  "$mpirun" -n 2 "$fcp" run --trace "$dir/one_600k.txt"
if [ "$(grep -cE '^fcp: error: rank [01]: the batch needs about' "$dir/err")" -ne 2 ]; then
  fail "600K-token sequence: expected one whole line from each of the 2 ranks"; cat "$dir/err"
fi

[ "$failures" -eq 0 ] && echo "all passed" || { echo "$failures failed"; exit 1; }
