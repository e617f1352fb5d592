#pragma once
/// Input a user hands FCP: numbers typed as flags, files to read, paths to write. Every
/// function here either returns a value inside the range it was asked for or throws
/// Error(kInvalidArgument) with one printable line naming the value and what was expected.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

namespace fcp {

/// Longest piece of user text a message echoes; longer text is cut and ends in "...".
inline constexpr size_t kMaxEchoedChars = 80;

/// `text` made printable for a one-line message: bytes below 0x20, DEL and bytes that are not
/// part of valid UTF-8 print as \xNN (\n, \r, \t and \0 as such), a byte-order mark as
/// \uFEFF; text past `maxChars` printable characters is cut and ends in "...".
std::string printable(std::string_view text, size_t maxChars = kMaxEchoedChars);

/// A signed integer in [min, max], written in decimal with an optional leading '-'. Rejects
/// empty text, spaces, signs other than one leading '-', trailing junk and values past int64
/// or outside the range. `what` names the value in the message ("--workers").
int64_t parseInteger(std::string_view text, std::string_view what, int64_t min, int64_t max);

/// An unsigned integer in [0, max]; rejects a '-' sign (so "-1" is not 2^64 - 1).
uint64_t parseUnsigned(std::string_view text, std::string_view what, uint64_t max);

/// A finite decimal number in [min, max] ("0.1", "1e-3"); rejects empty text, junk, inf and
/// nan, and values outside the range.
double parseNumber(std::string_view text, std::string_view what, double min, double max);

/// Largest file FCP reads for each kind of input (bytes).
inline constexpr int64_t kMaxTraceFileBytes = int64_t{256} << 20;
inline constexpr int64_t kMaxPlanFileBytes = int64_t{1} << 30;
inline constexpr int64_t kMaxSmallJsonFileBytes = int64_t{16} << 20;  ///< curves, hardware

/// The whole content of the regular file `path`. Refuses directories, FIFOs, sockets and
/// devices without blocking on them (so a FIFO with no writer cannot hang the reader), and
/// files over `maxBytes`. `what` names the input in the message ("--plan-in file").
std::string readUserFile(const std::string& path, std::string_view what, int64_t maxBytes);

/// Throws unless `path` names a regular file or nothing yet (a path FCP may create or
/// replace): a symlink, FIFO, device, socket or directory there is refused, so writing never
/// replaces something that is not an ordinary file; and its directory must exist and take new
/// files, so a command refuses a bad path before its work rather than after.
void checkOutputPath(const std::string& path, std::string_view what);

/// Throws when `path` already names the same file as one of `inputs` (a path and the flag that
/// gave it; empty paths and paths that name nothing are skipped): writing the output would
/// replace an input the command was given (`fcp plan --trace t.txt --plan-out t.txt`).
void checkNotAnInput(const std::string& path, std::string_view what,
                     std::initializer_list<std::pair<std::string_view, std::string_view>> inputs);

/// Writes `text` to `path` through a uniquely named temporary file in the same directory,
/// renamed into place, so a failure never leaves a half-written file. Checks the target with
/// checkOutputPath first.
void writeUserFile(const std::string& path, std::string_view what, std::string_view text);

/// Deepest nesting of arrays and objects FCP accepts in a JSON file (a plan needs 4).
inline constexpr int kMaxJsonDepth = 64;

/// Throws unless the JSON `text` nests arrays and objects at most kMaxJsonDepth deep (strings
/// are skipped). Run before handing text to a recursive parser. `source` names the file.
void checkJsonDepth(std::string_view text, std::string_view source);

}  // namespace fcp
