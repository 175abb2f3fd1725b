#pragma once
// The sharded loss's collective protocol (docs/spec.md §5), written once for every backend. A backend
// supplies what only it can compute over its own columns of one micro-batch of rows (row maxima, shifted
// sums, the gradient); the protocol does the collectives on per-row statistics over the TP group, applies
// the catalogued forward switches and writes each row's loss. Rows the plan leaves inactive are skipped
// by both sides. All spans hold one value per row of the micro-batch (or a packed multiple, as named).
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"

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

// KD: [M_a | M_b] in one allreduce_max; one packed allreduce_sum of [S_a | S_b | W (| U)]; KL without
// log P; the gradient T^(s-1) (Q - P) from the two lse.
class KdShard {
 public:
  virtual ~KdShard() = default;
  // [M_a | M_b]: the student's and the teacher's max over the shard (logits / T).
  virtual void local_maxima(std::span<float> maxima) = 0;
  // Given [M_a | M_b]: [S_a | S_b | W | U] with S = sum exp(z - M), W = sum exp(b - M_b)(b - a) and, for
  // kd-cross-entropy-value only (`packed` then holds 4 per row), U = sum exp(b - M_b)(a - M_a).
  virtual void shifted_sums(std::span<const float> maxima, std::span<float> packed) = 0;
  // The gradient weight * (Q - P) of the shard's columns (kd-untracked-allreduce's variant included).
  virtual void gradient(std::span<const float> lse_student, std::span<const float> lse_teacher,
                        std::span<const float> weight) = 0;
};

// One micro-batch, rows [begin, begin + n) of the rank: collective over groups.tp. `shard_width` is the
// number of columns the shard's kernels see. Writes token_loss[begin + i] of every active row.
void cross_entropy_protocol(const Case& c, const BugSwitches& bugs, const RankPlan& plan, RankGroups& groups,
                            std::int64_t begin, std::int64_t n, std::int64_t shard_width, CrossEntropyShard& shard,
                            std::vector<float>& token_loss);
void kd_protocol(const Case& c, const BugSwitches& bugs, const RankPlan& plan, RankGroups& groups, std::int64_t begin,
                 std::int64_t n, KdShard& shard, std::vector<float>& token_loss);

}  // namespace lossverify
