#include "fcp/sim/hardware.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "fcp/core/error.h"

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

double positiveNumber(const json& j, const char* field, const std::string& source) {
  if (!j.contains(field) || !j[field].is_number() || !(j[field].get<double>() > 0)) {
    throwInvalidArgument("hardware profile ", source, ": field '", field,
                         "' must be a positive number");
  }
  return j[field].get<double>();
}

EfficiencyCurve curve(const json& j, const char* field) {
  if (!j.contains(field) || !j[field].is_array() || j[field].empty()) {
    throwInvalidArgument("field '", field, "' must be a non-empty list of [tokens, fraction]");
  }
  std::vector<std::pair<int64_t, double>> points;
  for (const json& p : j[field]) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number()) {
      throwInvalidArgument("'", field, "' entry ", p.dump(), " is not [tokens, fraction]");
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

CostModel HardwareProfile::costModel(const AttentionConfig& attention) const {
  return CostModel{attention, forward, backward};
}

HardwareProfile parseHardwareProfile(const std::string& jsonText, const std::string& source) {
  json j;
  try {
    j = json::parse(jsonText);
  } catch (const json::parse_error& e) {
    throwInvalidArgument("hardware profile ", source, " is not valid JSON: ", e.what());
  }
  if (kindOf(j) != "fcp-hardware") {
    throwInvalidArgument("hardware profile ", source,
                         ": expected an object with \"kind\": \"fcp-hardware\"");
  }
  HardwareProfile h;
  h.name = j.value("name", source);
  h.note = j.value("note", "");
  h.peakFlops = positiveNumber(j, "peak_tflops", source) * 1e12;
  const double perNode = positiveNumber(j, "workers_per_node", source);
  if (perNode != static_cast<double>(static_cast<int64_t>(perNode))) {
    throwInvalidArgument("hardware profile ", source, ": workers_per_node ", perNode,
                         " must be a whole number");
  }
  h.workersPerNode = static_cast<int64_t>(perNode);
  h.intraNodeBytesPerSecond = positiveNumber(j, "intra_node_gbps", source) * 1e9;
  h.interNodeBytesPerSecond = positiveNumber(j, "inter_node_gbps", source) * 1e9;
  h.intraNodeLatencySeconds = j.value("intra_node_latency_us", 0.0) * 1e-6;
  h.interNodeLatencySeconds = j.value("inter_node_latency_us", 0.0) * 1e-6;
  if (h.intraNodeLatencySeconds < 0 || h.interNodeLatencySeconds < 0) {
    throwInvalidArgument("hardware profile ", source, ": latencies must be >= 0");
  }
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

/// A built-in profile's name, not a file: no '/', no ".json", and no such file here.
bool isProfileName(const std::string& nameOrPath) {
  return nameOrPath.find('/') == std::string::npos &&
         nameOrPath.find(".json") == std::string::npos &&
         !std::filesystem::is_regular_file(nameOrPath);
}

std::string readText(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) throwInvalidArgument("cannot read ", what, " '", path, "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

HardwareProfile loadHardwareProfile(const std::string& nameOrPath) {
  if (nameOrPath.empty()) throwInvalidArgument("empty hardware profile: expected a name or a file");
  std::string path = nameOrPath;
  if (isProfileName(nameOrPath)) {
    const char* env = std::getenv("FCP_DATA_DIR");
    const std::string dir = env && *env ? env : FCP_SOURCE_DATA_DIR;
    path = dir + "/hardware/" + nameOrPath + ".json";
    if (!std::filesystem::exists(path)) {
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
  const std::string text = readText(nameOrPath, "efficiency curve");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throwInvalidArgument("efficiency curve ", nameOrPath, " is not valid JSON: ", e.what());
  }
  const std::string kind = kindOf(j);
  if (kind == "fcp-hardware") {
    const HardwareProfile h = parseHardwareProfile(text, nameOrPath);
    return {h.forward, h.backward};
  }
  if (kind != "fcp-efficiency-curve") {
    throwInvalidArgument(
        "efficiency curve ", nameOrPath,
        ": expected an object with \"kind\": \"fcp-efficiency-curve\" or \"fcp-hardware\"");
  }
  try {
    EfficiencyCurve forward = curve(j, "forward");
    EfficiencyCurve backward = j.contains("backward") ? curve(j, "backward") : forward;
    return {std::move(forward), std::move(backward)};
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    throwInvalidArgument("efficiency curve ", nameOrPath, ": ", e.what());
  }
}

}  // namespace fcp::sim
