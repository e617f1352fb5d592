#pragma once
// The mask of a pair, expanded per token and summarised per tile.
//
// Terms: `TokenInfo` holds, per token of a block, its sequence id and position. A *tile* is a
// range of consecutive tokens of one side (tileTokens wide, the last one shorter). A tile pair is
// kEmpty (no visible (q, k)), kFull (all visible) or kPartial (the kernel masks element-wise).
// The *column span* of a non-empty tile pair is the smallest range of the K tile's columns that
// holds every key visible to some query of the Q tile: the kernels run their tile products on
// that range only (on a causal diagonal tile, the keys past the Q tile's last position are
// skipped instead of computed and masked).
#include <cstdint>
#include <vector>

#include "fcp/kernels/attention.h"

namespace fcp::kernels::detail {

struct TokenInfo {
  std::vector<int64_t> sequence;
  std::vector<int64_t> position;
};

/// Expands segments to per-token ids; throws fcp::Error if they do not cover numTokens exactly.
TokenInfo expandSegments(std::span<const Segment> segments, int64_t numTokens, const char* side);

enum class TileClass : uint8_t { kEmpty, kFull, kPartial };

/// Columns [begin, end) of a K tile, relative to the tile's first token.
struct ColumnSpan {
  int32_t begin = 0;
  int32_t end = 0;
};

/// Tile classes and column spans, row-major [numQTiles][numKTiles] (empty tiles: span {0, 0}).
struct TileMap {
  int64_t qTileTokens = 0;
  int64_t kTileTokens = 0;
  int64_t numQTiles = 0;
  int64_t numKTiles = 0;
  std::vector<TileClass> classes;
  std::vector<ColumnSpan> spans;
  TileClass at(int64_t qt, int64_t kt) const { return classes[qt * numKTiles + kt]; }
  ColumnSpan span(int64_t qt, int64_t kt) const { return spans[qt * numKTiles + kt]; }
};

TileMap classifyTiles(const TokenInfo& q, const TokenInfo& k, bool causal, int64_t qTileTokens,
                      int64_t kTileTokens);

/// Whether key token kj is visible to query token qi.
inline bool visible(const TokenInfo& q, int64_t qi, const TokenInfo& k, int64_t kj, bool causal) {
  return q.sequence[qi] == k.sequence[kj] && (!causal || k.position[kj] <= q.position[qi]);
}

}  // namespace fcp::kernels::detail
