#include "block_mask.h"

#include <algorithm>

#include "fcp/core/error.h"

namespace fcp::kernels {

int64_t countVisiblePairs(const BlockMask& mask) {
  // Segment pairs: same sequence, then either all pairs (full) or the causal triangle count.
  int64_t total = 0;
  for (const Segment& qs : mask.q) {
    for (const Segment& ks : mask.k) {
      if (qs.sequenceId != ks.sequenceId || qs.numTokens <= 0 || ks.numTokens <= 0) continue;
      if (mask.kind == MaskKind::kFull) {
        total += qs.numTokens * ks.numTokens;
        continue;
      }
      // For query position p: visible keys are those at positions <= p within ks.
      const int64_t kFirst = ks.firstPosition;
      const int64_t kLast = ks.firstPosition + ks.numTokens - 1;
      for (int64_t i = 0; i < qs.numTokens; ++i) {
        const int64_t p = qs.firstPosition + i;
        if (p >= kLast) {
          total += (qs.numTokens - i) * ks.numTokens;
          break;
        }
        if (p >= kFirst) total += p - kFirst + 1;
      }
    }
  }
  return total;
}

namespace detail {

TokenInfo expandSegments(std::span<const Segment> segments, int64_t numTokens, const char* side) {
  TokenInfo info;
  info.sequence.reserve(numTokens);
  info.position.reserve(numTokens);
  for (const Segment& s : segments) {
    if (s.numTokens < 0)
      throwInvalidArgument(side, " mask segment has numTokens = ", s.numTokens, ", expected >= 0");
    if (static_cast<int64_t>(info.sequence.size()) + s.numTokens > numTokens) break;
    for (int64_t i = 0; i < s.numTokens; ++i) {
      info.sequence.push_back(s.sequenceId);
      info.position.push_back(s.firstPosition + i);
    }
  }
  int64_t covered = 0;
  for (const Segment& s : segments) covered += s.numTokens;
  if (covered != numTokens)
    throwInvalidArgument(side, " mask segments cover ", covered, " tokens, expected ", numTokens,
                         " (the block's token count)");
  return info;
}

namespace {

struct TileSummary {
  int64_t seqMin, seqMax, posMin, posMax;
};

std::vector<TileSummary> summarise(const TokenInfo& info, int64_t tileTokens) {
  const int64_t n = static_cast<int64_t>(info.sequence.size());
  std::vector<TileSummary> tiles;
  for (int64_t begin = 0; begin < n; begin += tileTokens) {
    const int64_t end = std::min(n, begin + tileTokens);
    TileSummary t{info.sequence[begin], info.sequence[begin], info.position[begin],
                  info.position[begin]};
    for (int64_t i = begin; i < end; ++i) {
      t.seqMin = std::min(t.seqMin, info.sequence[i]);
      t.seqMax = std::max(t.seqMax, info.sequence[i]);
      t.posMin = std::min(t.posMin, info.position[i]);
      t.posMax = std::max(t.posMax, info.position[i]);
    }
    tiles.push_back(t);
  }
  return tiles;
}

struct Classified {
  TileClass cls = TileClass::kEmpty;
  ColumnSpan span;
};

// Element-wise classification, for tiles that mix sequences.
Classified classifyExactly(const TokenInfo& q, int64_t q0, int64_t q1, const TokenInfo& k,
                           int64_t k0, int64_t k1, bool causal) {
  int64_t seen = 0;
  int64_t first = k1, last = k0 - 1;  // visible key columns, absolute
  for (int64_t j = k0; j < k1; ++j) {
    int64_t column = 0;
    for (int64_t i = q0; i < q1; ++i) column += visible(q, i, k, j, causal) ? 1 : 0;
    if (column == 0) continue;
    seen += column;
    first = std::min(first, j);
    last = j;
  }
  if (seen == 0) return {};
  const ColumnSpan span{static_cast<int32_t>(first - k0), static_cast<int32_t>(last + 1 - k0)};
  return {seen == (q1 - q0) * (k1 - k0) ? TileClass::kFull : TileClass::kPartial, span};
}

// Causal tile pair of one sequence on both sides, partially visible: a key is visible to some
// query iff its position is at most the Q tile's last position.
ColumnSpan causalSpan(const TokenInfo& k, int64_t k0, int64_t k1, int64_t qPosMax) {
  int64_t first = k1, last = k0 - 1;
  for (int64_t j = k0; j < k1; ++j) {
    if (k.position[j] > qPosMax) continue;
    first = std::min(first, j);
    last = j;
  }
  return {static_cast<int32_t>(first - k0), static_cast<int32_t>(last + 1 - k0)};
}

}  // namespace

TileMap classifyTiles(const TokenInfo& q, const TokenInfo& k, bool causal, int64_t qTileTokens,
                      int64_t kTileTokens) {
  TileMap map;
  map.qTileTokens = qTileTokens;
  map.kTileTokens = kTileTokens;
  const std::vector<TileSummary> qs = summarise(q, qTileTokens);
  const std::vector<TileSummary> ks = summarise(k, kTileTokens);
  map.numQTiles = static_cast<int64_t>(qs.size());
  map.numKTiles = static_cast<int64_t>(ks.size());
  map.classes.resize(map.numQTiles * map.numKTiles);
  map.spans.resize(map.classes.size());
  const int64_t nq = static_cast<int64_t>(q.sequence.size());
  const int64_t nk = static_cast<int64_t>(k.sequence.size());
  for (int64_t qt = 0; qt < map.numQTiles; ++qt) {
    for (int64_t kt = 0; kt < map.numKTiles; ++kt) {
      const TileSummary& a = qs[qt];
      const TileSummary& b = ks[kt];
      const int64_t k0 = kt * kTileTokens, k1 = std::min(nk, (kt + 1) * kTileTokens);
      const ColumnSpan all{0, static_cast<int32_t>(k1 - k0)};
      Classified c;
      if (a.seqMax < b.seqMin || b.seqMax < a.seqMin) {
        c = {};
      } else if (a.seqMin == a.seqMax && b.seqMin == b.seqMax) {
        // One sequence on each side, and it is the same one.
        if (!causal || b.posMax <= a.posMin) c = {TileClass::kFull, all};
        else if (b.posMin > a.posMax) c = {};
        else c = {TileClass::kPartial, causalSpan(k, k0, k1, a.posMax)};
      } else {
        c = classifyExactly(q, qt * qTileTokens, std::min(nq, (qt + 1) * qTileTokens), k, k0, k1,
                            causal);
      }
      map.classes[qt * map.numKTiles + kt] = c.cls;
      map.spans[qt * map.numKTiles + kt] = c.span;
    }
  }
  return map;
}

}  // namespace detail
}  // namespace fcp::kernels
