#include "check_dump.hpp"

#include "options.hpp"

#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/dump/check_dump.hpp"
#include "lossverify/report/junit.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/control_band.hpp"
#include "lossverify/runner/launcher.hpp"

namespace lossverify::cli {

void register_check_dump(CLI::App& app, CheckDumpCommand& command) {
  command.app = app.add_subcommand(
      "check-dump",
      "check a training step dumped by a framework (manifest + safetensors/.npy tensors) against the "
      "float64 reference; several manifests of one problem at different layouts add the invariance check");
  command.app->add_option("manifests", command.args.manifests,
                          "the dump's manifest (lossverify.dump/1 JSON); several: the same problem at other layouts");
  command.app
      ->add_option("--manifest", command.args.named_manifests,
                   "a manifest, as the positional ones (repeatable; checked after them)")
      ->allow_extra_args(false);
  command.app->add_flag("--allow-outside-dump", command.args.allow_outside_dump,
                        "read tensor files outside the manifest's folder (absolute paths, ../, symlinks out of it); "
                        "by default every tensor file, symlinks resolved, must lie in that folder");
  command.app->add_option("--report", command.args.report_path, "write the JSON report here (atomically)");
  add_junit_option(*command.app, command.args.junit_path);
  command.app->add_flag("--quiet,-q", command.args.quiet, "print nothing; rely on the exit code and the report");
  add_control_flag(*command.app, command.args.no_control);
  command.app->add_option("--threads", command.args.threads, "OpenMP threads for the reference (default: all)")
      ->check(thread_count());
  command.app->footer(
      exit_codes("0 all checks pass, 1 a check failed, 2 usage error or a malformed dump, 3 internal error"));
}

namespace {

// What check-dump reads, which its report must not overwrite: the manifests and the files of their folders.
std::vector<std::string> dump_inputs(const std::vector<std::string>& manifests) {
  std::vector<std::string> files = manifests;
  for (const std::string& manifest : manifests) {
    std::error_code error;
    const std::filesystem::path folder = std::filesystem::path(manifest).parent_path();
    for (const auto& entry : std::filesystem::directory_iterator(folder.empty() ? "." : folder, error)) {
      files.push_back(entry.path().string());
    }
  }
  return files;
}

nlohmann::json layout_of(const Case& c) {
  return "tp" + std::to_string(c.layout.tp) + "-cp" + std::to_string(c.layout.cp) + "-dp" +
         std::to_string(c.layout.dp) + "-ga" + std::to_string(c.layout.ga);
}

}  // namespace

int run_check_dump(const CheckDumpArguments& args) {
  std::vector<std::string> paths = args.manifests;
  paths.insert(paths.end(), args.named_manifests.begin(), args.named_manifests.end());
  if (paths.empty()) {
    throw CaseError(
        "check-dump needs a manifest: lossverify check-dump MANIFEST.json [MORE.json ...], or "
        "--manifest MANIFEST.json");
  }
  check_output_path("--report", args.report_path, dump_inputs(paths));
  check_output_path("--junit", args.junit_path, dump_inputs(paths));
  check_distinct_outputs({{"--report", args.report_path}, {"--junit", args.junit_path}});
  // Every manifest is parsed and validated (its tensor files confined to its folder) before any tensor is read.
  dump::ManifestLimits limits;
  limits.allow_outside_folder = args.allow_outside_dump;
  std::vector<dump::Manifest> manifests;
  for (const std::string& path : paths) manifests.push_back(dump::load_manifest(path, limits));
  for (std::size_t k = 1; k < manifests.size(); ++k) dump::require_same_manifest_problem(manifests[0], manifests[k]);
  if (!args.no_control) {
    RunOptions control;
    control.threads = args.threads;
    for (const dump::Manifest& manifest : manifests) check_controls(manifest.the_case, control, *thread_launcher());
  }
  const bool sweep = manifests.size() > 1;
  dump::DumpCheckOptions options;
  options.threads = args.threads;
  options.keep_snapshot = sweep;

  std::vector<nlohmann::json> runs;
  std::optional<InvarianceCheck> invariance_check;  // of a sweep: each dump against the first as it comes
  std::vector<std::string> layouts;
  std::unique_ptr<dump::DumpProblem> first;
  Verdict verdict = Verdict::pass;
  // Printed once every dump is checked: a later dump that turns out to be another problem prints nothing.
  std::ostringstream printed;
  for (dump::Manifest& manifest : manifests) {
    auto problem = dump::load_dump(std::move(manifest), sweep);
    if (first) dump::require_same_problem(*first, *problem);
    RunResult result = dump::check_dump(*problem, options);
    if (!args.no_control) result.controls = dump::dump_controls(*problem, options);
    if (!args.quiet) dump::print_dump_summary(printed, *problem, result);
    if (result.verdict == Verdict::fail) verdict = Verdict::fail;
    runs.push_back(dump::dump_run_to_json(*problem, result));
    if (!first) {
      first = std::move(problem);  // kept for the comparison of inputs; the others are freed
      if (sweep) invariance_check.emplace(first->manifest.the_case);
    }
    if (sweep) {
      layouts.push_back(layout_of(result.the_case));
      invariance_check->add(std::move(*result.snapshot), layouts.back());
    }
  }
  std::cout << printed.str();
  nlohmann::json sweeps = nlohmann::json::array();
  if (sweep) {
    const Case& c = first->manifest.the_case;
    const CheckResult invariance = invariance_check->result();
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
  if (!args.report_path.empty() || !args.junit_path.empty()) {
    nlohmann::json report = make_report(sweep ? "sweep" : "check-dump", runs, code);
    if (sweep) report["sweeps"] = encode_nonfinite(sweeps);
    if (!args.report_path.empty()) {
      write_file_atomically(args.report_path, json_text(report, 2) + "\n");
      if (!args.quiet) std::cout << "report written to " << printable(args.report_path) << "\n";
    }
    if (!args.junit_path.empty()) {
      write_file_atomically(args.junit_path, report_junit(report));
      if (!args.quiet) std::cout << "JUnit written to " << printable(args.junit_path) << "\n";
    }
  }
  return static_cast<int>(code);
}

}  // namespace lossverify::cli
