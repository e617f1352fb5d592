#!/usr/bin/env bash
# Installs the Debian packages FCP needs, and only those that are missing, so a second run
# is a no-op. Works on a fresh Debian 12 machine as root (or with sudo available).
set -euo pipefail

packages=(
  build-essential cmake git
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev
  # libdnnl-dev's CMake config calls find_package(OpenCL), but Debian only *recommends* the
  # OpenCL headers and we install with --no-install-recommends.
  libdnnl-dev ocl-icd-opencl-dev
  libopenmpi-dev openmpi-bin
  python3 python3-numpy python3-torch python3-matplotlib
  # The Python package (python/): bindings for Debian's /usr/bin/python3, its tests, the
  # mpi4py path, and the text the training example learns from (vim's help files).
  python3-dev pybind11-dev python3-pytest python3-mpi4py vim-runtime
  # Debian's torch calls the libblas.so.3 alternative, which is the reference BLAS (6 GFLOP/s
  # here) unless an optimised one is installed: OpenBLAS gives the model's GEMMs ~160 GFLOP/s.
  libopenblas0-pthread
  # scripts/fuzz.sh: libFuzzer needs Clang and its runtime libraries.
  clang libclang-rt-14-dev
  # CI builds a fresh clone four times (Release, ASan + UBSan, TSan, fuzzers); the build
  # scripts compile through ccache when it is there, with paths relative to the clone.
  ccache
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo)
fi
echo "install_deps: installing ${missing[*]}"
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
  "${missing[@]}"
