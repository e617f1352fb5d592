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

TEST(HardwareInputTest, RatesSoSmallThatTimesOverflowAreRefused) {
  // 1e-310 GB/s made the simulated times infinite and the simulator crashed (a review); 1e-300
  // printed a 300-digit step time. The fields now start at 1e-6.
  const auto profile = [](const std::string& field, const std::string& value) {
    std::string text =
        R"({"kind": "fcp-hardware", "peak_tflops": 1, "workers_per_node": 8, "intra_node_gbps": 1,)"
        R"( "inter_node_gbps": 1, "forward": [[256, 0.5]]})";
    const std::string key = "\"" + field + "\": ";
    const size_t at = text.find(key) + key.size();
    text.replace(at, text.find(',', at) - at, value);
    return text;
  };
  for (const std::string field : {"peak_tflops", "intra_node_gbps", "inter_node_gbps"}) {
    for (const std::string value : {"1e-310", "1e-300", "9e-7", "0"}) {
      EXPECT_NE(
          errorOf([&] {
            parseHardwareProfile(profile(field, value), "p");
          }).find("hardware profile p: field '" + field + "' must be a number from 1e-06 to 1e+09"),
          std::string::npos)
          << field << " " << value;
    }
    EXPECT_NO_THROW(parseHardwareProfile(profile(field, "1e-6"), "p")) << field;
  }
  EXPECT_NE(errorOf([&] {
              parseHardwareProfile(profile("workers_per_node", "0.5"), "p");
            }).find("'workers_per_node' must be a number from 1 to"),
            std::string::npos);
}

TEST(HardwareInputTest, MemoryBandwidthIsOptionalAndZeroOrARate) {
  const auto with = [](const std::string& value) {
    return R"({"kind": "fcp-hardware", "peak_tflops": 1, "workers_per_node": 8,)"
           R"( "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]])" +
           (value.empty() ? std::string{} : ", \"hbm_gbps\": " + value) + "}";
  };
  EXPECT_EQ(parseHardwareProfile(with(""), "p").memoryBytesPerSecond, 0);
  EXPECT_EQ(parseHardwareProfile(with("0"), "p").memoryBytesPerSecond, 0);
  EXPECT_EQ(parseHardwareProfile(with("3350"), "p").memoryBytesPerSecond, 3350e9);
  for (const std::string bad : {"1e-300", "-1", "2e9", "\"fast\""}) {
    EXPECT_NE(errorOf([&] {
                parseHardwareProfile(with(bad), "p");
              }).find("hardware profile p: field 'hbm_gbps' must be 0 or from 1e-06 to 1e+09"),
              std::string::npos)
        << bad;
  }
  EXPECT_EQ(loadHardwareProfile("h100").memoryBytesPerSecond, 3350e9);  // H100 SXM's HBM3
}

TEST(HardwareInputTest, AnUnknownFieldIsNamed) {
  // A misspelt latency was read as absent (0) without a word (a review).
  const std::string text =
      R"({"kind": "fcp-hardware", "peak_tflops": 1, "workers_per_node": 8, "intra_node_gbps": 1,)"
      R"( "inter_node_gbps": 1, "intra_node_latency_usec": 1000, "forward": [[256, 0.5]]})";
  EXPECT_NE(errorOf([&] { parseHardwareProfile(text, "p"); })
                .find("hardware profile p: unknown field 'intra_node_latency_usec': expected kind, "
                      "name, note,"),
            std::string::npos);
  // Every built-in profile uses only known fields.
  for (const std::string name : {"h100", "gpu-x", "gpu-y", "cpu"})
    EXPECT_NO_THROW(loadHardwareProfile(name)) << name;
}

TEST(HardwareInputTest, KernelLaunchIsPairUnlessTheProfileSaysStage) {
  const auto with = [](const std::string& launch) {
    return R"({"kind": "fcp-hardware", "peak_tflops": 1, "workers_per_node": 8,)"
           R"( "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]])" +
           (launch.empty() ? std::string{} : ", \"kernel_launch\": " + launch) + "}";
  };
  EXPECT_EQ(parseHardwareProfile(with(""), "p").launch, KernelLaunch::kPair);
  EXPECT_EQ(parseHardwareProfile(with(R"("pair")"), "p").launch, KernelLaunch::kPair);
  EXPECT_EQ(parseHardwareProfile(with(R"("stage")"), "p").launch, KernelLaunch::kStage);
  EXPECT_NE(errorOf([&] {
              parseHardwareProfile(with(R"("fused")"), "p");
            }).find("hardware profile p: kernel_launch 'fused': expected pair or stage"),
            std::string::npos);
  EXPECT_NE(errorOf([&] {
              parseHardwareProfile(with("1"), "p");
            }).find("field 'kernel_launch' must be a string"),
            std::string::npos);
  // The GPU profiles launch per stage, as the paper's and MagiAttention's GPU kernels do; the
  // CPU profile per pair, as FCP's CPU executor runs (sim_vs_real compares against it).
  for (const std::string name : {"h100", "gpu-x", "gpu-y"})
    EXPECT_EQ(loadHardwareProfile(name).launch, KernelLaunch::kStage) << name;
  EXPECT_EQ(loadHardwareProfile("cpu").launch, KernelLaunch::kPair);
}

TEST(HardwareInputTest, ThePipelineIsLockstepUnlessTheProfileSaysMultiBuffer) {
  const auto with = [](const std::string& pipeline) {
    return R"({"kind": "fcp-hardware", "peak_tflops": 1, "workers_per_node": 8,)"
           R"( "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]])" +
           (pipeline.empty() ? std::string{} : ", \"pipeline\": " + pipeline) + "}";
  };
  EXPECT_EQ(parseHardwareProfile(with(""), "p").pipeline, Pipeline::kLockstep);
  EXPECT_EQ(parseHardwareProfile(with(R"("lockstep")"), "p").pipeline, Pipeline::kLockstep);
  EXPECT_EQ(parseHardwareProfile(with(R"("multibuffer")"), "p").pipeline, Pipeline::kMultiBuffer);
  EXPECT_NE(errorOf([&] {
              parseHardwareProfile(with(R"("async")"), "p");
            }).find("hardware profile p: pipeline 'async': expected lockstep or multibuffer"),
            std::string::npos);
  EXPECT_NE(errorOf([&] {
              parseHardwareProfile(with("3"), "p");
            }).find("field 'pipeline' must be a string"),
            std::string::npos);
  // The GPU profiles run the paper's multi-buffer pipeline; the CPU profile is FCP's CPU
  // executor, which goes stage by stage.
  for (const std::string name : {"h100", "gpu-x", "gpu-y"})
    EXPECT_EQ(loadHardwareProfile(name).pipeline, Pipeline::kMultiBuffer) << name;
  EXPECT_EQ(loadHardwareProfile("cpu").pipeline, Pipeline::kLockstep);
}

TEST(HardwareInputTest, TheNameIsOnePrintableLine) {
  const std::string text =
      R"({"kind": "fcp-hardware", "name": "evil\u001b[31m\nline", "peak_tflops": 1,)"
      R"( "workers_per_node": 8, "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]]})";
  EXPECT_EQ(parseHardwareProfile(text, "p").name, "evil\\x1B[31m\\nline");
}

TEST(HardwareInputTest, ABuiltInNameWinsOverAFileOfThatNameHere) {
  // As for workloads: `./h100` names the file, `h100` the built-in profile (a file named h100
  // in the current directory silently replaced it).
  const std::string dir = writeTemp("fcp_profile_dir", "");
  std::filesystem::remove(dir);
  std::filesystem::create_directory(dir);
  std::ofstream(dir + "/h100")
      << R"({"kind": "fcp-hardware", "name": "mine", "peak_tflops": 1, "workers_per_node": 8,)"
         R"( "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]]})";
  std::ofstream(dir + "/myprofile")
      << R"({"kind": "fcp-hardware", "name": "other", "peak_tflops": 1, "workers_per_node": 8,)"
         R"( "intra_node_gbps": 1, "inter_node_gbps": 1, "forward": [[256, 0.5]]})";
  const std::string cwd = std::filesystem::current_path().string();
  std::filesystem::current_path(dir);
  const std::string builtIn = loadHardwareProfile("h100").name;
  const std::string file = loadHardwareProfile("./h100").name;
  const std::string other = loadHardwareProfile("myprofile").name;  // no such built-in: the file
  std::filesystem::current_path(cwd);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(builtIn, "h100");
  EXPECT_EQ(file, "mine");
  EXPECT_EQ(other, "other");
  // A name too long for a path is an unknown profile, not an internal filesystem error.
  const std::string longName(300, 'a');
  EXPECT_NE(errorOf([&] { loadHardwareProfile(longName); }).find("unknown hardware profile"),
            std::string::npos);
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
