// validate's sentence collector: appending another collector's sentences gives what adding
// them in turn gives, on both sides of the 50 reported (the rest counted in the last line).
#include "violations.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace fcp::plan::detail {
namespace {

TEST(ViolationsTest, AppendingIsAddingInTurn) {
  for (const int first : {0, 1, 30, 49, 50, 51, 70}) {
    for (const int second : {0, 1, 5, 60}) {
      Violations appended, later, inTurn;
      for (int i = 0; i < first; ++i) {
        appended.add("first ", i);
        inTurn.add("first ", i);
      }
      for (int i = 0; i < second; ++i) {
        later.add("second ", i);
        inTurn.add("second ", i);
      }
      appended.append(std::move(later));
      EXPECT_EQ(appended.empty(), first + second == 0);
      const std::vector<std::string> got = appended.take();
      EXPECT_EQ(got, inTurn.take()) << first << " then " << second;
      EXPECT_EQ(got.size(), static_cast<size_t>(first + second > 50 ? 51 : first + second));
    }
  }
}

}  // namespace
}  // namespace fcp::plan::detail
