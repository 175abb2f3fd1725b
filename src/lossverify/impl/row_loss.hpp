#pragma once
// The host-side forward of one cross-entropy row from its all-reduced sums, with the catalogued forward
// switches: shared by the CPU kernel and the CUDA backend (whose kernels return the same sums).
#include "lossverify/case/case.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/math/cross_entropy_math.hpp"

namespace lossverify {

// Target distributions of the forward and the backward, as the switches make them.
struct SmoothingPair {
  SmoothingWeights<float> forward;
  SmoothingWeights<float> backward;
};
inline SmoothingPair smoothing_for(const Case& c, const BugSwitches& bugs, float shard_width) {
  const auto alpha = static_cast<float>(c.loss.label_smoothing);
  const SmoothingConvention convention =
      bugs.smoothing_convention_swap ? (c.loss.convention == SmoothingConvention::pytorch ? SmoothingConvention::megatron
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

}  // namespace lossverify
