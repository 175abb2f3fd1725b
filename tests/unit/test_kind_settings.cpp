// A kind's settings table (kind_api/settings.hpp) at work: one declaration per setting drives the case reader's
// checks, the resolved case, and the block that carries the settings to a plugin.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "lossverify/case/kind_settings.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/plugin/plugin_library.hpp"
#include "lossverify/impl/plugin/settings_block.hpp"
#include "lossverify/kind_api/registry.hpp"
#include "lossverify/kinds/policy/policy_options.hpp"
#include "test_support.hpp"

namespace lossverify {

namespace {

nlohmann::json policy_case(nlohmann::json loss) {
  nlohmann::json doc = testing::case_json(8, 32, 1);
  loss["kind"] = "policy";
  doc["loss"] = loss;
  return doc;
}

std::string refusal(const nlohmann::json& doc) {
  try {
    (void)testing::make_case(doc);
  } catch (const CaseError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a setting's range, choices and condition come from its table entry") {
  CHECK(refusal(policy_case({{"clip_low", 1.0}})) == "<test>: $.loss.clip_low: must be in (0, 1), got 1.0");
  CHECK(refusal(policy_case({{"entropy_coef", 1001.0}})) ==
        "<test>: $.loss.entropy_coef: must be in [0, 1000], got 1001.0");
  CHECK(refusal(policy_case({{"ratio", "group"}})) ==
        "<test>: $.loss.ratio: expected one of token|sequence, got \"group\"");
  // A key that does not apply is refused by name, unless it is 0.
  CHECK(refusal(policy_case({{"kl_coef", 0.1}})) ==
        "<test>: $.loss.kl_coef: applies to a kl_penalty other than none only (0 leaves it unset)");
  CHECK(refusal(policy_case({{"kl_coef", 0.0}})).empty());
  // Conditions nest: kl_penalty applies to the surrogate only, so kl_coef does not apply under objective logprob.
  CHECK(refusal(policy_case({{"objective", "logprob"}, {"kl_penalty", "k3"}, {"kl_coef", 0.1}})) ==
        "<test>: $.loss.kl_penalty: applies to objective policy_loss only (0 leaves it unset)");
  CHECK(refusal(policy_case({{"aggregation", "seq-mean-token-sum-norm"}})) ==
        "<test>: $.loss: aggregation seq-mean-token-sum-norm needs norm_constant (H_max)");
}

TEST_CASE("a fallback may come from another setting, and a setting that does not apply is not written back") {
  const Case c = testing::make_case(policy_case({{"clip_low", 0.1}}));
  CHECK(policy_options(c.loss).clip_high == 0.1);
  const nlohmann::json loss = c.resolved()["loss"];
  CHECK(loss["clip_high"] == 0.1);
  CHECK_FALSE(loss.contains("kl_coef"));
  CHECK_FALSE(loss.contains("dual_clip"));  // 0, which resolves to off and is left out
  CHECK_FALSE(loss.contains("norm_constant"));
  // The resolved case reads back as the same case.
  nlohmann::json doc = policy_case({});
  doc["loss"] = loss;
  CHECK(testing::make_case(doc).resolved()["loss"] == loss);
}

TEST_CASE("the settings block carries every setting whole, numbers exactly") {
  const Case c = testing::make_case(policy_case(
      {{"clip_low", 0.1}, {"whiten_advantages", true}, {"whiten_epsilon", 1.0 / 3.0}, {"kl_penalty", "k2"}}));
  std::vector<plugin_host::EncodedSetting> encoded;
  for (const Setting& s : kind_of(c.loss).settings()) {
    plugin_host::EncodedSetting e;
    e.name = s.key;
    const nlohmann::json v = s.get(c.loss);
    if (v.is_string()) {
      e.type = LV_SETTING_CHOICE;
      e.choice = v.get<std::string>();
    } else if (v.is_boolean()) {
      e.type = LV_SETTING_BOOLEAN;
      e.integer = v.get<bool>() ? 1 : 0;
    } else {
      e.number = v.get<double>();
    }
    encoded.push_back(e);
  }
  const plugin_host::SettingsBlock block(plugin_host::encode_settings("policy", encoded));
  REQUIRE(block.ok());
  CHECK(std::string(block.kind()) == "policy");
  REQUIRE(block.size() == static_cast<std::int64_t>(encoded.size()));
  for (std::int64_t i = 0; i < block.size(); ++i) {
    const lv_setting& s = block.data()[i];
    const auto& e = encoded[static_cast<std::size_t>(i)];
    CAPTURE(e.name);
    CHECK(std::string(s.name) == e.name);
    CHECK(s.type == e.type);
    if (e.type == LV_SETTING_NUMBER) CHECK(s.number == e.number);  // bit for bit (hexadecimal)
    if (e.type == LV_SETTING_CHOICE) CHECK(std::string(s.choice) == e.choice);
    if (e.type == LV_SETTING_BOOLEAN) CHECK(s.integer == e.integer);
  }
  // lv_find_setting, the plugin's side of it.
  lv_rank_inputs in{};
  in.struct_size = sizeof in;
  in.settings = block.data();
  in.settings_count = block.size();
  REQUIRE(lv_find_setting(&in, "whiten_epsilon") != nullptr);
  CHECK(lv_find_setting(&in, "whiten_epsilon")->number == 1.0 / 3.0);
  CHECK(std::string(lv_find_setting(&in, "kl_penalty")->choice) == "k2");
  CHECK(lv_find_setting(&in, "whiten") == nullptr);
  in.struct_size = offsetof(lv_rank_inputs, loss_kind);  // a lossverify from before the block
  CHECK(lv_find_setting(&in, "whiten_epsilon") == nullptr);
  // A block a corrupted region would hold is refused, not half read.
  CHECK_FALSE(plugin_host::SettingsBlock("policy\n0\tclip_low").ok());
  CHECK_FALSE(plugin_host::SettingsBlock("policy\n0\tclip_low\t0x1p-3zz\n").ok());
  CHECK_THROWS_AS(plugin_host::encode_settings("po\nlicy", {}), InternalError);
}

TEST_CASE("a setting outside the v1 structures reaches a plugin only when the plugin says it knows it") {
  PluginLibrary plugin;
  plugin.losses = LV_SUPPORTS_POLICY;
  const Case token = testing::make_case(policy_case({}));
  const Case sequence = testing::make_case(policy_case({{"ratio", "sequence"}}));
  CHECK(missing_plugin_capability(plugin, token.loss).empty());  // at its fallback: every plugin computes it
  const std::string missing = missing_plugin_capability(plugin, sequence.loss);
  CHECK(missing.find("the policy setting ratio sequence") == 0);
  CHECK(missing.find("LV_SUPPORTS_POLICY_SEQUENCE_RATIO") != std::string::npos);
  CHECK(missing.find("\"policy.ratio\"") != std::string::npos);
  plugin.names = {"policy.ratio"};  // by name
  CHECK(missing_plugin_capability(plugin, sequence.loss).empty());
  plugin.names.clear();
  plugin.losses |= LV_SUPPORTS_POLICY_SEQUENCE_RATIO;  // or by the setting's capability bit
  CHECK(missing_plugin_capability(plugin, sequence.loss).empty());
}

TEST_CASE("format_bound writes bounds as the range texts do") {
  CHECK(format_bound(0.0) == "0");
  CHECK(format_bound(1000.0) == "1000");
  CHECK(format_bound(1e6) == "1e6");
  CHECK(format_bound(1e-6) == "1e-6");
  CHECK(format_bound(1e12) == "1e12");
  CHECK(format_bound(0.2) == "0.2");
}

}  // namespace lossverify
