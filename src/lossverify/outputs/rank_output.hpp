#pragma once
// What one rank is given and what it reports: the interface between implementations and checks.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "lossverify/core/dtype.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/layout/vocab_range.hpp"

namespace lossverify {

// A rank's share of the global problem: its vocabulary columns and its local rows (global tokens or
// CP padding), micro-batch after micro-batch.
struct RankAssignment {
  int world_rank = 0;
  RankCoordinates coordinates;
  VocabRange vocab;
  std::vector<LocalRow> rows;
  std::vector<std::int64_t> micro_batch_begin;  // GA + 1 offsets into rows
};

namespace cuda {
struct DeviceShard;  // a rank's inputs and gradient left on its GPU (cuda/device_buffer.hpp)
}

struct RankOutput {
  RankAssignment assignment;
  DType dtype = DType::fp32;
  std::vector<std::byte> grad;    // rows x vocab.size() in dtype, row major: the local d loss / d x
  std::vector<float> token_loss;  // per local row, unweighted; 0 on masked rows
  // Per local row, its term in the logged loss per unit of its weight where a catalogued bug weighs parts of a
  // token's loss apart (KindRowPlan::separate_logged_loss); else unused.
  std::vector<float> logged_token_loss;
  std::vector<float> token_values;   // per local row, the kind's token_quantities() (row major); 0 on masked rows
  std::vector<double> logged_stats;  // the kind's logged_statistics(), as this rank logs them
  // GA x the kind's scope_values_width() (a router's per-expert counts of each micro-batch scope); empty: not reported.
  std::vector<double> scope_values;
  // A stage's gradients (kind_api/stage.hpp, its gradients()), each stage_rows.size() x stage_columns[w] in dtype,
  // row major; empty without a stage. stage_rows: the local rows they hold, in order (Stage::gradient_rows: all of
  // them, or under sequence parallelism the rank's token shard).
  std::vector<std::vector<std::byte>> stage_grads;
  std::vector<std::int64_t> stage_columns;
  std::vector<std::int64_t> stage_rows;
  // Its parameter gradients (Stage::parameters), each the rank's shard (Stage::parameter_shape) in dtype, row major.
  std::vector<std::vector<std::byte>> stage_params;
  bool has_reduced_loss = false;  // false for reduction "none"
  float reduced_loss = 0.0f;      // the logged loss
  std::int64_t logged_valid_tokens = 0;
  // The dtype a framework stored its losses in (check-dump): 16-bit losses are judged in units of their
  // spacing, as 16-bit gradients are. fp32 stands for float32 and wider.
  DType token_loss_dtype = DType::fp32;
  DType reduced_loss_dtype = DType::fp32;
  // The precision the logged loss carries when the dump declares one (a bf16 loss logged with .item()).
  std::optional<DType> reduced_loss_precision;
  double generate_seconds = 0.0;
  double compute_seconds = 0.0;
  double collective_seconds = 0.0;
  // Set instead of `grad` when the CUDA backend left the shard on the GPU for the GPU float64 reference.
  std::shared_ptr<cuda::DeviceShard> device_shard;

  std::int64_t rows() const { return static_cast<std::int64_t>(assignment.rows.size()); }
  std::int64_t columns() const { return assignment.vocab.size(); }
  std::int64_t token_of(std::int64_t row) const { return assignment.rows[static_cast<std::size_t>(row)].token; }
  // Gradient element of local row `row`, global column `column`, widened to double.
  double grad_at(std::int64_t row, std::int64_t column) const;
  // The whole local gradient row, widened to double (columns() values).
  void grad_row(std::int64_t row, double* out) const;
};

}  // namespace lossverify
