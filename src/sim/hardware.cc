#include "fcp/sim/hardware.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/plan/plan.h"

#ifndef FCP_SOURCE_DATA_DIR
#define FCP_SOURCE_DATA_DIR "data"
#endif

namespace fcp::sim {
namespace {

using nlohmann::json;

/// The "kind" of a JSON object, or "" when it has none (or it is not a string).
std::string kindOf(const json& j) {
  return j.is_object() && j.contains("kind") && j["kind"].is_string() ? j["kind"].get<std::string>()
                                                                      : "";
}

/// `text` parsed, its nesting bounded first (the parser recurses once per level); every
/// failure is one line naming `what` and `source`.
json parseJson(const std::string& text, const char* what, const std::string& source) {
  const std::string name = std::string(what) + " " + printable(source);
  checkJsonDepth(text, name);
  try {
    return json::parse(text);
  } catch (const json::out_of_range& e) {
    throwInvalidArgument(name, " has a number out of range (", e.what(),
                         "): expected numbers that fit a double");
  } catch (const json::exception& e) {
    throwInvalidArgument(name, " is not valid JSON: ", e.what());
  }
}

/// Largest number a profile field may hold (TFLOP/s, GB/s, microseconds, workers per node):
/// far above any device, and small enough that scaled to FLOP/s or bytes/s it stays finite.
constexpr double kMaxProfileNumber = 1e9;
/// Least peak or bandwidth (TFLOP/s, GB/s): far below any device, and large enough that the
/// largest batch's work over it takes a finite time (1e-310 GB/s made the simulated times
/// infinite, and the simulator's event order broke on them).
constexpr double kMinProfileRate = 1e-6;

/// The fields a profile may have; any other is refused, so a misspelt optional field (a
/// latency, say) is named rather than silently read as absent.
constexpr std::array<std::string_view, 15> kProfileFields = {"kind",
                                                             "name",
                                                             "note",
                                                             "peak_tflops",
                                                             "workers_per_node",
                                                             "intra_node_gbps",
                                                             "inter_node_gbps",
                                                             "intra_node_latency_us",
                                                             "inter_node_latency_us",
                                                             "merge_ps_per_element",
                                                             "hbm_gbps",
                                                             "kernel_launch",
                                                             "pipeline",
                                                             "forward",
                                                             "backward"};

double positiveNumber(const json& j, const char* field, const std::string& source,
                      double least = kMinProfileRate) {
  if (!j.contains(field) || !j[field].is_number() || !(j[field].get<double>() >= least) ||
      !(j[field].get<double>() <= kMaxProfileNumber)) {
    throwInvalidArgument("hardware profile ", source, ": field '", field,
                         "' must be a number from ", least, " to ", kMaxProfileNumber);
  }
  return j[field].get<double>();
}

/// An optional non-negative number (a latency), 0 when absent.
double optionalNumber(const json& j, const char* field, const std::string& source) {
  if (!j.contains(field)) return 0;
  if (!j[field].is_number() || !(j[field].get<double>() >= 0) ||
      !(j[field].get<double>() <= kMaxProfileNumber)) {
    throwInvalidArgument("hardware profile ", source, ": field '", field,
                         "' must be a number from 0 to ", kMaxProfileNumber);
  }
  return j[field].get<double>();
}

/// An optional rate (GB/s): 0 when absent or 0 (not charged), else as positiveNumber.
double optionalRate(const json& j, const char* field, const std::string& source) {
  if (!j.contains(field) || (j[field].is_number() && j[field].get<double>() == 0)) return 0;
  if (!j[field].is_number() || !(j[field].get<double>() >= kMinProfileRate) ||
      !(j[field].get<double>() <= kMaxProfileNumber)) {
    throwInvalidArgument("hardware profile ", source, ": field '", field, "' must be 0 or from ",
                         kMinProfileRate, " to ", kMaxProfileNumber);
  }
  return j[field].get<double>();
}

/// An optional string field, `fallback` when absent.
std::string optionalString(const json& j, const char* field, const std::string& fallback,
                           const std::string& source) {
  if (!j.contains(field)) return fallback;
  if (!j[field].is_string()) {
    throwInvalidArgument("hardware profile ", source, ": field '", field, "' must be a string");
  }
  return j[field].get<std::string>();
}

EfficiencyCurve curve(const json& j, const char* field) {
  if (!j.contains(field) || !j[field].is_array() || j[field].empty()) {
    throwInvalidArgument("field '", field, "' must be a non-empty list of [tokens, fraction]");
  }
  std::vector<std::pair<int64_t, double>> points;
  for (const json& p : j[field]) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number() ||
        (p[0].is_number_unsigned() && p[0].get<uint64_t>() > uint64_t{1} << 40)) {
      throwInvalidArgument("'", field, "' entry ", printable(p.dump()), " is not [tokens, fraction]");
    }
    points.push_back({p[0].get<int64_t>(), p[1].get<double>()});
  }
  try {
    return EfficiencyCurve(std::move(points));
  } catch (const Error& e) {
    // Say which of the two curves is wrong.
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    throwInvalidArgument("'", field, "' curve: ", e.what());
  }
}

}  // namespace

std::optional<KernelLaunch> kernelLaunchNamed(std::string_view name) {
  if (name == "pair") return KernelLaunch::kPair;
  if (name == "stage") return KernelLaunch::kStage;
  return std::nullopt;
}

std::optional<Pipeline> pipelineNamed(std::string_view name) {
  if (name == "lockstep") return Pipeline::kLockstep;
  if (name == "multibuffer") return Pipeline::kMultiBuffer;
  return std::nullopt;
}

CostModel HardwareProfile::costModel(const AttentionConfig& attention) const {
  return CostModel{attention, forward, backward};
}

double HardwareProfile::planCommRatio(int64_t workers) const {
  const double link = workers <= workersPerNode ? intraNodeBytesPerSecond : interNodeBytesPerSecond;
  return std::min(plan::kMaxCommRatio, peakFlops / (1.0 + kBackwardFlopsPerForward) / link);
}

HardwareProfile parseHardwareProfile(const std::string& jsonText, const std::string& source) {
  const json j = parseJson(jsonText, "hardware profile", source);
  if (kindOf(j) != "fcp-hardware") {
    throwInvalidArgument("hardware profile ", source,
                         ": expected an object with \"kind\": \"fcp-hardware\"");
  }
  for (const auto& [key, unused] : j.items()) {
    if (std::find(kProfileFields.begin(), kProfileFields.end(), key) == kProfileFields.end()) {
      std::string known;
      for (const std::string_view f : kProfileFields) (known += known.empty() ? "" : ", ") += f;
      throwInvalidArgument("hardware profile ", source, ": unknown field '", printable(key),
                           "': expected ", known);
    }
  }
  HardwareProfile h;
  // Printed in headers and tables: one printable line, as every echo of user input.
  h.name = printable(optionalString(j, "name", source, source));
  h.note = optionalString(j, "note", "", source);
  h.peakFlops = positiveNumber(j, "peak_tflops", source) * 1e12;
  const double perNode = positiveNumber(j, "workers_per_node", source, 1);
  if (perNode != static_cast<double>(static_cast<int64_t>(perNode))) {
    throwInvalidArgument("hardware profile ", source, ": workers_per_node ", perNode,
                         " must be a whole number");
  }
  h.workersPerNode = static_cast<int64_t>(perNode);
  h.intraNodeBytesPerSecond = positiveNumber(j, "intra_node_gbps", source) * 1e9;
  h.interNodeBytesPerSecond = positiveNumber(j, "inter_node_gbps", source) * 1e9;
  h.intraNodeLatencySeconds = optionalNumber(j, "intra_node_latency_us", source) * 1e-6;
  h.interNodeLatencySeconds = optionalNumber(j, "inter_node_latency_us", source) * 1e-6;
  h.mergeSecondsPerElement = optionalNumber(j, "merge_ps_per_element", source) * 1e-12;
  h.memoryBytesPerSecond = optionalRate(j, "hbm_gbps", source) * 1e9;
  const std::string launch = optionalString(j, "kernel_launch", "pair", source);
  const std::optional<KernelLaunch> named = kernelLaunchNamed(launch);
  if (!named) {
    throwInvalidArgument("hardware profile ", source, ": kernel_launch '", printable(launch),
                         "': expected pair or stage");
  }
  h.launch = *named;
  const std::string pipeline = optionalString(j, "pipeline", "lockstep", source);
  const std::optional<Pipeline> pipelined = pipelineNamed(pipeline);
  if (!pipelined) {
    throwInvalidArgument("hardware profile ", source, ": pipeline '", printable(pipeline),
                         "': expected lockstep or multibuffer");
  }
  h.pipeline = *pipelined;
  try {
    h.forward = curve(j, "forward");
    h.backward = j.contains("backward") ? curve(j, "backward") : h.forward;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    throwInvalidArgument("hardware profile ", source, ": ", e.what());
  }
  return h;
}

namespace {

/// The directory of the built-in profiles.
std::string profileDir() {
  const char* env = std::getenv("FCP_DATA_DIR");
  return std::string(env && *env ? env : FCP_SOURCE_DATA_DIR) + "/hardware";
}

/// A profile or curve file: a regular file of at most kMaxSmallJsonFileBytes (never a FIFO,
/// device or directory).
std::string readText(const std::string& path, const char* what) {
  return readUserFile(path, what, kMaxSmallJsonFileBytes);
}

}  // namespace

bool isProfileName(const std::string& nameOrPath) {
  if (nameOrPath.find('/') != std::string::npos || nameOrPath.find(".json") != std::string::npos)
    return false;
  std::error_code ignored;  // a name too long for a path is no profile, and no file here
  return std::filesystem::exists(profileDir() + "/" + nameOrPath + ".json", ignored) ||
         !std::filesystem::is_regular_file(nameOrPath, ignored);
}

HardwareProfile loadHardwareProfile(const std::string& nameOrPath) {
  if (nameOrPath.empty()) throwInvalidArgument("empty hardware profile: expected a name or a file");
  std::string path = nameOrPath;
  if (isProfileName(nameOrPath)) {
    path = profileDir() + "/" + nameOrPath + ".json";
    std::error_code ignored;
    if (!std::filesystem::exists(path, ignored)) {
      throwInvalidArgument("unknown hardware profile '", nameOrPath,
                           "': expected h100, gpu-x, gpu-y, cpu or a JSON file (looked for ", path,
                           ")");
    }
  }
  return parseHardwareProfile(readText(path, "hardware profile"), path);
}

std::pair<EfficiencyCurve, EfficiencyCurve> loadEfficiencyCurves(const std::string& nameOrPath) {
  if (nameOrPath.empty() || isProfileName(nameOrPath)) {
    const HardwareProfile h = loadHardwareProfile(nameOrPath);
    return {h.forward, h.backward};
  }
  return parseEfficiencyCurves(readText(nameOrPath, "efficiency curve"), nameOrPath);
}

std::pair<EfficiencyCurve, EfficiencyCurve> parseEfficiencyCurves(const std::string& jsonText,
                                                                  const std::string& source) {
  const json j = parseJson(jsonText, "efficiency curve", source);
  const std::string kind = kindOf(j);
  if (kind == "fcp-hardware") {
    const HardwareProfile h = parseHardwareProfile(jsonText, source);
    return {h.forward, h.backward};
  }
  if (kind != "fcp-efficiency-curve") {
    throwInvalidArgument(
        "efficiency curve ", source,
        ": expected an object with \"kind\": \"fcp-efficiency-curve\" or \"fcp-hardware\"");
  }
  try {
    EfficiencyCurve forward = curve(j, "forward");
    EfficiencyCurve backward = j.contains("backward") ? curve(j, "backward") : forward;
    return {std::move(forward), std::move(backward)};
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    throwInvalidArgument("efficiency curve ", source, ": ", e.what());
  }
}

}  // namespace fcp::sim
