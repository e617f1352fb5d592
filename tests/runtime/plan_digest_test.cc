// Same plan on every machine: the digests (runtime::planDigest, FNV-1a of the plan's JSON) of
// plans for fixed inputs are pinned. They depend only on integer arithmetic, IEEE basic
// operations and fcp::dmath (plan.no_libm checks no libm transcendental is called), so they
// must come out the same on every CPU, compiler and C library. A deliberate change of the
// planner or the sampler changes them: then print the new ones (FCP_PRINT_DIGESTS=1) and say
// in the commit why the plans changed.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fcp/baselines/baselines.h"
#include "fcp/core/cost_model.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"
#include "fcp/runtime/executor.h"

namespace fcp {
namespace {

struct Pinned {
  const char* strategy;
  const char* workload;
  int64_t workers;
  uint64_t seed;
  plan::Placement placement;
  MaskKind mask;
  uint64_t digest;
};

TEST(PlanDigestTest, PlansForFixedInputsArePinned) {
  const Pinned cases[] = {
      {"fcp", "lognormal", 8, 0, plan::Placement::kLocal, MaskKind::kCausal, 0xc38db5f1a659a8adull},
      {"fcp", "lognormal", 64, 1, plan::Placement::kLocal, MaskKind::kCausal, 0x31563b486d8647d0ull},
      {"fcp", "lognormal-narrow", 16, 2, plan::Placement::kLpt, MaskKind::kCausal, 0x44f0b8e06cf08d13ull},
      {"fcp", "bimodal", 32, 3, plan::Placement::kLocal, MaskKind::kFull, 0x143a249ff635fc3aull},
      {"fcp", "bimodal", 256, 4, plan::Placement::kLpt, MaskKind::kCausal, 0xb8786c366eb5324aull},
      {"ring", "lognormal", 8, 5, plan::Placement::kLpt, MaskKind::kCausal, 0x99dea2b94bafcd73ull},
      {"magi", "bimodal", 16, 6, plan::Placement::kLpt, MaskKind::kCausal, 0x3514ad55d4b9b2a1ull},
  };
  const bool print = std::getenv("FCP_PRINT_DIGESTS") != nullptr;
  for (const Pinned& p : cases) {
    plan::PlanConfig c;
    c.numWorkers = p.workers;
    c.tokensPerWorker = 32 * 1024;
    c.blockSize = 4096;
    c.placement = p.placement;
    c.attention.mask = p.mask;
    const Batch batch = sampleBatch(findWorkload(p.workload), c.numWorkers * c.tokensPerWorker, p.seed);
    const plan::Plan plan = baselines::makePlan(p.strategy, batch, c, CostModel{c.attention});
    const uint64_t digest = runtime::planDigest(plan);
    if (print) std::printf("0x%016llxull,  // %s %s %lld\n", static_cast<unsigned long long>(digest),
                           p.strategy, p.workload, static_cast<long long>(p.workers));
    EXPECT_EQ(digest, p.digest) << p.strategy << " " << p.workload << " " << p.workers
                                << " workers, seed " << p.seed;
  }
}

}  // namespace
}  // namespace fcp
