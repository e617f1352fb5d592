#!/usr/bin/env bash
# The test suite under sanitizers (CI runs it after scripts/test.sh). Exits nonzero on any
# failed test or sanitizer report.
#  - ${FCP_ASAN_BUILD_DIR:-build-asan}: every library, test and the fcp command built with
#    AddressSanitizer + UndefinedBehaviorSanitizer (RelWithDebInfo, -fno-sanitize-recover), and
#    the whole ctest suite run on it, MPI tests included. The Python package is left out (the
#    interpreter that would load it is not instrumented). LeakSanitizer ignores only Open
#    MPI's own allocations (tests/sanitizers/lsan.supp); nothing of FCP's is suppressed.
#  - ${FCP_TSAN_BUILD_DIR:-build-tsan}: the runtime's and the API's threaded tests (ranks as
#    threads, the progress and pipeline threads) and the planner's on two threads (runBoth,
#    HelperThread and whileLent, a plan made on one thread and on two, and the distributor's
#    trade search on one and on two), built with ThreadSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache (when CMake found it): hash paths relative to this tree, so another clone hits too.
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
scripts/install_deps.sh
jobs=$(nproc)
asan_dir=${FCP_ASAN_BUILD_DIR:-build-asan}
tsan_dir=${FCP_TSAN_BUILD_DIR:-build-tsan}

start=$SECONDS
cmake -S . -B "$asan_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFCP_SANITIZE=ON \
  -DFCP_BUILD_PYTHON=OFF -DFCP_BUILD_BENCH=OFF >/dev/null
cmake --build "$asan_dir" -j "$jobs"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:check_initialization_order=1
export LSAN_OPTIONS=suppressions=$PWD/tests/sanitizers/lsan.supp:print_suppressions=0
# Open MPI unloads its components at exit; kept loaded, their frames keep the names the
# suppressions match.
export OMPI_MCA_mca_base_component_disable_dlclose=1
# The suppressions match Open MPI's libraries in a leak's allocation stack, and only the slow
# unwinder (DWARF, at every malloc) walks through them. So only the tests that start Open MPI
# (label mpi) pay for it. The rest ran about ten times slower under it (a distributor test and
# a planner test: 74 s with it, 7 s without): the suite took 494 s of a CI run's 855 s here.
ctest --test-dir "$asan_dir" --output-on-failure -j "$jobs" --timeout 900 -LE mpi
LSAN_OPTIONS=$LSAN_OPTIONS:fast_unwind_on_malloc=0 \
  ctest --test-dir "$asan_dir" --output-on-failure -j "$jobs" --timeout 900 -L mpi
echo "sanitize: ASan+UBSan suite passed in $((SECONDS - start)) s"

start=$SECONDS
cmake -S . -B "$tsan_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DFCP_SANITIZE=thread \
  -DFCP_BUILD_PYTHON=OFF -DFCP_BUILD_BENCH=OFF -DFCP_BUILD_CLI=OFF -DFCP_INSTALL=OFF >/dev/null
cmake --build "$tsan_dir" -j "$jobs" --target fcp_runtime_tests fcp_api_tests fcp_plan_tests
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
for t in fcp_runtime_tests fcp_api_tests; do
  "$tsan_dir/tests/$t" --gtest_brief=1
done
"$tsan_dir/tests/fcp_plan_tests" --gtest_brief=1 \
  --gtest_filter='PlanTest.APlanIsTheSame*:ParallelTest.*:HelperThreadTest.*:DistributorTest.TradesOnTwo*'
echo "sanitize: TSan threaded tests passed in $((SECONDS - start)) s"
