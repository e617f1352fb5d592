// Does communication progress while a kernel computes? Run under mpirun -n 2.
//
// Rank 0 sends one large message to rank 1; both post their request, then run attention
// kernels for a while without calling the transport, then wait. With the communication thread
// the message moves during the kernels and the wait after them is short; without it
// (OpenMPI moves a large message only inside MPI calls) most of the transfer happens in the
// wait. Also reports the kernels' time in both modes: the thread's polling overhead.
#include <cstdio>
#include <string>
#include <vector>

#include "fcp/kernels/attention.h"
#include "fcp/runtime/mpi_transport.h"
#include "fcp/runtime/timeline.h"

namespace {

using fcp::runtime::Timeline;

double kernelsMs(int repeats) {
  const int64_t b = 1024;
  const int hq = 8, hkv = 1, d = 128;
  std::vector<float> q(b * hq * d, 0.1f), k(b * hkv * d, 0.2f), v(b * hkv * d, 0.3f), o(q.size()), lse(b * hq);
  const fcp::kernels::Segment seg{b, 0, 0};
  const fcp::kernels::BlockMask mask{fcp::kernels::MaskKind::kFull, {&seg, 1}, {&seg, 1}};
  const double start = Timeline::nowUs();
  for (int i = 0; i < repeats; ++i) {
    fcp::kernels::forward({q.data(), b, hq, d}, {k.data(), b, hkv, d}, {v.data(), b, hkv, d}, mask, o.data(),
                          lse.data(), {1});
  }
  return (Timeline::nowUs() - start) / 1e3;
}

}  // namespace

int main(int argc, char** argv) {
  // MPI initialises once per process, so each mode is its own run: `on` (default) or `off`.
  const bool thread = !(argc > 1 && std::string(argv[1]) == "off");
  const size_t bytes = size_t{256} << 20;
  std::vector<std::byte> buffer(bytes, std::byte{1});
  auto t = fcp::runtime::makeMpiTransport({.progressThread = thread});
  if (t->size() != 2) {
    std::fprintf(stderr, "run under mpirun -n 2\n");
    return 1;
  }
  double waitMs = 0, computeMs = 0, idleMs = 0;
  const int rounds = 3;
  for (int round = 0; round < rounds; ++round) {
    int64_t sync = 0;
    t->allreduce({&sync, 1}, fcp::runtime::ReduceOp::kMax);
    const double start = Timeline::nowUs();
    const auto id = t->rank() == 0 ? t->isend(1, 9, buffer) : t->irecv(0, 9, buffer);
    t->wait(id);
    idleMs += (Timeline::nowUs() - start) / 1e3 / rounds;
    t->allreduce({&sync, 1}, fcp::runtime::ReduceOp::kMax);
    const auto id2 = t->rank() == 0 ? t->isend(1, 10, buffer) : t->irecv(0, 10, buffer);
    computeMs += kernelsMs(20) / rounds;
    const double before = Timeline::nowUs();
    t->wait(id2);
    waitMs += (Timeline::nowUs() - before) / 1e3 / rounds;
  }
  // Polling overhead: kernels while a receive stays pending the whole time (the thread polls
  // throughout), against the same kernels with nothing pending.
  int64_t sync = 0;
  t->allreduce({&sync, 1}, fcp::runtime::ReduceOp::kMax);
  const double idleKernelsMs = kernelsMs(20);
  t->allreduce({&sync, 1}, fcp::runtime::ReduceOp::kMax);
  int64_t token = 0;
  const int peer = 1 - t->rank();
  const auto pending = t->irecv(peer, 11, std::as_writable_bytes(std::span(&token, 1)));
  const double pollingKernelsMs = kernelsMs(20);
  t->wait(t->isend(peer, 11, std::as_bytes(std::span(&sync, 1))));
  t->wait(pending);
  if (t->rank() == 1) {
    std::printf("communication thread %-3s: kernels %.0f ms with nothing pending, %.0f ms with a receive "
                "pending throughout (%+.1f%%)\n",
                thread ? "on" : "off", idleKernelsMs, pollingKernelsMs,
                100 * (pollingKernelsMs / idleKernelsMs - 1));
    std::printf("communication thread %-3s: %zu MB alone %.1f ms; after %.0f ms of kernels the wait "
                "takes %.1f ms (%.0f%% of the lone transfer)\n",
                thread ? "on" : "off", bytes >> 20, idleMs, computeMs, waitMs, 100 * waitMs / idleMs);
  }
  return 0;
}
