#!/usr/bin/env bash
# Planning time of one `fcp plan` command line for several fcp binaries, their runs alternated
# (the machine is shared and its speed drifts: only figures from one batch of runs compare).
# Prints, per binary, the median and least plan_ms and the median of each phase. A speed
# change is measured against the binary before it in the same batch (docs/planner.md).
#
#   scripts/plan_time.sh RUNS BINARY... -- PLAN-ARGS...
#   scripts/plan_time.sh 7 /tmp/fcp-before build/apps/fcp/fcp -- \
#       --workers 4096 --tokens-per-worker 32K
set -euo pipefail
python=/usr/bin/python3  # Debian's, as the other scripts (the one first on PATH may differ)
usage="usage: scripts/plan_time.sh RUNS BINARY... -- PLAN-ARGS..."
if [[ $# -lt 3 ]]; then
  echo "$usage" >&2
  exit 2
fi
runs=$1
shift
if ! [[ $runs =~ ^[1-9][0-9]*$ ]]; then
  echo "invalid run count '$runs': expected a positive integer; $usage" >&2
  exit 2
fi
binaries=()
while [[ $# -gt 0 && $1 != "--" ]]; do
  if [[ ! -x $1 ]]; then
    echo "not an executable: '$1'; $usage" >&2
    exit 2
  fi
  binaries+=("$1")
  shift
done
if [[ $# -eq 0 || ${#binaries[@]} -eq 0 ]]; then
  echo "$usage" >&2
  exit 2
fi
shift  # the --
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for ((i = 0; i < runs; ++i)); do
  for b in "${binaries[@]}"; do
    if ! json=$("$b" plan "$@" --json); then
      echo "$b plan $* failed" >&2
      exit 1
    fi
    printf '%s\t%s\n' "$b" "$json" >>"$out"
  done
done
"$python" - "$out" <<'EOF'
import collections, json, statistics, sys
totals = collections.defaultdict(list)
phases = collections.defaultdict(lambda: collections.defaultdict(list))
order = []
with open(sys.argv[1]) as f:
    for line in f:
        binary, text = line.rstrip("\n").split("\t", 1)
        record = json.loads(text)
        if binary not in order:
            order.append(binary)
        totals[binary].append(record["plan_ms"])
        for name, ms in record["plan_ms_by_phase"].items():
            phases[binary][name].append(ms)
for binary in order:
    t = totals[binary]
    by_phase = " ".join(f"{name} {statistics.median(v):.1f}" for name, v in phases[binary].items())
    print(f"{binary}: {len(t)} runs, plan_ms median {statistics.median(t):.1f} "
          f"(least {min(t):.1f}); phase medians: {by_phase}")
EOF
