#pragma once
// The checks of docs/spec.md §6: every loss value, gradient element and logged statistic of every rank against
// the float64 reference, plus reference-free signals (rank agreement, finiteness, the row-sum invariant).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/impl/rank_output.hpp"
#include "lossverify/inputs/input_source.hpp"

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
// ErrorStats as plain data, for all-gathers between ranks.
struct PackedElement {
  std::int64_t token, column, rank, padding_sequence, padding_position;
  double expected, got, tolerance;
};
struct PackedStats {
  std::int64_t compared, mismatches, max_ulp, has_worst;
  double max_abs, max_rel, margin;
  PackedElement worst;
};

class ErrorStats {
 public:
  PackedStats pack() const;
  static ErrorStats unpack(const PackedStats& packed);
  void add(const ElementRecord& record);
  // Adds an element whose margin the caller computed (ULP-based tolerances).
  void add_with_margin(const ElementRecord& record, double margin, bool mismatch);
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

// Largest N x V whose effective gradients a sweep keeps for the invariance check (float32 each).
inline constexpr std::int64_t kSnapshotElementLimit = std::int64_t{1} << 25;

// What a layout computed of the global problem, for the invariance check between layouts.
struct LayoutSnapshot {
  std::vector<float> token_loss;      // per global token, from the first TP holder
  std::vector<float> effective_grad;  // N x V, empty when the problem is too large to keep
  double logged_loss = 0.0;
  std::int64_t logged_valid_tokens = 0;
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
  std::vector<RankErrorCell> ranks;        // in world-rank order
  std::vector<double> token_grad_margin;   // per global token
  std::vector<double> token_loss_margin;   // per global token
};

struct RankGroups;
class Communicator;
namespace cuda {
struct OracleShard;  // the GPU oracle's own inputs (impl/cuda/gpu_reference.hpp)
}

// Distributed verification, run by every rank after its kernel (collective over `world`): the rank
// regenerates its own rows x columns, computes the float64 reference for them (row statistics combined
// over its TP group), checks every element locally, and only metrics and worst-element records are
// reduced, in rank order. No rank ever holds more than its own shard, and every backend that runs the
// same layout gets bitwise the same results. Returns the merged results (identical on every rank).
// `snapshot` (thread backend only: shared memory) receives the layout's answers for the invariance check.
// A rank whose gradient stayed on its GPU is judged by the GPU oracle: `gpu_oracle` when the runner made
// it before the implementation ran (its inputs are generated meanwhile), else one made here.
std::vector<CheckResult> verify_rank(const Case& c, const InputSource& inputs, const RankOutput& out,
                                     RankGroups& groups, Communicator& world, int threads,
                                     LayoutSnapshot* snapshot = nullptr, ErrorMap* error_map = nullptr,
                                     std::shared_ptr<cuda::OracleShard> gpu_oracle = nullptr);

// The invariance check: every layout's snapshot against the first (same global answers at every layout).
// Layouts are added one at a time; only the first is kept, so a sweep holds at most two snapshots.
class InvarianceCheck {
 public:
  explicit InvarianceCheck(const Case& c);
  void add(LayoutSnapshot snapshot, const std::string& layout_name);
  CheckResult result() const;

 private:
  const Case& case_;
  Tolerance tolerance_;
  std::optional<LayoutSnapshot> base_;
  std::string base_name_;
  int layouts_ = 0;  // compared so far
  ErrorStats stats_;
  nlohmann::json per_layout_ = nlohmann::json::array();
  bool gradients_compared_ = false;
};

CheckResult invariance_check(const Case& c, const std::vector<LayoutSnapshot>& snapshots,
                             const std::vector<std::string>& layout_names);

}  // namespace lossverify
