#include "fcp/sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <queue>
#include <tuple>

#include "fcp/core/error.h"

namespace fcp::sim {
namespace {

using plan::Plan;
using plan::Stage;

/// A unit of data movement between two workers: a KV transfer, a dK/dV return or a
/// reshuffle message.
struct Flow {
  int32_t src = 0;
  int32_t dst = 0;
  double bytes = 0;
};

/// A worker's stage as the engine sees it.
struct SimStage {
  int32_t planStage = 0;
  double computeSeconds = 0;
  std::vector<int32_t> flows;
};

/// The event-driven engine for one pass.
///
/// Terms: a *port* is one direction of one link kind at one worker (NVLink out, NVLink in,
/// NIC out, NIC in); a flow uses the sender's out port and the receiver's in port of one kind.
/// A flow is *posted* by each endpoint when it enters the stage holding it and *active* once
/// both have; an active flow drains at rate min over its two ports of capacity / active flows
/// on the port, recomputed whenever a flow starts or ends on either port. Each active flow has
/// one drain time, kept in an indexed heap (`drains_`, position `heapPos_`) and moved in place
/// when its rate changes; compute ends and arrivals go through `queue_`. A worker's
/// `outstanding` counts the flows and the compute of its current stage not yet done.
///
/// Rates are recomputed once per instant, not once per start or end: a port whose flow set
/// changed is *dirty*, and before time moves past the instant every dirty port's flows are
/// re-rated, and only a flow whose rate actually changed gets a new drain event. An
/// all-to-all of P workers posts P^2 flows at one instant; re-rating on every start would push
/// O(P^3) events (minutes and gigabytes at 256 workers), this pushes O(P^2).
class Engine {
 public:
  Engine(const HardwareProfile& hw, int64_t numWorkers, std::vector<Flow> flows,
         std::vector<std::vector<SimStage>> stages, bool keepTimelines)
      : hw_(hw), n_(static_cast<size_t>(numWorkers)), flows_(std::move(flows)),
        stages_(std::move(stages)), keep_(keepTimelines) {
    const size_t f = flows_.size();
    remaining_.resize(f);
    rate_.assign(f, 0);
    last_.assign(f, 0);
    drainAt_.assign(f, 0);
    heapPos_.assign(f, -1);
    posted_.assign(f, 0);
    for (size_t i = 0; i < f; ++i) remaining_[i] = flows_[i].bytes;
    active_.resize(4 * n_);
    isDirty_.assign(4 * n_, 0);
    stageIdx_.assign(n_, 0);
    outstanding_.assign(n_, 0);
    stageStart_.assign(n_, 0);
    computeEnd_.assign(n_, 0);
    result_.computeMs.assign(n_, 0);
    result_.finishMs.assign(n_, 0);
    if (keep_) result_.timelines.resize(n_);
  }

  PassResult run() {
    for (size_t w = 0; w < n_; ++w) enter(static_cast<int32_t>(w), 0);
    constexpr double kNever = std::numeric_limits<double>::infinity();
    while (!queue_.empty() || !drains_.empty() || !dirty_.empty()) {
      const double nextEvent = queue_.empty() ? kNever : queue_.top().time;
      const double nextDrain = drains_.empty() ? kNever : drainAt_[static_cast<size_t>(drains_[0])];
      if (!dirty_.empty() && std::min(nextEvent, nextDrain) > dirtyTime_) {
        flush(dirtyTime_);
        continue;
      }
      if (nextDrain <= nextEvent) {
        const int32_t f = drains_[0];
        heapRemoveTop();
        drained(f, nextDrain);
        continue;
      }
      const Event e = queue_.top();
      queue_.pop();
      switch (e.kind) {
        case kComputeDone:
          computeEnd_[static_cast<size_t>(e.id)] = e.time;
          done(e.id, e.time);
          break;
        case kArrived:
          done(flows_[static_cast<size_t>(e.id)].src, e.time);
          done(flows_[static_cast<size_t>(e.id)].dst, e.time);
          break;
      }
    }
    for (size_t w = 0; w < n_; ++w) {
      if (stageIdx_[w] < stages_[w].size()) {
        throw Error(ErrorCode::kInvalidPlan, "simulation stalls: worker " + std::to_string(w) +
                                                 " waits forever in stage " +
                                                 std::to_string(stages_[w][stageIdx_[w]].planStage));
      }
      result_.timeMs = std::max(result_.timeMs, result_.finishMs[w]);
    }
    return std::move(result_);
  }

 private:
  enum Kind { kComputeDone, kArrived };
  struct Event {
    double time;
    uint64_t seq;
    Kind kind;
    int32_t id;
    bool operator>(const Event& o) const { return std::tie(time, seq) > std::tie(o.time, o.seq); }
  };

  void push(double time, Kind kind, int32_t id) { queue_.push({time, seq_++, kind, id}); }

  // The indexed binary min-heap of drain times: ties broken by flow id, so the order is
  // deterministic.
  bool drainsBefore(int32_t a, int32_t b) const {
    const double ta = drainAt_[static_cast<size_t>(a)], tb = drainAt_[static_cast<size_t>(b)];
    return ta < tb || (ta == tb && a < b);
  }
  void heapPlace(size_t i, int32_t f) {
    drains_[i] = f;
    heapPos_[static_cast<size_t>(f)] = static_cast<int64_t>(i);
  }
  void siftUp(size_t i) {
    const int32_t f = drains_[i];
    while (i > 0 && drainsBefore(f, drains_[(i - 1) / 2])) {
      heapPlace(i, drains_[(i - 1) / 2]);
      i = (i - 1) / 2;
    }
    heapPlace(i, f);
  }
  void siftDown(size_t i) {
    const int32_t f = drains_[i];
    const size_t size = drains_.size();
    for (;;) {
      size_t child = 2 * i + 1;
      if (child >= size) break;
      if (child + 1 < size && drainsBefore(drains_[child + 1], drains_[child])) ++child;
      if (!drainsBefore(drains_[child], f)) break;
      heapPlace(i, drains_[child]);
      i = child;
    }
    heapPlace(i, f);
  }
  /// Sets flow f's drain time, inserting it or moving it within the heap.
  void scheduleDrain(int32_t f, double time) {
    const auto i = static_cast<size_t>(f);
    drainAt_[i] = time;
    if (heapPos_[i] < 0) {
      drains_.push_back(f);
      siftUp(drains_.size() - 1);
    } else {
      const auto at = static_cast<size_t>(heapPos_[i]);
      siftUp(at);
      siftDown(static_cast<size_t>(heapPos_[i]));
    }
  }
  void heapRemoveTop() {
    heapPos_[static_cast<size_t>(drains_[0])] = -1;
    const int32_t last = drains_.back();
    drains_.pop_back();
    if (!drains_.empty()) {
      drains_[0] = last;
      siftDown(0);
    }
  }

  bool sameNode(int32_t a, int32_t b) const {
    return a / hw_.workersPerNode == b / hw_.workersPerNode;
  }
  size_t outPort(const Flow& f) const { return 4 * static_cast<size_t>(f.src) + (sameNode(f.src, f.dst) ? 0 : 2); }
  size_t inPort(const Flow& f) const { return 4 * static_cast<size_t>(f.dst) + (sameNode(f.src, f.dst) ? 1 : 3); }
  double capacity(size_t port) const {
    return port % 4 < 2 ? hw_.intraNodeBytesPerSecond : hw_.interNodeBytesPerSecond;
  }

  void enter(int32_t w, double t) {
    const auto wi = static_cast<size_t>(w);
    if (stageIdx_[wi] == stages_[wi].size()) {
      result_.finishMs[wi] = t * 1e3;
      return;
    }
    const SimStage& s = stages_[wi][stageIdx_[wi]];
    stageStart_[wi] = t;
    outstanding_[wi] = static_cast<int64_t>(s.flows.size()) + 1;
    result_.computeMs[wi] += s.computeSeconds * 1e3;
    push(t + s.computeSeconds, kComputeDone, w);
    for (int32_t f : s.flows) {
      if (++posted_[static_cast<size_t>(f)] == 2) start(f, t);
    }
  }

  void done(int32_t w, double t) {
    const auto wi = static_cast<size_t>(w);
    if (--outstanding_[wi] > 0) return;
    if (keep_) {
      result_.timelines[wi].push_back({stages_[wi][stageIdx_[wi]].planStage, stageStart_[wi] * 1e3,
                                       computeEnd_[wi] * 1e3, t * 1e3});
    }
    ++stageIdx_[wi];
    enter(w, t);
  }

  void settle(int32_t f, double t) {
    const auto i = static_cast<size_t>(f);
    remaining_[i] = std::max(0.0, remaining_[i] - rate_[i] * (t - last_[i]));
    last_[i] = t;
  }

  /// Marks `port` for re-rating at time t (the current instant).
  void markDirty(size_t port, double t) {
    dirtyTime_ = t;
    if (!isDirty_[port]) {
      isDirty_[port] = 1;
      dirty_.push_back(port);
    }
  }

  /// Re-rates the flows of every dirty port at time t: a flow whose rate changed is settled at
  /// its old rate up to t and gets a new drain event.
  void flush(double t) {
    for (const size_t port : dirty_) {
      isDirty_[port] = 0;
      for (int32_t g : active_[port]) {
        const auto i = static_cast<size_t>(g);
        const Flow& f = flows_[i];
        const size_t a = outPort(f), b = inPort(f);
        const double rate = std::min(capacity(a) / static_cast<double>(active_[a].size()),
                                     capacity(b) / static_cast<double>(active_[b].size()));
        if (rate == rate_[i]) continue;
        settle(g, t);
        rate_[i] = rate;
        scheduleDrain(g, t + remaining_[i] / rate);
      }
    }
    dirty_.clear();
  }

  void start(int32_t f, double t) {
    const Flow& flow = flows_[static_cast<size_t>(f)];
    const size_t a = outPort(flow), b = inPort(flow);
    active_[a].push_back(f);
    active_[b].push_back(f);
    rate_[static_cast<size_t>(f)] = 0;
    last_[static_cast<size_t>(f)] = t;
    markDirty(a, t);
    markDirty(b, t);
  }

  void drained(int32_t f, double t) {
    const Flow& flow = flows_[static_cast<size_t>(f)];
    const size_t a = outPort(flow), b = inPort(flow);
    for (const size_t port : {a, b}) {
      auto& list = active_[port];
      list.erase(std::find(list.begin(), list.end(), f));
    }
    markDirty(a, t);
    markDirty(b, t);
    const double latency =
        sameNode(flow.src, flow.dst) ? hw_.intraNodeLatencySeconds : hw_.interNodeLatencySeconds;
    push(t + latency, kArrived, f);
  }

  const HardwareProfile& hw_;
  size_t n_;
  std::vector<Flow> flows_;
  std::vector<std::vector<SimStage>> stages_;
  bool keep_;
  std::vector<double> remaining_, rate_, last_;
  std::vector<double> drainAt_;
  std::vector<int64_t> heapPos_;
  std::vector<int32_t> drains_;
  std::vector<uint8_t> posted_;
  std::vector<std::vector<int32_t>> active_;
  std::vector<uint8_t> isDirty_;
  std::vector<size_t> dirty_;
  double dirtyTime_ = 0;
  std::vector<size_t> stageIdx_;
  std::vector<int64_t> outstanding_;
  std::vector<double> stageStart_, computeEnd_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  uint64_t seq_ = 0;
  PassResult result_;
};

/// Off-worker reshuffle bytes per (source, destination), for one direction.
std::map<std::pair<int32_t, int32_t>, double> reshuffleMessages(const Plan& plan, bool inward,
                                                                int64_t bytesPerToken) {
  std::map<std::pair<int32_t, int32_t>, double> bytes;
  for (const plan::ReshufflePiece& p : plan.reshuffle) {
    if (p.userWorker == p.fcpWorker) continue;
    const auto key = inward ? std::make_pair(p.userWorker, p.fcpWorker)
                            : std::make_pair(p.fcpWorker, p.userWorker);
    bytes[key] += static_cast<double>((p.end - p.begin) * bytesPerToken);
  }
  return bytes;
}

/// Geometric mean over the forward curve's points of backward / forward efficiency.
double backwardEfficiencyRatio(const HardwareProfile& hw) {
  double logSum = 0;
  const auto& points = hw.forward.points();
  for (const auto& [tokens, fraction] : points) logSum += std::log(hw.backward.at(tokens) / fraction);
  return std::exp(logSum / static_cast<double>(points.size()));
}

/// Merges the flows one sender sends one receiver in one stage into one message, as an
/// all-to-all-v or a grouped send does (a flow sits in the same stage at both ends); this also
/// keeps the number of flows sharing a port at most the number of peers.
void mergeMessages(std::vector<Flow>& flows, std::vector<std::vector<SimStage>>& stages) {
  // The stage holding each flow at its sender and at its receiver.
  std::vector<std::pair<int32_t, int32_t>> stageOfFlow(flows.size(), {-1, -1});
  for (size_t w = 0; w < stages.size(); ++w) {
    for (size_t s = 0; s < stages[w].size(); ++s) {
      for (int32_t f : stages[w][s].flows) {
        auto& at = stageOfFlow[static_cast<size_t>(f)];
        (flows[static_cast<size_t>(f)].src == static_cast<int32_t>(w) ? at.first : at.second) =
            static_cast<int32_t>(s);
      }
    }
  }
  // (src, dst, sender's stage, receiver's stage) -> message
  std::map<std::tuple<int32_t, int32_t, int32_t, int32_t>, int32_t> idOf;
  std::vector<Flow> merged;
  std::vector<int32_t> rename(flows.size());
  for (size_t f = 0; f < flows.size(); ++f) {
    const auto key = std::make_tuple(flows[f].src, flows[f].dst, stageOfFlow[f].first, stageOfFlow[f].second);
    auto [it, fresh] = idOf.try_emplace(key, static_cast<int32_t>(merged.size()));
    if (fresh) {
      merged.push_back(flows[f]);
    } else {
      merged[static_cast<size_t>(it->second)].bytes += flows[f].bytes;
    }
    rename[f] = it->second;
  }
  for (auto& ws : stages) {
    for (SimStage& st : ws) {
      for (int32_t& f : st.flows) f = rename[static_cast<size_t>(f)];
      std::sort(st.flows.begin(), st.flows.end());
      st.flows.erase(std::unique(st.flows.begin(), st.flows.end()), st.flows.end());
    }
  }
  flows = std::move(merged);
}

PassResult runPass(const Plan& plan, const HardwareProfile& hw, const SimOptions& options,
                   bool backward) {
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const auto& passStages = backward ? plan.backward : plan.forward;
  FCP_CHECK(passStages.size() == n, "plan has stages for ", passStages.size(), " workers, not ", n);
  const size_t numT = plan.transfers.size();
  std::vector<Flow> flows;
  flows.reserve(numT * (backward ? 2 : 1));
  for (const plan::Transfer& t : plan.transfers) {
    flows.push_back({t.sender, t.receiver, static_cast<double>(t.bytes)});
  }
  if (backward) {
    for (const plan::Transfer& t : plan.transfers) {
      flows.push_back({t.receiver, t.sender, static_cast<double>(t.bytes)});
    }
  }
  const double bwdScale = 2.5 / backwardEfficiencyRatio(hw);
  std::vector<std::vector<SimStage>> stages(n);
  for (size_t w = 0; w < n; ++w) {
    const auto& ws = passStages[w];
    stages[w].resize(ws.size());
    for (size_t s = 0; s < ws.size(); ++s) {
      const Stage& st = ws[s];
      SimStage& out = stages[w][s];
      out.planStage = static_cast<int32_t>(s);
      double cost = 0;
      for (int32_t p : st.compute) cost += plan.pairs[static_cast<size_t>(p)].cost;
      out.computeSeconds = cost * (backward ? bwdScale : 1.0) / hw.peakFlops;
      out.flows.insert(out.flows.end(), st.send.begin(), st.send.end());
      out.flows.insert(out.flows.end(), st.recv.begin(), st.recv.end());
      for (int32_t t : st.sendGrad) out.flows.push_back(static_cast<int32_t>(numT) + t);
      for (int32_t t : st.recvGrad) out.flows.push_back(static_cast<int32_t>(numT) + t);
    }
    if (stages[w].empty()) stages[w].push_back({0, 0, {}});
  }
  if (options.reshuffle) {
    const auto& a = plan.config.attention;
    const int64_t inBytes = backward ? a.qBytesPerToken() : a.qBytesPerToken() + a.kvBytesPerToken();
    const int64_t outBytes = backward ? a.qBytesPerToken() + a.kvBytesPerToken() : a.oBytesPerToken();
    if (!options.overlapReshuffle) {
      for (auto& s : stages) {
        s.insert(s.begin(), SimStage{-1, 0, {}});
        s.push_back(SimStage{-2, 0, {}});
      }
    }
    for (const bool inward : {true, false}) {
      for (const auto& [key, bytes] : reshuffleMessages(plan, inward, inward ? inBytes : outBytes)) {
        const auto id = static_cast<int32_t>(flows.size());
        flows.push_back({key.first, key.second, bytes});
        for (const int32_t w : {key.first, key.second}) {
          auto& s = stages[static_cast<size_t>(w)];
          (inward ? s.front() : s.back()).flows.push_back(id);
        }
      }
    }
  }
  mergeMessages(flows, stages);
  Engine engine(hw, plan.config.numWorkers, std::move(flows), std::move(stages), options.timelines);
  PassResult r = engine.run();
  for (const plan::BlockPair& p : plan.pairs) {
    r.usefulFlops += backward ? backwardFlops(plan.config.attention, p.visible)
                              : forwardFlops(plan.config.attention, p.visible);
  }
  const double denominator = static_cast<double>(n) * hw.peakFlops * r.timeMs * 1e-3;
  r.mfu = denominator > 0 ? r.usefulFlops / denominator : 0;
  return r;
}

double imbalance(const std::vector<double>& load) {
  double max = 0, sum = 0;
  for (double x : load) {
    max = std::max(max, x);
    sum += x;
  }
  return max > 0 ? (max - sum / static_cast<double>(load.size())) / max : 0;
}

}  // namespace

SimResult simulate(const Plan& plan, const HardwareProfile& hardware, const SimOptions& options) {
  if (!(hardware.peakFlops > 0) || !(hardware.intraNodeBytesPerSecond > 0) ||
      !(hardware.interNodeBytesPerSecond > 0) || hardware.workersPerNode <= 0) {
    throwInvalidArgument("hardware profile '", hardware.name,
                         "': expected positive peak, bandwidths and workers per node");
  }
  SimResult r;
  r.forward = runPass(plan, hardware, options, false);
  if (options.backward) r.backward = runPass(plan, hardware, options, true);
  r.timeMs = r.forward.timeMs + r.backward.timeMs;
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  const double useful = r.forward.usefulFlops + r.backward.usefulFlops;
  const double denominator = static_cast<double>(n) * hardware.peakFlops * r.timeMs * 1e-3;
  r.mfu = denominator > 0 ? useful / denominator : 0;

  std::vector<double> compute(n, 0), bytes(n, 0);
  for (size_t w = 0; w < n; ++w) {
    compute[w] = r.forward.computeMs[w] + (options.backward ? r.backward.computeMs[w] : 0);
    r.meanComputeMs += compute[w] / static_cast<double>(n);
  }
  for (const plan::Transfer& t : plan.transfers) {
    bytes[static_cast<size_t>(t.sender)] += static_cast<double>(t.bytes);
    bytes[static_cast<size_t>(t.receiver)] += static_cast<double>(t.bytes);
    r.transferBytes += t.bytes;
  }
  r.numTransfers = static_cast<int64_t>(plan.transfers.size());
  r.computeImbalance = imbalance(compute);
  r.commImbalance = imbalance(bytes);
  r.meanIdleMs = r.timeMs - r.meanComputeMs;
  const auto& a = plan.config.attention;
  for (const plan::ReshufflePiece& p : plan.reshuffle) {
    if (p.userWorker != p.fcpWorker) {
      r.reshuffleBytes += (p.end - p.begin) * (a.qBytesPerToken() + a.kvBytesPerToken() + a.oBytesPerToken());
    }
  }
  return r;
}

}  // namespace fcp::sim
