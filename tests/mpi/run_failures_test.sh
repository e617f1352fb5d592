#!/usr/bin/env bash
# `fcp run` failure paths: bad input gives one line and a nonzero exit (nothing written); a
# plan mismatch (one rank's seed differs), a peer that exits early and a peer that stops
# answering all end the job with a clear error on the other ranks within seconds.
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

# Batch mismatch: rank 1 samples its batch with another seed. Both ranks must say so.
expect_error "batch mismatch" "the ranks passed different batches" 20 \
  "$mpirun" -n 1 "$fcp" "${tiny[@]}" --seed 1 : -n 1 "$fcp" "${tiny[@]}" --seed 2
if [ "$(grep -c 'the ranks passed different batches' "$dir/err")" -ne 2 ]; then
  fail "batch mismatch: expected the error on both ranks"; cat "$dir/err"
fi

# A peer that dies after the plan agreement: the others are ended with a message.
expect_error "peer exits early" "rank 0: ended by the MPI launcher" 20 \
  env FCP_FAULT_EXIT_RANK=1 "$mpirun" -x FCP_FAULT_EXIT_RANK -n 2 "$fcp" "${tiny[@]}"

# A peer that stops answering: the waiting rank times out and aborts the job.
expect_error "peer stops answering" "rank 0: timed out after 2 s waiting for" 20 \
  env FCP_FAULT_STALL_RANK=1 "$mpirun" -x FCP_FAULT_STALL_RANK -n 2 "$fcp" "${tiny[@]}" --timeout 2

# And the happy path agrees with the reference.
if ! "$mpirun" -n 2 "$fcp" "${tiny[@]}" --check --json >"$dir/out" 2>"$dir/err"; then
  fail "2-rank --check run"; cat "$dir/err"
elif [ "$(grep -c '"rel_error"' "$dir/out")" -ne 2 ]; then
  fail "--json: expected one object per strategy with rel_error"; cat "$dir/out"
else
  echo "ok: 2-rank --check --json"
fi

# A reference slower than --timeout (rank 0 made 4 s slower, --timeout 1): the other ranks
# wait for the verdict as long as the reference may take, so the check still passes.
start=$SECONDS
if ! timeout 60 env FCP_FAULT_CHECK_DELAY_SECONDS=4 "$mpirun" -x FCP_FAULT_CHECK_DELAY_SECONDS -n 2 "$fcp" \
     "${tiny[@]}" --check --timeout 1 --json >"$dir/out" 2>"$dir/err"; then
  fail "--check slower than --timeout"; cat "$dir/err"
elif [ "$(grep -c '"rel_error"' "$dir/out")" -ne 2 ] || [ $((SECONDS - start)) -lt 4 ]; then
  fail "--check slower than --timeout: no rel_error per strategy, or the delay did not happen"; cat "$dir/out"
else
  echo "ok: --check slower than --timeout"
fi

# A check that fails (an impossible tolerance) is a nonzero exit on every rank, not a hang.
expect_error "check above tolerance" "relative L2 error above --tolerance" 30 \
  "$mpirun" -n 2 "$fcp" "${tiny[@]}" --check --tolerance 1e-15

[ "$failures" -eq 0 ] && echo "all passed" || { echo "$failures failed"; exit 1; }
