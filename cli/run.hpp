#pragma once
// `lossverify run CASE.json ...`: case files on thread ranks or MPI processes, on the CPU or CUDA GPUs,
// checked against the float64 reference; sweeps with the invariance check.
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "repro.hpp"

namespace lossverify::cli {

struct RunArguments {
  std::vector<std::string> case_files;
  std::string implementation = "correct";
  int tp = 0, cp = 0, dp = 0, ga = 0;  // > 0: override the case's layout
  std::vector<std::string> set;
  std::string report_path;
  bool quiet = false;
  bool no_control = false;  // --no-control: no control band
  std::string junit_path;   // --junit FILE
  int threads = 0;
  double timeout = 0.0;
  std::string fault;
  std::vector<std::string> sweep;
  bool sweep_requested = false;  // --sweep given, perhaps with no layouts (the case's own sweep)
  std::string launcher = "auto";
  std::string backend = "cpu";
  int gpus = 1;
  std::string collectives = "auto";
  std::string reference = "auto";
  lossverify::cli::ArtifactOptions artifacts;  // --save-inputs, --save-inputs-dir, --plot
};

struct RunCommand {
  CLI::App* app = nullptr;
  RunArguments args;
  bool selected() const { return app != nullptr && app->parsed(); }
};

// Adds the subcommand to `app`; the returned object must outlive app.parse().
void register_run(CLI::App& app, RunCommand& command);
// After parsing: case files that CLI11 took for --sweep values go back among the cases, and the launcher is
// chosen. Returns an exit code after printing a usage error, else nullopt with `use_mpi` set.
std::optional<int> prepare_run(RunCommand& command, bool& use_mpi);
// Runs it on thread ranks: 0 pass, 1 a check failed; throws lossverify::Error (2 usage or case error,
// 3 internal or backend error, 4 timeout).
int run_run(const RunArguments& args);
// One MPI process per rank (started by mpiexec; MPI is initialised and finalised here). Exit codes as above;
// an error inside the run ends the whole job.
int run_run_mpi(const RunArguments& args, int* argc, char*** argv);

}  // namespace lossverify::cli
