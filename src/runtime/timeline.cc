// Chrome-trace output: every rank's spans gathered on rank 0 as length-prefixed text.
#include "fcp/runtime/timeline.h"

#include <algorithm>
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
    if (c == '"' || c == '\\') out += '\\';
    out += c;
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
  if (maxBytesPerRank < 0 || maxBytesPerRank > kMaxTraceBytes) {
    throwInvalidArgument("gatherChromeTrace: maxBytesPerRank is ", maxBytesPerRank,
                         ": expected 0 to ", kMaxTraceBytes);
  }
  const std::string mine = serialize(timeline);
  const auto tooLarge = [&](int rank, int64_t bytes) {
    return Error(ErrorCode::kTransport, "rank " + std::to_string(rank) + "'s timeline is " +
                                            std::to_string(bytes) + " bytes: expected 0 to " +
                                            std::to_string(maxBytesPerRank));
  };
  // Message buffers in vectors (a move keeps their storage), kept for good by the guard when a
  // wait times out with a message still posted into or out of them.
  std::vector<int64_t> size(1, static_cast<int64_t>(mine.size()));
  std::vector<char> text;
  const PendingGuard guard(transport, [&] {
    keepForever(size);
    keepForever(text);
  });
  // A size out of range is sent without its text, so that no message is left behind: every
  // rank's size is received, and only the texts of the sizes in range follow them.
  if (transport.rank() != 0) {
    transport.wait(transport.isend(0, kTraceSizeTag, std::as_bytes(std::span(size))));
    if (size[0] > maxBytesPerRank) throw tooLarge(transport.rank(), size[0]);
    text.assign(mine.begin(), mine.end());
    transport.wait(transport.isend(0, kTraceTextTag, std::as_bytes(std::span(text))));
    return {};
  }
  std::vector<std::string> texts{mine};
  std::optional<Error> refused;
  if (size[0] > maxBytesPerRank) refused = tooLarge(0, size[0]);
  for (int r = 1; r < transport.size(); ++r) {
    transport.wait(transport.irecv(r, kTraceSizeTag, std::as_writable_bytes(std::span(size))));
    if (size[0] < 0 || size[0] > maxBytesPerRank) {
      if (!refused) refused = tooLarge(r, size[0]);
      continue;
    }
    text.assign(static_cast<size_t>(size[0]), '\0');
    transport.wait(transport.irecv(r, kTraceTextTag, std::as_writable_bytes(std::span(text))));
    texts.emplace_back(text.begin(), text.end());
  }
  if (refused) throw *refused;
  struct Event {
    int rank, lane;
    double start, duration;
    std::string name;
  };
  std::vector<Event> events;
  double origin = std::numeric_limits<double>::infinity();
  for (size_t r = 0; r < texts.size(); ++r) {
    std::istringstream in(texts[r]);
    Event e{static_cast<int>(r), 0, 0, 0, {}};
    while (in >> e.lane >> e.start >> e.duration) {
      in.get();
      std::getline(in, e.name);
      origin = std::min(origin, e.start);
      events.push_back(e);
    }
  }
  std::ostringstream os;
  os.precision(12);
  os << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (int r = 0; r < transport.size(); ++r) {
    for (int lane = 0; lane < 3; ++lane) {
      os << (first ? "" : ",") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << r << ",\"tid\":" << lane
         << ",\"args\":{\"name\":\"" << kLaneNames[lane] << "\"}}";
      first = false;
    }
    os << ",{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << r << ",\"args\":{\"name\":\"rank " << r << "\"}}";
  }
  for (const Event& e : events) {
    os << ",{\"name\":\"" << escapeJson(e.name) << "\",\"cat\":\"" << kLaneNames[e.lane]
       << "\",\"ph\":\"X\",\"pid\":" << e.rank << ",\"tid\":" << e.lane << ",\"ts\":" << e.start - origin
       << ",\"dur\":" << e.duration << "}";
  }
  os << "]}";
  return os.str();
}

}  // namespace fcp::runtime
