#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, Clang, with ASan + UBSan) into ${FCP_FUZZ_BUILD_DIR:-build-fuzz}
# and runs each for ${1:-60} seconds (as many at a time as there are cores) from its corpus
# fuzz/corpus/<name>/. New inputs go to a temporary directory (the repository's corpus is only
# read). Prints executions and corpus size per target; exits nonzero if any target crashed,
# naming the input it saved: fix the bug, then add that input to fuzz/corpus/<name>/ so it
# stays a regression test (ctest fuzz.*_corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache (when CMake found it): hash paths relative to this tree, so another clone hits too.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
scripts/install_deps.sh
seconds=${1:-60}
build_dir=${FCP_FUZZ_BUILD_DIR:-build-fuzz}
targets=(trace plan hardware flags)

CXX=clang++ cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFCP_BUILD_FUZZERS=ON \
  -DFCP_SANITIZE=ON -DFCP_BUILD_TESTS=OFF -DFCP_BUILD_BENCH=OFF -DFCP_BUILD_PYTHON=OFF \
  -DFCP_INSTALL=OFF >/dev/null
fuzzers=()
for t in "${targets[@]}"; do fuzzers+=("fcp_${t}_fuzzer"); done
cmake --build "$build_dir" -j "$(nproc)" --target "${fuzzers[@]}"

work=$(mktemp -d)
declare -A pid status
# On any exit (a failed step, a cancelled CI run), no fuzzer is left running into $work.
trap 'kill "${pid[@]}" 2>/dev/null || true; wait; rm -rf "$work"' EXIT
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1
# The targets run side by side, as many at a time as there are cores, each for the full time
# on a core of its own (one after another they took 4 x 45 s of a CI run).
fuzz_one() {
  local t=$1
  mkdir -p "$work/$t" "$work/$t-crash"
  # exec: the job's PID is the fuzzer's own, so the exit trap stops the fuzzer itself.
  exec "$build_dir/fuzz/fcp_${t}_fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=65536 -artifact_prefix="$work/$t-crash/" "$work/$t" "fuzz/corpus/$t" \
    >"$work/$t.log" 2>&1
}
# finish TARGET: waits for its fuzzer and records how it ended.
finish() {
  wait "${pid[$1]}" && status[$1]=ok || status[$1]=CRASH
  unset "pid[$1]"  # ended: the trap must not signal a PID reused since
}
jobs=$(nproc)
running=()
for t in "${targets[@]}"; do
  if [ "${#running[@]}" -ge "$jobs" ]; then
    finish "${running[0]}"
    running=("${running[@]:1}")
  fi
  fuzz_one "$t" &
  pid[$t]=$!
  running+=("$t")
done
for t in "${running[@]}"; do finish "$t"; done
failed=0
for t in "${targets[@]}"; do
  log="$work/$t.log"
  if [ "${status[$t]}" != ok ]; then
    failed=1
    kept=build-fuzz-crashes/$t
    mkdir -p "$kept"
    cp "$work/$t-crash/"* "$kept/" 2>/dev/null || true
    tail -n 40 "$log"
  fi
  execs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -n 1)
  corpus=$(ls "fuzz/corpus/$t" | wc -l)
  found=$(ls "$work/$t" | wc -l)
  echo "fuzz: $t: ${status[$t]}, ${execs:-0} executions in ${seconds} s, corpus $corpus files (+$found new)"
done
if [ "$failed" -ne 0 ]; then
  echo "fuzz: crash inputs saved under build-fuzz-crashes/ (add each to fuzz/corpus/<target>/ once fixed)" >&2
fi
exit "$failed"
