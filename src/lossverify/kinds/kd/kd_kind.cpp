// The KD kind (docs/spec.md §3): T^s KL(P || Q) of the teacher P = softmax(y / T) to the student
// Q = softmax(x / T), with the T^2 factor optional (s = 2 or 0).
#include "lossverify/kinds/kd/kd_parts.hpp"

#include <cmath>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/case/tolerances.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/kd/kd_options.hpp"
#include "lossverify/plugin.h"

namespace lossverify {

namespace {

using nlohmann::json;

double t2_power(const LossSpec& loss) { return kd_options(loss).t2_scaling ? 2.0 : 0.0; }

class KdKind final : public LossKind {
 public:
  std::string_view name() const override { return "kd"; }
  bool rows_independent() const override { return true; }   // its protocol is per row
  bool gradient_in_place() const override { return true; }  // its gradient kernels: per element, every row
  std::string_view summary() const override {
    return "forward KL from teacher logits at a temperature; reduction mean|sum|none, upstream_weights";
  }

  const SettingTable& settings() const override {
    static const SettingTable table = {
        number_setting("temperature", &KdOptions::temperature, 1.0)
            .range(0.0, kMaxTemperature, true, false)
            .described("T: both softmaxes of logits / T")
            .shrinks_as("temperature 1")
            .v1_struct(),
        boolean_setting("t2_scaling", &KdOptions::t2_scaling, true)
            .described("scale the loss by T^2 (its gradient by T)")
            .v1_struct(),
    };
    return table;
  }

  // Generated logits / T beyond 200: float32 rounding of the scaled logits, not a bug, decides the verdict.
  void validate(const Case& c) const override {
    auto check = [&](double mean, double scale, const std::string& path) {
      const double reach = generated_reach(mean, scale);
      if (reach / kd_options(c.loss).temperature > kMaxScaledLogit) {
        detail::fail_at(c.source, path,
                        "generated logits / temperature reach " + json(reach / kd_options(c.loss).temperature).dump() +
                            ", beyond 200, where float32 rounding of logits / T decides the verdict (raise the "
                            "temperature or lower the scale)");
      }
    };
    check(c.inputs.mean, c.inputs.scale, "$.inputs.scale");
    if (!c.inputs.teacher.same_as_student) {
      check(c.inputs.teacher.mean, c.inputs.teacher.scale, "$.inputs.teacher.scale");
      check_temperature_reach(c);
    }
  }

  // At a large temperature T^s KL(P || Q) tends to T^(s-2) Var_v(y_v - x_v) / 2, while the loss's absolute floor
  // (atol T^s: a correct float32 kernel's cancellation of two log-softmaxes of about log V each) grows as T^s:
  // past the temperature where that floor exceeds a tenth of the loss, a missing T^2 or a local softmax passes the
  // loss check, and a few times further every check (kd-no-t2 at T = 1e5). So T is bounded by
  // sqrt(0.05 Var / atol) for the generated inputs (docs/cases.md, "Value ranges").
  static void check_temperature_reach(const Case& c) {
    const auto variance = [&](double scale) {
      return c.inputs.distribution == LogitDistribution::uniform ? scale * scale / 3.0 : scale * scale;
    };
    const double spread = variance(c.inputs.scale) + variance(c.inputs.teacher.scale);
    const double atol = effective_tolerance(c, "loss").atol;
    const double limit = std::sqrt(0.05 * spread / atol);
    if (kd_options(c.loss).temperature > limit) {
      detail::fail_at(c.source, "$.loss.temperature",
                      json(kd_options(c.loss).temperature).dump() + " is beyond " + json(std::floor(limit)).dump() +
                          ", where the loss's float32 floor (atol T^2) exceeds a tenth of T^2 KL (about " +
                          json(spread / 2.0).dump() +
                          " for these inputs) and a missing T^2 would pass: lower the temperature or raise the "
                          "logits' scale");
    }
  }

  KindInputs inputs() const override { return {false, true}; }
  double loss_scale(const LossSpec& loss) const override {
    return std::pow(kd_options(loss).temperature, t2_power(loss));
  }
  double grad_scale(const LossSpec& loss) const override {
    return std::pow(kd_options(loss).temperature, t2_power(loss) - 1.0);
  }

  std::string row_sum_rule() const override { return "sum_v grad = w_t 2 w_z lse for every token"; }

  std::vector<Implementation> catalogue() const override { return kd_catalogue(); }

  bool models_logit_error() const override { return true; }
  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    (void)inputs;
    return make_kd_reference(c);
  }

  std::optional<DeviceRowModel> device_row_model(const Case& c) const override {
    DeviceRowModel m;
    m.teacher = true;
    m.labels = false;
    m.temperature = kd_options(c.loss).temperature;
    m.teacher_grad_scale = std::pow(kd_options(c.loss).temperature, t2_power(c.loss) - 1.0);
    return m;
  }

  void cpu_micro_batch(const CpuMicroBatch& batch) const override { kd_cpu_micro_batch(batch); }

  std::optional<int> plugin_kind() const override { return LV_LOSS_KD; }
  // The v1 structure's fields, for plugins built before lv_rank_inputs.settings.
  void plugin_settings(const LossSpec& spec, lv_rank_inputs& settings) const override {
    settings.loss.temperature = kd_options(spec).temperature;
    settings.loss.t2_scaling = kd_options(spec).t2_scaling ? 1 : 0;
  }
};

}  // namespace

const KdOptions& kd_options(const LossSpec& loss) { return options_of<KdOptions>(loss); }
KdOptions& edit_kd_options(LossSpec& loss) { return edit_options<KdOptions>(loss); }

std::unique_ptr<LossKind> make_kd_kind() { return std::make_unique<KdKind>(); }

}  // namespace lossverify
