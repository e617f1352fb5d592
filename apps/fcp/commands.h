#pragma once
/// Each subcommand of `fcp` registers itself on the top-level app. Each lives in its own file.

#include <CLI/CLI.hpp>

namespace fcp::app {

/// `fcp plan`: shard and assign a batch, print the plan summary.
void addPlanCommand(CLI::App& app);

/// `fcp bench kernel`: calibrate the block-attention kernels, write the efficiency curve.
void addBenchCommand(CLI::App& app);

/// `fcp run`: execute FCP and ring plans on MPI ranks, forward and backward, and compare them.
void addRunCommand(CLI::App& app);

/// `fcp simulate`: time FCP and the baselines on a simulated cluster.
void addSimulateCommand(CLI::App& app);

}  // namespace fcp::app
