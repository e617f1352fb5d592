// Same plan on every machine: for plans of fixed inputs, both FNV-1a of the plan's JSON (what
// the ranks compared until session 19) and plan::planDigest (what they compare now) are pinned.
// They depend only on integer arithmetic, IEEE basic operations and fcp::dmath (plan.no_libm
// checks no libm transcendental is called), so they must come out the same on every CPU,
// compiler and C library. A deliberate change of the planner or the sampler changes them: then
// print the new ones (FCP_PRINT_DIGESTS=1) and say in the commit why the plans changed.
// And the digest sees everything the JSON says: any one number, word or flag of a plan's JSON
// changed (and read back) changes it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fcp/baselines/baselines.h"
#include "fcp/core/cost_model.h"
#include "fcp/core/error.h"
#include "fcp/core/workload.h"
#include "fcp/plan/json.h"
#include "fcp/plan/plan.h"

namespace fcp {
namespace {

struct Pinned {
  const char* strategy;
  const char* workload;
  int64_t workers;
  uint64_t seed;
  plan::Placement placement;
  MaskKind mask;
  uint64_t jsonFnv;  ///< FNV-1a of plan::planToJson
  uint64_t digest;   ///< plan::planDigest
};

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 14695981039346656037ull;
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 1099511628211ull;
  }
  return hash;
}

plan::Plan pinnedPlan(const Pinned& p) {
  plan::PlanConfig c;
  c.numWorkers = p.workers;
  c.tokensPerWorker = 32 * 1024;
  c.blockSize = 4096;
  c.placement = p.placement;
  c.attention.mask = p.mask;
  const Batch batch =
      sampleBatch(findWorkload(p.workload), c.numWorkers * c.tokensPerWorker, p.seed);
  return baselines::makePlan(p.strategy, batch, c, CostModel{c.attention});
}

TEST(PlanDigestTest, PlansForFixedInputsArePinned) {
  const Pinned cases[] = {
      {"fcp", "lognormal", 8, 0, plan::Placement::kLocal, MaskKind::kCausal, 0xc38db5f1a659a8adull,
       0xabd266c75d2bbc81ull},
      {"fcp", "lognormal", 64, 1, plan::Placement::kLocal, MaskKind::kCausal, 0x31563b486d8647d0ull,
       0x333ac343f62bab46ull},
      {"fcp", "lognormal-narrow", 16, 2, plan::Placement::kLpt, MaskKind::kCausal,
       0x44f0b8e06cf08d13ull, 0x5a1a79ca8ad703beull},
      {"fcp", "bimodal", 32, 3, plan::Placement::kLocal, MaskKind::kFull, 0x143a249ff635fc3aull,
       0x8cf832846654a126ull},
      {"fcp", "bimodal", 256, 4, plan::Placement::kLpt, MaskKind::kCausal, 0xb8786c366eb5324aull,
       0xe93addc107be0242ull},
      {"ring", "lognormal", 8, 5, plan::Placement::kLpt, MaskKind::kCausal, 0x99dea2b94bafcd73ull,
       0x2b5329931c778e24ull},
      {"magi", "bimodal", 16, 6, plan::Placement::kLpt, MaskKind::kCausal, 0x3514ad55d4b9b2a1ull,
       0xe2929999b3dd15e6ull},
  };
  const bool print = std::getenv("FCP_PRINT_DIGESTS") != nullptr;
  for (const Pinned& p : cases) {
    const plan::Plan plan = pinnedPlan(p);
    const uint64_t jsonFnv = fnv1a(plan::planToJson(plan));
    const uint64_t digest = plan::planDigest(plan);
    if (print) {
      std::printf("0x%016llxull, 0x%016llxull,  // %s %s %lld\n",
                  static_cast<unsigned long long>(jsonFnv), static_cast<unsigned long long>(digest),
                  p.strategy, p.workload, static_cast<long long>(p.workers));
    }
    EXPECT_EQ(jsonFnv, p.jsonFnv) << p.strategy << " " << p.workload << " " << p.workers
                                  << " workers, seed " << p.seed << ": the plan's JSON";
    EXPECT_EQ(digest, p.digest) << p.strategy << " " << p.workload << " " << p.workers
                                << " workers, seed " << p.seed << ": its digest";
  }
}

// Every number and flag of a small plan's JSON, changed one at a time (each run of digits has
// its last digit moved, true and false swap): every change that reads back as another plan
// changes the digest. The plan has stages, transfers and a reshuffle (3 workers, causal, blocks
// of 512 tokens, so that workers share sequences).
TEST(PlanDigestTest, EveryChangeToThePlansJsonChangesTheDigest) {
  plan::PlanConfig c;
  c.numWorkers = 3;
  c.tokensPerWorker = 2048;
  c.blockSize = 512;
  const Batch batch = sampleBatch(findWorkload("lognormal"), c.numWorkers * c.tokensPerWorker, 3);
  const plan::Plan base = baselines::makePlan("fcp", batch, c, CostModel{c.attention});
  ASSERT_FALSE(base.transfers.empty());
  ASSERT_FALSE(base.reshuffle.empty());
  const std::string text = plan::planToJson(base);
  const uint64_t digest = plan::planDigest(base);
  EXPECT_EQ(plan::planDigest(plan::planFromJson(text)), digest) << "read back unchanged";
  std::vector<std::string> changed;
  for (size_t i = 0; i < text.size(); ++i) {
    const bool digitRunEnds =
        std::isdigit(static_cast<unsigned char>(text[i])) &&
        (i + 1 == text.size() || !std::isdigit(static_cast<unsigned char>(text[i + 1])));
    if (digitRunEnds) {
      std::string t = text;
      t[i] = static_cast<char>(t[i] == '9' ? '8' : t[i] + 1);
      changed.push_back(std::move(t));
    } else if (text.compare(i, 4, "true") == 0) {
      changed.push_back(text.substr(0, i) + "false" + text.substr(i + 4));
    } else if (text.compare(i, 5, "false") == 0) {
      changed.push_back(text.substr(0, i) + "true" + text.substr(i + 5));
    }
  }
  int64_t tried = 0, unread = 0, same = 0;
  for (const std::string& t : changed) {
    plan::Plan p;
    try {
      p = plan::planFromJson(t);
    } catch (const Error&) {
      ++unread;  // e.g. the format version, or a count no longer in range
      continue;
    }
    if (p == base) {
      ++same;  // the change is not one the plan carries (a double's last digit, say)
      continue;
    }
    ++tried;
    EXPECT_NE(plan::planDigest(p), digest)
        << "a change the digest misses: JSON offset "
        << (std::mismatch(t.begin(), t.end(), text.begin()).first - t.begin());
  }
  // And edits of the plan's shape, where every value stays: an id moved to the next list of its
  // stage, to the next stage, to the next worker, or from the forward pass to the backward; a
  // block's last chunk moved to the next block (lengths keep the lists apart).
  const auto moveLast = [](std::vector<int32_t>& from, std::vector<int32_t>& to) {
    to.push_back(from.back());
    from.pop_back();
  };
  std::vector<plan::Plan> reshaped(5, base);
  for (size_t w = 0; w + 1 < base.forward.size(); ++w) {
    if (base.forward[w].size() < 2 || base.forward[w][0].compute.empty()) continue;
    std::vector<std::vector<std::vector<plan::StageIds>>> f(4, base.forward.ids());
    std::vector<std::vector<plan::StageIds>> back = base.backward.ids();
    moveLast(f[0][w][0].compute, f[0][w][0].release);
    moveLast(f[1][w][0].compute, f[1][w][1].compute);
    moveLast(f[2][w][0].compute, f[2][w + 1][0].compute);
    moveLast(f[3][w][0].compute, back[w][0].compute);
    for (size_t k = 0; k < 4; ++k) reshaped[k].forward = plan::Stages(f[k]);
    reshaped[3].backward = plan::Stages(back);
    break;
  }
  for (size_t b = 0; b + 1 < base.blocks.size(); ++b) {
    if (base.blocks[b].chunks.empty()) continue;
    auto& from = reshaped[4].blocks[b].chunks;
    auto& to = reshaped[4].blocks[b + 1].chunks;
    to.insert(to.begin(), from.back());
    from.pop_back();
    break;
  }
  for (size_t i = 0; i < reshaped.size(); ++i) {
    ASSERT_FALSE(reshaped[i] == base) << "edit " << i << " found nothing to move";
    EXPECT_NE(plan::planDigest(reshaped[i]), digest) << "edit " << i;
  }
  EXPECT_GT(tried, 500) << unread << " changes did not read back, " << same
                        << " read back the same";
}

}  // namespace
}  // namespace fcp
