#include "check_dump.hpp"

#include <iostream>

#include "lossverify/dump/check_dump.hpp"
#include "lossverify/report/report.hpp"

namespace lossverify::cli {

void register_check_dump(CLI::App& app, CheckDumpCommand& command) {
  command.app = app.add_subcommand(
      "check-dump", "check a training step dumped by a framework (manifest + safetensors/.npy tensors) against the "
                    "float64 reference; several manifests of one problem at different layouts add the invariance check");
  command.app->add_option("--manifest", command.args.manifests,
                          "the dump's manifest (lossverify.dump/1 JSON); repeat for the same problem at other layouts")
      ->required()
      ->allow_extra_args(false);
  command.app->add_option("--report", command.args.report_path, "write the JSON report here (atomically)");
  command.app->add_flag("--quiet,-q", command.args.quiet, "print nothing; rely on the exit code and the report");
  command.app->add_option("--threads", command.args.threads, "OpenMP threads for the reference (default: all)")
      ->check(CLI::NonNegativeNumber);
}

namespace {

nlohmann::json layout_of(const Case& c) {
  return "tp" + std::to_string(c.layout.tp) + "-cp" + std::to_string(c.layout.cp) + "-dp" + std::to_string(c.layout.dp) +
         "-ga" + std::to_string(c.layout.ga);
}

}  // namespace

int run_check_dump(const CheckDumpArguments& args) {
  // Every manifest is parsed and validated before any tensor is read.
  std::vector<dump::Manifest> manifests;
  for (const std::string& path : args.manifests) manifests.push_back(dump::load_manifest(path));
  const bool sweep = manifests.size() > 1;
  dump::DumpCheckOptions options;
  options.threads = args.threads;
  options.keep_snapshot = sweep;

  std::vector<nlohmann::json> runs;
  std::vector<LayoutSnapshot> snapshots;
  std::vector<std::string> layouts;
  std::unique_ptr<dump::DumpProblem> first;
  Verdict verdict = Verdict::pass;
  for (dump::Manifest& manifest : manifests) {
    auto problem = dump::load_dump(std::move(manifest), sweep);
    if (first) dump::require_same_problem(*first, *problem);
    RunResult result = dump::check_dump(*problem, options);
    if (!args.quiet) dump::print_dump_summary(std::cout, *problem, result);
    if (result.verdict == Verdict::fail) verdict = Verdict::fail;
    runs.push_back(dump::dump_run_to_json(*problem, result));
    if (sweep) {
      snapshots.push_back(std::move(*result.snapshot));
      layouts.push_back(layout_of(result.the_case));
    }
    if (!first) first = std::move(problem);  // kept for the comparison of inputs; the others are freed
  }
  nlohmann::json sweeps = nlohmann::json::array();
  if (sweep) {
    const Case& c = first->manifest.the_case;
    const CheckResult invariance = invariance_check(c, snapshots, layouts);
    if (invariance.verdict == Verdict::fail) verdict = Verdict::fail;
    if (!args.quiet) {
      std::cout << "invariance over " << layouts.size() << " dumps: "
                << (invariance.verdict == Verdict::fail ? "FAIL" : std::string(to_string(invariance.verdict)))
                << ", margin " << invariance.margin << " (" << invariance.summary << ")\n"
                << "verdict: " << (verdict == Verdict::fail ? "FAIL" : "pass") << "\n";
    }
    sweeps.push_back({{"case", c.name},
                      {"layouts", layouts},
                      {"verdict", std::string(to_string(verdict))},
                      {"invariance", check_to_json(invariance, c)}});
  }
  const ExitCode code = verdict == Verdict::fail ? ExitCode::check_failed : ExitCode::pass;
  if (!args.report_path.empty()) {
    nlohmann::json report = make_report(sweep ? "sweep" : "check-dump", runs, code);
    if (sweep) report["sweeps"] = encode_nonfinite(sweeps);
    write_file_atomically(args.report_path, report.dump(2) + "\n");
    if (!args.quiet) std::cout << "report written to " << args.report_path << "\n";
  }
  return static_cast<int>(code);
}

}  // namespace lossverify::cli
