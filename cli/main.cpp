// lossverify command line: a thin layer over the library (case -> ranks -> checks -> report).
#include <algorithm>
#include <cstdio>
#include <chrono>
#include <iomanip>
#include <thread>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/checks/tolerances.hpp"
#include "lossverify/core/build_info.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/report/report.hpp"
#include "lossverify/runner/gate.hpp"
#include "lossverify/runner/run_case.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/layout/vocab_range.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "check_dump.hpp"
#include "export_inputs.hpp"
#include "repro.hpp"
#ifdef LOSSVERIFY_HAVE_MPI
#include "lossverify/comm/mpi_world.hpp"
#endif

namespace {

using namespace lossverify;

std::string version_text() {
  std::string text = std::string("lossverify ") + build_info::version + " (git " + build_info::git_revision + ")\n";
  text += "backends: cpu-threads";
#ifdef LOSSVERIFY_HAVE_MPI
  text += ", mpi (MPICH)";
#endif
  text += std::string("\nMPI (MPICH) at build time: ") + (build_info::have_mpi ? "found" : "not found");
  text += std::string("\nCUDA toolkit at build time: ") + (build_info::have_cuda ? "found" : "not found");
  if (cuda::built_with_cuda()) text += ", CUDA GPUs visible now: " + std::to_string(cuda::visible_devices());
  text += std::string("\nNCCL at build time: ") + (build_info::have_nccl ? "found" : "not found");
  return text;
}

struct RunArguments {
  std::vector<std::string> case_files;
  std::string implementation = "correct";
  int tp = 0;
  std::vector<std::string> set;
  std::string report_path;
  bool quiet = false;
  int threads = 0;
  double timeout = 0.0;
  std::string fault;
  std::vector<std::string> sweep;
  std::string launcher = "auto";
  std::string backend = "cpu";
  int gpus = 1;
  std::string collectives = "auto";
  std::string reference = "auto";
  lossverify::cli::ArtifactOptions artifacts;  // --save-inputs, --save-inputs-dir, --plot
};

lossverify::cli::ArtifactContext artifact_context(const RunArguments& args, const std::string& launcher, int processes) {
  lossverify::cli::ArtifactContext context;
  context.set_overrides = args.set;
  if (args.tp > 0) context.set_overrides.push_back("layout.tp=" + std::to_string(args.tp));
  context.report_path = args.report_path;
  context.launcher = launcher;
  context.processes = processes;
  context.device = args.backend;
  context.gpus = args.backend == "cuda" ? args.gpus : 0;
  context.quiet = args.quiet;
  return context;
}

RunOptions::Reference reference_of(const std::string& name) {
  return name == "gpu" ? RunOptions::Reference::gpu
         : name == "cpu" ? RunOptions::Reference::cpu
                         : RunOptions::Reference::automatic;
}

RunOptions::Collectives collectives_of(const std::string& name) {
  return name == "nccl" ? RunOptions::Collectives::nccl
         : name == "host" ? RunOptions::Collectives::host
                          : RunOptions::Collectives::automatic;
}

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
};

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

int command_run(const RunArguments& args) {
  // Every case is loaded and validated before anything runs: a bad file means no report at all.
  std::vector<std::string> overrides = args.set;
  if (args.tp > 0) overrides.push_back("layout.tp=" + std::to_string(args.tp));
  if (args.timeout > 0.0) overrides.push_back("timeout_seconds=" + std::to_string(args.timeout));
  std::vector<Case> cases;
  for (const auto& file : args.case_files) cases.push_back(load_case_file(file, overrides));
  if (find_implementation(args.implementation) == nullptr) {
    throw CaseError("--impl " + args.implementation + ": unknown implementation (see `lossverify list`)");
  }
  const lossverify::cli::ArtifactContext artifacts = artifact_context(args, "threads", 1);
  lossverify::cli::check_artifact_options(args.artifacts, artifacts);
  std::vector<RunResult> results;  // kept for bundles and plots only
  const bool keep_results = lossverify::cli::artifacts_requested(args.artifacts);
  RunOptions options;
  options.implementation = args.implementation;
  options.threads = args.threads;
  if (!args.fault.empty()) options.fault = parse_fault(args.fault);
  options.device = args.backend == "cuda" ? RunOptions::Device::cuda : RunOptions::Device::cpu;
  options.gpus = args.gpus;
  options.collectives = collectives_of(args.collectives);
  options.reference = reference_of(args.reference);

  std::vector<nlohmann::json> runs;
  nlohmann::json sweeps = nlohmann::json::array();
  bool any_failed = false;
  if (!args.sweep.empty()) {
    const SweepSpec spec = parse_sweep_arguments(args.sweep);
    for (const Case& c : cases) {
      Case swept = c;
      swept.sweep = spec;
      const std::vector<LayoutSpec> layouts = sweep_layouts(swept);
      const SweepResult result = run_sweep(c, layouts, options);
      if (!args.quiet) {
        std::cout << "case " << c.name << ": sweep of " << layouts.size() << " layouts, impl " << args.implementation
                  << "\n";
        for (const RunResult& r : result.runs) print_sweep_line(std::cout, r);
        std::cout << "  invariance: " << (result.invariance.verdict == Verdict::fail ? "FAIL" : std::string(to_string(result.invariance.verdict)))
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
    for (const Case& c : cases) {
      const RunResult result = run_case(c, options);
      if (!args.quiet) print_summary(std::cout, result);
      any_failed = any_failed || result.verdict == Verdict::fail;
      runs.push_back(run_to_json(result));
      if (keep_results) results.push_back(result);
    }
  }
  lossverify::cli::write_artifacts(args.artifacts, results, artifacts);
  const ExitCode code = any_failed ? ExitCode::check_failed : ExitCode::pass;
  if (!args.report_path.empty()) {
    nlohmann::json report = make_report(args.sweep.empty() ? "run" : "sweep", runs, code);
    if (!args.sweep.empty()) {
      report["sweeps"] = encode_nonfinite(sweeps);
      if (any_failed) report["verdict"] = "fail";
    }
    write_file_atomically(args.report_path, report.dump(2) + "\n");
    if (!args.quiet) std::cout << "report written to " << args.report_path << "\n";
  }
  if (cases.size() > 1 && !args.quiet && args.sweep.empty()) {
    int failed = 0;
    for (const auto& r : runs) failed += r.at("verdict") == "fail";
    std::cout << cases.size() - static_cast<std::size_t>(failed) << " passed, " << failed << " failed\n";
  }
  return static_cast<int>(code);
}

#ifdef LOSSVERIFY_HAVE_MPI
// One process per rank: every process runs its rank of every case; rank 0 prints and writes the report.
// Errors that every rank meets before the run (a bad case, a process count that does not match) end
// every process with exit code 2; an error inside the run ends the whole job (MPI_Abort) naming the rank.
int command_run_mpi(const RunArguments& args, mpi::Session& session) {
  const int rank = session.rank();
  const bool leader = rank == 0;
  std::vector<Case> cases;
  const lossverify::cli::ArtifactContext artifacts = artifact_context(args, "mpi", session.size());
  std::vector<RunResult> results;  // rank 0's, kept for bundles and plots only
  try {
    lossverify::cli::check_artifact_options(args.artifacts, artifacts);
    if (!args.sweep.empty()) throw CaseError("--sweep runs several layouts: use the thread launcher (--launcher threads)");
    std::vector<std::string> overrides = args.set;
    if (args.tp > 0) overrides.push_back("layout.tp=" + std::to_string(args.tp));
    if (args.timeout > 0.0) overrides.push_back("timeout_seconds=" + std::to_string(args.timeout));
    for (const auto& file : args.case_files) cases.push_back(load_case_file(file, overrides));
    if (find_implementation(args.implementation) == nullptr) {
      throw CaseError("--impl " + args.implementation + ": unknown implementation (see `lossverify list`)");
    }
    for (const Case& c : cases) {
      require_supported(*find_implementation(args.implementation), c);
      if (c.layout.world_size() != session.size()) {
        throw CaseError(c.source + ": layout tp*cp*dp = " + std::to_string(c.layout.tp) + "*" +
                        std::to_string(c.layout.cp) + "*" + std::to_string(c.layout.dp) + " = " +
                        std::to_string(c.layout.world_size()) + " ranks, but mpiexec started " +
                        std::to_string(session.size()) + " processes");
      }
    }
  } catch (const Error& e) {
    // One write per line: every rank prints this at once, and mpiexec merges their streams.
    const std::string line = "lossverify: rank " + std::to_string(rank) + " of " + std::to_string(session.size()) +
                             ": error: " + e.what() + "\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
    return static_cast<int>(e.code());
  }
  RunOptions options;
  options.implementation = args.implementation;
  if (!args.fault.empty()) options.fault = parse_fault(args.fault);
  options.device = args.backend == "cuda" ? RunOptions::Device::cuda : RunOptions::Device::cpu;
  options.gpus = std::max(1, cuda::visible_devices());  // one process per GPU: rank % GPUs
  options.collectives = collectives_of(args.collectives);
  options.reference = reference_of(args.reference);
  const char* local = std::getenv("MPI_LOCALNRANKS");
  const int local_ranks = local != nullptr ? std::max(1, std::atoi(local)) : 1;
  const int hardware = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = args.threads > 0 ? args.threads : std::max(1, hardware / local_ranks);

  std::vector<nlohmann::json> runs;
  bool any_failed = false;
  for (const Case& c : cases) {
    session.set_timeout(c.timeout_seconds);
    const auto start = std::chrono::steady_clock::now();
    RankJob job;
    try {
      const InputSource inputs(c);
      job = run_rank(c, inputs, *find_implementation(args.implementation), options, session.world(), threads);
    } catch (const Error& e) {
      session.abort(static_cast<int>(e.code()), e.what());
    } catch (const std::exception& e) {
      session.abort(static_cast<int>(ExitCode::internal_error), e.what());
    }
    RunResult result = assemble_result(c, *find_implementation(args.implementation), std::move(job));
    result.timings.total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    any_failed = any_failed || result.verdict == Verdict::fail;
    // Every rank's high-water mark: with distributed verification it falls as 1/R with the shard.
    const std::int64_t rss = peak_resident_bytes();
    std::vector<std::int64_t> rss_per_rank(static_cast<std::size_t>(session.size()));
    session.world().all_gather(&rss, rss_per_rank.data(), sizeof(rss));
    if (leader) {
      if (!args.quiet) print_summary(std::cout, result);
      runs.push_back(run_to_json(result));
      runs.back()["resources"]["peak_rss_bytes_per_rank"] = rss_per_rank;
      if (lossverify::cli::artifacts_requested(args.artifacts)) results.push_back(result);
    }
  }
  if (leader) {
    try {
      lossverify::cli::write_artifacts(args.artifacts, results, artifacts);
    } catch (const Error& e) {
      session.abort(static_cast<int>(e.code()), e.what());
    }
  }
  const ExitCode code = any_failed ? ExitCode::check_failed : ExitCode::pass;
  if (leader && !args.report_path.empty()) {
    try {
      write_file_atomically(args.report_path, make_report("run", runs, code, "mpi", session.size()).dump(2) + "\n");
    } catch (const Error& e) {
      session.abort(static_cast<int>(e.code()), e.what());
    }
    if (!args.quiet) std::cout << "report written to " << args.report_path << "\n";
  }
  return static_cast<int>(code);
}
#endif

int command_gate(const GateArguments& args) {
  GateOptions options;
  options.cases_dir = args.cases_dir;
  options.golden_dir = args.golden_dir;
  options.update_golden = args.update_golden;
  options.threads = args.threads;
  options.quiet = args.quiet;
  options.implementations = args.implementations;
  options.expect = args.expect;
  if (!args.expect.empty() && args.implementations.empty()) throw CaseError("--expect needs --impl");
  const GateResult result = run_gate(options);
  if (!args.quiet) print_gate_matrix(std::cout, result);
  if (!args.report_path.empty()) write_file_atomically(args.report_path, gate_report(result).dump(2) + "\n");
  if (!args.junit_path.empty()) write_file_atomically(args.junit_path, gate_junit(result));
  return static_cast<int>(result.passed() ? ExitCode::pass : ExitCode::check_failed);
}

struct BenchArguments {
  std::string backend = "cuda";
  std::string shape = "16384,128256";
  std::string dtype = "bf16";
  int tp = 1;
  int repeats = 20;
  double label_smoothing = 0.1;
  std::string report_path;
  std::string torch_script = "bench/torch_ce_bench.py";
};

// Runs the PyTorch comparison script, when python3 is there; its JSON line, or why not.
nlohmann::json torch_figures(const BenchArguments& a, std::int64_t tokens, std::int64_t vocab) {
  const std::string command = "python3 " + a.torch_script + " " + std::to_string(tokens) + " " + std::to_string(vocab) +
                              " " + a.dtype + " " + std::to_string(a.label_smoothing) + " " + std::to_string(a.repeats) +
                              " 2>/dev/null";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {{"available", false}, {"reason", "cannot start python3"}};
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  pclose(pipe);
  try {
    return nlohmann::json::parse(output.substr(0, output.find('\n')));
  } catch (const std::exception&) {
    return {{"available", false}, {"reason", "no JSON from " + a.torch_script}};
  }
}

int command_bench(const BenchArguments& a) {
  const auto comma = a.shape.find(',');
  if (comma == std::string::npos) throw CaseError("--shape " + a.shape + ": expected N,V");
  const std::int64_t tokens = std::stoll(a.shape.substr(0, comma));
  const std::int64_t vocab = std::stoll(a.shape.substr(comma + 1));
  const auto dtype = parse_dtype(a.dtype);
  if (!dtype) throw CaseError("--dtype " + a.dtype + ": expected fp32|bf16|fp16");
  if (tokens < 1 || vocab < 2 || a.tp < 1 || a.tp > vocab) throw CaseError("--shape/--tp: need N >= 1, V >= 2, 1 <= tp <= V");
  if (a.backend != "cuda") {
    throw CaseError("--backend " + a.backend + ": bench measures the CUDA kernels; CPU figures are in bench/run_benchmarks.sh");
  }
  cuda::BenchOptions o;
  o.tokens = tokens;
  o.vocab = vocab_range(vocab, a.tp, 0).size();  // the first (largest) shard of a TP rank
  o.dtype = *dtype;
  o.tp = a.tp;
  o.repeats = a.repeats;
  o.label_smoothing = a.label_smoothing;
  nlohmann::json r = cuda::bench(o);
  r["global_vocab"] = vocab;
  if (a.tp == 1) r["torch"] = torch_figures(a, tokens, vocab);
  std::cout << std::fixed << std::setprecision(3);
  std::cout << "device " << r["device"].get<std::string>() << ", copy " << r["copy_tb_per_s"].get<double>() << " TB/s\n";
  std::cout << "shape N=" << tokens << " V=" << vocab << " (" << o.vocab << " per rank, tp=" << a.tp << "), " << a.dtype
            << ", smoothing " << a.label_smoothing << ", mean\n";
  std::cout << "floor (" << r["floor_bytes_per_logit"].get<double>() << " B/logit at the copy bandwidth): "
            << r["floor_ms"].get<double>() << " ms\n";
  std::cout << "lossverify " << r["kernel"].get<std::string>() << ": "
            << r["kernel_ms"].get<double>() << " ms = " << std::setprecision(1) << r["percent_of_floor"].get<double>()
            << "% of the floor" << std::setprecision(3) << "; check on sampled rows: "
            << (r["check"]["pass"].get<bool>() ? "pass" : "FAIL") << "\n";
  if (r.contains("torch")) {
    const auto& t = r["torch"];
    if (t.value("available", false)) {
      for (const char* key : {"eager_ms", "compile_ms"}) {
        if (!t.contains(key)) continue;
        const double ms = t[key].get<double>();
        std::cout << "PyTorch " << t["torch"].get<std::string>() << " " << (std::string(key) == "eager_ms" ? "eager" : "torch.compile")
                  << ": " << ms << " ms = " << std::setprecision(1) << 100.0 * r["floor_ms"].get<double>() / ms
                  << "% of the floor; lossverify is " << ms / r["kernel_ms"].get<double>() << "x faster\n"
                  << std::setprecision(3);
      }
    } else {
      std::cout << "PyTorch figures unavailable: " << t.value("reason", std::string("?")) << "\n";
    }
  }
  std::cout << std::defaultfloat;
  if (!a.report_path.empty()) write_file_atomically(a.report_path, encode_nonfinite(r).dump(2) + "\n");
  return r["check"]["pass"].get<bool>() ? 0 : static_cast<int>(ExitCode::check_failed);
}

int command_list(bool as_json) {
  nlohmann::json doc;
  doc["losses"] = nlohmann::json::array(
      {{{"name", "cross_entropy"},
        {"options", "label_smoothing (pytorch|megatron), z_loss_weight, ignore_index, reduction mean|sum|none, "
                    "upstream_weights"}}});
  nlohmann::json impls = nlohmann::json::array();
  for (const auto& i : implementations()) {
    impls.push_back({{"name", i.name}, {"summary", i.summary}, {"source", i.source}, {"signal", i.signal},
                     {"caught_by", i.caught_by}});
  }
  doc["implementations"] = impls;
  nlohmann::json checks = nlohmann::json::array();
  for (const auto& c : check_catalogue()) checks.push_back({{"name", c.name}, {"description", c.description}});
  doc["checks"] = checks;
  if (as_json) {
    std::cout << doc.dump(2) << "\n";
    return 0;
  }
  std::cout << "losses:\n";
  for (const auto& l : doc["losses"]) {
    std::cout << "  " << l["name"].get<std::string>() << "  " << l["options"].get<std::string>() << "\n";
  }
  std::cout << "\nimplementations (--impl):\n";
  for (const auto& i : implementations()) {
    std::cout << "  " << i.name << "\n      " << i.summary << "\n";
    if (i.name != "correct") {
      std::string caught;
      for (const auto& c : i.caught_by) append_to_list(caught, c);
      std::cout << "      source: " << i.source << "\n      signal: " << i.signal << "\n      caught by: " << caught
                << "\n";
    }
  }
  std::cout << "\nchecks:\n";
  for (const auto& c : check_catalogue()) std::cout << "  " << c.name << "  " << c.description << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lossverify: checks sharded LLM training losses against a dense float64 reference"};
  app.set_version_flag("--version", version_text());
  app.require_subcommand(1);
  app.footer(
      "exit codes: 0 all checks pass, 1 a check failed, 2 usage or case error, 3 internal/backend error, 4 timeout");

  RunArguments run_args;
  CLI::App* run = app.add_subcommand("run", "run case files on thread ranks or MPI processes (CPU or CUDA) and check them against the reference");
  run->add_option("cases", run_args.case_files, "case file(s) (JSON)")->required()->check(CLI::ExistingFile);
  run->add_option("--impl", run_args.implementation, "implementation: correct or a catalogued bug (see list)");
  run->add_option("--tp", run_args.tp, "tensor-parallel ranks (overrides layout.tp)")->check(CLI::PositiveNumber);
  run->add_option("--set", run_args.set, "override a case field, e.g. --set loss.label_smoothing=0.1")
      ->allow_extra_args(false);
  run->add_option("--report", run_args.report_path, "write the JSON report here (atomically)");
  run->add_flag("--quiet,-q", run_args.quiet, "print nothing; rely on the exit code and the report");
  run->add_option("--threads", run_args.threads, "OpenMP threads for the reference (default: all)")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--timeout", run_args.timeout, "deadlock guard in seconds (overrides timeout_seconds)")
      ->check(CLI::PositiveNumber);
  run->add_option("--inject-fault", run_args.fault, "test aid: [late-]throw@RANK, [late-]hang@RANK or [late-]exit@RANK (late: after the groups, NCCL included, are set up)")->group("");
  run->add_option("--launcher", run_args.launcher,
                  "auto (mpi when started by mpiexec, else threads), threads, or mpi: one rank per process")
      ->check(CLI::IsMember({"auto", "threads", "mpi"}));
  run->add_option("--backend", run_args.backend, "where the kernels run: cpu, or cuda (GPU 0 with a stream per rank; see --gpus)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  run->add_option("--gpus", run_args.gpus,
                  "cuda: GPUs to spread the ranks over (rank % gpus); as many as ranks: one GPU per rank, NCCL between them")
      ->check(CLI::PositiveNumber);
  run->add_option("--collectives", run_args.collectives,
                  "cuda: auto (NCCL when every rank has its own GPU), host (shared memory or MPI), or nccl")
      ->check(CLI::IsMember({"auto", "host", "nccl"}));
  run->add_option("--reference", run_args.reference,
                  "where the float64 reference runs: auto (the GPU for --backend cuda, except sweeps), cpu, or gpu")
      ->check(CLI::IsMember({"auto", "cpu", "gpu"}));
  run->add_option("--sweep", run_args.sweep,
                  "run at every layout of the product, e.g. --sweep tp=1,2,4 cp=1,2 dp=1,2, and check invariance")
      ->expected(1, 4);
  lossverify::cli::add_artifact_options(*run, run_args.artifacts);

  GateArguments gate_args;
  CLI::App* gate = app.add_subcommand(
      "gate", "CI gate: every shipped case x every implementation vs golden/, matrix, mutation score, JUnit");
  gate->add_option("--cases", gate_args.cases_dir, "directory of case files")->check(CLI::ExistingDirectory);
  gate->add_option("--golden", gate_args.golden_dir, "directory of golden outcomes");
  gate->add_option("--report", gate_args.report_path, "write the JSON gate report here");
  gate->add_option("--junit", gate_args.junit_path, "write JUnit XML here");
  gate->add_flag("--update-golden", gate_args.update_golden, "rewrite golden/ from this run (review the diff)");
  gate->add_option("--threads", gate_args.threads, "OpenMP threads for the reference")->check(CLI::NonNegativeNumber);
  gate->add_flag("--quiet,-q", gate_args.quiet, "print nothing; rely on the exit code and the reports");
  gate->add_option("--impl", gate_args.implementations,
                   "gate these implementations only (repeatable), e.g. a plugin: --impl plugin:./libmy_loss.so")
      ->allow_extra_args(false);
  gate->add_option("--expect", gate_args.expect,
                   "judge them against golden's outcomes of this implementation (default: their own; correct for a plugin)");

  BenchArguments bench_args;
  CLI::App* bench = app.add_subcommand("bench", "kernel speed as % of the memory floor (CUDA), with PyTorch figures");
  bench->add_option("--backend", bench_args.backend, "cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  bench->add_option("--shape", bench_args.shape, "N,V (global vocabulary)");
  bench->add_option("--dtype", bench_args.dtype, "fp32|bf16|fp16");
  bench->add_option("--tp", bench_args.tp, "time one rank's shard of the vocabulary: the two kernels around the all-reduce");
  bench->add_option("--repeats", bench_args.repeats, "timed repetitions (median)")->check(CLI::PositiveNumber);
  bench->add_option("--label-smoothing", bench_args.label_smoothing, "alpha");
  bench->add_option("--report", bench_args.report_path, "write the figures as JSON");
  bench->add_option("--torch-script", bench_args.torch_script, "PyTorch comparison script");

  bool list_json = false;
  CLI::App* list = app.add_subcommand("list", "list losses, implementations (correct and catalogued bugs), checks");
  list->add_flag("--json", list_json, "machine-readable output");

  lossverify::cli::CheckDumpCommand check_dump;
  lossverify::cli::register_check_dump(app, check_dump);
  lossverify::cli::ExportInputsCommand export_inputs;
  lossverify::cli::register_export_inputs(app, export_inputs);
  lossverify::cli::ReproCommands repro;
  lossverify::cli::register_repro_commands(app, repro);
  lossverify::cli::remember_command_line(argc, argv);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    // CLI11 returns 0 for --help/--version; every other parse problem is a usage error (exit 2).
    return code == 0 ? 0 : static_cast<int>(ExitCode::usage_error);
  }

  bool use_mpi = false;
  if (*run) {
    use_mpi = run_args.launcher == "mpi";
#ifdef LOSSVERIFY_HAVE_MPI
    if (run_args.launcher == "auto") use_mpi = mpi::launched_by_mpiexec();
#else
    if (use_mpi) {
      std::cerr << "lossverify: error: --launcher mpi: this build has no MPI (MPICH was not found at configure time)\n";
      return static_cast<int>(ExitCode::usage_error);
    }
#endif
  }
#ifdef LOSSVERIFY_HAVE_MPI
  if (use_mpi) {
    mpi::Session session(&argc, &argv, run_args.timeout > 0.0 ? run_args.timeout : 120.0);
    return command_run_mpi(run_args, session);
  }
#endif
  try {
    if (*run) return command_run(run_args);
    if (*list) return command_list(list_json);
    if (*gate) return command_gate(gate_args);
    if (*bench) return command_bench(bench_args);
    if (check_dump.selected()) return lossverify::cli::run_check_dump(check_dump.args);
    if (export_inputs.selected()) return lossverify::cli::run_export_inputs(export_inputs.args);
    if (const auto code = lossverify::cli::run_repro_command(repro)) return *code;
  } catch (const TimeoutError& e) {
    std::cerr << "lossverify: timeout: " << e.what() << "\n";
    std::cerr.flush();
    std::cout.flush();
    std::_Exit(static_cast<int>(ExitCode::timeout));  // hung rank threads cannot be joined
  } catch (const Error& e) {
    std::cerr << "lossverify: " << (e.code() == ExitCode::usage_error ? "error: " : "internal error: ") << e.what()
              << "\n";
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::cerr << "lossverify: internal error: " << e.what() << "\n";
    return static_cast<int>(ExitCode::internal_error);
  }
  return 0;
}
