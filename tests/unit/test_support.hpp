#pragma once
// Builds cases in code for the unit tests.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/runner/gate.hpp"
#include "lossverify/runner/run_case.hpp"

namespace lossverify::testing {

// A small cross-entropy case; adjust the returned JSON before parsing it.
inline nlohmann::json case_json(std::int64_t tokens, std::int64_t vocab, int tp, const std::string& dtype = "fp32") {
  return {{"name", "unit"},
          {"shape", {{"tokens", tokens}, {"vocab", vocab}}},
          {"inputs", {{"seed", 1234}, {"dtype", dtype}, {"scale", 2.0}}},
          {"layout", {{"tp", tp}}},
          {"timeout_seconds", 30.0}};
}

inline Case make_case(const nlohmann::json& j) { return parse_case(j, "<test>"); }

// One case on CPU thread ranks with an implementation, two OpenMP threads.
inline RunResult run_with(const Case& c, const std::string& impl) {
  RunOptions options;
  options.implementation = impl;
  options.threads = 2;
  return run_case(c, options);
}

// The named check of a run (a missing one fails the test).
inline const CheckResult& check_named(const RunResult& r, const std::string& name) {
  for (const CheckResult& c : r.checks) {
    if (c.name == name) return c;
  }
  FAIL("no check " << name);
  return r.checks.front();
}

// The gate on one case in a folder of its own (under the temporary folder, removed afterwards): it records golden
// outcomes for every implementation that applies, then runs `held` against them.
struct GateRecordAndHold {
  GateResult recorded, held;
};
inline GateRecordAndHold gate_record_and_hold(const nlohmann::json& case_doc, const std::string& folder,
                                              const std::vector<std::string>& held) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / folder;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "cases");
  std::filesystem::create_directories(dir / "golden");
  std::ofstream(dir / "cases" / "case.json") << case_doc.dump(2);
  GateOptions options;
  options.cases_dir = (dir / "cases").string();
  options.golden_dir = (dir / "golden").string();
  options.quiet = true;
  options.threads = 2;
  options.update_golden = true;
  GateRecordAndHold out;
  out.recorded = run_gate(options);
  options.update_golden = false;
  options.implementations = held;
  out.held = run_gate(options);
  std::filesystem::remove_all(dir);
  return out;
}

}  // namespace lossverify::testing
