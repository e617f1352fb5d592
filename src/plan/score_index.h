#pragma once
// Private to the Block Distributor: the exact argmin of Algorithm 1's score in O(log N).

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace fcp::plan::detail {

/// Finds the worker minimising Algorithm 1's score max(A_w + x, B_w + y), where A_w = a m_w
/// and B_w = b c_w are a worker's scaled memory and compute and x = a m_i, y = b c_i the
/// block's, among workers with m_w <= a memory limit; ties go to the lowest worker id.
///
/// The score is A_w + x exactly when D_w = A_w - B_w >= y - x, and B_w + y otherwise. So the
/// workers are kept in a treap ordered by D_w: those at or above y - x are a suffix, whose best
/// is its least A (which is also its least memory, so it is feasible if any is), and those
/// below are a prefix, whose best is its least B among the feasible. Each is a walk down the
/// tree plus, for the prefix, a branch-and-bound descent that is O(log N) unless the least-B
/// workers are full. Priorities come from the worker id, so the shape is deterministic.
class ScoreIndex {
 public:
  /// a > 0 and b > 0; every worker starts empty.
  ScoreIndex(int32_t numWorkers, double a, double b);

  /// Sets worker w's memory (tokens) and compute.
  void update(int32_t w, int64_t mem, double cost);

  /// The best worker for a block of mi tokens and cost ci under memLimit, or -1.
  int32_t argMin(int64_t memLimit, int64_t mi, double ci) const;

 private:
  using Candidate = std::pair<double, int32_t>;  ///< (score or key, worker)

  struct Node {
    int32_t left = -1;
    int32_t right = -1;
    uint64_t priority = 0;
    int64_t mem = 0;
    double cost = 0;
    double scaledMem = 0;   ///< A_w = a m_w
    double scaledCost = 0;  ///< B_w = b c_w
    double diff = 0;        ///< D_w = A_w - B_w, the treap key (ties by worker id)
    // Over the subtree: least A (its worker has the least memory) and least B, ties by id.
    Candidate minA{0, -1};
    Candidate minB{0, -1};
  };
  bool keyLess(int32_t u, int32_t v) const;
  void pull(int32_t v);
  std::pair<int32_t, int32_t> split(int32_t v, int32_t w);  ///< (< w, >= w)
  int32_t merge(int32_t l, int32_t r);
  int32_t insert(int32_t v, int32_t w);
  int32_t erase(int32_t v, int32_t w);
  void bestFeasibleB(int32_t v, int64_t memLimit, Candidate& best) const;

  double a_;
  double b_;
  int32_t root_ = -1;
  std::vector<Node> nodes_;
};

}  // namespace fcp::plan::detail
