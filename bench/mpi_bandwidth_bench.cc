// MPI bandwidth between two ranks through the runtime's own transport, both directions at
// once (as the runtime's stages exchange blocks). Run under mpirun -n 2; prints, per message
// size, the median and best GB/s each way over the repeats. Feeds the CPU hardware profile
// (data/hardware/cpu.json; bench/sim_vs_real.sh).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "fcp/core/error.h"
#include "fcp/core/statistics.h"
#include "fcp/runtime/mpi_transport.h"
#include "fcp/runtime/timeline.h"

namespace {

int run(int argc, char** argv) {
  std::vector<size_t> mebibytes;
  for (int i = 1; i < argc; ++i) {
    char* end = nullptr;
    const long m = std::strtol(argv[i], &end, 10);
    if (end == argv[i] || *end != '\0' || m <= 0 || m > 1024) {
      std::fprintf(stderr, "mpi_bandwidth_bench: invalid size '%s': expected MiB in [1, 1024]\n",
                   argv[i]);
      return 1;
    }
    mebibytes.push_back(static_cast<size_t>(m));
  }
  if (mebibytes.empty()) mebibytes = {1, 4, 16, 64};
  auto t = fcp::runtime::makeMpiTransport();
  if (t->size() != 2) {
    std::fprintf(stderr, "mpi_bandwidth_bench: run under mpirun -n 2\n");
    return 1;
  }
  const int peer = 1 - t->rank();
  constexpr int kRepeats = 7;
  for (const size_t mib : mebibytes) {
    const size_t bytes = mib << 20;
    std::vector<std::byte> out(bytes, std::byte{1}), in(bytes);
    std::vector<double> gbps;
    for (int rep = 0; rep <= kRepeats; ++rep) {
      int64_t sync = 0;
      t->allreduce({&sync, 1}, fcp::runtime::ReduceOp::kMax);
      const double start = fcp::runtime::Timeline::nowUs();
      const auto recv = t->irecv(peer, 1, in);
      const auto send = t->isend(peer, 1, out);
      t->wait(send);
      t->wait(recv);
      const double seconds = (fcp::runtime::Timeline::nowUs() - start) * 1e-6;
      // The slower rank's time: both directions must be done.
      auto micros = static_cast<int64_t>(seconds * 1e6);
      t->allreduce({&micros, 1}, fcp::runtime::ReduceOp::kMax);
      if (rep > 0)
        gbps.push_back(static_cast<double>(bytes) / (static_cast<double>(micros) * 1e-6) * 1e-9);
    }
    if (t->rank() == 0) {
      std::printf(
          "%5zu MiB each way: median %.2f GB/s, best %.2f GB/s (%d repeats, first dropped)\n", mib,
          fcp::median(gbps), *std::max_element(gbps.begin(), gbps.end()), kRepeats);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const fcp::Error& e) {
    std::fprintf(stderr, "mpi_bandwidth_bench: %s\n", e.what());
    return 1;
  }
}
