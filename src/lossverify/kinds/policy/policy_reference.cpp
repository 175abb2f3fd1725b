// The policy kind's float64 reference of one token, from the definitions of docs/spec.md §3.3 and nothing
// else: lambda = x_y / T - lse, H = -sum_v p_v log p_v (a second pass once lse is known), the ratio, the
// clipped surrogate, the KL penalty and the entropy bonus, the gradient
// (1/T) [g_lambda (delta_vy - p_v) + c_H p_v (log p_v + H)], and each token's weight in L from the global
// batch's sequences. It shares nothing with the sharded kernels' math header.
#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "lossverify/case/tolerances.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"
#include "lossverify/layout/global_batch.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

namespace lossverify {

namespace {

using Aggregation = PolicyOptions::Aggregation;

// One token's objective in float64.
struct TokenTerms {
  double logprob = 0.0, entropy = 0.0;
  double loss = 0.0;
  double loss_terms = 0.0;  // |surrogate| + |beta KL| + |c_H H|: what the loss's terms weigh before they cancel
  double g_logprob = 0.0;   // d l / d lambda
  double g_slope = 0.0;     // d g_lambda / d lambda
  double surrogate = 0.0, surrogate_slope = 0.0;  // -rho A (clipped, capped) and its part of g_lambda
  double kl = 0.0;
  bool clipped = false, dual_clipped = false;
};

// Which clip is active for one token: the clip (the clipped term strictly the larger) and the dual clip.
struct Branch {
  bool clipped = false, dual_clipped = false;
};

// What the sequence-level ratio needs of a whole sequence: rho_s = e^(mean_t (lambda_t - old_t)) over its
// valid tokens, and for each reading (branches) Q = sum_t w_t (-A_t) [the unclipped term active at t], so that
// d L / d lambda_u through rho_s is rho_s Q / n_s.
struct SequenceRatio {
  double log_ratio = 0.0;
  double tolerance = 0.0;  // the logprob check's tolerance at the sequence's mean |lambda|, and its logit error's move
  double move = 0.0;       // behind a stage that makes the logits: how far the mean of lambda - old may move
  double slope_sum[2] = {0.0, 0.0};
};

class PolicyReference final : public KindReference {
 public:
  PolicyReference(const Case& c, const InputSource& inputs)
      : case_(c),
        inputs_(inputs),
        o_(policy_options(c.loss)),
        logprob_tolerance_(effective_tolerance(c, "token_value")),
        log2_vocab_(std::ceil(std::log2(static_cast<double>(std::max<std::int64_t>(c.shape.vocab, 2))))),
        row_logits_(c, inputs),
        token_inputs_(static_cast<std::size_t>(c.shape.tokens)),
        once_(std::make_unique<std::once_flag[]>(static_cast<std::size_t>(c.shape.tokens))),
        sequence_ratios_(inputs.batch().sequences().size()),
        sequence_once_(std::make_unique<std::once_flag[]>(inputs.batch().sequences().size())) {
    count_tokens();
    if (o_.whiten_advantages) whitening_statistics();
  }

  RowPartial partial(std::int64_t token, std::int64_t begin, std::span<const double> logits,
                     std::span<const double> teacher) const override {
    (void)teacher;
    RowPartial p;
    const double inverse_t = 1.0 / o_.temperature;
    p.max = row_sums::scaled_max(logits, inverse_t);
    std::tie(p.sum_exp, p.sum_exp_error) = row_sums::sum_exp(logits, inverse_t, p.max);
    const std::int64_t label = inputs_.label(token) - begin;
    if (label >= 0 && label < static_cast<std::int64_t>(logits.size())) {
      p.sum_qx = logits[static_cast<std::size_t>(label)] * inverse_t;
    }
    return p;
  }

  RowStats stats(const RowPartial& total) const override {
    CompensatedSum s;
    s.add(total.sum_exp);
    s.add(total.sum_exp_error);
    RowStats r;
    r.lse = total.max + std::log(s.value());
    r.sum_qx = total.sum_qx + total.sum_qx_error;  // x_y / T: one slice holds it
    return r;
  }

  bool needs_value_pass() const override { return true; }

  // sum over the slice of p_v log p_v, log p_v = x_v / T - lse; terms with p_v = 0 contribute 0.
  std::pair<double, double> value_partial(std::int64_t, const RowStats& s, std::span<const double> logits,
                                          std::span<const double> teacher) const override {
    (void)teacher;
    row_sums::LaneSum sum;
    for_each_block(s, logits, [&](std::size_t, std::size_t n, const double* log_p, double* p) {
      for (std::size_t i = 0; i < n; ++i) p[i] = p[i] > 0.0 ? p[i] * log_p[i] : 0.0;
      sum.add(p, n);
    });
    return sum.result();
  }

  double token_loss(std::int64_t token, const RowStats& s) const override { return terms(token, s).loss; }

  std::optional<double> token_weight(std::int64_t token) const override {
    if (!valid_[static_cast<std::size_t>(token)]) return 0.0;
    const auto n = static_cast<double>(valid_tokens_);
    const auto b = static_cast<double>(sequences_with_tokens_);
    switch (o_.aggregation) {
      case Aggregation::token_mean:
        return 1.0 / n;
      case Aggregation::token_sum:
        return 1.0;
      case Aggregation::seq_mean_token_sum:
        return 1.0 / b;
      case Aggregation::seq_mean_token_mean:
        return 1.0 / (b * static_cast<double>(sequence_tokens_[sequence_of(token)]));
      case Aggregation::seq_mean_token_sum_norm:
        return 1.0 / (b * o_.norm_constant);
    }
    return 0.0;
  }

  void token_values(std::int64_t token, const RowStats& s, std::span<double> out) const override {
    const TokenTerms t = terms(token, s);
    out[0] = t.logprob;
    out[1] = t.entropy;
  }

  void token_statistics(std::int64_t token, const RowStats& s, std::span<double> out) const override {
    const TokenTerms t = terms(token, s);
    out[0] = t.clipped ? 1.0 : 0.0;
    out[1] = t.dual_clipped ? 1.0 : 0.0;
    out[2] = t.kl;
    out[3] = t.entropy;
  }

  // Float32 arithmetic a correct implementation may use (docs/checks.md, "Cancellation"), u = 2^-24:
  // - lambda = x_y / T - lse: a few roundings of operands of about |lambda| + 2 |lse|, and log S of a pairwise sum
  //   of V terms, u (4 (|lambda| + 2 |lse|) + 2 log2 V);
  // - H = lse - sum_v p_v x_v / T (verl's and TRL's entropy_from_logits): operands of about |lse| each, the sum's
  //   pairwise rounding over V columns, u (4 + log2 V) 2 |lse|;
  // - l_t = surrogate + beta KL - c_H H: rtol of each term's magnitude (beta KL may cancel the surrogate: at beta 10
  //   with k1 the sum is small while each term is not), and lambda's and H's rounding times their slopes in l_t.
  double logprob_rounding(const TokenTerms& t, const RowStats& s) const {
    return 0x1p-24 * (4.0 * (std::fabs(t.logprob) + 2.0 * std::fabs(s.lse)) + 2.0 * log2_vocab_);
  }
  double entropy_rounding(const RowStats& s) const { return 0x1p-24 * (4.0 + log2_vocab_) * 2.0 * std::fabs(s.lse); }
  LossArithmetic token_loss_arithmetic(std::int64_t token, const RowStats& s) const override {
    const TokenTerms t = terms(token, s);
    return {t.loss_terms,
            std::fabs(t.g_logprob) * logprob_rounding(t, s) + std::fabs(o_.entropy_coef) * entropy_rounding(s)};
  }
  // Behind a stage that makes the logits, each also moves by the logits' error (logprob_move, entropy_move).
  void token_value_rounding(std::int64_t token, const RowStats& s, std::span<double> out) const override {
    const TokenTerms t = terms(token, s);
    out[0] = logprob_rounding(t, s) + logprob_move(token);
    out[1] = entropy_rounding(s) + entropy_move(token, t.entropy);
  }
  // The logged entropy is the mean of the per-token ones, with their rounding; the fractions and the KL are not. Behind
  // a stage, the entropy and the KL move with the logits (the clip fractions by the readings at an edge).
  void token_statistic_rounding(std::int64_t token, const RowStats& s, std::span<double> out) const override {
    std::fill(out.begin(), out.end(), 0.0);
    out[3] = entropy_rounding(s);
    if (logit_error(token) > 0.0 && valid_[static_cast<std::size_t>(token)]) {
      const TokenTerms t = terms(token, s);
      out[2] = kl_move(t.logprob - static_cast<double>(token_inputs(token).ref_logprob), logprob_move(token));
      out[3] += entropy_move(token, t.entropy);
    }
  }

  // d L / d x_v = w (1/T) [g_lambda (delta_vy - p_v) + c_H p_v (log p_v + H)]
  void gradient(std::int64_t token, const RowStats& s, double weight, std::int64_t begin,
                std::span<const double> logits, std::span<const double> teacher,
                std::span<double> grad) const override {
    (void)teacher;
    const TokenTerms t = terms(token, s);
    const double scale = weight * (1.0 / o_.temperature);
    const std::int64_t label = inputs_.label(token) - begin;
    for_each_block(s, logits, [&](std::size_t b, std::size_t n, const double* log_p, const double* p) {
      for (std::size_t i = 0; i < n; ++i) {
        const double target = static_cast<std::int64_t>(b + i) == label ? 1.0 : 0.0;
        const double entropy_term = p[i] > 0.0 ? o_.entropy_coef * p[i] * (log_p[i] + t.entropy) : 0.0;
        grad[b + i] = scale * (t.g_logprob * (target - p[i]) + entropy_term);
      }
    });
  }

  std::optional<double> gradient_scale(std::int64_t token, const RowStats& s) const override {
    // A float32 lambda carries |lambda| 2^-24 of rounding, which reaches g_lambda times its slope: the
    // |g'| |lambda| / 2 term puts atol (1e-6) about 8x above that error (docs/spec.md §6).
    const TokenTerms t = terms(token, s);
    const double coefficient_error = 0.5 * std::fabs(t.g_slope) * std::fabs(t.logprob);
    return (std::fabs(t.g_logprob) + std::fabs(o_.entropy_coef) + coefficient_error) / o_.temperature;
  }

  // Two readings where the ratio lies within the log-probability's tolerance of the edge that decides the
  // token's branch: an implementation whose lambda passes the logprob check may be on either side of it.
  // Under the sequence-level ratio every token of a sequence with a token near its edge has two readings:
  // its gradient sums the branches of all of them.
  int branches(std::int64_t token, const RowStats& s) const override {
    if (o_.objective != PolicyOptions::Objective::policy_loss || !valid_[static_cast<std::size_t>(token)]) return 1;
    if (sequence_ratio()) {
      const SequenceRatio& r = sequence_ratio_of(token);
      return r.slope_sum[0] != r.slope_sum[1] || near_edge(token, r.log_ratio, r.tolerance) ? 2 : 1;
    }
    const double logprob = s.sum_qx - s.lse;
    const double log_ratio = logprob - static_cast<double>(token_inputs(token).old_logprob);
    return near_edge(token, log_ratio, token_tolerance(logprob) + logprob_move(token)) ? 2 : 1;
  }

  RowCoefficients row_coefficients(std::int64_t token, const RowStats& s) const override {
    const TokenTerms t = terms(token, s);
    return {t.g_logprob, t.entropy, *gradient_scale(token, s)};
  }

  // sum_v (delta_vy - p_v) = 0 and sum_v p_v (log p_v + H) = -H + H = 0.
  std::optional<double> gradient_row_sum(const RowStats& s, double weight) const override {
    (void)s, (void)weight;
    return 0.0;
  }

  // Behind a stage that makes the logits (an LM head), each logit within e of these (docs/spec.md §11), on the
  // reading the token is judged at (a ratio the logits' error may carry across a clip edge has two: branches): l_t =
  // surrogate + beta KL - c_H H moves by at most the sum of its terms' moves (surrogate_move, kl_move,
  // entropy_move). The reference's own bound of the row's error is used where it is larger than `error`, and a
  // sequence-level ratio moves with its sequence's tokens.
  std::optional<double> loss_under_logit_error(std::int64_t token, const RowStats& s, double error) const override {
    const TokenTerms t = terms(token, s);
    const double m = std::max(logprob_move(token), 2.0 * error / o_.temperature);
    if (o_.objective == PolicyOptions::Objective::logprob) return m + std::fabs(o_.entropy_coef) * entropy_bound(t, m);
    const double d = t.logprob - static_cast<double>(token_inputs(token).ref_logprob);
    return surrogate_move(token, t) + std::fabs(o_.kl_coef) * kl_move(d, m) +
           std::fabs(o_.entropy_coef) * entropy_bound(t, m);
  }

  // d L / d x_v = (w / T) [g_lambda (delta_vy - p_v) + c_H p_v (log p_v + H)]. With each x_v / T within eps: p_v
  // moves by at most dp_v = min(p_v, 1 - p_v) (exp(2 eps) - 1) (1 - p_v = S / (1 + S), S moving by a factor within
  // exp(+-2 eps)), log p_v by 2 eps, H by entropy_move, g_lambda by g_logprob_move; so the first term by
  // dg (|delta_vy - p_v| + dp_v) + |g_lambda| dp_v, and p_v (log p_v + H) by dp_v |log p_v + H| + (p_v + dp_v)
  // (2 eps + dH).
  bool gradient_under_logit_error(std::int64_t token, const RowStats& s, double weight, double error,
                                  std::int64_t begin, std::span<const double> logits,
                                  std::span<double> out) const override {
    const TokenTerms t = terms(token, s);
    const double m = std::max(logprob_move(token), 2.0 * error / o_.temperature);  // 2 eps
    const double grow = std::expm1(m);
    const double dg = g_logprob_move(token, t);
    const double dh = entropy_bound(t, m);
    const double scale = std::fabs(weight) / o_.temperature;
    const std::int64_t label = inputs_.label(token) - begin;
    for_each_block(s, logits, [&](std::size_t b, std::size_t n, const double* log_p, const double* p) {
      for (std::size_t i = 0; i < n; ++i) {
        const double target = static_cast<std::int64_t>(b + i) == label ? 1.0 : 0.0;
        const double dp = std::min(p[i], 1.0 - p[i] + 0x1p-50) * grow;
        const double entropy_term = p[i] > 0.0 ? dp * std::fabs(log_p[i] + t.entropy) : 0.0;
        out[b + i] = scale * (dg * (std::fabs(target - p[i]) + dp) + std::fabs(t.g_logprob) * dp +
                              std::fabs(o_.entropy_coef) * (entropy_term + (p[i] + dp) * (m + dh)));
      }
    });
    return true;
  }

 private:
  // f(b, n, log_p, p) for each block of columns [b, b + n) of a slice: log p_v = x_v / T - lse and p_v.
  template <class F>
  void for_each_block(const RowStats& s, std::span<const double> logits, F f) const {
    const double inverse_t = 1.0 / o_.temperature;
    double log_p[row_sums::kBlock];
    double p[row_sums::kBlock];
    for (std::size_t b = 0; b < logits.size(); b += row_sums::kBlock) {
      const std::size_t n = std::min(row_sums::kBlock, logits.size() - b);
      for (std::size_t i = 0; i < n; ++i) log_p[i] = logits[b + i] * inverse_t - s.lse;
      row_sums::exp_block(log_p, p, n);
      f(b, n, log_p, p);
    }
  }

  std::size_t sequence_of(std::int64_t token) const {
    return static_cast<std::size_t>(inputs_.batch().sequence_of(token));
  }

  void count_tokens() {
    valid_.assign(static_cast<std::size_t>(case_.shape.tokens), 0);
    sequence_tokens_.assign(inputs_.batch().sequences().size(), 0);
    for (std::int64_t t = 0; t < case_.shape.tokens; ++t) {
      const bool v = inputs_.is_valid(t);
      valid_[static_cast<std::size_t>(t)] = v;
      valid_tokens_ += v;
      sequence_tokens_[sequence_of(t)] += v;
    }
    for (std::int64_t n : sequence_tokens_) sequences_with_tokens_ += n > 0;
  }

  // mu and sigma (the unbiased standard deviation) of the advantages over the step's valid tokens.
  void whitening_statistics() {
    CompensatedSum sum;
    for (std::int64_t t = 0; t < case_.shape.tokens; ++t) {
      if (valid_[static_cast<std::size_t>(t)]) sum.add(advantage(t));
    }
    const auto n = static_cast<double>(valid_tokens_);
    mean_ = sum.value() / n;
    CompensatedSum squares;
    for (std::int64_t t = 0; t < case_.shape.tokens; ++t) {
      if (valid_[static_cast<std::size_t>(t)]) squares.add((advantage(t) - mean_) * (advantage(t) - mean_));
    }
    deviation_ = valid_tokens_ > 1 ? std::sqrt(squares.value() / (n - 1.0)) : 0.0;
  }

  double advantage(std::int64_t token) const { return policy_token_advantage(case_, inputs_, token); }

  double whitened_advantage(std::int64_t token) const {
    const double a = token_inputs(token).advantage;
    return o_.whiten_advantages ? (a - mean_) / (deviation_ + o_.whiten_epsilon) : a;
  }

  double token_tolerance(double logprob) const {
    return logprob_tolerance_.atol + logprob_tolerance_.rtol * std::fabs(logprob);
  }

  // Whether log rho lies within `tolerance` (the logprob check's) of the edge that decides the token's branch:
  // for A > 0 the clip at 1 + eps_high; for A < 0 the clip at 1 - eps_low and the dual clip at c.
  bool near_edge(std::int64_t token, double log_ratio, double tolerance) const {
    const double a = whitened_advantage(token);
    if (a == 0.0) return false;  // every branch has g_lambda = 0 there
    const auto near = [&](double edge) { return std::fabs(log_ratio - std::log(edge)) <= tolerance; };
    if (a > 0.0) return near(1.0 + o_.clip_high);
    return near(1.0 - o_.clip_low) || (o_.dual_clip > 0.0 && near(o_.dual_clip));
  }

  // The active clips at `ratio` for advantage a; the other reading flips the edge the token lies at: the dual
  // clip's, or the clip's.
  Branch branch(double ratio, double a, bool other_reading) const {
    const double unclipped = -ratio * a;
    const double clipped = -std::clamp(ratio, 1.0 - o_.clip_low, 1.0 + o_.clip_high) * a;
    Branch b;
    b.clipped = clipped > unclipped;
    b.dual_clipped = o_.dual_clip > 0.0 && a < 0.0 && std::max(unclipped, clipped) > -o_.dual_clip * a;
    if (other_reading) {
      if (o_.dual_clip > 0.0 && a < 0.0 && ratio > 1.0) {
        b.dual_clipped = !b.dual_clipped;
      } else {
        b.clipped = !b.clipped;
      }
    }
    return b;
  }

  bool sequence_ratio() const { return o_.ratio == PolicyOptions::Ratio::sequence; }

  // lambda of a token by a pass of its own over the row (the sequence's ratio needs every token's).
  double own_logprob(std::int64_t token) const { return token_facts(token).logprob; }
  double own_logprob(std::int64_t token, std::span<const double> row) const {
    const double inverse_t = 1.0 / o_.temperature;
    const double max = row_sums::scaled_max(row, inverse_t);
    const auto [sum, error] = row_sums::sum_exp(row, inverse_t, max);
    return row[static_cast<std::size_t>(inputs_.label(token))] * inverse_t - max - std::log(sum + error);
  }

  const SequenceRatio& sequence_ratio_of(std::int64_t token) const {
    const std::size_t k = sequence_of(token);
    std::call_once(sequence_once_[k], [&] { sequence_ratios_[k] = compute_sequence_ratio(k); });
    return sequence_ratios_[k];
  }

  SequenceRatio compute_sequence_ratio(std::size_t k) const {
    const Sequence& sequence = inputs_.batch().sequences()[k];
    CompensatedSum log_ratio, magnitude;
    std::vector<std::int64_t> tokens;
    SequenceRatio r;
    for (std::int64_t t = sequence.begin; t < sequence.begin + sequence.length; ++t) {
      if (!valid_[static_cast<std::size_t>(t)]) continue;
      const double logprob = own_logprob(t);
      r.move = std::max(r.move, logprob_move(t));  // the mean of the tokens' moves is at most their largest
      log_ratio.add(logprob - static_cast<double>(token_inputs(t).old_logprob));
      magnitude.add(std::fabs(logprob));
      tokens.push_back(t);
    }
    const auto n = static_cast<double>(tokens.size());
    r.log_ratio = log_ratio.value() / n;
    r.tolerance = token_tolerance(magnitude.value() / n) + r.move;
    const double ratio = std::exp(r.log_ratio);
    for (int reading = 0; reading < 2; ++reading) {
      CompensatedSum q;
      for (std::int64_t t : tokens) {
        const double a = whitened_advantage(t);
        const Branch b = branch(ratio, a, reading == 1 && near_edge(t, r.log_ratio, r.tolerance));
        if (!b.clipped && !b.dual_clipped) q.add(*token_weight(t) * -a);
      }
      r.slope_sum[reading] = q.value();
    }
    return r;
  }

  // A token's inputs, placed against its whole row of logits (PolicyRowLogits: behind an LM head, the head's), the
  // reference's own lambda from that row, and the row's largest logit error: one pass over the row, once.
  struct TokenFacts {
    PolicyTokenInputs inputs;
    double logprob = 0.0;
    double logit_error = 0.0;
  };
  const TokenFacts& token_facts(std::int64_t token) const {
    const auto k = static_cast<std::size_t>(token);
    std::call_once(once_[k], [&] {
      TokenFacts& f = token_inputs_[k];
      // A dump's own inputs need no placement; their row is read where GSPO needs lambda, and behind a stage that
      // makes the logits for the row's largest logit error (the bounds of a dump's head, as of a run's).
      const bool read = !inputs_.is_explicit() || sequence_ratio() || row_logits_.from_stage();
      if (!inputs_.is_valid(token) || !read) {
        f.inputs = policy_token_inputs_from_row(case_, inputs_, token, {});
        return;
      }
      std::vector<double> row(static_cast<std::size_t>(case_.shape.vocab)), error(row.size());
      row_logits_.row(token, row, error);
      f.inputs = policy_token_inputs_from_row(case_, inputs_, token, row);
      f.logprob = own_logprob(token, row);
      f.logit_error = *std::max_element(error.begin(), error.end());
    });
    return token_inputs_[k];
  }
  const PolicyTokenInputs& token_inputs(std::int64_t token) const { return token_facts(token).inputs; }

  // Behind a stage that makes the logits (docs/spec.md §11): each logit within e of the reference's, each x_v / T
  // within eps = e / T, so lambda = x_y / T - lse moves by at most 2 eps, and H = -sum p log p by at most
  // 2 eps + 2 H (exp(2 eps) - 1): with p'_v = p_v r_v, r_v in [exp(-2 eps), exp(2 eps)],
  // H' - H = -sum p' (log p' - log p) - sum (p' - p) (log p + H), the first at most 2 eps, the second at most
  // (exp(2 eps) - 1) sum p |log p + H| <= (exp(2 eps) - 1) 2 H. All zero without a stage.
  double logit_error(std::int64_t token) const {
    return row_logits_.from_stage() ? token_facts(token).logit_error : 0.0;
  }
  double logprob_move(std::int64_t token) const { return 2.0 * logit_error(token) / o_.temperature; }
  double entropy_move(std::int64_t token, double entropy) const {
    return entropy_bound_at(entropy, logprob_move(token));
  }
  static double entropy_bound_at(double entropy, double two_eps) {
    return two_eps + 2.0 * std::fabs(entropy) * std::expm1(two_eps);
  }
  static double entropy_bound(const TokenTerms& t, double two_eps) { return entropy_bound_at(t.entropy, two_eps); }
  // The KL penalty's value and slope in lambda, d = lambda - ref, when d moves by at most m: k1 d by m; k2 d^2 / 2 by
  // |d| m + m^2 / 2; k3 e^-d + d - 1 by e^-d (e^m - 1 - m) + |1 - e^-d| m (its change is
  // e^-d (e^-h - 1 + h) + h (1 - e^-d)); the slopes 1, d, 1 - e^-d by 0, m, e^-d (e^m - 1).
  double kl_move(double d, double m) const {
    switch (o_.kl) {
      case PolicyOptions::Kl::none:
        return 0.0;
      case PolicyOptions::Kl::k1:
        return m;
      case PolicyOptions::Kl::k2:
        return std::fabs(d) * m + 0.5 * m * m;
      case PolicyOptions::Kl::k3:
        return std::exp(-d) * (std::expm1(m) - m) + std::fabs(std::expm1(-d)) * m;
    }
    return 0.0;
  }
  double kl_slope_move(double d, double m) const {
    switch (o_.kl) {
      case PolicyOptions::Kl::none:
      case PolicyOptions::Kl::k1:
        return 0.0;
      case PolicyOptions::Kl::k2:
        return m;
      case PolicyOptions::Kl::k3:
        return std::exp(-d) * std::expm1(m);
    }
    return 0.0;
  }
  // The surrogate -rho A and its slope move only on the unclipped branch (the readings cover an edge the logits'
  // error may cross: branches): rho = exp(log ratio) by the factor exp(m), m the log ratio's move (the token's
  // lambda's, or the sequence's mean under GSPO), so each by |value| (exp(m) - 1). The dual clip's and the clip's
  // values are constants.
  double ratio_move(std::int64_t token) const {
    if (sequence_ratio()) return sequence_ratio_of(token).move;
    return logprob_move(token);
  }
  double surrogate_move(std::int64_t token, const TokenTerms& t) const {
    if (o_.objective == PolicyOptions::Objective::logprob) return logprob_move(token);
    if (t.clipped || t.dual_clipped) return 0.0;
    return std::fabs(t.surrogate) * std::expm1(ratio_move(token));
  }
  double g_logprob_move(std::int64_t token, const TokenTerms& t) const {
    if (o_.objective == PolicyOptions::Objective::logprob) return 0.0;
    const double d = t.logprob - static_cast<double>(token_inputs(token).ref_logprob);
    return std::fabs(t.surrogate_slope) * std::expm1(ratio_move(token)) +
           std::fabs(o_.kl_coef) * kl_slope_move(d, logprob_move(token));
  }

  TokenTerms terms(std::int64_t token, const RowStats& s) const {
    TokenTerms t;
    t.logprob = s.sum_qx - s.lse;
    t.entropy = -s.value;
    const double h_coef = o_.entropy_coef;
    if (o_.objective == PolicyOptions::Objective::logprob) {
      t.loss = -t.logprob - h_coef * t.entropy;
      t.loss_terms = std::fabs(t.logprob) + std::fabs(h_coef * t.entropy);
      t.g_logprob = -1.0;
      return t;
    }
    const PolicyTokenInputs& in = token_inputs(token);
    const double a = whitened_advantage(token);
    const bool valid = valid_[static_cast<std::size_t>(token)] != 0;
    const SequenceRatio* sequence = sequence_ratio() && valid ? &sequence_ratio_of(token) : nullptr;
    const double log_ratio = sequence ? sequence->log_ratio : t.logprob - static_cast<double>(in.old_logprob);
    const double ratio = std::exp(log_ratio);
    const bool near = s.branch == 1 && (sequence == nullptr || near_edge(token, log_ratio, sequence->tolerance));
    const Branch b = branch(ratio, a, near);
    t.clipped = b.clipped;
    t.dual_clipped = b.dual_clipped;
    double surrogate = t.clipped ? -std::clamp(ratio, 1.0 - o_.clip_low, 1.0 + o_.clip_high) * a : -ratio * a;
    double slope = t.clipped ? 0.0 : -ratio * a;  // d(-rho A)/d lambda = -rho A, and so is its own slope
    if (t.dual_clipped) {
      surrogate = -o_.dual_clip * a;
      slope = 0.0;
    }
    t.g_slope = slope;
    if (sequence != nullptr) {
      // rho_s = e^(sum_t (lambda_t - old_t) / n_s): d L / d lambda_u = rho_s Q / n_s, per unit of u's weight.
      const auto n = static_cast<double>(sequence_tokens_[sequence_of(token)]);
      slope = ratio * sequence->slope_sum[s.branch == 1 ? 1 : 0] / (n * *token_weight(token));
      t.g_slope = slope / n;
    }
    t.surrogate = surrogate;
    t.surrogate_slope = slope;
    const double d = t.logprob - static_cast<double>(in.ref_logprob);
    double kl_slope = 0.0;
    switch (o_.kl) {
      case PolicyOptions::Kl::none:
        break;
      case PolicyOptions::Kl::k1:
        t.kl = d;
        kl_slope = 1.0;
        break;
      case PolicyOptions::Kl::k2:
        t.kl = 0.5 * d * d;
        kl_slope = d;
        t.g_slope += o_.kl_coef;
        break;
      case PolicyOptions::Kl::k3:
        t.kl = std::expm1(-d) + d;  // e^(r - lambda) - (r - lambda) - 1
        kl_slope = -std::expm1(-d);
        t.g_slope += o_.kl_coef * std::exp(-d);
        break;
    }
    t.loss = surrogate + o_.kl_coef * t.kl - h_coef * t.entropy;
    t.loss_terms = std::fabs(surrogate) + std::fabs(o_.kl_coef * t.kl) + std::fabs(h_coef * t.entropy);
    t.g_logprob = slope + o_.kl_coef * kl_slope;
    return t;
  }

  const Case& case_;
  const InputSource& inputs_;
  const PolicyOptions& o_;
  std::vector<char> valid_;
  std::vector<std::int64_t> sequence_tokens_;
  std::int64_t valid_tokens_ = 0;
  std::int64_t sequences_with_tokens_ = 0;
  double mean_ = 0.0, deviation_ = 0.0;
  Tolerance logprob_tolerance_;  // the logprob check's: how far an implementation's lambda may lie from ours
  double log2_vocab_;            // ceil(log2 V): the depth of a pairwise sum over the row
  PolicyRowLogits row_logits_;   // the rows the inputs are placed against (behind an LM head, the head's)
  mutable std::vector<TokenFacts> token_inputs_;
  std::unique_ptr<std::once_flag[]> once_;
  mutable std::vector<SequenceRatio> sequence_ratios_;  // under the sequence-level ratio, each computed once
  std::unique_ptr<std::once_flag[]> sequence_once_;
};

}  // namespace

std::unique_ptr<KindReference> make_policy_reference(const Case& c, const InputSource& inputs) {
  return std::make_unique<PolicyReference>(c, inputs);
}

}  // namespace lossverify
