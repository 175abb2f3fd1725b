// The policy kind (docs/spec.md §3.3): the clipped policy-gradient objective of RL post-training over
// vocabulary-parallel logits, or a trainer's log-probability and entropy pass alone.
#include <algorithm>
#include <array>
#include <cmath>
#include <span>
#include <string>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
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

// A finite number in a range, named in the error when it is not.
double number_in(detail::ObjectReader& r, const std::string& key, double fallback, bool (*ok)(double),
                 const std::string& range) {
  const double v = r.number(key, fallback);
  if (!(std::isfinite(v) && ok(v))) r.fail(key, "must be " + range + ", got " + json(v).dump());
  return v;
}

// Keys that mean something only under a setting are refused without it, by name; 0 leaves such a key unset
// (so `--set key=0` switches off what a case file turned on, beside the setting that needed it).
void refuse_unless(detail::ObjectReader& r, bool applies, const std::string& key, const std::string& needs) {
  if (applies || !r.has(key)) return;
  const json& value = r.raw(key);
  if (!(value.is_number() && value.get<double>() == 0.0))
    r.fail(key, "applies to " + needs + " only (0 leaves it unset)");
}

class PolicyKind final : public LossKind {
 public:
  std::string_view name() const override { return "policy"; }
  std::string_view summary() const override {
    return "RL policy loss over sampled tokens: objective policy_loss|logprob, temperature, clip_low, clip_high, "
           "dual_clip, ratio token|sequence, kl_penalty none|k1|k2|k3, kl_coef, entropy_coef, aggregation "
           "token-mean|token-sum|"
           "seq-mean-token-sum|seq-mean-token-mean|seq-mean-token-sum-norm, norm_constant, whiten_advantages, "
           "whiten_epsilon";
  }

  std::vector<std::string> keys() const override {
    return {"objective",     "temperature",       "clip_low",      "clip_high",    "dual_clip",
            "ratio",         "kl_penalty",        "kl_coef",       "entropy_coef", "aggregation",
            "norm_constant", "whiten_advantages", "whiten_epsilon"};
  }

  void parse(detail::ObjectReader& r, LossSpec& loss) const override {
    if (r.has("reduction")) {
      r.fail("reduction", "a policy loss aggregates its tokens by \"aggregation\", not by reduction");
    }
    auto o = std::make_shared<PolicyOptions>();
    o->objective = detail::parse_choice(r, "objective", kObjectives, Objective::policy_loss);
    o->temperature = number_in(
        r, "temperature", 1.0, [](double v) { return v > 0.0 && v <= kMaxTemperature; }, "in (0, 1e6]");
    o->entropy_coef = number_in(
        r, "entropy_coef", 0.0, [](double v) { return v >= 0.0 && v <= 1e3; }, "in [0, 1000]");
    o->aggregation = detail::parse_choice(r, "aggregation", kAggregations, Aggregation::token_mean);
    const bool norm = o->aggregation == Aggregation::seq_mean_token_sum_norm;
    refuse_unless(r, norm, "norm_constant", "aggregation seq-mean-token-sum-norm");
    if (norm) {
      if (!r.has("norm_constant")) r.fail_here("aggregation seq-mean-token-sum-norm needs norm_constant (H_max)");
      // H_max, a generation length: its weights 1 / (B H_max) stay at most 1e6, far inside float32's reach.
      o->norm_constant = number_in(
          r, "norm_constant", 0.0, [](double v) { return v >= 1e-6 && v <= 1e12; }, "in [1e-6, 1e12]");
    }
    const bool surrogate = o->objective == Objective::policy_loss;
    for (const char* key : {"clip_low", "clip_high", "dual_clip", "ratio", "kl_penalty", "kl_coef", "whiten_advantages",
                            "whiten_epsilon"}) {
      refuse_unless(r, surrogate, key, "objective policy_loss");
    }
    if (surrogate) parse_surrogate(r, *o);
    loss.reduction = o->aggregation == Aggregation::token_mean ? Reduction::mean : Reduction::sum;
    loss.options = std::move(o);
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

  void resolve(const LossSpec& loss, json& l) const override {
    const PolicyOptions& o = policy_options(loss);
    l.erase("reduction");
    l["objective"] = to_string(o.objective);
    l["temperature"] = o.temperature;
    l["entropy_coef"] = o.entropy_coef;
    l["aggregation"] = to_string(o.aggregation);
    if (o.aggregation == Aggregation::seq_mean_token_sum_norm) l["norm_constant"] = o.norm_constant;
    if (o.objective != Objective::policy_loss) return;
    l["clip_low"] = o.clip_low;
    l["clip_high"] = o.clip_high;
    if (o.dual_clip > 0.0) l["dual_clip"] = o.dual_clip;
    l["ratio"] = to_string(o.ratio);
    l["kl_penalty"] = to_string(o.kl);
    if (o.kl != Kl::none) l["kl_coef"] = o.kl_coef;
    l["whiten_advantages"] = o.whiten_advantages;
    if (o.whiten_advantages) l["whiten_epsilon"] = o.whiten_epsilon;
  }

  KindInputs inputs() const override { return {true, false}; }
  std::vector<std::string> token_inputs(const LossSpec& spec) const override {
    if (policy_options(spec).objective != Objective::policy_loss) return {};
    return {std::begin(kPolicyTokenInputNames), std::end(kPolicyTokenInputNames)};
  }
  void token_input_values(const Case& c, const InputSource& inputs, std::int64_t token,
                          std::span<float> out) const override {
    const PolicyTokenInputs in = policy_token_inputs(c, inputs, token);
    const float values[] = {in.old_logprob, in.ref_logprob, in.advantage};
    std::copy_n(values, std::min(out.size(), std::size(values)), out.begin());
  }

  bool logs_loss_in_input_dtype() const override { return false; }
  KindRowPlan plan_rows(const RowPlanRequest& request) const override { return plan_policy_rows(request); }
  std::vector<std::string> token_quantities() const override { return {"logprob", "entropy"}; }
  std::vector<std::string> logged_statistics() const override {
    return {"clip_fraction", "dual_clip_fraction", "kl", "entropy"};
  }

  std::string row_sum_rule() const override { return "sum_v grad = 0 for every token"; }

  std::vector<Implementation> catalogue() const override { return policy_catalogue(); }

  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    return make_policy_reference(c, inputs);
  }

  // The GPU oracle: softmax of x / T, the label's column, and each row's g_lambda and H from the reference.
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

 private:
  static void parse_surrogate(detail::ObjectReader& r, PolicyOptions& o) {
    o.clip_low = number_in(
        r, "clip_low", 0.2, [](double v) { return v > 0.0 && v < 1.0; }, "in (0, 1)");
    o.clip_high = number_in(
        r, "clip_high", o.clip_low, [](double v) { return v > 0.0 && v <= 1e3; }, "in (0, 1000]");
    if (r.has("dual_clip")) {
      o.dual_clip = number_in(
          r, "dual_clip", 0.0, [](double v) { return v == 0.0 || (v > 1.0 && v <= 1e3); }, "in (1, 1000], or 0 (off)");
    } else {
      r.allow("dual_clip");
    }
    o.ratio = detail::parse_choice(r, "ratio", kRatios, Ratio::token);
    o.kl = detail::parse_choice(r, "kl_penalty", kKls, Kl::none);
    refuse_unless(r, o.kl != Kl::none, "kl_coef", "a kl_penalty other than none");
    if (o.kl != Kl::none) {
      o.kl_coef = number_in(
          r, "kl_coef", 0.0, [](double v) { return v >= 0.0 && v <= 1e3; }, "in [0, 1000]");
    }
    o.whiten_advantages = r.boolean("whiten_advantages", false);
    refuse_unless(r, o.whiten_advantages, "whiten_epsilon", "whiten_advantages true");
    if (o.whiten_advantages) {
      o.whiten_epsilon = number_in(
          r, "whiten_epsilon", 1e-6, [](double v) { return v > 0.0 && v <= 1e3; }, "in (0, 1000]");
    }
  }
};

}  // namespace

const PolicyOptions& policy_options(const LossSpec& loss) {
  static const PolicyOptions defaults;
  const auto* o = dynamic_cast<const PolicyOptions*>(loss.options.get());
  return o != nullptr ? *o : defaults;
}

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
