#include "check_dump.hpp"

#include <iostream>

#include "lossverify/dump/check_dump.hpp"
#include "lossverify/report/report.hpp"

namespace lossverify::cli {

void register_check_dump(CLI::App& app, CheckDumpCommand& command) {
  command.app = app.add_subcommand(
      "check-dump", "check a training step dumped by a framework (manifest + safetensors/.npy tensors) against the "
                    "float64 reference");
  command.app->add_option("--manifest", command.args.manifest, "the dump's manifest (lossverify.dump/1 JSON)")
      ->required();
  command.app->add_option("--report", command.args.report_path, "write the JSON report here (atomically)");
  command.app->add_flag("--quiet,-q", command.args.quiet, "print nothing; rely on the exit code and the report");
  command.app->add_option("--threads", command.args.threads, "OpenMP threads for the reference (default: all)")
      ->check(CLI::NonNegativeNumber);
}

int run_check_dump(const CheckDumpArguments& args) {
  const auto problem = dump::load_dump(args.manifest);
  dump::DumpCheckOptions options;
  options.threads = args.threads;
  const RunResult result = dump::check_dump(*problem, options);
  if (!args.quiet) dump::print_dump_summary(std::cout, *problem, result);
  const ExitCode code = result.verdict == Verdict::fail ? ExitCode::check_failed : ExitCode::pass;
  if (!args.report_path.empty()) {
    write_file_atomically(args.report_path,
                          make_report("check-dump", {dump::dump_run_to_json(*problem, result)}, code).dump(2) + "\n");
    if (!args.quiet) std::cout << "report written to " << args.report_path << "\n";
  }
  return static_cast<int>(code);
}

}  // namespace lossverify::cli
