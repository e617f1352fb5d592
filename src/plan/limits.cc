#include "fcp/plan/limits.h"

#include <algorithm>
#include <sstream>
#include <string>

#include "fcp/core/error.h"

namespace fcp::plan {

int64_t estimatePairs(const Batch& batch, int64_t blockSize) {
  FCP_CHECK(blockSize > 0, "block size ", blockSize);
  int64_t pairs = 0;
  for (const int64_t length : batch.sequenceLengths) {
    // Lengths are at most kMaxSequenceLength = 2^30, so k^2 <= 2^60 fits.
    const int64_t k = length >= blockSize ? (length + blockSize - 1) / blockSize : 1;
    pairs += k * k;
    if (pairs > kMaxPairs) return kMaxPairs + 1;  // saturate before the sum can overflow
  }
  return pairs;
}

namespace {

/// The smallest block size from `from` at which estimatePairs is within kMaxPairs (it never
/// rises with the block size); there is one (checkPairCount checks kMaxSequenceLength first).
int64_t smallestFittingBlock(const Batch& batch, int64_t from) {
  int64_t lo = from, hi = kMaxSequenceLength;  // estimatePairs(lo) > kMaxPairs >= at hi
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (estimatePairs(batch, mid) > kMaxPairs ? lo : hi) = mid;
  }
  return hi;
}

/// "the batch needs more than ... (its longest, ...)", the start of both refusals.
std::string tooManyPairs(const Batch& batch, int64_t blockSize) {
  size_t longest = 0;
  for (size_t i = 1; i < batch.sequenceLengths.size(); ++i) {
    if (batch.sequenceLengths[i] > batch.sequenceLengths[longest]) longest = i;
  }
  const int64_t length = batch.sequenceLengths[longest];
  const int64_t k = (length + blockSize - 1) / blockSize;
  std::ostringstream os;
  os << "the batch needs more than " << kMaxPairs << " block pairs in blocks of " << blockSize
     << " tokens (its longest, sequence " << longest << ", has " << length << " tokens: " << k
     << " blocks, " << k * k << " pairs)";
  return os.str();
}

}  // namespace

void checkPairCount(const Batch& batch, int64_t blockSize) {
  if (estimatePairs(batch, blockSize) <= kMaxPairs) return;
  if (estimatePairs(batch, kMaxSequenceLength) > kMaxPairs) {
    // Every sequence makes a pair at least, whatever the block size.
    throwInvalidArgument("the batch has ", batch.sequenceLengths.size(),
                         " sequences, each at least one block pair: expected at most ", kMaxPairs,
                         " sequences");
  }
  throwInvalidArgument(tooManyPairs(batch, blockSize), ": expected a block size of at least ",
                       smallestFittingBlock(batch, blockSize), " or shorter sequences");
}

void checkPairCountUnderCap(const Batch& batch, int64_t blockSize, int64_t requestedBlockSize,
                            int64_t capTokens) {
  if (blockSize >= requestedBlockSize) return checkPairCount(batch, blockSize);
  if (estimatePairs(batch, blockSize) <= kMaxPairs) return;
  checkPairCount(batch, kMaxSequenceLength);  // too many sequences is the same refusal here
  throwInvalidArgument(tooManyPairs(batch, blockSize), ", cut finer than the block size ",
                       requestedBlockSize, " so that the memory cap of ", capTokens,
                       " tokens a worker can place them: expected a larger cap (more tokens per "
                       "worker, or a larger memory limit or slack) or shorter sequences");
}

}  // namespace fcp::plan
