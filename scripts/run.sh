#!/usr/bin/env bash
# The main job: install what is missing, build, and plan the built-in default workload.
# Extra arguments are passed to `fcp plan`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
"${FCP_BUILD_DIR:-build}"/apps/fcp/fcp plan "$@"
