#pragma once
// Private to the Block Distributor: the exact argmin of Algorithm 1's score.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fcp::plan::detail {

/// Finds the worker minimising Algorithm 1's score max(A_w + x, B_w + y), where A_w = a m_w
/// and B_w = b c_w are a worker's scaled memory and compute and x = a m_i, y = b c_i the
/// block's, among workers with m_w <= a memory limit; ties go to the lowest worker id.
///
/// The score is A_w + x exactly when D_w = A_w - B_w >= y - x, and B_w + y otherwise. So the
/// workers are kept ordered by D_w: those at or above y - x are a suffix, whose best is its
/// least A (which is also its least memory, so it is feasible if any is), and those below are
/// a prefix, whose best is its least B among the feasible. The order is kept in about 2√N
/// sorted buckets of about √N / 2 workers (at least 16), each knowing its least A and least
/// B, and the buckets in groups of kGroup that know the least of their buckets': a query reads
/// every group's summary, the summaries of the buckets of the one group that straddles y - x,
/// and scans the one bucket that straddles it (and, rarely, a bucket or group whose least-B
/// worker is full); an update moves one worker between buckets, which it finds by its key. Both are
/// O(√N) with small constants and no pointer chasing, which beats a balanced tree at the sizes FCP
/// plans for (N ≤ a few thousand). Deterministic: no randomness.
class ScoreIndex {
 public:
  /// a > 0 and b > 0; every worker starts empty.
  ScoreIndex(int32_t numWorkers, double a, double b);

  /// Sets worker w's memory (tokens) and compute.
  void update(int32_t w, int64_t mem, double cost);

  /// The best worker for a block of mi tokens and cost ci under memLimit, or -1.
  int32_t argMin(int64_t memLimit, int64_t mi, double ci) const;

 private:
  using Candidate = std::pair<double, int32_t>;  ///< (value, worker), compared in that order

  struct Bucket {
    std::vector<int32_t> workers;  ///< sorted by (D, id)
    Candidate minA{0, -1};         ///< least (A, id) in the bucket
    Candidate minB{0, -1};         ///< least (B, id) in the bucket
    double lo = 0, hi = 0;         ///< D of its first and last worker (the query reads only these)
  };

  /// The least (A, id) and (B, id) of buckets [g·kGroup, (g + 1)·kGroup).
  struct Group {
    Candidate minA{0, -1};
    Candidate minB{0, -1};
  };
  /// Buckets per group: without groups a query read every bucket's summary, and buckets of
  /// √N workers (64 at 4096 workers) were the least costly size.
  static constexpr size_t kGroup = 8;

  bool keyLess(int32_t u, int32_t v) const;
  void summarise(Bucket& bucket) const;
  void summariseGroup(size_t g);      ///< from its buckets' summaries
  void summariseGroups();             ///< every group (after buckets were split or dropped)
  void bound(Bucket& bucket) const;   ///< sets lo and hi from the workers
  size_t bucketFor(int32_t w) const;  ///< the bucket w's key belongs in
  void rebalance(size_t b);           ///< split a bucket grown too big, drop an empty one

  double a_;
  double b_;
  size_t targetSize_ = 1;
  std::vector<int64_t> mem_;
  std::vector<double> cost_;
  std::vector<double> scaledMem_;   ///< A_w
  std::vector<double> scaledCost_;  ///< B_w
  std::vector<double> diff_;        ///< D_w
  std::vector<Bucket> buckets_;
  std::vector<Group> groups_;
};

}  // namespace fcp::plan::detail
