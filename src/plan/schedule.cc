#include "fcp/plan/schedule.h"

#include <algorithm>
#include <array>
#include <limits>
#include <utility>

#include "fcp/core/error.h"
#include "huge_pages.h"

namespace fcp::plan {
namespace {

/// A StageIds' lists in Stages' order.
std::array<const std::vector<int32_t>*, kStageLists> listsOf(const StageIds& st) {
  return {&st.send, &st.recv, &st.compute, &st.release, &st.sendGrad, &st.recvGrad};
}

}  // namespace

StageIds Stage::ids() const {
  const auto own = [](std::span<const int32_t> list) {
    return std::vector<int32_t>(list.begin(), list.end());
  };
  return {own(send), own(recv), own(compute), own(release), own(sendGrad), own(recvGrad)};
}

size_t Stages::countStages(const std::vector<int64_t>& stagesOf) {
  firstStage_.reserve(stagesOf.size() + 1);
  firstStage_.push_back(0);
  for (const int64_t count : stagesOf) {
    FCP_CHECK(count >= 0, "a worker with ", count, " stages");
    firstStage_.push_back(firstStage_.back() + count);
  }
  return static_cast<size_t>(firstStage_.back()) * kStageLists;
}

namespace {

/// A list size as stored (a plan's lists hold far fewer than 2^32 ids).
uint32_t listSize(int64_t size) {
  FCP_CHECK(size >= 0 && size <= int64_t{std::numeric_limits<uint32_t>::max()}, "a list of ", size,
            " ids");
  return static_cast<uint32_t>(size);
}

/// Storage for `count` ids: zeros, or, for builders that write every id, left as it is
/// (at 4096 workers clearing it first was the first touch of 13 MB on one thread).
std::shared_ptr<int32_t[]> idStorage(size_t count, bool zeros) {
  std::shared_ptr<int32_t[]> ids(zeros ? new int32_t[count]() : new int32_t[count]);
  detail::adviseHugePages(ids.get(), count * sizeof(int32_t));
  return ids;
}

}  // namespace

Stages::Stages(const std::vector<std::vector<StageIds>>& workers) {
  std::vector<int64_t> stagesOf;
  stagesOf.reserve(workers.size());
  for (const std::vector<StageIds>& stages : workers)
    stagesOf.push_back(static_cast<int64_t>(stages.size()));
  begin_.reserve(countStages(stagesOf));
  size_.reserve(begin_.capacity());
  size_t numIds = 0;
  for (const std::vector<StageIds>& stages : workers) {
    for (const StageIds& st : stages) {
      for (const std::vector<int32_t>* list : listsOf(st)) {
        begin_.push_back(static_cast<int64_t>(numIds));
        size_.push_back(listSize(static_cast<int64_t>(list->size())));
        numIds += list->size();
      }
    }
  }
  ids_ = idStorage(numIds, false);
  int32_t* at = ids_.get();
  for (const std::vector<StageIds>& stages : workers)
    for (const StageIds& st : stages)
      for (const std::vector<int32_t>* list : listsOf(st))
        at = std::copy(list->begin(), list->end(), at);
}

int64_t Stages::takeSizes(std::vector<int64_t> sizes) {
  size_.resize(sizes.size());
  int64_t sum = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    size_[k] = listSize(sizes[k]);
    sum += std::exchange(sizes[k], sum);
  }
  begin_ = std::move(sizes);
  return sum;
}

StagesToFill Stages::toFill(const std::vector<int64_t>& stagesOf, std::vector<int64_t> sizes) {
  Stages stages;
  const size_t lists = stages.countStages(stagesOf);
  FCP_CHECK(sizes.size() == lists, "list sizes for ", sizes.size(), " lists of ",
            stages.firstStage_.back(), " stages");
  const int64_t sum = stages.takeSizes(std::move(sizes));
  stages.ids_ = idStorage(static_cast<size_t>(sum), true);
  return StagesToFill(std::move(stages));
}

std::pair<StagesToFill, StagesToFill> Stages::twoPasses(
    const std::vector<int64_t>& forwardStagesOf, std::vector<int64_t> forwardSizes,
    const std::vector<int64_t>& backwardStagesOf, const std::vector<int64_t>& backwardSizes) {
  FCP_CHECK(forwardStagesOf.size() == backwardStagesOf.size(), "stages of ", forwardStagesOf.size(),
            " and ", backwardStagesOf.size(), " workers");
  Stages forward, backward;
  const size_t forwardLists = forward.countStages(forwardStagesOf);
  const size_t backwardLists = backward.countStages(backwardStagesOf);
  FCP_CHECK(forwardSizes.size() == forwardLists && backwardSizes.size() == backwardLists,
            "list sizes for ", forwardSizes.size(), " and ", backwardSizes.size(), " lists of ",
            forwardLists, " and ", backwardLists);
  int64_t sum = forward.takeSizes(std::move(forwardSizes));
  // The backward lists: a prefix of the forward's same list where both have the stage, else
  // after all of the forward's ids.
  backward.begin_.resize(backwardLists);
  backward.size_.resize(backwardLists);
  for (size_t w = 0; w < forwardStagesOf.size(); ++w) {
    const auto stages = static_cast<size_t>(backwardStagesOf[w]);
    const auto shared = static_cast<size_t>(std::min(forwardStagesOf[w], backwardStagesOf[w]));
    // Worker w's first list in each pass; its stage s, list l is s * kStageLists + l after it.
    const size_t backwardFirst = backward.listIndex(w, 0, StageList::kSend);
    const size_t forwardFirst = forward.listIndex(w, 0, StageList::kSend);
    for (size_t s = 0; s < stages; ++s) {
      for (size_t l = 0; l < kStageLists; ++l) {
        const size_t k = backwardFirst + s * kStageLists + l;
        backward.size_[k] = listSize(backwardSizes[k]);
        if (s < shared && static_cast<StageList>(l) <= StageList::kRelease) {
          const size_t f = forwardFirst + s * kStageLists + l;
          FCP_CHECK(backward.size_[k] <= forward.size_[f], "a backward list of ", backward.size_[k],
                    " ids over the forward's ", forward.size_[f]);
          backward.begin_[k] = forward.begin_[f];
        } else {
          backward.begin_[k] = sum;
          sum += backwardSizes[k];
        }
      }
    }
  }
  forward.ids_ = idStorage(static_cast<size_t>(sum), false);
  backward.ids_ = forward.ids_;
  return {StagesToFill(std::move(forward)), StagesToFill(std::move(backward))};
}

std::span<int32_t> StagesToFill::list(size_t w, size_t s, StageList list) {
  FCP_DCHECK(w < stages_.size(), "worker ", w, " of ", stages_.size(), " (after done()?)");
  const size_t k = stages_.listIndex(w, s, list);
  return {stages_.ids_.get() + stages_.begin_[k], static_cast<size_t>(stages_.size_[k])};
}

std::vector<int32_t> Stages::allIds() const {
  std::vector<int32_t> all;
  for (size_t k = 0; k < size_.size(); ++k)
    all.insert(all.end(), ids_.get() + begin_[k], ids_.get() + begin_[k] + size_[k]);
  return all;
}

bool operator==(const Stages& a, const Stages& b) {
  if (a.empty() || b.empty()) return a.empty() == b.empty();
  if (a.firstStage_ != b.firstStage_ || a.size_ != b.size_) return false;
  for (size_t k = 0; k < a.size_.size(); ++k) {
    const int32_t* x = a.ids_.get() + a.begin_[k];
    if (!std::equal(x, x + a.size_[k], b.ids_.get() + b.begin_[k])) return false;
  }
  return true;
}

std::vector<std::vector<StageIds>> Stages::ids() const {
  std::vector<std::vector<StageIds>> workers(size());
  for (size_t w = 0; w < size(); ++w) {
    const WorkerStages stages = (*this)[w];
    workers[w].reserve(stages.size());
    for (const Stage st : stages) workers[w].push_back(st.ids());
  }
  return workers;
}

}  // namespace fcp::plan
