#include "score_index.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "fcp/core/error.h"

namespace fcp::plan::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

ScoreIndex::ScoreIndex(int32_t numWorkers, double a, double b)
    : a_(a),
      b_(b),
      mem_(static_cast<size_t>(numWorkers), 0),
      cost_(static_cast<size_t>(numWorkers), 0.0),
      scaledMem_(static_cast<size_t>(numWorkers), 0.0),
      scaledCost_(static_cast<size_t>(numWorkers), 0.0),
      diff_(static_cast<size_t>(numWorkers), 0.0) {
  targetSize_ =
      std::max<size_t>(16, static_cast<size_t>(std::sqrt(static_cast<double>(numWorkers))) / 2);
  // All keys start equal (0), so id order is key order.
  for (int32_t w = 0; w < numWorkers; ++w) {
    if (buckets_.empty() || buckets_.back().workers.size() >= targetSize_) buckets_.emplace_back();
    buckets_.back().workers.push_back(w);
  }
  for (Bucket& bucket : buckets_) summarise(bucket);
  summariseGroups();
}

void ScoreIndex::summariseGroup(size_t g) {
  const size_t first = g * kGroup, last = std::min(first + kGroup, buckets_.size());
  Group& group = groups_[g];
  group = {buckets_[first].minA, buckets_[first].minB};
  for (size_t b = first + 1; b < last; ++b) {
    group.minA = std::min(group.minA, buckets_[b].minA);
    group.minB = std::min(group.minB, buckets_[b].minB);
  }
}

void ScoreIndex::summariseGroups() {
  groups_.resize((buckets_.size() + kGroup - 1) / kGroup);
  for (size_t g = 0; g < groups_.size(); ++g) summariseGroup(g);
}

bool ScoreIndex::keyLess(int32_t u, int32_t v) const {
  const double du = diff_[static_cast<size_t>(u)], dv = diff_[static_cast<size_t>(v)];
  return du != dv ? du < dv : u < v;
}

void ScoreIndex::bound(Bucket& bucket) const {
  if (bucket.workers.empty()) return;
  bucket.lo = diff_[static_cast<size_t>(bucket.workers.front())];
  bucket.hi = diff_[static_cast<size_t>(bucket.workers.back())];
}

void ScoreIndex::summarise(Bucket& bucket) const {
  bound(bucket);
  // The least (A, id) and (B, id): the least values first, in four independent chains each
  // (one chain waited on every compare: the greedy's largest cost), then the least id among
  // the workers that hold them.
  const std::vector<int32_t>& workers = bucket.workers;
  const size_t n = workers.size();
  std::array<double, 4> a{kInf, kInf, kInf, kInf}, b{kInf, kInf, kInf, kInf};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (size_t k = 0; k < 4; ++k) {
      const auto w = static_cast<size_t>(workers[i + k]);
      a[k] = scaledMem_[w] < a[k] ? scaledMem_[w] : a[k];
      b[k] = scaledCost_[w] < b[k] ? scaledCost_[w] : b[k];
    }
  }
  for (; i < n; ++i) {
    const auto w = static_cast<size_t>(workers[i]);
    a[0] = scaledMem_[w] < a[0] ? scaledMem_[w] : a[0];
    b[0] = scaledCost_[w] < b[0] ? scaledCost_[w] : b[0];
  }
  const double leastA = std::min({a[0], a[1], a[2], a[3]});
  const double leastB = std::min({b[0], b[1], b[2], b[3]});
  int32_t idA = -1, idB = -1;
  for (const int32_t w : workers) {
    const auto ws = static_cast<size_t>(w);
    if (scaledMem_[ws] == leastA && (idA < 0 || w < idA)) idA = w;
    if (scaledCost_[ws] == leastB && (idB < 0 || w < idB)) idB = w;
  }
  // Values at infinity (scales that overflow) name no worker, as the pairs' minimum from
  // {inf, -1} did.
  bucket.minA = {leastA, leastA == kInf ? -1 : idA};
  bucket.minB = {leastB, leastB == kInf ? -1 : idB};
}

size_t ScoreIndex::bucketFor(int32_t w) const {
  // The first bucket whose last worker is not below w; the last bucket if none.
  size_t lo = 0, hi = buckets_.size() - 1;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (keyLess(buckets_[mid].workers.back(), w)) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

void ScoreIndex::rebalance(size_t b) {
  if (buckets_[b].workers.empty()) {
    buckets_.erase(buckets_.begin() + static_cast<std::ptrdiff_t>(b));
  } else if (buckets_[b].workers.size() > 2 * targetSize_) {
    Bucket upper;
    auto& lower = buckets_[b].workers;
    upper.workers.assign(lower.begin() + static_cast<std::ptrdiff_t>(targetSize_), lower.end());
    lower.resize(targetSize_);
    summarise(buckets_[b]);
    summarise(upper);
    buckets_.insert(buckets_.begin() + static_cast<std::ptrdiff_t>(b) + 1, std::move(upper));
  } else {
    return;
  }
  summariseGroups();
}

void ScoreIndex::update(int32_t w, int64_t mem, double cost) {
  const auto ws = static_cast<size_t>(w);
  // Found by its key, which has not changed yet (a map from workers to buckets had to be
  // renumbered after every split, most of the cost of splits); keys that are NaN (scales that
  // overflow times an empty worker) order nothing, and are looked for in every bucket.
  const auto holds = [&](size_t b) {
    const std::vector<int32_t>& list = buckets_[b].workers;
    return std::find(list.begin(), list.end(), w) != list.end();
  };
  size_t from = bucketFor(w);
  if (!holds(from)) {
    for (from = 0; from < buckets_.size() && !holds(from); ++from) {
    }
    FCP_CHECK(from < buckets_.size(), "worker ", w, " is in no bucket");
  }
  auto& old = buckets_[from].workers;
  old.erase(std::find(old.begin(), old.end(), w));
  // The summary changes only if w held one of its minima.
  if (buckets_[from].minA.second == w || buckets_[from].minB.second == w) {
    summarise(buckets_[from]);
    summariseGroup(from / kGroup);
  } else {
    bound(buckets_[from]);
  }
  if (old.empty() && buckets_.size() > 1) rebalance(from);

  mem_[ws] = mem;
  cost_[ws] = cost;
  scaledMem_[ws] = a_ * static_cast<double>(mem);
  scaledCost_[ws] = b_ * cost;
  diff_[ws] = scaledMem_[ws] - scaledCost_[ws];

  const size_t to = bucketFor(w);
  auto& list = buckets_[to].workers;
  list.insert(std::upper_bound(list.begin(), list.end(), w,
                               [&](int32_t x, int32_t y) { return keyLess(x, y); }),
              w);
  Bucket& bucket = buckets_[to];
  bucket.minA = std::min(bucket.minA, Candidate{scaledMem_[ws], w});
  bucket.minB = std::min(bucket.minB, Candidate{scaledCost_[ws], w});
  bound(bucket);
  Group& group = groups_[to / kGroup];
  group.minA = std::min(group.minA, bucket.minA);
  group.minB = std::min(group.minB, bucket.minB);
  rebalance(to);
}

int32_t ScoreIndex::argMin(int64_t memLimit, int64_t mi, double ci) const {
  const double x = a_ * static_cast<double>(mi), y = b_ * ci, t = y - x;
  Candidate bestA{kInf, -1};  // least (A, id) with D >= t
  Candidate bestB{kInf, -1};  // least (B, id) with D < t and room
  const auto scanB = [&](const Bucket& bucket) {
    for (int32_t w : bucket.workers) {
      const auto ws = static_cast<size_t>(w);
      if (diff_[ws] < t && mem_[ws] <= memLimit) bestB = std::min(bestB, Candidate{scaledCost_[ws], w});
    }
  };
  const auto visit = [&](const Bucket& bucket) {
    const double lo = bucket.lo, hi = bucket.hi;
    if (lo >= t) {
      bestA = std::min(bestA, bucket.minA);
    } else if (hi < t) {
      if (!(bucket.minB < bestB)) return;
      if (mem_[static_cast<size_t>(bucket.minB.second)] <= memLimit) {
        bestB = bucket.minB;
      } else {
        scanB(bucket);  // its least-B worker is full: look at the others
      }
    } else {
      // Straddles t: each worker on its own side.
      for (int32_t w : bucket.workers) {
        const auto ws = static_cast<size_t>(w);
        if (diff_[ws] >= t) bestA = std::min(bestA, Candidate{scaledMem_[ws], w});
      }
      scanB(bucket);
    }
  };
  // A group wholly on one side of t counts as one bucket, unless its least-B worker is full.
  for (size_t g = 0; g < groups_.size(); ++g) {
    const size_t first = g * kGroup, last = std::min(first + kGroup, buckets_.size());
    const Group& group = groups_[g];
    if (buckets_[first].lo >= t) {
      bestA = std::min(bestA, group.minA);
      continue;
    }
    if (buckets_[last - 1].hi < t) {
      if (!(group.minB < bestB)) continue;
      if (mem_[static_cast<size_t>(group.minB.second)] <= memLimit) {
        bestB = group.minB;
        continue;
      }
    }
    for (size_t b = first; b < last; ++b) visit(buckets_[b]);
  }
  // The least A has the least memory: if it has no room, no worker of its group has.
  if (bestA.second >= 0 && mem_[static_cast<size_t>(bestA.second)] > memLimit) bestA = {kInf, -1};
  // Score both winners exactly as Algorithm 1 states it; ties to the lower id.
  const auto score = [&](int32_t w) -> Candidate {
    if (w < 0) return {kInf, -1};
    const auto ws = static_cast<size_t>(w);
    return {std::max(a_ * (static_cast<double>(mem_[ws]) + static_cast<double>(mi)),
                     b_ * (cost_[ws] + ci)),
            w};
  };
  return std::min(score(bestA.second), score(bestB.second)).second;
}

}  // namespace fcp::plan::detail
