// Stages: a pass's lists stored in one array (a plan's two passes in one, sharing the lists
// the backward repeats), read through Stage views; and the stages buildPlan fills in place,
// against the schedule's rules written out list by list.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../test_seed.h"
#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "fcp/plan/plan.h"
#include "fcp/plan/schedule.h"

namespace fcp::plan {
namespace {

std::vector<int32_t> owned(std::span<const int32_t> ids) { return {ids.begin(), ids.end()}; }

/// Three workers with 2, 0 and 3 stages, lists of every kind and length 0 to 3.
std::vector<std::vector<StageIds>> handLists() {
  StageIds a{{1, 2}, {3}, {4, 5, 6}, {}, {7}, {}};
  StageIds b{{}, {}, {}, {8}, {}, {9, 10}};
  StageIds c{{11}, {12, 13}, {}, {}, {}, {}};
  return {{a, b}, {}, {c, StageIds{}, a}};
}

/// Each worker's stage count and each list's size, in Stages' order.
void sizesOf(const std::vector<std::vector<StageIds>>& lists, std::vector<int64_t>& stagesOf,
             std::vector<int64_t>& sizes) {
  for (const auto& worker : lists) {
    stagesOf.push_back(static_cast<int64_t>(worker.size()));
    for (const StageIds& st : worker)
      for (const auto* list :
           {&st.send, &st.recv, &st.compute, &st.release, &st.sendGrad, &st.recvGrad})
        sizes.push_back(static_cast<int64_t>(list->size()));
  }
}

/// Writes `lists` into `into`, but for the first four lists of the stages `sharedWith` (a
/// forward pass's lists, when given) also has: those twoPasses shares.
void fillFrom(StagesToFill& into, const std::vector<std::vector<StageIds>>& lists,
              const std::vector<std::vector<StageIds>>* sharedWith = nullptr) {
  for (size_t w = 0; w < lists.size(); ++w) {
    for (size_t s = 0; s < lists[w].size(); ++s) {
      const StageIds& st = lists[w][s];
      const std::vector<int32_t>* by[] = {&st.send,    &st.recv,     &st.compute,
                                          &st.release, &st.sendGrad, &st.recvGrad};
      for (size_t l = 0; l < kStageLists; ++l) {
        if (sharedWith && s < (*sharedWith)[w].size() && l < 4) continue;
        const std::span<int32_t> to = into.list(w, s, StageList(l));
        ASSERT_EQ(to.size(), by[l]->size());
        std::copy(by[l]->begin(), by[l]->end(), to.begin());
      }
    }
  }
}

static_assert(std::random_access_iterator<Stages::Iterator>);
static_assert(std::random_access_iterator<WorkerStages::Iterator>);

TEST(StagesTest, ViewsReadTheListsTheyWereGiven) {
  const std::vector<std::vector<StageIds>> lists = handLists();
  const Stages stages(lists);
  ASSERT_EQ(stages.size(), 3u);
  EXPECT_FALSE(stages.empty());
  EXPECT_TRUE(Stages().empty());
  EXPECT_EQ(stages.ids(), lists);
  for (size_t w = 0; w < lists.size(); ++w) {
    const WorkerStages mine = stages[w];
    ASSERT_EQ(mine.size(), lists[w].size()) << w;
    EXPECT_EQ(mine.empty(), lists[w].empty());
    for (size_t s = 0; s < mine.size(); ++s) {
      const Stage st = mine[s];
      const StageIds& want = lists[w][s];
      EXPECT_EQ(owned(st.send), want.send);
      EXPECT_EQ(owned(st.recv), want.recv);
      EXPECT_EQ(owned(st.compute), want.compute);
      EXPECT_EQ(owned(st.release), want.release);
      EXPECT_EQ(owned(st.sendGrad), want.sendGrad);
      EXPECT_EQ(owned(st.recvGrad), want.recvGrad);
      EXPECT_EQ(st.ids(), want);
    }
  }
  EXPECT_EQ(stages.front().back().ids(), lists[0][1]);
  EXPECT_EQ(stages[2].front().ids(), lists[2][0]);
  // Iterators: over workers and over one worker's stages, kept after the view is gone.
  EXPECT_EQ(std::distance(stages.begin(), stages.end()), 3);
  size_t workers = 0, seen = 0;
  for (const WorkerStages mine : stages) {
    for (const Stage& st : mine) EXPECT_EQ(st.ids(), lists[workers][seen++]);
    ++workers;
    seen = 0;
  }
  EXPECT_EQ(workers, 3u);
  auto it = stages[2].begin();
  const auto end = stages[2].end();
  EXPECT_EQ(end - it, 3);
  EXPECT_EQ((*(it + 2)).ids(), lists[2][2]);
  EXPECT_EQ(it[1].ids(), StageIds{});
  std::vector<int32_t> all;
  for (const auto& worker : lists)
    for (const StageIds& st : worker)
      for (const auto* list :
           {&st.send, &st.recv, &st.compute, &st.release, &st.sendGrad, &st.recvGrad})
        all.insert(all.end(), list->begin(), list->end());
  EXPECT_EQ(owned(stages.allIds()), all);
}

TEST(StagesTest, EqualOnlyWithTheSameListsInTheSamePlaces) {
  const Stages stages(handLists());
  EXPECT_EQ(stages, Stages(handLists()));
  EXPECT_EQ(Stages(), Stages(std::vector<std::vector<StageIds>>{}));
  EXPECT_EQ(Stages(), Stages::toFill(std::vector<int64_t>{}, {}).done());
  EXPECT_NE(Stages(), Stages(std::vector<std::vector<StageIds>>(1)));  // a worker, no stages
  EXPECT_NE(stages, Stages());
  Stages moved(handLists());
  const Stages taken = std::move(moved);
  EXPECT_EQ(taken, stages);
  // The same ids in the same order, one moved to the next list of its stage, to the next
  // stage, or to the next worker: each differs.
  std::vector<std::vector<StageIds>> lists = handLists();
  lists[0][0].send.pop_back();
  lists[0][0].recv.insert(lists[0][0].recv.begin(), 2);
  EXPECT_NE(stages, Stages(lists));
  lists = handLists();
  lists[0][0].recvGrad.push_back(8);  // b's release is its first id
  lists[0][1].release.clear();
  EXPECT_NE(stages, Stages(lists));
  lists = handLists();
  lists[1].push_back(lists[2].front());
  lists[2].erase(lists[2].begin());
  EXPECT_NE(stages, Stages(lists));
  EXPECT_EQ(owned(Stages(lists).allIds()), owned(stages.allIds()));
}

TEST(StagesTest, FilledInPlaceAsSized) {
  const std::vector<std::vector<StageIds>> lists = handLists();
  std::vector<int64_t> stagesOf, sizes;
  sizesOf(lists, stagesOf, sizes);
  StagesToFill toFill = Stages::toFill(stagesOf, sizes);
  EXPECT_EQ(toFill.list(0, 0, StageList::kCompute).size(), 3u);
  fillFrom(toFill, lists);
  const Stages filled = std::move(toFill).done();
  EXPECT_EQ(filled, Stages(lists));
  EXPECT_EQ(Stages::toFill(stagesOf, sizes).done().allIds(),
            std::vector<int32_t>(filled.allIds().size(), 0));
  sizes.pop_back();
  EXPECT_THROW(Stages::toFill(stagesOf, sizes), Error);
  sizes.push_back(-1);
  EXPECT_THROW(Stages::toFill(stagesOf, sizes), Error);
}

// A plan's two passes in one storage: the backward lists twoPasses shares are the forward's
// prefixes, whatever the fill writes to the others; the backward may have stages the forward
// has not (its own lists there). Against the same lists stored one by one.
TEST(StagesTest, TwoPassesShareTheForwardListsPrefixes) {
  const std::vector<std::vector<StageIds>> forwardLists = handLists();
  // Backward: each forward stage with its compute list cut by one id (when it has any) and
  // dK/dV lists of its own, and one more stage on the third worker.
  std::vector<std::vector<StageIds>> backwardLists = forwardLists;
  int32_t next = 100;
  for (auto& worker : backwardLists) {
    for (StageIds& st : worker) {
      if (!st.compute.empty()) st.compute.pop_back();
      st.sendGrad = {next++};
      st.recvGrad = {next++, next++};
    }
  }
  backwardLists[2].push_back(StageIds{{next++}, {}, {next++, next++}, {}, {}, {next++}});
  std::vector<int64_t> forwardStagesOf, forwardSizes, backwardStagesOf, backwardSizes;
  sizesOf(forwardLists, forwardStagesOf, forwardSizes);
  sizesOf(backwardLists, backwardStagesOf, backwardSizes);
  auto [forwardToFill, backwardToFill] =
      Stages::twoPasses(forwardStagesOf, forwardSizes, backwardStagesOf, backwardSizes);
  fillFrom(forwardToFill, forwardLists);
  fillFrom(backwardToFill, backwardLists, &forwardLists);
  const Stages forward = std::move(forwardToFill).done();
  const Stages backward = std::move(backwardToFill).done();
  EXPECT_EQ(forward, Stages(forwardLists));
  EXPECT_EQ(backward, Stages(backwardLists));
  EXPECT_EQ(backward.ids(), backwardLists);
  // The shared lists are the forward's storage: the same ids at the same addresses.
  EXPECT_EQ(backward[0][0].send.data(), forward[0][0].send.data());
  EXPECT_EQ(backward[2][2].compute.data(), forward[2][2].compute.data());
  EXPECT_EQ(backward[2][2].compute.size() + 1, forward[2][2].compute.size());
  // A backward list longer than the forward's it would share is refused.
  std::vector<int64_t> longer = backwardSizes;
  longer[2] += 2;  // worker 0, stage 0, compute: 3 ids forward
  EXPECT_THROW(Stages::twoPasses(forwardStagesOf, forwardSizes, backwardStagesOf, longer), Error);
  backwardStagesOf.pop_back();
  EXPECT_THROW(Stages::twoPasses(forwardStagesOf, forwardSizes, backwardStagesOf, backwardSizes),
               Error);
}

TEST(StagesTest, EditChangesTheOwnedLists) {
  StageIds added;
  added.send = {42};
  Stages stages(handLists());
  stages.edit([&](std::vector<std::vector<StageIds>>& lists) { lists[1].push_back(added); });
  std::vector<std::vector<StageIds>> want = handLists();
  want[1].push_back(added);
  EXPECT_EQ(stages, Stages(want));
  EXPECT_EQ(owned(stages[1][0].send), std::vector<int32_t>{42});
}

/// The stages of `p` by the schedule's rules (fcp/plan/schedule.h), list by list: a transfer
/// of round r is sent and received in stage r / coalesce; its pairs are computed, and its
/// buffer freed, buffer depth - 1 stages later; the pairs of blocks a worker holds both of are
/// split, the first half opening stage 0 and the rest closing the last stage. Backward, one
/// more stage: a received block's partial goes back in the stage after its pairs, and the
/// closing pairs move to the added stage. Lists in ascending ids.
std::pair<std::vector<std::vector<StageIds>>, std::vector<std::vector<StageIds>>> byTheRules(
    const Plan& p) {
  const auto n = static_cast<size_t>(p.config.numWorkers);
  const int64_t c = p.config.coalesce;
  const auto lag = static_cast<size_t>(p.config.bufferDepth - 1);
  const auto groups = static_cast<size_t>((p.numRounds + c - 1) / c);
  const size_t fwd = groups > 0 ? groups + lag : 1;
  std::vector<std::vector<StageIds>> forward(n, std::vector<StageIds>(fwd));
  std::map<std::pair<int32_t, int32_t>, int32_t> transferOf;  // (block, receiver)
  for (size_t t = 0; t < p.transfers.size(); ++t)
    transferOf[{p.transfers[t].block, p.transfers[t].receiver}] = static_cast<int32_t>(t);
  std::vector<std::vector<int32_t>> local(n), pairsOf(p.transfers.size());
  for (size_t i = 0; i < p.pairs.size(); ++i) {
    const int32_t q = p.owner[static_cast<size_t>(p.pairs[i].qBlock)];
    const int32_t kv = p.owner[static_cast<size_t>(p.pairs[i].kvBlock)];
    if (q == kv) {
      local[static_cast<size_t>(q)].push_back(static_cast<int32_t>(i));
    } else {
      pairsOf[static_cast<size_t>(transferOf.at({p.pairs[i].kvBlock, q}))].push_back(
          static_cast<int32_t>(i));
    }
  }
  const auto groupOf = [&](size_t t) { return static_cast<size_t>(p.transfers[t].round / c); };
  for (size_t w = 0; w < n; ++w) {
    const size_t opening = (local[w].size() + 1) / 2;
    forward[w][0].compute.assign(local[w].begin(), local[w].begin() + opening);
  }
  for (size_t t = 0; t < p.transfers.size(); ++t) {
    const auto id = static_cast<int32_t>(t);
    auto& mine = forward[static_cast<size_t>(p.transfers[t].receiver)];
    forward[static_cast<size_t>(p.transfers[t].sender)][groupOf(t)].send.push_back(id);
    mine[groupOf(t)].recv.push_back(id);
    auto& use = mine[groupOf(t) + lag];
    use.compute.insert(use.compute.end(), pairsOf[t].begin(), pairsOf[t].end());
    use.release.push_back(id);
  }
  std::vector<std::vector<StageIds>> backward = forward;
  for (size_t w = 0; w < n; ++w) {
    const size_t opening = (local[w].size() + 1) / 2;
    auto& close = forward[w].back().compute;
    close.insert(close.end(), local[w].begin() + opening, local[w].end());
    if (groups == 0) {
      backward[w] = forward[w];
      continue;
    }
    backward[w].emplace_back();
    backward[w].back().compute.assign(local[w].begin() + opening, local[w].end());
  }
  for (size_t t = 0; groups > 0 && t < p.transfers.size(); ++t) {
    const auto id = static_cast<int32_t>(t);
    const size_t back = groupOf(t) + lag + 1;
    backward[static_cast<size_t>(p.transfers[t].receiver)][back].sendGrad.push_back(id);
    backward[static_cast<size_t>(p.transfers[t].sender)][back].recvGrad.push_back(id);
  }
  return {forward, backward};
}

TEST(StagesTest, BuildPlanFillsTheListsTheRulesGive) {
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(testing::testSeed()));
  int compared = 0;
  for (const char* workload : {"lognormal", "bimodal"}) {
    for (const int64_t workers : {1, 3, 16, 512}) {
      for (const int64_t buffers : {2, 4}) {
        // A fixed batch, and a fresh one on the larger sizes.
        const uint64_t seed = workers >= 16 && buffers == 4 ? testing::testSeed() : 5;
        PlanConfig c;
        c.numWorkers = workers;
        c.tokensPerWorker = 16384;
        c.blockSize = 2048;
        c.bufferDepth = buffers;
        c.coalesce = workers == 16 ? 1 : 16;
        const Plan p =
            buildPlan(sampleBatch(findWorkload(workload), workers * c.tokensPerWorker, seed), c,
                      CostModel{c.attention});
        const auto [forward, backward] = byTheRules(p);
        EXPECT_EQ(p.forward, Stages(forward)) << workload << " on " << workers;
        EXPECT_EQ(p.backward, Stages(backward)) << workload << " on " << workers;
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 16);
}

}  // namespace
}  // namespace fcp::plan
