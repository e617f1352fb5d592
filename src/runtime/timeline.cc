// Chrome-trace output: every rank's spans gathered on rank 0 as length-prefixed text.
#include "fcp/runtime/timeline.h"

#include <algorithm>
#include <limits>
#include <sstream>

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

std::string gatherChromeTrace(Transport& transport, const Timeline& timeline) {
  const std::string mine = serialize(timeline);
  if (transport.rank() != 0) {
    int64_t size = static_cast<int64_t>(mine.size());
    transport.wait(transport.isend(0, kTraceSizeTag, std::as_bytes(std::span(&size, 1))));
    transport.wait(transport.isend(0, kTraceTextTag, std::as_bytes(std::span(mine.data(), mine.size()))));
    return {};
  }
  std::vector<std::string> texts{mine};
  for (int r = 1; r < transport.size(); ++r) {
    int64_t size = 0;
    transport.wait(transport.irecv(r, kTraceSizeTag, std::as_writable_bytes(std::span(&size, 1))));
    std::string text(static_cast<size_t>(size), '\0');
    transport.wait(transport.irecv(r, kTraceTextTag, std::as_writable_bytes(std::span(text.data(), text.size()))));
    texts.push_back(std::move(text));
  }
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
