#pragma once
// Private to the plan module: the greedy's order of blocks, by radix passes.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fcp::plan::detail {

/// Sorts `keyed` by descending key, ties by ascending id: what std::sort with that order gives
/// (`keyed` holds each id once), for keys that are non-negative and not NaN. Least significant
/// byte first, each pass stable: over the ids' bytes unless they ascend already, then over the
/// bytes of the keys' bits (which order like the keys, +0 for -0), complemented for the
/// descending order. A pass is skipped where every entry has the same byte (the high bytes of
/// keys of one magnitude). The greedy sorts its 36K blocks at 4096 workers: std::sort took
/// 1.3 ms, each comparison a branch on doubles.
inline void sortByKeyDescending(std::vector<std::pair<double, int32_t>>& keyed) {
  using Entry = std::pair<double, int32_t>;
  const size_t n = keyed.size();
  if (n < 2) return;
  std::vector<Entry> buffer(n);
  Entry* from = keyed.data();
  Entry* to = buffer.data();
  const auto pass = [&](auto byteOf) {
    std::array<size_t, 257> start{};
    for (size_t i = 0; i < n; ++i) ++start[byteOf(from[i]) + 1];
    if (start[byteOf(from[0]) + 1] == n) return;  // one byte value: the order stands
    for (size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
    for (size_t i = 0; i < n; ++i) to[start[byteOf(from[i])]++] = from[i];
    std::swap(from, to);
  };
  bool ascending = true;
  for (size_t i = 1; i < n && ascending; ++i) ascending = keyed[i - 1].second < keyed[i].second;
  for (int shift = 0; !ascending && shift < 32; shift += 8) {
    pass([shift](const Entry& e) {
      return static_cast<size_t>((static_cast<uint32_t>(e.second) >> shift) & 0xff);
    });
  }
  for (int shift = 0; shift < 64; shift += 8) {
    pass([shift](const Entry& e) {
      const uint64_t bits = ~std::bit_cast<uint64_t>(e.first + 0.0);  // -0 + 0 is +0
      return static_cast<size_t>((bits >> shift) & 0xff);
    });
  }
  if (from != keyed.data()) keyed.assign(from, from + n);
}

}  // namespace fcp::plan::detail
