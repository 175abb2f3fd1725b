#pragma once
// The policy kind's settings (docs/spec.md §3.3): the clipped surrogate, the KL penalty, the entropy
// bonus, the temperature, advantage whitening and how tokens are aggregated over the step.
#include <string_view>

#include "lossverify/case/case.hpp"

namespace lossverify {

struct PolicyOptions final : KindOptions {
  enum class Objective { policy_loss, logprob };
  enum class Kl { none, k1, k2, k3 };
  enum class Aggregation { token_mean, token_sum, seq_mean_token_sum, seq_mean_token_mean, seq_mean_token_sum_norm };
  enum class Ratio { token, sequence };

  Objective objective = Objective::policy_loss;  // logprob: l = -lambda - c_H H (a trainer's log-prob pass)
  double temperature = 1.0;
  double clip_low = 0.2;       // epsilon_low, in (0, 1)
  double clip_high = 0.2;      // epsilon_high, > 0
  double dual_clip = 0.0;      // c > 1; 0: off
  Ratio ratio = Ratio::token;  // sequence: GSPO's rho_s = exp(mean over the sequence's valid tokens of lambda - old)
  Kl kl = Kl::none;
  double kl_coef = 0.0;       // beta
  double entropy_coef = 0.0;  // c_H
  Aggregation aggregation = Aggregation::token_mean;
  double norm_constant = 0.0;  // H_max of seq-mean-token-sum-norm
  bool whiten_advantages = false;
  double whiten_epsilon = 1e-6;  // delta in (A - mu) / (sigma + delta)

  bool sequence_mean() const { return aggregation != Aggregation::token_mean && aggregation != Aggregation::token_sum; }
};

// The case's policy settings (the case's kind is policy).
const PolicyOptions& policy_options(const LossSpec& loss);
PolicyOptions& edit_policy_options(LossSpec& loss);

std::string_view to_string(PolicyOptions::Objective);
std::string_view to_string(PolicyOptions::Kl);
std::string_view to_string(PolicyOptions::Aggregation);
std::string_view to_string(PolicyOptions::Ratio);

}  // namespace lossverify
