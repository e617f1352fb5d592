#include "fcp/core/statistics.h"

#include <gtest/gtest.h>

#include <vector>

namespace fcp {
namespace {

TEST(ImbalanceTest, IsMaxMinusMeanOverMax) {
  EXPECT_DOUBLE_EQ(imbalance(std::vector<double>{1, 2, 3, 6}), 0.5);  // mean 3, max 6
  EXPECT_DOUBLE_EQ(imbalance(std::vector<int64_t>{1, 2, 3, 6}), 0.5);
  EXPECT_DOUBLE_EQ(imbalance(std::vector<double>{0.5, 1.5}), 0.5 / 1.5);
}

TEST(ImbalanceTest, ZeroForEvenLoadsAndOneMinusOneOverNForOneBusyWorker) {
  EXPECT_EQ(imbalance(std::vector<double>{7, 7, 7}), 0);
  EXPECT_EQ(imbalance(std::vector<int64_t>{4}), 0);
  EXPECT_DOUBLE_EQ(imbalance(std::vector<double>{0, 0, 0, 8}), 0.75);
  EXPECT_DOUBLE_EQ(imbalance(std::vector<int64_t>{0, 5}), 0.5);
}

TEST(ImbalanceTest, ZeroWithoutWorkersOrLoad) {
  EXPECT_EQ(imbalance(std::vector<double>{}), 0);
  EXPECT_EQ(imbalance(std::vector<int64_t>{}), 0);
  EXPECT_EQ(imbalance(std::vector<double>{0, 0}), 0);
  EXPECT_EQ(imbalance(std::vector<int64_t>{0, 0, 0}), 0);
}

TEST(MedianTest, MiddleValueOrTheUpperOfTheTwoMiddleOnes) {
  EXPECT_EQ(median({5, 1, 3}), 3);
  EXPECT_EQ(median({4, 1, 3, 2}), 3);  // a measured value, not the mean of 2 and 3
  EXPECT_EQ(median({7}), 7);
  EXPECT_EQ(median({2, 2, 9, 2}), 2);
}

TEST(MedianTest, ZeroForNone) { EXPECT_EQ(median({}), 0); }

}  // namespace
}  // namespace fcp
