#pragma once
// A kind's settings on their way to a plugin (lv_rank_inputs.settings): lossverify writes them into the shared region
// as one block of text, whole, and the plugin host turns the block back into the lv_setting array the plugin reads,
// so neither side names a setting. One line per setting, "TYPE\tNAME\tVALUE" (TYPE an lv_setting_type; a number in
// C99 hexadecimal, exact), after a first line with the kind's name.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lossverify/plugin.h"

namespace lossverify::plugin_host {

struct EncodedSetting {
  std::string name;
  lv_setting_type type = LV_SETTING_NUMBER;
  double number = 0.0;
  std::int64_t integer = 0;
  std::string choice;
};

// The block for `kind` and its settings; names and choices must hold no tab, newline or NUL (InternalError).
std::string encode_settings(std::string_view kind, const std::vector<EncodedSetting>& settings);

// The lv_setting array a block describes, with the strings it points into. An ill-formed block (which only a
// corrupted region makes) leaves ok() false.
class SettingsBlock {
 public:
  explicit SettingsBlock(std::string_view block);
  SettingsBlock(const SettingsBlock&) = delete;
  SettingsBlock& operator=(const SettingsBlock&) = delete;

  bool ok() const { return ok_; }
  const char* kind() const { return text_.c_str(); }
  const lv_setting* data() const { return entries_.empty() ? nullptr : entries_.data(); }
  std::int64_t size() const { return static_cast<std::int64_t>(entries_.size()); }

 private:
  std::string text_;  // the block, its separators turned into NULs
  std::vector<lv_setting> entries_;
  bool ok_ = true;
};

}  // namespace lossverify::plugin_host
