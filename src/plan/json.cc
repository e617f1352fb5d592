#include "fcp/plan/json.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <string_view>
#include <type_traits>

#include "fcp/core/error.h"
#include "fcp/core/input.h"

namespace fcp::plan {
namespace {

using nlohmann::json;

constexpr int kFormatVersion = 1;

json configToJson(const PlanConfig& c) {
  json j = {{"workers", c.numWorkers},
            {"tokens_per_worker", c.tokensPerWorker},
            {"block_size", c.blockSize},
            {"memory_limit_tokens", c.memoryLimitTokens},
            {"memory_slack", c.memorySlack},
            {"alpha", c.alpha},
            {"beta", c.beta},
            {"improve_target", c.improveTarget},
            {"improve_steps_per_block", c.improveStepsPerBlock},
            {"coalesce", c.coalesce},
            {"buffer_depth", c.bufferDepth},
            {"placement", std::string(placementName(c.placement))},
            {"locality_slack", c.localitySlack},
            {"locality", c.locality},
            {"comm_balance_slack", c.commBalanceSlack},
            {"cost_aware_blocks", c.costAwareBlocks},
            {"heads_q", c.attention.numHeadsQ},
            {"heads_kv", c.attention.numHeadsKv},
            {"head_dim", c.attention.headDim},
            {"element_bytes", c.attention.elementBytes},
            {"mask", std::string(maskName(c.attention.mask))},
            {"user_starts", c.userStarts}};
  // Only when set, so that plans made without it keep their JSON (and digests) as before.
  if (c.commRatio > 0) j["comm_ratio"] = c.commRatio;
  return j;
}

/// An integer that must fit T exactly: nlohmann's get<T>() would narrow 2^32 + 1 to 1, or
/// cast 1e300 with undefined behaviour.
template <typename T>
T integer(const json& j, const char* what) {
  static_assert(std::is_integral_v<T>);
  bool fits = j.is_number_integer();
  if (fits && j.is_number_unsigned()) {
    fits = j.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  } else if (fits) {
    const auto v = j.get<int64_t>();
    fits = v >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
           v <= static_cast<int64_t>(std::numeric_limits<T>::max());
  }
  if (!fits) {
    throwInvalidArgument("plan JSON: ", what, " ", j.dump(), " is not an integer that fits in ",
                         8 * sizeof(T), " bits");
  }
  return static_cast<T>(j.is_number_unsigned() ? static_cast<int64_t>(j.get<uint64_t>())
                                               : j.get<int64_t>());
}

template <typename T>
std::vector<T> integers(const json& j, const char* what) {
  if (!j.is_array()) throwInvalidArgument("plan JSON: ", what, " is not an array");
  std::vector<T> out;
  out.reserve(j.size());
  for (const json& e : j) out.push_back(integer<T>(e, what));
  return out;
}

/// Reads field `key` of `object` as T, naming it in the error when missing or mistyped.
template <typename T>
T field(const json& object, const char* key) {
  const auto it = object.find(key);
  if (it == object.end()) throwInvalidArgument("plan JSON: missing field '", key, "'");
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return integer<T>(*it, key);
  } else if constexpr (std::is_same_v<T, std::vector<int32_t>> ||
                       std::is_same_v<T, std::vector<int64_t>>) {
    return integers<typename T::value_type>(*it, key);
  } else {
    try {
      return it->get<T>();
    } catch (const json::exception&) {
      throwInvalidArgument("plan JSON: field '", key, "' has the wrong type (", it->type_name(),
                           ")");
    }
  }
}

/// Refuses a field of the object `j` (at `where`: "" for the top level, "config.") that is
/// neither a key of `written` nor one of `more`, by name, as a hardware profile's is: a
/// misspelt or hand-added field was ignored (a misspelt optional one silently took its
/// default). Called after the known fields are read, so that a misspelt required one is still
/// named as missing.
void refuseUnknownFields(const json& j, const json& written,
                         std::initializer_list<std::string_view> more, std::string_view where) {
  for (const auto& [key, unused] : j.items()) {
    if (written.contains(key) || std::find(more.begin(), more.end(), key) != more.end()) continue;
    throwInvalidArgument("plan JSON has an unknown field '", where, key,
                         "': expected only the fields fcp plan --plan-out writes");
  }
}

PlanConfig configFromJson(const json& j) {
  PlanConfig c;
  c.numWorkers = field<int64_t>(j, "workers");
  c.tokensPerWorker = field<int64_t>(j, "tokens_per_worker");
  c.blockSize = field<int64_t>(j, "block_size");
  c.memoryLimitTokens = field<int64_t>(j, "memory_limit_tokens");
  c.memorySlack = field<double>(j, "memory_slack");
  c.alpha = field<double>(j, "alpha");
  c.beta = field<double>(j, "beta");
  c.improveTarget = field<double>(j, "improve_target");
  c.improveStepsPerBlock = field<int64_t>(j, "improve_steps_per_block");
  c.coalesce = field<int64_t>(j, "coalesce");
  c.bufferDepth = field<int64_t>(j, "buffer_depth");
  // Absent in plans saved before the locality-first placement: those were all LPT.
  c.placement = j.contains("placement") ? parsePlacement(field<std::string>(j, "placement"))
                                        : Placement::kLpt;
  if (j.contains("locality_slack")) c.localitySlack = field<double>(j, "locality_slack");
  if (j.contains("comm_ratio")) c.commRatio = field<double>(j, "comm_ratio");
  c.locality = field<bool>(j, "locality");
  c.commBalanceSlack = field<double>(j, "comm_balance_slack");
  // Absent in plans saved before cost-aware blocks: those were made without them.
  c.costAwareBlocks = j.contains("cost_aware_blocks") ? field<bool>(j, "cost_aware_blocks") : false;
  c.attention.numHeadsQ = field<int64_t>(j, "heads_q");
  c.attention.numHeadsKv = field<int64_t>(j, "heads_kv");
  c.attention.headDim = field<int64_t>(j, "head_dim");
  c.attention.elementBytes = field<int64_t>(j, "element_bytes");
  c.attention.mask = parseMask(field<std::string>(j, "mask"));
  // Absent in plans saved before the user layout was configurable: the even split.
  if (j.contains("user_starts")) c.userStarts = field<std::vector<int64_t>>(j, "user_starts");
  refuseUnknownFields(j, configToJson(PlanConfig{}), {"comm_ratio"}, "config.");
  return c;
}

/// A pass's stages: [worker][stage] -> [send, recv, compute, release, sendGrad, recvGrad].
json stagesToJson(const Stages& stages) {
  json workers = json::array();
  for (const auto& ws : stages) {
    json list = json::array();
    for (const Stage st : ws) {
      const auto ids = [](std::span<const int32_t> v) {
        return json(std::vector<int32_t>(v.begin(), v.end()));
      };
      list.push_back({ids(st.send), ids(st.recv), ids(st.compute), ids(st.release),
                      ids(st.sendGrad), ids(st.recvGrad)});
    }
    workers.push_back(std::move(list));
  }
  return workers;
}

Stages stagesFromJson(const json& j) {
  std::vector<std::vector<StageIds>> stages;
  for (const json& ws : j) {
    std::vector<StageIds> list;
    for (const json& st : ws) {
      const char* what = "stage id";
      list.push_back({integers<int32_t>(st.at(0), what), integers<int32_t>(st.at(1), what),
                      integers<int32_t>(st.at(2), what), integers<int32_t>(st.at(3), what),
                      integers<int32_t>(st.at(4), what), integers<int32_t>(st.at(5), what)});
    }
    stages.push_back(std::move(list));
  }
  return Stages(stages);
}

/// Everything planToJson writes but the arrays that grow with the batch (its sequences, blocks,
/// owners, pairs, loads, transfers, stages and reshuffle): what planDigest takes as text.
json headerJson(const Plan& plan) {
  json sharding = {{"block_size", plan.shardBlockSize},
                   {"memory_retries", plan.memoryRetries},
                   {"cost_cut_sequences", plan.costCutSequences},
                   {"smallest_block_size", plan.smallestBlockSize}};
  // Only when memory-aware packing cut it, so that other plans keep their JSON (and digests).
  if (plan.packedBlockSize != plan.shardBlockSize)
    sharding["packed_block_size"] = plan.packedBlockSize;
  return {{"format", "fcp-plan"},
          {"version", kFormatVersion},
          {"strategy", plan.strategy},
          {"congestion_free", plan.congestionFree},
          {"config", configToJson(plan.config)},
          {"lower_bound", plan.lowerBound},
          {"greedy_max_cost", plan.greedyMaxCost},
          {"improve_steps", plan.improveSteps},
          {"comm_balance_steps", plan.commBalanceSteps},
          {"moved_tokens_without_locality", plan.movedTokensWithoutLocality},
          {"placement", std::string(placementName(plan.placement))},
          {"locality_moves", plan.localityMoves},
          {"sharding", std::move(sharding)},
          {"num_rounds", plan.numRounds}};
}

/// A 64-bit hash of a sequence of words: each is mixed in with a multiply and a shift, so that
/// a change in any bit of any word reaches the whole state. Not cryptographic: it tells ranks
/// whose plans differ apart, it does not resist a forger.
class WordHash {
 public:
  void add(uint64_t x) {
    h_ = (h_ ^ x) * 0x9e3779b97f4a7c15ull;
    h_ ^= h_ >> 29;
  }
  void add(int64_t x) { add(static_cast<uint64_t>(x)); }
  void add(int32_t x) { add(static_cast<uint64_t>(static_cast<int64_t>(x))); }
  void add(double x) {
    uint64_t bits = 0;
    std::memcpy(&bits, &x, sizeof bits);
    add(bits);
  }
  void add(std::string_view text) {
    add(static_cast<uint64_t>(text.size()));
    for (const char c : text) add(static_cast<uint64_t>(static_cast<unsigned char>(c)));
  }
  /// A list: its length, then each item as `each` adds it (lengths keep lists apart).
  template <typename List, typename Each>
  void list(const List& items, const Each& each) {
    add(static_cast<uint64_t>(items.size()));
    for (const auto& item : items) each(item);
  }
  void ids(std::span<const int32_t> v) {
    list(v, [&](int32_t x) { add(x); });
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

/// What planToJson writes, as a JSON document.
json planJson(const Plan& plan) {
  json blocks = json::array();
  for (const Block& b : plan.blocks) {
    json chunks = json::array();
    for (const Chunk& c : b.chunks) chunks.push_back({c.sequence, c.begin, c.end});
    blocks.push_back(std::move(chunks));
  }
  json pairs = json::array();
  for (const BlockPair& p : plan.pairs) pairs.push_back({p.qBlock, p.kvBlock, p.visible, p.cost});
  json loads = json::array();
  for (const WorkerLoad& l : plan.loads) loads.push_back({l.numTokens, l.cost});
  json transfers = json::array();
  for (const Transfer& t : plan.transfers) {
    transfers.push_back({t.block, t.sender, t.receiver, t.bytes, t.round});
  }
  json reshuffle = json::array();
  for (const ReshufflePiece& p : plan.reshuffle) {
    reshuffle.push_back({p.userWorker, p.fcpWorker, p.begin, p.end});
  }
  // An object's keys are written sorted, whatever order they were added in.
  json doc = headerJson(plan);
  doc["batch"] = plan.batch.sequenceLengths;
  doc["blocks"] = std::move(blocks);
  doc["owner"] = plan.owner;
  doc["pairs"] = std::move(pairs);
  doc["loads"] = std::move(loads);
  doc["transfers"] = std::move(transfers);
  doc["forward"] = stagesToJson(plan.forward);
  doc["backward"] = stagesToJson(plan.backward);
  doc["reshuffle"] = std::move(reshuffle);
  return doc;
}

}  // namespace

std::string planToJson(const Plan& plan) { return planJson(plan).dump(); }

uint64_t planDigest(const Plan& plan) {
  WordHash h;
  h.add(std::string_view(headerJson(plan).dump()));
  h.list(plan.batch.sequenceLengths, [&](int64_t length) { h.add(length); });
  h.list(plan.blocks, [&](const Block& b) {
    h.list(b.chunks, [&](const Chunk& c) {
      h.add(c.sequence);
      h.add(c.begin);
      h.add(c.end);
    });
  });
  h.ids(plan.owner);
  h.list(plan.pairs, [&](const BlockPair& p) {
    h.add(p.qBlock);
    h.add(p.kvBlock);
    h.add(p.visible);
    h.add(p.cost);
  });
  h.list(plan.loads, [&](const WorkerLoad& l) {
    h.add(l.numTokens);
    h.add(l.cost);
  });
  h.list(plan.transfers, [&](const Transfer& t) {
    h.add(t.block);
    h.add(t.sender);
    h.add(t.receiver);
    h.add(t.bytes);
    h.add(t.round);
  });
  for (const auto* pass : {&plan.forward, &plan.backward}) {
    h.list(*pass, [&](const WorkerStages& stages) {
      h.list(stages, [&](const Stage& st) {
        for (const auto* ids : {&st.send, &st.recv, &st.compute, &st.release, &st.sendGrad,
                                &st.recvGrad}) {
          h.ids(*ids);
        }
      });
    });
  }
  h.list(plan.reshuffle, [&](const ReshufflePiece& p) {
    h.add(p.userWorker);
    h.add(p.fcpWorker);
    h.add(p.begin);
    h.add(p.end);
  });
  return h.value();
}

Plan planFromJson(std::string_view text) {
  // nlohmann's parser recurses once per level: bound the depth before it sees the text.
  checkJsonDepth(text, "plan JSON");
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::out_of_range& e) {
    throwInvalidArgument("plan JSON has a number out of range (", e.what(),
                         "): expected numbers that fit a double");
  } catch (const json::exception& e) {
    throwInvalidArgument("plan JSON does not parse: ", e.what());
  }
  if (!doc.is_object() || !doc.contains("format") || doc["format"] != "fcp-plan") {
    throwInvalidArgument("not an FCP plan: expected a JSON object with \"format\": \"fcp-plan\"");
  }
  if (field<int>(doc, "version") != kFormatVersion) {
    throwInvalidArgument("plan JSON version ", doc["version"].dump(), ": expected ",
                         kFormatVersion);
  }
  Plan plan;
  plan.strategy = field<std::string>(doc, "strategy");
  plan.congestionFree = field<bool>(doc, "congestion_free");
  try {
    plan.config = configFromJson(field<json>(doc, "config"));
    plan.batch.sequenceLengths = field<std::vector<int64_t>>(doc, "batch");
    for (const json& b : field<json>(doc, "blocks")) {
      Block block;
      for (const json& c : b) {
        block.chunks.push_back({integer<int32_t>(c.at(0), "chunk sequence"),
                                integer<int64_t>(c.at(1), "chunk begin"),
                                integer<int64_t>(c.at(2), "chunk end")});
      }
      plan.blocks.push_back(std::move(block));
    }
    plan.owner = field<std::vector<int32_t>>(doc, "owner");
    for (const json& p : field<json>(doc, "pairs")) {
      plan.pairs.push_back(
          {integer<int32_t>(p.at(0), "pair Q block"), integer<int32_t>(p.at(1), "pair KV block"),
           integer<int64_t>(p.at(2), "pair visible count"), p.at(3).get<double>()});
    }
    for (const json& l : field<json>(doc, "loads")) {
      plan.loads.push_back({integer<int64_t>(l.at(0), "load tokens"), l.at(1).get<double>()});
    }
    for (const json& t : field<json>(doc, "transfers")) {
      const char* what = "transfer field";
      plan.transfers.push_back({.block = integer<int32_t>(t.at(0), what),
                                .sender = integer<int32_t>(t.at(1), what),
                                .receiver = integer<int32_t>(t.at(2), what),
                                .round = integer<int32_t>(t.at(4), what),
                                .bytes = integer<int64_t>(t.at(3), what)});
    }
    plan.forward = stagesFromJson(field<json>(doc, "forward"));
    plan.backward = stagesFromJson(field<json>(doc, "backward"));
    for (const json& p : field<json>(doc, "reshuffle")) {
      const char* what = "reshuffle field";
      plan.reshuffle.push_back({integer<int32_t>(p.at(0), what), integer<int32_t>(p.at(1), what),
                                integer<int64_t>(p.at(2), what), integer<int64_t>(p.at(3), what)});
    }
  } catch (const json::exception& e) {
    throwInvalidArgument(
        "plan JSON has a malformed block, pair, load, transfer, stage or "
        "reshuffle entry: ",
        e.what());
  }
  plan.lowerBound = field<double>(doc, "lower_bound");
  plan.greedyMaxCost = field<double>(doc, "greedy_max_cost");
  plan.improveSteps = field<int64_t>(doc, "improve_steps");
  plan.commBalanceSteps = field<int64_t>(doc, "comm_balance_steps");
  plan.movedTokensWithoutLocality = field<int64_t>(doc, "moved_tokens_without_locality");
  plan.numRounds = field<int32_t>(doc, "num_rounds");
  if (doc.contains("placement")) {
    plan.placement = parsePlacement(field<std::string>(doc, "placement"));
    plan.localityMoves = field<int64_t>(doc, "locality_moves");
  }
  // The fields the writer writes (an empty plan's), for refuseUnknownFields.
  const json written = planJson(Plan{});
  // Absent in plans saved before the sharding was recorded: blocks of the configured size.
  if (doc.contains("sharding")) {
    const json sharding = field<json>(doc, "sharding");
    plan.shardBlockSize = field<int64_t>(sharding, "block_size");
    plan.memoryRetries = field<int64_t>(sharding, "memory_retries");
    plan.costCutSequences = field<int64_t>(sharding, "cost_cut_sequences");
    plan.smallestBlockSize = field<int64_t>(sharding, "smallest_block_size");
    // Absent unless memory-aware packing cut it (see planToJson).
    plan.packedBlockSize = sharding.contains("packed_block_size")
                               ? field<int64_t>(sharding, "packed_block_size")
                               : plan.shardBlockSize;
    refuseUnknownFields(sharding, written.at("sharding"), {"packed_block_size"}, "sharding.");
  }
  refuseUnknownFields(doc, written, {}, "");
  return plan;
}

}  // namespace fcp::plan
