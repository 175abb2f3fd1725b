#include "lossverify/impl/kind_case.hpp"

#include "lossverify/case/kind_settings.hpp"
#include "lossverify/kind_api/loss_kind.hpp"
#include "lossverify/kind_api/stage.hpp"

namespace lossverify {

Case kind_case_of(const Case& c, const BugSwitches& bugs) {
  Case kind_case = c;
  if (c.loss.stage == nullptr) return kind_case;
  const SettingTable& table = kind_of(c.loss).settings();
  for (const auto& [key, value] : c.loss.stage->kind_settings_under(bugs)) {
    if (const Setting* s = find_setting(table, key)) s->set(kind_case.loss, value);
  }
  return kind_case;
}

}  // namespace lossverify
