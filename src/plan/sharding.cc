#include "fcp/plan/sharding.h"

#include <algorithm>
#include <numeric>
#include <tuple>

#include "fcp/core/error.h"

namespace fcp::plan {
namespace {

/// Splits [0, length) into `parts` near-equal contiguous ranges; the first length % parts
/// ranges get one extra token.
std::vector<Chunk> splitEvenly(int32_t sequence, int64_t length, int64_t parts) {
  std::vector<Chunk> chunks;
  chunks.reserve(static_cast<size_t>(parts));
  const int64_t base = length / parts;
  const int64_t extra = length % parts;
  int64_t begin = 0;
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t size = base + (i < extra ? 1 : 0);
    chunks.push_back({sequence, begin, begin + size});
    begin += size;
  }
  return chunks;
}

void appendLongSequence(int32_t sequence, int64_t length, int64_t blockSize, MaskKind mask,
                        std::vector<Block>& blocks) {
  const int64_t k = (length + blockSize - 1) / blockSize;
  // Zig-Zag needs 2k non-empty chunks; when a block would hold under two tokens (block sizes
  // of 1, or a 3-token sequence in 2-token blocks) contiguous blocks are used instead.
  if (mask == MaskKind::kFull || 2 * k > length) {
    for (const Chunk& c : splitEvenly(sequence, length, k)) blocks.push_back(Block{{c}});
    return;
  }
  const std::vector<Chunk> chunks = splitEvenly(sequence, length, 2 * k);
  for (int64_t j = 0; j < k; ++j) {
    blocks.push_back(Block{{chunks[static_cast<size_t>(j)],
                            chunks[static_cast<size_t>(2 * k - 1 - j)]}});
  }
}

/// First-fit decreasing over the short sequences. Bins are scanned in creation order, which
/// is O(S * bins) but S short sequences fill at most S / 2 + 1 bins of which only the open
/// ones are scanned: bins are dropped from the scan once full.
void appendPackedSequences(const Batch& batch, int64_t blockSize, std::vector<Block>& blocks) {
  std::vector<int32_t> shortSequences;
  for (int32_t s = 0; s < static_cast<int32_t>(batch.sequenceLengths.size()); ++s) {
    if (batch.sequenceLengths[static_cast<size_t>(s)] < blockSize) shortSequences.push_back(s);
  }
  std::stable_sort(shortSequences.begin(), shortSequences.end(), [&](int32_t a, int32_t b) {
    return batch.sequenceLengths[static_cast<size_t>(a)] >
           batch.sequenceLengths[static_cast<size_t>(b)];
  });
  struct Bin {
    Block block;
    int64_t free;
  };
  std::vector<Bin> bins;
  std::vector<size_t> open;  // indices into bins with free space, in creation order
  const int64_t minLength = shortSequences.empty()
                                ? 0
                                : batch.sequenceLengths[static_cast<size_t>(shortSequences.back())];
  for (int32_t s : shortSequences) {
    const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
    bool placed = false;
    for (size_t o = 0; o < open.size() && !placed; ++o) {
      Bin& bin = bins[open[o]];
      if (bin.free >= len) {
        bin.block.chunks.push_back({s, 0, len});
        bin.free -= len;
        placed = true;
        // No later (shorter or equal) sequence is shorter than minLength: a bin with less
        // room than that can never take another.
        if (bin.free < minLength) open.erase(open.begin() + static_cast<std::ptrdiff_t>(o));
      }
    }
    if (!placed) {
      bins.push_back({Block{{{s, 0, len}}}, blockSize - len});
      if (blockSize - len >= minLength) open.push_back(bins.size() - 1);
    }
  }
  for (Bin& bin : bins) {
    // Order a packed block's sequences by index so the token layout inside it is canonical.
    std::sort(bin.block.chunks.begin(), bin.block.chunks.end(),
              [](const Chunk& a, const Chunk& b) { return a.sequence < b.sequence; });
    blocks.push_back(std::move(bin.block));
  }
}

}  // namespace

int64_t Block::numTokens() const {
  int64_t total = 0;
  for (const Chunk& c : chunks) total += c.numTokens();
  return total;
}

std::vector<Block> shardBatch(const Batch& batch, int64_t blockSize, MaskKind mask) {
  if (blockSize <= 0) throwInvalidArgument("invalid block size ", blockSize, ": expected > 0");
  checkBatch(batch);
  if (batch.sequenceLengths.size() > static_cast<size_t>(INT32_MAX)) {
    throwInvalidArgument("batch has ", batch.sequenceLengths.size(),
                         " sequences: expected fewer than 2^31");
  }
  std::vector<Block> blocks;
  for (int32_t s = 0; s < static_cast<int32_t>(batch.sequenceLengths.size()); ++s) {
    const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
    if (len >= blockSize) appendLongSequence(s, len, blockSize, mask, blocks);
  }
  appendPackedSequences(batch, blockSize, blocks);
  if (blocks.size() > static_cast<size_t>(INT32_MAX)) {
    throwInvalidArgument("batch makes ", blocks.size(), " blocks: expected fewer than 2^31");
  }
  return blocks;
}

std::vector<BlockPair> blockPairs(const std::vector<Block>& blocks, const CostModel& costModel) {
  // Index chunks by sequence: (block, chunk) for every chunk of each sequence.
  int32_t numSequences = 0;
  for (const Block& b : blocks) {
    for (const Chunk& c : b.chunks) numSequences = std::max(numSequences, c.sequence + 1);
  }
  std::vector<std::vector<std::pair<int32_t, Chunk>>> bySequence(
      static_cast<size_t>(numSequences));
  for (int32_t b = 0; b < static_cast<int32_t>(blocks.size()); ++b) {
    for (const Chunk& c : blocks[static_cast<size_t>(b)].chunks) {
      bySequence[static_cast<size_t>(c.sequence)].push_back({b, c});
    }
  }
  const MaskKind mask = costModel.attention.mask;
  std::vector<BlockPair> pairs;
  for (const auto& pieces : bySequence) {
    // A sequence's blocks, each with the chunks of this sequence it holds (adjacent in
    // `pieces`, since blocks were visited in order).
    for (size_t qi = 0; qi < pieces.size();) {
      size_t qj = qi;
      int64_t qTokens = 0;
      while (qj < pieces.size() && pieces[qj].first == pieces[qi].first) {
        qTokens += pieces[qj].second.numTokens();
        ++qj;
      }
      // Kernels over this Q block's tokens of the sequence run at f(qTokens).
      const double fwdCostPerVisible =
          forwardFlops(costModel.attention, 1) / costModel.forward.at(qTokens);
      for (size_t ki = 0; ki < pieces.size();) {
        size_t kj = ki;
        int64_t visible = 0;
        while (kj < pieces.size() && pieces[kj].first == pieces[ki].first) {
          for (size_t q = qi; q < qj; ++q) {
            const Chunk& qc = pieces[q].second;
            const Chunk& kc = pieces[kj].second;
            visible += visibleEntries(mask, qc.begin, qc.end, kc.begin, kc.end);
          }
          ++kj;
        }
        if (visible > 0) {
          pairs.push_back({pieces[qi].first, pieces[ki].first, visible,
                           static_cast<double>(visible) * fwdCostPerVisible});
        }
        ki = kj;
      }
      qi = qj;
    }
  }
  // Merge the per-sequence contributions of packed blocks (several sequences, one self pair).
  // Stable, so equal keys keep sequence order and the float sums below have one order.
  std::stable_sort(pairs.begin(), pairs.end(), [](const BlockPair& a, const BlockPair& b) {
    return std::tie(a.qBlock, a.kvBlock) < std::tie(b.qBlock, b.kvBlock);
  });
  std::vector<BlockPair> merged;
  for (const BlockPair& p : pairs) {
    if (!merged.empty() && merged.back().qBlock == p.qBlock && merged.back().kvBlock == p.kvBlock) {
      merged.back().visible += p.visible;
      merged.back().cost += p.cost;
    } else {
      merged.push_back(p);
    }
  }
  return merged;
}

std::vector<double> blockCosts(int64_t numBlocks, const std::vector<BlockPair>& pairs) {
  std::vector<double> costs(static_cast<size_t>(numBlocks), 0.0);
  for (const BlockPair& p : pairs) costs[static_cast<size_t>(p.qBlock)] += p.cost;
  return costs;
}

}  // namespace fcp::plan
