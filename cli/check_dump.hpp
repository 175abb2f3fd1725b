#pragma once
// `lossverify check-dump dump/manifest.json` (or `--manifest dump/manifest.json`): checks a training step
// dumped by a framework.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace lossverify::cli {

struct CheckDumpArguments {
  std::vector<std::string> manifests;        // positional
  std::vector<std::string> named_manifests;  // after --manifest: checked after the positional ones
  std::string report_path;
  bool quiet = false;
  bool no_control = false;  // --no-control: no control band
  std::string junit_path;   // --junit FILE
  int threads = 0;
  bool allow_outside_dump = false;  // tensor files may lie outside their manifest's folder
};

struct CheckDumpCommand {
  CLI::App* app = nullptr;
  CheckDumpArguments args;
  bool selected() const { return app != nullptr && app->parsed(); }
};

// Adds the subcommand to `app`; the returned object must outlive app.parse().
void register_check_dump(CLI::App& app, CheckDumpCommand& command);
// Runs it: 0 pass, 1 a check failed; throws lossverify::Error (exit 2 for a malformed dump or manifest, or
// no manifest at all).
int run_check_dump(const CheckDumpArguments& args);

}  // namespace lossverify::cli
