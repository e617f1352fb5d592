#!/usr/bin/env bash
# examples/train_gpt.py on the same batches four ways: one process x 2 threads without context
# parallelism (the reference), FCP on 2 ranks x 1 thread in both layouts, and ring attention on
# 2 ranks x 1 thread (FCP's executor running the ring plan). Prints per-run losses against the
# reference, median step times (steps 1.. : step 0 warms up) and their ratios, and draws the loss
# curves. Recorded in docs/training.md.
# Usage: bench/train_bench.sh [OUT_DIR] [STEPS] [extra train_gpt.py arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-out}
steps=${2:-20}
shift 2 || shift $# || true
mkdir -p "$out"
export FCP_PYTHON_PATH=${FCP_BUILD_DIR:-build}/python
train=(examples/train_gpt.py --steps "$steps" "$@")
launch=(examples/launch.sh 2)
quiet() { grep -v "^\*\|WARNING\|Setting OMP" || true; }
echo "== local: 1 process x 2 threads =="
/usr/bin/python3 "${train[@]}" --attention local --threads 2 --json "$out/train_local.json"
for run in "fcp transparent" "fcp dispatched" "ring transparent"; do
  set -- $run
  echo "== $1 ($2): 2 ranks x 1 thread =="
  "${launch[@]}" "${train[@]}" --attention "$1" --layout "$2" --threads 1 --json "$out/train_$1_$2.json" 2>&1 | quiet
done
/usr/bin/python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
ref = json.load(open(f"{out}/train_local.json"))
def summary(run):
    times = [e["step_s"] for e in run["log"][1:]] or [run["log"][0]["step_s"]]
    share = statistics.median(e["attention_share"] for e in run["log"][1:] or run["log"])
    return statistics.median(times), share
ref_t, ref_share = summary(ref)
print(f"{'run':28s} {'worst rel. loss diff':>20s} {'median step s':>14s} {'x local':>8s} {'attn share':>10s}")
print(f"{'local, 1 x 2 threads':28s} {'-':>20s} {ref_t:14.3f} {1.0:8.3f} {100 * ref_share:9.1f}%")
times = {}
for name in ("fcp_transparent", "fcp_dispatched", "ring_transparent"):
    run = json.load(open(f"{out}/train_{name}.json"))
    diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(run["log"], ref["log"]))
    t, share = summary(run)
    times[name] = t
    print(f"{name + ', 2 x 1 thread':28s} {diff:20.2e} {t:14.3f} {t / ref_t:8.3f} {100 * share:9.1f}%")
print(f"ring / fcp (transparent) step time: {times['ring_transparent'] / times['fcp_transparent']:.3f}")
PY
/usr/bin/python3 - "$out" <<'PY'
import json, sys
sys.path.insert(0, "examples")
import train_gpt
out = sys.argv[1]
runs = [json.load(open(f"{out}/train_{n}.json")) for n in ("local", "fcp_transparent", "fcp_dispatched",
                                                             "ring_transparent")]
train_gpt.plot(runs, f"{out}/train_loss.png")
print(f"wrote {out}/train_loss.png")
PY
