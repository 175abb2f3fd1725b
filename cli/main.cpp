// lossverify command line: a thin layer over the library (case -> ranks -> checks -> report). Each command
// lives in a file of its own (run, gate, bench, list, check-dump, export-inputs, replay and shrink); this one
// registers them, parses, and turns errors into exit codes.
#include <malloc.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench.hpp"
#include "check_dump.hpp"
#include "export_inputs.hpp"
#include "gate.hpp"
#include "list.hpp"
#include "lossverify/comm/nccl_communicator.hpp"
#include "lossverify/core/build_info.hpp"
#include "lossverify/core/descendants.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/impl/cuda/cuda_backend.hpp"
#include "options.hpp"
#include "repro.hpp"
#include "run.hpp"

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

// Levenshtein distance, for suggesting the command a typo meant.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t substitution = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

// `lossverify lst`: CLI11 would say only "A subcommand is required"; name the word and the nearest command.
std::optional<int> refuse_unknown_command(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return std::nullopt;
  const std::string word = argv[1];
  std::string nearest;
  std::size_t best = std::string::npos;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (sub->get_name() == word) return std::nullopt;
    const std::size_t d = edit_distance(word, sub->get_name());
    if (d < best) best = d, nearest = sub->get_name();
  }
  std::cerr << "lossverify: error: unknown command \"" << printable(word) << "\""
            << (best <= 2 ? "; did you mean \"" + nearest + "\"?" : "") << " (see lossverify --help)\n";
  return static_cast<int>(ExitCode::usage_error);
}

// Freed memory stays with the process for reuse: glibc otherwise trims the heaps of the rank threads' arenas and
// unmaps blocks it sized its mmap threshold to, and the next run faults every page in again. On a 2-core virtual
// machine, where a fresh page costs several microseconds, the gate took 1.9 million page faults and 77 s; with
// these settings 0.38 million and 54-58 s, its peak memory the same (1.44 GB). Blocks over 32 MB (the largest
// threshold glibc takes) are still mapped and unmapped on their own.
void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

}  // namespace

int main(int argc, char** argv) {
  keep_freed_memory();
  CLI::App app{"lossverify: checks sharded LLM training losses against a dense float64 reference"};
  app.set_version_flag("--version", version_text());
  app.require_subcommand(1);
  app.footer(
      "exit codes: 0 all checks pass, 1 a check failed, 2 usage or case error, 3 internal/backend error, 4 timeout");

  lossverify::cli::RunCommand run;
  lossverify::cli::register_run(app, run);

  lossverify::cli::GateCommand gate;
  lossverify::cli::register_gate(app, gate);
  lossverify::cli::BenchCommand bench;
  lossverify::cli::register_bench(app, bench);
  lossverify::cli::ListCommand list;
  lossverify::cli::register_list(app, list);
  lossverify::cli::CheckDumpCommand check_dump;
  lossverify::cli::register_check_dump(app, check_dump);
  lossverify::cli::ExportInputsCommand export_inputs;
  lossverify::cli::register_export_inputs(app, export_inputs);
  lossverify::cli::ReproCommands repro;
  lossverify::cli::register_repro_commands(app, repro);
  lossverify::cli::remember_command_line(argc, argv);

  if (const auto code = refuse_unknown_command(app, argc, argv)) return *code;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    // CLI11 returns 0 for --help/--version; every other parse problem is a usage error (exit 2).
    return code == 0 ? 0 : static_cast<int>(ExitCode::usage_error);
  }

  bool use_mpi = false;
  if (run.selected()) {
    if (const auto code = lossverify::cli::prepare_run(run, use_mpi)) return *code;
  }
  // Whatever a plugin starts, in a session of its own too, ends with the command (core/descendants.hpp).
  adopt_orphaned_descendants();
  struct EndDescendants {
    ~EndDescendants() { end_descendants(); }
  } end_children;
  if (use_mpi) return lossverify::cli::run_run_mpi(run.args, &argc, &argv);
  // NCCL endpoints kept between the runs of this command go when it returns (not on a timeout's _Exit).
  struct ReleaseNccl {
    ~ReleaseNccl() { cuda::release_nccl_endpoints(); }
  } release_nccl;
  try {
    if (run.selected()) return lossverify::cli::run_run(run.args);
    if (list.selected()) return lossverify::cli::run_list(list.json);
    if (gate.selected()) return lossverify::cli::run_gate(gate.args);
    if (bench.selected()) return lossverify::cli::run_bench(bench.args);
    if (check_dump.selected()) return lossverify::cli::run_check_dump(check_dump.args);
    if (export_inputs.selected()) return lossverify::cli::run_export_inputs(export_inputs.args);
    if (const auto code = lossverify::cli::run_repro_command(repro)) return *code;
  } catch (const Error& e) {  // a TimeoutError too, or an error a rank carries with its code
    std::cerr << "lossverify: "
              << (e.code() == ExitCode::usage_error ? "error: "
                  : e.code() == ExitCode::timeout   ? "timeout: "
                                                    : "internal error: ")
              << printable_message(e.what()) << "\n";
    if (e.code() == ExitCode::timeout) {  // hung rank threads cannot be joined
      end_descendants();
      std::cerr.flush();
      std::cout.flush();
      std::_Exit(static_cast<int>(ExitCode::timeout));
    }
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::cerr << "lossverify: internal error: " << printable_message(e.what()) << "\n";
    return static_cast<int>(ExitCode::internal_error);
  }
  return 0;
}
