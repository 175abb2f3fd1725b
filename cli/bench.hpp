#pragma once
// `lossverify bench`: the CUDA kernels' speed as a fraction of the memory floor,
// with PyTorch's figures beside them.
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace lossverify::cli {

struct BenchArguments {
  std::string backend = "cuda";
  std::string shape = "16384,128256";
  std::string dtype = "bf16";
  int tp = 1;
  int gpus = 1;  // > 1: the TP-sharded step over this many GPUs, NCCL between them
  int repeats = 20;
  double label_smoothing = 0.1;
  std::string report_path;
  std::string torch_script;            // default: bench/torch_ce_bench.py, or bench/torch_logprob_bench.py for policy
  std::string loss = "cross_entropy";  // cross_entropy | policy | router | head
  int hidden = 4096;                   // head: H
  int chunks = 4;                      // head: its chunks of the tokens
};

struct BenchCommand {
  CLI::App* app = nullptr;
  BenchArguments args;
  bool selected() const { return app != nullptr && app->parsed(); }
};

// Adds the subcommand to `app`; the returned object must outlive app.parse().
void register_bench(CLI::App& app, BenchCommand& command);
// Runs it: 0 measured and the sampled check passed, 1 the check failed; throws lossverify::Error (exit 2
// for a usage error, 3 without a GPU).
int run_bench(const BenchArguments& args);

}  // namespace lossverify::cli
