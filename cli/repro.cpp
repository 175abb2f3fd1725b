#include "repro.hpp"

#include "options.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <set>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/report/plot.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/repro/bundle.hpp"
#include "lossverify/repro/shrink.hpp"

namespace lossverify::cli {

namespace {

std::vector<std::string>& command_line() {
  static std::vector<std::string> words;
  return words;
}

std::string sanitise(std::string_view text) {
  std::string out;
  for (char ch : text) {
    out += (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-') ? ch : '_';
  }
  return out.empty() ? "case" : out;
}

std::string resolved_save_policy(const ArtifactOptions& options) {
  if (!options.save_inputs.empty()) return options.save_inputs;
  return options.save_inputs_dir.empty() ? "never" : "failed";
}

std::string bundle_folder(const ArtifactOptions& options, const ArtifactContext& context) {
  if (!options.save_inputs_dir.empty()) return options.save_inputs_dir;
  if (!context.report_path.empty()) {
    const std::filesystem::path parent = std::filesystem::path(context.report_path).parent_path();
    if (!parent.empty()) return parent.string();
  }
  return ".";
}

std::string failing_list(const RunResult& run) {
  std::string list;
  for (const CheckResult& c : run.checks) {
    if (c.verdict == Verdict::fail) append_to_list(list, c.name);
  }
  return list;
}

std::string failing_list(const Bundle& bundle) {
  std::string list;
  for (const RecordedCheck& c : bundle.checks) {
    if (c.verdict == Verdict::fail) append_to_list(list, c.name);
  }
  return list;
}

std::string verdict_text(Verdict v) { return v == Verdict::fail ? "FAIL" : std::string(to_string(v)); }

void write_plots(const std::string& path, const std::vector<const RunResult*>& runs, bool quiet) {
  for (const auto& [file, contents] : render_plots(path, runs)) {
    write_file_atomically(file, contents);
    if (!quiet) std::cout << "plot written to " << printable(file) << "\n";
  }
}

void check_plot_path(const std::string& path, const std::vector<std::string>& inputs) {
  if (path.empty()) return;
  if (!is_plot_path(path))
    throw CaseError("--plot " + printable(path) + ": expected a file ending in .svg, .html or .htm");
  check_output_path("--plot", path, inputs);
}

// --- replay -------------------------------------------------------------------------------------------

// Whether --impl names the bundle's own implementation (a plugin by its canonical spec).
bool same_implementation(const std::string& given, const std::string& recorded) {
  if (given == recorded) return true;
  return is_plugin_spec(given) && is_plugin_spec(recorded) && canonical_plugin_spec(given) == recorded;
}

int command_replay(const ReplayArguments& args) {
  check_plot_path(args.plot_path, {args.bundle});
  check_output_path("--report", args.report_path, {args.bundle});
  const Bundle bundle = read_bundle(args.bundle);
  const bool other_impl =
      !args.implementation.empty() && !same_implementation(args.implementation, bundle.implementation);
  if (is_plugin_spec(bundle.implementation) && args.implementation.empty()) {
    throw CaseError(printable(args.bundle) + " was recorded with " + printable(bundle.implementation) +
                    ": a bundle never loads a library by itself; name it on the command line (--impl " +
                    printable(bundle.implementation) + ") or replay with another implementation (--impl correct)");
  }
  if (other_impl && find_implementation(args.implementation) == nullptr) {
    throw CaseError("--impl " + args.implementation + ": unknown implementation (see `lossverify list`)");
  }
  const std::string device = args.backend.empty() ? bundle.device : args.backend;
  if (!args.quiet) {
    const std::string failing = failing_list(bundle);
    std::cout << "replaying " << printable(args.bundle) << ": case " << printable(bundle.the_case.name) << ", impl "
              << bundle.implementation << ", recorded verdict " << verdict_text(bundle.verdict)
              << (failing.empty() ? "" : " (" + failing + ")") << " by lossverify " << bundle.tool_version << " (git "
              << bundle.git_revision << ") on " << bundle.device << "\n";
  }
  const std::vector<std::string> drift = input_drift(bundle);
  if (!args.quiet && !bundle.rows.empty()) {
    std::string tokens;
    for (const RecordedRow& r : bundle.rows) append_to_list(tokens, std::to_string(r.token));
    std::cout << "  " << bundle.rows.size() << " recorded row(s), pinned inline (tokens " << tokens << ")"
              << (drift.empty() ? "; this build's generator reproduces them bit for bit" : "") << "\n";
  }
  for (const std::string& line : drift) {
    std::cerr << "lossverify: warning: input drift: " << line
              << " (the generator changed since the bundle was written; rows not recorded may differ too)\n";
  }

  RunOptions options;
  options.implementation = other_impl ? args.implementation : bundle.implementation;
  options.threads = args.threads;
  options.device = device == "cuda" ? RunOptions::Device::cuda : RunOptions::Device::cpu;
  const RunResult result = run_case(bundle.the_case, options);
  if (!args.quiet) print_summary(std::cout, result);
  const ExitCode run_code = result.verdict == Verdict::fail ? ExitCode::check_failed : ExitCode::pass;
  if (!args.plot_path.empty()) write_plots(args.plot_path, {&result}, args.quiet);
  if (!args.report_path.empty()) {
    write_file_atomically(args.report_path, json_text(make_report("run", {run_to_json(result)}, run_code), 2) + "\n");
    if (!args.quiet) std::cout << "report written to " << printable(args.report_path) << "\n";
  }

  if (other_impl) {
    // Checking a fix (or another bug) on the bundle's inputs: the run's own verdict decides.
    if (!args.quiet) {
      std::cout << "with --impl " << args.implementation << ": " << verdict_text(result.verdict)
                << (result.verdict == Verdict::fail ? " (" + failing_list(result) + ")" : "") << "; recorded with "
                << bundle.implementation << ": " << verdict_text(bundle.verdict) << "\n";
    }
    return static_cast<int>(run_code);
  }
  const bool same_backend = device == bundle.device;
  const ReplayComparison comparison = compare_outcome(bundle, result, same_backend);
  if (comparison.reproduced) {
    const std::string failing = failing_list(result);
    std::cout << "reproduced: " << verdict_text(result.verdict) << " as recorded"
              << (failing.empty()
                      ? std::string("")
                      : std::string(": ") + failing +
                            (failing.find(',') == std::string::npos
                                 ? (same_backend ? " fails with its worst element where recorded" : " fails")
                                 : (same_backend ? " fail with their worst elements where recorded" : " fail")))
              << "\n";
  } else {
    std::cout << "did not reproduce:\n";
    for (const std::string& line : comparison.differences) std::cout << "  " << line << "\n";
  }
  if (!args.quiet) {
    for (const std::string& line : comparison.notes) std::cout << "  note: " << line << "\n";
    if (!same_backend) std::cout << "  note: recorded on " << bundle.device << ", replayed on " << device << "\n";
  }
  return comparison.reproduced ? 0 : static_cast<int>(ExitCode::check_failed);
}

// --- shrink -------------------------------------------------------------------------------------------

std::string size_line(const char* what, std::int64_t before, std::int64_t after) {
  return std::string("  ") + what + std::string(12 - std::min<std::size_t>(11, std::strlen(what)), ' ') +
         std::to_string(before) + " -> " + std::to_string(after) + "\n";
}

std::string layout_text(const LayoutSpec& l) {
  return "tp=" + std::to_string(l.tp) + (l.sp ? " sp" : "") + " cp=" + std::to_string(l.cp) +
         " dp=" + std::to_string(l.dp) + " ga=" + std::to_string(l.ga);
}

int command_shrink(const ShrinkArguments& args) {
  std::vector<std::string> overrides = args.set;
  if (args.tp > 0) overrides.push_back("layout.tp=" + std::to_string(args.tp));
  const Case original = load_case_file(args.case_file, overrides);
  const std::string out_path = args.out_path.empty() ? sanitise(original.name) + "-shrunk.json" : args.out_path;
  check_output_path("--out", out_path, {args.case_file});
  ShrinkOptions options;
  options.implementation = args.implementation;
  options.check = args.check;
  options.max_trials = args.max_trials;
  options.max_seconds = args.max_seconds;
  options.pin_rows = args.pin_rows;
  options.threads = args.threads;
  if (!args.quiet) options.progress = [](const std::string& line) { std::cout << line << "\n" << std::flush; };
  const ShrinkResult result = shrink_case(original, options);

  // The file must read back as a case that still fails the check before it is written.
  const std::string text = case_file_text(result.minimized);
  const Case reread = parse_case(nlohmann::json::parse(text), out_path);
  RunOptions run_options;
  run_options.implementation = args.implementation;
  run_options.threads = args.threads;
  const RunResult confirm = run_case(reread, run_options);
  const auto it = std::find_if(confirm.checks.begin(), confirm.checks.end(),
                               [&](const CheckResult& c) { return c.name == result.check; });
  if (it == confirm.checks.end() || it->verdict != Verdict::fail) {
    throw InternalError("shrink: the minimized case no longer fails check " + result.check + " when read back");
  }
  write_file_atomically(out_path, text);

  if (!args.quiet) {
    const ShrinkSize& b = result.before;
    const ShrinkSize& a = result.after;
    std::cout << "shrunk " << printable(args.case_file) << " with --impl " << args.implementation << ": check "
              << result.check << " still fails\n";
    std::cout << size_line("tokens", b.tokens, a.tokens) << size_line("vocab", b.vocab, a.vocab)
              << size_line("logits", b.logits(), a.logits()) << size_line("sequences", b.sequences, a.sequences)
              << size_line("inline rows", b.overrides, a.overrides);
    std::cout << "  layout      " << layout_text(b.layout) << " -> " << layout_text(a.layout) << "\n";
    std::cout << "  margin      " << std::setprecision(3) << result.margin_before << " -> " << it->margin
              << std::setprecision(6) << "\n";
    std::cout << "  " << result.steps.size() << " reductions kept in " << result.trials << " trials, " << std::fixed
              << std::setprecision(2) << result.seconds << " s" << std::defaultfloat
              << (result.budget_exhausted ? " (budget exhausted: raise --max-trials or --max-seconds to go further)"
                                          : " (no reduction left that keeps it failing)")
              << "\n";
  }
  std::cout << "minimized case written to " << printable(out_path) << "\n";
  return 0;
}

}  // namespace

// --- run --save-inputs / --plot ----------------------------------------------------------------------------

void remember_command_line(int argc, char** argv) { command_line().assign(argv, argv + argc); }

void add_artifact_options(CLI::App& run, ArtifactOptions& options) {
  run.add_option("--save-inputs", options.save_inputs,
                 "write a reproducer bundle per run: never (default), failed, or always")
      ->check(CLI::IsMember({"never", "failed", "always"}));
  run.add_option("--save-inputs-dir", options.save_inputs_dir,
                 "folder for the bundles (default: the --report file's folder, else the current one); alone it "
                 "implies --save-inputs failed");
  run.add_option("--plot", options.plot_path,
                 "draw where the error sits: FILE.svg (one per run when several) or FILE.html (one page)");
}

void check_artifact_options(const ArtifactOptions& options, const ArtifactContext& context) {
  check_plot_path(options.plot_path, context.inputs);
  if (!options.save_inputs_dir.empty()) check_output_folder("--save-inputs-dir", options.save_inputs_dir);
  if (resolved_save_policy(options) != "never") {
    check_output_folder(
        options.save_inputs_dir.empty() ? "--save-inputs: the --report file's folder" : "--save-inputs-dir",
        bundle_folder(options, context));
  }
}

void write_artifacts(const ArtifactOptions& options, const std::vector<RunResult>& runs,
                     const ArtifactContext& context) {
  std::vector<std::pair<std::string, std::string>> bundles;
  const std::string policy = resolved_save_policy(options);
  if (policy != "never") {
    const std::filesystem::path folder = bundle_folder(options, context);
    std::map<std::string, int> cases_named;
    for (const RunResult& run : runs) ++cases_named[run.the_case.name];
    std::map<std::string, int> used;
    std::set<std::string> taken;  // the command's own outputs, by the file each lands in
    for (const std::string& output : context.outputs) {
      if (!output.empty()) taken.insert(output_identity(output));
    }
    BundleContext bundle_context;
    bundle_context.set_overrides = context.set_overrides;
    bundle_context.command_line = command_line();
    bundle_context.launcher = context.launcher;
    bundle_context.processes = context.processes;
    bundle_context.device = context.device;
    bundle_context.gpus = context.gpus;
    for (const RunResult& run : runs) {
      if (policy == "failed" && run.verdict != Verdict::fail) continue;
      const nlohmann::json bundle = make_bundle(run, bundle_context);
      std::string name = sanitise(run.the_case.name) + "." + sanitise(run.implementation->name);
      if (cases_named[run.the_case.name] > 1) name += "." + layout_name(run.the_case.layout);
      if (const int n = ++used[name]; n > 1) name += "." + std::to_string(n);
      // A --report (or --junit, --plot) named like this bundle keeps its name; the bundle takes the next number.
      const auto is_taken = [&](const std::string& n) {
        return taken.count(output_identity((folder / (n + ".bundle.json")).string())) > 0;
      };
      if (is_taken(name)) {
        int n = ++used[name];
        while (is_taken(name + "." + std::to_string(n))) n = ++used[name];
        name += "." + std::to_string(n);
      }
      std::size_t values = 0;
      for (const auto& row : bundle.at("failing_rows")) values += row.at("logits_bits").get<std::string>().size() / 5;
      // Pretty-printed unless the rows are large (every number would take a line of its own).
      bundles.emplace_back((folder / (name + ".bundle.json")).string(),
                           (values <= 65536 ? json_text(bundle, 1) : json_text(bundle)) + "\n");
    }
  }
  std::vector<std::pair<std::string, std::string>> plots;
  if (!options.plot_path.empty()) {
    std::vector<const RunResult*> pointers;
    for (const RunResult& run : runs) pointers.push_back(&run);
    plots = render_plots(options.plot_path, pointers);
  }
  for (const auto& [path, contents] : bundles) {
    write_file_atomically(path, contents);
    if (!context.quiet) std::cout << "reproducer bundle written to " << printable(path) << "\n";
  }
  for (const auto& [path, contents] : plots) {
    write_file_atomically(path, contents);
    if (!context.quiet) std::cout << "plot written to " << printable(path) << "\n";
  }
}

// --- registration
// -------------------------------------------------------------------------------------------

void register_repro_commands(CLI::App& app, ReproCommands& commands) {
  ReplayArguments& r = commands.replay_args;
  commands.replay =
      app.add_subcommand("replay",
                         "re-run a reproducer bundle (run --save-inputs) and compare with the recorded outcome: exit 0 "
                         "reproduced, 1 did not reproduce (with --impl: the run's own exit code)");
  commands.replay->footer(exit_codes(
      "0 reproduced, 1 did not reproduce (with --impl: 0 pass, 1 a check failed), 2 usage error, 3 internal error"));
  commands.replay->add_option("bundle", r.bundle, "the bundle (lossverify.bundle/1 JSON)")
      ->required()
      ->check(CLI::ExistingFile);
  commands.replay->add_option("--impl", r.implementation,
                              "run the bundle's inputs with another implementation (e.g. your fix); exit code as run");
  commands.replay->add_option("--backend", r.backend, "cpu or cuda (default: the recorded backend)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  commands.replay->add_option("--report", r.report_path, "write the run's JSON report here (atomically)");
  commands.replay->add_option("--plot", r.plot_path, "draw where the error sits (.svg or .html)");
  commands.replay->add_option("--threads", r.threads, "OpenMP threads for the reference (default: all)")
      ->check(thread_count());
  commands.replay->add_flag("--quiet,-q", r.quiet, "print only the reproduced / did not reproduce lines");

  ShrinkArguments& s = commands.shrink_args;
  commands.shrink = app.add_subcommand(
      "shrink",
      "reduce a failing case (tokens, vocabulary, rank counts, features, inline rows) to a small case that "
      "still fails the same check, and write it as a case file");
  commands.shrink->footer(
      exit_codes("0 the minimized case was written, 2 usage error (or the case does not fail), 3 internal error"));
  commands.shrink->add_option("case", s.case_file, "the failing case file (JSON)")
      ->required()
      ->check(CLI::ExistingFile);
  commands.shrink->add_option("--impl", s.implementation, "the implementation that fails (a catalogued bug)")
      ->required();
  commands.shrink->add_option("--check", s.check, "the check that must keep failing (default: the first failing one)");
  commands.shrink->add_option("--set", s.set, "override a case field first, e.g. --set layout.cp=2")
      ->allow_extra_args(false);
  commands.shrink->add_option("--tp", s.tp, "tensor-parallel ranks (overrides layout.tp)")->check(CLI::PositiveNumber);
  commands.shrink->add_option("--out,-o", s.out_path, "where to write the minimized case (default: NAME-shrunk.json)");
  commands.shrink->add_option("--max-trials", s.max_trials, "runs to try at most (default 400)")
      ->check(CLI::PositiveNumber);
  commands.shrink->add_option("--max-seconds", s.max_seconds, "time budget in seconds (default 60)")
      ->check(CLI::PositiveNumber);
  commands.shrink->add_flag("--pin-rows", s.pin_rows,
                            "pin the worst element's row inline, so the case needs no generator for it");
  commands.shrink->add_option("--threads", s.threads, "OpenMP threads per trial (default: all)")->check(thread_count());
  commands.shrink->add_flag("--quiet,-q", s.quiet, "print only the output path");
}

std::optional<int> run_repro_command(const ReproCommands& commands) {
  if (commands.replay != nullptr && commands.replay->parsed()) return command_replay(commands.replay_args);
  if (commands.shrink != nullptr && commands.shrink->parsed()) return command_shrink(commands.shrink_args);
  return std::nullopt;
}

}  // namespace lossverify::cli
