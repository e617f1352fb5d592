// The `fcp` command. Errors end here: one line on stderr (one write, so several MPI ranks'
// lines never interleave), exit code 1 (2 for usage errors).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>

#include "commands.h"
#include "common.h"
#include "fcp/core/error.h"

namespace {

/// `code`, or 1 with one line when what the command printed did not all reach stdout: a full
/// disk under `fcp simulate --csv > out.csv` must not end in exit 0 and a truncated file.
int finish(int code) {
  errno = 0;
  std::cout.flush();  // (in sync with stdio, this flushes stdout: errno says why it failed)
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout.good()) {
    const int saved = errno;
    fcp::app::printErrorLine("error",
                             std::string("cannot write standard output: ") +
                                 (saved != 0 ? std::strerror(saved) : "an earlier write failed"));
    return 1;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fcp: flexible context parallelism"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.set_version_flag("--version", std::string("fcp ") + FCP_VERSION,
                       "Print the version (the CMake project's) and exit");
  fcp::app::addPlanCommand(app);
  fcp::app::addBenchCommand(app);
  fcp::app::addRunCommand(app);
  fcp::app::addSimulateCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    // Print the help of the deepest subcommand named on the command line.
    const CLI::App* target = &app;
    while (!target->get_subcommands().empty()) target = target->get_subcommands().front();
    std::cout << target->help();
    return finish(0);
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return finish(0);
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << '\n';
    return finish(0);
  } catch (const CLI::ParseError& e) {
    fcp::app::printErrorLine("error", std::string(e.what()) + " (see fcp --help)");
    return 2;
  } catch (const fcp::Error& e) {
    fcp::app::printErrorLine("error", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    fcp::app::printErrorLine("error", "out of memory (see the README's Limits for what each size costs)");
    return 1;
  } catch (const std::exception& e) {
    fcp::app::printErrorLine("internal error", e.what());
    return 1;
  }
  return finish(0);
}
