#!/usr/bin/env bash
# The planning rows of README's "Limits" table, timed: what `fcp plan` costs at the largest
# batches it accepts. One 23.7M-token sequence (the pair limit at 4K blocks, on the default 16
# workers) and 4096 workers x 1M tokens. Prints, per row, plan_ms with its largest phases, the
# command's wall time and its peak resident memory beside README's figures (measured on
# 2026-11-29), and whether the plan's digest is still the one it had then (a change for speed
# must not change the plan; a deliberate plan change updates the digests here). Exits nonzero
# when a digest changed. Each takes 10-60 s
# and up to 3 GB here.
# Two such rows went from 7 s to 48 s and from 23 s to 41 s of planning unnoticed between two
# measurements (docs/planner.md, session 29): run this after any change to the planner's
# arrays or loops and compare with the README.
# Usage: bench/limits_bench.sh [RUNS]   (RUNS per row, default 1; the machine is shared)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
if ! [[ $runs =~ ^[1-9][0-9]*$ ]]; then
  echo "invalid run count '$runs': expected a positive integer" >&2
  exit 2
fi
fcp=${FCP_BUILD_DIR:-build}/apps/fcp/fcp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo 23724032 >"$work/one-sequence.txt"
row() {
  local name=$1 readme=$2 digest=$3
  shift 3
  for _ in $(seq "$runs"); do
    /usr/bin/time -f '%e %M' -o "$work/time" "$fcp" plan "$@" --json >"$work/plan.json"
    /usr/bin/python3 - "$name" "$work/plan.json" "$work/time" "$readme" "$digest" <<'PY'
import json, sys
name, plan, timing, readme, digest = sys.argv[1:]
p = json.load(open(plan))
wall, kb = open(timing).read().split()[-2:]
phases = sorted(p["plan_ms_by_phase"].items(), key=lambda kv: -kv[1])[:3]
print(f"{name:28s} plan {p['plan_ms'] / 1000:6.1f} s ({', '.join(f'{k} {v / 1000:.1f}' for k, v in phases)}),"
      f" command {float(wall):5.1f} s, {int(kb) / 2**20:4.1f} GB, {p['blocks']} blocks,"
      f" {p['pairs']} pairs (README: {readme}); digest",
      "the same" if p["digest"] == digest else f"CHANGED: {p['digest']}, was {digest}")
sys.exit(0 if p["digest"] == digest else 1)
PY
  done
}
row "one 23.7M-token sequence" "8 s, 13 s, 2.4 GB" 7c88f159c6a012ee --trace "$work/one-sequence.txt"
row "4096 workers x 1M tokens" "7.1 s, 14 s, 2.9 GB" 3509d4544d23eecb --workers 4096 --tokens-per-worker 1M
