#pragma once
// `lossverify gate`: every shipped case x every implementation against golden/,
// the matrix, the mutation score and a JUnit report.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace lossverify::cli {

struct GateArguments {
  std::string cases_dir = "cases";
  std::string golden_dir = "golden";
  std::string report_path;
  std::string junit_path;
  bool update_golden = false;
  int threads = 0;
  bool quiet = false;
  std::vector<std::string> implementations;
  std::string expect;
  std::string backend = "cpu";
  int gpus = 1;
  double timeout = 0.0;  // > 0: overrides every case's timeout_seconds
  std::string run_reports_dir;
};

struct GateCommand {
  CLI::App* app = nullptr;
  GateArguments args;
  bool selected() const { return app != nullptr && app->parsed(); }
};

// Adds the subcommand to `app`; the returned object must outlive app.parse().
void register_gate(CLI::App& app, GateCommand& command);
// Runs it: 0 every outcome matches golden, 1 an outcome differs; throws lossverify::Error (exit 2 for a
// usage error).
int run_gate(const GateArguments& args);

}  // namespace lossverify::cli
