#pragma once
// The host-side forward of one cross-entropy row from its all-reduced sums, with the catalogued forward
// switches: shared by the CPU kernel and the CUDA backend (whose kernels return the same sums).
#include "lossverify/case/case.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/math/cross_entropy_math.hpp"
#include "lossverify/math/kd_math.hpp"

#include <cmath>

namespace lossverify {

// Target distributions of the forward and the backward, as the switches make them.
struct SmoothingPair {
  SmoothingWeights<float> forward;
  SmoothingWeights<float> backward;
};
inline SmoothingPair smoothing_for(const Case& c, const BugSwitches& bugs, float shard_width) {
  const auto alpha = static_cast<float>(c.loss.label_smoothing);
  const SmoothingConvention convention =
      bugs.smoothing_convention_swap
          ? (c.loss.convention == SmoothingConvention::pytorch ? SmoothingConvention::megatron
                                                               : SmoothingConvention::pytorch)
          : c.loss.convention;
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

// KD's T^s on the loss and T^(s-1) on the gradient, with the T^2 bugs, and the gradient times TP under
// kd-tp-grad-sum (`tp` is the layout's TP degree).
struct KdScales {
  float loss;
  float grad;
};
inline KdScales kd_scales(const LossSpec& loss, const BugSwitches& bugs, int tp) {
  int power = loss.t2_scaling ? 2 : 0;
  if (loss.t2_scaling && bugs.kd_no_t2) power = 0;
  if (loss.t2_scaling && bugs.kd_double_t2) power = 4;
  const double grad_factor = bugs.kd_tp_grad_sum ? tp : 1;
  return {static_cast<float>(std::pow(loss.temperature, power)),
          static_cast<float>(grad_factor * std::pow(loss.temperature, power - 1))};
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

}  // namespace lossverify
