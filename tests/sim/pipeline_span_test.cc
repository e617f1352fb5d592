// plan::pipelineSpan, the planner's estimate of a forward pass with free communication, against
// the simulator's event-driven run of the same stages on links too fast to matter.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/plan.h"
#include "fcp/sim/hardware.h"
#include "fcp/sim/simulator.h"

namespace fcp::sim {
namespace {

/// H100's kernel curves, links that move any plan's bytes in under 1e-15 s, no latency.
HardwareProfile freeLinks() {
  HardwareProfile h;
  h.intraNodeBytesPerSecond = h.interNodeBytesPerSecond = 1e30;
  h.intraNodeLatencySeconds = h.interNodeLatencySeconds = 0;
  return h;
}

double simulatedForwardCost(const plan::Plan& p, const HardwareProfile& hw) {
  SimOptions o;
  o.backward = false;
  o.reshuffle = false;
  return simulate(p, hw, o).forward.timeMs / 1e3 * hw.peakFlops;  // in cost units
}

double busiestCost(const plan::Plan& p) {
  double most = 0;
  for (const plan::WorkerLoad& l : plan::computeLoads(p)) most = std::max(most, l.cost);
  return most;
}

TEST(PipelineSpanTest, TheMultiBufferPipelineIsTheLockstepWhereComputeReadsThePreviousStage) {
  // Ring attention computes with the KV of the step before, and FCP with two buffers with the
  // group of the stage before: the two pipelines time them alike, forward and backward. With
  // three buffers FCP's computes wait less, and on this batch the pass is shorter.
  HardwareProfile hw = loadHardwareProfile("h100"), multiBuffer = hw;
  hw.pipeline = Pipeline::kLockstep;
  multiBuffer.pipeline = Pipeline::kMultiBuffer;
  plan::PlanConfig c;
  c.numWorkers = 32;
  c.tokensPerWorker = 8192;
  c.blockSize = 2048;
  const Batch batch = sampleBatch(findWorkload("bimodal"), 32 * 8192, 3);
  const SimOptions o;
  const plan::Plan ring = baselines::ringPlan(batch, c, hw.costModel(c.attention));
  EXPECT_EQ(simulate(ring, hw, o).timeMs, simulate(ring, multiBuffer, o).timeMs);
  c.bufferDepth = 2;
  const plan::Plan two = plan::buildPlan(batch, c, hw.costModel(c.attention));
  // Without the reshuffle. With it, the multi-buffer pipeline is a little faster here (backward
  // 73.73 against 73.91 ms): the backward's last stage, whose pairs are all local, starts
  // before the stage before's returning partials are in (lock-step waits for them).
  SimOptions bare = o;
  bare.reshuffle = false;
  EXPECT_EQ(simulate(two, hw, bare).timeMs, simulate(two, multiBuffer, bare).timeMs);
  EXPECT_LE(simulate(two, multiBuffer, o).timeMs, simulate(two, hw, o).timeMs);
  c.bufferDepth = 3;
  const plan::Plan three = plan::buildPlan(batch, c, hw.costModel(c.attention));
  EXPECT_LT(simulate(three, multiBuffer, o).timeMs, simulate(three, hw, o).timeMs);
}

TEST(PipelineSpanTest, IsTheSimulatedForwardPassWhenLinksAreFree) {
  const HardwareProfile hw = freeLinks();
  struct Case {
    const char* workload;
    int64_t workers, tokensPerWorker;
    plan::Placement placement;
    uint64_t seed;
  };
  int waits = 0;  // plans whose span is above their busiest worker's cost
  for (const Case& k : {Case{"bimodal", 64, 8192, plan::Placement::kLocal, 2},
                        Case{"bimodal", 64, 8192, plan::Placement::kLpt, 2},
                        Case{"lognormal", 16, 8192, plan::Placement::kLocal, 2},
                        Case{"lognormal", 16, 8192, plan::Placement::kLocal, 0},
                        Case{"bimodal", 16, 8192, plan::Placement::kLocal, 0},
                        Case{"lognormal-narrow", 8, 32768, plan::Placement::kLpt, 1},
                        Case{"lognormal", 3, 32768, plan::Placement::kLocal, 0}}) {
    plan::PlanConfig c;
    c.numWorkers = k.workers;
    c.tokensPerWorker = k.tokensPerWorker;
    c.placement = k.placement;
    const Batch batch =
        sampleBatch(findWorkload(k.workload), k.workers * k.tokensPerWorker, k.seed);
    const plan::Plan fcp = plan::buildPlan(batch, c, hw.costModel(c.attention));
    // Ring attention's stages, another shape: every worker passes the KV it got on to the next
    // (relays), one step per stage.
    const plan::Plan ring = baselines::ringPlan(batch, c, hw.costModel(c.attention));
    for (const plan::Plan* p : {&fcp, &ring}) {
      const std::string what = std::string(k.workload) + " on " + std::to_string(k.workers) +
                               " workers, " + p->strategy;
      const double span = plan::pipelineSpan(*p);
      EXPECT_NEAR(span, simulatedForwardCost(*p, hw), 1e-9 * span) << what;
      EXPECT_GE(span, busiestCost(*p) * (1 - 1e-12)) << what;
      waits += span > busiestCost(*p) * 1.01;
    }
  }
  EXPECT_GE(waits, 3);  // the comparison covers plans that wait, not only ones that never do
}

/// Two workers, two stages: worker 1's second stage receives a block worker 0 sends as it
/// enters its own second stage, after a first stage of 5 units of compute.
TEST(PipelineSpanTest, AStageEndsOnlyOnceItsPartnerHasEnteredTheStageHoldingTheTransfer) {
  plan::Plan p;
  p.config.numWorkers = 2;
  p.pairs = {{0, 0, 1, 5.0}, {1, 1, 1, 1.0}, {2, 2, 1, 2.0}};
  p.transfers = {{.block = 0, .sender = 0, .receiver = 1, .round = 0, .bytes = 64}};
  // The plan with forward stages f.
  std::vector<std::vector<plan::StageIds>> f;
  const auto with =
      [&](const std::vector<std::vector<plan::StageIds>>& stages) -> const plan::Plan& {
    p.forward = plan::Stages(stages);
    return p;
  };
  f.assign(2, std::vector<plan::StageIds>(2));
  f[0][0].compute = {0};  // 5
  f[0][1].send = {0};
  f[1][0].compute = {1};  // 1
  f[1][1].recv = {0};
  f[1][1].compute = {2};  // 2: done at 1 + 2 = 3 without the wait, at 5 with it
  EXPECT_DOUBLE_EQ(plan::pipelineSpan(with(f)), 5.0);
  f[0][0].compute.clear();  // worker 0 enters stage 1 at once: worker 1 never waits
  EXPECT_DOUBLE_EQ(plan::pipelineSpan(with(f)), 3.0);
  // Held in different stages at its two ends (not as buildStages places transfers): worker
  // 1's first stage now waits for worker 0 to enter its second, after 5 units.
  f[0][0].compute = {0};
  f[1][1].recv.clear();
  f[1][0].recv = {0};
  EXPECT_DOUBLE_EQ(plan::pipelineSpan(with(f)), 7.0);  // 5, then worker 1's 2
  // Each first stage waiting for the other worker's second: worker 1 receives in its stage 0
  // what worker 0 sends in its stage 1, and worker 0 in its stage 0 what worker 1 sends in its
  // stage 1. No order of the stages lets either start: a cycle.
  p.transfers = {{.block = 0, .sender = 0, .receiver = 1, .round = 0, .bytes = 64},
                 {.block = 1, .sender = 1, .receiver = 0, .round = 0, .bytes = 64}};
  f.assign(2, std::vector<plan::StageIds>(2));
  f[0][1].send = {0};
  f[1][0].recv = {0};
  f[1][1].send = {1};
  f[0][0].recv = {1};
  try {
    plan::pipelineSpan(with(f));
    ADD_FAILURE() << "a cycle gave a span";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidPlan);
  }
  f[1][1].send = {};
  f[1][0].send = {1, 1};  // sent twice by one end
  EXPECT_THROW(plan::pipelineSpan(with(f)), Error);
  f[1][0].send = {};  // never sent
  EXPECT_THROW(plan::pipelineSpan(with(f)), Error);
  f[1][0].send = {2};  // no such transfer
  EXPECT_THROW(plan::pipelineSpan(with(f)), Error);
  f.pop_back();  // stages of one worker of two
  EXPECT_THROW(plan::pipelineSpan(with(f)), Error);
}

}  // namespace
}  // namespace fcp::sim
