#include "fcp/core/input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "fcp/core/error.h"

namespace fcp {
namespace {

/// Length of the valid UTF-8 sequence starting at text[i] (2 to 4), or 0 if there is none.
size_t utf8SequenceLength(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;   // no overlong forms
    if (lead == 0xED) high = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;  // nothing past U+10FFFF
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  if (byte(i + 1) < low || byte(i + 1) > high) return 0;
  for (size_t k = 2; k < length; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return length;
}

std::string hexEscape(unsigned char c) {
  char buffer[8];
  std::snprintf(buffer, sizeof buffer, "\\x%02X", c);
  return buffer;
}

std::string escapeFor(unsigned char c) {
  switch (c) {
    case '\0':
      return "\\0";
    case '\n':
      return "\\n";
    case '\r':
      return "\\r";
    case '\t':
      return "\\t";
    default:
      return hexEscape(c);
  }
}

[[noreturn]] void failParse(std::string_view text, std::string_view what, const std::string& expected) {
  throwInvalidArgument("invalid ", what, " '", printable(text), "': expected ", expected);
}

std::string describeFileType(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace

std::string printable(std::string_view text, size_t maxChars) {
  std::string out;
  size_t columns = 0;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    std::string piece;
    size_t consumed = 1;
    if (c >= 0x20 && c < 0x7F) {
      piece.assign(1, static_cast<char>(c));
    } else if (c < 0x80) {
      piece = escapeFor(c);
    } else if (const size_t n = utf8SequenceLength(text, i); n == 0) {
      piece = hexEscape(c);
    } else if (text.substr(i, n) == "\xEF\xBB\xBF") {
      piece = "\\uFEFF";  // an invisible byte-order mark
      consumed = n;
    } else {
      piece.assign(text.substr(i, n));
      consumed = n;
    }
    const size_t width = c >= 0x80 && piece.size() == consumed ? 1 : piece.size();
    if (columns + width > maxChars) {
      out += "...";
      return out;
    }
    out += piece;
    columns += width;
    i += consumed;
  }
  return out;
}

int64_t parseInteger(std::string_view text, std::string_view what, int64_t min, int64_t max) {
  std::ostringstream expected;
  expected << "an integer from " << min << " to " << max;
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ptr != end || ec != std::errc() || value < min || value > max) {
    failParse(text, what, expected.str());
  }
  return value;
}

uint64_t parseUnsigned(std::string_view text, std::string_view what, uint64_t max) {
  std::ostringstream expected;
  expected << "an integer from 0 to " << max;
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  // from_chars takes no sign for unsigned types, so "-1" stops at once and is refused.
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ptr != end || ec != std::errc() || value > max) {
    failParse(text, what, expected.str());
  }
  return value;
}

double parseNumber(std::string_view text, std::string_view what, double min, double max) {
  std::ostringstream expected;
  expected << "a finite number from " << min << " to " << max;
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ptr != end || ec != std::errc() || !std::isfinite(value) || value < min ||
      value > max) {
    failParse(text, what, expected.str());
  }
  return value;
}

std::string readUserFile(const std::string& path, std::string_view what, int64_t maxBytes) {
  const std::string shown = printable(path);
  // O_NONBLOCK: opening a FIFO that has no writer returns at once instead of waiting.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    throwInvalidArgument("cannot read ", what, " '", shown, "': ", std::strerror(errno));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throwInvalidArgument("cannot read ", what, " '", shown, "': ", std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    throwInvalidArgument("cannot read ", what, " '", shown, "': it is ",
                         describeFileType(st.st_mode), ", expected a regular file");
  }
  if (st.st_size > maxBytes) {
    throwInvalidArgument(what, " '", shown, "' is ", st.st_size, " bytes: expected at most ",
                         maxBytes);
  }
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throwInvalidArgument("cannot read ", what, " '", shown, "': ", std::strerror(errno));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > maxBytes) {  // it grew while we read
      throwInvalidArgument(what, " '", shown, "' is over ", maxBytes, " bytes: expected at most ",
                           maxBytes);
    }
  }
  return text;
}

void checkOutputPath(const std::string& path, std::string_view what) {
  const std::string shown = printable(path);
  if (path.empty()) throwInvalidArgument("empty ", what, " path: expected a file name");
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT)
      throwInvalidArgument("cannot write ", what, " '", shown, "': ", std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    throwInvalidArgument("cannot write ", what, " '", shown, "': it is ",
                         describeFileType(st.st_mode),
                         ", expected a regular file or a new path");
  }
  // The file is written through a temporary beside it (writeUserFile), so its directory must
  // exist and take new files: checked now, not after the work whose result it is for.
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat dirSt {};
  if (::stat(dir.c_str(), &dirSt) != 0) {
    throwInvalidArgument("cannot write ", what, " '", shown, "': its directory '", printable(dir),
                         "': ", std::strerror(errno), ", expected an existing directory");
  }
  if (!S_ISDIR(dirSt.st_mode)) {
    throwInvalidArgument("cannot write ", what, " '", shown, "': '", printable(dir), "' is ",
                         describeFileType(dirSt.st_mode), ", expected a directory");
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throwInvalidArgument("cannot write ", what, " '", shown, "': its directory '", printable(dir),
                         "': ", std::strerror(errno));
  }
}

void checkNotAnInput(const std::string& path, std::string_view what,
                     std::initializer_list<std::pair<std::string_view, std::string_view>> inputs) {
  struct stat out {};
  if (::stat(path.c_str(), &out) != 0) return;  // a new file is no input
  for (const auto& [input, flag] : inputs) {
    struct stat in {};
    if (input.empty() || ::stat(std::string(input).c_str(), &in) != 0) continue;
    if (in.st_dev == out.st_dev && in.st_ino == out.st_ino) {
      throwInvalidArgument("cannot write ", what, " '", printable(path), "': it is the ", flag,
                           " file, expected another path");
    }
  }
}

void writeUserFile(const std::string& path, std::string_view what, std::string_view text) {
  checkOutputPath(path, what);
  const std::string shown = printable(path);
  std::string tmp = path + ".XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) throwInvalidArgument("cannot write ", what, " '", shown, "': ", std::strerror(errno));
  ::fchmod(fd, 0644);  // mkstemp makes it private; the output is an ordinary file
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  const bool ok = written == text.size() && ::fsync(fd) == 0;
  const bool closed = ::close(fd) == 0;
  std::error_code ec;
  if (ok && closed) std::filesystem::rename(tmp, path, ec);
  if (!ok || !closed || ec) {
    std::remove(tmp.c_str());
    throwInvalidArgument("cannot write ", what, " '", shown, "'");
  }
}

void checkJsonDepth(std::string_view text, std::string_view source) {
  int depth = 0;
  bool inString = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (inString) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        inString = false;
      }
    } else if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        throwInvalidArgument(source, ": JSON nests arrays and objects more than ", kMaxJsonDepth,
                             " deep (at byte ", i, "): expected at most ", kMaxJsonDepth);
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

}  // namespace fcp
