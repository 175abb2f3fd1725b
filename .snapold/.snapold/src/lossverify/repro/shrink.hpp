#pragma once
// Shrinking a failing case: greedy delta debugging, in process, on the CPU thread backend. Each trial runs a
// reduced copy of the case and keeps it when the same check (by name) still fails. Reductions, repeated
// until a round changes nothing or the budget runs out:
//   sequences  drop whole sequences (halves, quarters, ... single ones)
//   tokens     halve each sequence (its first or its second half), then drop single tokens
//   vocabulary halve V (never below tp or 2; inline rows keep their first V columns), then V - 1 when small
//   layout     tp, cp, dp, ga toward 1 (1, then half, then one less)
//   features   label smoothing, z-loss, softcap, ignored tokens, reduction, upstream weights, dtype,
//              framework model, placement, logit scale back to their defaults
//   rows       drop inline rows (inputs.overrides)
// Token indices of inline rows and explicit upstream weights follow the tokens they belong to.
// A failure must not slip into another one: when the check failed with a finite margin it must keep a
// finite margin, and when the run's outputs were all finite (the finite check passed) they must stay so
// (a tiny vocabulary can make a buggy kernel divide by zero: a different bug report).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"

namespace lossverify {

struct ShrinkOptions {
  std::string implementation = "correct";
  std::string check;          // the check that must keep failing; empty: the first failing check
  int max_trials = 400;       // runs, the first one included
  double max_seconds = 60.0;  // wall-clock budget (checked before each trial)
  bool pin_rows = false;      // finally pin the worst element's row inline (generator-independent)
  int threads = 0;            // OpenMP threads per trial (0: all)
  std::function<void(const std::string&)> progress;  // one line per accepted reduction
};

struct ShrinkSize {
  std::int64_t tokens = 0, vocab = 0, sequences = 0, overrides = 0;
  LayoutSpec layout;
  std::int64_t logits() const { return tokens * vocab; }
};
ShrinkSize size_of(const Case& c);

struct ShrinkResult {
  nlohmann::json minimized;  // the case file to write (compact: defaults left out)
  Case minimized_case;
  std::string check;
  ShrinkSize before, after;
  double margin_before = 0.0, margin_after = 0.0;
  int trials = 0;
  double seconds = 0.0;
  std::vector<std::string> steps;  // accepted reductions, in order
  bool budget_exhausted = false;   // stopped by max_trials or max_seconds, not at a fixed point
};

// Throws CaseError "nothing to shrink: ..." when the check does not fail to begin with (or, when no check
// is named, when nothing fails), and for an unknown implementation or check name.
ShrinkResult shrink_case(const Case& c, const ShrinkOptions& options);

// The case as a compact case document: the resolved case without the keys that hold their defaults, without
// the sweep, with only the tolerances the case overrides. Reads back to the same case.
nlohmann::json compact_case_json(const Case& c);
// A case document as the text of a case file: keys in the order of the README (name, description, shape,
// loss, inputs, batch, layout, framework, tolerances, timeout_seconds), two-space indent.
std::string case_file_text(const nlohmann::json& document);

}  // namespace lossverify
