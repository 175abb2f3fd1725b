#include "lossverify/kind_api/settings.hpp"

#include "lossverify/core/strings.hpp"

namespace lossverify {

std::string format_bound(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e5) return std::to_string(static_cast<long long>(v));
  const double exponent = std::log10(std::fabs(v));
  if (std::fabs(v) > 0.0 && exponent == std::round(exponent)) {
    return std::string(v < 0 ? "-" : "") + "1e" + std::to_string(static_cast<int>(std::lround(exponent)));
  }
  return nlohmann::json(v).dump();  // the shortest text that reads back as v
}

std::string Setting::allowed() const {
  switch (type) {
    case Type::boolean:
      return "true or false";
    case Type::choice: {
      std::string names;
      for (const std::string& c : choices) append_to_list(names, c, "|");
      return "one of " + names;
    }
    case Type::number:
    case Type::integer:
      break;
  }
  std::string text;
  if (std::isfinite(low) || std::isfinite(high)) {
    text = std::string("in ") + (low_open ? "(" : "[") + format_bound(low) + ", " + format_bound(high) +
           (high_open ? ")" : "]");
  } else {
    text = type == Type::integer ? "an integer" : "a finite number";
  }
  return zero_is_off ? "0 (off) or " + text : text;
}

}  // namespace lossverify
