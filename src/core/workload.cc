#include "fcp/core/workload.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "fcp/core/det_math.h"
#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/random.h"

namespace fcp {
namespace {

/// ln-space parameters of a lognormal whose mean (expectation) is `mean`.
LognormalComponent withMean(double mean, double sigma) {
  return {dmath::log(mean) - 0.5 * sigma * sigma, sigma};
}

/// ln-space parameters of a lognormal whose median is `median`.
LognormalComponent withMedian(double median, double sigma) { return {dmath::log(median), sigma}; }

std::string trim(const std::string& line) {
  const auto hash = line.find('#');
  std::string s = line.substr(0, hash);
  const auto first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  const auto last = s.find_last_not_of(" \t\r");
  return s.substr(first, last - first + 1);
}

}  // namespace

int64_t Batch::numTokens() const {
  int64_t total = 0;
  for (int64_t len : sequenceLengths) total += len;
  return total;
}

const std::vector<Workload>& builtinWorkloads() {
  // lognormal: the production-like long tail. Median 3K, sigma 1.5 puts ~55 % of sequences
  // under 4K yet ~28 % of tokens (and ~78 % of causal FLOPs) in sequences over 64K, and about
  // one sequence in 3300 at the 512K clip, so the tail shows from ~256 workers on.
  static const std::vector<Workload> workloads = {
      {"lognormal", {withMedian(3072, 1.5)}, {}},
      {"lognormal-narrow", {withMean(16384, 0.7)}, {}},
      {"bimodal", {withMean(16384, 0.5), withMean(65536, 0.5)}, {}},
  };
  return workloads;
}

const Workload* builtinWorkload(std::string_view name) {
  for (const auto& w : builtinWorkloads()) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

namespace {

/// "lognormal, lognormal-narrow, bimodal": the names an unknown workload's error lists.
std::string builtinWorkloadNames() {
  std::string known;
  for (const auto& w : builtinWorkloads()) known += (known.empty() ? "" : ", ") + w.name;
  return known;
}

}  // namespace

const Workload& findWorkload(std::string_view name) {
  if (const Workload* w = builtinWorkload(name)) return *w;
  throwInvalidArgument("unknown workload '", name, "': expected one of ", builtinWorkloadNames());
}

namespace {

/// Draws one batch of exactly `numTokens` tokens from `rng`'s stream (the last sequence cut to
/// fit).
Batch drawBatch(const Workload& workload, int64_t numTokens, Rng& rng) {
  Batch batch;
  int64_t filled = 0;
  if (!workload.lengths.empty()) {
    const auto count = static_cast<uint64_t>(workload.lengths.size());
    while (filled < numTokens) {
      const int64_t len = std::min(workload.lengths[rng.next() % count], numTokens - filled);
      batch.sequenceLengths.push_back(len);
      filled += len;
    }
    return batch;
  }
  const auto numComponents = static_cast<uint64_t>(workload.components.size());
  while (filled < numTokens) {
    // One draw picks the component (always drawn, so the stream does not depend on the count).
    const auto& c = workload.components[rng.next() % numComponents];
    const double x = dmath::exp(c.mu + c.sigma * rng.normal());
    const double clipped = std::clamp(x, static_cast<double>(kMinSampledLength),
                                      static_cast<double>(kMaxSampledLength));
    const auto len = std::min(static_cast<int64_t>(std::llround(clipped)), numTokens - filled);
    batch.sequenceLengths.push_back(len);
    filled += len;
  }
  return batch;
}

}  // namespace

Batch sampleBatch(const Workload& workload, int64_t numTokens, uint64_t seed,
                  int64_t minSequences) {
  if (numTokens <= 0 || numTokens > kMaxBatchTokens) {
    throwInvalidArgument("invalid batch size ", numTokens, " tokens: expected 1 to ",
                         kMaxBatchTokens);
  }
  FCP_CHECK(!workload.components.empty() || !workload.lengths.empty(), "workload '",
            workload.name, "' has no components");
  // Every sequence but the last is at least the shortest length the workload draws.
  const auto& lengths = workload.lengths;
  const int64_t shortest = lengths.empty() ? kMinSampledLength
                                           : *std::min_element(lengths.begin(), lengths.end());
  const int64_t most = 1 + (numTokens - 1) / shortest;
  if (minSequences < 1 || minSequences > most) {
    throwInvalidArgument("invalid minimum of ", minSequences, " sequences: expected 1 to ", most,
                         " for ", numTokens, " tokens of workload '", printable(workload.name),
                         "' (no sequence but the last is under ", shortest, " tokens)");
  }
  // Bounded in batches and in lengths drawn (a huge batch takes many lengths per try).
  Rng rng(seed);
  int64_t tries = 0;
  for (int64_t drawn = 0; tries < kMaxBatchDraws && drawn < 64 * kMaxBatchDraws; ++tries) {
    Batch batch = drawBatch(workload, numTokens, rng);
    if (batch.numSequences() >= minSequences) return batch;
    drawn += batch.numSequences();
  }
  throwInvalidArgument("no batch of ", numTokens, " tokens drawn from workload '",
                       printable(workload.name), "' (seed ", seed, ") had ", minSequences,
                       " sequences in ", tries, " tries: expected fewer sequences or more tokens");
}

Batch readTrace(const std::string& path) {
  return parseTrace(readUserFile(path, "trace file", kMaxTraceFileBytes), path);
}

namespace {

/// The lengths in a trace's text, one per line; a total over kMaxBatchTokens is refused only
/// when `limitTotal` (a batch: a "trace"), not for a length list (a distribution: a "workload
/// file"), and errors name the file as what it is.
std::vector<int64_t> parseLengths(std::string_view content, const std::string& source,
                                  bool limitTotal) {
  const std::string shown = printable(source);
  const char* const what = limitTotal ? "trace" : "workload file";
  std::vector<int64_t> lengths;
  int64_t total = 0;
  int64_t lineNumber = 0;
  for (size_t begin = 0; begin < content.size();) {
    size_t end = content.find('\n', begin);
    if (end == std::string::npos) end = content.size();
    ++lineNumber;
    const std::string text = trim(std::string(content.substr(begin, end - begin)));
    begin = end + 1;
    if (text.empty()) continue;
    bool digits = text.size() <= 19;
    for (char ch : text) digits = digits && ch >= '0' && ch <= '9';
    int64_t len = 0;
    if (digits) {
      errno = 0;
      const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
      digits = errno == 0 && v <= static_cast<unsigned long long>(std::numeric_limits<int64_t>::max());
      len = static_cast<int64_t>(v);
    }
    if (!digits || len <= 0) {
      throwInvalidArgument(what, " '", shown, "' line ", lineNumber, ": '", printable(text),
                           "' is not a positive integer sequence length");
    }
    if (len > kMaxSequenceLength) {
      throwInvalidArgument(what, " '", shown, "' line ", lineNumber, ": sequence length ", len,
                           " is over the limit: expected at most ", kMaxSequenceLength, " tokens");
    }
    if (limitTotal && len > kMaxBatchTokens - total) {
      throwInvalidArgument(what, " '", shown, "' line ", lineNumber, ": the batch passes ",
                           kMaxBatchTokens, " tokens: expected a smaller total");
    }
    total = limitTotal ? total + len : 0;
    lengths.push_back(len);
  }
  if (lengths.empty()) {
    throwInvalidArgument(what, " '", shown, "' has no sequence lengths: expected one per line");
  }
  return lengths;
}

}  // namespace

Batch parseTrace(std::string_view content, const std::string& source) {
  Batch batch{parseLengths(content, source, true)};
  checkBatch(batch);
  return batch;
}

Workload loadWorkload(const std::string& nameOrPath) {
  if (const Workload* w = builtinWorkload(nameOrPath)) return *w;
  std::string content;
  try {
    content = readUserFile(nameOrPath, "workload file", kMaxTraceFileBytes);
  } catch (const Error& e) {
    throwInvalidArgument("unknown workload '", printable(nameOrPath), "': expected one of ",
                         builtinWorkloadNames(), " or a file of lengths (", e.what(), ")");
  }
  Workload w;
  w.name = nameOrPath;
  w.lengths = parseLengths(content, nameOrPath, false);
  return w;
}

void checkBatch(const Batch& batch) {
  if (batch.sequenceLengths.empty()) throwInvalidArgument("empty batch: expected at least one sequence");
  int64_t total = 0;
  for (size_t i = 0; i < batch.sequenceLengths.size(); ++i) {
    const int64_t len = batch.sequenceLengths[i];
    if (len <= 0) throwInvalidArgument("sequence ", i, " has length ", len, ": expected > 0");
    if (len > kMaxSequenceLength) {
      throwInvalidArgument("sequence ", i, " has length ", len, ": expected at most ",
                           kMaxSequenceLength, " tokens (int64 FLOP arithmetic)");
    }
    if (len > kMaxBatchTokens - total) {
      throwInvalidArgument("batch passes ", kMaxBatchTokens, " tokens at sequence ", i,
                           ": expected a total that int64 FLOP arithmetic can hold");
    }
    total += len;
  }
}

}  // namespace fcp
