#include "lossverify/kind_api/registry.hpp"

#include <mutex>

#include "lossverify/case/case.hpp"
#include "lossverify/core/errors.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_parts.hpp"
#include "lossverify/kinds/kd/kd_parts.hpp"
#include "lossverify/kinds/lm_head/lm_head_parts.hpp"
#include "lossverify/kinds/policy/policy_parts.hpp"
#include "lossverify/kinds/router/router_parts.hpp"
#include "lossverify/outputs/rank_output.hpp"

namespace lossverify {

std::int64_t LossKind::scope_values_width(const Case& c) const {
  return scope_values_name().empty() ? 0 : c.shape.vocab;
}

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::unique_ptr<LossKind>> kinds;
  std::vector<std::unique_ptr<Stage>> stages;
  Registry() {
    kinds.push_back(make_cross_entropy_kind());
    kinds.push_back(make_kd_kind());
    kinds.push_back(make_policy_kind());
    kinds.push_back(make_router_kind());
    stages.push_back(make_lm_head_stage());
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

std::vector<Implementation> LossKind::catalogue() const { return {}; }

double effective_gradient_scale(const Case& c, std::int64_t step_valid_tokens) {
  const double scale = c.framework.gradient_scale(c.layout);
  if (!c.loss.kind->divides_by_step_tokens(c.loss)) return scale;
  return scale / static_cast<double>(std::max<std::int64_t>(step_valid_tokens, 1));
}
std::vector<Implementation> Stage::catalogue() const { return {}; }
std::vector<std::int64_t> Stage::gradient_rows(const Case&, const RankAssignment& assignment) const {
  std::vector<std::int64_t> all(assignment.rows.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::int64_t>(i);
  return all;
}
const SettingTable& Stage::settings() const {
  static const SettingTable none;
  return none;
}

const LossKind* find_loss_kind(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (const auto& kind : r.kinds) {
    if (kind->name() == name) return kind.get();
  }
  return nullptr;
}

std::vector<const LossKind*> loss_kinds() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<const LossKind*> out;
  for (const auto& kind : r.kinds) out.push_back(kind.get());
  return out;
}

void register_loss_kind(std::unique_ptr<LossKind> kind) {
  if (!kind) throw InternalError("register_loss_kind: no kind");
  if (find_loss_kind(kind->name()) != nullptr) {
    throw InternalError("register_loss_kind: a loss kind named \"" + std::string(kind->name()) + "\" exists");
  }
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.kinds.push_back(std::move(kind));
}

const LossKind& default_loss_kind() { return *registry().kinds.front(); }

const Stage* find_stage(std::string_view name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (const auto& stage : r.stages) {
    if (stage->name() == name) return stage.get();
  }
  return nullptr;
}

std::vector<const Stage*> stages() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<const Stage*> out;
  for (const auto& stage : r.stages) out.push_back(stage.get());
  return out;
}

void register_stage(std::unique_ptr<Stage> stage) {
  if (!stage) throw InternalError("register_stage: no stage");
  if (find_stage(stage->name()) != nullptr) {
    throw InternalError("register_stage: a stage named \"" + std::string(stage->name()) + "\" exists");
  }
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.stages.push_back(std::move(stage));
}

}  // namespace lossverify
