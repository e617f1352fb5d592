// Loading kernel-efficiency curves for planning: from `fcp bench kernel --curve-out` files and
// from hardware profiles, and the errors for anything else.
#include "fcp/sim/hardware.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/stat.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <string>

#include "fcp/core/error.h"
#include "fcp/plan/plan.h"
#include "../common/error_of.h"

namespace fcp::sim {
namespace {

using fcp::testing::errorOf;

// A file in the temp directory, named for this process so that concurrent test runs (ctest -j,
// two checkouts on one machine) do not share it.
std::string writeTemp(const std::string& name, const std::string& text) {
  const std::string unique = std::to_string(::getpid()) + "_" + name;
  const std::string path = (std::filesystem::temp_directory_path() / unique).string();
  std::ofstream(path) << text;
  return path;
}

TEST(EfficiencyCurvesTest, ABenchCurveFileGivesItsPoints) {
  const std::string path =
      writeTemp("fcp_curve_test.json",
                R"({"kind": "fcp-efficiency-curve", "device": "x", "peak_gflops": 80,)"
                R"( "forward": [[256, 0.5], [1024, 0.8]], "backward": [[256, 0.4], [1024, 0.9]]})");
  const auto [forward, backward] = loadEfficiencyCurves(path);
  EXPECT_DOUBLE_EQ(forward.at(256), 0.5);
  EXPECT_DOUBLE_EQ(forward.at(1024), 0.8);
  EXPECT_DOUBLE_EQ(backward.at(256), 0.4);
  EXPECT_DOUBLE_EQ(backward.at(1024), 0.9);
  std::filesystem::remove(path);
}

TEST(EfficiencyCurvesTest, WithoutABackwardCurveTheForwardOneServesBoth) {
  const std::string path = writeTemp(
      "fcp_curve_fwd_only.json", R"({"kind": "fcp-efficiency-curve", "forward": [[512, 0.6]]})");
  const auto [forward, backward] = loadEfficiencyCurves(path);
  EXPECT_DOUBLE_EQ(backward.at(512), forward.at(512));
  std::filesystem::remove(path);
}

TEST(EfficiencyCurvesTest, AHardwareProfileGivesItsCurves) {
  const HardwareProfile cpu = loadHardwareProfile("cpu");
  const auto [forward, backward] = loadEfficiencyCurves("cpu");
  for (const int64_t tokens : {256, 1024, 4096}) {
    EXPECT_DOUBLE_EQ(forward.at(tokens), cpu.forward.at(tokens));
    EXPECT_DOUBLE_EQ(backward.at(tokens), cpu.backward.at(tokens));
  }
}

TEST(EfficiencyCurvesTest, OtherFilesAreRejectedByName) {
  const std::string other = writeTemp("fcp_curve_other.json", R"({"kind": "fcp-plan"})");
  try {
    loadEfficiencyCurves(other);
    FAIL() << "accepted a file of another kind";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(other), std::string::npos) << e.what();
  }
  std::filesystem::remove(other);
  EXPECT_THROW(loadEfficiencyCurves("/nonexistent/curve.json"), Error);
  EXPECT_THROW(loadEfficiencyCurves("no-such-profile"), Error);
}

TEST(EfficiencyCurvesTest, ABadPointNamesItsCurve) {
  const std::string path = writeTemp(
      "fcp_curve_bad_backward.json",
      R"({"kind": "fcp-efficiency-curve", "forward": [[512, 0.6]], "backward": [[512, 1.7]]})");
  try {
    loadEfficiencyCurves(path);
    FAIL() << "accepted an efficiency of 1.7";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_NE(message.find("'backward' curve"), std::string::npos) << message;
    EXPECT_NE(message.find("1.7"), std::string::npos) << message;
  }
  std::filesystem::remove(path);
}

TEST(HardwareProfileTest, ThePlannersLinkRatioIsPeakOver3Point5OverTheLinkAJobCrosses) {
  // gpu-x: 989 TFLOP/s, 8 per node on 450 GB/s NVLink, 167.06 GB/s NIC (data/hardware).
  const HardwareProfile gpuX = loadHardwareProfile("gpu-x");
  EXPECT_NEAR(gpuX.planCommRatio(8), 989e12 / 3.5 / 450e9, 1e-9 * 628);       // one node
  EXPECT_NEAR(gpuX.planCommRatio(9), 989e12 / 3.5 / 167.06e9, 1e-9 * 1691);  // past it
  EXPECT_NEAR(gpuX.planCommRatio(4096), 989e12 / 3.5 / 167.06e9, 1e-9 * 1691);
  HardwareProfile slow = gpuX;  // a link so slow the planner's range caps it
  slow.interNodeBytesPerSecond = 1e6;
  EXPECT_EQ(slow.planCommRatio(64), plan::kMaxCommRatio);
}

TEST(HardwareInputTest, DeepNestingIsAnErrorNotACrash) {
  // Issue 16: 70,000 levels crashed the recursive parser (stack overflow).
  const std::string nested = std::string(70000, '[') + std::string(70000, ']');
  const std::string curve =
      writeTemp("fcp_deep_curve.json", R"({"kind": "fcp-efficiency-curve", "forward": )" + nested + "}");
  EXPECT_NE(errorOf([&] { loadEfficiencyCurves(curve); }).find("JSON nests"), std::string::npos);
  const std::string profile =
      writeTemp("fcp_deep_profile.json", R"({"kind": "fcp-hardware", "note": )" + nested + "}");
  EXPECT_NE(errorOf([&] { loadHardwareProfile(profile); }).find("JSON nests"), std::string::npos);
  std::filesystem::remove(curve);
  std::filesystem::remove(profile);
}

TEST(HardwareInputTest, NumbersOutOfRangeAndWrongTypesAreOneLine) {
  const std::string huge = writeTemp(
      "fcp_huge_curve.json", R"({"kind": "fcp-efficiency-curve", "forward": [[256, 1e400]]})");
  EXPECT_NE(errorOf([&] { loadEfficiencyCurves(huge); }).find("number out of range"),
            std::string::npos);
  const std::string base =
      R"({"kind": "fcp-hardware", "peak_tflops": 1, "workers_per_node": 8, "intra_node_gbps": 1,)"
      R"( "inter_node_gbps": 1, "forward": [[256, 0.5]])";
  EXPECT_NE(errorOf([&] { parseHardwareProfile(base + R"(, "name": 7})", "p"); }).find("'name'"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { parseHardwareProfile(base + R"(, "intra_node_latency_us": "x"})", "p"); })
                .find("'intra_node_latency_us'"),
            std::string::npos);
  const std::string tooFast = R"({"kind": "fcp-hardware", "peak_tflops": 1e300, "workers_per_node": 8,)"
                              R"( "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]]})";
  EXPECT_NE(errorOf([&] { parseHardwareProfile(tooFast, "p"); }).find("'peak_tflops'"),
            std::string::npos);
  std::filesystem::remove(huge);
}

TEST(HardwareInputTest, ADirectoryOrFifoIsRefusedWithoutBlocking) {
  const std::string dir = writeTemp("fcp_dir_curve.json", "");
  std::filesystem::remove(dir);
  std::filesystem::create_directory(dir);
  EXPECT_NE(errorOf([&] { loadEfficiencyCurves(dir); }).find("a directory"), std::string::npos);
  std::filesystem::remove(dir);
  ASSERT_EQ(::mkfifo(dir.c_str(), 0600), 0);
  EXPECT_NE(errorOf([&] { loadEfficiencyCurves(dir); }).find("a FIFO"), std::string::npos);
  std::filesystem::remove(dir);
}

}  // namespace
}  // namespace fcp::sim
