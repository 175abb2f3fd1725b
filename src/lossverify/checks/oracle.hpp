#pragma once
// The seam between the checks and the float64 reference (docs/spec.md §4): an Oracle owns its inputs
// (regenerated from the case's Philox streams into its own buffers, on the host or on a GPU) and judges a
// read-only view of one rank's outputs, element by element. The checks drive every oracle through the
// same stages and never learn where it runs; the runner makes the oracle, and neither calls the other.
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/reference/loss_reference.hpp"

namespace lossverify {

// Compared-element statistics as plain data (all-gathers between ranks; an oracle's rows).
struct PackedElement {
  std::int64_t token, column, rank, padding_sequence, padding_position;
  double expected, got, tolerance;
};
struct PackedStats {
  std::int64_t compared, mismatches, max_ulp, has_worst;
  double max_abs, max_rel, margin;
  PackedElement worst;
};

// How one gradient element is judged (docs/spec.md §6): the same numbers for every oracle.
struct GradJudgement {
  Tolerance tolerance;
  DType dtype = DType::fp32;     // of the rank's gradient
  double framework_scale = 1.0;  // local gradient x this = the effective gradient
  double quantum = 0.0;          // smallest positive value of the dtype
  double grad_scale = 1.0;       // the kind's gradient factor (KD: T^(s-1))
  double smallest_normal = 0.0;  // of the dtype, for the finite census
};

// What the oracle found in one row of a rank's gradient.
struct RowJudgement {
  PackedStats grad{};                 // every element of the row (worst: global token and column)
  double sum = 0.0, sum_error = 0.0;  // compensated sum of the effective gradient (row-sum invariant)
  double magnitude = 0.0;             // sum of its magnitudes
  std::int64_t nan = 0, pos_inf = 0, neg_inf = 0, subnormal = 0;  // of the stored values
  std::int64_t first_bad_column = -1;  // global column of the first non-finite value, -1 if none
  double first_bad_value = 0.0;
  std::int64_t lookups = 0;        // elements judged by a code-table lookup (GPU oracle)
  std::vector<PackedStats> stage;  // each of a stage's gradients over the row (kind_api/stage.hpp); host oracle
};

class Oracle {
 public:
  virtual ~Oracle() = default;
  // The definitions the oracle evaluates (token weights, row combination, losses).
  virtual const LossReference& reference() const = 0;
  // Stage 1: every row's RowPartial over the rank's columns (RowPartial::kDoubles doubles per row, empty
  // partials for rows that are no valid token), and which rows are valid tokens.
  virtual void row_partials(std::vector<double>& partials, std::vector<char>& valid) = 0;
  // Kinds with a value pass (KindReference::needs_value_pass, KD's sum_v P_v (log P_v - log Q_v)): its
  // [value, error] per row over the rank's columns.
  virtual std::vector<double> value_partials(std::span<const RowStats> stats) = 0;
  // Stage 3: starts judging every element of the rank's gradient against the reference, given each row's
  // combined statistics (it may run in the background); judged_rows waits for it.
  virtual void start_judging(std::span<const RowStats> stats) = 0;
  virtual std::span<const RowJudgement> judged_rows() = 0;
  // Once the rows are judged: each of a stage's parameter gradients of the rank (Stage::parameters), judged whole.
  virtual std::vector<PackedStats> stage_parameters() { return {}; }
  // Whether the oracle counts code-table lookups (the report's "judged_by_lookup").
  virtual bool counts_lookups() const { return false; }
};

}  // namespace lossverify
