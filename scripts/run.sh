#!/usr/bin/env bash
# The main job: install what is missing, build, plan the built-in default workload, run FCP and
# ring attention on 2 MPI ranks at GPU-X's compute-to-communication ratio on a batch of real
# document sizes and print the
# comparison, then train a small GPT through FCP from PyTorch for a few steps beside a
# one-process reference (about two minutes on 2 cores after the build). Extra arguments are passed to `fcp plan`;
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
# A realistic batch: documents drawn from real document sizes (data/workloads/code-corpus.txt,
# median 807 tokens), 8K tokens per rank: 9 sequences with seed 0 (8 to 18 over seeds 0-4).
# shellcheck disable=SC2086
mpirun -n 2 --oversubscribe "$fcp" run --workload data/workloads/code-corpus.txt --tokens-per-worker 8K \
  --comm-ratio 5920 --warmup 1 --repeats 1 ${FCP_RUN_ARGS:-}
# What FCP exists for: a real model trained through it. A few steps of a byte-level GPT on vim's
# help files (documents of 1 KB to 1.6 MB, packed without padding), FCP on 2 ranks of a gloo
# process group beside one process without context parallelism: the losses agree.
echo
echo "== examples/train_gpt.py: one process (reference), then FCP on 2 ranks =="
export FCP_PYTHON_PATH="${FCP_BUILD_DIR:-build}/python"
/usr/bin/python3 examples/train_gpt.py --attention local --steps 4 --threads 1
# (examples/launch.sh: torch.distributed.run with what Debian's torch 1.13 needs.)
examples/launch.sh 2 examples/train_gpt.py --attention fcp --steps 4 --threads 1 2>&1 | grep -v "^\*\|WARNING\|Setting OMP"
