#!/usr/bin/env bash
# Whether two fcp binaries make byte-identical plans (`fcp plan --plan-out`) on the 157
# configurations the planner's speed work has been checked on since session 13: 8-1024
# workers x the four workloads x 1K and 4K blocks x seeds 0-1 x both placements; the four
# workloads at 4096 workers; 8 and 32 workers at 128K tokens in 1K blocks; link-aware plans
# (--comm-ratio) at 16, 64 and 4096 workers. (Sessions 13-17 counted 165 plan files: 8
# workers at 128K were planned three times per seed under three names.) Prints each
# configuration whose plans differ and exits 1 if any does. About 5 minutes here; each plan
# is deleted once compared.
#
#   scripts/compare_plans.sh BEFORE AFTER
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: scripts/compare_plans.sh BEFORE AFTER (two fcp binaries)" >&2
  exit 2
fi
for b in "$1" "$2"; do
  if [[ ! -x $b ]]; then
    echo "not an executable: '$b'; usage: scripts/compare_plans.sh BEFORE AFTER" >&2
    exit 2
  fi
done
before=$1 after=$2
corpus="$(cd "$(dirname "$0")/.." && pwd)/data/workloads/code-corpus.txt"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
compared=0 differ=0
# One configuration: its name, then the arguments to `fcp plan`.
compare() {
  local name=$1
  shift
  for side in before after; do
    local bin=$before
    [[ $side == after ]] && bin=$after
    if ! "$bin" plan "$@" --plan-out "$work/$side.json" >/dev/null 2>"$work/$side.err"; then
      echo "$name: $bin failed: $(head -c 300 "$work/$side.err")" >&2
      exit 1
    fi
  done
  compared=$((compared + 1))
  if ! cmp -s "$work/before.json" "$work/after.json"; then
    echo "differ: $name (fcp plan $*)"
    differ=$((differ + 1))
  fi
}
for w in 8 64 256 1024; do
  for wl in lognormal lognormal-narrow bimodal "$corpus"; do
    for bs in 1K 4K; do
      for s in 0 1; do
        for pl in local lpt; do
          compare "$w-$(basename "$wl")-$bs-$s-$pl" --workers "$w" --workload "$wl" \
            --block-size "$bs" --seed "$s" --placement "$pl"
        done
      done
    done
  done
done
for wl in lognormal lognormal-narrow bimodal "$corpus"; do
  compare "4096-$(basename "$wl")" --workers 4096 --workload "$wl"
done
for s in 0 1 2 3; do
  for wl in bimodal lognormal "$corpus"; do
    compare "32x128K-$(basename "$wl")-$s" --workers 32 --tokens-per-worker 128K \
      --block-size 1K --workload "$wl" --seed "$s"
  done
  compare "8x128K-lognormal-narrow-$s" --workers 8 --tokens-per-worker 128K --block-size 1K \
    --workload lognormal-narrow --seed "$s"
done
for w in 16 64; do
  for s in 0 1; do
    for wl in lognormal "$corpus"; do
      compare "cr-$w-$(basename "$wl")-$s" --workers "$w" --tokens-per-worker 32K \
        --workload "$wl" --seed "$s" --comm-ratio 5651.43
    done
  done
done
compare cr-4096 --workers 4096 --tokens-per-worker 32K --comm-ratio 5651.43
echo "$compared configurations compared, $differ differ"
[[ $differ -eq 0 ]]
