#pragma once
// Reproducing and seeing a failure: `run --save-inputs/--save-inputs-dir/--plot`, `lossverify replay BUNDLE`
// and `lossverify shrink CASE --impl NAME`.
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "lossverify/runner/run_case.hpp"

namespace lossverify::cli {

// The options `run` gains.
struct ArtifactOptions {
  std::string save_inputs;      // never | failed | always; empty: failed with --save-inputs-dir, else never
  std::string save_inputs_dir;  // default: the --report file's folder, else the current folder
  std::string plot_path;        // .svg or .html
};
void add_artifact_options(CLI::App& run, ArtifactOptions& options);
// Whether the command must keep its runs' results for bundles or plots.
inline bool artifacts_requested(const ArtifactOptions& options) {
  return !options.plot_path.empty() || !options.save_inputs_dir.empty() ||
         (!options.save_inputs.empty() && options.save_inputs != "never");
}

// How the run was started, for the bundles' provenance.
struct ArtifactContext {
  std::vector<std::string> set_overrides;
  std::string report_path;
  std::string launcher = "threads";
  int processes = 1;
  std::string device = "cpu";
  int gpus = 0;
  bool quiet = false;
  std::vector<std::string> inputs;  // the files the command reads: never written over
  // The command's own outputs (--report, --junit, --plot): a bundle never takes one of their names.
  std::vector<std::string> outputs;
};

// Checks the options before anything runs: throws CaseError (exit 2) for a --plot path that is neither
// .svg nor .html or cannot be written (output_path.hpp), or a bundle folder that cannot be written.
void check_artifact_options(const ArtifactOptions& options, const ArtifactContext& context);

// Writes the bundles (per --save-inputs) and the plot of the runs of one command, each file atomically;
// prints each path unless quiet. Every file's contents are built before the first is written.
void write_artifacts(const ArtifactOptions& options, const std::vector<RunResult>& runs,
                     const ArtifactContext& context);

// The command line, recorded in bundles.
void remember_command_line(int argc, char** argv);

struct ReplayArguments {
  std::string bundle;
  std::string implementation;  // empty: the recorded one
  std::string backend;         // empty: the recorded one
  std::string report_path;
  std::string plot_path;
  int threads = 0;
  bool quiet = false;
};

struct ShrinkArguments {
  std::string case_file;
  std::string implementation;
  std::string check;
  std::vector<std::string> set;
  int tp = 0;
  std::string out_path;
  int max_trials = 400;
  double max_seconds = 60.0;
  bool pin_rows = false;
  int threads = 0;
  bool quiet = false;
};

struct ReproCommands {
  CLI::App* replay = nullptr;
  CLI::App* shrink = nullptr;
  ReplayArguments replay_args;
  ShrinkArguments shrink_args;
};

// Adds `replay` and `shrink` to `app`; `commands` must outlive app.parse().
void register_repro_commands(CLI::App& app, ReproCommands& commands);
// Runs the selected one (nullopt when neither was selected). Throws lossverify::Error like `run`.
std::optional<int> run_repro_command(const ReproCommands& commands);

}  // namespace lossverify::cli
