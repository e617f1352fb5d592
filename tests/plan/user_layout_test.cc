// The user layout's lookups (src/plan/communication.h): userWorkerOf, which starts where an
// even layout would put a token and falls back to a binary search, and forEachUserRun, which
// steps from one worker's slice to the next; both against a token-by-token reference.
#include "communication.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "fcp/plan/communication.h"

namespace fcp::plan {
namespace {

// The last worker whose slice starts at or before `token`, by a scan.
int32_t scanWorkerOf(const std::vector<int64_t>& starts, int64_t token) {
  int32_t r = 0;
  for (size_t w = 0; w + 1 < starts.size(); ++w) {
    if (starts[w] <= token) r = static_cast<int32_t>(w);
  }
  return r;
}

// Layouts of `tokens` over `workers`: even, random with empty slices, and lopsided (every
// token on the last worker or on the first), which no few steps from an even guess reach.
std::vector<std::vector<int64_t>> layouts(int64_t tokens, int64_t workers, std::mt19937_64& rng) {
  std::vector<std::vector<int64_t>> out{userLayoutStarts(tokens, workers)};
  std::vector<int64_t> cuts{0, tokens};
  std::uniform_int_distribution<int64_t> at(0, tokens);
  for (int64_t w = 1; w < workers; ++w)
    cuts.push_back(w % 3 == 0 ? cuts[cuts.size() - 1] : at(rng));
  std::sort(cuts.begin(), cuts.end());
  out.push_back(cuts);
  std::vector<int64_t> last(static_cast<size_t>(workers) + 1, 0), first(last.size(), tokens);
  last.back() = tokens;
  first.front() = 0;
  out.push_back(last);
  out.push_back(first);
  return out;
}

TEST(UserLayoutTest, WorkerOfAGlobalTokenMatchesAScan) {
  std::mt19937_64 rng(7);
  for (const auto& [tokens, workers] : {std::pair<int64_t, int64_t>{1, 1}, {10, 3}, {97, 7},
                                        {1000, 64}, {4096 * 5 + 3, 4096}}) {
    for (const std::vector<int64_t>& starts : layouts(tokens, workers, rng)) {
      for (int64_t t = 0; t < tokens; ++t) {
        ASSERT_EQ(detail::userWorkerOf(starts, t), scanWorkerOf(starts, t))
            << "token " << t << " of " << tokens << " on " << workers << " workers";
      }
    }
  }
}

TEST(UserLayoutTest, RunsOfABlockFollowItsTokens) {
  // Two sequences of 40 and 60 tokens; blocks of one, two and three chunks, each chunk's runs
  // cut wherever a user slice ends (empty slices included).
  const std::vector<int64_t> sequenceStart{0, 40, 100};
  const std::vector<Block> blocks{Block{{{0, 0, 40}}}, Block{{{1, 5, 17}, {0, 39, 40}}},
                                  Block{{{1, 0, 60}, {0, 3, 3}, {1, 59, 60}}}};
  std::mt19937_64 rng(11);
  for (const std::vector<int64_t>& user : layouts(100, 9, rng)) {
    for (const Block& block : blocks) {
      std::vector<std::tuple<int32_t, int64_t, int64_t>> runs, expected;
      detail::forEachUserRun(block, sequenceStart, user,
                             [&](int32_t w, int64_t begin, int64_t end) {
                               runs.emplace_back(w, begin, end);
                             });
      for (const Chunk& c : block.chunks) {
        const int64_t from = sequenceStart[static_cast<size_t>(c.sequence)] + c.begin;
        const int64_t to = sequenceStart[static_cast<size_t>(c.sequence)] + c.end;
        for (int64_t t = from; t < to; ++t) {
          const int32_t w = scanWorkerOf(user, t);
          if (t > from && std::get<0>(expected.back()) == w) {
            std::get<2>(expected.back()) = t + 1;
          } else {
            expected.emplace_back(w, t, t + 1);
          }
        }
      }
      EXPECT_EQ(runs, expected);
    }
  }
}

}  // namespace
}  // namespace fcp::plan
