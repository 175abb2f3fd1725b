// The router kind's float64 reference (../shared/MOE.md §1, docs/spec.md §10), from the definitions and the layout
// alone. Every scope (one DP rank's micro-batch: its tokens over CP, and over TP under sequence parallelism; each of
// its sequences; the global batch's counts) is routed, layer by layer, from the reference's own reading of the
// logits; a token's loss is the sum over layers of
//   l_t = a <c, s_t> + a_s <c_s, s_t> / S + a_g <c^G, s_t> + alpha_z / T lse(z_t)^2
// with constant counts, and its weight in L is 1 / (DP GA) (the mean of the micro-batches' losses) or, in per-token
// mode, T_S / N (each micro-batch's share of the step's valid tokens).
#include <cmath>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/inputs/input_source.hpp"
#include "lossverify/kinds/router/router_definitions.hpp"
#include "lossverify/kinds/router/router_options.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/kinds/router/router_reference.hpp"
#include "lossverify/layout/rank_layout.hpp"
#include "lossverify/reference/compensated_sum.hpp"

namespace lossverify {

namespace {

router::Score score_of(const RouterOptions& o) {
  return o.score == RouterOptions::Score::softmax ? router::Score::softmax : router::Score::sigmoid;
}

// One layer's scopes, indexed like the reference's token maps.
struct LayerScopes {
  std::vector<router::ScopeSums> batch;      // per micro-batch scope (dp-major)
  std::vector<router::ScopeSums> sequences;  // per sequence holding a valid token
  std::vector<router::ScopeSums> global;     // per micro-batch scope: the global aux loss's counts and tokens
};

class RouterReference final : public KindReference, public router::DeviceTerms {
 public:
  // `routing` empty: every token routed here, from the reference's own reading of its logits, and every token's terms
  // evaluated here too; else a GPU oracle's float64 routing, whose terms it sets (set_terms) for the rows it judges.
  RouterReference(const Case& c, const InputSource& inputs, router::RoutingSource routing)
      : options_(router_options(c.loss)),
        layers_(static_cast<std::size_t>(options_.layers)),
        experts_(static_cast<std::size_t>(c.shape.vocab) / layers_),
        ga_(static_cast<std::size_t>(c.layout.ga)),
        scopes_(layers_),
        routing_(std::move(routing)) {
    route(c, inputs);
    for (LayerScopes& layer : scopes_) layer.global = global_counts(c, layer.batch);
    if (options_.pool_layers) {  // one aux loss over every layer's counts and tokens (transformers)
      for (std::size_t b = 0; b < scopes_.front().batch.size(); ++b) {
        router::ScopeSums pooled(experts_);
        for (const LayerScopes& layer : scopes_) pooled.merge(layer.batch[b]);
        pooled_.push_back(std::move(pooled));
      }
    }
    const double n = static_cast<double>(valid_tokens_);
    for (const router::ScopeSums& scope : scopes_.front().batch) {
      scope_weight_.push_back(options_.scaling == RouterOptions::Scaling::per_token
                                  ? scope.tokens / n
                                  : 1.0 / (static_cast<double>(c.layout.dp) * static_cast<double>(c.layout.ga)));
    }
    if (!routing_) evaluate_terms(inputs);
  }

  // router::DeviceTerms: what a GPU oracle evaluates the rows with, and gives back.
  std::vector<double> weight_table(bool ties) const override {
    std::vector<double> table;
    table.reserve(sequence_batch_.size() * layers_ * experts_);
    for (std::size_t j = 0; j < sequence_batch_.size(); ++j) {
      for (std::size_t l = 0; l < layers_; ++l) {
        const std::vector<double> w = aux_weights_of(l, sequence_batch_[j], j, ties);
        table.insert(table.end(), w.begin(), w.end());
      }
    }
    return table;
  }
  std::int64_t weight_slot(std::int64_t token) const override {
    const auto j = sequence_of_.find(token);
    return j == sequence_of_.end() ? -1 : static_cast<std::int64_t>(j->second);
  }
  double z_weight(std::int64_t token) const override {
    return options_.z_loss_coef / scopes_.front().batch[scope_of_.at(token)].tokens;
  }
  bool any_ties() const override { return !tie_tokens_.empty(); }
  void set_terms(std::int64_t token, std::span<const double> terms) override {
    term_of_[token] = terms_.size() / (2 * layers_);
    for (std::size_t l = 0; l < layers_; ++l) {
      terms_.push_back(terms[3 * l]);
      terms_.push_back(terms[3 * l + 1]);
      if (!tie_tokens_.empty()) tie_terms_.push_back(terms[3 * l + 2]);
    }
  }

  RowPartial partial(std::int64_t, std::int64_t, std::span<const double>, std::span<const double>) const override {
    return {};
  }
  RowStats stats(const RowPartial&) const override { return {}; }
  // l_t over the whole row (rows are whole on every rank: one slice), from the logits the oracle read.
  bool needs_value_pass() const override { return true; }
  std::pair<double, double> value_partial(std::int64_t token, const RowStats&, std::span<const double> logits,
                                          std::span<const double>) const override {
    std::vector<double> s(experts_);
    CompensatedSum loss;
    for (std::size_t l = 0; l < layers_; ++l) {
      const std::span<const double> z = logits.subspan(l * experts_, experts_);
      router::scores(score_of(options_), z, s);
      const std::vector<double> w = aux_weights(l, token);
      for (std::size_t e = 0; e < experts_; ++e) loss.add(w[e] * s[e]);
      loss.add(router::z_loss(z, z_weight(token)));
    }
    return {loss.value(), 0.0};
  }
  double token_loss(std::int64_t, const RowStats& st) const override { return st.value; }
  std::optional<double> token_weight(std::int64_t token) const override { return scope_weight_[scope_of_.at(token)]; }
  // The logged aux loss and z-loss, means over layers, then each layer's: the sum over tokens of w_t times the
  // token's term, given as per-token values whose mean over the step's valid tokens is that sum.
  void token_statistics(std::int64_t token, const RowStats&, std::span<double> out) const override {
    const double share = static_cast<double>(valid_tokens_) * scope_weight_[scope_of_.at(token)];
    const double* terms = &terms_[term_of_.at(token) * 2 * layers_];
    double aux = 0.0, z = 0.0;
    for (std::size_t l = 0; l < layers_; ++l) {
      aux += terms[2 * l];
      z += terms[2 * l + 1];
      if (layers_ > 1) {
        out[2 + 2 * l] = share * terms[2 * l];
        out[3 + 2 * l] = share * terms[2 * l + 1];
      }
    }
    out[0] = share * aux / logged_aux_divisor(options_);
    out[1] = share * z / static_cast<double>(layers_);
  }
  void gradient(std::int64_t token, const RowStats&, double weight, std::int64_t, std::span<const double> logits,
                std::span<const double>, std::span<double> grad) const override {
    std::vector<double> aux(experts_), z(experts_);
    for (std::size_t l = 0; l < layers_; ++l) {
      const std::span<const double> x = logits.subspan(l * experts_, experts_);
      router::aux_gradient(score_of(options_), x, aux_weights(l, token), 1.0, aux);
      router::z_loss_gradient(x, z_weight(token), z);
      for (std::size_t e = 0; e < experts_; ++e) grad[l * experts_ + e] = weight * (aux[e] + z[e]);
    }
  }
  std::optional<double> gradient_row_sum(const RowStats&, double) const override { return std::nullopt; }

  // MOE.md §3's bound for the scopes' tie tokens: each may move one count between its k-th and (k+1)-th experts, so a
  // token's weights may move by up to the weights of |delta c| (tw), its loss by <tw, s_t> and its gradient by
  // |w| s_t,e slope_e (tw_e + <tw, s_t>) per layer.
  LossArithmetic token_loss_arithmetic(std::int64_t token, const RowStats&) const override {
    LossArithmetic a;
    if (tie_tokens_.empty()) return a;
    const double* bound = &tie_terms_[term_of_.at(token) * layers_];
    for (std::size_t l = 0; l < layers_; ++l) a.either_way += bound[l];
    return a;
  }
  void token_statistic_rounding(std::int64_t token, const RowStats&, std::span<double> out) const override {
    std::fill(out.begin(), out.end(), 0.0);
    if (tie_tokens_.empty()) return;
    const double share = static_cast<double>(valid_tokens_) * scope_weight_[scope_of_.at(token)];
    const double* bound = &tie_terms_[term_of_.at(token) * layers_];
    for (std::size_t l = 0; l < layers_; ++l) {
      out[0] += share * bound[l] / logged_aux_divisor(options_);
      if (layers_ > 1) out[2 + 2 * l] = share * bound[l];
    }
  }
  bool has_gradient_slack() const override { return !tie_tokens_.empty(); }
  void gradient_slack(std::int64_t token, double weight, std::span<const double> logits,
                      std::span<double> slack) const override {
    std::vector<double> s(experts_);
    for (std::size_t l = 0; l < layers_; ++l) {
      const std::span<const double> z = logits.subspan(l * experts_, experts_);
      router::scores(score_of(options_), z, s);
      const std::vector<double> tie = aux_weights(l, token, true);
      double inner = 0.0;
      for (std::size_t e = 0; e < experts_; ++e) inner += tie[e] * s[e];
      for (std::size_t e = 0; e < experts_; ++e) {
        const double slope =
            options_.score == RouterOptions::Score::softmax ? 1.0 : 1.0 - 1.0 / (1.0 + std::exp(-z[e]));
        slack[l * experts_ + e] = std::fabs(weight) * s[e] * slope * (tie[e] + inner);
      }
    }
  }
  std::int64_t either_way_tokens() const override { return static_cast<std::int64_t>(tie_tokens_.size()); }
  // The micro-batch scope's counts per layer, and the counts its tie tokens may move.
  void scope_values(int dp, int micro_batch, std::span<double> expected, std::span<double> slack) const override {
    const std::size_t b = static_cast<std::size_t>(dp) * ga_ + static_cast<std::size_t>(micro_batch);
    for (std::size_t l = 0; l < layers_; ++l) {
      const router::ScopeSums& scope = scopes_[l].batch[b];
      std::copy(scope.counts.begin(), scope.counts.end(), expected.begin() + static_cast<std::ptrdiff_t>(l * experts_));
      std::copy(scope.ties.begin(), scope.ties.end(), slack.begin() + static_cast<std::ptrdiff_t>(l * experts_));
    }
  }

 private:
  // Pass 1: every valid token routed in every layer, into its micro-batch's and its sequence's scope.
  void route(const Case& c, const InputSource& inputs) {
    std::vector<double> z(experts_ * layers_), s(experts_);
    std::vector<float> raw(z.size());
    for (int dp = 0; dp < c.layout.dp; ++dp) {
      for (int k = 0; k < c.layout.ga; ++k) {
        const std::size_t first_sequence = sequence_weight_.size();
        std::vector<router::ScopeSums> batch(layers_, router::ScopeSums(experts_));
        for (const std::int64_t q : sequences_of_slot(inputs.batch(), c.batch, c.layout, dp, k)) {
          const Sequence& seq = inputs.batch().sequences()[static_cast<std::size_t>(q)];
          std::vector<router::ScopeSums> own(layers_, router::ScopeSums(experts_));
          for (std::int64_t t = seq.begin; t < seq.begin + seq.length; ++t) {
            if (!inputs.is_valid(t)) continue;
            ++valid_tokens_;
            if (!routing_) {
              inputs.logits(t, 0, static_cast<std::int64_t>(z.size()), raw.data());
              for (std::size_t e = 0; e < z.size(); ++e) z[e] = raw[e];
            }
            for (std::size_t l = 0; l < layers_; ++l) {
              const router::TopK routed = routing_ ? routing_(t, l) : route_token(z, s, l);
              batch[l].count(routed);
              own[l].count(routed);
              if (user_tie(c, inputs, t, l, routed)) {
                batch[l].add_tie(routed);
                own[l].add_tie(routed);
                tie_tokens_[t] = 1;
              }
            }
            scope_of_[t] = scopes_.front().batch.size();
            sequence_of_[t] = scopes_.front().sequences.size();
          }
          if (own.front().tokens == 0.0) continue;
          for (std::size_t l = 0; l < layers_; ++l) scopes_[l].sequences.push_back(std::move(own[l]));
          sequence_weight_.push_back(0.0);
          sequence_batch_.push_back(scopes_.front().batch.size());
        }
        // The micro-batch's sequence aux loss is the mean over its sequences that hold a valid token.
        const auto held = static_cast<double>(sequence_weight_.size() - first_sequence);
        for (std::size_t j = first_sequence; j < sequence_weight_.size(); ++j) sequence_weight_[j] = 1.0 / held;
        for (std::size_t l = 0; l < layers_; ++l) scopes_[l].batch.push_back(std::move(batch[l]));
      }
    }
  }

  // Whether a token ties (router::ties: a float32 router may route it either way, MOE.md §3). Generated logits are
  // refused there (the case's seed or scale moves them apart), so that a run and a dump of its inputs judge alike. A
  // user's own logits (a dump's, a case's override row) may tie: the token is then counted as moving one count between
  // those two experts, and every tolerance of the scope widens by the bound that implies.
  bool user_tie(const Case& c, const InputSource& inputs, std::int64_t t, std::size_t layer,
                const router::TopK& routed) const {
    if (router::groups_tie(routed)) {
      throw CaseError(c.source + ": token " + std::to_string(t) + "'s " + std::to_string(options_.top_groups) +
                      "-th and next expert groups of layer " + std::to_string(layer) +
                      " tie within float32 rounding: every count of the token may move, which no bound covers "
                      "(MOE.md section 3)");
    }
    if (!router::ties(routed)) return false;
    const RowOverride* row = inputs.override_of(t);
    const bool users = inputs.is_explicit() || (row != nullptr && !row->logits.empty());
    if (users) return true;
    throw CaseError(c.source + ": token " + std::to_string(t) + "'s " + std::to_string(counted_per_token()) +
                    "-th and next router scores of layer " + std::to_string(layer) +
                    " tie within float32 rounding (MOE.md section 3); another inputs.seed moves them apart");
  }

  // The global aux loss's counts for each micro-batch scope (dp-major): the whole step's, or (running) those of
  // micro-batches 0..m of every DP rank.
  std::vector<router::ScopeSums> global_counts(const Case& c, const std::vector<router::ScopeSums>& batch) const {
    const auto ga = static_cast<std::size_t>(c.layout.ga);
    std::vector<router::ScopeSums> upto;  // per micro-batch index m: micro-batches 0..m over every DP rank
    for (std::size_t m = 0; m < ga; ++m) {
      router::ScopeSums sums = m == 0 ? router::ScopeSums(experts_) : upto.back();
      for (std::size_t dp = 0; dp < static_cast<std::size_t>(c.layout.dp); ++dp) sums.merge(batch[dp * ga + m]);
      upto.push_back(std::move(sums));
    }
    const bool running = options_.global_counts == RouterOptions::GlobalCounts::running;
    std::vector<router::ScopeSums> out;
    for (std::size_t b = 0; b < batch.size(); ++b) out.push_back(upto[running ? b % ga : ga - 1]);
    return out;
  }

  // Pass 2, for the logged values: each valid token's aux and z terms per layer, from the reference's own reading.
  void evaluate_terms(const InputSource& inputs) {
    std::vector<double> z(experts_ * layers_), s(experts_);
    std::vector<float> raw(z.size());
    for (const auto& [t, b] : scope_of_) {
      (void)b;
      term_of_[t] = terms_.size() / (2 * layers_);
      inputs.logits(t, 0, static_cast<std::int64_t>(z.size()), raw.data());
      for (std::size_t e = 0; e < z.size(); ++e) z[e] = raw[e];
      for (std::size_t l = 0; l < layers_; ++l) {
        const std::span<const double> x = std::span<const double>(z).subspan(l * experts_, experts_);
        router::scores(score_of(options_), x, s);
        const std::vector<double> w = aux_weights(l, t);
        CompensatedSum aux;
        for (std::size_t e = 0; e < experts_; ++e) aux.add(w[e] * s[e]);
        terms_.push_back(aux.value());
        terms_.push_back(router::z_loss(x, z_weight(t)));
        if (tie_tokens_.empty()) continue;
        const std::vector<double> tie = aux_weights(l, t, true);
        double bound = 0.0;
        for (std::size_t e = 0; e < experts_; ++e) bound += tie[e] * s[e];
        tie_terms_.push_back(bound);
      }
    }
  }

  // The experts a token counts for in the aux terms: its top-k, or its first choice only.
  int counted_per_token() const { return options_.counts == RouterOptions::Counts::first ? 1 : options_.top_k; }
  // A token's map in layer l from its row of logits z: the plain top-k of the scores, or the routed map (the routing
  // scores plus the expert bias, group-limited). `s` is scratch for E scores.
  router::TopK route_token(std::span<const double> z, std::span<double> s, std::size_t layer) const {
    const std::span<const double> x = z.subspan(layer * experts_, experts_);
    router::scores(score_of(options_), x, s);
    if (options_.map == RouterOptions::Map::top_k) return router::top_k(s, counted_per_token());
    std::vector<double> keys(experts_), magnitude(experts_);
    router::routing_scores(score_of(options_), x, keys);
    for (std::size_t e = 0; e < experts_; ++e) {
      const double b = router::expert_bias(options_.expert_bias, static_cast<std::int64_t>(layer),
                                           static_cast<std::int64_t>(e), static_cast<std::int64_t>(experts_));
      magnitude[e] = std::fabs(keys[e]) + std::fabs(b);
      keys[e] += b;
    }
    return router::routed_top_k(keys, magnitude, {options_.top_k, options_.groups, options_.top_groups},
                                counted_per_token());
  }
  // Every aux term is linear in s_t with constant counts: their weights per expert, summed, are the one vector
  // a c + a_s c_s / S + a_g c^G that both the loss and the gradient read.
  // With `ties`: the same weights of the counts the scopes' tie tokens may move (|delta c|), the bound of MOE.md §3.
  std::vector<double> aux_weights(std::size_t layer, std::int64_t token, bool ties = false) const {
    return aux_weights_of(layer, scope_of_.at(token), sequence_of_.at(token), ties);
  }
  // The same for micro-batch scope b's sequence scope j.
  std::vector<double> aux_weights_of(std::size_t layer, std::size_t b, std::size_t j, bool ties) const {
    const LayerScopes& scopes = scopes_[layer];
    const router::ScopeSums& scope = options_.pool_layers ? pooled_[b] : scopes.batch[b];
    const router::ScopeSums& sequence = scopes.sequences[j];
    const router::ScopeSums& global = scopes.global[b];
    const double k = aux_k_divisor(options_);
    const double a = router::aux_scale(scope, options_.aux_coef, k);
    const double a_s = router::aux_scale(sequence, options_.seq_aux_coef, k) * sequence_weight_[j];
    // alpha E sum_e f_e P_e with f_e = c^G_e / (k T^G) and P_e = sum_{t in B} p_te / T_B
    const double a_g = global.tokens > 0.0 ? options_.global_aux_coef * static_cast<double>(experts_) /
                                                 (k * global.tokens * scope.tokens)
                                           : 0.0;
    std::vector<double> w(experts_);
    for (std::size_t e = 0; e < w.size(); ++e) {
      w[e] = ties ? a * scope.ties[e] + a_s * sequence.ties[e] + a_g * global.ties[e]
                  : a * scope.counts[e] + a_s * sequence.counts[e] + a_g * global.counts[e];
    }
    return w;
  }

  const RouterOptions options_;
  std::size_t layers_, experts_, ga_;
  std::vector<LayerScopes> scopes_;        // per layer
  std::vector<router::ScopeSums> pooled_;  // per micro-batch scope, every layer's counts and tokens (pool_layers)
  std::unordered_map<std::int64_t, std::size_t> scope_of_;     // token -> micro-batch scope
  std::unordered_map<std::int64_t, std::size_t> sequence_of_;  // token -> sequence scope
  std::vector<double> sequence_weight_;  // per sequence scope: 1 / its micro-batch's sequences holding a valid token
  std::vector<std::size_t> sequence_batch_;                // per sequence scope: its micro-batch scope
  std::vector<double> scope_weight_;                       // per micro-batch scope: a token's weight in L
  std::unordered_map<std::int64_t, std::size_t> term_of_;  // token -> its row of terms_
  std::vector<double> terms_;                              // per valid token and layer: aux, z
  std::int64_t valid_tokens_ = 0;                          // of the step
  std::unordered_map<std::int64_t, char> tie_tokens_;      // tokens of a user's logits whose routing ties
  std::vector<double> tie_terms_;  // per valid token and layer (where any tie): <weights of |delta c|, s_t>
  router::RoutingSource routing_;  // empty: routed here
};

}  // namespace

std::unique_ptr<KindReference> make_router_reference(const Case& c, const InputSource& inputs) {
  return std::make_unique<RouterReference>(c, inputs, router::RoutingSource{});
}

namespace router {

RoutedReference make_routed_reference(const Case& c, const InputSource& inputs, RoutingSource routing) {
  auto reference = std::make_unique<RouterReference>(c, inputs, std::move(routing));
  DeviceTerms* terms = reference.get();
  return {std::move(reference), terms};
}

}  // namespace router

}  // namespace lossverify
