// The router kind's float64 reference (../shared/MOE.md §1), from the definitions and the layout alone: every scope
// (one DP rank's micro-batch: its tokens over CP, and over TP under sequence parallelism) routed from its own copy of
// the logits, its counts c_e and valid tokens T; each token's l_t = alpha E / (k T^2) <c, s_t> + alpha_z / T lse(z_t)^2
// with weight 1 / (DP GA), so that L = sum_t w_t l_t is the step's mean over micro-batches of the scopes' losses.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/compensated_sum.hpp"
#include "lossverify/reference/row_sums.hpp"

namespace lossverify {

namespace {

router::Score score_of(const RouterOptions& o) {
  return o.score == RouterOptions::Score::softmax ? router::Score::softmax : router::Score::sigmoid;
}

class RouterReference final : public KindReference {
 public:
  RouterReference(const Case& c, const InputSource& inputs)
      : options_(router_options(c.loss)),
        experts_(c.shape.vocab),
        weight_(1.0 / (static_cast<double>(c.layout.dp) * static_cast<double>(c.layout.ga))) {
    std::vector<double> z(static_cast<std::size_t>(experts_)), s(z.size());
    std::vector<float> raw(z.size());
    for (int dp = 0; dp < c.layout.dp; ++dp) {
      for (int k = 0; k < c.layout.ga; ++k) {
        router::ScopeSums sums(z.size());
        const std::size_t first_sequence = sequence_scopes_.size();
        for (const std::int64_t q : sequences_of_slot(inputs.batch(), c.batch, c.layout, dp, k)) {
          const Sequence& seq = inputs.batch().sequences()[static_cast<std::size_t>(q)];
          router::ScopeSums sequence_sums(z.size());
          for (std::int64_t t = seq.begin; t < seq.begin + seq.length; ++t) {
            if (!inputs.is_valid(t)) continue;
            ++valid_tokens_;
            inputs.logits(t, 0, experts_, raw.data());
            for (std::size_t e = 0; e < z.size(); ++e) z[e] = raw[e];
            router::scores(score_of(options_), z, s);
            const router::TopK routed = router::top_k(s, options_.top_k);
            // A float32 router may route a token whose k-th and (k+1)-th scores lie within its rounding either way
            // (MOE.md §3); the bound that admits both is not written yet, so such inputs are refused.
            if (routed.margin <= 1e-6 * s[static_cast<std::size_t>(routed.experts.back())]) {
              throw CaseError(c.source + ": token " + std::to_string(t) + "'s " + std::to_string(options_.top_k) +
                              "-th and next router scores tie within float32 rounding (MOE.md §3)");
            }
            sums.add(s, routed);
            sequence_sums.add(s, routed);
            scope_of_[t] = scopes_.size();
            sequence_of_[t] = sequence_scopes_.size();
          }
          if (sequence_sums.tokens > 0.0) sequence_scopes_.push_back(std::move(sequence_sums));
        }
        // The micro-batch's sequences that hold a valid token: its sequence aux loss is their mean.
        const auto held = static_cast<double>(sequence_scopes_.size() - first_sequence);
        for (std::size_t j = first_sequence; j < sequence_scopes_.size(); ++j) sequences_in_batch_.push_back(held);
        scopes_.push_back(std::move(sums));
      }
    }
    global_counts(c);
  }

  RowPartial partial(std::int64_t, std::int64_t, std::span<const double> logits,
                     std::span<const double>) const override {
    RowPartial p;
    p.max = row_sums::scaled_max(logits, 1.0);
    std::tie(p.sum_exp, p.sum_exp_error) = row_sums::sum_exp(logits, 1.0, p.max);
    return p;
  }
  RowStats stats(const RowPartial& total) const override {
    CompensatedSum s;
    s.add(total.sum_exp);
    s.add(total.sum_exp_error);
    return RowStats{total.max + std::log(s.value()), 0.0, 0.0};
  }
  // The aux terms over the whole row (rows are whole on every rank: one slice): a <c, s_t> of the micro-batch's scope
  // plus a_s <c_s, s_t> / S of the token's sequence's, each with its own scale a.
  bool needs_value_pass() const override { return true; }
  std::pair<double, double> value_partial(std::int64_t token, const RowStats&, std::span<const double> logits,
                                          std::span<const double>) const override {
    std::vector<double> s(logits.size());
    router::scores(score_of(options_), logits, s);
    const std::vector<double> w = aux_weights(token);
    CompensatedSum dot;
    for (std::size_t e = 0; e < s.size(); ++e) dot.add(w[e] * s[e]);
    return {dot.value(), 0.0};
  }
  double token_loss(std::int64_t token, const RowStats& st) const override {
    return st.value + options_.z_loss_coef / scope_of(token).tokens * st.lse * st.lse;
  }
  std::optional<double> token_weight(std::int64_t) const override { return weight_; }
  // The logged aux loss (every aux term) and z-loss of the step: each the sum over tokens of w_t times the token's
  // term, given as per-token values whose mean over the step's valid tokens is that sum.
  void token_statistics(std::int64_t token, const RowStats& st, std::span<double> out) const override {
    const double share = static_cast<double>(valid_tokens_) * weight_;
    out[0] = share * st.value;
    out[1] = share * options_.z_loss_coef / scope_of(token).tokens * st.lse * st.lse;
  }
  void gradient(std::int64_t token, const RowStats&, double weight, std::int64_t, std::span<const double> logits,
                std::span<const double>, std::span<double> grad) const override {
    const router::ScopeSums& scope = scope_of(token);
    std::vector<double> aux(logits.size()), z(logits.size());
    router::aux_gradient(score_of(options_), logits, aux_weights(token), 1.0, aux);
    router::z_loss_gradient(logits, options_.z_loss_coef / scope.tokens, z);
    for (std::size_t e = 0; e < grad.size(); ++e) grad[e] = weight * (aux[e] + z[e]);
  }
  std::optional<double> gradient_row_sum(const RowStats&, double) const override { return std::nullopt; }

 private:
  const router::ScopeSums& scope_of(std::int64_t token) const { return scopes_[scope_of_.at(token)]; }
  // Every aux term is linear in s_t with constant counts: their weights per expert, summed, are the one vector
  // a c + a_s c_s / S + a_g c^G that both the loss and the gradient read.
  std::vector<double> aux_weights(std::int64_t token) const {
    const std::size_t b = scope_of_.at(token);
    const router::ScopeSums& scope = scopes_[b];
    const std::size_t j = sequence_of_.at(token);
    const router::ScopeSums& sequence = sequence_scopes_[j];
    const router::ScopeSums& global = global_[b];
    const double a = router::aux_scale(scope, options_.aux_coef, options_.top_k);
    const double a_s = router::aux_scale(sequence, options_.seq_aux_coef, options_.top_k) / sequences_in_batch_[j];
    // alpha E sum_e f_e P_e with f_e = c^G_e / (k T^G) and P_e = sum_{t in B} p_te / T_B
    const double a_g = global.tokens > 0.0 ? options_.global_aux_coef * static_cast<double>(global.counts.size()) /
                                                 (options_.top_k * global.tokens * scope.tokens)
                                           : 0.0;
    std::vector<double> w(scope.counts.size());
    for (std::size_t e = 0; e < w.size(); ++e) {
      w[e] = a * scope.counts[e] + a_s * sequence.counts[e] + a_g * global.counts[e];
    }
    return w;
  }

  // The global aux loss's counts for each micro-batch scope (in scopes_' order, dp-major): the whole step's, or
  // (running) those of micro-batches 0..m of every DP rank.
  void global_counts(const Case& c) {
    const std::size_t width = scopes_.empty() ? 0 : scopes_.front().counts.size();
    const auto ga = static_cast<std::size_t>(c.layout.ga);
    std::vector<router::ScopeSums> upto;  // per micro-batch index m: micro-batches 0..m over every DP rank
    for (std::size_t m = 0; m < ga; ++m) {
      router::ScopeSums sums = m == 0 ? router::ScopeSums(width) : upto.back();
      for (std::size_t dp = 0; dp < static_cast<std::size_t>(c.layout.dp); ++dp) {
        const router::ScopeSums& s = scopes_[dp * ga + m];
        for (std::size_t e = 0; e < width; ++e) sums.counts[e] += s.counts[e];
        sums.tokens += s.tokens;
      }
      upto.push_back(std::move(sums));
    }
    const bool running = options_.global_counts == RouterOptions::GlobalCounts::running;
    for (std::size_t b = 0; b < scopes_.size(); ++b) global_.push_back(upto[running ? b % ga : ga - 1]);
  }

  const RouterOptions options_;
  std::int64_t experts_;
  double weight_;
  std::vector<router::ScopeSums> scopes_;
  std::map<std::int64_t, std::size_t> scope_of_;
  std::vector<router::ScopeSums> sequence_scopes_;  // each sequence holding a valid token
  std::vector<double> sequences_in_batch_;          // per sequence scope: its micro-batch's such sequences
  std::map<std::int64_t, std::size_t> sequence_of_;
  std::vector<router::ScopeSums> global_;  // per micro-batch scope: the global aux loss's counts and tokens
  std::int64_t valid_tokens_ = 0;          // of the step
};

}  // namespace

std::unique_ptr<KindReference> make_router_reference(const Case& c, const InputSource& inputs) {
  return std::make_unique<RouterReference>(c, inputs);
}

}  // namespace lossverify
