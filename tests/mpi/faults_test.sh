#!/usr/bin/env bash
# Faults on real MPI ranks (faults_mpi_test.cc, a transport wrapper): a rank that exits and a
# rank that stops answering, each at its first send after the batch is planned, end the job
# nonzero within seconds, the other ranks with a transport error naming the wait that timed
# out (or, when a peer exited, ended by the launcher, which may be quicker than the timeout).
# Without a fault the same program completes, so the wrapper alone changes nothing.
# Usage: faults_test.sh FAULTS_MPI_TEST MPIEXEC
set -u
prog=$1
mpirun=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
fail() { echo "FAILED: $*"; failures=$((failures + 1)); }

# expect_error NAME PATTERN MAX_SECONDS RANKS MODE FAULT_RANK: nonzero exit within MAX_SECONDS
# and stderr matching PATTERN.
expect_error() {
  local name=$1 pattern=$2 limit=$3 ranks=$4
  shift 4
  local start=$SECONDS
  timeout 60 "$mpirun" -n "$ranks" --oversubscribe "$prog" "$@" >"$dir/out" 2>"$dir/err"
  local rc=$? elapsed=$((SECONDS - start)) before=$failures
  if [ "$rc" -eq 0 ]; then fail "$name: exit code 0"; cat "$dir/out" "$dir/err"; return; fi
  if [ "$rc" -eq 124 ]; then fail "$name: still running after 60 s (killed by timeout)"; fi
  if [ "$elapsed" -gt "$limit" ]; then fail "$name: took ${elapsed}s, more than ${limit}s"; fi
  if ! grep -qE "$pattern" "$dir/err"; then fail "$name: stderr lacks /$pattern/:"; cat "$dir/err"; fi
  if grep -q "FAILED" "$dir/out"; then fail "$name:"; cat "$dir/out"; fi
  [ "$failures" -eq "$before" ] || return
  echo "ok: $name (exit $rc after ${elapsed}s): $(grep -E "$pattern" "$dir/err" | head -1)"
}

# No fault: the wrapper passes everything through.
if ! timeout 60 "$mpirun" -n 2 --oversubscribe "$prog" none 1 >"$dir/out" 2>"$dir/err"; then
  fail "no fault: nonzero exit"; cat "$dir/out" "$dir/err"
elif ! grep -q "none: forward and backward completed on 2 ranks" "$dir/out"; then
  fail "no fault: no completion line"; cat "$dir/out"
else
  echo "ok: $(cat "$dir/out")"
fi
cp "$dir/out" "$dir/none.out"

# A peer that dies after the plan agreement: rank 0 times out on it (a transport error) or the
# launcher ends it first.
expect_error "peer exits" \
  "rank 0: (transport error: rank 0: timed out after 2 s waiting for|ended by the MPI launcher)" \
  20 2 exit 1

# A peer that stops answering: the rank waiting on it gives up after the 2 s timeout.
expect_error "peer stops answering" \
  "rank 0: transport error: rank 0: timed out after 2 s waiting for" 20 2 stall 1
# Three ranks, rank 0 hung: one of the others gives up first and ends the job.
expect_error "rank 0 stops answering (3 ranks)" \
  "rank [12]: transport error: rank [12]: timed out after 2 s waiting for" 20 3 stall 0

# A rank late to the plan agreement: the others time out on the allreduce, which stays posted,
# so their transport refuses the next batch, naming that timeout (the late rank would have met
# the stale allreduce as if agreed).
expect_error "rank late to an allreduce" \
  "rank 0: transport error: rank 0: this transport abandoned messages after an earlier error \(rank 0: timed out after 2 s waiting for an allreduce" \
  20 2 late 1

# A pass that fails on every rank with messages posted (rank 1's first send waits past rank 0's
# timeout, then throws), then the same batch again on the same transport: the transports
# withdrew those messages but still take part in the plan agreement, so both ranks hear its
# verdict on the failed call (a transport that refused the agreement once it had withdrawn
# messages fails this: each rank then says only that messages were abandoned, or, where one
# rank withdrew none, that rank times out on the agreement).
expect_error "a failed pass, then the next agreement on every rank" \
  "rank [01]: second attempt: transport error: rank [01]: a call of an earlier batch over this transport threw" \
  20 2 pause 1
heard=$(grep -cE "second attempt: transport error: rank [01]: a call of an earlier batch over this transport threw after it had sent or posted messages" "$dir/err")
[ "$heard" -eq 2 ] || { fail "a failed pass, then the next agreement: $heard of 2 ranks heard the verdict"; cat "$dir/err"; }

# A message a byte short or long (a peer on another plan or tensor shape): the receiver fails
# with a transport error naming the sizes (or MPI's truncation), never reads stale bytes.
expect_error "message one byte short" \
  "transport error: rank 0: a receive of [0-9]+ bytes from rank 1 .* got [0-9]+ bytes: expected" \
  20 2 short 1
# Open MPI 4.1's shared-memory single copy (vader with CMA) writes the whole longer message
# past the receive buffer instead of truncating it (seen under ASan: a heap overflow inside
# process_vm_readv); with copy-in/copy-out it reports MPI_ERR_TRUNCATE as the standard says.
# FCP's own defence is that ranks agree on the plan digest before any message moves.
OMPI_MCA_btl_vader_single_copy_mechanism=none \
  expect_error "message one byte long" "transport error: rank 0: .*(truncat|TRUNCATE)" 20 2 long 1

# A slow link (every message of rank 1 leaves 50 ms late): the passes complete, with the same
# result as without a fault.
reference=$(sed -n 's/.*checksum //p' "$dir/none.out")
if ! timeout 60 "$mpirun" -n 2 --oversubscribe "$prog" slow 1 >"$dir/out" 2>"$dir/err"; then
  fail "slow link: nonzero exit"; cat "$dir/out" "$dir/err"
elif ! grep -q "slow: forward and backward completed on 2 ranks" "$dir/out"; then
  fail "slow link: no completion line"; cat "$dir/out"
elif ! awk -v a="$reference" -v b="$(sed -n 's/.*checksum //p' "$dir/out")" \
    'BEGIN { d = a - b; if (d < 0) d = -d; s = a < 0 ? -a : a; exit !(a != "" && d <= 1e-5 * (s + 1)) }'; then
  fail "slow link: checksum $(sed -n 's/.*checksum //p' "$dir/out"), expected $reference"
else
  echo "ok: slow link: $(cat "$dir/out")"
fi

[ "$failures" -eq 0 ] && echo "all passed" || { echo "$failures failed"; exit 1; }
