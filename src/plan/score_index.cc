#include "score_index.h"

#include <algorithm>

namespace fcp::plan::detail {
namespace {

uint64_t mixBits(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr double kInf = std::numeric_limits<double>::infinity();

}  // namespace

ScoreIndex::ScoreIndex(int32_t numWorkers, double a, double b)
    : a_(a), b_(b), nodes_(static_cast<size_t>(numWorkers)) {
  for (int32_t w = 0; w < numWorkers; ++w) {
    nodes_[w].priority = mixBits(static_cast<uint64_t>(w));
    pull(w);
    root_ = insert(root_, w);
  }
}

bool ScoreIndex::keyLess(int32_t u, int32_t v) const {
  const double du = nodes_[u].diff, dv = nodes_[v].diff;
  return du != dv ? du < dv : u < v;
}

void ScoreIndex::pull(int32_t v) {
  Node& n = nodes_[v];
  n.minA = {n.scaledMem, v};
  n.minB = {n.scaledCost, v};
  if (n.left >= 0) {
    n.minA = std::min(n.minA, nodes_[n.left].minA);
    n.minB = std::min(n.minB, nodes_[n.left].minB);
  }
  if (n.right >= 0) {
    n.minA = std::min(n.minA, nodes_[n.right].minA);
    n.minB = std::min(n.minB, nodes_[n.right].minB);
  }
}

std::pair<int32_t, int32_t> ScoreIndex::split(int32_t v, int32_t w) {
  if (v < 0) return {-1, -1};
  if (keyLess(v, w)) {
    auto [l, r] = split(nodes_[v].right, w);
    nodes_[v].right = l;
    pull(v);
    return {v, r};
  }
  auto [l, r] = split(nodes_[v].left, w);
  nodes_[v].left = r;
  pull(v);
  return {l, v};
}

int32_t ScoreIndex::merge(int32_t l, int32_t r) {
  if (l < 0) return r;
  if (r < 0) return l;
  if (nodes_[l].priority > nodes_[r].priority) {
    nodes_[l].right = merge(nodes_[l].right, r);
    pull(l);
    return l;
  }
  nodes_[r].left = merge(l, nodes_[r].left);
  pull(r);
  return r;
}

int32_t ScoreIndex::insert(int32_t v, int32_t w) {
  if (v < 0) return w;
  if (nodes_[w].priority > nodes_[v].priority) {
    auto [l, r] = split(v, w);
    nodes_[w].left = l;
    nodes_[w].right = r;
    pull(w);
    return w;
  }
  if (keyLess(w, v)) {
    nodes_[v].left = insert(nodes_[v].left, w);
  } else {
    nodes_[v].right = insert(nodes_[v].right, w);
  }
  pull(v);
  return v;
}

int32_t ScoreIndex::erase(int32_t v, int32_t w) {
  if (v == w) return merge(nodes_[v].left, nodes_[v].right);
  if (keyLess(w, v)) {
    nodes_[v].left = erase(nodes_[v].left, w);
  } else {
    nodes_[v].right = erase(nodes_[v].right, w);
  }
  pull(v);
  return v;
}

void ScoreIndex::update(int32_t w, int64_t mem, double cost) {
  root_ = erase(root_, w);
  Node& n = nodes_[w];
  n.left = n.right = -1;
  n.mem = mem;
  n.cost = cost;
  n.scaledMem = a_ * static_cast<double>(mem);
  n.scaledCost = b_ * cost;
  n.diff = n.scaledMem - n.scaledCost;
  pull(w);
  root_ = insert(root_, w);
}

// The least (B, id) among the subtree's workers with mem <= memLimit, if it beats `best`.
void ScoreIndex::bestFeasibleB(int32_t v, int64_t memLimit, Candidate& best) const {
  if (v < 0) return;
  const Candidate& bound = nodes_[v].minB;
  if (!(bound < best)) return;
  if (nodes_[bound.second].mem <= memLimit) {
    best = bound;
    return;
  }
  if (nodes_[v].mem <= memLimit) best = std::min(best, Candidate{nodes_[v].scaledCost, v});
  bestFeasibleB(nodes_[v].left, memLimit, best);
  bestFeasibleB(nodes_[v].right, memLimit, best);
}

int32_t ScoreIndex::argMin(int64_t memLimit, int64_t mi, double ci) const {
  const double x = a_ * static_cast<double>(mi), y = b_ * ci, t = y - x;
  Candidate bestA{kInf, -1};  // least (A, id) with D >= t
  Candidate bestB{kInf, -1};  // least (B, id) with D < t and room
  for (int32_t v = root_; v >= 0;) {
    const Node& n = nodes_[v];
    if (n.diff >= t) {
      // v and its right subtree have D >= t.
      bestA = std::min(bestA, Candidate{n.scaledMem, v});
      if (n.right >= 0) bestA = std::min(bestA, nodes_[n.right].minA);
      v = n.left;
    } else {
      // v and its left subtree have D < t.
      if (n.mem <= memLimit) bestB = std::min(bestB, Candidate{n.scaledCost, v});
      bestFeasibleB(n.left, memLimit, bestB);
      v = n.right;
    }
  }
  // The least A has the least memory: if it has no room, no worker of its group has.
  if (bestA.second >= 0 && nodes_[bestA.second].mem > memLimit) bestA = {kInf, -1};
  // Score both winners exactly as Algorithm 1 states it; ties to the lower id.
  const auto score = [&](int32_t w) -> Candidate {
    if (w < 0) return {kInf, -1};
    const Node& n = nodes_[w];
    return {std::max(a_ * (static_cast<double>(n.mem) + static_cast<double>(mi)), b_ * (n.cost + ci)), w};
  };
  return std::min(score(bestA.second), score(bestB.second)).second;
}

}  // namespace fcp::plan::detail
