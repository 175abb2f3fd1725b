#pragma once
// KD's collective protocol (docs/spec.md §5), written once for every backend: the backend computes over its
// own columns of one micro-batch, the protocol does the collectives over the TP group, applies the
// catalogued switches and writes each row's loss.
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kinds/kd/kd_math.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"

namespace lossverify {

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

// KD's T^s on the loss and T^(s-1) on the gradient, with the T^2 bugs, and the gradient times TP under
// kd-tp-grad-sum (`tp` is the layout's TP degree).
struct KdScales {
  float loss;
  float grad;
};
inline KdScales kd_scales(const LossSpec& loss, const BugSwitches& bugs, int tp) {
  int power = kd_options(loss).t2_scaling ? 2 : 0;
  if (kd_options(loss).t2_scaling && bugs.kd_no_t2) power = 0;
  if (kd_options(loss).t2_scaling && bugs.kd_double_t2) power = 4;
  const double grad_factor = bugs.kd_tp_grad_sum ? tp : 1;
  return {static_cast<float>(std::pow(kd_options(loss).temperature, power)),
          static_cast<float>(grad_factor * std::pow(kd_options(loss).temperature, power - 1))};
}

// KD's per-row value from the all-reduced sums [S_a, S_b, W (, U)] and maxima: KL(P || Q), or the shard's
// own KL summed over TP (kd-local-softmax, passed in), or H(P, Q) = lse_a - sum_v P_v a_v
// (kd-cross-entropy-value). Unscaled by T^s.
inline float kd_row_value(float sum_exp_student, float sum_exp_teacher, float weighted_gap, float shifted_cross,
                          float max_student, float max_teacher, float local_divergence, const BugSwitches& bugs) {
  if (bugs.kd_cross_entropy_value) {
    return std::log(sum_exp_student) - shifted_cross / sum_exp_teacher;
  }
  if (bugs.kd_local_softmax) return local_divergence;
  return kl_from_sums(sum_exp_student, sum_exp_teacher, weighted_gap, max_student, max_teacher);
}

// One micro-batch, rows [begin, begin + n) of the rank: collective over groups.tp. Writes
// token_loss[begin + i] of every active row.
void kd_protocol(const Case& c, const BugSwitches& bugs, const RankPlan& plan, RankGroups& groups, std::int64_t begin,
                 std::int64_t n, KdShard& shard, std::vector<float>& token_loss);

}  // namespace lossverify
