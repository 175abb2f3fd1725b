#pragma once
// Builds cases in code for the unit tests.
#include <string>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
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

}  // namespace lossverify::testing
