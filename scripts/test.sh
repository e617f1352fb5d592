#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite. Exits nonzero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
build_dir=${FCP_BUILD_DIR:-build}
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" --timeout 900
