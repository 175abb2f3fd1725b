#pragma once
// `lossverify export-inputs CASE.json --out DIR`: every rank's exact inputs as safetensors plus an index.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace lossverify::cli {

struct ExportInputsArguments {
  std::string case_file;
  std::vector<std::string> set;
  int tp = 0, cp = 0, dp = 0, ga = 0;  // 0: the case's own
  std::string out_dir;
  int threads = 0;
  int rank = -1;  // >= 0: only this world rank's file
  bool quiet = false;
};

struct ExportInputsCommand {
  CLI::App* app = nullptr;
  ExportInputsArguments args;
  bool selected() const { return app != nullptr && app->parsed(); }
};

void register_export_inputs(CLI::App& app, ExportInputsCommand& command);
// 0 when written; throws lossverify::Error (exit 2 for a bad case or folder, 3 for I/O).
int run_export_inputs(const ExportInputsArguments& args);

}  // namespace lossverify::cli
