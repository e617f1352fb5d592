#!/usr/bin/env bash
# The main job: install what is missing, build, plan the built-in default workload, then run
# FCP and ring attention on 2 MPI ranks at GPU-X's compute-to-communication ratio and print
# the comparison (about a minute on 2 cores). Extra arguments are passed to `fcp plan`;
# FCP_RUN_ARGS adds arguments to `fcp run` (e.g. FCP_RUN_ARGS="--comm-ratio 0").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
fcp="${FCP_BUILD_DIR:-build}"/apps/fcp/fcp
"$fcp" plan "$@"
echo
# mpirun refuses root unless told; --oversubscribe lets 2 ranks run where fewer cores show.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# shellcheck disable=SC2086
mpirun -n 2 --oversubscribe "$fcp" run --comm-ratio 5920 --warmup 1 --repeats 1 ${FCP_RUN_ARGS:-}
