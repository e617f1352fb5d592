#pragma once
/// What every subcommand of `fcp` shares: numeric flags parsed strictly (fcp/core/input.h),
/// the limits of the flags, and the one-line error report.

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fcp/plan/limits.h"
#include "fcp/plan/plan.h"

namespace fcp::app {

/// Help of every subcommand's --workload.
inline constexpr const char* kWorkloadHelp =
    "Length distribution: lognormal, lognormal-narrow, bimodal, or a file of lengths (one per "
    "line) to draw sequences from uniformly, e.g. data/workloads/code-corpus.txt";

/// Most kernel threads per rank (--threads).
inline constexpr int64_t kMaxThreads = 256;
/// Largest block `fcp bench kernel --tokens` measures, and the most forward FLOPs of one of its
/// pairs, 4 x tokens^2 x heads x head dim: that of the default's largest case (8K tokens, 8
/// heads of 128), about 2 minutes for its four measurements here.
inline constexpr int64_t kMaxBenchTokens = 16 * 1024;
inline constexpr double kMaxBenchPairFlops = 4.0 * 8192 * 8192 * 8 * 128;
/// Longest --min-seconds of `fcp bench kernel`.
inline constexpr double kMaxMinSeconds = 60;
/// Most --warmup and --repeats of `fcp run`, and its longest --timeout.
inline constexpr int64_t kMaxRepeats = 1000;
inline constexpr double kMaxTimeoutSeconds = 24 * 3600;
/// Largest --comm-ratio (FLOP per byte; GPU-X is 5920): above it the capped link is so slow
/// that a run of the default batch takes hours.
inline constexpr double kMaxCommRatio = plan::kMaxCommRatio;
/// Most attention FLOPs `fcp run` takes on per rank (forward and backward, every warm-up and
/// timed repeat of every strategy): about 15 minutes at 20 GFLOP/s.
inline constexpr double kMaxRunFlopsPerRank = 2e13;
/// Most bytes of tensors `fcp run` estimates a rank holds.
inline constexpr double kMaxRunBytesPerRank = 8.0 * (1 << 30);

/// How a sampled batch was drawn, for headers: "workload lognormal (seed 4)", or with a
/// minimum count "workload lognormal (seed 4, at least 8 sequences)".
std::string describeDraw(const std::string& workload, uint64_t seed, int64_t minSequences);

/// The file --workload reads, or "" for a built-in workload (built-in names win over files).
std::string_view workloadFile(const std::string& workload);

/// A text flag; an empty value ('') is an error rather than "not given".
CLI::Option* addText(CLI::App* cmd, const std::string& name, std::string& target,
                     const std::string& help);
/// An integer flag in [min, max]; anything else (empty, junk, overflow) is a one-line error
/// naming the flag and the range.
CLI::Option* addInteger(CLI::App* cmd, const std::string& name, int64_t& target, int64_t min,
                        int64_t max, const std::string& help);
/// A comma-separated list of integers in [min, max] ("16,32"); an empty item is an error.
CLI::Option* addIntegerList(CLI::App* cmd, const std::string& name, std::vector<int64_t>& target,
                            int64_t min, int64_t max, const std::string& help);
/// An unsigned integer flag in [0, max]; "-1" is an error, not 2^64 - 1.
CLI::Option* addUnsigned(CLI::App* cmd, const std::string& name, uint64_t& target, uint64_t max,
                         const std::string& help);
/// A finite number flag in [min, max].
CLI::Option* addNumber(CLI::App* cmd, const std::string& name, double& target, double min,
                       double max, const std::string& help);
/// A finite number flag in (0, max]: as addNumber, but its help and error say that 0 is refused;
/// `shownDefault` is the default --help shows.
CLI::Option* addPositiveNumber(CLI::App* cmd, const std::string& name, double& target, double max,
                               const std::string& help, const std::string& shownDefault);

/// --block-size parsed (parseTokenCount) and checked (plan::checkBlockSize), named by the flag.
int64_t parseBlockSize(const std::string& text);

/// Prints "fcp: <kind>: [rank R: ]<message>" and a newline to stderr in one write(2), so that
/// lines of several ranks sharing stderr never interleave; the rank is named when the process
/// runs under an MPI launcher with more than one rank. `message` is made printable.
void printErrorLine(std::string_view kind, std::string_view message);

}  // namespace fcp::app
