#pragma once
// The checks of docs/spec.md §6: every loss value, gradient element and logged statistic of every rank against
// the float64 reference, plus reference-free signals (rank agreement, finiteness, the row-sum invariant).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/checks/oracle.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

enum class Verdict { pass, fail, not_applicable };
std::string_view to_string(Verdict v);

// One compared element: where it is and both values. column is -1 for per-token quantities.
struct ElementRecord {
  std::int64_t token = -1;
  std::int64_t column = -1;
  int rank = -1;
  double expected = 0.0;
  double got = 0.0;
  double tolerance = 0.0;
  // Set for CP padding rows (token -1): which sequence position the row pads.
  std::int64_t padding_sequence = -1;
  std::int64_t padding_position = -1;
};

// Error statistics of one quantity; the worst element is the one with the largest error/tolerance,
// ties broken by position so the result does not depend on thread scheduling.
// ErrorStats as plain data (PackedStats, checks/oracle.hpp), for all-gathers between ranks.

class ErrorStats {
 public:
  PackedStats pack() const;
  static ErrorStats unpack(const PackedStats& packed);
  void add(const ElementRecord& record);
  // Adds an element whose margin the caller computed (ULP-based tolerances).
  void add_with_margin(const ElementRecord& record, double margin, bool mismatch);
  // add_with_margin for elements added in increasing (token, column, rank) order, as a row's columns are:
  // the same statistics, but the record is built only when the element becomes the worst so far.
  template <class MakeRecord>
  void add_in_order(double got, double expected, double margin, bool mismatch, MakeRecord make_record) {
    count(got, expected, mismatch);
    if (!worst_ || margin > max_margin_) {
      max_margin_ = margin;
      worst_ = make_record();
    }
  }
  void add_ulp(std::int64_t ulp) { max_ulp_ = std::max(max_ulp_, ulp); }
  void merge(const ErrorStats& other);

  std::int64_t compared() const { return compared_; }
  std::int64_t mismatches() const { return mismatches_; }
  double max_abs_error() const { return max_abs_; }
  double max_rel_error() const { return max_rel_; }
  double margin() const { return max_margin_; }  // max |got - expected| / tolerance; inf for NaN
  std::int64_t max_ulp() const { return max_ulp_; }
  const std::optional<ElementRecord>& worst() const { return worst_; }
  nlohmann::json to_json() const;

 private:
  // compared, mismatches and the largest absolute and relative errors
  void count(double got, double expected, bool mismatch) {
    ++compared_;
    const double error = got == expected ? 0.0 : std::fabs(got - expected);
    if (mismatch) ++mismatches_;
    if (std::isnan(error)) {
      max_abs_ = std::numeric_limits<double>::infinity();
    } else {
      max_abs_ = std::max(max_abs_, error);
      if (expected != 0.0) max_rel_ = std::max(max_rel_, error / std::fabs(expected));
    }
  }

  std::int64_t compared_ = 0;
  std::int64_t mismatches_ = 0;
  double max_abs_ = 0.0;
  double max_rel_ = 0.0;
  double max_margin_ = 0.0;
  std::int64_t max_ulp_ = 0;
  std::optional<ElementRecord> worst_;
};

struct CheckResult {
  std::string name;
  Verdict verdict = Verdict::pass;
  double margin = 0.0;  // error / tolerance of the worst element: < 1 passes, > 1 fails
  std::optional<Tolerance> tolerance;
  nlohmann::json metrics = nlohmann::json::object();
  std::optional<ElementRecord> worst;
  std::string summary;  // one line for humans
};

struct CheckInfo {
  std::string name;
  std::string description;
};
const std::vector<CheckInfo>& check_catalogue();
// A check's result from its statistics: not applicable when nothing was compared.
CheckResult make_result(const std::string& name, const ErrorStats& stats, Tolerance tol, std::string what);

// Largest N x V whose effective gradients a sweep keeps for the invariance check (float32 each).
inline constexpr std::int64_t kSnapshotElementLimit = std::int64_t{1} << 25;

// What a layout computed of the global problem, for the invariance check between layouts.
struct LayoutSnapshot {
  std::vector<float> token_loss;      // per global token, from the first TP holder
  std::vector<float> effective_grad;  // N x V, empty when the problem is too large to keep
  // Per global token, |w_t| times the kind's gradient factor where the kind scales its gradient tolerance
  // per token (KindReference::gradient_scale); 0 elsewhere.
  std::vector<float> token_grad_scale;
  double logged_loss = 0.0;
  std::int64_t logged_valid_tokens = 0;

  // Sized for an N x V problem (gradients kept up to kSnapshotElementLimit elements; none where a stage keeps the
  // kind's gradient inside, `gradients` false).
  static LayoutSnapshot sized_for(std::int64_t tokens, std::int64_t vocab, bool gradients = true) {
    LayoutSnapshot s;
    s.token_loss.assign(static_cast<std::size_t>(tokens), 0.0f);
    s.token_grad_scale.assign(static_cast<std::size_t>(tokens), 0.0f);
    if (gradients && tokens * vocab <= kSnapshotElementLimit)
      s.effective_grad.assign(static_cast<std::size_t>(tokens * vocab), 0.0f);
    return s;
  }
};

// Where the error sits, for plots and summaries: each rank's largest margin and shard, and each global
// token's largest margin over its columns and ranks. Margins are error / tolerance (> 1 fails; +inf for
// NaN). Filled by verify_rank on every rank (identical everywhere).
struct RankErrorCell {
  std::int64_t rank = 0, tp = 0, cp = 0, dp = 0;
  std::int64_t vocab_begin = 0, vocab_end = 0;
  double loss_margin = 0.0, grad_margin = 0.0;
  std::int64_t grad_mismatches = 0;
};
struct ErrorMap {
  std::vector<RankErrorCell> ranks;       // in world-rank order
  std::vector<double> token_grad_margin;  // per global token
  std::vector<double> token_loss_margin;  // per global token
};

struct RankGroups;
class Communicator;

// How the case's gradient elements are judged, for a rank whose gradient is stored in `output_dtype`.
// The step's valid tokens matter where the kind's framework divides by them (effective_gradient_scale).
GradJudgement grad_judgement(const Case& c, std::int64_t step_valid_tokens, DType output_dtype);

// Distributed verification, run by every rank after its kernel (collective over `world`): the rank's
// oracle computes the float64 reference of its own rows x columns (row statistics combined over its TP
// group here) and judges every element of its gradient; the losses, logged values and cross-rank
// invariants are judged here, and only metrics and worst-element records are reduced, in rank order. No
// rank ever holds more than its own shard, and every oracle gets bitwise the same results. Returns the
// merged results (identical on every rank). `snapshot` (thread ranks only: shared memory) receives the
// layout's answers for the invariance check; it needs the rank's gradient on the host.
std::vector<CheckResult> verify_rank(const Case& c, const RankOutput& out, Oracle& oracle, RankGroups& groups,
                                     Communicator& world, LayoutSnapshot* snapshot = nullptr,
                                     ErrorMap* error_map = nullptr);

// The invariance check: every layout's snapshot against the first (same global answers at every layout).
// Layouts are added one at a time; only the first is kept, so a sweep holds at most two snapshots.
class InvarianceCheck {
 public:
  explicit InvarianceCheck(const Case& c);
  // A layout is compared with the first one of its class (LossKind::invariance_class; one class for most kinds).
  void add(LayoutSnapshot snapshot, const std::string& layout_name, const std::string& layout_class = {});
  CheckResult result() const;

 private:
  struct Base {
    LayoutSnapshot snapshot;
    std::string name;
  };
  const Case& case_;
  Tolerance tolerance_;
  std::map<std::string, Base> bases_;  // per layout class
  int layouts_ = 0;                    // compared so far
  ErrorStats stats_;
  nlohmann::json per_layout_ = nlohmann::json::array();
  bool gradients_compared_ = false;
};

CheckResult invariance_check(const Case& c, const std::vector<LayoutSnapshot>& snapshots,
                             const std::vector<std::string>& layout_names);

}  // namespace lossverify
