#include "fcp/plan/limits.h"

#include <algorithm>

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

void checkPairCount(const Batch& batch, int64_t blockSize) {
  const int64_t pairs = estimatePairs(batch, blockSize);
  if (pairs <= kMaxPairs) return;
  size_t longest = 0;
  for (size_t i = 1; i < batch.sequenceLengths.size(); ++i) {
    if (batch.sequenceLengths[i] > batch.sequenceLengths[longest]) longest = i;
  }
  const int64_t length = batch.sequenceLengths[longest];
  const int64_t k = (length + blockSize - 1) / blockSize;
  int64_t fits = blockSize;
  while (fits < kMaxSequenceLength && estimatePairs(batch, fits) > kMaxPairs) fits *= 2;
  throwInvalidArgument("the batch needs more than ", kMaxPairs, " block pairs in blocks of ",
                       blockSize, " tokens (its longest, sequence ", longest, ", has ", length,
                       " tokens: ", k, " blocks, ", k * k,
                       " pairs): expected a block size of at least ", fits,
                       " or shorter sequences");
}

}  // namespace fcp::plan
