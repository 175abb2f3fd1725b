#include "gate.hpp"

#include <filesystem>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/gate.hpp"
#include "options.hpp"

namespace lossverify::cli {

namespace {

// The case and golden files a gate reads: its reports must not be written over them.
std::vector<std::string> gate_input_files(const std::string& cases_dir, const std::string& golden_dir) {
  std::vector<std::string> files;
  for (const std::string& dir : {cases_dir, golden_dir}) {
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(dir, error)) files.push_back(entry.path().string());
  }
  return files;
}

}  // namespace

int run_gate(const GateArguments& args) {
  GateOptions options;
  options.cases_dir = args.cases_dir;
  options.golden_dir = args.golden_dir;
  options.update_golden = args.update_golden;
  options.threads = args.threads;
  options.quiet = args.quiet;
  options.implementations = args.implementations;
  options.expect = args.expect;
  options.device = args.backend == "cuda" ? RunOptions::Device::cuda : RunOptions::Device::cpu;
  options.gpus = args.gpus;
  options.timeout_seconds = args.timeout;
  if (args.backend != "cuda" && args.gpus != 1) throw CaseError("--gpus needs --backend cuda");
  if (!args.expect.empty() && args.implementations.empty()) throw CaseError("--expect needs --impl");
  for (const auto& [option, dir] : {std::pair{"--cases", args.cases_dir}, std::pair{"--golden", args.golden_dir}}) {
    if (!std::filesystem::is_directory(dir)) {
      throw CaseError(std::string(option) + " " + printable(dir) + ": no such folder" +
                      (dir == "cases" || dir == "golden"
                           ? " here: run the gate from the repository root, or give --cases DIR --golden DIR"
                           : ""));
    }
  }
  const std::vector<std::string> inputs = gate_input_files(args.cases_dir, args.golden_dir);
  check_output_path("--report", args.report_path, inputs);
  check_output_path("--junit", args.junit_path, inputs);
  check_distinct_outputs({{"--report", args.report_path}, {"--junit", args.junit_path}});
  if (!args.run_reports_dir.empty()) prepare_new_folder("--run-reports", args.run_reports_dir);
  options.run_reports_dir = args.run_reports_dir;
  const GateResult result = lossverify::run_gate(options);
  if (!args.quiet) print_gate_matrix(std::cout, result);
  if (!args.report_path.empty()) write_file_atomically(args.report_path, json_text(gate_report(result), 2) + "\n");
  if (!args.junit_path.empty()) write_file_atomically(args.junit_path, gate_junit(result));
  return static_cast<int>(result.passed() ? ExitCode::pass : ExitCode::check_failed);
}

void register_gate(CLI::App& app, GateCommand& command) {
  command.app = app.add_subcommand(
      "gate", "CI gate: every shipped case x every implementation vs golden/, matrix, mutation score, JUnit");
  command.app->footer(lossverify::cli::exit_codes(
      "0 every outcome matches golden, 1 an outcome differs, 2 usage error, 3 internal error"));
  command.app->add_option("--cases", command.args.cases_dir, "directory of case files (default: cases)");
  command.app->add_option("--golden", command.args.golden_dir, "directory of golden outcomes (default: golden)");
  command.app->add_option("--report", command.args.report_path, "write the JSON gate report here");
  command.app->add_option("--junit", command.args.junit_path, "write JUnit XML here");
  command.app->add_flag("--update-golden", command.args.update_golden,
                        "rewrite golden/ from this run (review the diff)");
  command.app->add_option("--threads", command.args.threads, "OpenMP threads for the reference")
      ->check(lossverify::cli::thread_count());
  command.app->add_flag("--quiet,-q", command.args.quiet, "print nothing; rely on the exit code and the reports");
  command.app
      ->add_option("--impl", command.args.implementations,
                   "gate these implementations only (repeatable), e.g. a plugin: --impl plugin:./libmy_loss.so")
      ->allow_extra_args(false);
  command.app
      ->add_option("--backend", command.args.backend,
                   "where the kernels run: cpu, or cuda (judged by the GPU oracle; golden/ is the same)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  command.app->add_option("--gpus", command.args.gpus, "cuda: GPUs to spread each case's ranks over (rank % gpus)")
      ->check(CLI::PositiveNumber);
  command.app
      ->add_option("--timeout", command.args.timeout,
                   "deadlock guard in seconds for every case (overrides their timeout_seconds), as run's")
      ->check(CLI::Range(0.01, 86400.0));
  command.app->add_option("--run-reports", command.args.run_reports_dir,
                          "also write every run's report into this new or empty folder (CASE__IMPL.json, "
                          "CASE__sweep.json), as run --report writes it");
  command.app->add_option(
      "--expect", command.args.expect,
      "judge them against golden's outcomes of this implementation (default: their own; correct for a plugin)");
}

}  // namespace lossverify::cli
