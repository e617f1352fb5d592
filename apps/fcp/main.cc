// The `fcp` command. Errors end here: one line on stderr, exit code 1 (2 for usage errors).
#include <exception>
#include <iostream>

#include "commands.h"
#include "fcp/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"fcp: flexible context parallelism"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
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
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << "fcp: error: " << e.what() << " (see fcp --help)\n";
    return 2;
  } catch (const fcp::Error& e) {
    std::cerr << "fcp: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fcp: internal error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
