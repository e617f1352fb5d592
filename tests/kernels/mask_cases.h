#pragma once
// The mask layouts every kernel test sweeps: causal with offsets (a Zig-Zag block of two chunks
// against another Zig-Zag block), full, and varlen (short sequences packed in one block, some of
// them absent from the KV block so that their rows see nothing).
#include <random>
#include <string>
#include <vector>

#include "fcp/kernels/attention.h"

namespace fcp::kernels::testing {

enum class Layout { kCausalOffsets, kFull, kVarlen };

inline std::string layoutName(Layout l) {
  switch (l) {
    case Layout::kCausalOffsets: return "causal";
    case Layout::kFull: return "full";
    case Layout::kVarlen: return "varlen";
  }
  return "?";
}

struct MaskSetup {
  MaskKind kind = MaskKind::kCausal;
  std::vector<Segment> q, k;
  BlockMask mask() const { return {kind, q, k}; }
};

/// A mask of `layout` for nq query and nk key tokens (varlen uses nk = nq).
inline MaskSetup makeMask(Layout layout, int64_t nq, int64_t nk, std::mt19937_64& rng) {
  MaskSetup m;
  const int64_t c = std::max(nq, nk);
  switch (layout) {
    case Layout::kCausalOffsets: {
      // Q holds chunks at positions ~2c and ~9c of sequence 7; K holds a chunk straddling Q's
      // first chunk (partial tiles), and one after it (empty for Q's first chunk, full for the
      // second).
      const int64_t shift = static_cast<int64_t>(rng() % 13);
      const int64_t p1 = 2 * c + 11 + shift;
      m.q = {{(nq + 1) / 2, 7, p1}, {nq / 2, 7, 9 * c + 3}};
      m.k = {{(nk + 1) / 2, 7, p1 - nk / 3}, {nk / 2, 7, 5 * c}};
      break;
    }
    case Layout::kFull:
      m.kind = MaskKind::kFull;
      m.q = {{nq, 3, 100}};
      m.k = {{nk, 3, 0}};
      break;
    case Layout::kVarlen: {
      // Sequences of 1 .. max(1, nq / 3) tokens; every third is missing from the KV block.
      int64_t at = 0, id = 0;
      while (at < nq) {
        const int64_t len = std::min<int64_t>(nq - at, 1 + rng() % std::max<int64_t>(1, nq / 3));
        m.q.push_back({len, id, 0});
        m.k.push_back({len, id % 3 == 2 ? id + 1000 : id, 0});
        at += len;
        ++id;
      }
      break;
    }
  }
  return m;
}

}  // namespace fcp::kernels::testing
