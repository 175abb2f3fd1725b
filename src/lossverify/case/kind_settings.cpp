#include "lossverify/case/kind_settings.hpp"

#include <algorithm>

#include "lossverify/case/json_reader.hpp"

namespace lossverify {

using nlohmann::json;

const Setting* find_setting(const SettingTable& table, std::string_view key) {
  const auto it = std::find_if(table.begin(), table.end(), [&](const Setting& s) { return s.key == key; });
  return it == table.end() ? nullptr : &*it;
}

bool setting_applies(const SettingTable& table, const Setting& setting, const LossSpec& loss) {
  if (!setting.applies) return true;
  const Setting* other = find_setting(table, setting.applies->key);
  if (other == nullptr) return false;
  if (!setting_applies(table, *other, loss)) return false;
  const json value = other->get(loss);
  const auto& values = setting.applies->values;
  return std::find(values.begin(), values.end(), value) != values.end();
}

namespace {

json read_value(const Setting& s, detail::ObjectReader& r) {
  switch (s.type) {
    case Setting::Type::boolean:
      return r.boolean(s.key, s.fallback.get<bool>());
    case Setting::Type::choice: {
      const std::string value = r.string(s.key);
      if (std::find(s.choices.begin(), s.choices.end(), value) == s.choices.end()) {
        r.fail(s.key, "expected " + s.allowed() + ", got \"" + value + "\"");
      }
      return value;
    }
    case Setting::Type::integer: {
      const std::int64_t value = r.integer(s.key);
      if (!s.in_range(static_cast<double>(value)))
        r.fail(s.key, "must be " + s.allowed() + ", got " + json(value).dump());
      return value;
    }
    case Setting::Type::number:
      break;
  }
  const double value = r.number(s.key);
  if (!s.in_range(value)) r.fail(s.key, "must be " + s.allowed() + ", got " + json(value).dump());
  return value;
}

// A key that does not apply is refused by name; 0 leaves it unset (`--set key=0` beside the setting it needed).
void refuse_unless_zero(const Setting& s, detail::ObjectReader& r) {
  if (!r.has(s.key)) {
    r.allow(s.key);
    return;
  }
  const json& value = r.raw(s.key);
  if (!(value.is_number() && value.get<double>() == 0.0)) {
    r.fail(s.key, "applies to " + s.applies->words + " only (0 leaves it unset)");
  }
}

}  // namespace

void parse_settings(const SettingTable& table, detail::ObjectReader& r, LossSpec& loss) {
  for (const Setting& s : table) {
    const json fallback = s.fallback_from.empty() ? s.fallback : find_setting(table, s.fallback_from)->get(loss);
    if (!setting_applies(table, s, loss)) {
      refuse_unless_zero(s, r);
      s.set(loss, s.fallback);
      continue;
    }
    if (r.has(s.key)) {
      s.set(loss, read_value(s, r));
      continue;
    }
    if (s.required) r.fail_here(s.required_message);
    r.allow(s.key);
    s.set(loss, fallback);
  }
}

void resolve_settings(const SettingTable& table, const LossSpec& loss, json& out) {
  for (const Setting& s : table) {
    if (!setting_applies(table, s, loss)) continue;
    json value = s.get(loss);
    if (s.zero_is_off && !s.written_when_off && value == json(0.0)) continue;
    out[s.key] = std::move(value);
  }
}

}  // namespace lossverify
