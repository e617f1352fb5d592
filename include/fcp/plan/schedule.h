#pragma once
/// The Communication Planner's output (§4.2, §4.3): transfers, rounds, per-worker pipeline
/// stages for the forward and backward pass, and the reshuffle between the user layout and the
/// FCP layout.
///
/// Terms. A *transfer* sends one KV block from its owner to a worker owning a Q block that
/// needs it, once per (block, worker). Transfers are coloured into Δ *rounds* (matchings).
/// The *coalescer* merges `coalesce` consecutive rounds into one *group*; group g is received
/// during stage g. With a buffer depth of D (in groups, D >= 2), the pairs that use group g's
/// blocks are computed in stage g + D − 1 and its buffers released after that stage, so a
/// worker holds at most D groups of remote KV at once and always receives ahead of computing.
/// Pairs needing no remote KV are split between the first stage and the last, where they hide
/// the reshuffle in and out. Backward: the same KV flow, and each received block's dK/dV
/// partial goes back to its owner in the stage after the block's pairs were recomputed; a
/// reversed matching is a matching, so those returns are congestion-free too.

#include <compare>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <span>
#include <utility>
#include <vector>

namespace fcp::plan {

/// One KV block sent to one worker that needs it.
struct Transfer {
  int32_t block = 0;
  /// The block's owner, or a relay that received the block earlier and still holds it (ring
  /// attention passes blocks on). Backward, the receiver's dK/dV partial goes back to the
  /// sender; a relay adds it to its own partial before returning that along its own transfer.
  int32_t sender = 0;
  int32_t receiver = 0;  ///< a worker owning a Q block that attends to it
  int32_t round = 0;     ///< in [0, Δ)
  int64_t bytes = 0;     ///< K and V of the block's tokens (last: 24 bytes, no padding)
  friend bool operator==(const Transfer&, const Transfer&) = default;
};

/// The six lists of a stage, in the order Stages stores them.
enum class StageList : uint8_t { kSend, kRecv, kCompute, kRelease, kSendGrad, kRecvGrad };
inline constexpr size_t kStageLists = 6;
static_assert(static_cast<size_t>(StageList::kRecvGrad) + 1 == kStageLists);

/// What one worker does in one pipeline stage, as lists it owns: how stages are written by
/// hand (the ring baseline, a plan file, tests) before Stages stores them. Ids index
/// Plan::transfers and Plan::pairs.
struct StageIds {
  std::vector<int32_t> send;     ///< transfers this worker sends
  std::vector<int32_t> recv;     ///< transfers this worker receives
  std::vector<int32_t> compute;  ///< pairs computed (this worker owns their Q block)
  std::vector<int32_t> release;  ///< received transfers whose buffers are freed after it
  /// Backward only: the dK/dV partials of received transfers sent back to their owners, and
  /// those this worker receives for its own blocks (and adds in).
  std::vector<int32_t> sendGrad;
  std::vector<int32_t> recvGrad;
  friend bool operator==(const StageIds&, const StageIds&) = default;
};

/// What one worker does in one pipeline stage: the lists of StageIds, seen in the Stages that
/// holds them (valid while that Stages object lives, unmoved and not assigned to).
struct Stage {
  std::span<const int32_t> send;
  std::span<const int32_t> recv;
  std::span<const int32_t> compute;
  std::span<const int32_t> release;
  std::span<const int32_t> sendGrad;
  std::span<const int32_t> recvGrad;
  /// The same lists, owned.
  StageIds ids() const;
};

/// Positions of `Owner`, read by value through `get`. It holds the owner itself (Stages), not
/// a view, so it outlives the view it came from (not a move of the Stages). Its values are
/// made on reading, so it is a C++20 random-access iterator and, to older algorithms, an input
/// iterator.
template <typename Owner, typename Value, Value (Owner::*get)(size_t) const>
class IndexIterator {
 public:
  using iterator_concept = std::random_access_iterator_tag;
  using iterator_category = std::input_iterator_tag;
  using value_type = Value;
  using difference_type = std::ptrdiff_t;
  using pointer = void;
  using reference = Value;
  IndexIterator() = default;
  IndexIterator(const Owner* owner, size_t i) : owner_(owner), i_(i) {}
  Value operator*() const { return (owner_->*get)(i_); }
  Value operator[](difference_type k) const { return (owner_->*get)(i_ + static_cast<size_t>(k)); }
  IndexIterator& operator++() {
    ++i_;
    return *this;
  }
  IndexIterator operator++(int) { return {owner_, i_++}; }
  IndexIterator& operator--() {
    --i_;
    return *this;
  }
  IndexIterator operator--(int) { return {owner_, i_--}; }
  IndexIterator& operator+=(difference_type k) {
    i_ += static_cast<size_t>(k);
    return *this;
  }
  IndexIterator& operator-=(difference_type k) {
    i_ -= static_cast<size_t>(k);
    return *this;
  }
  friend IndexIterator operator+(IndexIterator it, difference_type k) { return it += k; }
  friend IndexIterator operator+(difference_type k, IndexIterator it) { return it += k; }
  friend IndexIterator operator-(IndexIterator it, difference_type k) { return it -= k; }
  friend difference_type operator-(const IndexIterator& a, const IndexIterator& b) {
    return static_cast<difference_type>(a.i_) - static_cast<difference_type>(b.i_);
  }
  friend bool operator==(const IndexIterator& a, const IndexIterator& b) { return a.i_ == b.i_; }
  friend auto operator<=>(const IndexIterator& a, const IndexIterator& b) { return a.i_ <=> b.i_; }

 private:
  const Owner* owner_ = nullptr;
  size_t i_ = 0;
};

class WorkerStages;
class StagesToFill;

/// Every worker's stages of one pass, [worker][stage], with all their lists stored in one
/// array: a plan of 4096 workers has some 380,000 non-empty lists, which as vectors of their
/// own took 20-25 ms to build and 30-50 ms to free. A plan's backward pass repeats most of the
/// forward's lists; the two passes then keep one array (twoPasses), and copies of a Stages
/// share it too (its lists are not changed once built: edit() stores them again).
class Stages {
 public:
  Stages() = default;
  /// Stores `workers[w][s]`'s lists.
  explicit Stages(const std::vector<std::vector<StageIds>>& workers);
  /// For a builder that fills every list in place: `stagesOf[w]` stages for worker w, and
  /// `sizes[(stage index) * kStageLists + list]` the size of each list, stage index counting
  /// the workers' stages in order (its storage is reused for the lists' starts). The lists
  /// hold zeros until written through StagesToFill::list.
  static StagesToFill toFill(const std::vector<int64_t>& stagesOf, std::vector<int64_t> sizes);
  /// For a builder of a plan's two passes, sized as above: the backward pass's send, receive,
  /// compute and release lists of each stage the forward pass also has are the forward's
  /// lists cut to their backward sizes (prefixes: none may be longer), stored once; the
  /// builder writes the forward's lists and the backward's other lists, which hold unspecified
  /// values until written (it writes them all).
  static std::pair<StagesToFill, StagesToFill> twoPasses(
      const std::vector<int64_t>& forwardStagesOf, std::vector<int64_t> forwardSizes,
      const std::vector<int64_t>& backwardStagesOf, const std::vector<int64_t>& backwardSizes);

  size_t size() const { return firstStage_.empty() ? 0 : firstStage_.size() - 1; }
  bool empty() const { return size() == 0; }
  WorkerStages operator[](size_t w) const;
  WorkerStages front() const;
  WorkerStages worker(size_t w) const;  ///< the same as [w]
  using Iterator = IndexIterator<Stages, WorkerStages, &Stages::worker>;
  Iterator begin() const { return {this, 0}; }
  Iterator end() const { return {this, size()}; }
  /// The `index`-th stage of all workers' stages in order (worker 0's first).
  Stage stage(size_t index) const {
    return {list(index, StageList::kSend),     list(index, StageList::kRecv),
            list(index, StageList::kCompute),  list(index, StageList::kRelease),
            list(index, StageList::kSendGrad), list(index, StageList::kRecvGrad)};
  }
  /// Worker w's stage s, list `list`.
  std::span<const int32_t> list(size_t w, size_t s, StageList list) const {
    return listAt(listIndex(w, s, list));
  }

  /// The lists, owned: to change a plan's stages, change these and store them again (edit).
  std::vector<std::vector<StageIds>> ids() const;
  /// Changes the lists: `change` gets them owned, [worker][stage], and they are stored again
  /// (for tools and tests: the planner fills its lists in place).
  template <typename Change>
  void edit(Change&& change) {
    std::vector<std::vector<StageIds>> lists = ids();
    change(lists);
    *this = Stages(lists);
  }
  /// Every id of every list, in (worker, stage, list) order.
  std::vector<int32_t> allIds() const;

  /// The same workers' stages with the same lists (no workers: equal however made).
  friend bool operator==(const Stages& a, const Stages& b);

 private:
  friend class StagesToFill;
  /// The index k of worker w's stage s, list `list`, in begin_ and size_.
  size_t listIndex(size_t w, size_t s, StageList list) const {
    return (static_cast<size_t>(firstStage_[w]) + s) * kStageLists + static_cast<size_t>(list);
  }
  std::span<const int32_t> listAt(size_t k) const {
    return {ids_.get() + begin_[k], static_cast<size_t>(size_[k])};
  }
  std::span<const int32_t> list(size_t stage, StageList list) const {
    return listAt(stage * kStageLists + static_cast<size_t>(list));
  }
  /// firstStage_ from the stage counts; the number of lists.
  size_t countStages(const std::vector<int64_t>& stagesOf);
  /// size_ from `sizes` (one per list), and begin_ from the same storage made the lists'
  /// starts in place (each entry the sum of those before it); returns the sum of all.
  int64_t takeSizes(std::vector<int64_t> sizes);

  std::vector<int64_t> firstStage_;  ///< worker w's stages: [firstStage_[w], firstStage_[w + 1])
  std::vector<int64_t> begin_;       ///< list k of all stages: ids_[begin_[k], + size_[k])
  std::vector<uint32_t> size_;
  std::shared_ptr<int32_t[]> ids_;
};

/// A Stages sized up front whose lists a builder writes in place (Stages::toFill, twoPasses),
/// then hands over (done). It is the only way to write a Stages's lists: a Stages's copies
/// share its storage, so no list changes once it is done (edit() stores the lists anew).
class StagesToFill {
 public:
  StagesToFill(StagesToFill&&) noexcept = default;
  StagesToFill& operator=(StagesToFill&&) noexcept = default;
  StagesToFill(const StagesToFill&) = delete;  // a copy would write what done() handed over
  StagesToFill& operator=(const StagesToFill&) = delete;

  /// Worker w's stage s, list `list`, to write (not a backward list twoPasses shares). Not
  /// after done().
  std::span<int32_t> list(size_t w, size_t s, StageList list);
  /// The Stages, its lists written.
  Stages done() && { return std::move(stages_); }

 private:
  friend class Stages;
  explicit StagesToFill(Stages stages) : stages_(std::move(stages)) {}
  Stages stages_;
};

/// One worker's stages of one pass, in order: a view into the Stages that holds them.
class WorkerStages {
 public:
  WorkerStages(const Stages* stages, size_t first, size_t count)
      : stages_(stages), first_(first), count_(count) {}
  size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  Stage operator[](size_t s) const { return stages_->stage(first_ + s); }
  Stage front() const { return (*this)[0]; }
  Stage back() const { return (*this)[count_ - 1]; }
  using Iterator = IndexIterator<Stages, Stage, &Stages::stage>;
  Iterator begin() const { return {stages_, first_}; }
  Iterator end() const { return {stages_, first_ + count_}; }

 private:
  const Stages* stages_;
  size_t first_, count_;
};

inline WorkerStages Stages::operator[](size_t w) const {
  return {this, static_cast<size_t>(firstStage_[w]),
          static_cast<size_t>(firstStage_[w + 1] - firstStage_[w])};
}
inline WorkerStages Stages::worker(size_t w) const { return (*this)[w]; }
inline WorkerStages Stages::front() const { return (*this)[0]; }

/// One piece of the reshuffle: tokens [begin, end) of the packed batch stream move between the
/// user layout's holder and the block's owner (inward: user -> FCP; outward: the reverse).
struct ReshufflePiece {
  int32_t userWorker = 0;
  int32_t fcpWorker = 0;
  int64_t begin = 0;
  int64_t end = 0;
  friend bool operator==(const ReshufflePiece&, const ReshufflePiece&) = default;
};

}  // namespace fcp::plan
