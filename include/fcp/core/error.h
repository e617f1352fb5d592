#pragma once
/// The one error hierarchy of FCP's public API, and the checks that raise it.

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace fcp {

/// What kind of failure an `Error` reports.
enum class ErrorCode {
  kInvalidArgument,  ///< bad input from the user: flags, files, sizes
  kInvalidPlan,      ///< a plan that breaks an invariant of `validate`
  kTransport,        ///< communication failed (a peer died, MPI reported an error, a wait
                     ///< timed out), or a transport can no longer be used: messages of an
                     ///< earlier call may still arrive on it (a new one is needed)
  kInternal,         ///< a bug in FCP
};

/// Name of an error code, for messages.
std::string_view errorCodeName(ErrorCode code);

/// Longest message an Error carries, in printable characters.
inline constexpr size_t kMaxErrorMessageChars = 1024;

namespace detail {
/// `message` as one printable line: control bytes (NUL and newlines too), a byte-order mark
/// and bytes that are not UTF-8 escaped, cut after kMaxErrorMessageChars.
std::string oneLine(const std::string& message);
}  // namespace detail

/// Root of every exception FCP throws. `what()` is one printable line, whatever bytes of user
/// input the message echoes.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(detail::oneLine(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

/// Throws Error(kInvalidArgument) with the concatenation of `parts`.
template <typename... Parts>
[[noreturn]] void throwInvalidArgument(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(ErrorCode::kInvalidArgument, os.str());
}

namespace detail {
template <typename... Parts>
[[noreturn]] void failCheck(const char* file, int line, const char* expr, const Parts&... parts) {
  std::ostringstream os;
  os << file << ":" << line << ": check failed: " << expr;
  if constexpr (sizeof...(parts) > 0) {
    os << ": ";
    (os << ... << parts);
  }
  throw Error(ErrorCode::kInternal, os.str());
}
}  // namespace detail

}  // namespace fcp

/// Checks an internal invariant (a bug if it fails); reports file:line and the message parts.
#define FCP_CHECK(cond, ...)                                                      \
  do {                                                                            \
    if (!(cond)) ::fcp::detail::failCheck(__FILE__, __LINE__, #cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)

/// Checks a == b and prints both values when they differ.
#define FCP_CHECK_EQ(a, b)                                                               \
  do {                                                                                   \
    const auto& fcp_check_a_ = (a);                                                      \
    const auto& fcp_check_b_ = (b);                                                      \
    if (!(fcp_check_a_ == fcp_check_b_))                                                 \
      ::fcp::detail::failCheck(__FILE__, __LINE__, #a " == " #b, fcp_check_a_, " vs ", \
                               fcp_check_b_);                                            \
  } while (0)

#ifdef NDEBUG
#define FCP_DCHECK(cond, ...) \
  do {                        \
  } while (0)
#else
#define FCP_DCHECK(cond, ...) FCP_CHECK(cond __VA_OPT__(, ) __VA_ARGS__)
#endif
