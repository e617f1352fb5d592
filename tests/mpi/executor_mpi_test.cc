// Multi-rank test of the executor (run under mpirun with any number of ranks): for random
// batches and edge cases, FCP and ring plans give outputs and dQ, dK, dV that match a float64
// single-process reference to relative L2 <= 1e-5. Every rank reaches the same verdict.
//
// Terms. A *case* is a batch (sequence lengths), a block size and a mask. Every rank makes
// the whole batch's Q, K, V, dO from one seed and runs the executor on its user-layout slice;
// rank 0 gathers the outputs and compares them with the reference.
#include <cstdio>
#include <string>
#include <vector>

#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"
#include "fcp/core/random.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/plan.h"
#include "fcp/runtime/executor.h"
#include "fcp/runtime/mpi_transport.h"
#include "fcp/runtime/reference.h"

namespace {

using namespace fcp;

constexpr double kTolerance = 1e-5;
constexpr int kGatherTag = 6;
constexpr int kVerdictTag = 7;

struct Case {
  std::string name;
  std::vector<int64_t> lengths;
  int64_t blockSize;
  MaskKind mask = MaskKind::kCausal;
  int64_t headDim = 16;
};

std::vector<Case> cases(int ranks) {
  std::vector<Case> out;
  Rng rng(2024);
  for (int i = 0; i < 2; ++i) {
    Case c{"random batch " + std::to_string(i), {}, 128 + 64 * i};
    int64_t total = 0;
    while (total < 1500) {
      const auto len = static_cast<int64_t>(1 + rng.uniform() * 600);
      c.lengths.push_back(len);
      total += len;
    }
    if (i == 1) c.mask = MaskKind::kFull;
    out.push_back(c);
  }
  out.push_back({"all sequences shorter than a block", {10, 37, 5, 100, 64, 1, 90, 33}, 128});
  out.push_back({"one sequence spanning every rank", {static_cast<int64_t>(250 * ranks + 7)}, 128,
                 MaskKind::kCausal, 32});
  out.push_back({"lengths not multiples of the block size", {517, 1031, 263}, 128});
  out.push_back({"user slices starting mid-sequence", {333, 999, 401, 77}, 256});
  out.push_back({"few blocks: ranks without blocks", {50, 30}, 64});
  return out;
}

struct Inputs {
  std::vector<float> q, k, v, dO;
};

Inputs makeInputs(int64_t tokens, const AttentionConfig& a, uint64_t seed) {
  Rng rng(seed);
  Inputs in;
  for (auto [x, width] : {std::pair{&in.q, a.numHeadsQ}, {&in.k, a.numHeadsKv}, {&in.v, a.numHeadsKv},
                          {&in.dO, a.numHeadsQ}}) {
    x->resize(static_cast<size_t>(tokens * width * a.headDim));
    for (float& value : *x) value = static_cast<float>(rng.normal());
  }
  return in;
}

std::span<const float> slice(const std::vector<float>& x, int64_t begin, int64_t end, int64_t width) {
  return {x.data() + begin * width, static_cast<size_t>((end - begin) * width)};
}

// Runs one case with one strategy; returns the worst relative error on rank 0 (0 elsewhere).
double runCase(runtime::Transport& t, const Case& c, const std::string& strategy) {
  Batch batch{c.lengths};
  plan::PlanConfig config;
  config.numWorkers = t.size();
  config.blockSize = c.blockSize;
  config.tokensPerWorker = (batch.numTokens() + t.size() - 1) / t.size();
  config.memoryLimitTokens = batch.numTokens();  // let tiny batches fit anywhere
  config.coalesce = 2;
  config.attention = {2, 1, c.headDim, 4, c.mask};
  const CostModel cost{config.attention};
  const plan::Plan p = strategy == "ring" ? baselines::ringPlan(batch, config, cost)
                                          : plan::buildPlan(batch, config, cost);
  plan::checkValid(p);
  runtime::checkPlanAgreement(p, t);
  const auto& a = config.attention;
  const int64_t qRow = a.numHeadsQ * a.headDim, kRow = a.numHeadsKv * a.headDim;
  const Inputs in = makeInputs(batch.numTokens(), a, 77);
  const auto starts = plan::userLayoutStarts(batch.numTokens(), t.size());
  const int64_t b = starts[static_cast<size_t>(t.rank())], e = starts[static_cast<size_t>(t.rank()) + 1];
  runtime::Executor ex(p, t);
  std::vector<float> out(static_cast<size_t>((e - b) * (2 * qRow + 2 * kRow)));
  std::vector<float> lse(static_cast<size_t>((e - b) * a.numHeadsQ));
  float* o = out.data();
  float* dq = o + (e - b) * qRow;
  float* dk = dq + (e - b) * qRow;
  float* dv = dk + (e - b) * kRow;
  const auto n = static_cast<size_t>(e - b);
  ex.forward(slice(in.q, b, e, qRow), slice(in.k, b, e, kRow), slice(in.v, b, e, kRow),
             {o, n * static_cast<size_t>(qRow)}, lse);
  ex.backward(slice(in.dO, b, e, qRow), {dq, n * static_cast<size_t>(qRow)},
              {dk, n * static_cast<size_t>(kRow)}, {dv, n * static_cast<size_t>(kRow)});
  if (t.rank() != 0) {
    if (!out.empty()) t.wait(t.isend(0, kGatherTag, runtime::asBytes(out)));
    return 0;
  }
  std::vector<std::vector<float>> all(4);
  for (int r = 0; r < t.size(); ++r) {
    const int64_t m = starts[static_cast<size_t>(r) + 1] - starts[static_cast<size_t>(r)];
    std::vector<float> got = out;
    if (r != 0) {
      got.assign(static_cast<size_t>(m * (2 * qRow + 2 * kRow)), 0.f);
      if (!got.empty()) t.wait(t.irecv(r, kGatherTag, runtime::asWritableBytes(got)));
    }
    const float* x = got.data();
    for (int f = 0; f < 4; ++f) {
      const int64_t width = f < 2 ? qRow : kRow;
      all[static_cast<size_t>(f)].insert(all[static_cast<size_t>(f)].end(), x, x + m * width);
      x += m * width;
    }
  }
  const auto ref = runtime::referenceAttention(batch, a, in.q, in.k, in.v, in.dO);
  const double errors[4] = {runtime::relativeL2(all[0], ref.o), runtime::relativeL2(all[1], ref.dq),
                            runtime::relativeL2(all[2], ref.dk), runtime::relativeL2(all[3], ref.dv)};
  double worst = 0;
  for (double err : errors) worst = std::max(worst, err != err ? 1e300 : err);
  std::printf("%-5s %-42s blocks %3zu  rel L2 out %.2e dq %.2e dk %.2e dv %.2e  %s\n", strategy.c_str(),
              c.name.c_str(), p.blocks.size(), errors[0], errors[1], errors[2], errors[3],
              worst <= kTolerance ? "ok" : "FAILED");
  std::fflush(stdout);
  return worst;
}

// Rank 0's verdict to every rank over point-to-point messages (whose waits sleep, unlike a
// busy-polling collective), then an allreduce so that all ranks hold the same verdict.
bool agree(runtime::Transport& t, bool passed) {
  int64_t verdict = passed ? 1 : 0;
  if (t.rank() == 0) {
    for (int r = 1; r < t.size(); ++r) t.wait(t.isend(r, kVerdictTag, std::as_bytes(std::span(&verdict, 1))));
  } else {
    t.wait(t.irecv(0, kVerdictTag, std::as_writable_bytes(std::span(&verdict, 1))));
  }
  t.allreduce({&verdict, 1}, runtime::ReduceOp::kMin);
  return verdict == 1;
}

}  // namespace

int main() {
  std::unique_ptr<runtime::Transport> t;
  try {
    t = runtime::makeMpiTransport({.timeoutSeconds = 120});
  } catch (const Error& e) {
    std::fprintf(stderr, "executor_mpi_test: %s\n", e.what());
    return 1;
  }
  bool passed = true;
  try {
    for (const Case& c : cases(t->size())) {
      for (const std::string strategy : {"fcp", "ring"}) {
        const double worst = runCase(*t, c, strategy);
        passed = agree(*t, worst <= kTolerance) && passed;
      }
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "executor_mpi_test: rank %d: %s\n", t->rank(), e.what());
    t->abort(1);
  }
  if (t->rank() == 0) std::printf("%d ranks: %s\n", t->size(), passed ? "all cases passed" : "FAILED");
  return passed ? 0 : 1;
}
