#pragma once
// Per-element cross-entropy math of docs/spec.md §3, written once for the CPU and CUDA kernels.
// Real is float in the sharded implementations. The float64 reference does not use this file: it is
// written from the definitions on its own (reference/), so a shared mistake cannot hide itself.
#include "lossverify/core/host_device.hpp"
#include "lossverify/kinds/cross_entropy/smoothing_convention.hpp"

namespace lossverify {

// Target distribution q: q_v = on_target for v = label, off_target otherwise.
//   pytorch:  q_v = (1 - a) [v = l] + a / V
//   megatron: q_v = (1 - a) [v = l] + a / (V - 1) [v != l]
template <class Real>
struct SmoothingWeights {
  Real on_target;
  Real off_target;
};

template <class Real>
LV_HOST_DEVICE SmoothingWeights<Real> smoothing_weights(Real alpha, SmoothingConvention convention, Real vocab) {
  if (convention == SmoothingConvention::megatron) {
    return {Real(1) - alpha, alpha / (vocab - Real(1))};
  }
  return {Real(1) - alpha + alpha / vocab, alpha / vocab};
}

// Token loss from max-shifted sums, never taking log(p):
//   log_sum = log sum_v exp(x_v - M),  target_shifted = x_l - M,  sum_shifted = sum_v (x_v - M)
//   l = lse - sum_v q_v x_v + w_z lse^2 = log_sum - [q_off sum_shifted + (q_on - q_off) target_shifted] + w_z lse^2
// (sum_v q_v = 1, so the shift M cancels.)
template <class Real>
LV_HOST_DEVICE Real cross_entropy_from_sums(Real log_sum, Real target_shifted, Real sum_shifted,
                                            SmoothingWeights<Real> q, Real z_loss_weight, Real lse) {
  const Real smoothing_term = q.off_target * sum_shifted + (q.on_target - q.off_target) * target_shifted;
  return log_sum - smoothing_term + z_loss_weight * lse * lse;
}

// d l / d x_v = p_v (1 + 2 w_z lse) - q_v. z_factor = 1 + 2 w_z lse.
template <class Real>
LV_HOST_DEVICE Real cross_entropy_grad(Real probability, bool is_target, SmoothingWeights<Real> q, Real z_factor) {
  return probability * z_factor - (is_target ? q.on_target : q.off_target);
}

}  // namespace lossverify
