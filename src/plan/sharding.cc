#include "fcp/plan/sharding.h"

#include <algorithm>
#include <numeric>
#include <tuple>

#include "fcp/core/error.h"
#include "fcp/plan/limits.h"
#include "huge_pages.h"
#include "pair_halves.h"
#include "parallel.h"

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
    blocks.push_back(
        Block{{chunks[static_cast<size_t>(j)], chunks[static_cast<size_t>(2 * k - 1 - j)]}});
  }
}

/// The forward cost of one visible entry in kernels over `tokens` tokens of one sequence: a
/// pair's cost is its visible entries times this (blockPairs), and so is a block's, per
/// sequence it holds (blockCostsFromChunks, costliestLayoutBlock).
double costPerVisible(const CostModel& costModel, int64_t tokens) {
  return forwardFlops(costModel.attention, 1) / costModel.forward.at(tokens);
}

/// One user worker's part [begin, end) of a sequence (positions from its first token).
struct LayoutPiece {
  size_t worker;
  int64_t begin, end;
};

/// The parts shardBatchForLayout cuts a sequence into: a sequence of `len` tokens from `first`
/// in the packed stream, `worker` the user worker holding token `first`. Each worker's part of
/// the sequence, except that a part under a block at either end of a sequence split across
/// workers joins its neighbour's: a few tokens move rather than a kernel running on a short
/// piece (at the end of a long causal sequence, the densest).
void layoutPieces(int64_t first, int64_t len, int64_t blockSize,
                  const std::vector<int64_t>& userStarts, size_t worker,
                  std::vector<LayoutPiece>& pieces) {
  const size_t numWorkers = userStarts.size() - 1;
  pieces.clear();
  for (size_t w = worker; w < numWorkers && userStarts[w] < first + len; ++w) {
    const int64_t begin = std::max(first, userStarts[w]) - first;
    const int64_t end = std::min(first + len, userStarts[w + 1]) - first;
    if (end > begin) pieces.push_back({w, begin, end});
  }
  if (pieces.size() > 1 && pieces.front().end - pieces.front().begin < blockSize) {
    pieces[1].begin = pieces.front().begin;
    pieces.erase(pieces.begin());
  }
  if (pieces.size() > 1 && pieces.back().end - pieces.back().begin < blockSize) {
    pieces[pieces.size() - 2].end = pieces.back().end;
    pieces.pop_back();
  }
}

void checkLayout(const Batch& batch, const std::vector<int64_t>& userStarts) {
  if (userStarts.size() < 2 || userStarts.front() != 0 ||
      userStarts.back() != batch.numTokens()) {
    throwInvalidArgument("user layout of ", userStarts.size(),
                         " slice starts does not cover the batch's ", batch.numTokens(),
                         " tokens");
  }
}

/// First-fit decreasing of `items` (chunks under blockSize tokens) into blocks of at most
/// blockSize tokens, returned in the order they were opened. Bins live in a max-segment tree of
/// free space over slots 0..S-1 (not yet opened slots are empty, so created bins are a prefix):
/// the first bin with room is found by one descent, O(S log S) in all. Ties keep the items'
/// order.
std::vector<Block> packChunks(std::vector<Chunk> items, int64_t blockSize) {
  if (items.empty()) return {};
  std::stable_sort(items.begin(), items.end(),
                   [](const Chunk& a, const Chunk& b) { return a.numTokens() > b.numTokens(); });
  size_t leaves = 1;
  while (leaves < items.size()) leaves *= 2;
  std::vector<int64_t> freeMax(2 * leaves, blockSize);
  // Each item's bin first, then the bins made at their sizes (grown item by item, the bins'
  // chunk lists were reallocated a few times each).
  std::vector<uint32_t> slotOf(items.size());
  std::vector<uint32_t> itemsIn;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t len = items[i].numTokens();
    size_t node = 1;
    while (node < leaves) node = freeMax[2 * node] >= len ? 2 * node : 2 * node + 1;
    const size_t slot = node - leaves;
    if (slot == itemsIn.size()) itemsIn.push_back(0);
    ++itemsIn[slot];
    slotOf[i] = static_cast<uint32_t>(slot);
    freeMax[node] -= len;
    for (node /= 2; node >= 1; node /= 2)
      freeMax[node] = std::max(freeMax[2 * node], freeMax[2 * node + 1]);
  }
  std::vector<Block> bins(itemsIn.size());
  for (size_t b = 0; b < bins.size(); ++b) bins[b].chunks.reserve(itemsIn[b]);
  for (size_t i = 0; i < items.size(); ++i) bins[slotOf[i]].chunks.push_back(items[i]);
  for (Block& bin : bins) {
    // Order a packed block's chunks by position so the token layout inside it is canonical.
    std::sort(bin.chunks.begin(), bin.chunks.end(), [](const Chunk& a, const Chunk& b) {
      return std::tie(a.sequence, a.begin) < std::tie(b.sequence, b.begin);
    });
  }
  return bins;
}

/// Appends every list of `packed` to `blocks`, in order, after one reservation for all of them.
/// (The local placement packs each worker's pieces apart: reserving for each worker's bins in
/// turn moved every block made so far each time, 33 of the 41 s of planning 4096 workers x 1M
/// tokens.)
void appendPacked(std::vector<std::vector<Block>> packed, std::vector<Block>& blocks) {
  size_t count = blocks.size();
  for (const auto& bins : packed) count += bins.size();
  blocks.reserve(count);
  for (auto& bins : packed) {
    for (Block& bin : bins) blocks.push_back(std::move(bin));
  }
}

void checkShardInput(const Batch& batch, int64_t blockSize) {
  if (blockSize <= 0) throwInvalidArgument("invalid block size ", blockSize, ": expected > 0");
  checkBatch(batch);
  if (batch.sequenceLengths.size() > static_cast<size_t>(INT32_MAX)) {
    throwInvalidArgument("batch has ", batch.sequenceLengths.size(),
                         " sequences: expected fewer than 2^31");
  }
}

void checkSequenceSizes(const Batch& batch, int64_t blockSize, const std::vector<int64_t>& sizes) {
  if (sizes.empty()) return;
  if (sizes.size() != batch.sequenceLengths.size()) {
    throwInvalidArgument("sharding got ", sizes.size(), " per-sequence block sizes for ",
                         batch.sequenceLengths.size(), " sequences: expected one each");
  }
  for (size_t s = 0; s < sizes.size(); ++s) {
    if (sizes[s] < 0 || sizes[s] > blockSize) {
      throwInvalidArgument("sequence ", s, " has block size ", sizes[s], ": expected 0 to ",
                           blockSize);
    }
  }
}

/// The block size of sequence `s`: its own, or the batch's.
int64_t sizeOf(const std::vector<int64_t>& sizes, int32_t s, int64_t blockSize) {
  return sizes.empty() || sizes[static_cast<size_t>(s)] == 0 ? blockSize
                                                             : sizes[static_cast<size_t>(s)];
}

void checkBlockCount(const std::vector<Block>& blocks) {
  if (blocks.size() > static_cast<size_t>(INT32_MAX)) {
    throwInvalidArgument("batch makes ", blocks.size(), " blocks: expected fewer than 2^31");
  }
}

/// Every sequence's chunks in block order, as (block, chunk), in CSR form: sequence s holds
/// items[offset[s]] .. items[offset[s + 1]].
struct ChunksBySequence {
  std::vector<int64_t> offset;
  std::vector<std::pair<int32_t, Chunk>> items;
};

/// The number of distinct blocks holding each sequence.
std::vector<int64_t> blocksPerSequence(const ChunksBySequence& bySequence) {
  std::vector<int64_t> m(bySequence.offset.size() - 1, 0);
  for (size_t s = 0; s < m.size(); ++s) {
    for (int64_t i = bySequence.offset[s]; i < bySequence.offset[s + 1]; ++i) {
      const auto at = static_cast<size_t>(i);
      m[s] += i == bySequence.offset[s] ||
              bySequence.items[at].first != bySequence.items[at - 1].first;
    }
  }
  return m;
}

/// Pairs of Q blocks [qBegin, qEnd), appended to `pairs` (see blockPairs).
void appendPairs(const std::vector<Block>& blocks, const ChunksBySequence& bySequence,
                 const CostModel& costModel, int32_t qBegin, int32_t qEnd,
                 std::vector<BlockPair>& pairs) {
  // One Q block at a time: every sequence it holds contributes to its pairs with the blocks
  // holding that sequence; contributions to one KV block add up in dense accumulators (a
  // block may hold many sequences — packed blocks, or a ring rank's block), in sequence
  // order, so the float sums have one order. Pairs come out sorted by (qBlock, kvBlock).
  const MaskKind mask = costModel.attention.mask;
  std::vector<int64_t> accVisible(blocks.size(), 0);
  std::vector<double> accCost(blocks.size(), 0.0);
  std::vector<int32_t> touched;
  std::vector<const Chunk*> qChunks;
  // Kernels over qTokens tokens of one sequence run at f(qTokens): most Q blocks hold the same
  // number of tokens, so the last value is kept rather than the curve evaluated again.
  int64_t lastTokens = -1;
  double lastCostPerVisible = 0;
  for (int32_t q = qBegin; q < qEnd; ++q) {
    qChunks.clear();
    for (const Chunk& c : blocks[static_cast<size_t>(q)].chunks) qChunks.push_back(&c);
    std::stable_sort(qChunks.begin(), qChunks.end(),
                     [](const Chunk* x, const Chunk* y) { return x->sequence < y->sequence; });
    // A Q block of one sequence (a cut sequence's Zig-Zag block: most blocks) meets each KV
    // block once, in ascending order: its pairs go out directly, each sum one addition to zero
    // as in the accumulators, so the pairs are the same.
    const bool oneSequence =
        !qChunks.empty() && qChunks.front()->sequence == qChunks.back()->sequence;
    for (size_t qi = 0; qi < qChunks.size();) {
      size_t qj = qi;
      int64_t qTokens = 0;
      for (; qj < qChunks.size() && qChunks[qj]->sequence == qChunks[qi]->sequence; ++qj) {
        qTokens += qChunks[qj]->numTokens();
      }
      if (qTokens != lastTokens) {
        lastTokens = qTokens;
        lastCostPerVisible = costPerVisible(costModel, qTokens);
      }
      const double costPerVisible = lastCostPerVisible;
      const auto seq = static_cast<size_t>(qChunks[qi]->sequence);
      const std::pair<int32_t, Chunk>* pieces = bySequence.items.data() + bySequence.offset[seq];
      const auto numPieces =
          static_cast<size_t>(bySequence.offset[seq + 1] - bySequence.offset[seq]);
      for (size_t ki = 0; ki < numPieces;) {
        const int32_t k = pieces[ki].first;
        int64_t visible = 0;
        for (; ki < numPieces && pieces[ki].first == k; ++ki) {
          const Chunk& kc = pieces[ki].second;
          for (size_t i = qi; i < qj; ++i) {
            visible += visibleEntries(mask, qChunks[i]->begin, qChunks[i]->end, kc.begin, kc.end);
          }
        }
        if (visible == 0) continue;
        if (oneSequence) {
          pairs.push_back({q, k, visible, 0.0 + static_cast<double>(visible) * costPerVisible});
          continue;
        }
        if (accVisible[static_cast<size_t>(k)] == 0) touched.push_back(k);
        accVisible[static_cast<size_t>(k)] += visible;
        accCost[static_cast<size_t>(k)] += static_cast<double>(visible) * costPerVisible;
      }
      qi = qj;
    }
    if (oneSequence) continue;
    std::sort(touched.begin(), touched.end());
    for (int32_t k : touched) {
      pairs.push_back({q, k, accVisible[static_cast<size_t>(k)], accCost[static_cast<size_t>(k)]});
      accVisible[static_cast<size_t>(k)] = 0;
      accCost[static_cast<size_t>(k)] = 0.0;
    }
    touched.clear();
  }
}
}  // namespace

std::vector<Block> shardBatch(const Batch& batch, int64_t blockSize, MaskKind mask,
                              const std::vector<int64_t>& sequenceBlockSizes, int64_t packSize) {
  checkShardInput(batch, blockSize);
  checkSequenceSizes(batch, blockSize, sequenceBlockSizes);
  if (packSize < 0 || packSize > blockSize) {
    throwInvalidArgument("invalid pack size ", packSize, ": expected 0 (the block size) to ",
                         blockSize);
  }
  const int64_t pack = packSize == 0 ? blockSize : packSize;
  std::vector<Block> blocks;
  {  // the blocks of cut and lone sequences (appendPacked reserves for the packed ones)
    size_t count = 0;
    for (size_t s = 0; s < batch.sequenceLengths.size(); ++s) {
      const int64_t len = batch.sequenceLengths[s];
      const int64_t size = sizeOf(sequenceBlockSizes, static_cast<int32_t>(s), blockSize);
      if (len >= blockSize)
        count += static_cast<size_t>((len + size - 1) / size);
      else if (len > pack)
        ++count;
    }
    blocks.reserve(count);
  }
  std::vector<Chunk> shortSequences;
  for (int32_t s = 0; s < static_cast<int32_t>(batch.sequenceLengths.size()); ++s) {
    const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
    if (len >= blockSize) {
      appendLongSequence(s, len, sizeOf(sequenceBlockSizes, s, blockSize), mask, blocks);
    } else if (len > pack) {
      blocks.push_back(Block{{{s, 0, len}}});
    } else {
      shortSequences.push_back({s, 0, len});
    }
  }
  std::vector<std::vector<Block>> packed;
  packed.push_back(packChunks(std::move(shortSequences), pack));
  appendPacked(std::move(packed), blocks);
  checkBlockCount(blocks);
  return blocks;
}

std::vector<Block> shardBatchForLayout(const Batch& batch, int64_t blockSize,
                                       const std::vector<int64_t>& userStarts,
                                       const std::vector<int64_t>& sequenceBlockSizes) {
  checkShardInput(batch, blockSize);
  checkSequenceSizes(batch, blockSize, sequenceBlockSizes);
  checkLayout(batch, userStarts);
  const size_t numWorkers = userStarts.size() - 1;
  std::vector<Block> blocks;
  std::vector<std::vector<Chunk>> shortPieces(numWorkers);
  std::vector<LayoutPiece> pieces;
  int64_t first = 0;  // the sequence's first token in the packed stream
  size_t worker = 0;  // the user worker holding token `first`
  for (int32_t s = 0; s < static_cast<int32_t>(batch.sequenceLengths.size()); ++s) {
    const int64_t len = batch.sequenceLengths[static_cast<size_t>(s)];
    while (userStarts[worker + 1] <= first) ++worker;
    // Each worker's piece of the sequence is cut into contiguous blocks (pieces under a
    // block pack with that worker's other short pieces): no block draws tokens from two
    // workers. Contiguous, not Zig-Zag, even for a sequence on one worker: a causal
    // sequence's later blocks carry more work per token, so when balance must move work, the
    // fewest tokens move.
    layoutPieces(first, len, blockSize, userStarts, worker, pieces);
    for (const auto& [w, begin, end] : pieces) {
      if (end - begin < blockSize) {
        shortPieces[w].push_back({s, begin, end});
        continue;
      }
      const int64_t size = sizeOf(sequenceBlockSizes, s, blockSize);
      const int64_t k = (end - begin + size - 1) / size;
      for (Chunk c : splitEvenly(s, end - begin, k)) {
        c.begin += begin;
        c.end += begin;
        blocks.push_back(Block{{c}});
      }
    }
    first += len;
  }
  std::vector<std::vector<Block>> packed;
  packed.reserve(shortPieces.size());
  for (auto& own : shortPieces) packed.push_back(packChunks(std::move(own), blockSize));
  appendPacked(std::move(packed), blocks);
  checkBlockCount(blocks);
  return blocks;
}

detail::PairHalves detail::blockPairHalves(const std::vector<Block>& blocks,
                                           const CostModel& costModel, bool withCosts) {
  // Index chunks by sequence: (block, chunk) for every chunk of each sequence, in block order.
  int32_t numSequences = 0;
  for (const Block& b : blocks) {
    for (const Chunk& c : b.chunks) {
      if (c.sequence < 0 || c.begin < 0 || c.end < c.begin) {
        throwInvalidArgument("chunk of sequence ", c.sequence, " [", c.begin, ", ", c.end,
                             "): expected a sequence >= 0 and 0 <= begin <= end");
      }
      numSequences = std::max(numSequences, c.sequence + 1);
    }
  }
  // One array for all sequences (CSR) rather than a vector each: tens of thousands of
  // sequences made as many allocations.
  ChunksBySequence bySequence;
  bySequence.offset.assign(static_cast<size_t>(numSequences) + 1, 0);
  size_t numChunks = 0;
  for (const Block& b : blocks) {
    for (const Chunk& c : b.chunks) ++bySequence.offset[static_cast<size_t>(c.sequence) + 1];
    numChunks += b.chunks.size();
  }
  for (size_t s = 1; s < bySequence.offset.size(); ++s)
    bySequence.offset[s] += bySequence.offset[s - 1];
  bySequence.items.resize(numChunks);
  {
    std::vector<int64_t> next(bySequence.offset.begin(), bySequence.offset.end() - 1);
    for (int32_t b = 0; b < static_cast<int32_t>(blocks.size()); ++b) {
      for (const Chunk& c : blocks[static_cast<size_t>(b)].chunks) {
        bySequence.items[static_cast<size_t>(next[static_cast<size_t>(c.sequence)]++)] = {b, c};
      }
    }
  }
  // The pairs are bounded by the sum over sequences of m^2, m the blocks holding it (a Q block
  // of the sequence pairs with at most the m): reserved, since growing by doubling made most
  // of the page faults. For large batches the Q blocks are cut in two at half that bound, the
  // halves' pairs made side by side and appended in order: the same pairs.
  const std::vector<int64_t> m = blocksPerSequence(bySequence);
  const auto numBlocks = static_cast<int32_t>(blocks.size());
  std::vector<int64_t> boundBefore(blocks.size() + 1, 0);  // Q blocks [0, q)
  for (int32_t q = 0; q < numBlocks; ++q) {
    int64_t bound = 0;
    const auto& chunks = blocks[static_cast<size_t>(q)].chunks;
    // A sequence counts once per run of its chunks (a Zig-Zag block's two are one run; a
    // sequence in two runs of one block only loosens the bound).
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (i == 0 || chunks[i].sequence != chunks[i - 1].sequence)
        bound += m[static_cast<size_t>(chunks[i].sequence)];
    }
    // Saturating far above any plan (kMaxPairs), far below overflow.
    boundBefore[static_cast<size_t>(q) + 1] =
        std::min(boundBefore[static_cast<size_t>(q)] + bound, int64_t{1} << 60);
  }
  const int64_t total = boundBefore.back();
  const auto capped = [](int64_t bound) { return static_cast<size_t>(std::min(kMaxPairs, bound)); };
  detail::PairHalves h;
  detail::reserveHuge(h.first, capped(total));  // room for the second half too
  if (withCosts) h.costs.assign(blocks.size(), 0.0);
  // blockCosts' sums, per half: each block's pairs are in one half, in order.
  const auto sumCosts = [&](const std::vector<BlockPair>& pairs) {
    if (!withCosts) return;
    for (const BlockPair& p : pairs) h.costs[static_cast<size_t>(p.qBlock)] += p.cost;
  };
  const bool parallel = detail::worthParallel(total);
  const auto split = static_cast<int32_t>(
      parallel ? std::lower_bound(boundBefore.begin(), boundBefore.end(), total / 2) -
                     boundBefore.begin()
               : numBlocks);
  detail::runBoth(
      parallel,
      [&] {
        appendPairs(blocks, bySequence, costModel, 0, split, h.first);
        sumCosts(h.first);
      },
      [&] {
        if (split == numBlocks) return;
        detail::reserveHuge(h.second, capped(total - boundBefore[static_cast<size_t>(split)]));
        appendPairs(blocks, bySequence, costModel, split, numBlocks, h.second);
        sumCosts(h.second);
      });
  return h;
}

std::vector<BlockPair> blockPairs(const std::vector<Block>& blocks, const CostModel& costModel) {
  detail::PairHalves h = detail::blockPairHalves(blocks, costModel, false);
  return detail::joinHalves(h);
}

std::vector<double> blockCosts(int64_t numBlocks, const std::vector<BlockPair>& pairs) {
  std::vector<double> costs(static_cast<size_t>(numBlocks), 0.0);
  for (const BlockPair& p : pairs) costs[static_cast<size_t>(p.qBlock)] += p.cost;
  return costs;
}

double costliestLayoutBlock(const Batch& batch, int32_t sequence, int64_t blockSize,
                            const std::vector<int64_t>& userStarts,
                            const std::vector<int64_t>& sequenceBlockSizes,
                            const CostModel& costModel) {
  checkShardInput(batch, blockSize);
  checkSequenceSizes(batch, blockSize, sequenceBlockSizes);
  checkLayout(batch, userStarts);
  FCP_CHECK(sequence >= 0 && static_cast<size_t>(sequence) < batch.sequenceLengths.size(),
            "sequence ", sequence, " of ", batch.sequenceLengths.size());
  const auto s = static_cast<size_t>(sequence);
  const int64_t len = batch.sequenceLengths[s];
  const int64_t first =
      std::accumulate(batch.sequenceLengths.begin(),
                      batch.sequenceLengths.begin() + static_cast<std::ptrdiff_t>(s), int64_t{0});
  // The last slice starting at or before `first` (the first slice holding it, or an empty one
  // just before: layoutPieces skips empty parts, so both give the same pieces).
  const auto worker = static_cast<size_t>(
      std::upper_bound(userStarts.begin(), userStarts.end() - 1, first) - userStarts.begin() - 1);
  std::vector<LayoutPiece> pieces;
  layoutPieces(first, len, blockSize, userStarts, worker, pieces);
  const int64_t size = sizeOf(sequenceBlockSizes, sequence, blockSize);
  double costliest = 0;
  for (const auto& [w, begin, end] : pieces) {
    if (end - begin < blockSize) continue;  // packed with the worker's other short pieces
    for (const Chunk& c : splitEvenly(sequence, end - begin, (end - begin + size - 1) / size)) {
      const int64_t visible =
          visibleEntries(costModel.attention.mask, begin + c.begin, begin + c.end, 0, len);
      if (visible == 0) continue;
      // As blockCostsFromChunks computes a one-chunk block's cost: the same value.
      costliest = std::max(costliest, 0.0 + static_cast<double>(visible) *
                                                costPerVisible(costModel, c.numTokens()));
    }
  }
  return costliest;
}

std::vector<double> blockCostsFromChunks(const std::vector<Block>& blocks,
                                         const std::vector<int64_t>& sequenceLengths,
                                         const CostModel& costModel) {
  const MaskKind mask = costModel.attention.mask;
  // Most blocks hold the same number of tokens of one sequence: the last rate is kept rather
  // than the curve evaluated again (as blockPairs does).
  int64_t lastTokens = -1;
  double lastRate = 0;
  const auto cost = [&](int32_t s, const Chunk* const* first, const Chunk* const* last) {
    FCP_CHECK(s >= 0 && static_cast<size_t>(s) < sequenceLengths.size(), "chunk of sequence ",
              s, " in a batch of ", sequenceLengths.size());
    const int64_t length = sequenceLengths[static_cast<size_t>(s)];
    int64_t tokens = 0, visible = 0;
    for (; first != last; ++first) {
      tokens += (*first)->numTokens();
      visible += visibleEntries(mask, (*first)->begin, (*first)->end, 0, length);
    }
    if (visible == 0) return 0.0;
    if (tokens != lastTokens) {
      lastTokens = tokens;
      lastRate = costPerVisible(costModel, tokens);
    }
    return static_cast<double>(visible) * lastRate;
  };
  std::vector<double> costs(blocks.size(), 0.0);
  std::vector<const Chunk*> chunks;
  for (size_t b = 0; b < blocks.size(); ++b) {
    chunks.clear();
    for (const Chunk& c : blocks[b].chunks) chunks.push_back(&c);
    // One sequence (a cut sequence's block: most blocks) needs no sorting.
    const bool oneSequence = std::all_of(chunks.begin(), chunks.end(), [&](const Chunk* c) {
      return c->sequence == chunks.front()->sequence;
    });
    if (!oneSequence) {
      std::stable_sort(chunks.begin(), chunks.end(),
                       [](const Chunk* x, const Chunk* y) { return x->sequence < y->sequence; });
    }
    for (size_t i = 0; i < chunks.size();) {
      size_t j = i;
      while (j < chunks.size() && chunks[j]->sequence == chunks[i]->sequence) ++j;
      costs[b] += cost(chunks[i]->sequence, chunks.data() + i, chunks.data() + j);
      i = j;
    }
  }
  return costs;
}

}  // namespace fcp::plan
