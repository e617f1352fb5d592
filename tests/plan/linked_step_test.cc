// The link-aware choice's step estimate (src/plan/communication.h, linkedStepTime): each stage
// as long as the longest of its compute, its sends and its receives over the link.
#include "communication.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "fcp/core/workload.h"
#include "fcp/plan/communication.h"
#include "fcp/plan/plan.h"

namespace fcp::plan {
namespace {

// Two workers, by hand. Forward: worker 0 computes pair 0 (cost 5) and sends transfer 0 (10
// bytes) in stage 0; worker 1 computes pair 1 (cost 1) and receives it in stage 0, then pair 2
// (cost 3) in stage 1. At 2 cost units a byte, stage 0 takes max(5, 20) = 20 at worker 0 and
// max(1, 20) = 20 at worker 1 (neither waits: the other end's entry is the start), stage 1
// ends at 20 + 3 = 23. At 0 a byte, 5 and max(0 + 1, 0) + 3 = 4: 5. Backward adds the partial
// (at 3x the bytes) going back in stage 1, which worker 1 sends and worker 0 receives: worker
// 0's stage 1 waits for worker 1's stage 0 to end.
Plan handPlan() {
  Plan p;
  p.config.numWorkers = 2;
  p.pairs = {{0, 0, 1, 5.0}, {1, 0, 1, 1.0}, {1, 1, 1, 3.0}};
  p.transfers = {{.block = 0, .sender = 0, .receiver = 1, .round = 0, .bytes = 10}};
  StageIds send, recv, last;
  send.send = {0};
  send.compute = {0};
  recv.recv = {0};
  recv.compute = {1};
  last.compute = {2};
  p.forward = Stages({{send}, {recv, last}});
  StageIds back0 = send, back1;  // worker 0: the same stage 0, then the partial comes back
  back1.recvGrad = {0};
  StageIds grad = last;
  grad.sendGrad = {0};
  p.backward = Stages({{back0, back1}, {recv, grad}});
  return p;
}

TEST(LinkedStepTest, AHandPlanTakesTheLongestOfComputeSendsAndReceives) {
  const Plan p = handPlan();
  EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.forward, 1.0, 2.0, 0.0), 23.0);
  EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.forward, 1.0, 0.0, 0.0), 5.0);
  EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.forward, 1.0, 0.0, 0.0), pipelineSpan(p));
  // Backward at 2 a byte, compute x2.5, partial 30 bytes: worker 1's stage 0 max(2.5, 20) = 20,
  // stage 1 max(7.5, 60) = 60 after it: 80; worker 0's stage 0 max(12.5, 20) = 20, stage 1
  // (receives the partial: 60) ends at max(20 + 60, worker 1's stage 0, 20) = 80.
  EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.backward, 2.5, 2.0, 3.0), 80.0);
}

// Waits that decide. Worker 1 owns a KV block that worker 0 reads. Forward, worker 1 sends it
// in its stage 1 and worker 0 receives it in its stage 1, which cannot end before worker 1's
// stage 0 has (at 10): worker 0's stage 1 ends at max(0 + 5, 10) = 10 and its stage 2 at 18
// (13 without the wait). Backward (compute x2.5), worker 0 sends the block's partial back in
// its stage 1 and worker 1 receives it in its stage 1: worker 0's stage 1 ends at
// max(0 + 12.5, 25) = 25 and its stage 2 at 45 (32.5 without the wait). Free link throughout.
TEST(LinkedStepTest, AStageWaitsForTheOtherEndOfWhatItHolds) {
  Plan p;
  p.config.numWorkers = 2;
  p.pairs = {{0, 1, 1, 5.0}, {1, 1, 1, 10.0}, {1, 1, 1, 3.0}, {0, 0, 1, 8.0}};
  p.transfers = {{.block = 1, .sender = 1, .receiver = 0, .round = 0, .bytes = 10}};
  StageIds idle, take, tail, first, give;
  take.recv = {0};
  take.compute = {0};
  tail.compute = {3};
  first.compute = {1};
  give.send = {0};
  give.compute = {2};
  p.forward = Stages({{idle, take, tail}, {first, give}});
  EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.forward, 1.0, 0.0, 0.0), 18.0);
  EXPECT_DOUBLE_EQ(pipelineSpan(p), 18.0);
  StageIds sendPartial, recvPartial;
  sendPartial.sendGrad = {0};
  sendPartial.compute = {0};
  recvPartial.recvGrad = {0};
  recvPartial.compute = {2};
  p.backward = Stages({{idle, sendPartial, tail}, {first, recvPartial}});
  EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.backward, 2.5, 0.0, 0.0), 45.0);
}

TEST(LinkedStepTest, WithAFreeLinkTheForwardPassIsPipelineSpanAndTheStepHasItsFloors) {
  for (const char* workload : {"lognormal", "bimodal", "lognormal-narrow"}) {
    for (uint64_t seed = 0; seed < 3; ++seed) {
      PlanConfig c;
      c.numWorkers = 16;
      c.tokensPerWorker = 8192;
      const Batch batch = sampleBatch(findWorkload(workload), 16 * 8192, seed);
      const Plan p = buildPlan(batch, c, CostModel{c.attention});
      // Stage by stage against pipelineSpan's own pass (and its check that ends align).
      EXPECT_DOUBLE_EQ(detail::linkedPassSpan(p, p.forward, 1.0, 0.0, 0.0), pipelineSpan(p))
          << workload << " seed " << seed;
      double busiest = 0;
      for (const WorkerLoad& l : p.loads) busiest = std::max(busiest, l.cost);
      int64_t reshuffle = 0, kv = 0;
      for (const WorkerTraffic& w : computeTraffic(p)) {
        reshuffle = std::max({reshuffle, w.forward.reshuffleSent, w.forward.reshuffleReceived});
        kv = std::max({kv, w.forward.kvSent, w.forward.kvReceived});
      }
      for (const double perByte : {0.0, 100.0, 20000.0}) {
        const double time = detail::linkedStepTime(p, perByte);
        // Each worker runs its stages one after another: both passes' compute, and each
        // pass's bytes in its busier direction, are floors; the reshuffle comes on top.
        EXPECT_GE(time * (1 + 1e-12), 3.5 * busiest + perByte * static_cast<double>(reshuffle));
        EXPECT_GE(time * (1 + 1e-12), perByte * static_cast<double>(kv + reshuffle));
      }
      EXPECT_LT(detail::linkedStepTime(p, 100.0), detail::linkedStepTime(p, 20000.0));
    }
  }
}

}  // namespace
}  // namespace fcp::plan
