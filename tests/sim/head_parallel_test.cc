// Head-parallel context parallelism (Ulysses, USP) on cases timed by hand: the all-to-alls
// around a head share of the kernels, and USP's ring copies between them.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "../common/error_of.h"
#include "../common/unit_hardware.h"
#include "fcp/baselines/baselines.h"
#include "fcp/core/config.h"
#include "fcp/core/error.h"
#include "fcp/plan/json.h"
#include "fcp/plan/plan.h"
#include "fcp/sim/simulator.h"

namespace fcp::sim {
namespace {

using fcp::testing::errorOf;

/// 1 TFLOP/s peak on a curve rising with tokens, NVLink 4 GB/s and NICs 1 GB/s, no latency.
HardwareProfile hardware(int64_t perNode) { return fcp::testing::risingCurveHardware(perNode); }

AttentionConfig attention() {
  return {
      .numHeadsQ = 8, .numHeadsKv = 2, .headDim = 16, .elementBytes = 2, .mask = MaskKind::kFull};
}

plan::PlanConfig config(int64_t workers, int64_t tokensPerWorker) {
  plan::PlanConfig c;
  c.numWorkers = workers;
  c.tokensPerWorker = tokensPerWorker;
  c.attention = attention();
  return c;
}

SimOptions noReshuffle() {
  SimOptions o;
  o.reshuffle = false;
  return o;
}

TEST(HeadParallelTest, AHeadShareSplitsQueryHeadsAndSplitsOrReplicatesKeyValueHeads) {
  const AttentionConfig a = attention();  // 8 : 2
  EXPECT_EQ(headShare(a, 1), a);
  EXPECT_EQ(headShare(a, 2).numHeadsQ, 4);
  EXPECT_EQ(headShare(a, 2).numHeadsKv, 1);
  EXPECT_EQ(headShare(a, 8).numHeadsQ, 1);
  EXPECT_EQ(headShare(a, 8).numHeadsKv, 1);  // each key/value head on 4 workers
  EXPECT_EQ(headShare(a, 8).headDim, 16);
  for (const int64_t bad : {0, 3, 16}) {
    EXPECT_NE(errorOf([&] { headShare(a, bad); }), "") << bad;
  }
  const AttentionConfig sixToThree{.numHeadsQ = 6, .numHeadsKv = 3};
  EXPECT_EQ(errorOf([&] { headShare(sixToThree, 2); }),
            "head-parallel degree 2 with 6 query and 3 key/value heads: expected a divisor of the "
            "query heads that divides the key/value heads or is a multiple of them");
}

TEST(HeadParallelTest, UlyssesTimesItsAllToAllsAroundEachSequencesWholeKernel) {
  // 8 workers on two nodes of 4, 1024 tokens each; Ulysses gives each one query head and one
  // (replicated) key/value head of all 8192 tokens. Each all-to-all sends every peer 1024
  // tokens of one head share: 3 peers over NVLink, 4 over the NIC, which is the slower.
  const Batch batch{{4096, 2048, 1024, 1024}};
  const auto hp =
      baselines::headParallelPlan("ulysses", batch, config(8, 1024), CostModel{attention()}, 4);
  ASSERT_EQ(hp.degree, 8);
  const AttentionConfig share = headShare(attention(), 8);
  const double qBytes = 1024.0 * static_cast<double>(share.qBytesPerToken());
  const double qkvBytes =
      1024.0 * static_cast<double>(share.qBytesPerToken() + share.kvBytesPerToken());
  const auto allToAll = [](double bytes) { return std::max(3 * bytes / 4e9, 4 * bytes / 1e9); };
  for (const KernelLaunch launch : {KernelLaunch::kPair, KernelLaunch::kStage}) {
    HardwareProfile h = hardware(4);
    h.launch = launch;
    double forward = allToAll(qkvBytes) + allToAll(qBytes);
    double backward = allToAll(qBytes) + allToAll(qkvBytes);
    double useful = 0;
    for (const int64_t len : batch.sequenceLengths) {
      forward += forwardFlops(share, len * len) / (h.forward.at(len) * 1e12);
      backward += backwardFlops(share, len * len) / (h.backward.at(len) * 1e12);
      useful += forwardFlops(attention(), len * len);
    }
    SimOptions o = noReshuffle();
    o.timelines = true;
    const SimResult r = simulateHeadParallel(hp.ring, attention(), hp.degree, h, o);
    EXPECT_NEAR(r.forward.timeMs, forward * 1e3, 1e-9 * forward * 1e3);
    // Each all-to-all its own stage: Q, K, V in and O out forward; dO in and dQ, dK, dV out.
    for (const auto& [pass, in, out] :
         {std::tuple{&r.forward, qkvBytes, qBytes}, std::tuple{&r.backward, qBytes, qkvBytes}}) {
      const auto& spans = pass->timelines[0];
      ASSERT_GE(spans.size(), 3u);
      EXPECT_EQ(spans.front().stage, kAllToAllIn);
      EXPECT_EQ(spans.back().stage, kAllToAllOut);
      EXPECT_NEAR(spans.front().endMs - spans.front().startMs, allToAll(in) * 1e3, 1e-9);
      EXPECT_NEAR(spans.back().endMs - spans.back().startMs, allToAll(out) * 1e3, 1e-9);
    }
    EXPECT_NEAR(r.backward.timeMs, backward * 1e3, 1e-9 * backward * 1e3);
    EXPECT_NEAR(r.forward.usefulFlops, useful, 1e-9 * useful);
    EXPECT_NEAR(r.forward.mfu, useful / (8 * 1e12 * forward), 1e-9);
    EXPECT_NEAR(r.computeImbalance, 0, 1e-12);
    EXPECT_NEAR(r.commImbalance, 0, 1e-12);
    EXPECT_EQ(r.transferBytes, static_cast<int64_t>(8 * 7 * (qkvBytes + qBytes)));
  }
}

TEST(HeadParallelTest, EachMemberPermutesItsTensorsInMemoryBeforeAndAfterTheAllToAlls) {
  // The case above, on a profile that says its memory bandwidth: before the all-to-all in, a
  // member reads its 1024 tokens' rows (every head) and writes one chunk per member (the
  // share's heads, the key/value head replicated); after the all-to-all out it reads the 8
  // chunks it received and writes its rows. Nothing else moves.
  const Batch batch{{4096, 2048, 1024, 1024}};
  const auto hp =
      baselines::headParallelPlan("ulysses", batch, config(8, 1024), CostModel{attention()}, 4);
  const AttentionConfig full = attention(), share = headShare(full, 8);
  const double q = static_cast<double>(share.qBytesPerToken());
  const double qkv = static_cast<double>(share.qBytesPerToken() + share.kvBytesPerToken());
  const double fullQ = static_cast<double>(full.qBytesPerToken());
  const double fullQkv = static_cast<double>(full.qBytesPerToken() + full.kvBytesPerToken());
  ASSERT_LT(fullQkv, 8 * qkv);  // replicated: the chunks hold more than the rows
  HardwareProfile h = hardware(4);
  h.memoryBytesPerSecond = 2e9;
  SimOptions o = noReshuffle();
  o.timelines = true;
  const SimResult bare = simulateHeadParallel(hp.ring, full, 8, hardware(4), o);
  const SimResult r = simulateHeadParallel(hp.ring, full, 8, h, o);
  const double forwardIn = 1024 * (fullQkv + 8 * qkv) / 2e9,
               forwardOut = 1024 * (8 * q + fullQ) / 2e9;
  const double backwardIn = 1024 * (fullQ + 8 * q) / 2e9,
               backwardOut = 1024 * (8 * qkv + fullQkv) / 2e9;
  EXPECT_NEAR(r.forward.timeMs, bare.forward.timeMs + (forwardIn + forwardOut) * 1e3, 1e-9);
  EXPECT_NEAR(r.backward.timeMs, bare.backward.timeMs + (backwardIn + backwardOut) * 1e3, 1e-9);
  for (size_t w = 0; w < 8; ++w) {
    const auto& spans = r.forward.timelines[w];
    ASSERT_EQ(spans.size(), bare.forward.timelines[w].size() + 2);
    EXPECT_EQ(spans[0].stage, kPermuteIn);
    EXPECT_NEAR(spans[0].computeEndMs - spans[0].startMs, forwardIn * 1e3, 1e-9);
    EXPECT_EQ(spans.back().stage, kPermuteOut);
    EXPECT_NEAR(spans.back().endMs - spans.back().startMs, forwardOut * 1e3, 1e-9);
  }
  EXPECT_EQ(r.transferBytes, bare.transferBytes);
  // A degree of 1 exchanges nothing, so permutes nothing.
  const plan::PlanConfig c = config(4, 2048);
  const plan::Plan ring =
      baselines::ringPlan(Batch{{4096, 2048, 1536, 512}}, c, CostModel{c.attention});
  EXPECT_DOUBLE_EQ(simulateHeadParallel(ring, c.attention, 1, h).timeMs, simulate(ring, h).timeMs);
}

TEST(HeadParallelTest, ADegreeOfOneIsTheRingItself) {
  HardwareProfile h = hardware(2);
  const plan::PlanConfig c = config(4, 2048);
  const plan::Plan ring =
      baselines::ringPlan(Batch{{4096, 2048, 1536, 512}}, c, CostModel{c.attention});
  SimOptions o;  // the reshuffle too
  const SimResult alone = simulate(ring, h, o);
  const SimResult hp = simulateHeadParallel(ring, c.attention, 1, h, o);
  EXPECT_DOUBLE_EQ(hp.forward.timeMs, alone.forward.timeMs);
  EXPECT_DOUBLE_EQ(hp.backward.timeMs, alone.backward.timeMs);
  EXPECT_DOUBLE_EQ(hp.mfu, alone.mfu);
  EXPECT_EQ(hp.transferBytes, alone.transferBytes);
  EXPECT_EQ(hp.reshuffleBytes, alone.reshuffleBytes);
  EXPECT_DOUBLE_EQ(hp.commImbalance, alone.commImbalance);
  EXPECT_DOUBLE_EQ(hp.computeImbalance, alone.computeImbalance);
}

TEST(HeadParallelTest, UspRunsItsRingOnEveryMemberBetweenTheNodesAllToAlls) {
  // 8 workers, 2 per node, so USP's Ulysses degree is 2 and its ring spans the 4 nodes; member
  // j of every node runs copy j of the ring over its own NIC.
  const Batch batch{{6144, 4096, 4096, 2048}};
  const auto hp =
      baselines::headParallelPlan("usp", batch, config(8, 2048), CostModel{attention()}, 2);
  ASSERT_EQ(hp.degree, 2);
  ASSERT_EQ(hp.ring.config.numWorkers, 4);
  ASSERT_EQ(hp.ring.config.attention, headShare(attention(), 2));
  // Compute alone (links free): each member computes what its ring worker computes.
  HardwareProfile free = hardware(2);
  free.intraNodeBytesPerSecond = free.interNodeBytesPerSecond = 1e18;
  const SimResult ringFree = simulate(hp.ring, free, noReshuffle());
  const SimResult uspFree = simulateHeadParallel(hp.ring, attention(), 2, free, noReshuffle());
  for (size_t w = 0; w < 8; ++w) {
    EXPECT_DOUBLE_EQ(uspFree.forward.computeMs[w], ringFree.forward.computeMs[w / 2]) << w;
    EXPECT_DOUBLE_EQ(uspFree.backward.computeMs[w], ringFree.backward.computeMs[w / 2]) << w;
  }
  EXPECT_NEAR(uspFree.timeMs, ringFree.timeMs, 1e-6 * ringFree.timeMs);
  // Communication alone (compute free): the node's all-to-all (one NVLink peer, half the
  // node's 4096 tokens each), the ring over NICs one worker per node, the all-to-all back.
  HardwareProfile links = hardware(2);
  links.peakFlops = 1e30;
  HardwareProfile ringLinks = links;
  ringLinks.workersPerNode = 1;
  const SimResult ringOnly = simulate(hp.ring, ringLinks, noReshuffle());
  const AttentionConfig share = headShare(attention(), 2);
  const double inBytes =
      2048.0 * static_cast<double>(share.qBytesPerToken() + share.kvBytesPerToken());
  const double outBytes = 2048.0 * static_cast<double>(share.qBytesPerToken());
  const double in = inBytes / 4e9, out = outBytes / 4e9;
  const SimResult usp = simulateHeadParallel(hp.ring, attention(), 2, links, noReshuffle());
  EXPECT_NEAR(usp.forward.timeMs, (in + out) * 1e3 + ringOnly.forward.timeMs, 1e-9);
  EXPECT_NEAR(usp.backward.timeMs, (out + in) * 1e3 + ringOnly.backward.timeMs, 1e-9);
  EXPECT_EQ(usp.transferBytes,
            2 * ringOnly.transferBytes + static_cast<int64_t>(8 * (inBytes + outBytes)));
  // Two copies of the ring's transfers, and each of the 8 workers' one message in and out.
  EXPECT_EQ(usp.numTransfers, 2 * static_cast<int64_t>(hp.ring.transfers.size()) + 16);
  // The reshuffle moves whole tokens (every head) wherever the ring's pieces change hands.
  int64_t moved = 0;
  for (const plan::ReshufflePiece& p : hp.ring.reshuffle) {
    if (p.userWorker != p.fcpWorker) moved += p.end - p.begin;
  }
  const AttentionConfig a = attention();
  ASSERT_GT(moved, 0);
  EXPECT_EQ(simulateHeadParallel(hp.ring, a, 2, links).reshuffleBytes,
            moved * (a.qBytesPerToken() + a.kvBytesPerToken() + a.oBytesPerToken()));
}

TEST(HeadParallelTest, UspTakesTheLargestDegreeANodeAndTheHeadsAllow) {
  const Batch batch{{65536}};
  const auto degree = [&](int64_t workers, int64_t perNode, int64_t hq, int64_t hkv) {
    plan::PlanConfig c = config(workers, 65536 / workers);
    c.attention.numHeadsQ = hq;
    c.attention.numHeadsKv = hkv;
    return baselines::headParallelPlan("usp", batch, c, CostModel{c.attention}, perNode).degree;
  };
  EXPECT_EQ(degree(64, 8, 64, 8), 8);
  EXPECT_EQ(degree(4, 8, 64, 8), 4);   // one node, not full: pure Ulysses
  EXPECT_EQ(degree(12, 8, 64, 8), 4);  // 6 does not divide the heads
  EXPECT_EQ(degree(16, 8, 6, 3), 1);   // 8, 4 and 2 cannot split 6 : 3 heads: a plain ring
  EXPECT_EQ(degree(12, 8, 48, 48), 4);  // 6 would put workers 6-11 on two nodes
  EXPECT_EQ(degree(6, 8, 48, 6), 6);    // one group filling part of one node
  // Given an oracle, USP takes the legal degree it times fastest, across nodes too.
  const auto tuned = [&](const baselines::HeadParallelOracle& oracle) {
    return baselines::headParallelPlan("usp", batch, config(64, 1024), CostModel{attention()}, 8,
                                       oracle)
        .degree;
  };
  // 8 : 2 heads over 64 workers: degrees 1, 2, 4 and 8 (16 splits no 8 query heads).
  EXPECT_EQ(
      tuned([](const baselines::HeadParallelPlan& h) { return -static_cast<double>(h.degree); }),
      8);
  EXPECT_EQ(tuned([](const baselines::HeadParallelPlan& h) { return h.degree == 2 ? 0.0 : 1.0; }),
            2);
  EXPECT_EQ(tuned([](const baselines::HeadParallelPlan&) { return 1.0; }),
            1);  // a tie: the smallest
  plan::PlanConfig many = config(64, 1024);
  many.attention.numHeadsQ = 64;
  many.attention.numHeadsKv = 8;
  const baselines::HeadParallelOracle largest = [](const baselines::HeadParallelPlan& h) {
    return -static_cast<double>(h.degree);
  };
  EXPECT_EQ(
      baselines::headParallelPlan("usp", batch, many, CostModel{many.attention}, 8, largest).degree,
      64);  // eight nodes' Ulysses
  // A degree given is taken as it is, oracle or not, when legal; else refused.
  EXPECT_EQ(
      baselines::headParallelPlan("usp", batch, many, CostModel{many.attention}, 8, largest, 2)
          .degree,
      2);
  EXPECT_EQ(
      baselines::headParallelPlan("fcp+ulysses", batch, many, CostModel{many.attention}, 8, {}, 16)
          .degree,
      16);
  EXPECT_NE(errorOf([&] {
              baselines::headParallelPlan("usp", batch, many, CostModel{many.attention}, 8, {}, 12);
            }).find("usp with Ulysses degree 12 on 64 workers"),
            std::string::npos);
}

TEST(HeadParallelTest, FcpWithUlyssesPlansTheGroupsWithFcpsOwnPlanner) {
  // 8 workers, 2 per node: 4 FCP workers of 2 x 2048 tokens' memory, each with half the heads.
  const Batch batch{{9000, 3000, 2500, 1200, 400, 284}};
  const auto hp =
      baselines::headParallelPlan("fcp+ulysses", batch, config(8, 2048), CostModel{attention()}, 2);
  ASSERT_EQ(hp.degree, 2);
  EXPECT_EQ(hp.ring.strategy, "fcp");
  EXPECT_EQ(plan::validate(hp.ring), std::vector<std::string>{});
  plan::PlanConfig groups = config(4, 4096);
  groups.attention = headShare(attention(), 2);
  const plan::Plan fcp = plan::buildPlan(batch, groups, CostModel{groups.attention});
  EXPECT_EQ(hp.ring.config.numWorkers, 4);
  EXPECT_EQ(hp.ring.config.tokensPerWorker, 4096);
  EXPECT_EQ(hp.ring.config.attention, groups.attention);
  EXPECT_EQ(plan::planDigest(hp.ring), plan::planDigest(fcp));  // the same plan, to the byte
  // The library's own layout and memory limit, per group: every second boundary, twice the limit.
  plan::PlanConfig laid = config(8, 2048);
  laid.userStarts = {0, 1000, 2000, 4096, 6000, 8192, 10000, 12288, 16384};
  laid.memoryLimitTokens = 3000;
  const auto grouped =
      baselines::headParallelPlan("fcp+ulysses", batch, laid, CostModel{attention()}, 2);
  EXPECT_EQ(grouped.ring.config.userStarts, (std::vector<int64_t>{0, 2000, 6000, 10000, 16384}));
  EXPECT_EQ(grouped.ring.config.memoryLimitTokens, 6000);
  EXPECT_EQ(plan::validate(grouped.ring), std::vector<std::string>{});
  // And it times like any head-parallel plan: both all-to-alls and each member's FCP share.
  const SimResult r = simulateHeadParallel(hp.ring, attention(), 2, hardware(2), noReshuffle());
  EXPECT_GT(r.mfu, 0);
  EXPECT_EQ(r.transferBytes % 2, 0);
}

TEST(HeadParallelTest, UlyssesOnMoreWorkersThanHeadsIsRefused) {
  const Batch batch{{8192}};
  EXPECT_EQ(
      errorOf([&] {
        baselines::headParallelPlan("ulysses", batch, config(16, 512), CostModel{attention()}, 8);
      }),
      "ulysses on 16 workers with 8 query and 2 key/value heads: expected workers that divide "
      "the query heads and divide or are a multiple of the key/value heads (or usp)");
  const auto hp =
      baselines::headParallelPlan("usp", batch, config(4, 2048), CostModel{attention()}, 4);
  const std::string share =
      errorOf([&] { simulateHeadParallel(hp.ring, attention(), 2, hardware(4)); });
  EXPECT_NE(share.find("expected one worker's share of 8 and 2 at degree 2"), std::string::npos)
      << share;
}

}  // namespace
}  // namespace fcp::sim
