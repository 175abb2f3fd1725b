#pragma once
// Cross-entropy's collective protocol (docs/spec.md §5), written once for every backend. A backend
// supplies what only it can compute over its own columns of one micro-batch of rows (row maxima, shifted
// sums, the gradient); the protocol does the collectives on per-row statistics over the TP group, applies
// the catalogued forward switches and writes each row's loss. Rows the plan leaves inactive are skipped
// by both sides. All spans hold one value per row of the micro-batch (or a packed multiple, as named).
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_math.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"

namespace lossverify {

// Cross-entropy: M = allreduce_max(local max); one packed allreduce_sum of [S | x_l - M | sum(x - M)];
// the loss from the sums; the gradient of the local columns from p = exp(x - M - log S).
class CrossEntropyShard {
 public:
  virtual ~CrossEntropyShard() = default;
  // Whole rows (a TP group of one) may take a single pass: the statistics of every row with M its max,
  // S its sum exp(x - M) as log S, and the gradient computed alongside. False when the shard does not.
  virtual bool fused_pass(std::span<float> max, std::span<float> log_sum, std::span<float> target_shifted,
                          std::span<float> sum_shifted) {
    (void)max, (void)log_sum, (void)target_shifted, (void)sum_shifted;
    return false;
  }
  // Each row's max over the shard's (softcapped) logits.
  virtual void local_max(std::span<float> max) = 0;
  // Given each row's M (global, or 0 under no-max-shift): S = sum exp(x - M), x_target - M (where the
  // target column is in the shard, else left 0) and sum(x - M) (left alone without label smoothing).
  virtual void shifted_sums(std::span<const float> max, std::span<float> sum_exp, std::span<float> target_shifted,
                            std::span<float> sum_shifted) = 0;
  // smoothing-log-after-exp: sum over the shard of log(exp(x - M) / S).
  virtual void sum_log_p(std::span<const float> max, std::span<const float> sum_exp, std::span<float> out) = 0;
  // The gradient of the shard's columns from M and log S (a fused pass has written it already).
  virtual void gradient(std::span<const float> max, std::span<const float> log_sum) = 0;
};

// Target distributions of the forward and the backward, as the switches make them.
struct SmoothingPair {
  SmoothingWeights<float> forward;
  SmoothingWeights<float> backward;
};
inline SmoothingPair smoothing_for(const Case& c, const BugSwitches& bugs, float shard_width) {
  const auto alpha = static_cast<float>(cross_entropy_options(c.loss).label_smoothing);
  const SmoothingConvention convention =
      bugs.smoothing_convention_swap
          ? (cross_entropy_options(c.loss).convention == SmoothingConvention::pytorch ? SmoothingConvention::megatron
                                                                                      : SmoothingConvention::pytorch)
          : cross_entropy_options(c.loss).convention;
  const auto vocab = static_cast<float>(c.shape.vocab);
  return {smoothing_weights(alpha, convention, bugs.smoothing_vocab_local_forward ? shard_width : vocab),
          smoothing_weights(alpha, convention, bugs.smoothing_vocab_local_backward ? shard_width : vocab)};
}

// l for one row: log_sum = log S, target_shifted = x_l - M, smoothing_sum the sum(x - M) the forward uses,
// local_sum_shifted this rank's own sum(x - M) (for smoothing-local-sum).
inline float cross_entropy_row_loss(const RowPlan& p, float row_max, float log_sum, float target_shifted,
                                    float smoothing_sum, float local_sum_shifted, float shard_width,
                                    SmoothingWeights<float> q, float z_weight, const BugSwitches& bugs) {
  const float lse = row_max + log_sum;
  if (!p.valid) return z_weight * lse * lse;  // reached only under zloss-on-ignored
  if (bugs.smoothing_raw_local_sum) {
    const float local_raw_sum = local_sum_shifted + shard_width * row_max;
    return lse - (q.off_target * local_raw_sum + (q.on_target - q.off_target) * (target_shifted + row_max)) +
           z_weight * lse * lse;
  }
  return cross_entropy_from_sums(log_sum, target_shifted, smoothing_sum, q, z_weight, lse);
}

// One micro-batch, rows [begin, begin + n) of the rank: collective over groups.tp. `shard_width` is the
// number of columns the shard's kernels see. Writes token_loss[begin + i] of every active row.
void cross_entropy_protocol(const Case& c, const BugSwitches& bugs, const RankPlan& plan, RankGroups& groups,
                            std::int64_t begin, std::int64_t n, std::int64_t shard_width, CrossEntropyShard& shard,
                            std::vector<float>& token_loss);

}  // namespace lossverify
