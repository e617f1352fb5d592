#include "fcp/sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <queue>
#include <span>
#include <sstream>
#include <tuple>

#include "fcp/core/error.h"
#include "fcp/core/statistics.h"

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
  /// The stage whose communication this stage's compute waits for, counted back from this
  /// one: 1, the stage before (what a stage-by-stage pipeline does), or more where the data the
  /// compute reads arrived earlier (FCP with D buffers computes in stage g + D − 1 what arrived
  /// in stage g).
  int32_t waitBack = 1;
  /// Whether this stage's messages wait for the stage before's compute, which frees the
  /// buffers they land in (FCP's group g reuses group g − D's). Not for the first plan stage
  /// after the reshuffle in's own stage: its buffers are fresh, and that stage's compute holds
  /// nothing its messages need.
  bool afterCompute = true;
  /// The stage whose messages (and every earlier stage's) must be done before this stage's are
  /// posted, counted back: 1, one stage's messages after another's. More lets them fly beside
  /// the stages' between (the outputs the last compute finishes beside those already final).
  int32_t commWaitBack = 1;
};

/// The event-driven engine for one pass.
///
/// Terms: a *port* is one direction of one link kind at one worker (NVLink out, NVLink in,
/// NIC out, NIC in); a flow uses the sender's out port and the receiver's in port of one kind.
/// A flow is *posted* by each endpoint when it enters the stage holding it and *active* once
/// both have; an active flow drains at rate min over its two ports of capacity / active flows
/// on the port, recomputed whenever a flow starts or ends on either port. Each active flow has
/// one drain time, kept in an indexed 4-ary heap (`heap_`, position `FlowState::heapPos`) and
/// moved in place when its rate changes; compute ends and arrivals go through `queue_`. A
/// worker runs two streams through its stages. Its communication enters stage i once stage
/// i − 1's compute is done (the buffers stage i receives into are freed by that compute; not
/// where SimStage::afterCompute says otherwise) and stage i − commWaitBack's communication and
/// every earlier stage's are done (commWaitBack 1, one stage's messages after another's, but
/// for the reshuffle out's last stage); its compute enters stage i once stage i − 1's compute
/// and stage i − waitBack's communication are done (the data its pairs read has arrived). With
/// every waitBack 1 and the defaults, both streams enter each stage together: the
/// stage-by-stage lock-step.
///
/// Rates are recomputed once per instant, not once per start or end: a port whose flow set
/// changed is *dirty*, and before time moves past the instant every dirty port's flows are
/// re-rated, and only a flow whose rate actually changed gets a new drain event. An
/// all-to-all of P workers posts P^2 flows at one instant; re-rating on every start would push
/// O(P^3) events (minutes and gigabytes at 256 workers), this pushes O(P^2).
///
/// Layout, for speed at thousands of workers (a million flows, tens of millions of re-rates):
/// everything the inner loops touch about a flow sits in one FlowState; a port's active list
/// removes in O(1) (each flow remembers its slot in both lists); heap entries carry their
/// time, so sifting compares without chasing flows. None of this changes a result: the heap
/// orders by (time, flow id), a total order, so the order flows are re-rated in is immaterial.
class Engine {
 public:
  Engine(const HardwareProfile& hw, int64_t numWorkers, const std::vector<Flow>& flows,
         std::vector<std::vector<SimStage>> stages, bool keepTimelines)
      : hw_(hw),
        n_(static_cast<size_t>(numWorkers)),
        stages_(std::move(stages)),
        keep_(keepTimelines) {
    flow_.resize(flows.size());
    for (size_t i = 0; i < flows.size(); ++i) {
      FlowState& s = flow_[i];
      const bool near = sameNode(flows[i].src, flows[i].dst);
      s.remaining = flows[i].bytes;
      s.outPort = 4 * flows[i].src + (near ? 0 : 2);
      s.inPort = 4 * flows[i].dst + (near ? 1 : 3);
      s.src = flows[i].src;
      s.dst = flows[i].dst;
    }
    active_.resize(4 * n_);
    isDirty_.assign(4 * n_, 0);
    worker_.resize(n_);
    size_t entries = 0;
    for (size_t w = 0; w < n_; ++w) {
      worker_[w].firstLeft = entries;
      entries += stages_[w].size();
      for (size_t i = 0; i < stages_[w].size(); ++i) {
        for (const int32_t f : stages_[w][i].flows) {
          FlowState& s = flow_[static_cast<size_t>(f)];
          (s.src == static_cast<int32_t>(w) ? s.srcStage : s.dstStage) = static_cast<int32_t>(i);
        }
      }
    }
    left_.assign(entries, 0);
    result_.computeMs.assign(n_, 0);
    result_.finishMs.assign(n_, 0);
    if (keep_) {
      result_.timelines.resize(n_);
      for (size_t w = 0; w < n_; ++w) {
        result_.timelines[w].resize(stages_[w].size());
        for (size_t i = 0; i < stages_[w].size(); ++i) {
          result_.timelines[w][i].stage = stages_[w][i].planStage;
        }
      }
    }
  }

  PassResult run() {
    for (size_t w = 0; w < n_; ++w) advance(static_cast<int32_t>(w), 0);
    constexpr double kNever = std::numeric_limits<double>::infinity();
    while (!queue_.empty() || !heap_.empty() || !dirty_.empty()) {
      const double nextEvent = queue_.empty() ? kNever : queue_.top().time;
      const double nextDrain = heap_.empty() ? kNever : heap_[0].time;
      if (!dirty_.empty() && std::min(nextEvent, nextDrain) > dirtyTime_) {
        flush(dirtyTime_);
        continue;
      }
      if (nextDrain <= nextEvent) {
        const int32_t f = heap_[0].flow;
        heapRemoveTop();
        drained(f, nextDrain);
        continue;
      }
      const Event e = queue_.top();
      queue_.pop();
      switch (e.kind) {
        case kComputeDone: {
          Worker& k = worker_[static_cast<size_t>(e.id)];
          if (keep_) span(e.id, k.computeDone).computeEndMs = e.time * 1e3;
          k.computing = false;
          ++k.computeDone;
          advance(e.id, e.time);
          break;
        }
        case kArrived: {
          const FlowState& f = flow_[static_cast<size_t>(e.id)];
          arrived(f.src, f.srcStage, e.time);
          arrived(f.dst, f.dstStage, e.time);
          break;
        }
      }
    }
    for (size_t w = 0; w < n_; ++w) {
      const Worker& k = worker_[w];
      if (k.commDone < stages_[w].size() || k.computeDone < stages_[w].size()) {
        throw Error(ErrorCode::kInvalidPlan,
                    "simulation stalls: worker " + std::to_string(w) + " waits forever in " +
                        stageName(stages_[w][std::min(k.commDone, k.computeDone)].planStage));
      }
      result_.timeMs = std::max(result_.timeMs, result_.finishMs[w]);
      if (keep_) {
        for (StageSpan& sp : result_.timelines[w]) {
          sp.startMs = std::min(sp.computeStartMs, sp.commStartMs);
          sp.endMs = std::max(sp.computeEndMs, sp.commEndMs);
        }
      }
    }
    return std::move(result_);
  }

 private:
  enum Kind { kComputeDone, kArrived };
  /// A worker's two streams: the stages whose messages it has posted, how many of the first of
  /// them are done (commDone: every stage before it), the stages it has computed, and whether
  /// it computes now.
  struct Worker {
    size_t commPosted = 0, commDone = 0, computeDone = 0;
    bool computing = false, finished = false;
    size_t firstLeft = 0;  ///< its stages' entries in left_
  };
  struct Event {
    double time;
    uint64_t seq;
    Kind kind;
    int32_t id;
    bool operator>(const Event& o) const { return std::tie(time, seq) > std::tie(o.time, o.seq); }
  };
  /// What the engine keeps of one flow.
  struct FlowState {
    double remaining = 0;  ///< bytes left as of `last`
    double rate = 0;       ///< bytes per second since `last`
    double last = 0;
    int32_t outPort = 0, inPort = 0;    ///< port indices, 4 × worker + kind
    int32_t outSlot = -1, inSlot = -1;  ///< index in active_[outPort] / active_[inPort]
    int32_t heapPos = -1;               ///< index in heap_, −1 when not draining
    int32_t src = 0, dst = 0;
    int32_t srcStage = 0, dstStage = 0;  ///< the stage holding it at each end
    int32_t posted = 0;  ///< endpoints that have posted it (0, 1, 2)
  };
  struct Drain {
    double time;
    int32_t flow;
  };

  /// A time that is not finite (work over rates so small that a duration overflows) would
  /// break both queues' order: refused, never simulated. Profiles bound their rates
  /// (hardware.cc), so this is a last guard.
  static void checkFinite(double time) {
    if (!std::isfinite(time)) {
      throwInvalidArgument("a simulated time of ", time,
                           " s: expected finite times (is a rate in the hardware profile far too "
                           "small?)");
    }
  }

  void push(double time, Kind kind, int32_t id) {
    checkFinite(time);
    queue_.push({time, seq_++, kind, id});
  }

  // The indexed 4-ary min-heap of drain times; ties broken by flow id, so the order is
  // deterministic.
  static bool before(const Drain& a, const Drain& b) {
    return a.time < b.time || (a.time == b.time && a.flow < b.flow);
  }
  void heapPlace(size_t i, const Drain& d) {
    heap_[i] = d;
    flow_[static_cast<size_t>(d.flow)].heapPos = static_cast<int32_t>(i);
  }
  void siftUp(size_t i) {
    const Drain d = heap_[i];
    while (i > 0 && before(d, heap_[(i - 1) / 4])) {
      heapPlace(i, heap_[(i - 1) / 4]);
      i = (i - 1) / 4;
    }
    heapPlace(i, d);
  }
  void siftDown(size_t i) {
    const Drain d = heap_[i];
    const size_t size = heap_.size();
    for (;;) {
      const size_t first = 4 * i + 1;
      if (first >= size) break;
      size_t best = first;
      const size_t stop = std::min(first + 4, size);
      for (size_t c = first + 1; c < stop; ++c) {
        if (before(heap_[c], heap_[best])) best = c;
      }
      if (!before(heap_[best], d)) break;
      heapPlace(i, heap_[best]);
      i = best;
    }
    heapPlace(i, d);
  }
  /// Sets flow f's drain time, inserting it or moving it within the heap.
  void scheduleDrain(int32_t f, double time) {
    checkFinite(time);
    FlowState& s = flow_[static_cast<size_t>(f)];
    if (s.heapPos < 0) {
      heap_.push_back({time, f});
      siftUp(heap_.size() - 1);
      return;
    }
    const auto at = static_cast<size_t>(s.heapPos);
    const bool earlier = before({time, f}, heap_[at]);
    heap_[at].time = time;
    if (earlier) {
      siftUp(at);
    } else {
      siftDown(at);
    }
  }
  void heapRemoveTop() {
    flow_[static_cast<size_t>(heap_[0].flow)].heapPos = -1;
    const Drain last = heap_.back();
    heap_.pop_back();
    if (!heap_.empty()) {
      heap_[0] = last;
      siftDown(0);
    }
  }

  bool sameNode(int32_t a, int32_t b) const {
    return a / hw_.workersPerNode == b / hw_.workersPerNode;
  }
  double capacity(int32_t port) const {
    return port % 4 < 2 ? hw_.intraNodeBytesPerSecond : hw_.interNodeBytesPerSecond;
  }
  double share(int32_t port) const {
    return capacity(port) / static_cast<double>(active_[static_cast<size_t>(port)].size());
  }

  /// Enters every stage worker w's two streams may enter at time t (the rules above), and
  /// records when the worker has finished both.
  void advance(int32_t w, double t) {
    const auto wi = static_cast<size_t>(w);
    Worker& k = worker_[wi];
    const std::vector<SimStage>& own = stages_[wi];
    for (bool moved = true; moved;) {
      moved = false;
      if (k.commPosted < own.size() &&
          k.computeDone + (own[k.commPosted].afterCompute ? 0 : 1) >= k.commPosted &&
          static_cast<int64_t>(k.commDone) >
              static_cast<int64_t>(k.commPosted) - own[k.commPosted].commWaitBack) {
        const size_t i = k.commPosted++;
        const SimStage& s = own[i];
        if (keep_) span(w, i).commStartMs = t * 1e3;
        left_[k.firstLeft + i] = static_cast<int32_t>(s.flows.size());
        if (s.flows.empty()) {
          if (keep_) span(w, i).commEndMs = t * 1e3;
          settle(k);
        }
        for (int32_t f : s.flows) {
          if (++flow_[static_cast<size_t>(f)].posted == 2) start(f, t);
        }
        moved = true;
      }
      if (!k.computing && k.computeDone < own.size()) {
        const SimStage& s = own[k.computeDone];
        const auto waitFor = static_cast<int64_t>(k.computeDone) - s.waitBack;
        if (waitFor < 0 || static_cast<int64_t>(k.commDone) > waitFor) {
          if (keep_) span(w, k.computeDone).computeStartMs = t * 1e3;
          k.computing = true;
          result_.computeMs[wi] += s.computeSeconds * 1e3;
          push(t + s.computeSeconds, kComputeDone, w);
          moved = true;
        }
      }
    }
    if (!k.finished && k.commDone == own.size() && k.computeDone == own.size()) {
      k.finished = true;
      result_.finishMs[wi] = t * 1e3;
    }
  }

  /// Counts worker k's stages whose messages are done from the first: each posted one whose
  /// messages all are.
  void settle(Worker& k) {
    while (k.commDone < k.commPosted && left_[k.firstLeft + k.commDone] == 0) ++k.commDone;
  }

  /// One of worker w's messages of its stage `stage` is done.
  void arrived(int32_t w, int32_t stage, double t) {
    Worker& k = worker_[static_cast<size_t>(w)];
    if (--left_[k.firstLeft + static_cast<size_t>(stage)] > 0) return;
    if (keep_) span(w, static_cast<size_t>(stage)).commEndMs = t * 1e3;
    settle(k);
    advance(w, t);
  }

  /// Worker w's record of its stage i (timelines only); run() sets its startMs and endMs from
  /// the two streams' spans.
  StageSpan& span(int32_t w, size_t i) { return result_.timelines[static_cast<size_t>(w)][i]; }

  /// Marks `port` for re-rating at time t (the current instant).
  void markDirty(int32_t port, double t) {
    dirtyTime_ = t;
    const auto p = static_cast<size_t>(port);
    if (!isDirty_[p]) {
      isDirty_[p] = 1;
      dirty_.push_back(port);
    }
  }

  /// Re-rates the flows of every dirty port at time t: a flow whose rate changed is settled at
  /// its old rate up to t and gets a new drain event.
  void flush(double t) {
    for (const int32_t port : dirty_) {
      isDirty_[static_cast<size_t>(port)] = 0;
      const auto& list = active_[static_cast<size_t>(port)];
      if (list.empty()) continue;
      const double mine = share(port);
      for (const int32_t g : list) {
        FlowState& s = flow_[static_cast<size_t>(g)];
        const double rate = std::min(mine, share(s.outPort == port ? s.inPort : s.outPort));
        if (rate == s.rate) continue;
        s.remaining = std::max(0.0, s.remaining - s.rate * (t - s.last));
        s.last = t;
        s.rate = rate;
        scheduleDrain(g, t + s.remaining / rate);
      }
    }
    dirty_.clear();
  }

  void start(int32_t f, double t) {
    FlowState& s = flow_[static_cast<size_t>(f)];
    auto& out = active_[static_cast<size_t>(s.outPort)];
    auto& in = active_[static_cast<size_t>(s.inPort)];
    s.outSlot = static_cast<int32_t>(out.size());
    out.push_back(f);
    s.inSlot = static_cast<int32_t>(in.size());
    in.push_back(f);
    s.rate = 0;
    s.last = t;
    markDirty(s.outPort, t);
    markDirty(s.inPort, t);
  }

  /// Removes flow f from `port`'s active list (at `slot`), moving the last entry into its place.
  void unlist(int32_t port, int32_t slot) {
    auto& list = active_[static_cast<size_t>(port)];
    const int32_t moved = list.back();
    list[static_cast<size_t>(slot)] = moved;
    list.pop_back();
    FlowState& m = flow_[static_cast<size_t>(moved)];
    (m.outPort == port ? m.outSlot : m.inSlot) = slot;
  }

  void drained(int32_t f, double t) {
    FlowState& s = flow_[static_cast<size_t>(f)];
    unlist(s.outPort, s.outSlot);
    unlist(s.inPort, s.inSlot);
    markDirty(s.outPort, t);
    markDirty(s.inPort, t);
    const double latency =
        s.outPort % 4 == 0 ? hw_.intraNodeLatencySeconds : hw_.interNodeLatencySeconds;
    push(t + latency, kArrived, f);
  }

  const HardwareProfile& hw_;
  size_t n_;
  std::vector<FlowState> flow_;
  std::vector<std::vector<SimStage>> stages_;
  bool keep_;
  std::vector<Drain> heap_;
  std::vector<std::vector<int32_t>> active_;
  std::vector<uint8_t> isDirty_;
  std::vector<int32_t> dirty_;
  double dirtyTime_ = 0;
  std::vector<Worker> worker_;
  /// Per worker and posted stage (from Worker::firstLeft), its messages not yet done.
  std::vector<int32_t> left_;  // a stage holds under 2^31 messages (flow ids are int32_t)
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  uint64_t seq_ = 0;
  PassResult result_;
};

/// The token ranges of `plan`'s blocks in the packed batch: (begin, end, block), sorted by begin.
struct BlockRange {
  int64_t begin = 0, end = 0;
  int32_t block = 0;
};
std::vector<BlockRange> blockRanges(const Plan& plan) {
  std::vector<int64_t> starts(plan.batch.sequenceLengths.size() + 1, 0);
  for (size_t i = 0; i < plan.batch.sequenceLengths.size(); ++i)
    starts[i + 1] = starts[i] + plan.batch.sequenceLengths[i];
  std::vector<BlockRange> ranges;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    for (const plan::Chunk& c : plan.blocks[b].chunks) {
      if (c.numTokens() <= 0) continue;  // holds no token
      const int64_t begin = starts[static_cast<size_t>(c.sequence)] + c.begin;
      ranges.push_back({begin, begin + c.numTokens(), static_cast<int32_t>(b)});
    }
  }
  std::sort(ranges.begin(), ranges.end(), [](const BlockRange& x, const BlockRange& y) {
    return std::tie(x.begin, x.end, x.block) < std::tie(y.begin, y.end, y.block);
  });
  return ranges;
}

/// Calls f(block) for each block of `ranges` holding a token of [begin, end).
template <typename F>
void forBlocksIn(const std::vector<BlockRange>& ranges, int64_t begin, int64_t end, F&& f) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), begin,
                             [](int64_t token, const BlockRange& r) { return token < r.begin; });
  if (it != ranges.begin()) --it;
  for (; it != ranges.end() && it->begin < end; ++it) {
    if (it->end > begin) f(it->block);
  }
}

/// One reshuffle message: (source, destination, whether it waits for the pass's last compute).
using ReshuffleKey = std::tuple<int32_t, int32_t, bool>;

/// Off-worker reshuffle bytes per (source, destination), for one direction. Outward, with
/// `late` (per block), a piece holding a late block's tokens is a message of its own, which
/// leaves only once its worker's last stage has computed.
std::map<ReshuffleKey, double> reshuffleMessages(const Plan& plan, bool inward,
                                                 int64_t bytesPerToken,
                                                 const std::vector<uint8_t>& late,
                                                 const std::vector<BlockRange>& ranges) {
  std::map<ReshuffleKey, double> bytes;
  for (const plan::ReshufflePiece& p : plan.reshuffle) {
    if (p.userWorker == p.fcpWorker) continue;
    bool waits = false;
    if (!inward && !late.empty()) {
      forBlocksIn(ranges, p.begin, p.end,
                  [&](int32_t b) { waits = waits || late[static_cast<size_t>(b)] != 0; });
    }
    const auto key = inward ? ReshuffleKey{p.userWorker, p.fcpWorker, false}
                            : ReshuffleKey{p.fcpWorker, p.userWorker, waits};
    bytes[key] += static_cast<double>((p.end - p.begin) * bytesPerToken);
  }
  return bytes;
}

/// Seconds each of the plan's pairs computes for on `hw` in one direction: its visible entries
/// at the hardware's own efficiency, f(tokens of each sequence in the Q block), from the
/// hardware's forward or backward curve (plan::blockPairs, as the planner costs pairs). The
/// plan's own pair costs are not used: they are forward costs, at whatever curve the planner
/// was given.
std::vector<double> pairSeconds(const Plan& plan, const HardwareProfile& hw, bool backward) {
  const EfficiencyCurve& curve = backward ? hw.backward : hw.forward;
  const AttentionConfig& attention = plan.config.attention;
  const std::vector<plan::BlockPair> pairs =
      plan::blockPairs(plan.blocks, CostModel{attention, curve, curve});
  // blockPairs' costs are forward FLOPs / f; the backward does more FLOPs per entry.
  const double flopScale =
      backward ? backwardFlops(attention, 1) / forwardFlops(attention, 1) : 1.0;
  const auto byBlocks = [](const plan::BlockPair& a, const plan::BlockPair& b) {
    return std::tie(a.qBlock, a.kvBlock) < std::tie(b.qBlock, b.kvBlock);
  };
  std::vector<double> seconds(plan.pairs.size());
  for (size_t p = 0; p < plan.pairs.size(); ++p) {
    const plan::BlockPair& want = plan.pairs[p];
    const auto it = std::lower_bound(pairs.begin(), pairs.end(), want, byBlocks);
    const bool found =
        it != pairs.end() && it->qBlock == want.qBlock && it->kvBlock == want.kvBlock;
    if (!found || it->visible != want.visible) {
      std::ostringstream message;
      message << "plan pair " << p << " (Q block " << want.qBlock << ", KV block " << want.kvBlock
              << ") says " << want.visible << " visible entries; its blocks give "
              << (found ? it->visible : 0);
      throw Error(ErrorCode::kInvalidPlan, message.str());
    }
    seconds[p] = it->cost * flopScale / hw.peakFlops;
  }
  return seconds;
}

/// Compute seconds of one worker's stage run as one launch (KernelLaunch::kStage). Each
/// pair's visible entries are split by sequence; in the forward they are grouped by (Q block,
/// sequence) and run at f(the keys of that sequence in the group's KV blocks), in the backward
/// by (KV block, sequence) at f(the queries of that sequence in the group's Q blocks), on the
/// pass's own curve.
class FusedStageTimer {
 public:
  FusedStageTimer(const Plan& plan, const HardwareProfile& hw, bool backward)
      : plan_(plan),
        curve_(backward ? hw.backward : hw.forward),
        backward_(backward),
        peak_(hw.peakFlops),
        bySequence_(plan.blocks.size()) {
    for (size_t b = 0; b < plan.blocks.size(); ++b) {
      bySequence_[b] = plan.blocks[b].chunks;
      std::stable_sort(
          bySequence_[b].begin(), bySequence_[b].end(),
          [](const plan::Chunk& x, const plan::Chunk& y) { return x.sequence < y.sequence; });
    }
  }

  double seconds(std::span<const int32_t> stagePairs) {
    // Pairs grouped by the block a kernel parallelises over: the Q block forward, the KV
    // block backward.
    order_.assign(stagePairs.begin(), stagePairs.end());
    const auto keyOf = [&](int32_t p) {
      const plan::BlockPair& pair = plan_.pairs[static_cast<size_t>(p)];
      return backward_ ? pair.kvBlock : pair.qBlock;
    };
    std::sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) {
      return std::make_pair(keyOf(a), a) < std::make_pair(keyOf(b), b);
    });
    double total = 0;
    for (size_t i = 0; i < order_.size();) {
      const int32_t key = keyOf(order_[i]);
      parts_.clear();
      for (; i < order_.size() && keyOf(order_[i]) == key; ++i) addPair(order_[i]);
      std::sort(parts_.begin(), parts_.end());
      for (size_t j = 0; j < parts_.size();) {
        int64_t visible = 0, loop = 0;
        const int32_t sequence = parts_[j].sequence;
        for (; j < parts_.size() && parts_[j].sequence == sequence; ++j) {
          visible += parts_[j].visible;
          loop += parts_[j].loopTokens;
        }
        const double flops = backward_ ? backwardFlops(plan_.config.attention, visible)
                                       : forwardFlops(plan_.config.attention, visible);
        total += flops / (curve_.at(loop) * peak_);
      }
    }
    return total;
  }

 private:
  struct Part {
    int32_t sequence;
    int64_t visible;
    int64_t loopTokens;  ///< keys (forward) or queries (backward) of the sequence in the pair
    friend bool operator<(const Part& a, const Part& b) {
      return std::tie(a.sequence, a.visible, a.loopTokens) <
             std::tie(b.sequence, b.visible, b.loopTokens);
    }
  };

  /// One pair's visible entries and loop tokens, per sequence its two blocks share. Throws
  /// Error(kInvalidPlan) when the pair's own count of visible entries is not its blocks', as
  /// pairSeconds does.
  void addPair(int32_t p) {
    const plan::BlockPair& pair = plan_.pairs[static_cast<size_t>(p)];
    const auto& q = bySequence_[static_cast<size_t>(pair.qBlock)];
    const auto& k = bySequence_[static_cast<size_t>(pair.kvBlock)];
    const MaskKind mask = plan_.config.attention.mask;
    int64_t pairVisible = 0;
    size_t qi = 0, ki = 0;
    while (qi < q.size() && ki < k.size()) {
      if (q[qi].sequence < k[ki].sequence) {
        ++qi;
      } else if (k[ki].sequence < q[qi].sequence) {
        ++ki;
      } else {
        const int32_t sequence = q[qi].sequence;
        size_t qj = qi, kj = ki;
        while (qj < q.size() && q[qj].sequence == sequence) ++qj;
        while (kj < k.size() && k[kj].sequence == sequence) ++kj;
        int64_t visible = 0, qTokens = 0, kTokens = 0;
        for (size_t a = qi; a < qj; ++a) qTokens += q[a].numTokens();
        for (size_t b = ki; b < kj; ++b) kTokens += k[b].numTokens();
        for (size_t a = qi; a < qj; ++a) {
          for (size_t b = ki; b < kj; ++b) {
            visible += visibleEntries(mask, q[a].begin, q[a].end, k[b].begin, k[b].end);
          }
        }
        if (visible > 0) parts_.push_back({sequence, visible, backward_ ? qTokens : kTokens});
        pairVisible += visible;
        qi = qj;
        ki = kj;
      }
    }
    if (pairVisible != pair.visible) {
      std::ostringstream message;
      message << "plan pair " << p << " (Q block " << pair.qBlock << ", KV block " << pair.kvBlock
              << ") says " << pair.visible << " visible entries; its blocks give " << pairVisible;
      throw Error(ErrorCode::kInvalidPlan, message.str());
    }
  }

  const Plan& plan_;
  const EfficiencyCurve& curve_;
  bool backward_;
  double peak_;
  std::vector<std::vector<plan::Chunk>> bySequence_;
  std::vector<int32_t> order_;
  std::vector<Part> parts_;
};

/// Merges the flows one sender sends one receiver in one stage into one message, as an
/// all-to-all-v or a grouped send does (a flow sits in the same stage at both ends); this also
/// keeps the number of flows sharing a port at most the number of peers. A message takes the
/// place of its lowest-numbered flow, so messages keep the order of their first flows.
void mergeMessages(std::vector<Flow>& flows, std::vector<std::vector<SimStage>>& stages) {
  // The stage holding each flow at its receiver.
  std::vector<int32_t> recvStage(flows.size(), -1);
  for (size_t w = 0; w < stages.size(); ++w) {
    for (size_t s = 0; s < stages[w].size(); ++s) {
      for (int32_t f : stages[w][s].flows) {
        if (flows[static_cast<size_t>(f)].dst == static_cast<int32_t>(w)) {
          recvStage[static_cast<size_t>(f)] = static_cast<int32_t>(s);
        }
      }
    }
  }
  // Within each sender's stage, flows with the same (receiver, receiver's stage) are one
  // message; `first` maps each flow to the lowest-numbered flow of its message.
  std::vector<int32_t> first(flows.size());
  std::vector<std::tuple<int32_t, int32_t, int32_t>> local;  // (dst, recv stage, flow)
  for (size_t w = 0; w < stages.size(); ++w) {
    for (const SimStage& st : stages[w]) {
      local.clear();
      for (int32_t f : st.flows) {
        const Flow& flow = flows[static_cast<size_t>(f)];
        if (flow.src == static_cast<int32_t>(w))
          local.emplace_back(flow.dst, recvStage[static_cast<size_t>(f)], f);
      }
      std::sort(local.begin(), local.end());
      for (size_t i = 0; i < local.size(); ++i) {
        const bool sameAsPrevious = i > 0 && std::get<0>(local[i]) == std::get<0>(local[i - 1]) &&
                                    std::get<1>(local[i]) == std::get<1>(local[i - 1]);
        first[static_cast<size_t>(std::get<2>(local[i]))] =
            sameAsPrevious ? first[static_cast<size_t>(std::get<2>(local[i - 1]))]
                           : std::get<2>(local[i]);
      }
    }
  }
  std::vector<Flow> merged;
  std::vector<int32_t> rename(flows.size());
  for (size_t f = 0; f < flows.size(); ++f) {
    const auto head = static_cast<size_t>(first[f]);
    if (head == f) {
      rename[f] = static_cast<int32_t>(merged.size());
      merged.push_back(flows[f]);
    } else {
      rename[f] = rename[head];
      merged[static_cast<size_t>(rename[f])].bytes += flows[f].bytes;
    }
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

/// How many stages back from stage s the communication is that worker w's compute in stage s
/// waits for: the latest stage before s in which a KV block its pairs read arrived (`arrivals`,
/// its (block, stage) pairs sorted), and at least the stage that brings the reshuffle in: with
/// `reshuffleStage` its own stage before stage 0 (plan stage s is then the engine's s + 1, and
/// −1 counts back to it), otherwise stage 0 from stage 1 on (a floor kept from when stage 0
/// held the reshuffle in; without one it binds nothing a figure shows). A compute that reads a
/// block arriving in its own stage or later, or never, waits as a stage-by-stage pipeline would:
/// for the stage before (1), as does every compute of a plan without block owners.
int32_t computeWaitBack(const Plan& plan, const Stage& stage, int32_t w, int32_t s,
                        const std::vector<std::pair<int32_t, int32_t>>& arrivals,
                        bool reshuffleStage) {
  if (plan.owner.size() != plan.blocks.size()) return 1;  // a plan made by hand: no owners
  int32_t need = s > 0 && !reshuffleStage ? 0 : -1;
  for (const int32_t p : stage.compute) {
    const int32_t kv = plan.pairs[static_cast<size_t>(p)].kvBlock;
    if (plan.owner[static_cast<size_t>(kv)] == w) continue;
    // The latest arrival of kv before stage s.
    auto it = std::lower_bound(arrivals.begin(), arrivals.end(), std::make_pair(kv, s));
    if (it == arrivals.begin() || std::prev(it)->first != kv) return 1;
    need = std::max(need, std::prev(it)->second);
  }
  return s - need;
}

/// Per block of `plan`, whether its worker holds its tokens before the reshuffle in: no piece
/// of the reshuffle moves any of them.
std::vector<uint8_t> blocksAtHome(const Plan& plan, const std::vector<BlockRange>& ranges) {
  std::vector<uint8_t> home(plan.blocks.size(), 1);
  for (const plan::ReshufflePiece& p : plan.reshuffle) {
    if (p.userWorker != p.fcpWorker)
      forBlocksIn(ranges, p.begin, p.end, [&](int32_t b) { home[static_cast<size_t>(b)] = 0; });
  }
  return home;
}

/// Per block of `plan`, whether its result (forward O; backward dQ, dK, dV) is final only once
/// its worker's last stage of the pass has computed: a pair of that stage reads it as its Q
/// block, or (backward) as its KV block, or a dK/dV partial for it comes back in that stage.
std::vector<uint8_t> blocksFinishingLast(const Plan& plan, const plan::Stages& pass,
                                         bool backward) {
  std::vector<uint8_t> late(plan.blocks.size(), 0);
  for (size_t w = 0; w < pass.size(); ++w) {
    if (pass[w].size() == 0) continue;
    const Stage last = pass[w][pass[w].size() - 1];
    for (const int32_t p : last.compute) {
      const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
      late[static_cast<size_t>(pair.qBlock)] = 1;
      if (backward) late[static_cast<size_t>(pair.kvBlock)] = 1;
    }
    for (const int32_t t : last.recvGrad)
      late[static_cast<size_t>(plan.transfers[static_cast<size_t>(t)].block)] = 1;
  }
  return late;
}

/// What the engine runs for one pass: the flows, and each worker's stages (flow ids index
/// `flows`), before messages are merged.
struct PassGraph {
  std::vector<Flow> flows;
  std::vector<std::vector<SimStage>> stages;
};

/// The pass graph of `plan`: its stages' compute (timed on `hw` as its launch says, plus
/// merges), KV transfers (backward also dK/dV returns) and, if asked, the reshuffle.
PassGraph buildPass(const Plan& plan, const HardwareProfile& hw, const SimOptions& options,
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
  const bool perStage = hw.launch == KernelLaunch::kStage;
  std::vector<double> seconds;
  std::optional<FusedStageTimer> fused;
  if (perStage) {
    fused.emplace(plan, hw, backward);
  } else {
    seconds = pairSeconds(plan, hw, backward);
  }
  std::vector<std::vector<SimStage>> stages(n);
  // This stage's Q blocks that compute with remote KV, once per pair (kPair) or per stage.
  std::vector<int32_t> merged;
  // The seconds of computing `pairs` on worker w, merges included.
  const auto computeSeconds = [&](std::span<const int32_t> pairs, size_t w) {
    double total = fused ? fused->seconds(pairs) : 0.0;
    merged.clear();
    for (int32_t p : pairs) {
      if (!fused) total += seconds[static_cast<size_t>(p)];
      if (hw.mergeSecondsPerElement == 0) continue;
      const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
      if (plan.owner[static_cast<size_t>(pair.kvBlock)] != static_cast<int32_t>(w))
        merged.push_back(pair.qBlock);
    }
    if (perStage) {
      std::sort(merged.begin(), merged.end());
      merged.erase(std::unique(merged.begin(), merged.end()), merged.end());
    }
    for (const int32_t q : merged) {
      total += hw.mergeSecondsPerElement *
               static_cast<double>(plan.blocks[static_cast<size_t>(q)].numTokens() *
                                   plan.config.attention.numHeadsQ * plan.config.attention.headDim);
    }
    return total;
  };
  // The reshuffle in has a stage of its own before stage 0: apart (the ablation steps), or
  // overlapped (reshuffleFirst, where some piece moves), computing beside it the pairs whose
  // inputs the worker holds already (forward its Q and its own KV block, backward the Q block
  // whose dO comes in), while stage 0 computes the rest once it is in and sends only then (what
  // it sends may be coming in). Either way computes wait for that stage, not for stage 0's.
  const bool reshuffleApart = options.reshuffle && !options.overlapReshuffle;
  const bool reshuffleFirst =
      options.reshuffle && options.overlapReshuffle && plan.owner.size() == plan.blocks.size() &&
      std::any_of(plan.reshuffle.begin(), plan.reshuffle.end(),
                  [](const plan::ReshufflePiece& p) { return p.userWorker != p.fcpWorker; });
  const std::vector<BlockRange> ranges =
      reshuffleFirst ? blockRanges(plan) : std::vector<BlockRange>{};
  const std::vector<uint8_t> home =
      reshuffleFirst ? blocksAtHome(plan, ranges) : std::vector<uint8_t>{};
  std::vector<int32_t> ready, waiting;
  // (block, stage) of each block this worker receives in the pass.
  std::vector<std::pair<int32_t, int32_t>> arrivals;
  const bool multiBuffer = hw.pipeline == Pipeline::kMultiBuffer;
  for (size_t w = 0; w < n; ++w) {
    const auto& ws = passStages[w];
    arrivals.clear();
    for (size_t s = 0; s < ws.size() && multiBuffer; ++s) {
      for (const int32_t t : ws[s].recv) {
        arrivals.emplace_back(plan.transfers[static_cast<size_t>(t)].block,
                              static_cast<int32_t>(s));
      }
    }
    std::sort(arrivals.begin(), arrivals.end());
    stages[w].clear();
    stages[w].reserve(ws.size() + 1);
    for (size_t s = 0; s < ws.size(); ++s) {
      const Stage& st = ws[s];
      SimStage out;
      out.planStage = static_cast<int32_t>(s);
      if (multiBuffer) {
        out.waitBack = computeWaitBack(plan, st, static_cast<int32_t>(w), static_cast<int32_t>(s),
                                       arrivals, reshuffleApart || reshuffleFirst);
      }
      std::span<const int32_t> pairs = st.compute;
      if (s == 0 && !home.empty()) {
        // The reshuffle in's own stage first, computing the pairs whose blocks it does not
        // move; stage 0 computes the rest once it is in (waitBack counts back to it).
        ready.clear();
        waiting.clear();
        for (const int32_t p : st.compute) {
          const plan::BlockPair& pair = plan.pairs[static_cast<size_t>(p)];
          const auto kv = static_cast<size_t>(pair.kvBlock);
          const bool held =
              home[static_cast<size_t>(pair.qBlock)] != 0 &&
              (backward || (plan.owner[kv] == static_cast<int32_t>(w) && home[kv] != 0));
          (held ? ready : waiting).push_back(p);
        }
        stages[w].push_back(SimStage{kReshuffleIn, computeSeconds(ready, w), {}});
        pairs = waiting;
        out.afterCompute = false;
      }
      out.computeSeconds = computeSeconds(pairs, w);
      out.flows.insert(out.flows.end(), st.send.begin(), st.send.end());
      out.flows.insert(out.flows.end(), st.recv.begin(), st.recv.end());
      for (int32_t t : st.sendGrad) out.flows.push_back(static_cast<int32_t>(numT) + t);
      for (int32_t t : st.recvGrad) out.flows.push_back(static_cast<int32_t>(numT) + t);
      stages[w].push_back(std::move(out));
    }
    if (stages[w].empty()) stages[w].push_back({0, 0, {}});
  }
  if (options.reshuffle) {
    const auto& a = plan.config.attention;
    const int64_t inBytes =
        backward ? a.qBytesPerToken() : a.qBytesPerToken() + a.kvBytesPerToken();
    const int64_t outBytes =
        backward ? a.qBytesPerToken() + a.kvBytesPerToken() : a.oBytesPerToken();
    if (!options.overlapReshuffle) {
      for (auto& s : stages) {
        s.insert(s.begin(), SimStage{kReshuffleIn, 0, {}});
        s.push_back(SimStage{kReshuffleOut, 0, {}});
      }
    }
    // Overlapping the last stage, the reshuffle out has two stages after it, at both ends: the
    // results already final leave once the last stage's messages are done (beside its
    // compute), those it finishes once it has, beside the first if they are still on their way.
    const std::vector<uint8_t> late =
        reshuffleFirst ? blocksFinishingLast(plan, passStages, backward) : std::vector<uint8_t>{};
    const auto outward = reshuffleMessages(plan, false, outBytes, late, ranges);
    std::vector<size_t> early(n), after(n);  // where each worker's outward messages go
    for (size_t w = 0; w < n; ++w) early[w] = after[w] = stages[w].size() - 1;
    if (reshuffleFirst) {
      std::vector<uint8_t> final(n, 0), finishing(n, 0);
      for (const auto& [key, bytes] : outward) {
        const auto [from, to, waits] = key;
        (waits ? finishing : final)[static_cast<size_t>(from)] = 1;
        (waits ? finishing : final)[static_cast<size_t>(to)] = 1;
      }
      for (size_t w = 0; w < n; ++w) {
        if (final[w]) {
          early[w] = stages[w].size();
          stages[w].push_back(SimStage{kReshuffleOut, 0, {}});
          stages[w].back().afterCompute = false;
        }
        if (finishing[w]) {
          after[w] = stages[w].size();
          stages[w].push_back(SimStage{kReshuffleOutAfter, 0, {}});
          stages[w].back().commWaitBack = final[w] ? 2 : 1;
        }
      }
    }
    for (const auto& [key, bytes] : reshuffleMessages(plan, true, inBytes, {}, ranges)) {
      const auto [from, to, waits] = key;
      const auto id = static_cast<int32_t>(flows.size());
      flows.push_back({from, to, bytes});
      stages[static_cast<size_t>(from)].front().flows.push_back(id);
      stages[static_cast<size_t>(to)].front().flows.push_back(id);
    }
    for (const auto& [key, bytes] : outward) {
      const auto [from, to, waits] = key;
      const auto id = static_cast<int32_t>(flows.size());
      flows.push_back({from, to, bytes});
      for (const int32_t w : {from, to}) {
        const auto wi = static_cast<size_t>(w);
        stages[wi][waits ? after[wi] : early[wi]].flows.push_back(id);
      }
    }
  }
  return {std::move(flows), std::move(stages)};
}

/// The useful FLOPs of one pass of `plan` with `attention`'s heads.
double usefulFlops(const Plan& plan, const AttentionConfig& attention, bool backward) {
  double flops = 0;
  for (const plan::BlockPair& p : plan.pairs) {
    flops += backward ? backwardFlops(attention, p.visible) : forwardFlops(attention, p.visible);
  }
  return flops;
}

/// Runs a pass graph on `hw`; MFU counts `useful` FLOPs.
PassResult runGraph(PassGraph graph, const HardwareProfile& hw, const SimOptions& options,
                    double useful) {
  const auto n = static_cast<int64_t>(graph.stages.size());
  mergeMessages(graph.flows, graph.stages);
  Engine engine(hw, n, graph.flows, std::move(graph.stages), options.timelines);
  PassResult r = engine.run();
  r.usefulFlops = useful;
  const double denominator = static_cast<double>(n) * hw.peakFlops * r.timeMs * 1e-3;
  r.mfu = denominator > 0 ? r.usefulFlops / denominator : 0;
  return r;
}

PassResult runPass(const Plan& plan, const HardwareProfile& hw, const SimOptions& options,
                   bool backward) {
  return runGraph(buildPass(plan, hw, options, backward), hw, options,
                  usefulFlops(plan, plan.config.attention, backward));
}

/// Tokens each member of each head-parallel group holds (job worker i·degree + m): group i holds
/// ring worker i's tokens, split as evenly as whole tokens go.
std::vector<int64_t> memberTokens(const Plan& ring, int64_t degree) {
  std::vector<int64_t> group(static_cast<size_t>(ring.config.numWorkers), 0);
  for (size_t b = 0; b < ring.blocks.size(); ++b) {
    group[static_cast<size_t>(ring.owner[b])] += ring.blocks[b].numTokens();
  }
  std::vector<int64_t> held(group.size() * static_cast<size_t>(degree));
  for (size_t i = 0; i < group.size(); ++i) {
    const int64_t t = group[i];
    for (int64_t m = 0; m < degree; ++m) {
      held[i * static_cast<size_t>(degree) + static_cast<size_t>(m)] =
          t * (m + 1) / degree - t * m / degree;
    }
  }
  return held;
}

/// The all-to-all of each head-parallel group (`degree` consecutive workers, their tokens as
/// memberTokens says): before the attention each member sends every other its own tokens'
/// `before` bytes per token (the receiver's heads), after it every other member's tokens'
/// `after` bytes per token (the sender's heads).
std::vector<Flow> groupAllToAll(const Plan& ring, int64_t degree, int64_t beforeBytes,
                                int64_t afterBytes, bool after) {
  const std::vector<int64_t> held = memberTokens(ring, degree);
  std::vector<Flow> flows;
  for (int64_t base = 0; base < static_cast<int64_t>(held.size()); base += degree) {
    for (int64_t a = 0; a < degree; ++a) {
      for (int64_t b = 0; b < degree; ++b) {
        if (a == b) continue;
        const double bytes =
            after ? static_cast<double>(held[static_cast<size_t>(base + b)] * afterBytes)
                  : static_cast<double>(held[static_cast<size_t>(base + a)] * beforeBytes);
        if (bytes <= 0) continue;
        flows.push_back({static_cast<int32_t>(base + a), static_cast<int32_t>(base + b), bytes});
      }
    }
  }
  return flows;
}

/// Bytes per token each all-to-all of a head-parallel pass moves, for the heads of one member
/// (`share`): forward Q, K and V before and O after; backward dO before and dQ, dK, dV after.
std::pair<int64_t, int64_t> allToAllBytes(const AttentionConfig& share, bool backward) {
  const int64_t qkv = share.qBytesPerToken() + share.kvBytesPerToken();
  return backward ? std::make_pair(share.qBytesPerToken(), qkv)
                  : std::make_pair(qkv, share.oBytesPerToken());
}

/// Seconds each member of a group holding `tokens` spends permuting its tensors between the
/// token-major rows attention reads and the all-to-all's per-destination chunks (one read and
/// one write in HBM, as DeepSpeed-Ulysses' exchange does on each side): before the all-to-all
/// in it reads its own tokens at every head (`full` bytes per token) and writes `degree` chunks
/// of the share's heads (`share` each: key/value heads replicated where the members outnumber
/// them); after the all-to-all out it reads the `degree` chunks it received and writes its own
/// tokens' rows (replicated heads' gradients summed on the way). 0 where the profile does not
/// say its memory bandwidth, or one member holds every head.
std::vector<double> permuteSeconds(const Plan& ring, int64_t degree, int64_t full, int64_t share,
                                   const HardwareProfile& hw) {
  std::vector<double> seconds(static_cast<size_t>(ring.config.numWorkers * degree), 0);
  if (hw.memoryBytesPerSecond <= 0 || degree == 1) return seconds;
  const std::vector<int64_t> held = memberTokens(ring, degree);
  for (size_t w = 0; w < held.size(); ++w) {
    seconds[w] = static_cast<double>(held[w]) * static_cast<double>(full + degree * share) /
                 hw.memoryBytesPerSecond;
  }
  return seconds;
}

/// One head-parallel pass: a stage of the all-to-all in, `degree` copies of the ring's pass
/// (copy j on workers i·degree + j), a stage of the all-to-all out; where the profile gives its
/// memory bandwidth, a stage of permutes before the first and after the last.
PassGraph headParallelPass(const Plan& ring, const AttentionConfig& attention, int64_t degree,
                           const HardwareProfile& hw, const SimOptions& options, bool backward) {
  const PassGraph sub = buildPass(ring, hw, options, backward);
  const auto r = static_cast<size_t>(ring.config.numWorkers);
  const auto u = static_cast<size_t>(degree);
  PassGraph g;
  g.stages.resize(r * u);
  for (size_t j = 0; j < u; ++j) {
    const auto offset = static_cast<int32_t>(g.flows.size());
    for (const Flow& f : sub.flows) {
      g.flows.push_back({static_cast<int32_t>(static_cast<size_t>(f.src) * u + j),
                         static_cast<int32_t>(static_cast<size_t>(f.dst) * u + j), f.bytes});
    }
    for (size_t i = 0; i < r; ++i) {
      auto& out = g.stages[i * u + j];
      out.push_back(SimStage{kAllToAllIn, 0, {}});
      for (SimStage st : sub.stages[i]) {
        for (int32_t& f : st.flows) f += offset;
        out.push_back(std::move(st));
      }
      out.push_back(SimStage{kAllToAllOut, 0, {}});
    }
  }
  const auto [before, after] = allToAllBytes(ring.config.attention, backward);
  for (const bool last : {false, true}) {
    for (const Flow& f : groupAllToAll(ring, degree, before, after, last)) {
      const auto id = static_cast<int32_t>(g.flows.size());
      g.flows.push_back(f);
      for (const int32_t w : {f.src, f.dst}) {
        auto& s = g.stages[static_cast<size_t>(w)];
        (last ? s.back() : s.front()).flows.push_back(id);
      }
    }
  }
  if (hw.memoryBytesPerSecond > 0 && degree > 1) {
    const auto [fullBefore, fullAfter] = allToAllBytes(attention, backward);
    const std::vector<double> in = permuteSeconds(ring, degree, fullBefore, before, hw);
    const std::vector<double> out = permuteSeconds(ring, degree, fullAfter, after, hw);
    for (size_t w = 0; w < g.stages.size(); ++w) {
      auto& s = g.stages[w];
      s.insert(s.begin(), SimStage{kPermuteIn, in[w], {}});
      s.push_back(SimStage{kPermuteOut, out[w], {}});
    }
  }
  return g;
}

void checkProfile(const HardwareProfile& hardware) {
  if (!(hardware.peakFlops > 0) || !(hardware.intraNodeBytesPerSecond > 0) ||
      !(hardware.interNodeBytesPerSecond > 0) || hardware.workersPerNode <= 0) {
    throwInvalidArgument("hardware profile '", hardware.name,
                         "': expected positive peak, bandwidths and workers per node");
  }
}

/// The step's figures from its two passes: times, MFU, compute imbalance and the idle share;
/// `bytes` holds each worker's forward bytes sent plus received.
SimResult finish(PassResult forward, PassResult backward, const HardwareProfile& hardware,
                 const SimOptions& options, const std::vector<double>& bytes) {
  SimResult r;
  r.forward = std::move(forward);
  r.backward = std::move(backward);
  r.timeMs = r.forward.timeMs + r.backward.timeMs;
  const size_t n = bytes.size();
  const double useful = r.forward.usefulFlops + r.backward.usefulFlops;
  const double denominator = static_cast<double>(n) * hardware.peakFlops * r.timeMs * 1e-3;
  r.mfu = denominator > 0 ? useful / denominator : 0;
  std::vector<double> compute(n, 0);
  for (size_t w = 0; w < n; ++w) {
    compute[w] = r.forward.computeMs[w] + (options.backward ? r.backward.computeMs[w] : 0);
    r.meanComputeMs += compute[w] / static_cast<double>(n);
  }
  r.computeImbalance = imbalance(compute);
  r.commImbalance = imbalance(bytes);
  r.meanIdleMs = r.timeMs - r.meanComputeMs;
  return r;
}

/// Off-worker reshuffle bytes of `plan`'s pieces, each token with `attention`'s Q, K, V and O.
int64_t reshuffleBytes(const Plan& plan, const AttentionConfig& a) {
  int64_t bytes = 0;
  for (const plan::ReshufflePiece& p : plan.reshuffle) {
    if (p.userWorker != p.fcpWorker) {
      bytes += (p.end - p.begin) * (a.qBytesPerToken() + a.kvBytesPerToken() + a.oBytesPerToken());
    }
  }
  return bytes;
}

}  // namespace

std::string stageName(int32_t stage) {
  switch (stage) {
    case kReshuffleIn:
      return "reshuffle in";
    case kReshuffleOut:
      return "reshuffle out";
    case kReshuffleOutAfter:
      return "reshuffle out after";
    case kAllToAllIn:
      return "all-to-all in";
    case kAllToAllOut:
      return "all-to-all out";
    case kPermuteIn:
      return "permute in";
    case kPermuteOut:
      return "permute out";
    default:
      return "stage " + std::to_string(stage);
  }
}

SimResult simulate(const Plan& plan, const HardwareProfile& hardware, const SimOptions& options) {
  checkProfile(hardware);
  PassResult forward = runPass(plan, hardware, options, false);
  PassResult backward = options.backward ? runPass(plan, hardware, options, true) : PassResult{};
  const auto n = static_cast<size_t>(plan.config.numWorkers);
  std::vector<double> bytes(n, 0);
  int64_t transferBytes = 0;
  for (const plan::Transfer& t : plan.transfers) {
    bytes[static_cast<size_t>(t.sender)] += static_cast<double>(t.bytes);
    bytes[static_cast<size_t>(t.receiver)] += static_cast<double>(t.bytes);
    transferBytes += t.bytes;
  }
  SimResult r = finish(std::move(forward), std::move(backward), hardware, options, bytes);
  r.transferBytes = transferBytes;
  r.numTransfers = static_cast<int64_t>(plan.transfers.size());
  r.reshuffleBytes = reshuffleBytes(plan, plan.config.attention);
  return r;
}

SimResult simulateHeadParallel(const Plan& ring, const AttentionConfig& attention, int64_t degree,
                               const HardwareProfile& hardware, const SimOptions& options) {
  checkProfile(hardware);
  if (!(headShare(attention, degree) == ring.config.attention)) {
    throwInvalidArgument("head-parallel ring plan has ", ring.config.attention.numHeadsQ,
                         " query and ", ring.config.attention.numHeadsKv,
                         " key/value heads: expected one worker's share of ", attention.numHeadsQ,
                         " and ", attention.numHeadsKv, " at degree ", degree);
  }
  if (ring.config.numWorkers > (int64_t{1} << 24) / degree) {
    throwInvalidArgument("head-parallel ", ring.config.numWorkers, " ring workers x degree ",
                         degree, ": expected at most 2^24 workers");
  }
  const auto pass = [&](bool backward) {
    return runGraph(headParallelPass(ring, attention, degree, hardware, options, backward),
                    hardware, options, usefulFlops(ring, attention, backward));
  };
  PassResult forward = pass(false);
  PassResult backward = options.backward ? pass(true) : PassResult{};
  const auto u = static_cast<size_t>(degree);
  std::vector<double> bytes(static_cast<size_t>(ring.config.numWorkers) * u, 0);
  int64_t transferBytes = 0, numTransfers = 0;
  for (const plan::Transfer& t : ring.transfers) {
    for (size_t j = 0; j < u; ++j) {
      bytes[static_cast<size_t>(t.sender) * u + j] += static_cast<double>(t.bytes);
      bytes[static_cast<size_t>(t.receiver) * u + j] += static_cast<double>(t.bytes);
    }
    transferBytes += t.bytes * degree;
    numTransfers += degree;
  }
  const auto [before, after] = allToAllBytes(ring.config.attention, false);
  for (const bool last : {false, true}) {
    for (const Flow& f : groupAllToAll(ring, degree, before, after, last)) {
      bytes[static_cast<size_t>(f.src)] += f.bytes;
      bytes[static_cast<size_t>(f.dst)] += f.bytes;
      transferBytes += static_cast<int64_t>(f.bytes);
      ++numTransfers;
    }
  }
  SimResult r = finish(std::move(forward), std::move(backward), hardware, options, bytes);
  r.transferBytes = transferBytes;
  r.numTransfers = numTransfers;
  r.reshuffleBytes = reshuffleBytes(ring, attention);
  return r;
}

}  // namespace fcp::sim
