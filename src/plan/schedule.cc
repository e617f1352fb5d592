#include "fcp/plan/schedule.h"

#include <algorithm>
#include <array>
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

Stages::Stages(const std::vector<std::vector<StageIds>>& workers) {
  firstStage_.reserve(workers.size() + 1);
  firstStage_.push_back(0);
  size_t numIds = 0;
  for (const std::vector<StageIds>& stages : workers) {
    firstStage_.push_back(firstStage_.back() + static_cast<int64_t>(stages.size()));
    for (const StageIds& st : stages)
      for (const std::vector<int32_t>* list : listsOf(st)) numIds += list->size();
  }
  firstId_.reserve(static_cast<size_t>(firstStage_.back()) * kStageLists + 1);
  firstId_.push_back(0);
  ids_.reserve(numIds);
  for (const std::vector<StageIds>& stages : workers) {
    for (const StageIds& st : stages) {
      for (const std::vector<int32_t>* list : listsOf(st)) {
        ids_.insert(ids_.end(), list->begin(), list->end());
        firstId_.push_back(static_cast<int64_t>(ids_.size()));
      }
    }
  }
}

Stages::Stages(const std::vector<int64_t>& stagesOf, std::vector<int64_t> sizes) {
  firstStage_.reserve(stagesOf.size() + 1);
  firstStage_.push_back(0);
  for (const int64_t count : stagesOf) {
    FCP_CHECK(count >= 0, "a worker with ", count, " stages");
    firstStage_.push_back(firstStage_.back() + count);
  }
  FCP_CHECK(sizes.size() == static_cast<size_t>(firstStage_.back()) * kStageLists,
            "list sizes for ", sizes.size(), " lists of ", firstStage_.back(), " stages");
  // The sizes become the lists' starts in place: each entry the sum of those before it.
  firstId_ = std::move(sizes);
  firstId_.push_back(0);
  int64_t sum = 0, least = 0;
  for (int64_t& first : firstId_) {
    least = std::min(least, first);
    sum += std::exchange(first, sum);
  }
  FCP_CHECK(least >= 0, "a list of ", least, " ids");
  detail::resizeHuge(ids_, static_cast<size_t>(firstId_.back()));
}

std::span<int32_t> Stages::fill(size_t w, size_t s, StageList list) {
  const size_t k =
      (static_cast<size_t>(firstStage_[w]) + s) * kStageLists + static_cast<size_t>(list);
  return {ids_.data() + firstId_[k], static_cast<size_t>(firstId_[k + 1] - firstId_[k])};
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
