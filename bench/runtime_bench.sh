#!/usr/bin/env bash
# FCP versus ring attention on 2 MPI ranks x 1 thread, lognormal workload, CPU-sized model
# (8/1 heads x 64, fp32, 2K blocks), on one batch: at this machine's own bandwidth and at
# GPU-X's compute-to-communication ratio (--comm-ratio 5920). Prints both tables and writes
# the GPU-X timeline (Chrome trace and PNG) into OUT_DIR. Recorded in docs/runtime.md.
# Usage: bench/runtime_bench.sh [OUT_DIR] [extra fcp run arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-out}
shift || true
mkdir -p "$out"
fcp=${FCP_BUILD_DIR:-build}/apps/fcp/fcp
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
common=(--workload lognormal --seed 0 --tokens-per-worker 16K --threads 1 --warmup 1 --repeats 2 "$@")
echo "== machine bandwidth (uncapped) =="
mpirun -n 2 --oversubscribe "$fcp" run "${common[@]}" --comm-ratio 0 | tee "$out/runtime_uncapped.txt"
echo "== GPU-X ratio (--comm-ratio 5920) =="
mpirun -n 2 --oversubscribe "$fcp" run "${common[@]}" --comm-ratio 5920 --timeline "$out/runtime_gpux_trace.json" \
  | tee "$out/runtime_gpux.txt"
/usr/bin/python3 bench/runtime_timeline_plot.py "$out/runtime_gpux_trace.json" "$out/runtime_gpux_timeline.png"
