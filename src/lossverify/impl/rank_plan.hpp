#pragma once
// The framework side of one rank, shared by the CPU and CUDA kernels: the labels and masks of its rows
// (the label step, next-token labels and their catalogued mistakes), the valid-token counts over the
// batch group, and each row's weight in the logged objective and in the backward pass under the
// framework model (grad_reduce, ga_reduce) and the catalogued reduction bugs.
#include <cstdint>
#include <optional>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/communicator.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/cpu/sharded_loss.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

// Per local row, decided before the loss kernel runs.
struct RowPlan {
  std::int64_t label = -1;    // global label (cross-entropy), or the ignore index
  bool valid = false;         // counts in the loss
  bool active = false;        // gets a loss and gradient computed (valid, or ignored under zloss-on-ignored)
  float forward_weight = 0;   // weight of the token's loss in the logged objective
  float backward_weight = 0;  // scale of the local gradient
};

class RankPlan {
 public:
  // Collective over groups.batch (and groups.dp): the valid-token counts are all-reduced.
  RankPlan(const Case& c, const InputSource& inputs, const RankAssignment& assignment, RankGroups& groups,
           const BugSwitches& bugs);

  const RowPlan& row(std::int64_t i) const { return rows_[static_cast<std::size_t>(i)]; }
  const std::vector<RowPlan>& rows() const { return rows_; }
  std::int64_t logged_valid_tokens() const { return logged_valid_tokens_; }
  // What the case's kind planned for these rows (kinds/loss_kind.hpp).
  const KindRowPlan& kind_plan() const { return kind_plan_; }
  // The logged loss sum_t forward_weight * l_t over groups.batch (collective; over groups.dp under
  // cp-loss-stat-dp-only); none for reduction none.
  std::optional<float> logged_loss(const RankOutput& out, RankGroups& groups) const;

 private:
  bool labelled() const;  // the case's kind reads labels
  void plan_labels(const RankAssignment& assignment);
  std::int64_t label_with_cp_padding(const RankAssignment& assignment, const LocalRow& row,
                                     std::int64_t local_index) const;
  void plan_weights(const RankAssignment& assignment, RankGroups& groups);

  const Case& case_;
  const InputSource& inputs_;
  const BugSwitches& bugs_;
  std::vector<RowPlan> rows_;
  std::int64_t logged_valid_tokens_ = 0;
  std::int64_t slice_valid_tokens_ = 0;  // cp-loss-stat-dp-only: this CP rank's valid tokens over DP
  KindRowPlan kind_plan_;
};

}  // namespace lossverify
