// sortByKeyDescending (src/plan/radix_sort.h): the greedy's order of blocks, against std::sort.
#include "radix_sort.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../test_seed.h"

namespace fcp::plan::detail {
namespace {

using Keyed = std::vector<std::pair<double, int32_t>>;

Keyed sortedByStd(Keyed keyed) {
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  return keyed;
}

// Keys drawn from few values (ties decided by id), arbitrary doubles of several magnitudes,
// zeros of both signs and the largest doubles; ids in ascending order (the paper's greedy) or
// shuffled and spread over 31 bits (the local placement's blocks left after those kept home).
TEST(RadixSortTest, SortsAsStdSortByDescendingKeyThenId) {
  const uint64_t fresh = testing::testSeed();
  SCOPED_TRACE("FCP_TEST_SEED=" + std::to_string(fresh));
  for (const uint64_t seed : {uint64_t{3}, fresh}) {
    std::mt19937_64 rng(seed);
    for (const size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{300}, size_t{5000}}) {
      for (int kind = 0; kind < 4; ++kind) {
        std::vector<int32_t> ids(n);
        std::iota(ids.begin(), ids.end(), 0);
        if (kind >= 2) {
          for (int32_t& id : ids) id = static_cast<int32_t>(rng() % (uint64_t{1} << 31));
          std::sort(ids.begin(), ids.end());
          ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
          std::shuffle(ids.begin(), ids.end(), rng);
        }
        Keyed keyed;
        for (const int32_t id : ids) {
          double key = 0;
          switch ((kind % 2 == 0 ? rng() % 3 : 3) + (rng() % 16 == 0 ? 1 : 0)) {
            case 0:
              key = static_cast<double>(rng() % 4) * 0.125;
              break;  // few values
            case 1:
              key = rng() % 2 ? 0.0 : -0.0;
              break;
            case 2:
              key = std::numeric_limits<double>::max() / static_cast<double>(1 + rng() % 3);
              break;
            default:
              key = std::ldexp(static_cast<double>(rng() % 1000000),
                               static_cast<int>(rng() % 40) - 20);
          }
          keyed.push_back({key, id});
        }
        const Keyed want = sortedByStd(keyed);
        sortByKeyDescending(keyed);
        ASSERT_EQ(keyed.size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_EQ(keyed[i].second, want[i].second)
              << "n=" << n << " kind=" << kind << " at " << i;
          ASSERT_EQ(keyed[i].first, want[i].first);
        }
      }
    }
  }
}

}  // namespace
}  // namespace fcp::plan::detail
