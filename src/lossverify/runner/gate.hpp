#pragma once
// The CI numerical gate: every shipped case with the correct implementation and with every catalogued
// bug, each outcome compared with golden/<case>.json; sweeps of the correct implementation where a case
// declares one. Nothing rewrites golden/ unless asked (--update-golden).
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify {

struct GateOptions {
  std::string cases_dir = "cases";
  std::string golden_dir = "golden";
  bool update_golden = false;
  int threads = 0;
  bool quiet = false;
  // Empty: the correct implementation and every catalogued bug. Otherwise these implementations only (a
  // plugin:PATH included), each judged against golden's outcomes of `expect` (empty: its own name; for a
  // plugin, correct). Sweeps run for the implementations judged as correct.
  std::vector<std::string> implementations;
  std::string expect;
  // Where the kernels run: the CPU, or CUDA GPUs (the GPU oracle judges them; sweeps keep the CPU
  // reference), against the same golden outcomes.
  RunOptions::Device device = RunOptions::Device::cpu;
  int gpus = 1;
  double timeout_seconds = 0.0;  // > 0: every case's deadlock-guard timeout (their own otherwise)
  // Non-empty: every run's report, as `run --report` writes it, into this folder (CASE__IMPL.json for a
  // cell, CASE__sweep.json for a sweep's layouts), so that one process's runs can be compared with fresh ones.
  std::string run_reports_dir;
};

// One (case, implementation) cell of the matrix.
struct GateCell {
  std::string case_name;
  std::string implementation;
  std::string expected_as;                  // the golden row it is judged against (its own name by default)
  std::string verdict;                      // pass | fail | not_applicable (the bug cannot reach this loss)
  std::vector<std::string> failing_checks;  // sorted
  double margin = 0.0;                      // worst check margin of the run (detection margin for a bug)
  std::optional<nlohmann::json> expected;   // golden outcome; nullopt when golden has none
  bool matches = false;
  double seconds = 0.0;
  std::string detail;  // failure message for JUnit
};

struct GateSweep {
  std::string case_name;
  std::string implementation;
  std::vector<std::string> layouts;
  std::string verdict;
  std::string failing_layouts;
  double invariance_margin = 0.0;
  std::optional<std::string> expected;
  bool matches = false;
  double seconds = 0.0;
};

struct GateResult {
  std::vector<std::string> cases;
  std::vector<std::string> implementations;
  std::vector<GateCell> cells;
  std::vector<GateSweep> sweeps;
  int bugs_run = 0;
  int bugs_caught = 0;
  std::vector<std::string> uncaught_bugs;
  int false_alarms = 0;                    // an implementation judged as correct failing a case or a sweep
  int mismatches = 0;                      // outcomes differing from golden
  std::string smallest_detection;          // "impl on case"
  double smallest_detection_margin = 0.0;  // over bugs: the margin on the case that catches it best
  double largest_correct_margin = 0.0;     // over cases: how close the correct implementation comes to failing
  double wall_seconds = 0.0;
  std::string backend = "cpu";
  int gpus = 0;
  bool golden_updated = false;
  // Cells that ran (not not_applicable) and sweeps: a gate that ran nothing checked nothing, and does not pass.
  int ran() const {
    int n = static_cast<int>(sweeps.size());
    for (const GateCell& cell : cells) n += cell.verdict != "not_applicable";
    return n;
  }
  bool passed() const { return ran() > 0 && mismatches == 0 && false_alarms == 0 && uncaught_bugs.empty(); }
};

GateResult run_gate(const GateOptions& options);

void print_gate_matrix(std::ostream& out, const GateResult& result);
nlohmann::json gate_report(const GateResult& result);
std::string gate_junit(const GateResult& result);

}  // namespace lossverify
