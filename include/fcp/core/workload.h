#pragma once
/// Batches of sequence lengths: sampled from a named workload or read from a trace file.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fcp {

/// The sequences of one training step, in order; packed they form one token stream.
struct Batch {
  std::vector<int64_t> sequenceLengths;

  int64_t numSequences() const { return static_cast<int64_t>(sequenceLengths.size()); }
  /// Sum of the lengths (checked against overflow when the batch was made).
  int64_t numTokens() const;

  friend bool operator==(const Batch&, const Batch&) = default;
};

/// Shortest and longest sequence a sampled workload produces (the paper clips to [1K, 512K]).
inline constexpr int64_t kMinSampledLength = 1024;
inline constexpr int64_t kMaxSampledLength = 512 * 1024;

/// Largest sequence and batch FCP accepts: with these, every count of visible (query, key)
/// entries, summed over a batch, stays below 2^62 in int64 arithmetic.
inline constexpr int64_t kMaxSequenceLength = int64_t{1} << 30;
inline constexpr int64_t kMaxBatchTokens = int64_t{1} << 32;

/// One lognormal component: ln(length) ~ Normal(mu, sigma).
struct LognormalComponent {
  double mu = 0;
  double sigma = 1;
};

/// A named length distribution: either an equal-weight mixture of lognormal components,
/// clipped to [kMinSampledLength, kMaxSampledLength] (the built-in ones), or an *empirical*
/// one: a list of lengths (a corpus's document sizes, say), each draw one of them uniformly,
/// unclipped, the way the paper samples batches from its traces.
struct Workload {
  std::string name;
  std::vector<LognormalComponent> components;
  std::vector<int64_t> lengths;  ///< empirical: non-empty, and then `components` is empty
};

/// The built-in workloads: "lognormal", "lognormal-narrow", "bimodal".
const std::vector<Workload>& builtinWorkloads();
/// The built-in workload named `name`, or nullptr when there is none (a name that is not
/// built in is a file's path to loadWorkload).
const Workload* builtinWorkload(std::string_view name);
/// Looks up a built-in workload; throws Error(kInvalidArgument) listing the known names.
const Workload& findWorkload(std::string_view name);

/// A built-in workload by name, or else an empirical one read from the file `nameOrPath`
/// (one length per line, like a trace; its total is not limited). Throws Error(kInvalidArgument)
/// naming the built-in workloads when it is neither, or the file's bad line.
Workload loadWorkload(const std::string& nameOrPath);

/// Most batches sampleBatch draws before it gives up on `minSequences`.
inline constexpr int64_t kMaxBatchDraws = 100000;

/// Draws lengths from `workload` (seeded, identical on every machine) until exactly
/// `numTokens` tokens are filled; the last sequence is cut to fit, so it may be shorter
/// than kMinSampledLength. With `minSequences` > 1 it returns the first batch of the seed's
/// stream with at least that many sequences (the distribution conditioned on the count; the
/// first draw is the batch `minSequences` = 1 gives). Throws Error(kInvalidArgument) for a
/// size out of range, a count no batch of that size can have, or none found in kMaxBatchDraws
/// batches.
Batch sampleBatch(const Workload& workload, int64_t numTokens, uint64_t seed,
                  int64_t minSequences = 1);

/// Reads a trace: one positive sequence length per line; blank lines and text after '#' are
/// ignored. Throws Error(kInvalidArgument) for a missing or unreadable file, one that is not a
/// regular file (a FIFO, device or directory: refused without blocking) or is over
/// kMaxTraceFileBytes, a line that is not a positive integer or is over kMaxSequenceLength
/// (naming the line), an empty trace, or a total over kMaxBatchTokens (naming the line).
Batch readTrace(const std::string& path);

/// The batch in the text of a trace file (what readTrace reads), checked the same way;
/// `source` names it in messages.
Batch parseTrace(std::string_view content, const std::string& source);

/// Checks every length is in [1, kMaxSequenceLength] and the total at most kMaxBatchTokens;
/// throws Error(kInvalidArgument) naming the bad entry.
void checkBatch(const Batch& batch);

}  // namespace fcp
