// The policy kind (docs/spec.md §3.3): the clipped policy-gradient objective of RL post-training over
// vocabulary-parallel logits, or a trainer's log-probability and entropy pass alone.
#include <algorithm>
#include <array>
#include <cmath>
#include <span>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/policy/policy_inputs.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"
#include "lossverify/plugin.h"

namespace lossverify {

namespace {

using nlohmann::json;
using Objective = PolicyOptions::Objective;
using Kl = PolicyOptions::Kl;
using Aggregation = PolicyOptions::Aggregation;
using Ratio = PolicyOptions::Ratio;

constexpr std::array kObjectives = {Objective::policy_loss, Objective::logprob};
constexpr std::array kKls = {Kl::none, Kl::k1, Kl::k2, Kl::k3};
constexpr std::array kAggregations = {Aggregation::token_mean, Aggregation::token_sum, Aggregation::seq_mean_token_sum,
                                      Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum_norm};
constexpr std::array kRatios = {Ratio::token, Ratio::sequence};

class PolicyKind final : public LossKind {
 public:
  std::string_view name() const override { return "policy"; }
  std::string_view summary() const override {
    return "RL policy loss over sampled tokens: the clipped surrogate (or a log-prob pass), KL penalty, entropy bonus, "
           "five aggregations, GSPO's sequence ratio";
  }

  const SettingTable& settings() const override {
    using O = PolicyOptions;
    static const SettingTable table = [] {
      const std::vector<json> surrogate = {"policy_loss"};
      const std::string surrogate_words = "objective policy_loss";
      return SettingTable{
          choice_setting("objective", &O::objective, kObjectives, Objective::policy_loss)
              .described("policy_loss: the clipped surrogate; logprob: l = -lambda - c_H H (a trainer's log-prob pass)")
              .v1_struct(),
          number_setting("temperature", &O::temperature, 1.0)
              .range(0.0, kMaxTemperature, true, false)
              .described("T: the log-probabilities and entropy of softmax(x / T)")
              .shrinks_as("temperature 1")
              .v1_struct(),
          number_setting("entropy_coef", &O::entropy_coef, 0.0)
              .range(0.0, 1e3)
              .described("c_H: the entropy bonus")
              .shrinks_as("no entropy bonus")
              .v1_struct(),
          choice_setting("aggregation", &O::aggregation, kAggregations, Aggregation::token_mean)
              .described("how tokens are weighted over the step (docs/spec.md §3.3)")
              .v1_struct(),
          // H_max, a generation length: its weights 1 / (B H_max) stay at most 1e6, far inside float32's reach.
          number_setting("norm_constant", &O::norm_constant, 0.0)
              .range(1e-6, 1e12)
              .when("aggregation", {"seq-mean-token-sum-norm"}, "aggregation seq-mean-token-sum-norm")
              .needed("aggregation seq-mean-token-sum-norm needs norm_constant (H_max)")
              .described("H_max of seq-mean-token-sum-norm (Dr. GRPO)")
              .v1_struct(),
          number_setting("clip_low", &O::clip_low, 0.2)
              .range(0.0, 1.0, true, true)
              .when("objective", surrogate, surrogate_words)
              .described("epsilon_low")
              .v1_struct(),
          number_setting("clip_high", &O::clip_high, 0.2)
              .range(0.0, 1e3, true, false)
              .default_from("clip_low")
              .when("objective", surrogate, surrogate_words)
              .described("epsilon_high (clip_low when absent)")
              .v1_struct(),
          number_setting("dual_clip", &O::dual_clip, 0.0)
              .range(1.0, 1e3, true, false)
              .or_zero_for_off(false)
              .when("objective", surrogate, surrogate_words)
              .described("c: caps -rho A at -c A where A < 0")
              .shrinks_as("no dual clip")
              .v1_struct(),
          choice_setting("ratio", &O::ratio, kRatios, Ratio::token)
              .when("objective", surrogate, surrogate_words)
              .described("token: each token's own ratio; sequence: GSPO's per-sequence ratio")
              .shrinks_as("token ratio")
              .capability(LV_SUPPORTS_POLICY_SEQUENCE_RATIO, "LV_SUPPORTS_POLICY_SEQUENCE_RATIO"),
          choice_setting("kl_penalty", &O::kl, kKls, Kl::none)
              .when("objective", surrogate, surrogate_words)
              .described("the KL estimator against the reference policy")
              .shrinks_as("no KL penalty")
              .v1_struct(),
          number_setting("kl_coef", &O::kl_coef, 0.0)
              .range(0.0, 1e3)
              .when("kl_penalty", {"k1", "k2", "k3"}, "a kl_penalty other than none")
              .described("beta")
              .v1_struct(),
          boolean_setting("whiten_advantages", &O::whiten_advantages, false)
              .when("objective", surrogate, surrogate_words)
              .described("whiten advantages over the step's valid tokens (DP x CP)")
              .shrinks_as("no whitening")
              .v1_struct(),
          number_setting("whiten_epsilon", &O::whiten_epsilon, 1e-6)
              .range(0.0, 1e3, true, false)
              .when("whiten_advantages", {true}, "whiten_advantages true")
              .described("delta in (A - mu) / (sigma + delta)")
              .v1_struct(),
      };
    }();
    return table;
  }

  // A policy loss weighs its tokens by its aggregation, which decides the reduction.
  void parse_extra(detail::ObjectReader& r, LossSpec& loss) const override {
    if (r.has("reduction")) {
      r.fail("reduction", "a policy loss aggregates its tokens by \"aggregation\", not by reduction");
    }
    const bool token_mean = policy_options(loss).aggregation == Aggregation::token_mean;
    loss.reduction = token_mean ? Reduction::mean : Reduction::sum;
  }
  void resolve_extra(const LossSpec& loss, json& l) const override {
    (void)loss;
    l.erase("reduction");
  }

  // Generated logits / T beyond 200: float32 rounding of the scaled logits, not a bug, decides the verdict.
  void validate(const Case& c) const override {
    const double t = policy_options(c.loss).temperature;
    const double reach = generated_reach(c.inputs.mean, c.inputs.scale);
    if (reach / t > kMaxScaledLogit) {
      detail::fail_at(c.source, "$.inputs.scale",
                      "generated logits / temperature reach " + json(reach / t).dump() +
                          ", beyond 200, where float32 rounding of logits / T decides the verdict (raise the "
                          "temperature or lower the scale)");
    }
    for (std::size_t i = 0; i < c.inputs.overrides.size(); ++i) {
      for (const auto& [name, value] : c.inputs.overrides[i].token_inputs) {
        if (name != "advantages" && value > 0.0) {
          detail::fail_at(c.source, "$.inputs.overrides[" + std::to_string(i) + "]." + name,
                          json(value).dump() + " is not a log-probability (> 0)");
        }
      }
    }
  }

  KindInputs inputs() const override { return {true, false}; }
  std::vector<std::string> token_inputs(const LossSpec& spec) const override {
    if (policy_options(spec).objective != Objective::policy_loss) return {};
    return {std::begin(kPolicyTokenInputNames), std::end(kPolicyTokenInputNames)};
  }
  void token_input_values(const Case& c, const InputSource& inputs, std::int64_t token,
                          std::span<float> out) const override {
    const PolicyTokenInputs in = policy_token_inputs(c, inputs, token);  // behind a head: V x H per token
    const float values[] = {in.old_logprob, in.ref_logprob, in.advantage};
    std::copy_n(values, std::min(out.size(), std::size(values)), out.begin());
  }

  bool logs_loss_in_input_dtype() const override { return false; }
  KindRowPlan plan_rows(const RowPlanRequest& request) const override { return plan_policy_rows(request); }
  std::vector<std::string> token_quantities() const override { return {"logprob", "entropy"}; }
  std::vector<std::string> logged_statistics(const LossSpec&) const override {
    return {"clip_fraction", "dual_clip_fraction", "kl", "entropy"};
  }

  std::string row_sum_rule() const override { return "sum_v grad = 0 for every token"; }

  std::vector<Implementation> catalogue() const override { return policy_catalogue(); }

  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    return make_policy_reference(c, inputs);
  }

  // The GPU oracle: softmax of x / T, the label's column, and each row's g_lambda and H from the reference.
  // Its reference bounds the loss, the token values, the statistics and the gradient under an error in the logits
  // (an LM head in front: policy_reference.cpp, docs/spec.md §11).
  bool models_logit_error() const override { return true; }
  std::optional<DeviceRowModel> device_row_model(const Case& c) const override {
    const PolicyOptions& o = policy_options(c.loss);
    DeviceRowModel m;
    m.row_coefficients = true;
    m.temperature = o.temperature;
    m.entropy_coef = o.entropy_coef;
    return m;
  }

  void cpu_micro_batch(const CpuMicroBatch& batch) const override { policy_cpu_micro_batch(batch); }
  static_assert(static_cast<int>(PolicyOptions::Kl::k3) == LV_KL_K3 &&
                    static_cast<int>(Aggregation::seq_mean_token_sum_norm) == LV_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM &&
                    static_cast<int>(Aggregation::seq_mean_token_mean) == LV_AGGREGATION_SEQ_MEAN_TOKEN_MEAN,
                "the ABI's enumerations follow PolicyOptions' order");
  std::optional<int> plugin_kind() const override { return LV_LOSS_POLICY; }
  void plugin_settings(const LossSpec& spec, lv_rank_inputs& settings) const override {
    const PolicyOptions& o = policy_options(spec);
    lv_policy_config& policy = settings.policy;
    lv_loss_config& loss = settings.loss;
    policy.objective = o.objective == Objective::logprob ? LV_POLICY_OBJECTIVE_LOGPROB : LV_POLICY_OBJECTIVE_LOSS;
    policy.temperature = o.temperature;
    loss.temperature = o.temperature;
    policy.clip_low = o.clip_low;
    policy.clip_high = o.clip_high;
    policy.dual_clip = o.dual_clip;
    policy.kl_penalty = static_cast<lv_kl_penalty>(static_cast<int>(o.kl));  // none, k1, k2, k3 in both
    policy.kl_coef = o.kl_coef;
    policy.entropy_coef = o.entropy_coef;
    policy.aggregation = static_cast<lv_aggregation>(static_cast<int>(o.aggregation));  // the same order
    policy.norm_constant = o.aggregation == Aggregation::seq_mean_token_sum_norm ? o.norm_constant : 0.0;
    policy.whiten_advantages = o.whiten_advantages ? 1 : 0;
    policy.whiten_epsilon = o.whiten_epsilon;
    // Only the surrogate has a ratio (parse refuses the key under objective logprob).
    const bool by_sequence = o.ratio == Ratio::sequence && o.objective == Objective::policy_loss;
    settings.policy_ratio = by_sequence ? LV_POLICY_RATIO_SEQUENCE : LV_POLICY_RATIO_TOKEN;
  }
};

}  // namespace

const PolicyOptions& policy_options(const LossSpec& loss) { return options_of<PolicyOptions>(loss); }
PolicyOptions& edit_policy_options(LossSpec& loss) { return edit_options<PolicyOptions>(loss); }

std::string_view to_string(PolicyOptions::Objective o) { return o == Objective::logprob ? "logprob" : "policy_loss"; }

std::string_view to_string(PolicyOptions::Kl k) {
  switch (k) {
    case Kl::k1:
      return "k1";
    case Kl::k2:
      return "k2";
    case Kl::k3:
      return "k3";
    case Kl::none:
      break;
  }
  return "none";
}

std::string_view to_string(PolicyOptions::Aggregation a) {
  switch (a) {
    case Aggregation::token_sum:
      return "token-sum";
    case Aggregation::seq_mean_token_sum:
      return "seq-mean-token-sum";
    case Aggregation::seq_mean_token_mean:
      return "seq-mean-token-mean";
    case Aggregation::seq_mean_token_sum_norm:
      return "seq-mean-token-sum-norm";
    case Aggregation::token_mean:
      break;
  }
  return "token-mean";
}

std::string_view to_string(PolicyOptions::Ratio r) { return r == Ratio::sequence ? "sequence" : "token"; }

std::unique_ptr<LossKind> make_policy_kind() { return std::make_unique<PolicyKind>(); }

}  // namespace lossverify
