// The simulator on cases small enough to time by hand: one transfer, two transfers into one
// NIC, a pipeline whose compute hides its communication, a ring of N steps.
#include "fcp/sim/simulator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../common/error_of.h"
#include "../common/unit_hardware.h"
#include "fcp/baselines/ring.h"
#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"
#include "fcp/sim/hardware.h"

namespace fcp::sim {
namespace {

using fcp::testing::errorOf;
using fcp::testing::risingCurveHardware;
using fcp::testing::unitHardware;

/// A bare plan: `workers` workers with `stages` empty forward stages each; one head of one
/// dimension under a full mask, so that a visible entry is 4 forward FLOPs.
plan::Plan barePlan(int64_t workers, size_t stages) {
  plan::Plan p;
  p.config.numWorkers = workers;
  p.config.attention.numHeadsQ = p.config.attention.numHeadsKv = 1;
  p.config.attention.headDim = 1;
  p.config.attention.mask = MaskKind::kFull;
  p.forward = plan::Stages(std::vector<std::vector<plan::StageIds>>(
      static_cast<size_t>(workers), std::vector<plan::StageIds>(stages)));
  p.backward = p.forward;
  return p;
}

/// Adds a transfer of `bytes` from `from` to `to` in forward stage `stage`.
void addTransfer(plan::Plan& p, int32_t from, int32_t to, int64_t bytes, size_t stage) {
  const auto id = static_cast<int32_t>(p.transfers.size());
  p.transfers.push_back({.block = 0, .sender = from, .receiver = to, .round = 0, .bytes = bytes});
  p.forward.edit([&](auto& forward) {
    forward[static_cast<size_t>(from)][stage].send.push_back(id);
    forward[static_cast<size_t>(to)][stage].recv.push_back(id);
  });
}

/// Adds a pair of `qTokens` x `kvTokens` visible entries, two new blocks of a new sequence,
/// to `worker`'s stage `stage` of both passes; returns its forward FLOPs.
double addPair(plan::Plan& p, int32_t worker, int64_t qTokens, int64_t kvTokens, size_t stage) {
  const auto sequence = static_cast<int32_t>(p.blocks.size() / 2);
  const auto q = static_cast<int32_t>(p.blocks.size());
  p.blocks.push_back({{{sequence, 0, qTokens}}});
  p.blocks.push_back({{{sequence, qTokens, qTokens + kvTokens}}});
  const double flops = forwardFlops(p.config.attention, qTokens * kvTokens);
  p.pairs.push_back({q, q + 1, qTokens * kvTokens, flops});
  const auto id = static_cast<int32_t>(p.pairs.size() - 1);
  for (plan::Stages* pass : {&p.forward, &p.backward})
    pass->edit(
        [&](auto& stages) { stages[static_cast<size_t>(worker)][stage].compute.push_back(id); });
  return flops;
}

/// Adds a pair computing for `seconds` at 1 TFLOP/s (unitHardware) to `worker`'s stage `stage`:
/// one query against seconds x 1e12 / 4 keys.
void addCompute(plan::Plan& p, int32_t worker, double seconds, size_t stage) {
  addPair(p, worker, 1, static_cast<int64_t>(seconds * 1e12 / 4), stage);
}

SimOptions forwardOnly() {
  SimOptions o;
  o.backward = false;
  o.reshuffle = false;
  o.timelines = true;
  return o;
}

TEST(SimulatorTest, OneTransferTakesBytesOverBandwidth) {
  plan::Plan p = barePlan(2, 1);
  addTransfer(p, 0, 1, 1'000'000'000, 0);
  const SimResult r = simulate(p, unitHardware(), forwardOnly());
  EXPECT_NEAR(r.forward.timeMs, 1000.0, 1e-6);
  // Inside one node the NVLink-class link is four times faster.
  EXPECT_NEAR(simulate(p, unitHardware(2), forwardOnly()).forward.timeMs, 250.0, 1e-6);
}

TEST(SimulatorTest, ATimeThatIsNotFiniteIsAnErrorNotACrash) {
  // A profile made in code is not bounded as a parsed one is: 1e-301 bytes/s made the drain
  // times infinite, and the event order broke on them (a segfault, found through the CLI).
  plan::Plan p = barePlan(2, 1);
  addTransfer(p, 0, 1, 1'000'000'000, 0);
  HardwareProfile h = unitHardware();
  h.interNodeBytesPerSecond = 1e-301;
  EXPECT_NE(errorOf([&] {
              simulate(p, h, forwardOnly());
            }).find("a simulated time of inf s: expected finite times"),
            std::string::npos);
  HardwareProfile slow = unitHardware();
  slow.peakFlops = 1e-301;
  plan::Plan q = barePlan(1, 1);
  addCompute(q, 0, 1.0, 0);
  EXPECT_NE(errorOf([&] { simulate(q, slow, forwardOnly()); }).find("expected finite times"),
            std::string::npos);
}

TEST(SimulatorTest, AMultiBufferPipelineComputesOnceItsOwnKvHasArrived) {
  // Worker 1 computes for 1 s in stage 2 with block 1, which arrived from worker 0 in stage 0
  // (1 ms); in stage 1 another block takes 1 s to arrive. Stage by stage, the compute waits for
  // that second transfer: 1 + 1000 + 1000 ms. With the multi-buffer pipeline it waits only for
  // its own block and runs beside the second transfer: 1 + 1000 ms.
  plan::Plan p = barePlan(2, 3);
  addCompute(p, 1, 1.0, 2);           // Q block 0 (worker 1's), KV block 1 (worker 0's)
  p.blocks.push_back({{{1, 0, 1}}});  // block 2, worker 0's, what stage 1 brings
  p.owner = {1, 0, 0};
  addTransfer(p, 0, 1, 1'000'000, 0);
  p.transfers.back().block = 1;
  addTransfer(p, 0, 1, 1'000'000'000, 1);
  p.transfers.back().block = 2;
  const SimOptions o = forwardOnly();
  EXPECT_NEAR(simulate(p, unitHardware(), o).forward.timeMs, 2001.0, 1e-6);
  HardwareProfile multiBuffer = unitHardware();
  multiBuffer.pipeline = Pipeline::kMultiBuffer;
  const SimResult ahead = simulate(p, multiBuffer, o);
  EXPECT_NEAR(ahead.forward.timeMs, 1001.0, 1e-6);
  // Worker 1's stage 2: it began when its block was in (1 ms) and ended with its compute.
  const StageSpan& last = ahead.forward.timelines[1][2];
  EXPECT_NEAR(last.startMs, 1.0, 1e-6);
  EXPECT_NEAR(last.computeEndMs, 1001.0, 1e-6);
  EXPECT_NEAR(last.computeStartMs, 1.0, 1e-6);
  EXPECT_NEAR(last.endMs, 1001.0, 1e-6);
  // Its stage 1, each stream on its own: the second block's messages from when the first was
  // in (1 ms) to 1001 ms, the (empty) compute at 1 ms, once stage 0's messages were done.
  const StageSpan& second = ahead.forward.timelines[1][1];
  EXPECT_NEAR(second.commStartMs, 1.0, 1e-6);
  EXPECT_NEAR(second.commEndMs, 1001.0, 1e-6);
  EXPECT_NEAR(second.computeStartMs, 1.0, 1e-6);
  EXPECT_NEAR(second.computeEndMs, 1.0, 1e-6);
  EXPECT_NEAR(second.startMs, 1.0, 1e-6);
  EXPECT_NEAR(second.endMs, 1001.0, 1e-6);
  // Stage 2 has no messages: they are posted and done once stage 1's are.
  EXPECT_NEAR(last.commStartMs, 1001.0, 1e-6);
  EXPECT_NEAR(last.commEndMs, 1001.0, 1e-6);
  // A compute that reads a block arriving only in its own stage still waits as stage by stage.
  p.transfers.front().round = 0;
  p.forward.edit([&](auto& forward) {
    std::swap(forward[0][0].send, forward[0][2].send);
    std::swap(forward[1][0].recv, forward[1][2].recv);
  });
  EXPECT_NEAR(simulate(p, multiBuffer, o).forward.timeMs,
              simulate(p, unitHardware(), o).forward.timeMs, 1e-9);
}

TEST(SimulatorTest, AMultiBufferComputeWaitsForTheLatestOfItsBlocksAndForStageZero) {
  HardwareProfile multiBuffer = unitHardware();
  multiBuffer.pipeline = Pipeline::kMultiBuffer;
  const SimOptions o = forwardOnly();
  {
    // Worker 1's stage 3 reads block 1 (arrives in stage 0, 1 ms) and block 3 (stage 1, 500
    // ms); stage 2 brings an unread block in 200 ms. The compute (1 s) waits for the later of
    // its blocks, stage 1's, not for stage 2's: 501 + 1000 ms. Stage by stage: 701 + 1000.
    plan::Plan p = barePlan(2, 4);
    addCompute(p, 1, 0.5, 3);           // Q block 0 (worker 1), KV block 1 (worker 0)
    addCompute(p, 1, 0.5, 3);           // Q block 2 (worker 1), KV block 3 (worker 0)
    p.blocks.push_back({{{2, 0, 1}}});  // block 4, read by no one
    p.owner = {1, 0, 1, 0, 0};
    struct Sent {
      int64_t bytes;
      size_t stage;
      int32_t block;
    };
    for (const Sent& t :
         {Sent{1'000'000, 0, 1}, Sent{500'000'000, 1, 3}, Sent{200'000'000, 2, 4}}) {
      addTransfer(p, 0, 1, t.bytes, t.stage);
      p.transfers.back().block = t.block;
    }
    EXPECT_NEAR(simulate(p, unitHardware(), o).forward.timeMs, 1701.0, 1e-6);
    EXPECT_NEAR(simulate(p, multiBuffer, o).forward.timeMs, 1501.0, 1e-6);
  }
  {
    // Stage 0 brings an unread block in 1 s (as the reshuffle in does, beside stage 0's pairs);
    // stage 1 computes with a block worker 1 owns. From stage 1 on a compute waits for stage
    // 0's messages, so both pipelines take 1000 + 1000 ms.
    plan::Plan p = barePlan(2, 2);
    addCompute(p, 1, 1.0, 1);
    p.blocks.push_back({{{1, 0, 1}}});
    p.owner = {1, 1, 0};
    addTransfer(p, 0, 1, 1'000'000'000, 0);
    p.transfers.back().block = 2;
    EXPECT_NEAR(simulate(p, unitHardware(), o).forward.timeMs, 2000.0, 1e-6);
    EXPECT_NEAR(simulate(p, multiBuffer, o).forward.timeMs, 2000.0, 1e-6);
  }
}

TEST(SimulatorTest, LatencyIsAddedOncePerTransfer) {
  plan::Plan p = barePlan(2, 1);
  addTransfer(p, 0, 1, 1'000'000, 0);
  HardwareProfile h = unitHardware();
  h.interNodeLatencySeconds = 0.5e-3;
  EXPECT_NEAR(simulate(p, h, forwardOnly()).forward.timeMs, 1.5, 1e-9);
}

TEST(SimulatorTest, TwoSendersIntoOneNicTakeTwiceAsLong) {
  plan::Plan into = barePlan(3, 1);
  addTransfer(into, 0, 2, 1'000'000'000, 0);
  addTransfer(into, 1, 2, 1'000'000'000, 0);
  EXPECT_NEAR(simulate(into, unitHardware(), forwardOnly()).forward.timeMs, 2000.0, 1e-6);
  // Without congestion (different receivers) the same bytes take half the time.
  plan::Plan apart = barePlan(4, 1);
  addTransfer(apart, 0, 2, 1'000'000'000, 0);
  addTransfer(apart, 1, 3, 1'000'000'000, 0);
  EXPECT_NEAR(simulate(apart, unitHardware(), forwardOnly()).forward.timeMs, 1000.0, 1e-6);
}

TEST(SimulatorTest, ShareIsRecomputedWhenAFlowEnds) {
  // 1 GB and 3 GB into one NIC: both at 0.5 GB/s for 2 s, then the rest alone: 4 s total.
  plan::Plan p = barePlan(3, 1);
  addTransfer(p, 0, 2, 1'000'000'000, 0);
  addTransfer(p, 1, 2, 3'000'000'000, 0);
  const SimResult r = simulate(p, unitHardware(), forwardOnly());
  EXPECT_NEAR(r.forward.timeMs, 4000.0, 1e-6);
  EXPECT_NEAR(r.forward.finishMs[0], 2000.0, 1e-6);  // each sender is done with its own flow
  EXPECT_NEAR(r.forward.finishMs[1], 4000.0, 1e-6);
}

/// Finish times, in ms, of flows of `bytes` sharing one port of `capacity` bytes/s equally
/// (processor sharing): sorted by size, the i-th ends at Σ_{j ≤ i} (b_j − b_{j−1}) (k − j + 1)
/// / capacity.
std::vector<double> processorSharingFinishMs(const std::vector<int64_t>& bytes, double capacity) {
  std::vector<int64_t> sorted = bytes;
  std::sort(sorted.begin(), sorted.end());
  std::vector<double> finish;
  for (const int64_t b : bytes) {
    double seconds = 0;
    int64_t previous = 0;
    for (size_t j = 0; j < sorted.size() && sorted[j] <= b; ++j) {
      seconds += static_cast<double>(sorted[j] - previous) *
                 static_cast<double>(sorted.size() - j) / capacity;
      previous = sorted[j];
    }
    finish.push_back(seconds * 1e3);
  }
  return finish;
}

/// k distinct sizes in a shuffled order.
std::vector<int64_t> shuffledSizes(int32_t k, int32_t stride) {
  std::vector<int64_t> bytes;
  for (int32_t i = 0; i < k; ++i) bytes.push_back(int64_t{10'000'000} * (1 + (i * stride) % k));
  return bytes;
}

// k senders of distinct sizes into one NIC, listed in shuffled order, so flows leave the
// receiver's port from the middle of its list.
TEST(SimulatorTest, ManySendersIntoOneNicFinishAsUnderProcessorSharing) {
  constexpr int32_t k = 40;
  const std::vector<int64_t> bytes = shuffledSizes(k, 17);
  plan::Plan p = barePlan(k + 1, 1);
  for (int32_t i = 0; i < k; ++i) addTransfer(p, i, k, bytes[static_cast<size_t>(i)], 0);
  const SimResult r = simulate(p, unitHardware(), forwardOnly());
  const std::vector<double> expect = processorSharingFinishMs(bytes, 1e9);
  for (size_t i = 0; i < bytes.size(); ++i)
    EXPECT_NEAR(r.forward.finishMs[i], expect[i], 1e-6) << "sender " << i;
}

// The mirror case: one sender to k receivers, so flows leave the sender's out port from the
// middle of its list.
TEST(SimulatorTest, OneSenderToManyReceiversFinishAsUnderProcessorSharing) {
  constexpr int32_t k = 40;
  const std::vector<int64_t> bytes = shuffledSizes(k, 23);
  plan::Plan p = barePlan(k + 1, 1);
  for (int32_t i = 0; i < k; ++i) addTransfer(p, k, i, bytes[static_cast<size_t>(i)], 0);
  const SimResult r = simulate(p, unitHardware(), forwardOnly());
  const std::vector<double> expect = processorSharingFinishMs(bytes, 1e9);
  for (size_t i = 0; i < bytes.size(); ++i)
    EXPECT_NEAR(r.forward.finishMs[i], expect[i], 1e-6) << "receiver " << i;
}

TEST(SimulatorTest, ComputeHidesCommunicationInAPipeline) {
  // Worker 1 receives a block per stage (0.5 s each) while computing 1 s per stage on what
  // arrived before: four stages of 1 s, the transfers entirely hidden.
  plan::Plan p = barePlan(2, 4);
  for (size_t s = 0; s < 3; ++s) addTransfer(p, 0, 1, 500'000'000, s);
  for (size_t s = 0; s < 4; ++s) addCompute(p, 1, 1.0, s);
  const SimResult r = simulate(p, unitHardware(), forwardOnly());
  EXPECT_NEAR(r.forward.timeMs, 4000.0, 1e-6);
  EXPECT_NEAR(r.forward.computeMs[1], 4000.0, 1e-6);
  ASSERT_EQ(r.forward.timelines[1].size(), 4u);
  EXPECT_NEAR(r.forward.timelines[1][2].startMs, 2000.0, 1e-6);
  // When communication dominates, the stage waits for it: 2 s per transfer stage, 1 s last.
  plan::Plan slow = barePlan(2, 4);
  for (size_t s = 0; s < 3; ++s) addTransfer(slow, 0, 1, 2'000'000'000, s);
  for (size_t s = 0; s < 4; ++s) addCompute(slow, 1, 1.0, s);
  EXPECT_NEAR(simulate(slow, unitHardware(), forwardOnly()).forward.timeMs, 7000.0, 1e-6);
}

TEST(SimulatorTest, EachStageMergesItsRemoteQBlocksOnce) {
  // Ring on 4 workers, one 16K-token sequence: each worker's Q block (4K tokens) computes with
  // remote KV in 3 stages of each pass, so the merge cost adds 3 x 4K x heads x dim x c to
  // every worker's compute, forward and backward; the local stage merges nothing.
  plan::PlanConfig c;
  c.numWorkers = 4;
  c.tokensPerWorker = 4096;
  const plan::Plan p = baselines::ringPlan(Batch{{16384}}, c, CostModel{c.attention});
  HardwareProfile h = unitHardware();
  SimOptions o;
  o.reshuffle = false;
  const SimResult before = simulate(p, h, o);
  h.mergeSecondsPerElement = 1e-12;
  const SimResult after = simulate(p, h, o);
  const double mergeMs = 3.0 * 4096 * static_cast<double>(c.attention.numHeadsQ * c.attention.headDim) * 1e-12 * 1e3;
  for (size_t w = 0; w < 4; ++w) {
    EXPECT_NEAR(after.forward.computeMs[w] - before.forward.computeMs[w], mergeMs, 1e-9) << w;
    EXPECT_NEAR(after.backward.computeMs[w] - before.backward.computeMs[w], mergeMs, 1e-9) << w;
  }
}

/// Visible (query, key) entries between two chunks of one sequence, counted query by query
/// (not with visibleEntries): under a causal mask query i sees keys j <= i.
int64_t visibleByRows(MaskKind mask, const plan::Chunk& q, const plan::Chunk& k) {
  int64_t visible = 0;
  for (int64_t i = q.begin; i < q.end; ++i) {
    const int64_t last = mask == MaskKind::kCausal ? std::min(k.end, i + 1) : k.end;
    visible += std::max<int64_t>(0, last - k.begin);
  }
  return visible;
}

/// Per worker, the compute seconds of `plan`'s pass as one launch per stage: the pairs of a
/// stage grouped by (Q block, sequence) forward and (KV block, sequence) backward, each group's
/// entries at f(its keys forward, its queries backward); no merges.
std::vector<double> stageLaunchSeconds(const plan::Plan& plan, const HardwareProfile& hw,
                                       bool backward) {
  const auto& passStages = backward ? plan.backward : plan.forward;
  const EfficiencyCurve& curve = backward ? hw.backward : hw.forward;
  std::vector<double> seconds(static_cast<size_t>(plan.config.numWorkers), 0.0);
  for (size_t w = 0; w < seconds.size(); ++w) {
    for (const plan::Stage& st : passStages[w]) {
      std::map<std::pair<int32_t, int32_t>, std::pair<int64_t, int64_t>> groups;  // visible, loop
      for (const int32_t id : st.compute) {
        const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(id)];
        const plan::Block& q = plan.blocks[static_cast<size_t>(pair.qBlock)];
        const plan::Block& k = plan.blocks[static_cast<size_t>(pair.kvBlock)];
        std::map<int32_t, std::pair<int64_t, int64_t>> bySequence;
        for (const plan::Chunk& qc : q.chunks) {
          for (const plan::Chunk& kc : k.chunks) {
            if (qc.sequence == kc.sequence)
              bySequence[qc.sequence].first += visibleByRows(plan.config.attention.mask, qc, kc);
          }
        }
        for (auto& [sequence, entry] : bySequence) {
          if (entry.first == 0) continue;
          for (const plan::Chunk& c : (backward ? q : k).chunks) {
            if (c.sequence == sequence) entry.second += c.numTokens();
          }
          auto& g = groups[{backward ? pair.kvBlock : pair.qBlock, sequence}];
          g.first += entry.first;
          g.second += entry.second;
        }
      }
      for (const auto& [key, g] : groups) {
        const double flops = backward ? backwardFlops(plan.config.attention, g.first)
                                      : forwardFlops(plan.config.attention, g.first);
        seconds[w] += flops / (curve.at(g.second) * hw.peakFlops);
      }
    }
  }
  return seconds;
}

TEST(SimulatorTest, AStageLaunchRunsEachSequenceAtTheKeysOrQueriesItLoopsOver) {
  // FCP plans of a long-tailed batch with coalesce 4, where a stage holds several KV blocks of
  // one Q block: each worker's compute in both passes against the grouping done here by rows.
  HardwareProfile h = risingCurveHardware();
  h.launch = KernelLaunch::kStage;
  HardwareProfile perPair = h;
  perPair.launch = KernelLaunch::kPair;
  SimOptions o;
  o.reshuffle = false;
  int differs = 0;  // workers whose time per pair differs: the grouping is exercised
  for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kFull}) {
    for (const uint64_t seed : {0, 1}) {
      plan::PlanConfig c;
      c.numWorkers = 4;
      c.tokensPerWorker = 4096;
      c.blockSize = 512;
      c.coalesce = 4;
      c.attention.mask = mask;
      const Batch batch = sampleBatch(findWorkload("lognormal"), 4 * 4096, seed);
      const plan::Plan p = plan::buildPlan(batch, c, h.costModel(c.attention));
      const SimResult r = simulate(p, h, o);
      const SimResult pairs = simulate(p, perPair, o);
      for (const bool backward : {false, true}) {
        const std::vector<double> want = stageLaunchSeconds(p, h, backward);
        const PassResult& got = backward ? r.backward : r.forward;
        const PassResult& perPairGot = backward ? pairs.backward : pairs.forward;
        for (size_t w = 0; w < want.size(); ++w) {
          EXPECT_NEAR(got.computeMs[w], want[w] * 1e3, 1e-9 * want[w] * 1e3)
              << "seed " << seed << (backward ? " backward" : " forward") << " worker " << w;
          differs += std::abs(perPairGot.computeMs[w] - got.computeMs[w]) > 1e-6 * got.computeMs[w];
        }
      }
    }
  }
  EXPECT_GE(differs, 8);
}

TEST(SimulatorTest, ARingStepTimesAlikeWhicheverWayKernelsLaunch) {
  // One KV block per stage and Q and KV pieces of equal length: a stage launch is the pair.
  HardwareProfile h = risingCurveHardware();
  h.mergeSecondsPerElement = 1e-12;
  plan::PlanConfig c;
  c.numWorkers = 4;
  c.tokensPerWorker = 4096;
  const plan::Plan p =
      baselines::ringPlan(Batch{{8192, 4096, 2048, 2048}}, c, h.costModel(c.attention));
  SimOptions o;
  o.reshuffle = false;
  const SimResult pairs = simulate(p, h, o);
  h.launch = KernelLaunch::kStage;
  const SimResult stages = simulate(p, h, o);
  for (size_t w = 0; w < 4; ++w) {
    EXPECT_NEAR(stages.forward.computeMs[w], pairs.forward.computeMs[w],
                1e-12 * pairs.forward.computeMs[w]);
    EXPECT_NEAR(stages.backward.computeMs[w], pairs.backward.computeMs[w],
                1e-12 * pairs.backward.computeMs[w]);
  }
}

TEST(SimulatorTest, MergesComeAfterEveryRemotePairOrOncePerStageAsKernelsLaunch) {
  // One 32K-token sequence on 4 workers in 1K blocks, coalesce 8: a Q block computes with
  // several remote KV blocks in one stage. Per pair, every such pair merges its Q block; per
  // stage, each Q block once in each stage where it reads remote KV.
  plan::PlanConfig c;
  c.numWorkers = 4;
  c.tokensPerWorker = 8192;
  c.blockSize = 1024;
  c.coalesce = 8;
  HardwareProfile h = unitHardware();
  const plan::Plan p = plan::buildPlan(Batch{{32768}}, c, h.costModel(c.attention));
  SimOptions o;
  o.reshuffle = false;
  const double perElement = 1e-12;
  const double elements = static_cast<double>(c.attention.numHeadsQ * c.attention.headDim);
  int64_t fewer = 0;  // workers where the stage launch merges less often
  for (const KernelLaunch launch : {KernelLaunch::kPair, KernelLaunch::kStage}) {
    h.launch = launch;
    h.mergeSecondsPerElement = 0;
    const SimResult before = simulate(p, h, o);
    h.mergeSecondsPerElement = perElement;
    const SimResult after = simulate(p, h, o);
    for (const bool backward : {false, true}) {
      const auto& passStages = backward ? p.backward : p.forward;
      for (size_t w = 0; w < 4; ++w) {
        double perPairTokens = 0, perStageTokens = 0;
        for (const plan::Stage& st : passStages[w]) {
          std::vector<int32_t> remote;
          for (const int32_t id : st.compute) {
            const plan::BlockPair& pair = p.pairs[static_cast<size_t>(id)];
            if (p.owner[static_cast<size_t>(pair.kvBlock)] != static_cast<int32_t>(w))
              remote.push_back(pair.qBlock);
          }
          for (const int32_t q : remote)
            perPairTokens += static_cast<double>(p.blocks[static_cast<size_t>(q)].numTokens());
          std::sort(remote.begin(), remote.end());
          remote.erase(std::unique(remote.begin(), remote.end()), remote.end());
          for (const int32_t q : remote)
            perStageTokens += static_cast<double>(p.blocks[static_cast<size_t>(q)].numTokens());
        }
        const double tokens = launch == KernelLaunch::kPair ? perPairTokens : perStageTokens;
        const PassResult& a = backward ? after.backward : after.forward;
        const PassResult& b = backward ? before.backward : before.forward;
        EXPECT_NEAR(a.computeMs[w] - b.computeMs[w], tokens * elements * perElement * 1e3, 1e-9)
            << (launch == KernelLaunch::kPair ? "pair" : "stage") << " worker " << w;
        fewer += launch == KernelLaunch::kStage && perStageTokens < perPairTokens;
      }
    }
  }
  EXPECT_GE(fewer, 4);
}

TEST(SimulatorTest, ATransferWaitsForBothSidesToPostIt) {
  // Worker 0 computes 1 s in stage 0 and sends in stage 1; worker 1 receives in stage 1,
  // which it enters at once, so the 1 s transfer runs from 1 s to 2 s.
  plan::Plan p = barePlan(2, 2);
  addCompute(p, 0, 1.0, 0);
  addTransfer(p, 0, 1, 1'000'000'000, 1);
  EXPECT_NEAR(simulate(p, unitHardware(), forwardOnly()).forward.timeMs, 2000.0, 1e-6);
}

TEST(SimulatorTest, EachPassTimesPairsOnItsOwnCurveAtThePairsBlockLength) {
  // Forward at 0.5 of peak throughout; backward at 0.25 of peak on 1K-token Q blocks rising to
  // 1.0 on 4K ones (log-linear between): a pair's backward takes 2.5 x its forward FLOPs at
  // f_bwd(its Q tokens), not at one ratio for the whole curve.
  HardwareProfile h = unitHardware();
  h.forward = EfficiencyCurve({{1, 0.5}});
  h.backward = EfficiencyCurve({{1024, 0.25}, {4096, 1.0}});
  SimOptions o = forwardOnly();
  o.backward = true;
  for (const auto& [tokens, fBwd] : {std::pair{1024, 0.25}, {2048, 0.625}, {4096, 1.0}}) {
    plan::Plan p = barePlan(1, 1);
    const double flops = addPair(p, 0, tokens, 1000, 0);
    const SimResult r = simulate(p, h, o);
    EXPECT_NEAR(r.forward.timeMs, flops / (1e12 * 0.5) * 1e3, 1e-9) << tokens;
    EXPECT_NEAR(r.backward.timeMs, 2.5 * flops / (1e12 * fBwd) * 1e3, 1e-9) << tokens;
  }
}

TEST(SimulatorTest, APairNotMadeOfItsBlocksIsRefused) {
  plan::Plan p = barePlan(1, 1);
  addPair(p, 0, 10, 10, 0);
  p.pairs[0].visible = 99;  // the blocks give 100
  for (const KernelLaunch launch : {KernelLaunch::kPair, KernelLaunch::kStage}) {
    HardwareProfile h = unitHardware();
    h.launch = launch;
    try {
      simulate(p, h, forwardOnly());
      ADD_FAILURE() << "timed a pair its blocks do not make";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidPlan);
      const std::string message = e.what();
      EXPECT_NE(message.find("says 99"), std::string::npos) << message;
      EXPECT_NE(message.find("give 100"), std::string::npos) << message;
    }
  }
}

TEST(SimulatorTest, RingOfNStepsTakesNMinusOneHops) {
  // Communication-bound ring: compute is free, each of the P − 1 rounds moves one block per
  // rank over its own NIC, so the forward takes (P − 1) · block bytes / bandwidth.
  for (int64_t ranks : {2, 3, 5, 8}) {
    plan::PlanConfig c;
    c.numWorkers = ranks;
    c.tokensPerWorker = 1024;
    const int64_t len = 2 * ranks * 512;
    const plan::Plan p = baselines::ringPlan(Batch{{len}}, c, CostModel{c.attention});
    HardwareProfile h = unitHardware();
    h.peakFlops = 1e30;
    const double blockBytes = static_cast<double>(len / ranks * c.attention.kvBytesPerToken());
    const SimResult r = simulate(p, h, forwardOnly());
    EXPECT_NEAR(r.forward.timeMs, static_cast<double>(ranks - 1) * blockBytes / 1e9 * 1e3, 1e-6)
        << ranks << " ranks";
    EXPECT_NEAR(r.commImbalance, 0.0, 1e-12);
  }
}

TEST(SimulatorTest, MfuCountsUsefulFlopsOverWorkersPeakAndTime) {
  plan::PlanConfig c;
  c.numWorkers = 4;
  c.tokensPerWorker = 4096;
  HardwareProfile h = unitHardware(8);
  h.forward = h.backward = EfficiencyCurve({{1, 0.5}});
  const plan::Plan p = baselines::ringPlan(Batch{{16384}}, c, h.costModel(c.attention));
  SimOptions o = forwardOnly();
  const SimResult r = simulate(p, h, o);
  EXPECT_GT(r.forward.mfu, 0);
  EXPECT_LE(r.forward.mfu, 0.5 + 1e-12);  // never above the kernels' own efficiency
  EXPECT_NEAR(r.forward.mfu, r.forward.usefulFlops / (4 * 1e12 * r.forward.timeMs * 1e-3), 1e-12);
  o.backward = true;
  const SimResult both = simulate(p, h, o);
  EXPECT_NEAR(both.backward.usefulFlops, 2.5 * both.forward.usefulFlops,
              1e-6 * both.forward.usefulFlops);
  EXPECT_GT(both.backward.timeMs, both.forward.timeMs);
}

TEST(SimulatorTest, ReshuffleCostsItsBytes) {
  plan::PlanConfig c;
  c.numWorkers = 2;
  c.tokensPerWorker = 1024;
  HardwareProfile h = unitHardware();
  h.peakFlops = 1e30;
  const plan::Plan p = baselines::ringPlan(Batch{{2048}}, c, CostModel{c.attention});
  SimOptions o = forwardOnly();
  const double without = simulate(p, h, o).forward.timeMs;
  o.reshuffle = true;
  o.overlapReshuffle = false;
  const SimResult r = simulate(p, h, o);
  // Zig-Zag on 2 ranks: chunks 1 and 2 (512 tokens each) change hands, each way.
  const auto& a = c.attention;
  const double in = 512.0 * static_cast<double>(a.qBytesPerToken() + a.kvBytesPerToken());
  const double out = 512.0 * static_cast<double>(a.oBytesPerToken());
  EXPECT_NEAR(r.forward.timeMs - without, (in + out) / 1e9 * 1e3, 1e-6);
}

/// One block of reshuffledBlocks: a whole sequence of `tokens` tokens (block i, sequence i)
/// that `owner` computes with itself in stage `stage` (full mask: tokens^2 entries, 1 s at
/// 1 TFLOP/s for 5e5 tokens), held by `user` before the reshuffle, which brings it in and takes
/// its output back.
struct ReshuffledBlock {
  int64_t tokens = 0;
  int32_t user = 0, owner = 0;
  size_t stage = 0;
};
plan::Plan reshuffledBlocks(int64_t workers, size_t stages,
                            const std::vector<ReshuffledBlock>& blocks) {
  plan::Plan p = barePlan(workers, stages);
  int64_t begin = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const auto b = static_cast<int32_t>(i);
    const int64_t t = blocks[i].tokens;
    p.batch.sequenceLengths.push_back(t);
    p.blocks.push_back({{{b, 0, t}}});
    p.owner.push_back(blocks[i].owner);
    p.reshuffle.push_back({blocks[i].user, blocks[i].owner, begin, begin + t});
    begin += t;
    p.pairs.push_back({b, b, t * t, forwardFlops(p.config.attention, t * t)});
    p.forward.edit([&](auto& forward) {
      forward[static_cast<size_t>(blocks[i].owner)][blocks[i].stage].compute.push_back(b);
    });
  }
  p.backward = p.forward;
  return p;
}

/// reshuffledBlocks on two workers, every block worker 1's and `tokens` long: block i held by
/// user[i], computed in stage stageOf[i].
plan::Plan reshuffledPlan(size_t stages, const std::vector<int32_t>& user,
                          const std::vector<size_t>& stageOf, int64_t tokens) {
  std::vector<ReshuffledBlock> blocks;
  for (size_t i = 0; i < user.size(); ++i) blocks.push_back({tokens, user[i], 1, stageOf[i]});
  return reshuffledBlocks(2, stages, blocks);
}

TEST(SimulatorTest, WhatTheReshuffleBringsIsComputedOnceItIsIn) {
  // Worker 1 computes block 0 (its own) and block 1 (worker 0's) in stage 0, for 1 s each, and
  // block 2 (its own) in stage 1; block 1's Q, K and V take 2 s to come in, its O 2/3 s to go
  // back. Block 0 computes beside the reshuffle (0-1 s), block 1 once it is in (2-3 s), block
  // 2 after it (3-4 s) while block 1's O goes home. Computing block 1 before its tokens were
  // in, as the simulator did, gave 3 s.
  constexpr int64_t kTokens = 500'000;
  const plan::Plan p = reshuffledPlan(2, {1, 0, 1}, {0, 0, 1}, kTokens);
  const auto& a = p.config.attention;
  HardwareProfile h = unitHardware();
  h.interNodeBytesPerSecond =
      static_cast<double>(kTokens * (a.qBytesPerToken() + a.kvBytesPerToken())) / 2;
  SimOptions o = forwardOnly();
  o.reshuffle = true;
  for (const Pipeline pipeline : {Pipeline::kLockstep, Pipeline::kMultiBuffer}) {
    h.pipeline = pipeline;
    const SimResult r = simulate(p, h, o);
    EXPECT_NEAR(r.forward.timeMs, 4000.0, 1e-6);
    // Worker 1's stage 0 runs in two parts: its own block beside the reshuffle in, in a stage
    // of its own, then the rest.
    // Block 1's O goes home in the reshuffle out's stage after stage 1, beside its compute.
    const auto& spans = r.forward.timelines[1];
    ASSERT_EQ(spans.size(), 4u);
    EXPECT_EQ(spans[0].stage, kReshuffleIn);
    EXPECT_EQ(spans[1].stage, 0);
    EXPECT_EQ(spans[3].stage, kReshuffleOut);
    EXPECT_NEAR(spans[0].computeEndMs, 1000.0, 1e-6);
    EXPECT_NEAR(spans[0].commEndMs, 2000.0, 1e-6);
    EXPECT_NEAR(spans[1].computeStartMs, 2000.0, 1e-6);
    EXPECT_NEAR(spans[3].commStartMs, 3000.0, 1e-6);
    EXPECT_NEAR(spans[3].commEndMs, 3000.0 + 2000.0 / 3.0, 1e-6);
  }
  // Without the reshuffle charged, there is nothing to wait for: 3 s.
  EXPECT_NEAR(simulate(p, h, forwardOnly()).forward.timeMs, 3000.0, 1e-6);
  // Backward (2.5 s a pair): block 0 beside block 1's dO coming in (2/3 s), block 1 after it,
  // block 2 last, while block 1's dQ, dK and dV (2 s) go home: 7.5 s.
  o.backward = true;
  EXPECT_NEAR(simulate(p, h, o).backward.timeMs, 7500.0, 1e-6);
}

TEST(SimulatorTest, TransfersDoNotWaitForWhatComputesBesideTheReshuffleIn) {
  // Worker 1 computes its own block 0 for 1 s beside the reshuffle in (block 1: one token from
  // worker 0) and sends block 0 to worker 0 (1 s) in stage 0: the transfer needs nothing that
  // compute holds, so both end at 1 s, not 2.
  plan::Plan p = reshuffledPlan(1, {1, 0}, {0, 0}, 500'000);
  p.batch.sequenceLengths[1] = 1;
  p.blocks[1] = {{{1, 0, 1}}};
  p.reshuffle[1] = {0, 1, 500'000, 500'001};
  p.pairs[1] = {1, 1, 1, forwardFlops(p.config.attention, 1)};
  addTransfer(p, 1, 0, 1'000'000'000, 0);
  SimOptions o = forwardOnly();
  o.reshuffle = true;
  EXPECT_NEAR(simulate(p, unitHardware(), o).forward.timeMs, 1000.0, 1e-3);
}

TEST(SimulatorTest, AReshuffleThatMovesNothingChangesNothing) {
  // Every piece stays on its worker: the same times and stages as without the reshuffle.
  const plan::Plan p = reshuffledPlan(2, {1, 1, 1}, {0, 0, 1}, 500'000);
  SimOptions o = forwardOnly();
  o.backward = true;
  const SimResult without = simulate(p, unitHardware(), o);
  o.reshuffle = true;
  const SimResult with = simulate(p, unitHardware(), o);
  EXPECT_DOUBLE_EQ(with.timeMs, without.timeMs);
  EXPECT_EQ(with.forward.timelines[1].size(), without.forward.timelines[1].size());
}

TEST(SimulatorTest, AnOutputLeavesOnceItsLastPairIsComputed) {
  // Worker 1 computes block 0 (its own) in stage 0 and block 1 (worker 0's, 1 s to come in) in
  // stage 1, its last: block 1's O (1/3 s) can leave only after it, at 2 s, not beside it.
  constexpr int64_t kTokens = 500'000;
  const plan::Plan p = reshuffledPlan(2, {1, 0}, {0, 1}, kTokens);
  const auto& a = p.config.attention;
  HardwareProfile h = unitHardware();
  h.interNodeBytesPerSecond =
      static_cast<double>(kTokens * (a.qBytesPerToken() + a.kvBytesPerToken()));
  SimOptions o = forwardOnly();
  o.reshuffle = true;
  const SimResult r = simulate(p, h, o);
  EXPECT_NEAR(r.forward.timeMs, 2000.0 + 1000.0 / 3.0, 1e-6);
  // Its own stage after the last (kReshuffleOutAfter), at both ends: worker 0 posts it at 1 s,
  // worker 1 once it has computed.
  for (const size_t w : {0, 1}) {
    const auto& spans = r.forward.timelines[w];
    ASSERT_EQ(spans.size(), 4u) << w;  // the reshuffle in's, stages 0 and 1, the one after
    EXPECT_EQ(spans[3].stage, kReshuffleOutAfter);
    EXPECT_NEAR(spans[3].commStartMs, w == 0 ? 1000.0 : 2000.0, 1e-6) << w;
    EXPECT_NEAR(spans[3].commEndMs, 2000.0 + 1000.0 / 3.0, 1e-6) << w;
  }
  // An output computed before the last stage leaves beside it: block 1 in stage 0, then 1 s of
  // block 0 in stage 1, its O on the way meanwhile.
  const plan::Plan early = reshuffledPlan(2, {1, 0}, {1, 0}, kTokens);
  const SimResult e = simulate(early, h, o);
  EXPECT_NEAR(e.forward.timeMs, 3000.0, 1e-6);
  // The reshuffle in's stage, 0, 1, the reshuffle out's beside stage 1's compute; none after.
  ASSERT_EQ(e.forward.timelines[1].size(), 4u);
  EXPECT_EQ(e.forward.timelines[1][3].stage, kReshuffleOut);
}

TEST(SimulatorTest, OutputsTheLastStageFinishesDoNotWaitForThoseAlreadyOnTheirWay) {
  // Worker 1 computes blocks 0 (its own), 1 (worker 0's) and 2 (worker 2's) for 40 ms each in
  // stages 0, 0 and 1; worker 0 computes its own block 3 for 1 s. Block 1's O leaves after
  // stage 0 but worker 0 takes it only once it has computed (1 s); block 2's O, finished by
  // the last stage (0.12 s), goes to worker 2 at once, not after block 1's.
  constexpr int64_t kSmall = 100'000, kLarge = 500'000;
  const plan::Plan p = reshuffledBlocks(
      3, 2, {{kSmall, 1, 1, 0}, {kSmall, 0, 1, 0}, {kSmall, 2, 1, 1}, {kLarge, 0, 0, 0}});
  SimOptions o = forwardOnly();
  o.reshuffle = true;
  const SimResult r = simulate(p, unitHardware(), o);
  const auto& one = r.forward.timelines[1];
  ASSERT_EQ(one.size(), 5u);  // the reshuffle in's, 0, 1, the reshuffle out's two
  EXPECT_EQ(one[4].stage, kReshuffleOutAfter);
  // Block 1's O (0.2 ms on the link) once worker 0 has computed; block 2's when worker 1 has.
  EXPECT_NEAR(one[3].commEndMs, 1000.2, 1e-6);
  EXPECT_NEAR(one[4].commStartMs, 120.0, 1e-6);
  EXPECT_NEAR(one[4].commEndMs, 120.2, 1e-6);
  EXPECT_NEAR(r.forward.timeMs, 1000.2, 1e-6);
}

TEST(SimulatorTest, StalledPlanIsReported) {
  plan::Plan p = barePlan(2, 1);
  addTransfer(p, 0, 1, 1000, 0);
  p.forward.edit([](auto& forward) { forward[1][0].recv.clear(); });  // the receiver never posts it
  EXPECT_THROW(simulate(p, unitHardware(), forwardOnly()), Error);
}

}  // namespace
}  // namespace fcp::sim
