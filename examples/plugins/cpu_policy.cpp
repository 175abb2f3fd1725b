// Example lossverify plugin, host memory: the RL policy loss of one rank (docs/spec.md §3.3, the math of
// lv_policy_config in include/lossverify/plugin.h), part of the example CPU plugin library.
//
// The step's side, once per rank, over DP x CP as a trainer computes it: the valid tokens N, each sequence's
// valid tokens n_s (all its CP chunks) and B, the sequences that have any, for the aggregation weights; the
// advantages' mean and unbiased deviation for whitening.
// Per micro-batch and row, with u = x / T: M = all-reduce max over TP of the local maxima, then one packed
// all-reduce sum over TP of S = sum e^(u - M), E = sum e^(u - M) (u - M) and u_y - M (the label's owner gives
// it): lambda = (u_y - M) - log S and H = log S - E / S, the entropy in its shifted form. The gradient of the
// local columns needs no further communication: dl/du_v = g ([v = y] - p_v) + c_H p_v (log p_v + H), with g the
// objective's slope in lambda, times 1/T and the row's weight in the back-propagated objective.
// Under ratio sequence (GSPO), two more all-reduces over the CP group per micro-batch, one value per sequence of the
// step: [sum (lambda - old) | n_s] for rho_s, then Q_s = sum w_t (-A_t) over tokens whose unclipped term is taken,
// for the true derivative dL/dlambda_u = rho_s Q_s / n_s (a sequence's chunks lie in one micro-batch of its CP group).
#include "cpu_policy.hpp"

#include "cpu_elements.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace lossverify_example {

namespace {

using namespace cpu;

// One token's objective, in float32 like the rest of the kernel.
struct PolicyTerms {
  float surrogate = 0.0f;
  float surrogate_slope = 0.0f;  // d surrogate / d lambda
  float kl = 0.0f;
  float kl_slope = 0.0f;  // d KL / d lambda
  bool clipped = false;
  bool dual_clipped = false;
};

// rho = exp(log_ratio) (the token's lambda - old, or its sequence's mean); surrogate = max(-rho A, -clip(rho) A),
// capped at -c A for A < 0; the KL estimators of d = lambda - ref. Under objective logprob: -lambda.
PolicyTerms policy_terms(float logprob, float log_ratio, float ref_logprob, float advantage,
                         const lv_policy_config& p) {
  PolicyTerms t;
  if (p.objective == LV_POLICY_OBJECTIVE_LOGPROB) {
    t.surrogate = -logprob;
    t.surrogate_slope = -1.0f;
    return t;
  }
  const float ratio = std::exp(log_ratio);
  const float low = 1.0f - static_cast<float>(p.clip_low);
  const float high = 1.0f + static_cast<float>(p.clip_high);
  const float unclipped = -ratio * advantage;
  const float clipped = -std::clamp(ratio, low, high) * advantage;
  t.clipped = clipped > unclipped;
  t.surrogate = t.clipped ? clipped : unclipped;
  t.surrogate_slope = t.clipped ? 0.0f : unclipped;  // d(-rho A)/d lambda = -rho A
  const auto dual_clip = static_cast<float>(p.dual_clip);
  if (dual_clip > 0.0f && advantage < 0.0f && t.surrogate > -dual_clip * advantage) {
    t.dual_clipped = true;
    t.surrogate = -dual_clip * advantage;
    t.surrogate_slope = 0.0f;
  }
  const float d = logprob - ref_logprob;
  switch (p.kl_penalty) {
    case LV_KL_K1:
      t.kl = d;
      t.kl_slope = 1.0f;
      break;
    case LV_KL_K2:
      t.kl = 0.5f * d * d;
      t.kl_slope = d;
      break;
    case LV_KL_K3:
      t.kl = std::exp(-d) + d - 1.0f;
      t.kl_slope = 1.0f - std::exp(-d);
      break;
    case LV_KL_NONE:
      break;
  }
  return t;
}

// ---- The step -----------------------------------------------------------------------------------

struct PolicyPlan {
  BatchPlan batch;                // valid rows, their weights in L and in the backward pass, N
  std::vector<float> advantages;  // per row, whitened where the config says so
};

// Each row's weight in L under the aggregation (token-mean 1/N, token-sum 1, seq-mean-token-sum 1/B,
// seq-mean-token-mean 1/(B n_s), seq-mean-token-sum-norm 1/(B H_max)), from counts over DP x CP.
PolicyPlan plan_policy(const lv_rank_inputs& in, const Collectives& comm) {
  const lv_policy_config& p = in.policy;
  PolicyPlan plan;
  plan.batch.rows.resize(static_cast<std::size_t>(in.rows));
  std::vector<std::int64_t> per_sequence(static_cast<std::size_t>(in.num_sequences), 0);
  const HostRows host{in.labels, in.loss_mask, in.upstream_weights};
  for (std::int64_t i = 0; i < in.rows; ++i) {
    RowPlan& row = plan.batch.rows[static_cast<std::size_t>(i)];
    row.valid = row_is_valid(in, host, i);
    if (in.sequences[i] < 0 || in.sequences[i] >= in.num_sequences) {
      throw std::invalid_argument("row " + std::to_string(i) + " of sequence " + std::to_string(in.sequences[i]) +
                                  ", outside [0, num_sequences)");
    }
    if (row.valid) ++per_sequence[static_cast<std::size_t>(in.sequences[i])];
  }
  allreduce(comm, LV_GROUP_DP_CP, per_sequence, LV_REDUCE_SUM);
  std::int64_t tokens = 0, sequences = 0;
  for (const std::int64_t n : per_sequence) {
    tokens += n;
    sequences += n > 0 ? 1 : 0;
  }
  plan.batch.valid_tokens = tokens;

  const double factor = framework_factor(in);
  for (std::int64_t i = 0; i < in.rows; ++i) {
    RowPlan& row = plan.batch.rows[static_cast<std::size_t>(i)];
    if (!row.valid) continue;
    const auto n_s = static_cast<double>(per_sequence[static_cast<std::size_t>(in.sequences[i])]);
    const auto b = static_cast<double>(sequences);
    double weight = 1.0;  // token-sum
    switch (p.aggregation) {
      case LV_AGGREGATION_TOKEN_MEAN:
        weight = 1.0 / static_cast<double>(tokens);
        break;
      case LV_AGGREGATION_TOKEN_SUM:
        break;
      case LV_AGGREGATION_SEQ_MEAN_TOKEN_SUM:
        weight = 1.0 / b;
        break;
      case LV_AGGREGATION_SEQ_MEAN_TOKEN_MEAN:
        weight = 1.0 / (b * n_s);
        break;
      case LV_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM:
        weight = 1.0 / (b * p.norm_constant);
        break;
    }
    row.forward_weight = static_cast<float>(weight);
    row.backward_weight = static_cast<float>(weight / factor);
  }

  // Whitening over the step's valid tokens (DP x CP), with the unbiased deviation.
  plan.advantages.assign(in.advantages, in.advantages + in.rows);
  if (p.objective != LV_POLICY_OBJECTIVE_LOSS || p.whiten_advantages == 0) return plan;
  std::vector<double> moments(3, 0.0);  // n, sum A, sum A^2
  for (std::int64_t i = 0; i < in.rows; ++i) {
    if (!plan.batch.rows[static_cast<std::size_t>(i)].valid) continue;
    const double a = in.advantages[i];
    moments[0] += 1.0;
    moments[1] += a;
    moments[2] += a * a;
  }
  allreduce(comm, LV_GROUP_DP_CP, moments, LV_REDUCE_SUM);
  const double n = std::max(moments[0], 1.0);
  const double mean = moments[1] / n;
  const double variance = n > 1.0 ? std::max(moments[2] - n * mean * mean, 0.0) / (n - 1.0) : 0.0;
  const auto mean_f = static_cast<float>(mean);
  const float scale = 1.0f / (static_cast<float>(std::sqrt(variance)) + static_cast<float>(p.whiten_epsilon));
  for (std::int64_t i = 0; i < in.rows; ++i) {
    float& a = plan.advantages[static_cast<std::size_t>(i)];
    a = plan.batch.rows[static_cast<std::size_t>(i)].valid ? (a - mean_f) * scale : 0.0f;
  }
  return plan;
}

// ---- One micro-batch ----------------------------------------------------------------------------

// Per row after the collectives: M, log S, lambda and H.
struct PolicyRow {
  float max = kNegInf;
  float log_sum = 0.0f;
  float logprob = 0.0f;
  float entropy = 0.0f;
};

template <class T>
std::vector<PolicyRow> policy_rows(const lv_rank_inputs& in, Matrix<T> logits, RowRange range, const BatchPlan& plan,
                                   float inverse_t, const Collectives& comm) {
  const auto n = static_cast<std::size_t>(range.size());
  auto counts = [&](std::size_t i) { return plan.rows[static_cast<std::size_t>(range.begin) + i].valid; };
  auto u_of = [&](std::int64_t row, std::int64_t v) { return widen(logits.row(row)[v]) * inverse_t; };

  std::vector<float> maxima(n, kNegInf);
  for (std::size_t i = 0; i < n; ++i) {
    if (!counts(i)) continue;
    const std::int64_t row = range.begin + static_cast<std::int64_t>(i);
    for (std::int64_t v = 0; v < logits.width; ++v) maxima[i] = std::fmax(maxima[i], u_of(row, v));
  }
  allreduce(comm, LV_GROUP_TP, maxima, LV_REDUCE_MAX);

  std::vector<float> packed(3 * n, 0.0f);  // [S | E | u_y - M]
  for (std::size_t i = 0; i < n; ++i) {
    if (!counts(i)) continue;
    const std::int64_t row = range.begin + static_cast<std::int64_t>(i);
    CompensatedSum sum_exp, sum_exp_u;
    for (std::int64_t v = 0; v < logits.width; ++v) {
      const float u = u_of(row, v) - maxima[i];
      const float e = std::exp(u);
      sum_exp.add(e);
      sum_exp_u.add(e * u);
    }
    packed[i] = sum_exp.value();
    packed[n + i] = sum_exp_u.value();
    const std::int64_t target = in.labels[row] - in.vocab_begin;
    if (target >= 0 && target < logits.width) packed[2 * n + i] = u_of(row, target) - maxima[i];
  }
  allreduce(comm, LV_GROUP_TP, packed, LV_REDUCE_SUM);

  std::vector<PolicyRow> rows(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (!counts(i)) continue;
    const float log_sum = std::log(packed[i]);
    rows[i] = {maxima[i], log_sum, packed[2 * n + i] - log_sum, log_sum - packed[n + i] / packed[i]};
  }
  return rows;
}

// GSPO's sequence-level ratio, per sequence of the step: log rho_s (the mean of lambda - old over its valid
// tokens), n_s, and Q_s = sum over them of w_t (-A_t) where t's unclipped term is the one taken (its slope in
// rho), each summed over the CP group, which holds the sequence's other chunks. The sums accumulate in double:
// a float accumulator over thousands of equal summands (a sequence's advantage) drifts by 1e-5 and more.
struct SequenceRatios {
  std::vector<float> log_ratio;
  std::vector<double> tokens, slope_sum;
};

SequenceRatios sequence_ratios(const lv_rank_inputs& in, RowRange range, const PolicyPlan& plan,
                               const std::vector<PolicyRow>& rows, const PolicyBugs& bugs, const Collectives& comm) {
  const auto b = static_cast<std::size_t>(in.num_sequences);
  // rl-gspo-cp-local-ratio: each CP rank's ratio from its own chunks only.
  auto over_cp = [&](std::vector<double>& v) {
    if (!bugs.gspo_cp_local_ratio) allreduce(comm, LV_GROUP_CP, v, LV_REDUCE_SUM);
  };
  auto valid = [&](std::int64_t row) { return plan.batch.rows[static_cast<std::size_t>(row)].valid; };
  auto sequence = [&](std::int64_t row) { return static_cast<std::size_t>(in.sequences[row]); };
  std::vector<double> sums(2 * b, 0.0);  // [sum (lambda - old) | valid tokens]
  for (std::int64_t row = range.begin; row < range.end; ++row) {
    if (!valid(row)) continue;
    sums[sequence(row)] += rows[static_cast<std::size_t>(row - range.begin)].logprob - in.old_logprob[row];
    sums[b + sequence(row)] += 1.0;
  }
  over_cp(sums);
  SequenceRatios s{std::vector<float>(b, 0.0f),
                   std::vector<double>(sums.begin() + static_cast<std::ptrdiff_t>(b), sums.end()),
                   std::vector<double>(b, 0.0)};
  for (std::size_t k = 0; k < b; ++k) {
    if (s.tokens[k] > 0.0) s.log_ratio[k] = static_cast<float>(sums[k] / s.tokens[k]);
  }
  for (std::int64_t row = range.begin; row < range.end; ++row) {
    if (!valid(row)) continue;
    const float advantage = plan.advantages[static_cast<std::size_t>(row)];
    const PolicyTerms t = policy_terms(rows[static_cast<std::size_t>(row - range.begin)].logprob,
                                       s.log_ratio[sequence(row)], in.ref_logprob[row], advantage, in.policy);
    if (!t.clipped && !t.dual_clipped) {
      s.slope_sum[sequence(row)] += plan.batch.rows[static_cast<std::size_t>(row)].backward_weight * -advantage;
    }
  }
  over_cp(s.slope_sum);
  return s;
}

// The rank's share of the logged statistics, sum over its valid rows of s_t / N (LV_POLICY_STAT_* order).
using Statistics = std::vector<double>;

template <class T>
void policy_micro_batch(const lv_rank_inputs& in, lv_rank_outputs& out, RowRange range, const PolicyPlan& plan,
                        const PolicyBugs& bugs, Statistics& statistics, const Collectives& comm) {
  const lv_policy_config& p = in.policy;
  const std::int64_t width = in.vocab_end - in.vocab_begin;
  const Matrix<T> logits{static_cast<const T*>(in.logits), width};
  // rl-temperature-one-side: the policy's log-probabilities at T = 1 while the rollout's were taken at T.
  const float inverse_t = bugs.temperature_one_side ? 1.0f : static_cast<float>(1.0 / p.temperature);
  const std::vector<PolicyRow> rows = policy_rows(in, logits, range, plan.batch, inverse_t, comm);
  const bool by_sequence = in.policy_ratio == LV_POLICY_RATIO_SEQUENCE && p.objective == LV_POLICY_OBJECTIVE_LOSS;
  const SequenceRatios sequences = by_sequence ? sequence_ratios(in, range, plan, rows, bugs, comm) : SequenceRatios{};
  const auto kl_coef = static_cast<float>(p.kl_coef);
  const auto entropy_coef = static_cast<float>(p.entropy_coef);
  const double inverse_n = 1.0 / static_cast<double>(std::max<std::int64_t>(plan.batch.valid_tokens, 1));
  T* grad = static_cast<T*>(out.grad);
  for (std::int64_t i = 0; i < range.size(); ++i) {
    const std::int64_t row = range.begin + i;
    const RowPlan& row_plan = plan.batch.rows[static_cast<std::size_t>(row)];
    if (!row_plan.valid) continue;
    const PolicyRow& r = rows[static_cast<std::size_t>(i)];
    const std::size_t k = static_cast<std::size_t>(in.sequences[row]);
    const float log_ratio = by_sequence ? sequences.log_ratio[k] : r.logprob - in.old_logprob[row];
    PolicyTerms t =
        policy_terms(r.logprob, log_ratio, in.ref_logprob[row], plan.advantages[static_cast<std::size_t>(row)], p);
    if (by_sequence) {  // d L / d lambda_u = rho_s Q_s / n_s, per unit of the row's backward weight
      const float w = row_plan.backward_weight;
      t.surrogate_slope =
          w != 0.0f ? static_cast<float>(std::exp(log_ratio) * sequences.slope_sum[k] / (sequences.tokens[k] * w))
                    : 0.0f;
    }
    out.token_loss[row] = t.surrogate + kl_coef * t.kl - entropy_coef * r.entropy;
    out.token_values[row * LV_POLICY_VALUES + LV_POLICY_VALUE_LOGPROB] = r.logprob;
    out.token_values[row * LV_POLICY_VALUES + LV_POLICY_VALUE_ENTROPY] = r.entropy;
    statistics[LV_POLICY_STAT_CLIP_FRACTION] += (t.clipped ? 1.0 : 0.0) * inverse_n;
    statistics[LV_POLICY_STAT_DUAL_CLIP_FRACTION] += (t.dual_clipped ? 1.0 : 0.0) * inverse_n;
    statistics[LV_POLICY_STAT_KL] += static_cast<double>(t.kl) * inverse_n;
    statistics[LV_POLICY_STAT_ENTROPY] += static_cast<double>(r.entropy) * inverse_n;

    // rl-kl-no-grad: the KL term computed without gradient.
    const float slope = t.surrogate_slope + (bugs.kl_no_grad ? 0.0f : kl_coef * t.kl_slope);
    const float scale = row_plan.backward_weight * inverse_t;
    const std::int64_t target = in.labels[row] - in.vocab_begin;
    const T* x = logits.row(row);
    for (std::int64_t v = 0; v < width; ++v) {
      const float log_p = (widen(x[v]) * inverse_t - r.max) - r.log_sum;
      const float prob = std::exp(log_p);
      const float value = slope * ((v == target ? 1.0f : 0.0f) - prob) + entropy_coef * prob * (log_p + r.entropy);
      grad[row * width + v] = narrow<T>(scale * value);
    }
  }
}

template <class T>
void run_policy_typed(const lv_rank_inputs& in, lv_rank_outputs& out, const PolicyBugs& bugs, const Collectives& comm) {
  const PolicyPlan plan = plan_policy(in, comm);
  zero_rows_that_do_not_count<T>(plan.batch, out, in.vocab_end - in.vocab_begin);
  Statistics statistics(LV_POLICY_STATS, 0.0);
  for (std::int32_t k = 0; k < in.ga; ++k) {
    const RowRange range{in.micro_batch_begin[k], in.micro_batch_begin[k + 1]};
    if (range.size() == 0) continue;  // the TP peers, holding the same rows, skip it too
    policy_micro_batch<T>(in, out, range, plan, bugs, statistics, comm);
  }
  allreduce(comm, LV_GROUP_DP_CP, statistics, LV_REDUCE_SUM);
  std::copy(statistics.begin(), statistics.end(), out.logged_statistics);
  out.logged_statistics_count = LV_POLICY_STATS;
  out.token_value_rows = in.rows;
  out.token_value_columns = LV_POLICY_VALUES;
  out.grad_rows = in.rows;
  out.grad_columns = in.vocab_end - in.vocab_begin;
  out.token_loss_count = in.rows;
  out.logged_num_tokens = plan.batch.valid_tokens;
  out.has_logged_loss = 1;
  auto sum_over_dp_cp = [&comm](float value) {
    comm.allreduce(LV_GROUP_DP_CP, &value, 1, LV_REDUCE_SUM);
    return value;
  };
  out.logged_loss = logged_loss(plan.batch, out.token_loss, sum_over_dp_cp);
}

}  // namespace

void run_policy(const lv_rank_inputs& in, lv_rank_outputs& out, const PolicyBugs& bugs, const Collectives& comm) {
  if (in.sequences == nullptr || in.old_logprob == nullptr || in.ref_logprob == nullptr || in.advantages == nullptr ||
      out.token_values == nullptr) {
    throw std::invalid_argument("policy loss without its per-row inputs or token_values");
  }
  if (!(in.policy.temperature > 0.0)) throw std::invalid_argument("policy loss with temperature <= 0");
  switch (in.dtype) {
    case LV_DTYPE_F32:
      return run_policy_typed<float>(in, out, bugs, comm);
    case LV_DTYPE_BF16:
      return run_policy_typed<Bf16>(in, out, bugs, comm);
    case LV_DTYPE_F16:
      return run_policy_typed<Fp16>(in, out, bugs, comm);
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<int>(in.dtype)));
}

}  // namespace lossverify_example
