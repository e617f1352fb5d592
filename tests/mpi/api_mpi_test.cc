// The public API on real MPI ranks (run under mpirun with any number of ranks): random batches
// over random uneven caller splits (a rank with no tokens, slices starting mid-sequence) and
// every strategy, fp32 and bf16, both layouts, four layers sharing one batch, against the
// float64 reference; with 4 ranks or more, WORLD split into two communicators that run
// different batches at the same time; and one rank whose planning fails (its own environment)
// stops every rank at the plan agreement, after which the ranks are still in step. Every rank
// reaches the same verdict.
//
// Terms. A *case* is a batch, a caller split and settings. Every rank makes the whole batch's
// inputs from one seed, runs its slice through FCP over the communicator it was given, and
// writes its outputs into a zeroed whole-batch buffer; a sum over the communicator gives every
// rank the whole outputs, and each compares them with the reference.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fcp/api/attention.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/runtime/mpi_transport.h"
#include "fcp/runtime/reference.h"

namespace {

using namespace fcp;

struct Case {
  std::string name;
  std::vector<int64_t> lengths;
  std::vector<int64_t> starts;
  std::string strategy = "fcp";
  DType dtype = DType::kFp32;
  Layout layout = Layout::kTransparent;
  MaskKind mask = MaskKind::kCausal;
  int layers = 1;
};

using kernels::dtypeBytes;

std::vector<int64_t> cuOf(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (const int64_t l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

std::vector<Case> cases(int ranks, uint64_t seed) {
  Rng rng(seed);
  std::vector<Case> out;
  const char* strategies[] = {"fcp", "ring", "bytescale", "wlb", "magi", "megatron"};
  for (int i = 0; i < 8; ++i) {
    Case c;
    for (int64_t total = 0; total < 300 * ranks;) {
      c.lengths.push_back(1 + static_cast<int64_t>(rng.uniform() * 400));
      total += c.lengths.back();
    }
    const int64_t total = cuOf(c.lengths).back();
    c.starts = {0};
    std::vector<int64_t> cuts;
    for (int r = 1; r < ranks; ++r)
      cuts.push_back(static_cast<int64_t>(rng.uniform() * static_cast<double>(total)));
    std::sort(cuts.begin(), cuts.end());
    for (const int64_t cut : cuts) c.starts.push_back(cut);
    c.starts.push_back(total);
    if (ranks > 1 && i % 2 == 0) {  // one rank holds nothing
      const auto empty = static_cast<size_t>(i / 2 % ranks);
      c.starts[empty + 1] = c.starts[empty];
      for (size_t r = empty + 2; r < c.starts.size(); ++r)
        c.starts[r] = std::max(c.starts[r], c.starts[r - 1]);
      c.starts.back() = total;
    }
    c.strategy = strategies[i % 6];
    c.dtype = i % 3 == 1 ? DType::kBf16 : DType::kFp32;
    c.layout = i % 4 >= 2 ? Layout::kDispatched : Layout::kTransparent;
    c.mask = i == 5 ? MaskKind::kFull : MaskKind::kCausal;
    c.layers = i == 3 ? 4 : 1;
    c.name = "case " + std::to_string(i);
    out.push_back(c);
  }
  return out;
}

std::vector<float> randomTensor(Rng& rng, int64_t size, DType d) {
  std::vector<float> x(static_cast<size_t>(size));
  for (float& v : x) {
    v = static_cast<float>(rng.normal());
    if (d == DType::kBf16) v = kernels::fromBf16(kernels::toBf16(v));
  }
  return x;
}

std::vector<std::byte> storage(const float* x, int64_t count, DType d) {
  std::vector<std::byte> out(static_cast<size_t>(count * dtypeBytes(d)));
  if (out.empty()) return out;  // memcpy's pointers must not be null, even for 0 bytes
  if (d == DType::kFp32) {
    std::memcpy(out.data(), x, out.size());
  } else {
    const auto n = static_cast<size_t>(count);
    kernels::toBf16({x, n}, {reinterpret_cast<uint16_t*>(out.data()), n});
  }
  return out;
}

void unstore(const std::vector<std::byte>& bytes, float* x, DType d) {
  if (bytes.empty()) return;  // memcpy's pointers must not be null, even for 0 bytes
  if (d == DType::kFp32) {
    std::memcpy(x, bytes.data(), bytes.size());
  } else {
    const size_t n = bytes.size() / 2;
    kernels::fromBf16({reinterpret_cast<const uint16_t*>(bytes.data()), n}, {x, n});
  }
}

// Runs one case over `comm`; returns the worst relative error (the same on every rank).
double runCase(MPI_Comm comm, runtime::Transport& t, const Case& c) {
  const int64_t hq = 4, hkv = 2, dim = 16, qw = hq * dim, kw = hkv * dim;
  const int64_t total = cuOf(c.lengths).back();
  const DType d = c.dtype;
  BatchOptions o;
  o.cuSeqlens = cuOf(c.lengths);
  o.localBegin = c.starts[static_cast<size_t>(t.rank())];
  o.localEnd = c.starts[static_cast<size_t>(t.rank()) + 1];
  o.numHeadsQ = hq;
  o.numHeadsKv = hkv;
  o.headDim = dim;
  o.mask = c.mask;
  o.dtype = d;
  o.layout = c.layout;
  o.strategy = c.strategy;
  o.planConfig.blockSize = 128;
  o.planConfig.coalesce = 2;
  AttentionBatch batch(t, o);
  const int64_t b = o.localBegin, e = o.localEnd, n = batch.numCallTokens();
  const bool dispatched = c.layout == Layout::kDispatched;
  auto toCall = [&](const std::vector<float>& whole, int64_t width) {
    std::vector<std::byte> user = storage(whole.data() + b * width, (e - b) * width, d);
    if (!dispatched) return user;
    std::vector<std::byte> local(static_cast<size_t>(n * width * dtypeBytes(d)));
    batch.dispatch(user, local, width * dtypeBytes(d));
    return local;
  };
  auto fromCall = [&](const std::vector<std::byte>& call, std::vector<float>& whole,
                      int64_t width) {
    std::vector<std::byte> user = call;
    if (dispatched) {
      user.assign(static_cast<size_t>((e - b) * width * dtypeBytes(d)), std::byte{0});
      batch.undispatch(call, user, width * dtypeBytes(d));
    }
    unstore(user, whole.data() + b * width, d);
  };
  Rng rng(1234 + c.lengths.size());
  struct Layer {
    std::vector<float> q, k, v, dO, o, dq, dk, dv;
    std::vector<std::byte> cq, ck, cv, cdO;
    AttentionLayer attention;
  };
  std::vector<Layer> layers(static_cast<size_t>(c.layers));
  for (Layer& l : layers) {
    l.q = randomTensor(rng, total * qw, d);
    l.k = randomTensor(rng, total * kw, d);
    l.v = randomTensor(rng, total * kw, d);
    l.dO = randomTensor(rng, total * qw, d);
    l.o.assign(l.q.size(), 0.f);
    l.dq.assign(l.q.size(), 0.f);
    l.dk.assign(l.k.size(), 0.f);
    l.dv.assign(l.k.size(), 0.f);
    l.cq = toCall(l.q, qw);
    l.ck = toCall(l.k, kw);
    l.cv = toCall(l.v, kw);
    l.cdO = toCall(l.dO, qw);
  }
  for (Layer& l : layers) {
    std::vector<std::byte> out(static_cast<size_t>(n * qw * dtypeBytes(d)));
    l.attention.forward(batch, {l.cq.data(), d, n, hq, dim}, {l.ck.data(), d, n, hkv, dim},
                        {l.cv.data(), d, n, hkv, dim}, {out.data(), d, n, hq, dim});
    fromCall(out, l.o, qw);
  }
  for (size_t i = layers.size(); i-- > 0;) {
    Layer& l = layers[i];
    std::vector<std::byte> dq(static_cast<size_t>(n * qw * dtypeBytes(d))),
        dk(static_cast<size_t>(n * kw * dtypeBytes(d))), dv(dk.size());
    l.attention.backward(batch, {l.cdO.data(), d, n, hq, dim}, {dq.data(), d, n, hq, dim},
                         {dk.data(), d, n, hkv, dim}, {dv.data(), d, n, hkv, dim});
    fromCall(dq, l.dq, qw);
    fromCall(dk, l.dk, kw);
    fromCall(dv, l.dv, kw);
  }
  double worst = 0;
  for (Layer& l : layers) {
    for (std::vector<float>* x : {&l.o, &l.dq, &l.dk, &l.dv}) {
      MPI_Allreduce(MPI_IN_PLACE, x->data(), static_cast<int>(x->size()), MPI_FLOAT, MPI_SUM, comm);
    }
    const AttentionConfig a{hq, hkv, dim, dtypeBytes(d), c.mask};
    const auto ref = runtime::referenceAttention(Batch{c.lengths}, a, l.q, l.k, l.v, l.dO);
    for (const double err :
         {runtime::relativeL2(l.o, ref.o), runtime::relativeL2(l.dq, ref.dq),
          runtime::relativeL2(l.dk, ref.dk), runtime::relativeL2(l.dv, ref.dv)}) {
      worst = std::max(worst, err != err ? 1e300 : err);
    }
  }
  return worst;
}

// Runs every case over `comm`; true when all pass. Rank 0 of `comm` prints each result.
bool runAll(MPI_Comm comm, const char* group, uint64_t seed) {
  std::unique_ptr<runtime::Transport> t = runtime::makeMpiTransport(
      runtime::MpiCommHandle{MPI_Comm_c2f(comm)}, {.timeoutSeconds = 120});
  bool passed = true;
  for (const Case& c : cases(t->size(), seed)) {
    const double worst = runCase(comm, *t, c);
    const double tolerance = c.dtype == DType::kBf16 ? 1e-2 : 1e-5;
    const bool ok = worst <= tolerance;
    passed = passed && ok;
    if (t->rank() == 0) {
      std::printf("%s %-7s %-9s %-4s %-11s %d layer(s) %5zu seqs: worst rel L2 %.2e  %s\n", group,
                  c.name.c_str(), c.strategy.c_str(),
                  std::string(kernels::dtypeName(c.dtype)).c_str(),
                  c.layout == Layout::kDispatched ? "dispatched" : "transparent", c.layers,
                  c.lengths.size(), worst, ok ? "ok" : "FAILED");
      std::fflush(stdout);
    }
  }
  return passed;
}

// Planning that fails on one rank only: the last rank's environment has FCP_PLAN_THREADS=3,
// which only its planner reads. Every rank must throw at the plan agreement, in line and through
// a PendingBatch, within seconds (not at the transport's timeout): the last rank its own error,
// the others one naming it. Then the ranks are still in step: a case runs and passes.
bool oneRanksPlanningFailureStopsEveryRank(MPI_Comm comm) {
  std::unique_ptr<runtime::Transport> t = runtime::makeMpiTransport(
      runtime::MpiCommHandle{MPI_Comm_c2f(comm)}, {.timeoutSeconds = 120});
  const int rank = t->rank(), last = t->size() - 1;
  const Case c = cases(t->size(), 11).front();
  BatchOptions o;
  o.cuSeqlens = cuOf(c.lengths);
  o.localBegin = c.starts[static_cast<size_t>(rank)];
  o.localEnd = c.starts[static_cast<size_t>(rank) + 1];
  o.numHeadsQ = 4;
  o.numHeadsKv = 2;
  o.headDim = 16;
  o.planConfig.blockSize = 128;
  const std::string own = "invalid FCP_PLAN_THREADS '3': expected 1 or 2 planner threads",
                    named = "rank " + std::to_string(rank) + ": rank " + std::to_string(last) +
                            " could not plan this batch (its error there, of kind 'invalid "
                            "argument', says why): expected a batch every rank can plan";
  bool passed = true;
  for (const bool ahead : {false, true}) {
    if (rank == last) setenv("FCP_PLAN_THREADS", "3", 1);
    const double start = MPI_Wtime();
    std::string what = "(no error)";
    try {
      if (ahead) {
        PendingBatch pending(*t, o);
        AttentionBatch batch(std::move(pending));
      } else {
        AttentionBatch batch(*t, o);
      }
    } catch (const Error& e) {
      what = e.what();
    }
    unsetenv("FCP_PLAN_THREADS");
    const double seconds = MPI_Wtime() - start;
    const bool ok = what == (rank == last ? own : named) && seconds < 30;
    if (!ok) {
      std::fprintf(stderr, "rank %d, %s: after %.1f s: %s\n", rank,
                   ahead ? "pending batch" : "in line", seconds, what.c_str());
    }
    passed = passed && ok;
  }
  const double worst = runCase(comm, *t, c);
  passed = passed && worst <= 1e-5;
  int all = passed ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0) {
    std::printf(
        "one rank's planning fails: every rank threw, then a case ran (worst rel L2 "
        "%.2e): %s\n",
        worst, all ? "ok" : "FAILED");
  }
  return all == 1;
}

// A call that throws on one rank only (the last passes q with a row too many), then a new batch
// on the same transport, as a training loop that catches the error would make. The other ranks
// wait out their timeout (4 s) in the forward for the last rank's messages (a full mask: every
// rank reads the last rank's KV); the last rank is in
// the new batch's agreement at once, and must wait for them there, so that every rank hears the
// agreement's verdict on the failed call. Before, the last rank gave up on the agreement just
// before the others arrived, and they then waited a timeout more alone: every rank ended on a
// timeout, none on what happened. On one rank there is no one to wait for: the forward fails in
// its checks, and the next batch is fine.
bool aCallThatFailedOnOneRankIsNamedByTheNextBatch(MPI_Comm comm) {
  constexpr double kTimeout = 4;
  std::unique_ptr<runtime::Transport> t = runtime::makeMpiTransport(
      runtime::MpiCommHandle{MPI_Comm_c2f(comm)}, {.timeoutSeconds = kTimeout});
  const int rank = t->rank(), ranks = t->size(), last = ranks - 1;
  BatchOptions o;
  o.cuSeqlens = {0, 300 * ranks};
  o.localBegin = 300 * rank;
  o.localEnd = 300 * (rank + 1);
  o.numHeadsQ = o.numHeadsKv = 1;
  o.headDim = 8;
  o.mask = MaskKind::kFull;  // every rank reads KV the last rank holds: every rank waits for it
  o.planConfig.blockSize = 64;
  std::string first = "(no error)", second = "(no error)";
  const double start = MPI_Wtime();
  try {
    AttentionBatch batch(*t, o);
    const int64_t rows = 300 + (rank == last ? 1 : 0);
    std::vector<float> q(static_cast<size_t>(rows * 8), 0.5f), kv(300 * 8, 0.5f), out(300 * 8);
    AttentionLayer layer;
    layer.forward(batch, {q.data(), DType::kFp32, rows, 1, 8}, {kv.data(), DType::kFp32, 300, 1, 8},
                  {kv.data(), DType::kFp32, 300, 1, 8}, {out.data(), DType::kFp32, 300, 1, 8});
  } catch (const Error& e) {
    first = e.what();
  }
  try {
    AttentionBatch again(*t, o);
  } catch (const Error& e) {
    second = e.what();
  }
  const double seconds = MPI_Wtime() - start;
  const std::string verdict =
      "rank " + std::to_string(rank) + ": a call of an earlier batch over this transport threw ";
  const bool ok = first.find(rank == last ? "q is [301, 1, 8] fp32, expected [300, 1, 8] fp32"
                                          : "timed out") != std::string::npos &&
                  (ranks == 1 ? second == "(no error)" : second.rfind(verdict, 0) == 0) &&
                  seconds < 3 * kTimeout + 10;
  if (!ok) {
    std::fprintf(stderr, "rank %d: after %.1f s: first: %s; second: %s\n", rank, seconds,
                 first.c_str(), second.c_str());
  }
  int all = ok ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0) {
    std::printf("a call that failed on one rank: the next batch names it on every rank: %s\n",
                all ? "ok" : "FAILED");
  }
  return all == 1;
}

// A split one rank refuses (the last passes colour -1, then a timeout of 0 s, which the new
// transport checks before its MPI_Comm_dup): every rank throws within seconds, the last naming
// its argument and the others naming it, rather than wait in MPI_Comm_split or MPI_Comm_dup for
// ever. Then a valid split (even and odd ranks) joins the ranks it should, in key order.
bool aSplitOneRankRefusesFailsEveryRank(MPI_Comm comm) {
  std::unique_ptr<runtime::Transport> t =
      runtime::makeMpiTransport(runtime::MpiCommHandle{MPI_Comm_c2f(comm)}, {.timeoutSeconds = 20});
  const int rank = t->rank(), ranks = t->size(), last = ranks - 1;
  bool ok = true;
  for (const bool colour : {true, false}) {
    const double start = MPI_Wtime();
    std::string what = "(no error)";
    try {
      runtime::makeMpiSplitTransport(*t, rank == last && colour ? -1 : 0, rank,
                                     {.timeoutSeconds = rank == last && !colour ? 0.0 : 20.0});
    } catch (const Error& e) {
      what = e.what();
    }
    const double seconds = MPI_Wtime() - start;
    const std::string expected =
        rank == last ? (colour ? "split colour -1: expected 0 or more"
                               : "MPI transport timeout 0 s: expected above 0 and at most 86400")
                     : "rank " + std::to_string(rank) + ": rank " + std::to_string(last) +
                           "'s split arguments were refused there (its own error says why): "
                           "expected valid arguments on every rank";
    if (what != expected || seconds >= 10) {
      std::fprintf(stderr, "rank %d: after %.1f s: %s\n", rank, seconds, what.c_str());
      ok = false;
    }
  }
  // Reversed keys: the split's ranks count down.
  std::unique_ptr<runtime::Transport> half = runtime::makeMpiSplitTransport(*t, rank % 2, -rank);
  const int members = (ranks - rank % 2 + 1) / 2;
  std::vector<int64_t> sum = {rank};
  half->allreduce(sum, runtime::ReduceOp::kSum);
  int64_t expectedSum = 0;
  for (int r = rank % 2; r < ranks; r += 2) expectedSum += r;
  const bool joined =
      half->size() == members && half->rank() == members - 1 - rank / 2 && sum[0] == expectedSum;
  if (!joined) {
    std::fprintf(stderr, "rank %d: split rank %d of %d, sum %lld\n", rank, half->rank(),
                 half->size(), static_cast<long long>(sum[0]));
  }
  int all = ok && joined ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0) {
    std::printf("a split one rank refuses fails every rank; a valid one joins its ranks: %s\n",
                all ? "ok" : "FAILED");
  }
  return all == 1;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int worldRank = 0, worldSize = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &worldRank);
  MPI_Comm_size(MPI_COMM_WORLD, &worldSize);
  int passed = 1;
  try {
    passed = runAll(MPI_COMM_WORLD, "world", 2024) ? 1 : 0;
    if (!oneRanksPlanningFailureStopsEveryRank(MPI_COMM_WORLD)) passed = 0;
    if (!aCallThatFailedOnOneRankIsNamedByTheNextBatch(MPI_COMM_WORLD)) passed = 0;
    if (!aSplitOneRankRefusesFailsEveryRank(MPI_COMM_WORLD)) passed = 0;
    if (worldSize >= 4) {
      // Two context-parallel groups (even and odd ranks) running different batches at once,
      // while WORLD carries the caller's own traffic.
      MPI_Comm half;
      MPI_Comm_split(MPI_COMM_WORLD, worldRank % 2, worldRank, &half);
      const bool ok = runAll(half, worldRank % 2 == 0 ? "even " : "odd  ",
                             7 + static_cast<uint64_t>(worldRank % 2));
      passed = passed && ok ? 1 : 0;
      MPI_Comm_free(&half);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "api_mpi_test: rank %d: %s\n", worldRank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Allreduce(MPI_IN_PLACE, &passed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (worldRank == 0)
    std::printf("%d ranks: %s\n", worldSize, passed ? "all cases passed" : "FAILED");
  MPI_Finalize();
  return passed ? 0 : 1;
}
