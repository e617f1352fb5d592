#!/usr/bin/env bash
# Every strategy on 2 MPI ranks x 1 thread, in both layouts of the API (transparent: the caller's
# layout, each pass reshuffles; dispatched: tensors moved into FCP's layout once), at this
# machine's own bandwidth and at GPU-X's compute-to-communication ratio (--comm-ratio 5920), on
# one lognormal batch of at least 8 sequences (seed 1: 10 sequences, 32K tokens), CPU-sized model
# (8/1 heads x 64, fp32, 2K blocks). Prints the tables (fwd/bwd ms, bytes moved, wall / physical
# bound) and writes the GPU-X timeline of FCP (Chrome trace and PNG) into OUT_DIR. Recorded in
# docs/runtime.md.
# Usage: bench/runtime_bench.sh [OUT_DIR] [extra fcp run arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-out}
shift || true
mkdir -p "$out"
fcp=${FCP_BUILD_DIR:-build}/apps/fcp/fcp
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
common=(--workload lognormal --seed 1 --tokens-per-worker 16K --threads 1 --warmup 1 --repeats 2
        --strategy fcp,ring,bytescale,wlb,magi,megatron "$@")
for ratio in 0 5920; do
  for layout in transparent dispatched; do
    name=runtime_ratio${ratio}_${layout}
    echo "== --comm-ratio $ratio (0: uncapped), --layout $layout =="
    extra=()
    if [ "$ratio" = 5920 ] && [ "$layout" = transparent ]; then extra=(--timeline "$out/runtime_gpux_trace.json"); fi
    mpirun -n 2 --oversubscribe "$fcp" run "${common[@]}" --comm-ratio "$ratio" --layout "$layout" \
      "${extra[@]}" | tee "$out/$name.txt"
  done
done
/usr/bin/python3 bench/runtime_timeline_plot.py "$out/runtime_gpux_trace.json" "$out/runtime_gpux_timeline.png"
