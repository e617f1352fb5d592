// Chrome-trace output: every rank's spans gathered on rank 0 as length-prefixed text.
#include "fcp/runtime/timeline.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "fcp/core/error.h"

namespace fcp::runtime {
namespace {

constexpr int kTraceSizeTag = 3;
constexpr int kTraceTextTag = 4;
constexpr const char* kLaneNames[] = {"compute", "communication", "pass"};

std::string escapeJson(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {  // a control character: \u00XX
      char code[8];
      std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(c));
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

// One line per span: lane, start, duration, name.
std::string serialize(const Timeline& timeline) {
  std::ostringstream os;
  os.precision(17);
  for (const Span& s : timeline.spans()) os << s.lane << ' ' << s.startUs << ' ' << s.durationUs << ' ' << s.name << '\n';
  return os.str();
}

}  // namespace

std::string gatherChromeTrace(Transport& transport, const Timeline& timeline,
                              int64_t maxBytesPerRank) {
  const auto validLimit = [](int64_t limit) { return limit >= 0 && limit <= kMaxTraceBytes; };
  const std::string mine = serialize(timeline);
  // Message buffers in vectors (a move keeps their storage), kept for good by the guard when a
  // wait times out with a message still posted into or out of them.
  std::vector<int64_t> head{static_cast<int64_t>(mine.size()), maxBytesPerRank};  // size, limit
  std::vector<char> text;
  const PendingGuard guard(transport, [&] {
    keepForever(head);
    keepForever(text);
  });
  // Each rank sends its size and its limit, then its text only where the limit is valid and the
  // size within it; rank 0 knows from the two whether a text follows, receives every message of
  // every rank, and only then throws. So no message is left behind, whatever a rank passed.
  const auto textFollows = [&](int64_t size, int64_t limit) {
    return validLimit(limit) && size >= 0 && size <= limit;
  };
  const auto badLimit = [&](int rank, int64_t limit) {
    return Error(ErrorCode::kInvalidArgument,
                 "gatherChromeTrace: rank " + std::to_string(rank) + "'s maxBytesPerRank is " +
                     std::to_string(limit) + ": expected 0 to " + std::to_string(kMaxTraceBytes) +
                     ", the same on every rank (rank 0's is " + std::to_string(maxBytesPerRank) +
                     ")");
  };
  const auto tooLarge = [&](int rank, int64_t size, int64_t limit) {
    return Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) + "'s timeline is " +
                                                  std::to_string(size) + " bytes: expected 0 to " +
                                                  std::to_string(limit));
  };
  if (transport.rank() != 0) {
    transport.wait(transport.isend(0, kTraceSizeTag, std::as_bytes(std::span(head))));
    if (!validLimit(maxBytesPerRank)) throw badLimit(transport.rank(), maxBytesPerRank);
    if (!textFollows(head[0], maxBytesPerRank))
      throw tooLarge(transport.rank(), head[0], maxBytesPerRank);
    text.assign(mine.begin(), mine.end());
    transport.wait(transport.isend(0, kTraceTextTag, std::as_bytes(std::span(text))));
    return {};
  }
  std::vector<std::string> texts{mine};
  std::optional<Error> refused;
  if (!validLimit(maxBytesPerRank)) {
    refused = badLimit(0, maxBytesPerRank);
  } else if (!textFollows(head[0], maxBytesPerRank)) {
    refused = tooLarge(0, head[0], maxBytesPerRank);
  }
  for (int r = 1; r < transport.size(); ++r) {
    transport.wait(transport.irecv(r, kTraceSizeTag, std::as_writable_bytes(std::span(head))));
    const int64_t size = head[0], limit = head[1];
    if (textFollows(size, limit)) {
      text.assign(static_cast<size_t>(size), '\0');
      transport.wait(transport.irecv(r, kTraceTextTag, std::as_writable_bytes(std::span(text))));
      texts.emplace_back(text.begin(), text.end());
    }
    if (refused) continue;
    if (!validLimit(limit) || limit != maxBytesPerRank) {
      refused = badLimit(r, limit);
    } else if (!textFollows(size, limit)) {
      refused = tooLarge(r, size, limit);
    }
  }
  if (refused) throw *refused;
  std::vector<std::vector<Span>> ranks(texts.size());
  for (size_t r = 0; r < texts.size(); ++r) {
    std::istringstream in(texts[r]);
    Span span;
    while (in >> span.lane >> span.startUs >> span.durationUs) {
      in.get();
      std::getline(in, span.name);
      ranks[r].push_back(span);
    }
  }
  return chromeTrace(ranks, "rank");
}

std::string chromeTrace(const std::vector<std::vector<Span>>& processes,
                        std::string_view processName) {
  double origin = std::numeric_limits<double>::infinity();
  for (const auto& spans : processes)
    for (const Span& s : spans) origin = std::min(origin, s.startUs);
  std::ostringstream os;
  os.precision(12);
  os << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (size_t r = 0; r < processes.size(); ++r) {
    for (int lane = 0; lane < 3; ++lane) {
      os << (first ? "" : ",") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << r << ",\"tid\":" << lane
         << ",\"args\":{\"name\":\"" << kLaneNames[lane] << "\"}}";
      first = false;
    }
    os << ",{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << r << ",\"args\":{\"name\":\""
       << escapeJson(std::string(processName)) << ' ' << r << "\"}}";
  }
  for (size_t r = 0; r < processes.size(); ++r) {
    for (const Span& s : processes[r]) {
      FCP_CHECK(s.lane >= 0 && s.lane < 3, "a span in lane ", s.lane, ": expected 0, 1 or 2");
      os << ",{\"name\":\"" << escapeJson(s.name) << "\",\"cat\":\"" << kLaneNames[s.lane]
         << "\",\"ph\":\"X\",\"pid\":" << r << ",\"tid\":" << s.lane
         << ",\"ts\":" << s.startUs - origin << ",\"dur\":" << s.durationUs << "}";
    }
  }
  os << "]}";
  return os.str();
}

}  // namespace fcp::runtime
