#include "lossverify/impl/plugin/settings_block.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "lossverify/core/errors.hpp"

namespace lossverify::plugin_host {

namespace {

void require_plain(const std::string& text) {
  if (text.find_first_of(std::string("\t\n\0", 3)) != std::string::npos) {
    throw InternalError("a setting's name or choice holds a tab, newline or NUL: " + text);
  }
}

}  // namespace

std::string encode_settings(std::string_view kind, const std::vector<EncodedSetting>& settings) {
  std::string block(kind);
  require_plain(block);
  block += '\n';
  for (const EncodedSetting& s : settings) {
    require_plain(s.name);
    require_plain(s.choice);
    char value[64];
    if (s.type == LV_SETTING_NUMBER) {
      std::snprintf(value, sizeof value, "%a", s.number);
    } else {
      std::snprintf(value, sizeof value, "%lld", static_cast<long long>(s.integer));
    }
    block += std::to_string(static_cast<int>(s.type)) + '\t' + s.name + '\t' +
             (s.type == LV_SETTING_CHOICE ? s.choice : std::string(value)) + '\n';
  }
  return block;
}

SettingsBlock::SettingsBlock(std::string_view block) : text_(block) {
  const std::size_t first = text_.find('\n');
  if (first == std::string::npos) {
    ok_ = false;
    text_.clear();
    return;
  }
  // Split in place: every field becomes a NUL-terminated string inside text_ (which no longer changes size).
  std::vector<std::size_t> starts;
  text_[first] = '\0';
  std::size_t at = first + 1;
  while (at < text_.size()) {
    const std::size_t tab1 = text_.find('\t', at);
    const std::size_t tab2 = tab1 == std::string::npos ? tab1 : text_.find('\t', tab1 + 1);
    const std::size_t end = tab2 == std::string::npos ? tab2 : text_.find('\n', tab2 + 1);
    if (end == std::string::npos) {
      ok_ = false;
      break;
    }
    text_[tab1] = text_[tab2] = text_[end] = '\0';
    starts.insert(starts.end(), {at, tab1 + 1, tab2 + 1});
    at = end + 1;
  }
  for (std::size_t k = 0; ok_ && k < starts.size(); k += 3) {
    const char* type = text_.c_str() + starts[k];
    const char* value = text_.c_str() + starts[k + 2];
    lv_setting s{};
    s.name = text_.c_str() + starts[k + 1];
    s.type = static_cast<lv_setting_type>(std::atoi(type));
    s.choice = "";
    char* stop = nullptr;
    errno = 0;
    if (s.type == LV_SETTING_CHOICE) {
      s.choice = value;
    } else if (s.type == LV_SETTING_NUMBER) {
      s.number = std::strtod(value, &stop);
      ok_ = ok_ && *stop == '\0';
    } else if (s.type == LV_SETTING_INTEGER || s.type == LV_SETTING_BOOLEAN) {
      s.integer = std::strtoll(value, &stop, 10);
      s.number = static_cast<double>(s.integer);
      ok_ = ok_ && *stop == '\0' && errno == 0;
    } else {
      ok_ = false;
    }
    entries_.push_back(s);
  }
}

}  // namespace lossverify::plugin_host
