#pragma once
// What every subcommand validates the same way: thread counts, time limits, and the exit codes its help lists.
#include <cmath>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "lossverify/core/errors.hpp"

namespace lossverify::cli {

// OpenMP threads: 0 means all hardware threads; more than 1024 is a typo, not a machine (libgomp gives up).
inline CLI::Validator thread_count() { return CLI::Range(0, 1024); }

// Seconds for a time limit: finite and between 10 ms and a day.
inline CLI::Validator seconds() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0.0;
        try {
          std::size_t used = 0;
          value = std::stod(text, &used);
          if (used != text.size()) return "not a number of seconds: " + text;
        } catch (const std::exception&) {
          return "not a number of seconds: " + text;
        }
        if (!std::isfinite(value) || value < 0.01 || value > 86400.0) {
          return "must be a number of seconds in [0.01, 86400], got " + text;
        }
        return {};
      },
      "SECONDS in [0.01, 86400]");
}

// The help footer of a subcommand: its own exit codes.
inline std::string exit_codes(const std::string& codes) { return "exit codes: " + codes; }

// --junit FILE (run, check-dump): a testcase per check, its margin and control band as properties.
inline void add_junit_option(CLI::App& app, std::string& junit_path) {
  app.add_option("--junit", junit_path,
                 "write JUnit XML here: a testcase per check, its margin and control band as properties");
}

// --no-control: skip the control band (docs/checks.md, "The control band"), on by default.
inline void add_control_flag(CLI::App& app, bool& no_control) {
  app.add_flag("--no-control", no_control,
               "skip the control band: the margins lossverify's correct implementation reaches on the same inputs in "
               "float32 and in the case's 16-bit dtype (on by default; each control is one more run)");
}

}  // namespace lossverify::cli
