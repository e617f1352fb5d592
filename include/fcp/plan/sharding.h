#pragma once
/// Sharding (§4.1): every sequence cut into blocks of about `blockSize` tokens.
///
/// A sequence of length L >= blockSize becomes k = ceil(L / blockSize) blocks, so no block
/// exceeds blockSize and none is padded. Under a causal mask it is cut into 2k chunks of
/// near-equal size and block j holds chunks j and 2k-1-j (Zig-Zag), so every block of the
/// sequence carries the same causal work (exactly when 2k divides L, nearly otherwise). Under
/// a full mask, or when 2k > L (blocks under two tokens), the k blocks are contiguous
/// near-equal pieces. Sequences
/// shorter than blockSize are packed whole into shared blocks by first-fit decreasing (varlen
/// packing), which keeps the block count within 11/9 of the fewest possible.

#include <cstdint>
#include <vector>

#include "fcp/core/config.h"
#include "fcp/core/cost_model.h"
#include "fcp/core/workload.h"

namespace fcp::plan {

/// A contiguous token range [begin, end) of one sequence; positions count from the sequence's
/// first token.
struct Chunk {
  int32_t sequence = 0;
  int64_t begin = 0;
  int64_t end = 0;

  int64_t numTokens() const { return end - begin; }
  friend bool operator==(const Chunk&, const Chunk&) = default;
};

/// The unit of scheduling: one or more chunks, either a Zig-Zag pair or contiguous piece of one
/// sequence, or several whole short sequences packed together.
struct Block {
  std::vector<Chunk> chunks;

  /// Inline: the planner sums the tokens of tens of thousands of blocks in several places.
  int64_t numTokens() const {
    int64_t total = 0;
    for (const Chunk& c : chunks) total += c.numTokens();
    return total;
  }
  friend bool operator==(const Block&, const Block&) = default;
};

/// One (Q block, KV block) whose attention must be computed: `visible` is the number of
/// (query, key) entries the mask lets through between them, `cost` their forward cost under
/// the cost model (FLOPs at peak, see CostModel).
struct BlockPair {
  int32_t qBlock = 0;
  int32_t kvBlock = 0;
  int64_t visible = 0;
  double cost = 0;

  friend bool operator==(const BlockPair&, const BlockPair&) = default;
};

/// Cuts `batch` into blocks as described above, in a deterministic order: sequences' own
/// blocks in sequence order, then the packed blocks. `sequenceBlockSizes`, when not empty,
/// holds one entry per sequence: a sequence of at least `blockSize` tokens is cut into
/// ceil(L / size) blocks with its own size instead (0 means blockSize; used to give long
/// sequences smaller blocks). `packSize` (0 means blockSize) bounds the packed blocks: the
/// short sequences are packed into blocks of at most packSize tokens, and one longer than
/// packSize (but under blockSize) gets a block of its own; smaller packed blocks fill the
/// room the memory cap leaves on workers (no transfer ever carries them). Throws
/// Error(kInvalidArgument) for a non-positive block size, sizes of the wrong count or outside
/// [0, blockSize], a pack size outside [0, blockSize], or a batch that fails checkBatch.
std::vector<Block> shardBatch(const Batch& batch, int64_t blockSize, MaskKind mask,
                              const std::vector<int64_t>& sequenceBlockSizes = {},
                              int64_t packSize = 0);

/// Sharding for a given user layout (worker r holds tokens [userStarts[r], userStarts[r + 1])
/// of the packed batch). Each worker's piece of each sequence is cut into
/// ceil(piece / blockSize) contiguous near-equal blocks; a piece under blockSize at either end
/// of a sequence split across workers first joins its neighbour's piece (the only blocks that
/// draw tokens from two workers); the other pieces under blockSize are packed, per worker, by
/// first-fit decreasing. Contiguous blocks of a causal sequence carry unequal work (later ones
/// more per token), which is what lets the locality-first distributor move the most work with
/// the fewest tokens. Deterministic: sequences' blocks in sequence order, then each worker's
/// packed blocks in worker order. `sequenceBlockSizes` as for shardBatch: a piece of at least
/// blockSize tokens is cut into ceil(piece / size) blocks with its sequence's own size.
std::vector<Block> shardBatchForLayout(const Batch& batch, int64_t blockSize,
                                       const std::vector<int64_t>& userStarts,
                                       const std::vector<int64_t>& sequenceBlockSizes = {});

/// Every pair of blocks that shares visible entries under `mask`, sorted by (qBlock, kvBlock).
/// A pair's cost sums, per sequence, forwardCost(visible, tokens of that sequence in the Q
/// block): kernels run per sequence, so a packed block of short sequences runs short kernels.
std::vector<BlockPair> blockPairs(const std::vector<Block>& blocks, const CostModel& costModel);

/// Forward cost of each block as a Q block: the sum of its pairs' costs.
std::vector<double> blockCosts(int64_t numBlocks, const std::vector<BlockPair>& pairs);

/// blockCosts(blocks.size(), blockPairs(blocks, costModel)) up to rounding, without the pairs:
/// a pair's cost is its visible entries times a per-sequence rate, so a block's cost is, per
/// sequence it holds, that rate times the entries its chunks see in the whole sequence (the
/// sequence's chunks tile it). The same terms summed in another order: for a block of n pairs
/// the two agree to within about n * 2^-53 relative. O(chunks), not O(pairs),
/// for deciding that a cutting cannot win before its pairs are made. `sequenceLengths` are the
/// batch's, which the blocks must tile.
std::vector<double> blockCostsFromChunks(const std::vector<Block>& blocks,
                                         const std::vector<int64_t>& sequenceLengths,
                                         const CostModel& costModel);

/// The costliest of the blocks of `sequence` alone (not packed with others) that
/// shardBatchForLayout(batch, blockSize, userStarts, sequenceBlockSizes) makes, as
/// blockCostsFromChunks costs them (the same value); 0 when the sequence has none (every piece
/// of it is packed). O(the sequence's blocks + the batch's sequences), without cutting the
/// rest of the batch: a cutting whose costliest block is over what it must beat is refused
/// before it is made. Throws as shardBatchForLayout does, and for a sequence out of range.
double costliestLayoutBlock(const Batch& batch, int32_t sequence, int64_t blockSize,
                            const std::vector<int64_t>& userStarts,
                            const std::vector<int64_t>& sequenceBlockSizes,
                            const CostModel& costModel);

}  // namespace fcp::plan
