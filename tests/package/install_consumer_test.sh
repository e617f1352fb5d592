#!/usr/bin/env bash
# Installs an FCP build into a temporary prefix, builds examples/consumer against it with
# find_package(fcp) and runs it on 2 MPI ranks. Fails on any step; removes its temp dirs.
# Usage: install_consumer_test.sh BUILD_DIR SOURCE_DIR MPIEXEC [CMAKE] [CXX_COMPILER]
set -euo pipefail

build_dir=$1
source_dir=$2
mpiexec=$3
cmake=${4:-cmake}
cxx=${5:-}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fcp_package_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

step() { echo "== $*"; }

step "install $build_dir into $tmp/prefix"
"$cmake" --install "$build_dir" --prefix "$tmp/prefix" > "$tmp/install.log" ||
  { cat "$tmp/install.log"; exit 1; }

step "configure examples/consumer against it"
"$cmake" -S "$source_dir/examples/consumer" -B "$tmp/build" \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_BUILD_TYPE=Release \
  ${cxx:+-DCMAKE_CXX_COMPILER="$cxx"}

fcp_dir=$(sed -n 's/^fcp_DIR:PATH=//p' "$tmp/build/CMakeCache.txt")
[[ $fcp_dir == "$tmp/prefix/"* ]] ||
  { echo "found fcp in '$fcp_dir', not in the install prefix $tmp/prefix"; exit 1; }

step "build it"
"$cmake" --build "$tmp/build" -j2

step "run it on 2 ranks"
"$mpiexec" -n 2 --oversubscribe "$tmp/build/fcp_consumer"
