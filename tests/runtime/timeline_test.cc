// chromeTrace and gatherChromeTrace: every rank's spans reach rank 0 as Chrome-trace JSON, and a
// rank whose spans are over the limit fails the gather on both ends without leaving a message
// behind (a later gather on the same transport used to receive the refused rank's old text).
#include "fcp/runtime/timeline.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fcp/core/error.h"
#include "thread_transport.h"

namespace fcp::runtime {
namespace {

using testing::runRanks;
using testing::ThreadTransport;

/// Rank r's spans: r + 1 of them, named so that JSON must escape them, starting at 1000 + 10 r µs.
Timeline spansOf(int rank, int count) {
  Timeline t;
  for (int i = 0; i < count; ++i) {
    const double start = 1000.0 + 10.0 * rank + i;
    t.add("pair \"" + std::to_string(rank) + "\\" + std::to_string(i) + "\"", i % 3, start,
          start + 0.5 + i);
  }
  return t;
}

TEST(GatherChromeTraceTest, EveryRanksSpansReachRankZeroFromTheEarliestSpan) {
  constexpr int kRanks = 3;
  std::string trace;
  runRanks(kRanks, [&](ThreadTransport& t) {
    std::string out = gatherChromeTrace(t, spansOf(t.rank(), t.rank() + 1));
    if (t.rank() == 0) {
      trace = std::move(out);
    } else {
      EXPECT_EQ(out, "");
    }
  });
  const nlohmann::json json = nlohmann::json::parse(trace);
  int spans = 0;
  std::vector<int> laneNames(kRanks, 0), processNames(kRanks, 0);
  for (const nlohmann::json& e : json.at("traceEvents")) {
    const int rank = e.at("pid").get<int>();
    ASSERT_GE(rank, 0);
    ASSERT_LT(rank, kRanks);
    if (e.at("ph") == "M") {
      (e.at("name") == "thread_name" ? laneNames : processNames)[static_cast<size_t>(rank)]++;
      continue;
    }
    // Each span, found again among the rank's own: name, lane, start less the earliest start
    // of any rank (rank 0's first, 1000 µs), duration.
    ASSERT_EQ(e.at("ph"), "X");
    const Timeline mine = spansOf(rank, rank + 1);
    bool found = false;
    for (const Span& s : mine.spans()) {
      if (s.name != e.at("name").get<std::string>()) continue;
      found = true;
      EXPECT_EQ(e.at("tid").get<int>(), s.lane);
      EXPECT_DOUBLE_EQ(e.at("ts").get<double>(), s.startUs - 1000.0);
      EXPECT_DOUBLE_EQ(e.at("dur").get<double>(), s.durationUs);
    }
    EXPECT_TRUE(found) << e.dump();
    ++spans;
  }
  EXPECT_EQ(spans, 1 + 2 + 3);
  EXPECT_EQ(laneNames, std::vector<int>(kRanks, 3));
  EXPECT_EQ(processNames, std::vector<int>(kRanks, 1));
}

TEST(ChromeTraceTest, IsWhatTheGatherWritesAndNamesItsProcesses) {
  // The gather's trace is chromeTrace of the ranks' spans as they were serialised; fcp simulate
  // writes its workers' spans with it.
  std::string gathered;
  runRanks(2, [&](ThreadTransport& t) {
    std::string out = gatherChromeTrace(t, spansOf(t.rank(), t.rank() + 1));
    if (t.rank() == 0) gathered = std::move(out);
  });
  const std::vector<std::vector<Span>> spans{spansOf(0, 1).spans(), spansOf(1, 2).spans()};
  EXPECT_EQ(chromeTrace(spans, "rank"), gathered);
  std::vector<std::string> names;
  const nlohmann::json json = nlohmann::json::parse(chromeTrace(spans, "worker"));
  for (const nlohmann::json& e : json.at("traceEvents"))
    if (e.at("name") == "process_name") names.push_back(e.at("args").at("name"));
  EXPECT_EQ(names, (std::vector<std::string>{"worker 0", "worker 1"}));
  EXPECT_THROW(chromeTrace({{Span{"x", 3, 0, 1}}}, "worker"), Error);
}

TEST(GatherChromeTraceTest, ATimelineOverTheLimitLeavesNoMessageBehind) {
  // Rank 1's 40 spans are well over 200 bytes, the others' one span each under it.
  constexpr int64_t kLimit = 200;
  std::vector<std::string> errors(3);
  std::string second;
  runRanks(3, [&](ThreadTransport& t) {
    const int r = t.rank();
    try {
      gatherChromeTrace(t, spansOf(r, r == 1 ? 40 : 1), kLimit);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      errors[static_cast<size_t>(r)] = e.what();
    }
    // The same transport again: rank 0 must see these spans, not rank 1's refused ones.
    std::string out = gatherChromeTrace(t, spansOf(r, 1), kLimit);
    if (r == 0) second = std::move(out);
  });
  EXPECT_NE(errors[0].find("rank 1's timeline is "), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find(" bytes: expected 0 to 200"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], errors[0]);
  EXPECT_EQ(errors[2], "");
  const nlohmann::json json = nlohmann::json::parse(second);
  int spans = 0;
  for (const nlohmann::json& e : json.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    ++spans;
    const int rank = e.at("pid").get<int>();
    EXPECT_EQ(e.at("name").get<std::string>(), spansOf(rank, 1).spans()[0].name);
  }
  EXPECT_EQ(spans, 3);
}

TEST(GatherChromeTraceTest, LimitsThatDifferOrAreOutOfRangeAreNamedOnRankZero) {
  // Rank 1's limit is larger than rank 0's, rank 2's out of range: rank 1 sends its text (it is
  // within its own limit) and returns; rank 2 sends its size alone and throws; rank 0 receives
  // everything sent and throws naming rank 1. A second gather on the same transport is whole.
  std::vector<std::string> errors(3);
  std::string second;
  runRanks(3, [&](ThreadTransport& t) {
    const int r = t.rank();
    const int64_t limit = r == 0 ? 200 : r == 1 ? 100000 : -5;
    try {
      gatherChromeTrace(t, spansOf(r, r == 1 ? 40 : 1), limit);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      errors[static_cast<size_t>(r)] = e.what();
    }
    std::string out = gatherChromeTrace(t, spansOf(r, 1), 200);
    if (r == 0) second = std::move(out);
  });
  EXPECT_NE(errors[0].find("rank 1's maxBytesPerRank is 100000: expected 0 to 1073741824, the "
                           "same on every rank (rank 0's is 200)"),
            std::string::npos)
      << errors[0];
  EXPECT_EQ(errors[1], "");
  EXPECT_NE(errors[2].find("rank 2's maxBytesPerRank is -5"), std::string::npos) << errors[2];
  const nlohmann::json json = nlohmann::json::parse(second);
  int spans = 0;
  for (const nlohmann::json& e : json.at("traceEvents")) spans += e.at("ph") == "X";
  EXPECT_EQ(spans, 3);
}

TEST(GatherChromeTraceTest, ALimitOutOfRangeIsNamed) {
  runRanks(1, [&](ThreadTransport& t) {
    for (const int64_t limit : {int64_t{-1}, kMaxTraceBytes + 1}) {
      try {
        gatherChromeTrace(t, spansOf(0, 1), limit);
        ADD_FAILURE() << "limit " << limit << " accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
        EXPECT_NE(std::string(e.what()).find("maxBytesPerRank is " + std::to_string(limit)),
                  std::string::npos)
            << e.what();
      }
    }
  });
}

}  // namespace
}  // namespace fcp::runtime
