#pragma once
// Reproducer bundles ("lossverify.bundle/1"): one JSON file that re-runs a failure anywhere, without the
// original case file and without trusting the input generator for the rows that matter.
//
//   format          "lossverify.bundle/1"
//   tool            version, git revision, compiler, build type of the build that wrote it
//   implementation  the --impl name
//   backend         device (cpu|cuda), launcher (threads|mpi), processes, gpus, collectives
//   provenance      case file, --set overrides applied, command line
//   seeds           the input seed and the generator (Philox4x32-10)
//   case            the fully resolved case (every default written out, --set applied) with the failing
//                   rows pinned inline as inputs.overrides: runnable as a case file on its own
//   failing_rows    for the worst element of every failing check (then the tokens of largest margin):
//                   token, place in the layout, label, margins, and the exact input rows as the raw bits
//                   of the input dtype in hex ("3f800000 bf800000 ...": student logits_bits, KD teacher_bits,
//                   and a stage's own input row of the token, stage_input_bits: an LM head's h_t; under such a
//                   stage the pinned logits reach no one, and W comes from the seed)
//   outcome         the recorded verdict, exit code, every check's verdict, margin and worst element, and
//                   the error map's failing ranks
//
// Replay re-runs the case and compares: the run reproduces when every recorded check has the same verdict
// and every recorded failing check's worst element sits at the same (token, column, rank).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/checks.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify {

inline constexpr const char* kBundleFormat = "lossverify.bundle/1";

// How the run was started: recorded for provenance (replay runs on thread ranks, bitwise like MPI).
struct BundleContext {
  std::vector<std::string> set_overrides;  // --set (and --tp/--timeout) assignments applied to the case file
  std::vector<std::string> command_line;
  std::string launcher = "threads";  // threads | mpi
  int processes = 1;
  std::string device = "cpu";  // cpu | cuda
  int gpus = 0;
};

struct BundleLimits {
  int max_rows = 8;                                 // rows of distinct tokens recorded
  std::int64_t max_values = std::int64_t{1} << 20;  // logits recorded in all (the first row always is)
};

nlohmann::json make_bundle(const RunResult& run, const BundleContext& context, const BundleLimits& limits = {});

// Hex words of the raw bits of values in the dtype (each value is rounded to the dtype first).
std::string encode_row_bits(const std::vector<double>& values, DType dtype);
// Inverse; throws CaseError naming `source` and `path` for a malformed word or a wrong count (`width_name`: what
// the count is, "vocab" or a stage's input width).
std::vector<double> decode_row_bits(const std::string& text, DType dtype, std::int64_t expected_count,
                                    const std::string& source, const std::string& path,
                                    const std::string& width_name = "vocab");

struct RecordedElement {
  std::int64_t token = -1;
  std::int64_t column = -1;
  int rank = -1;
};
struct RecordedCheck {
  std::string name;
  Verdict verdict = Verdict::pass;
  double margin = 0.0;
  std::optional<RecordedElement> worst;
};
struct RecordedRow {
  std::int64_t token = 0;
  bool pinned = false;                // added to the case's overrides by the bundle writer
  std::vector<double> logits;         // decoded student row (exact values of the input dtype)
  std::vector<double> teacher;        // decoded teacher row (KD with its own teacher)
  std::vector<double> stage_input;    // decoded stage input row (Stage::token_input: an LM head's h_t)
  std::optional<std::int64_t> label;  // cross-entropy
};

struct Bundle {
  std::string path;
  nlohmann::json document;
  Case the_case;
  std::string implementation;
  std::string device = "cpu";
  std::string tool_version;
  std::string git_revision;
  Verdict verdict = Verdict::pass;
  std::vector<RecordedCheck> checks;
  std::vector<RecordedRow> rows;
};

// Validates everything; throws CaseError "FILE: $.field: what is wrong" (exit code 2) otherwise, including
// a failing row whose bits disagree with the row pinned in $.case.
Bundle parse_bundle(const nlohmann::json& document, const std::string& source);
Bundle read_bundle(const std::string& path);

// Rows the bundle recorded that this build's generator no longer produces bit for bit (the generator
// changed since the bundle was written): one line per row, empty when every row matches.
std::vector<std::string> input_drift(const Bundle& bundle);

struct ReplayComparison {
  bool reproduced = true;
  std::vector<std::string> differences;  // why not, one line each ("check grad was fail, now pass")
  std::vector<std::string> notes;        // informative only (a check this build adds)
};
// compare_worst: also require the recorded failing checks' worst elements at the same place (off when the
// replay runs on another backend, whose rounding may move the worst element).
ReplayComparison compare_outcome(const Bundle& bundle, const RunResult& run, bool compare_worst = true);

}  // namespace lossverify
