#!/usr/bin/env bash
# examples/train_gpt.py for 3 steps: FCP on 2 ranks (both layouts, torch.distributed.run over
# gloo) and ring give the same per-step losses as one process without context parallelism
# (--attention local), within 1e-4 relative, and so does FCP with Ulysses inside nodes of 2 ranks
# on 4 ranks (--ulysses 2, the paper's deployment); and FCP planning each batch a step ahead
# (--plan-ahead) gives exactly the losses of FCP planning it in line.
# Usage: train_equivalence_test.sh SOURCE_DIR PYTHON_PACKAGE_DIR
set -euo pipefail
src=$1
export FCP_PYTHON_PATH=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
train=("$src/examples/train_gpt.py" --steps 3 --batch-tokens 8192 --threads 1)
launch=(bash "$src/examples/launch.sh" 2)
/usr/bin/python3 "${train[@]}" --attention local --json "$dir/local.json" >/dev/null
"${launch[@]}" "${train[@]}" --attention fcp --layout transparent --json "$dir/fcp_t.json" >/dev/null 2>&1
"${launch[@]}" "${train[@]}" --attention fcp --layout dispatched --json "$dir/fcp_d.json" >/dev/null 2>&1
"${launch[@]}" "${train[@]}" --attention ring --json "$dir/ring.json" >/dev/null 2>&1
bash "$src/examples/launch.sh" 4 "${train[@]}" --attention fcp --ulysses 2 --json "$dir/fcp_u.json" >/dev/null 2>&1
"${launch[@]}" "${train[@]}" --attention fcp --layout dispatched --plan-ahead \
    --json "$dir/fcp_ahead.json" >/dev/null 2>&1
/usr/bin/python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
ref = [e["loss"] for e in json.load(open(f"{d}/local.json"))["log"]]
bad = 0
for name in ("fcp_t", "fcp_d", "ring", "fcp_u"):
    run = json.load(open(f"{d}/{name}.json"))
    got = [e["loss"] for e in run["log"]]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    ok = len(got) == len(ref) == 3 and worst <= 1e-4
    bad += not ok
    print(f"{name}: {run['ranks']} ranks, losses {', '.join(f'{x:.6f}' for x in got)} vs local "
          f"{', '.join(f'{x:.6f}' for x in ref)}: worst relative difference {worst:.1e} {'ok' if ok else 'FAILED'}")
inline = [e["loss"] for e in json.load(open(f"{d}/fcp_d.json"))["log"]]
ahead = [e["loss"] for e in json.load(open(f"{d}/fcp_ahead.json"))["log"]]
same = ahead == inline and len(ahead) == 3
bad += not same
print(f"fcp_d planned ahead: losses {', '.join(f'{x:.9f}' for x in ahead)}: "
      f"{'the same as in line' if same else 'NOT the same as in line: FAILED'}")
sys.exit(1 if bad else 0)
PY
