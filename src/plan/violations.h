#pragma once
// Private to the plan module: collects validate()'s sentences.

#include <sstream>
#include <string>
#include <vector>

namespace fcp::plan::detail {

/// Collects violations, keeping the first kMaxReported sentences and counting the rest.
class Violations {
 public:
  template <typename... Parts>
  void add(const Parts&... parts) {
    ++count_;
    if (messages_.size() >= kMaxReported) return;
    std::ostringstream os;
    (os << ... << parts);
    messages_.push_back(os.str());
  }
  std::vector<std::string> take() {
    if (count_ > messages_.size()) {
      messages_.push_back("... and " + std::to_string(count_ - messages_.size()) + " more");
    }
    return std::move(messages_);
  }
  bool empty() const { return count_ == 0; }
  /// Adds `later`'s sentences after these, as if each had been added here in turn.
  void append(Violations&& later) {
    for (std::string& m : later.messages_) {
      if (messages_.size() >= kMaxReported) break;
      messages_.push_back(std::move(m));
    }
    count_ += later.count_;
  }

 private:
  static constexpr size_t kMaxReported = 50;
  std::vector<std::string> messages_;
  size_t count_ = 0;
};

}  // namespace fcp::plan::detail
