#include "fcp/core/units.h"

#include <gtest/gtest.h>

#include "fcp/core/error.h"

namespace fcp {
namespace {

TEST(UnitsTest, ParsesPlainAndSuffixedCounts) {
  EXPECT_EQ(parseTokenCount("4096", "x"), 4096);
  EXPECT_EQ(parseTokenCount("4K", "x"), 4096);
  EXPECT_EQ(parseTokenCount("4k", "x"), 4096);
  EXPECT_EQ(parseTokenCount("512K", "x"), 512 * 1024);
  EXPECT_EQ(parseTokenCount("1M", "x"), 1024 * 1024);
  EXPECT_EQ(parseTokenCount("2G", "x"), int64_t{2} << 30);
  EXPECT_EQ(parseTokenCount("9223372036854775807", "x"), INT64_MAX);
}

TEST(UnitsTest, RejectsAnythingElseNamingTheValue) {
  for (const char* bad : {"", "K", "0", "0K", "-4", "4Q", "4.5K", " 4", "4KK", "1e3",
                          "9223372036854775808", "9007199254740993K"}) {
    try {
      parseTokenCount(bad, "--block-size");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("--block-size '" + std::string(bad) + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(UnitsTest, FormatsCompactly) {
  EXPECT_EQ(formatTokenCount(4096), "4K");
  EXPECT_EQ(formatTokenCount(1536), "1536");
  EXPECT_EQ(formatTokenCount(1 << 20), "1M");
  EXPECT_EQ(formatTokenCount(int64_t{1} << 30), "1G");  // it was "1024M"
  EXPECT_EQ(formatTokenCount(int64_t{3} << 31), "6G");
  EXPECT_EQ(formatTokenCount((int64_t{1} << 30) + (int64_t{1} << 20)), "1025M");
  EXPECT_EQ(formatTokenCount(7), "7");
}

}  // namespace
}  // namespace fcp
