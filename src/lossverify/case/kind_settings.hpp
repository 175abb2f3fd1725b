#pragma once
// A kind's settings table at work (kind_api/settings.hpp): the case reader's parse and write-back of the keys a
// kind declares, and the bindings from a table entry to a field of the kind's options.
#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "lossverify/case/case.hpp"
#include "lossverify/kind_api/settings.hpp"

namespace lossverify {

namespace detail {
class ObjectReader;
}

// Where a table's options live in a LossSpec: the kind's (`options`) or its stage's (`stage_options`).
using OptionsSlot = std::shared_ptr<const KindOptions> LossSpec::*;

// The kind's options in a case (its defaults when the case has none of them yet); with `slot`, the stage's.
template <class Options>
const Options& options_of(const LossSpec& loss, OptionsSlot slot = &LossSpec::options) {
  static const Options defaults;
  const auto* o = dynamic_cast<const Options*>((loss.*slot).get());
  return o != nullptr ? *o : defaults;
}

// A writable copy, installed in `loss` (options are shared between copies of a case until one is edited).
template <class Options>
Options& edit_options(LossSpec& loss, OptionsSlot slot = &LossSpec::options) {
  auto fresh = std::make_shared<Options>(options_of<Options>(loss, slot));
  Options& edited = *fresh;
  loss.*slot = std::move(fresh);
  return edited;
}

// Table entries bound to a field of the kind's options (a number or a boolean, read and written as JSON); a stage's
// table passes the slot &LossSpec::stage_options.
template <class Options, class Value>
Setting field_setting(std::string key, Value Options::*field, Value fallback, Setting::Type type,
                      OptionsSlot slot = &LossSpec::options) {
  Setting s;
  s.key = std::move(key);
  s.type = type;
  s.fallback = fallback;
  s.get = [field, slot](const LossSpec& l) { return nlohmann::json(options_of<Options>(l, slot).*field); };
  s.set = [field, slot](LossSpec& l, const nlohmann::json& v) {
    edit_options<Options>(l, slot).*field = v.get<Value>();
  };
  return s;
}

template <class Options>
Setting number_setting(std::string key, double Options::*field, double fallback,
                       OptionsSlot slot = &LossSpec::options) {
  return field_setting(std::move(key), field, fallback, Setting::Type::number, slot);
}

template <class Options>
Setting integer_setting(std::string key, int Options::*field, int fallback, OptionsSlot slot = &LossSpec::options) {
  return field_setting(std::move(key), field, fallback, Setting::Type::integer, slot);
}

template <class Options>
Setting boolean_setting(std::string key, bool Options::*field, bool fallback, OptionsSlot slot = &LossSpec::options) {
  return field_setting(std::move(key), field, fallback, Setting::Type::boolean, slot);
}

// An enumeration named by to_string(Enum); `values` in the enumeration's order.
template <class Options, class Enum, std::size_t N>
Setting choice_setting(std::string key, Enum Options::*field, const std::array<Enum, N>& values, Enum fallback,
                       OptionsSlot slot = &LossSpec::options) {
  Setting s;
  s.key = std::move(key);
  s.type = Setting::Type::choice;
  s.fallback = std::string(to_string(fallback));
  for (Enum e : values) s.choices.emplace_back(to_string(e));
  s.get = [field, slot](const LossSpec& l) {
    return nlohmann::json(std::string(to_string(options_of<Options>(l, slot).*field)));
  };
  s.set = [field, values, slot](LossSpec& l, const nlohmann::json& v) {
    for (Enum e : values) {
      if (to_string(e) == v.get<std::string>()) edit_options<Options>(l, slot).*field = e;
    }
  };
  return s;
}

// Parses the kind's table from the "loss" object into `loss` (options reset to the kind's defaults first), in
// the table's order: type and range checks, settings that do not apply refused by name, required ones demanded.
void parse_settings(const SettingTable& table, detail::ObjectReader& reader, LossSpec& loss);
// Writes the settings that apply at their values into the resolved "loss" object.
void resolve_settings(const SettingTable& table, const LossSpec& loss, nlohmann::json& out);
// Whether the setting means something in this case (its condition holds).
bool setting_applies(const SettingTable& table, const Setting& setting, const LossSpec& loss);
// The entry named `key`, or null.
const Setting* find_setting(const SettingTable& table, std::string_view key);

}  // namespace lossverify
