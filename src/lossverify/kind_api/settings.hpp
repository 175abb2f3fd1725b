#pragma once
// A kind's settings, declared once (docs/development.md, "A kind's settings"). Each entry of a kind's table names
// one key of the case's "loss" section with its type, fallback, range or choices, the setting it depends on, and
// how it reaches a plugin; from the table alone lossverify parses and checks the key, writes it back in the
// resolved case, offers it to shrink, lists it, and carries it to plugins (lv_rank_inputs.settings) and to the
// Python package (the resolved case). Cross-field checks that need the whole case stay in LossKind::validate.
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lossverify {

struct LossSpec;

// What a kind keeps of its settings beyond LossSpec's shared fields: its table's setters write it, and only that
// kind reads it (case/kind_settings.hpp: options_of, edit_options).
struct KindOptions {
  virtual ~KindOptions() = default;
};

// A setting means something only where another setting of the same kind has one of `values` (as the case
// resolves it). Elsewhere the key is refused unless it is 0 (so `--set key=0` switches off what a case file turned
// on), is not written back, and reads as its fallback.
struct SettingCondition {
  std::string key;
  std::vector<nlohmann::json> values;
  std::string words;  // "objective policy_loss": the refusal says the key "applies to <words> only"
};

struct Setting {
  enum class Type { number, integer, boolean, choice };

  std::string key;
  Type type = Type::number;
  std::string meaning;  // one line, for `lossverify list` and the docs
  nlohmann::json fallback;
  std::string fallback_from;  // when absent, another setting's value (clip_high: clip_low); "" for `fallback`
  // number and integer: the closed or open range [low, high]; zero_is_off admits 0 besides ("0 (off)").
  double low = -HUGE_VAL, high = HUGE_VAL;
  bool low_open = false, high_open = false, zero_is_off = false;
  std::vector<std::string> choices;  // choice: the names, in the order of the kind's enumeration
  std::optional<SettingCondition> applies;
  bool required = false;         // where it applies, the case must state it (fail_message says why)
  std::string required_message;  // "aggregation seq-mean-token-sum-norm needs norm_constant (H_max)"
  bool written_when_off = true;  // false: resolved() leaves out a zero_is_off setting at 0 (dual_clip)
  std::string simplify;          // shrink tries the fallback and says this ("no label smoothing"); "": never
  bool shrinks_by_half = false;  // integer: shrink halves it (to its low end) while the failure stays (a head's H)
  // The plugin ABI: in_v1_structs, carried by lv_loss_config or lv_policy_config too, so every plugin of the kind
  // reads it; plugin_capability, a bit of lv_plugin.losses that says a plugin knows it. Any other setting reaches
  // a plugin at a value other than its fallback only when the plugin names it ("kind.key", docs/plugins.md).
  bool in_v1_structs = false;
  std::uint32_t plugin_capability = 0;
  std::string capability_name;  // the bit's name in plugin.h, for the refusal
  // Bound to where the kind keeps the value (case/kind_settings.hpp builds these from a member pointer).
  std::function<nlohmann::json(const LossSpec&)> get;
  std::function<void(LossSpec&, const nlohmann::json&)> set;

  Setting& range(double lo, double hi, bool lo_open = false, bool hi_open = false) {
    low = lo, high = hi, low_open = lo_open, high_open = hi_open;
    return *this;
  }
  Setting& or_zero_for_off(bool written = true) {
    zero_is_off = true;
    written_when_off = written;
    return *this;
  }
  Setting& when(std::string other, std::vector<nlohmann::json> values, std::string words) {
    applies = SettingCondition{std::move(other), std::move(values), std::move(words)};
    return *this;
  }
  Setting& needed(std::string message) {
    required = true;
    required_message = std::move(message);
    return *this;
  }
  Setting& default_from(std::string other) {
    fallback_from = std::move(other);
    return *this;
  }
  Setting& shrinks_as(std::string words) {
    simplify = std::move(words);
    return *this;
  }
  Setting& halves_in_shrink() {
    shrinks_by_half = true;
    return *this;
  }
  Setting& described(std::string words) {
    meaning = std::move(words);
    return *this;
  }
  Setting& v1_struct() {
    in_v1_structs = true;
    return *this;
  }
  Setting& capability(std::uint32_t bit, std::string name) {
    plugin_capability = bit;
    capability_name = std::move(name);
    return *this;
  }

  // "in [0, 1)", "0 (off) or in [1e-6, 1e6]", "one of pytorch|megatron", "true or false".
  std::string allowed() const;
  bool in_range(double v) const {
    if (zero_is_off && v == 0.0) return true;
    return std::isfinite(v) && (low_open ? v > low : v >= low) && (high_open ? v < high : v <= high);
  }
};

using SettingTable = std::vector<Setting>;

// A number as the range texts write it: 1000, 0.2, 1e6, 1e-6.
std::string format_bound(double v);

}  // namespace lossverify
