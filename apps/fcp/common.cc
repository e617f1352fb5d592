#include "common.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "fcp/core/error.h"
#include "fcp/core/input.h"
#include "fcp/core/units.h"
#include "fcp/core/workload.h"

namespace fcp::app {
namespace {

template <typename T>
std::string show(T value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

/// This process's rank under an MPI launcher with more than one rank, or -1.
int launcherRank() {
  for (auto [rankVar, sizeVar] : {std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                                  {"PMI_RANK", "PMI_SIZE"}, {"PMIX_RANK", "PMIX_SIZE"}}) {
    const char* rank = std::getenv(rankVar);
    const char* size = std::getenv(sizeVar);
    if (rank && size && std::atoi(size) > 1) return std::atoi(rank);
  }
  return -1;
}

}  // namespace

std::string describeDraw(const std::string& workload, uint64_t seed, int64_t minSequences) {
  std::string text = "workload " + workload + " (seed " + std::to_string(seed);
  if (minSequences > 1) text += ", at least " + std::to_string(minSequences) + " sequences";
  return text + ")";
}

std::string_view workloadFile(const std::string& workload) {
  return builtinWorkload(workload) != nullptr ? std::string_view{} : std::string_view{workload};
}

CLI::Option* addText(CLI::App* cmd, const std::string& name, std::string& target,
                     const std::string& help) {
  CLI::Option* option = cmd->add_option_function<std::string>(
      name, [&target, name](const std::string& text) {
        if (text.empty()) throwInvalidArgument("empty ", name, " '': expected a value");
        target = text;
      },
      help);
  option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  if (!target.empty()) option->default_str(target);
  return option;
}

CLI::Option* addInteger(CLI::App* cmd, const std::string& name, int64_t& target, int64_t min,
                        int64_t max, const std::string& help) {
  return cmd
      ->add_option_function<std::string>(
          name, [&target, name, min, max](const std::string& text) {
            target = parseInteger(text, name, min, max);
          },
          help + " [" + show(min) + " to " + show(max) + "]")
      ->type_name("INT")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str(show(target));
}

CLI::Option* addIntegerList(CLI::App* cmd, const std::string& name, std::vector<int64_t>& target,
                            int64_t min, int64_t max, const std::string& help) {
  std::string shown;
  for (int64_t v : target) shown += (shown.empty() ? "" : ",") + std::to_string(v);
  return cmd
      ->add_option_function<std::string>(
          name, [&target, name, min, max](const std::string& text) {
            // Split here rather than with CLI11's delimiter, which drops empty items.
            target.clear();
            size_t begin = 0;
            for (;;) {
              const size_t comma = text.find(',', begin);
              const std::string_view item =
                  std::string_view(text).substr(begin, comma == std::string::npos ? std::string::npos
                                                                                   : comma - begin);
              target.push_back(parseInteger(item, name + " item", min, max));
              if (comma == std::string::npos) break;
              begin = comma + 1;
            }
          },
          help + " [each " + show(min) + " to " + show(max) + "]")
      ->type_name("INT,...")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str(shown);
}

CLI::Option* addUnsigned(CLI::App* cmd, const std::string& name, uint64_t& target, uint64_t max,
                         const std::string& help) {
  return cmd
      ->add_option_function<std::string>(
          name, [&target, name, max](const std::string& text) {
            target = parseUnsigned(text, name, max);
          },
          help + " [0 to " + show(max) + "]")
      ->type_name("UINT")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str(show(target));
}

CLI::Option* addNumber(CLI::App* cmd, const std::string& name, double& target, double min,
                       double max, const std::string& help) {
  return cmd
      ->add_option_function<std::string>(
          name, [&target, name, min, max](const std::string& text) {
            target = parseNumber(text, name, min, max);
          },
          help + " [" + show(min) + " to " + show(max) + "]")
      ->type_name("NUMBER")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str(show(target));
}

CLI::Option* addPositiveNumber(CLI::App* cmd, const std::string& name, double& target, double max,
                               const std::string& help, const std::string& shownDefault) {
  const std::string expected = "above 0, up to " + show(max);
  return cmd
      ->add_option_function<std::string>(
          name,
          [&target, name, max, expected](const std::string& text) {
            double value = 0;
            try {
              value = parseNumber(text, name, 0, max);
            } catch (const Error&) {
            }
            if (!(value > 0))
              throwInvalidArgument("invalid ", name, " '", printable(text),
                                   "': expected a finite number ", expected);
            target = value;
          },
          help + " [" + expected + "]")
      ->type_name("NUMBER")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->default_str(shownDefault);
}

int64_t parseBlockSize(const std::string& text) {
  const int64_t size = parseTokenCount(text, "--block-size");
  plan::checkBlockSize(size, "--block-size");
  return size;
}

void printErrorLine(std::string_view kind, std::string_view message) {
  std::string line = "fcp: ";
  line += kind;
  line += ": ";
  const int rank = launcherRank();
  if (rank >= 0 && message.rfind("rank ", 0) != 0) line += "rank " + std::to_string(rank) + ": ";
  line += printable(message, kMaxErrorMessageChars);
  line += '\n';
  size_t written = 0;
  while (written < line.size()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + written, line.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
}

}  // namespace fcp::app
