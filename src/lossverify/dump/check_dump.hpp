#pragma once
// `lossverify check-dump`: a real implementation's dumped training step, checked like `run` checks the
// built-in kernels. The manifest's tensors are read and validated, the global problem (logits, teacher
// logits, labels, loss mask, upstream weights, packed sequences) is reassembled into an InputSource in
// explicit mode, every rank's dumped gradient, per-token and logged losses and logged count become its
// RankOutput, and the same distributed verification (verify_rank on thread ranks) and report follow.
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/dump/manifest.hpp"
#include "lossverify/dump/tensor_file.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/outputs/rank_output.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify::dump {

// The reassembled problem. Not movable: the input source refers to the manifest's case.
struct DumpProblem {
  Manifest manifest;
  Implementation implementation;  // what produced the dump (name from the manifest)
  std::unique_ptr<InputSource> inputs;
  std::vector<RankOutput> outputs;  // world-rank order
  std::vector<std::string> files;   // every tensor file read, in first-use order (printable, for the report)
  std::uint64_t bytes_read = 0;
  double load_seconds = 0.0;
  bool logits_look_like_probabilities = false;  // every row in [0, 1], summing to 1
  // Of each global input (logits, teacher logits, labels, mask, the kind's per-token inputs), by name; taken only
  // when asked for (sweeps compare them).
  std::optional<std::vector<std::pair<std::string, std::uint64_t>>> inputs_fingerprint;

  DumpProblem() = default;
  DumpProblem(const DumpProblem&) = delete;
  DumpProblem& operator=(const DumpProblem&) = delete;
};

// Reads and validates every tensor the manifest names and reassembles the global problem. Throws
// DumpError / CaseError (exit code 2) naming the file and tensor for anything malformed or inconsistent.
// `fingerprint_inputs`: also hash the reassembled inputs, for require_same_problem (one more pass over them).
std::unique_ptr<DumpProblem> load_dump(Manifest manifest, bool fingerprint_inputs = false);
std::unique_ptr<DumpProblem> load_dump(const std::string& manifest_path, bool fingerprint_inputs = false);

struct DumpCheckOptions {
  int threads = 0;             // OpenMP threads in all (0: the hardware's)
  bool keep_snapshot = false;  // keep the global answers (RunResult::snapshot) for the invariance check
};

// Several dumps of one global problem at different layouts (a sweep): DumpError naming `other`'s manifest
// unless the two hold the same problem: shape, dtype, loss, framework, sequences and identical inputs.
void require_same_problem(const DumpProblem& first, const DumpProblem& other);
// The part of that known from the manifests alone (shape, loss, framework, dtype, sequences): before any tensor
// is read.
void require_same_manifest_problem(const Manifest& first, const Manifest& other);

// Verifies the dump on thread ranks (one per dumped rank). Quantities the dump does not hold (per-token
// losses, the logged loss, the logged count) are reported as not dumped, never as passing comparisons.
RunResult check_dump(const DumpProblem& problem, const DumpCheckOptions& options = {});

// The control band of the dump (runner/control_band.hpp): lossverify's correct implementations at the dump's
// layout on the dump's own inputs, on thread ranks. Throws CaseError where lossverify cannot run that case.
std::vector<ControlRun> dump_controls(const DumpProblem& problem, const DumpCheckOptions& options = {});

// The report's run object: run_to_json plus the dump (manifest, files, what was dumped) and, for every
// worst element, the rank, micro-batch, row and tensor of the dump that holds it.
nlohmann::json dump_run_to_json(const DumpProblem& problem, const RunResult& run);

// The human summary (like `run`'s, with dump locations).
void print_dump_summary(std::ostream& out, const DumpProblem& problem, const RunResult& run);

}  // namespace lossverify::dump
