#include "export_inputs.hpp"

#include "options.hpp"

#include <iostream>
#include <thread>

#include "lossverify/core/errors.hpp"
#include "lossverify/core/strings.hpp"
#include "lossverify/dump/export_inputs.hpp"
#include "lossverify/kind_api/loss_kind.hpp"

namespace lossverify::cli {

void register_export_inputs(CLI::App& app, ExportInputsCommand& command) {
  ExportInputsArguments& a = command.args;
  command.app =
      app.add_subcommand("export-inputs",
                         "write every rank's exact inputs (logits shard, labels, loss mask, rows, ...) of a case as "
                         "safetensors plus an index, for code that runs outside lossverify");
  CLI::App& sub = *command.app;
  sub.footer(exit_codes("0 written, 2 usage or case error (or --out is not empty), 3 internal error"));
  sub.add_option("case", a.case_file, "case file (JSON)")->required()->check(CLI::ExistingFile);
  sub.add_option("--set", a.set, "override a case field, e.g. --set loss.label_smoothing=0.1")->allow_extra_args(false);
  sub.add_option("--tp", a.tp, "tensor-parallel ranks (overrides layout.tp)")->check(CLI::PositiveNumber);
  sub.add_option("--cp", a.cp, "context-parallel ranks (overrides layout.cp)")->check(CLI::PositiveNumber);
  sub.add_option("--dp", a.dp, "data-parallel ranks (overrides layout.dp)")->check(CLI::PositiveNumber);
  sub.add_option("--ga", a.ga, "gradient-accumulation micro-batches (overrides layout.ga)")->check(CLI::PositiveNumber);
  sub.add_option("--out", a.out_dir, "folder to write (created; must be empty if it exists)")->required();
  sub.add_option("--threads", a.threads, "OpenMP threads for generating the inputs (default: all)")
      ->check(thread_count());
  sub.add_option("--rank", a.rank,
                 "write only this world rank's file (the index still describes every rank): a process of a "
                 "distributed launch regenerates its own inputs")
      ->check(CLI::NonNegativeNumber);
  sub.add_flag("--quiet,-q", a.quiet, "print nothing");
}

int run_export_inputs(const ExportInputsArguments& args) {
  std::vector<std::string> overrides = args.set;
  const std::pair<const char*, int> layout[] = {{"tp", args.tp}, {"cp", args.cp}, {"dp", args.dp}, {"ga", args.ga}};
  for (const auto& [key, value] : layout) {
    if (value > 0) overrides.push_back("layout." + std::string(key) + "=" + std::to_string(value));
  }
  const Case c = load_case_file(args.case_file, overrides);
  if (const std::string gap = kind_of(c.loss).dump_gap(); !gap.empty()) {
    throw CaseError(args.case_file + ": loss kind " + std::string(kind_of(c.loss).name()) +
                    " cannot be exported: " + gap + " (lossverify run checks it)");
  }
  dump::ExportOptions options;
  options.out_dir = args.out_dir;
  options.case_file = args.case_file;
  options.overrides = overrides;
  options.only_rank = args.rank;
  options.threads =
      args.threads > 0 ? args.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const nlohmann::json index = dump::export_inputs(c, options);
  if (!args.quiet) {
    std::cout << "exported " << (args.rank >= 0 ? "rank " + std::to_string(args.rank) + " of " : "")
              << index["ranks"].size() << " rank(s) of case " << printable(c.name) << " [N=" << c.shape.tokens
              << " V=" << c.shape.vocab << ", " << to_string(c.inputs.dtype) << ", tp=" << c.layout.tp
              << " cp=" << c.layout.cp << " dp=" << c.layout.dp << " ga=" << c.layout.ga << "] to " << args.out_dir
              << "/" << dump::kInputsIndex << "\n";
  }
  return 0;
}

}  // namespace lossverify::cli
