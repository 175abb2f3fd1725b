#include "run.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/output_path.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/report/junit.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/launcher.hpp"
#include "lossverify/runner/run_case.hpp"
#include "options.hpp"
#include "repro.hpp"
#ifdef LOSSVERIFY_HAVE_MPI
#include "lossverify/comm/mpi_world.hpp"
#include "lossverify/comm/nccl_communicator.hpp"
#endif

namespace lossverify::cli {

namespace {

// --set overrides, then --tp/--cp/--dp/--ga as layout overrides.
std::vector<std::string> case_overrides(const RunArguments& args) {
  std::vector<std::string> overrides = args.set;
  const std::pair<const char*, int> layout[] = {{"tp", args.tp}, {"cp", args.cp}, {"dp", args.dp}, {"ga", args.ga}};
  for (const auto& [key, value] : layout) {
    if (value > 0) overrides.push_back("layout." + std::string(key) + "=" + std::to_string(value));
  }
  return overrides;
}

lossverify::cli::ArtifactContext artifact_context(const RunArguments& args, const std::string& launcher,
                                                  int processes) {
  lossverify::cli::ArtifactContext context;
  context.set_overrides = case_overrides(args);
  context.report_path = args.report_path;
  context.launcher = launcher;
  context.processes = processes;
  context.device = args.backend;
  context.gpus = args.backend == "cuda" ? args.gpus : 0;
  context.quiet = args.quiet;
  context.inputs = args.case_files;
  context.outputs = {args.report_path, args.junit_path, args.artifacts.plot_path};
  return context;
}

RunOptions::Reference reference_of(const std::string& name) {
  return name == "gpu"   ? RunOptions::Reference::gpu
         : name == "cpu" ? RunOptions::Reference::cpu
                         : RunOptions::Reference::automatic;
}

RunOptions::Collectives collectives_of(const std::string& name) {
  return name == "nccl"   ? RunOptions::Collectives::nccl
         : name == "host" ? RunOptions::Collectives::host
                          : RunOptions::Collectives::automatic;
}

void print_sweep_line(std::ostream& out, const RunResult& r) {
  double worst = 0.0;
  std::string failing;
  for (const auto& c : r.checks) {
    if (c.verdict != Verdict::not_applicable) worst = std::max(worst, c.margin);
    if (c.verdict == Verdict::fail) append_to_list(failing, c.name);
  }
  out << "  " << std::left << std::setw(22) << layout_name(r.the_case.layout) << std::setw(6)
      << (r.verdict == Verdict::fail ? "FAIL" : "pass") << " worst margin " << std::setprecision(3) << worst
      << (failing.empty() ? "" : "  failing: " + failing) << std::defaultfloat << "\n";
}

}  // namespace

namespace {

// Every case of the command on the launcher's ranks: thread ranks, or this process as one MPI rank. Every
// case is loaded and validated before anything runs: a bad file means no report at all. Only the
// launcher's reporting process prints and writes files.
int run_cases(const RunArguments& args, Launcher& launcher) {
  std::vector<std::string> overrides = case_overrides(args);
  if (args.timeout > 0.0) overrides.push_back("timeout_seconds=" + std::to_string(args.timeout));
  std::vector<Case> cases;
  for (const auto& file : args.case_files) cases.push_back(load_case_file(file, overrides));
  if (find_implementation(args.implementation) == nullptr) {
    throw CaseError("--impl " + args.implementation + ": unknown implementation (see `lossverify list`)");
  }
  const lossverify::cli::ArtifactContext artifacts = artifact_context(args, launcher.name(), launcher.processes());
  lossverify::cli::check_artifact_options(args.artifacts, artifacts);
  check_output_path("--report", args.report_path, args.case_files);
  check_output_path("--junit", args.junit_path, args.case_files);
  check_distinct_outputs(
      {{"--report", args.report_path}, {"--junit", args.junit_path}, {"--plot", args.artifacts.plot_path}});
  std::vector<RunResult> results;  // kept for bundles and plots only
  const bool keep_results = lossverify::cli::artifacts_requested(args.artifacts);
  RunOptions options;
  options.implementation = args.implementation;
  options.threads = args.threads;
  if (!args.fault.empty()) options.fault = parse_fault(args.fault);
  options.device = args.backend == "cuda" ? RunOptions::Device::cuda : RunOptions::Device::cpu;
  options.gpus = launcher.gpus(args.gpus);
  options.collectives = collectives_of(args.collectives);
  options.reference = reference_of(args.reference);
  options.control = !args.no_control;

  std::vector<nlohmann::json> runs;
  nlohmann::json sweeps = nlohmann::json::array();
  bool any_failed = false;
  if (args.sweep_requested) {
    const std::optional<SweepSpec> spec =
        args.sweep.empty() ? std::nullopt : std::optional<SweepSpec>(parse_sweep_arguments(args.sweep));
    std::vector<std::vector<LayoutSpec>> layouts_of_case;
    for (const Case& c : cases) {  // every layout of every case is checked before the first runs
      Case swept = c;
      if (spec) swept.sweep = *spec;
      if (!spec && swept.sweep.empty()) {
        throw CaseError(printable(c.source) +
                        ": --sweep without layouts uses the case's \"sweep\", and it has none "
                        "(give them: --sweep tp=1,2 cp=1,2)");
      }
      layouts_of_case.push_back(sweep_layouts(swept));
      check_sweep(c, layouts_of_case.back(), options);
    }
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      const std::vector<LayoutSpec>& layouts = layouts_of_case[k];
      SweepProgress progress;
      if (!args.quiet && layouts.size() > 4) {
        progress = [&c](std::size_t done, std::size_t total, const RunResult& r) {
          std::cerr << "lossverify: sweep of " << printable(c.name) << ": " << done << "/" << total << " layouts done ("
                    << layout_name(r.the_case.layout) << ")\n";
        };
      }
      const SweepResult result = run_sweep(c, layouts, options, progress);
      if (!args.quiet) {
        std::cout << "case " << printable(c.name) << ": sweep of " << layouts.size() << " layouts, impl "
                  << args.implementation << "\n";
        for (const RunResult& r : result.runs) print_sweep_line(std::cout, r);
        std::cout << "  invariance: "
                  << (result.invariance.verdict == Verdict::fail ? "FAIL"
                                                                 : std::string(to_string(result.invariance.verdict)))
                  << ", margin " << result.invariance.margin << " (" << result.invariance.summary << ")\n";
        std::cout << "  verdict: " << (result.verdict == Verdict::fail ? "FAIL" : "pass") << "\n";
      }
      any_failed = any_failed || result.verdict == Verdict::fail;
      nlohmann::json names = nlohmann::json::array();
      for (const auto& l : layouts) names.push_back(layout_name(l));
      for (const RunResult& r : result.runs) runs.push_back(run_to_json(r));
      if (keep_results) results.insert(results.end(), result.runs.begin(), result.runs.end());
      sweeps.push_back({{"case", c.name},
                        {"layouts", names},
                        {"verdict", std::string(to_string(result.verdict))},
                        {"invariance", check_to_json(result.invariance, c)}});
    }
  } else {
    for (const Case& c : cases) check_run(c, options, launcher);
    for (const Case& c : cases) {
      const RunResult result = run_case(c, options, launcher);
      any_failed = any_failed || result.verdict == Verdict::fail;
      if (!launcher.reports()) continue;
      if (!args.quiet) print_summary(std::cout, result);
      runs.push_back(run_to_json(result));
      if (keep_results) results.push_back(result);
    }
  }
  const ExitCode code = any_failed ? ExitCode::check_failed : ExitCode::pass;
  if (!launcher.reports()) return static_cast<int>(code);
  launcher.report_step([&] { lossverify::cli::write_artifacts(args.artifacts, results, artifacts); });
  if (!args.report_path.empty() || !args.junit_path.empty()) {
    nlohmann::json report =
        make_report(args.sweep_requested ? "sweep" : "run", runs, code, launcher.environment(), launcher.processes());
    if (args.sweep_requested) {
      report["sweeps"] = encode_nonfinite(sweeps);
      if (any_failed) report["verdict"] = "fail";
    }
    if (!args.report_path.empty()) {
      launcher.report_step([&] { write_file_atomically(args.report_path, json_text(report, 2) + "\n"); });
      if (!args.quiet) std::cout << "report written to " << printable(args.report_path) << "\n";
    }
    if (!args.junit_path.empty()) {
      launcher.report_step([&] { write_file_atomically(args.junit_path, report_junit(report)); });
      if (!args.quiet) std::cout << "JUnit written to " << printable(args.junit_path) << "\n";
    }
  }
  if (cases.size() > 1 && !args.quiet && !args.sweep_requested) {
    int failed = 0;
    for (const auto& r : runs) failed += r.at("verdict") == "fail";
    std::cout << cases.size() - static_cast<std::size_t>(failed) << " passed, " << failed << " failed\n";
  }
  return static_cast<int>(code);
}

}  // namespace

int run_run(const RunArguments& args) { return run_cases(args, *thread_launcher()); }

#ifdef LOSSVERIFY_HAVE_MPI
// One process per rank, through the same path as thread ranks. Errors that every rank meets before the run
// (a bad case, a process count that does not match) end every process with exit code 2, each naming its
// rank; an error inside the run ends the whole job (MPI_Abort) naming the rank.
int command_run_mpi(const RunArguments& args, mpi::Session& session) {
  const std::unique_ptr<Launcher> launcher = mpi_launcher(session);
  try {
    if (args.sweep_requested)
      throw CaseError("--sweep runs several layouts: use the thread launcher (--launcher threads)");
    return run_cases(args, *launcher);
  } catch (const Error& e) {
    // One write per line: every rank prints this at once, and mpiexec merges their streams.
    const std::string line = "lossverify: rank " + std::to_string(session.rank()) + " of " +
                             std::to_string(session.size()) + ": error: " + printable_message(e.what()) + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
    return static_cast<int>(e.code());
  }
}
#endif

// Words after `--sweep` that are not KEY=COUNTS are case files that CLI11 took for sweep values
// (`run --sweep tp=1,2 cp=1,2 CASE.json`).
void sweep_arguments_to_cases(RunArguments& args) {
  std::vector<std::string> layouts;
  for (std::string& word : args.sweep) {
    if (word.empty()) continue;  // CLI11's value for a bare --sweep
    (word.find('=') == std::string::npos ? args.case_files : layouts).push_back(std::move(word));
  }
  args.sweep = std::move(layouts);
}

// The number of processes mpiexec started, from its environment (1 when not started by mpiexec).
int mpiexec_processes() {
  for (const char* name : {"PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"}) {
    if (const char* value = std::getenv(name)) return std::max(1, std::atoi(value));
  }
  return 1;
}

// threads or mpi for --launcher; nullopt (after printing why) for a launcher that cannot work here.
std::optional<std::string> choose_launcher(const std::string& requested) {
  const int processes = mpiexec_processes();
  if (requested == "threads" && processes > 1) {
    std::cerr << "lossverify: error: --launcher threads under mpiexec with " << processes
              << " processes would run the whole job in every process: drop --launcher threads (one rank per "
                 "process), or start one process\n";
    return std::nullopt;
  }
#ifdef LOSSVERIFY_HAVE_MPI
  if (requested == "mpi" && !mpi::launched_by_mpiexec()) {
    std::cerr << "lossverify: error: --launcher mpi: this process was not started by mpiexec; start one process per "
                 "rank: mpiexec -n RANKS lossverify run ...\n";
    return std::nullopt;
  }
  if (requested == "auto") return mpi::launched_by_mpiexec() ? "mpi" : "threads";
#else
  if (requested == "mpi") {
    std::cerr << "lossverify: error: --launcher mpi: this build has no MPI (MPICH was not found at configure time)\n";
    return std::nullopt;
  }
  if (requested == "auto") return "threads";
#endif
  return requested;
}
void register_run(CLI::App& app, RunCommand& command) {
  command.app = app.add_subcommand(
      "run", "run case files on thread ranks or MPI processes (CPU or CUDA) and check them against the reference");
  command.app->footer(lossverify::cli::exit_codes(
      "0 all checks pass, 1 a check failed, 2 usage or case error, 3 internal/backend error, 4 timeout"));
  // Not required here: a case file given after `--sweep tp=1,2 cp=1,2` lands in the sweep's list and is
  // moved back (sweep_arguments_to_cases), so the check that one was given comes after parsing.
  command.app->add_option("cases", command.args.case_files, "case file(s) (JSON)")->check(CLI::ExistingFile);
  command.app->add_option("--impl", command.args.implementation,
                          "implementation: correct or a catalogued bug (see list)");
  command.app->add_option("--tp", command.args.tp, "tensor-parallel ranks (overrides layout.tp)")
      ->check(CLI::PositiveNumber);
  command.app->add_option("--cp", command.args.cp, "context-parallel ranks (overrides layout.cp)")
      ->check(CLI::PositiveNumber);
  command.app->add_option("--dp", command.args.dp, "data-parallel ranks (overrides layout.dp)")
      ->check(CLI::PositiveNumber);
  command.app->add_option("--ga", command.args.ga, "gradient-accumulation micro-batches (overrides layout.ga)")
      ->check(CLI::PositiveNumber);
  command.app->add_option("--set", command.args.set, "override a case field, e.g. --set loss.label_smoothing=0.1")
      ->allow_extra_args(false);
  command.app->add_option("--report", command.args.report_path, "write the JSON report here (atomically)");
  lossverify::cli::add_junit_option(*command.app, command.args.junit_path);
  command.app->add_flag("--quiet,-q", command.args.quiet, "print nothing; rely on the exit code and the report");
  lossverify::cli::add_control_flag(*command.app, command.args.no_control);
  command.app->add_option("--threads", command.args.threads, "OpenMP threads for the reference (default: all)")
      ->check(lossverify::cli::thread_count());
  command.app->add_option("--timeout", command.args.timeout, "deadlock guard in seconds (overrides timeout_seconds)")
      ->check(lossverify::cli::seconds());
  command.app
      ->add_option("--inject-fault", command.args.fault,
                   "test aid: [late-]throw@RANK, [late-]hang@RANK or [late-]exit@RANK (late: after the groups, NCCL "
                   "included, are set up)")
      ->group("");
  command.app
      ->add_option("--launcher", command.args.launcher,
                   "auto (mpi when started by mpiexec, else threads), threads, or mpi: one rank per process")
      ->check(CLI::IsMember({"auto", "threads", "mpi"}));
  command.app
      ->add_option("--backend", command.args.backend,
                   "where the kernels run: cpu, or cuda (GPU 0 with a stream per rank; see --gpus)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  command.app
      ->add_option(
          "--gpus", command.args.gpus,
          "cuda: GPUs to spread the ranks over (rank % gpus); as many as ranks: one GPU per rank, NCCL between them")
      ->check(CLI::PositiveNumber);
  command.app
      ->add_option("--collectives", command.args.collectives,
                   "cuda: auto (NCCL when every rank has its own GPU), host (shared memory or MPI), or nccl")
      ->check(CLI::IsMember({"auto", "host", "nccl"}));
  command.app
      ->add_option("--reference", command.args.reference,
                   "where the float64 reference runs: auto (the GPU for --backend cuda, except sweeps), cpu, or gpu")
      ->check(CLI::IsMember({"auto", "cpu", "gpu"}));
  command.app
      ->add_option("--sweep", command.args.sweep,
                   "run at every layout of the product, e.g. --sweep tp=1,2,4 cp=1,2 dp=1,2 (ga, and sp for a router), "
                   "and check invariance; "
                   "alone: the case's own \"sweep\"")
      ->expected(0, 5);
  add_artifact_options(*command.app, command.args.artifacts);
}

std::optional<int> prepare_run(RunCommand& command, bool& use_mpi) {
  RunArguments& args = command.args;
  args.sweep_requested = command.app->count("--sweep") > 0;
  sweep_arguments_to_cases(args);
  if (args.case_files.empty()) {
    std::cerr << "lossverify: error: run needs a case file, e.g. lossverify run cases/smoothing-pytorch.json\n";
    return static_cast<int>(ExitCode::usage_error);
  }
  const auto launcher = choose_launcher(args.launcher);
  if (!launcher) return static_cast<int>(ExitCode::usage_error);
  use_mpi = *launcher == "mpi";
  return std::nullopt;
}

int run_run_mpi(const RunArguments& args, int* argc, char*** argv) {
#ifdef LOSSVERIFY_HAVE_MPI
  mpi::Session session(argc, argv, args.timeout > 0.0 ? args.timeout : 120.0);
  const int code = command_run_mpi(args, session);
  cuda::release_nccl_endpoints();  // before MPI_Finalize
  return code;
#else
  (void)args;
  (void)argc;
  (void)argv;
  throw InternalError("--launcher mpi: this build has no MPI");
#endif
}

}  // namespace lossverify::cli
