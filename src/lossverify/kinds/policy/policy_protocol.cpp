#include "lossverify/kinds/policy/policy_protocol.hpp"

#include <algorithm>
#include <cmath>

#include "lossverify/comm/rank_groups.hpp"
#include "lossverify/core/dtype.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/impl/rank_plan.hpp"
#include "lossverify/kinds/policy/policy_math.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"

namespace lossverify {

namespace {

PolicyCoefficients<float> coefficients(const PolicyOptions& o) {
  PolicyCoefficients<float> k;
  k.logprob_only = o.objective == PolicyOptions::Objective::logprob;
  k.clip_low = static_cast<float>(o.clip_low);
  k.clip_high = static_cast<float>(o.clip_high);
  k.dual_clip = static_cast<float>(o.dual_clip);
  k.kl = static_cast<int>(o.kl);
  k.kl_coef = static_cast<float>(o.kl_coef);
  k.entropy_coef = static_cast<float>(o.entropy_coef);
  return k;
}

// Columns a shard pads its width to a multiple of 1024 with (rl-fused-vocab-pad).
float pad_columns(std::int64_t width) { return static_cast<float>((1024 - width % 1024) % 1024); }

class Protocol {
 public:
  Protocol(const PolicyBatch& mb, PolicyShard& shard)
      : mb_(mb),
        shard_(shard),
        o_(policy_options(mb.c.loss)),
        k_(coefficients(o_)),
        // The 16-bit control computes the log-prob pass in the logits' dtype, as rl-logprob-16bit does; the
        // objective after it stays float32 (its other inputs are float32 and promote it).
        bugs_(mb.bugs.kind_switches | (mb.bugs.compute_in_input_dtype ? policy_bug::logprob_16bit : 0)),
        // rl-temperature-after-logprob: the pass at T = 1, its log-prob divided by T afterwards
        inverse_t_(has(policy_bug::temperature_one_side) || has(policy_bug::temperature_after_logprob)
                       ? 1.0f
                       : static_cast<float>(1.0 / o_.temperature)),
        logprob_scale_(has(policy_bug::temperature_after_logprob) ? static_cast<float>(1.0 / o_.temperature) : 1.0f),
        n_(static_cast<std::size_t>(mb.n)),
        dtype_(mb.c.inputs.dtype),
        rounded_(has(policy_bug::logprob_16bit) && dtype_ != DType::fp32),
        tempered16_(has(policy_bug::temperature_16bit) && dtype_ != DType::fp32 && inverse_t_ != 1.0f),
        local_(n_ * PolicyLocalStats::kFloats, 0.0f),
        max_(n_, -INFINITY),
        sums_(3 * n_, 0.0f),
        own_(2 * n_, 0.0f) {}

  void run() {
    // rl-temperature-16bit: every statistic, and the gradient's softmax, of x / T rounded to the logits' dtype.
    shard_.local_stats(inverse_t_, tempered16_, local_);
    reduce_stats(local_, max_, sums_, &own_);
    if (rounded_) {
      // rl-logprob-16bit: the same statistics of x / T rounded to the logits' dtype, for the log-prob and the
      // entropy; the gradient keeps the float32 ones.
      local16_.assign(n_ * PolicyLocalStats::kFloats, 0.0f);
      max16_.assign(n_, -INFINITY);
      sums16_.assign(3 * n_, 0.0f);
      shard_.local_stats(inverse_t_, true, local16_);
      reduce_stats(local16_, max16_, sums16_, nullptr);
    }
    if (sequence_ratio()) sequence_ratios();
    std::vector<float> grad_rows(n_ * PolicyGradRow::kFloats, 0.0f);
    for (std::size_t i = 0; i < n_; ++i) {
      if (!active(i)) continue;
      const PolicyGradRow g = evaluate(i);
      const float values[PolicyGradRow::kFloats] = {g.max,   g.log_sum, g.a,      g.bonus, g.c,
                                                    g.shift, g.scale,   g.target, g.argmax};
      std::copy(values, values + PolicyGradRow::kFloats,
                grad_rows.begin() + static_cast<std::ptrdiff_t>(i * PolicyGradRow::kFloats));
    }
    const PolicyGradRounding rounding = rounded_      ? PolicyGradRounding::logsoftmax16
                                        : tempered16_ ? PolicyGradRounding::tempered16
                                                      : PolicyGradRounding::none;
    shard_.gradient(inverse_t_, rounding, grad_rows);
  }

 private:
  bool has(std::uint64_t bug) const { return (bugs_ & bug) != 0; }
  const RowPlan& plan(std::size_t i) const { return mb_.plan.row(mb_.begin + static_cast<std::int64_t>(i)); }
  bool active(std::size_t i) const { return plan(i).active; }
  PolicyLocalStats local(std::size_t i) const { return local_of(local_, i); }
  static PolicyLocalStats local_of(const std::vector<float>& stats, std::size_t i) {
    const float* s = &stats[i * PolicyLocalStats::kFloats];
    return {s[0], s[1], s[2], s[3], s[4]};
  }
  // To the case's 16-bit dtype (round to nearest even), back in float32.
  float round16(float v) const { return static_cast<float>(round_to_dtype(static_cast<double>(v), dtype_)); }
  std::int64_t local_target(std::size_t i) const { return plan(i).label - mb_.work.begin; }
  bool owner(std::size_t i) const { return local_target(i) >= 0 && local_target(i) < mb_.work.size(); }

  // The group's maximum M, then each shard's sums relative to it, packed [S | E | x_y / T - M] and
  // all-reduced; under rl-fused-vocab-pad each shard's zero pad columns join the sums. own: this shard's
  // [S | E] alone.
  void reduce_stats(const std::vector<float>& local_stats, std::vector<float>& max, std::vector<float>& sums,
                    std::vector<float>* own) {
    for (std::size_t i = 0; i < n_; ++i) {
      if (active(i)) max[i] = local_of(local_stats, i).max;
    }
    if (mb_.groups.tp.size() > 1) mb_.groups.tp.allreduce_max(std::span<float>(max));
    const float pad = has(policy_bug::fused_vocab_pad) ? pad_columns(mb_.work.size()) : 0.0f;
    for (std::size_t i = 0; i < n_; ++i) {
      if (!active(i)) continue;
      const PolicyLocalStats s = local_of(local_stats, i);
      const float shift = s.max - max[i];  // <= 0
      const float f = std::exp(shift);
      float sum = s.sum_exp * f;
      float sum_u = f * (s.sum_exp_u + shift * s.sum_exp);
      if (pad > 0.0f) {
        const float e = std::exp(-max[i]);
        sum += pad * e;
        sum_u += pad * e * -max[i];
      }
      sums[i] = sum;
      sums[n_ + i] = sum_u;
      if (own != nullptr) {
        (*own)[i] = sum;
        (*own)[n_ + i] = sum_u;
      }
      if (owner(i)) sums[2 * n_ + i] = s.target + shift;
    }
    if (mb_.groups.tp.size() > 1) mb_.groups.tp.allreduce_sum(std::span<float>(sums));
  }

  bool sequence_ratio() const {
    return o_.ratio == PolicyOptions::Ratio::sequence && o_.objective == PolicyOptions::Objective::policy_loss;
  }
  float log_sum(std::size_t i) const { return std::log(sums_[i]); }
  // Under rl-logprob-16bit, log_softmax on 16-bit x / T: float32 inside, the output rounded,
  // round16((x_y - M) - log S) as torch's CUDA kernel computes it.
  float logprob(std::size_t i) const {
    if (rounded_) return logprob_scale_ * round16(sums16_[2 * n_ + i] - std::log(sums16_[i]));
    return logprob_scale_ * (sums_[2 * n_ + i] - log_sum(i));
  }
  // verl's and TRL's entropy_from_logits on 16-bit x / T: logsumexp(x) - sum(softmax(x) * x), each op's result
  // rounded (sum_v p_v x_v = M + E / S).
  float entropy16(std::size_t i) const {
    const float s = sums16_[i];
    const float lse = max16_[i] + std::log(s);
    return round16(round16(lse) - round16(max16_[i] + sums16_[n_ + i] / s));
  }
  const float* inputs(std::size_t i) const {
    const std::vector<float>& in = mb_.plan.kind_plan().row_inputs;
    return in.empty() ? nullptr : &in[(static_cast<std::size_t>(mb_.begin) + i) * kPolicyRowInputs];
  }
  std::size_t sequence(std::size_t i) const { return static_cast<std::size_t>(inputs(i)[3]); }

  // GSPO: each sequence's rho_s = e^(mean of lambda - old over its valid tokens), its chunks summed over the CP
  // group, then Q_s = sum_t w_t (-A_t) [the unclipped term active at t], so that every token u of the sequence
  // has d L / d lambda_u = rho_s Q_s / n_s, or g_lambda = rho_s Q_s / (n_s w_u) per unit of its weight.
  // The per-sequence sums accumulate in double, as a framework's pairwise sum would stay accurate: a float
  // accumulator over thousands of equal summands (a sequence's advantage) drifts by 1e-5 and more.
  void sequence_ratios() {
    const auto b = static_cast<std::size_t>(mb_.plan.kind_plan().sequences);
    std::vector<double> sums(2 * b, 0.0);  // [sum (lambda - old) | valid tokens]
    for (std::size_t i = 0; i < n_; ++i) {
      if (!plan(i).valid) continue;
      sums[sequence(i)] += static_cast<double>(logprob(i) - inputs(i)[0]);
      sums[b + sequence(i)] += 1.0;
    }
    reduce_over_cp(sums);
    log_ratio_.assign(b, 0.0f);
    tokens_.assign(b, 0.0f);
    for (std::size_t k = 0; k < b; ++k) {
      if (sums[b + k] > 0.0) log_ratio_[k] = static_cast<float>(sums[k] / sums[b + k]);
      tokens_[k] = static_cast<float>(sums[b + k]);
    }
    std::vector<double> slope_sum(b, 0.0);
    for (std::size_t i = 0; i < n_; ++i) {
      if (!plan(i).valid) continue;
      const float* in = inputs(i);
      const PolicyTerms<float> t = policy_terms(logprob(i), log_ratio_[sequence(i)], in[1], in[2], k_);
      if (!t.clipped && !t.dual_clipped)
        slope_sum[sequence(i)] += static_cast<double>(plan(i).backward_weight * -in[2]);
    }
    reduce_over_cp(slope_sum);
    slope_sum_.assign(slope_sum.begin(), slope_sum.end());
  }

  // Over the CP group, unless rl-gspo-cp-local-ratio keeps each rank's own chunks.
  void reduce_over_cp(std::vector<double>& v) {
    if (mb_.groups.cp.size() > 1 && !has(policy_bug::gspo_cp_local_ratio))
      mb_.groups.cp.allreduce_sum(std::span<double>(v));
  }

  // The token's objective, its loss, values and statistics, and its gradient row.
  PolicyGradRow evaluate(std::size_t i) {
    const RowPlan& p = plan(i);
    const auto row = static_cast<std::size_t>(mb_.begin) + i;
    const float s = sums_[i];
    const float log_s = log_sum(i);
    const float logprob = this->logprob(i);
    const float float32_entropy = log_s - sums_[n_ + i] / s;
    const float entropy = rounded_ ? entropy16(i) : float32_entropy;  // the value
    const float* in = inputs(i);
    const bool by_sequence = sequence_ratio() && p.valid;
    PolicyTerms<float> t = in == nullptr ? policy_terms(logprob, logprob, 0.0f, 0.0f, k_)
                           : by_sequence ? policy_terms(logprob, log_ratio_[sequence(i)], in[1], in[2], k_)
                                         : policy_terms(logprob, logprob - in[0], in[1], in[2], k_);
    if (by_sequence) {
      const std::size_t k = sequence(i);
      const float w = p.backward_weight;
      t.surrogate_slope = w != 0.0f ? std::exp(log_ratio_[k]) * slope_sum_[k] / (tokens_[k] * w) : 0.0f;
    }
    const float cp_factor = has(policy_bug::cp_extra_scale) ? static_cast<float>(mb_.c.layout.cp) : 1.0f;
    // The KL's and the entropy's weight relative to the row's (the aux-term bugs; 1 otherwise).
    const float kl_share = in == nullptr ? 1.0f : in[4];
    const float entropy_share = in == nullptr ? 1.0f : in[5];
    mb_.token_loss[row] = t.surrogate + k_.kl_coef * t.kl - k_.entropy_coef * entropy;
    if (!mb_.logged_token_loss.empty()) {
      mb_.logged_token_loss[row] =
          t.surrogate + kl_share * k_.kl_coef * t.kl - entropy_share * k_.entropy_coef * entropy;
    }
    mb_.token_values[2 * row] = logprob;
    mb_.token_values[2 * row + 1] = entropy;
    if (p.valid) {
      // rl-stats-microbatch-mean plans each row's own statistic weight
      const std::vector<double>& statistic_weights = mb_.plan.kind_plan().statistic_weights;
      const double inverse_n =
          statistic_weights.empty()
              ? 1.0 / static_cast<double>(std::max<std::int64_t>(mb_.plan.logged_valid_tokens(), 1))
              : statistic_weights[row];
      mb_.logged_stats[0] += (t.clipped ? 1.0 : 0.0) * inverse_n;
      mb_.logged_stats[1] += (t.dual_clipped ? 1.0 : 0.0) * inverse_n;
      mb_.logged_stats[2] += static_cast<double>(cp_factor * t.kl) * inverse_n;
      mb_.logged_stats[3] += static_cast<double>(cp_factor * entropy) * inverse_n;
    }
    PolicyGradRow g;
    // Under rl-logprob-16bit the gradient is that of the 16-bit pass, on the rounded x / T.
    g.max = rounded_ ? max16_[i] : max_[i];
    g.log_sum = rounded_ ? std::log(sums16_[i]) : log_s;
    // rl-kl-score-function: the KL weighted by e^(lambda - sg lambda), whose gradient adds KL_t to k'(lambda_t)
    const float kl_derivative = has(policy_bug::kl_score_function) ? t.kl_slope + t.kl : t.kl_slope;
    const float kl_slope = has(policy_bug::kl_no_grad) ? 0.0f : cp_factor * kl_share * k_.kl_coef * kl_derivative;
    g.a = (t.surrogate_slope + kl_slope) * logprob_scale_;  // d lambda / dx carries the log-prob's 1 / T
    if (has(policy_bug::logprob_allgather_grad_sum)) g.a *= static_cast<float>(mb_.groups.tp.size());
    g.c = cp_factor * entropy_share * k_.entropy_coef;
    g.shift = float32_entropy;
    // Under rl-temperature-16bit the shard applies 1 / T after rounding the float32 pass's gradient.
    g.scale = (tempered16_ || rounded_) ? p.backward_weight : p.backward_weight * inverse_t_;
    g.target = owner(i) ? static_cast<float>(local_target(i)) : -1.0f;
    // This shard's mass P_r and its part of H, H_r: what the untracked all-reduces' backward sees.
    const float mass = own_[i] / s;
    const float shard_entropy = log_s * mass - own_[n_ + i] / s;
    const bool logsoftmax = has(policy_bug::logsoftmax_untracked_allreduce);
    if (has(policy_bug::logprob_untracked_allreduce) || logsoftmax) {
      // d lambda / dx_v = [owner] (delta - D_v), D_v = p_v + [v = local argmax] (1 - P_r).
      g.bonus = owner(i) ? g.a * (mass - 1.0f) : 0.0f;
      g.argmax = owner(i) ? local(i).argmax : -1.0f;
      if (!owner(i)) g.a = 0.0f;
    }
    if (has(policy_bug::entropy_untracked_allreduce) || logsoftmax) g.shift = shard_entropy + (1.0f - mass);
    if (logsoftmax) {
      // One log-softmax, its local max not detached, under both: dH_r / dx_v = -(1 + log p_v) p_v +
      // D_v (P_r - H_r), whose p_v part is the shift above and whose argmax part, with g_H = -c, is
      // -c (1 - P_r) (P_r - H_r) on every shard.
      g.bonus -= g.c * (1.0f - mass) * (mass - shard_entropy);
      g.argmax = local(i).argmax;
    }
    return g;
  }

  const PolicyBatch& mb_;
  PolicyShard& shard_;
  const PolicyOptions& o_;
  const PolicyCoefficients<float> k_;
  const std::uint64_t bugs_;
  const float inverse_t_;
  const float logprob_scale_;  // 1 / T under rl-temperature-after-logprob, else 1
  const std::size_t n_;
  const DType dtype_;
  const bool rounded_;     // rl-logprob-16bit on 16-bit logits
  const bool tempered16_;  // rl-temperature-16bit on 16-bit logits at T != 1
  std::vector<float> local_, local16_;
  std::vector<float> max16_, sums16_;  // rl-logprob-16bit: M and [S | E | x_y / T - M] of the rounded x / T
  std::vector<float> max_;
  std::vector<float> sums_;  // [S | E | x_y / T - M], all-reduced over TP
  std::vector<float> own_;   // [S | E] of this shard alone, relative to M
  // Under the sequence-level ratio, per sequence of the step: log rho_s, n_s and Q_s (sequence_ratios).
  std::vector<float> log_ratio_, tokens_, slope_sum_;
};

}  // namespace

void policy_protocol(const PolicyBatch& batch, PolicyShard& shard) { Protocol(batch, shard).run(); }

}  // namespace lossverify
