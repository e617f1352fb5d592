#pragma once
/// Token counts as users write them: 4096, 4K, 512K, 1M.

#include <cstdint>
#include <string>
#include <string_view>

namespace fcp {

/// Parses a positive token count with an optional binary suffix K (2^10), M (2^20) or G (2^30),
/// case-insensitive: "4K" = 4096. `what` names the value in the error message.
/// Throws Error(kInvalidArgument) for anything else, zero, or a value past int64.
int64_t parseTokenCount(std::string_view text, std::string_view what);

/// Formats a token count compactly, as parseTokenCount reads it: 4096 -> "4K", 1536 -> "1536",
/// 1048576 -> "1M", 2^30 -> "1G".
std::string formatTokenCount(int64_t numTokens);

}  // namespace fcp
