// The cross-entropy kind (docs/spec.md §3): l = lse - sum_v q_v x_v + w_z lse^2 over the softcapped logits,
// with label smoothing in the PyTorch or Megatron convention.
#include "lossverify/kinds/cross_entropy/cross_entropy_parts.hpp"

#include <array>

#include "lossverify/case/case.hpp"
#include "lossverify/case/json_reader.hpp"
#include "lossverify/case/kind_settings.hpp"
#include "lossverify/impl/catalogue.hpp"
#include "lossverify/kinds/cross_entropy/cross_entropy_options.hpp"
#include "lossverify/plugin.h"

namespace lossverify {

namespace {

using nlohmann::json;

class CrossEntropyKind final : public LossKind {
 public:
  std::string_view name() const override { return "cross_entropy"; }
  bool rows_independent() const override { return true; }   // its protocol is per row
  bool gradient_in_place() const override { return true; }  // its gradient kernels: per element, every row
  std::string_view summary() const override {
    return "softmax cross-entropy against the label, with label smoothing, z-loss and softcap; reduction "
           "mean|sum|none, upstream_weights";
  }

  const SettingTable& settings() const override {
    using O = CrossEntropyOptions;
    static const SettingTable table = [] {
      Setting ignore_index;
      ignore_index.key = "ignore_index";
      ignore_index.type = Setting::Type::integer;
      ignore_index.fallback = -100;
      ignore_index.get = [](const LossSpec& l) { return json(l.ignore_index); };
      ignore_index.set = [](LossSpec& l, const json& v) { l.ignore_index = v.get<std::int64_t>(); };
      return SettingTable{
          number_setting("softcap", &O::softcap, 0.0)
              .range(kMinSoftcap, kMaxSoftcap)
              .or_zero_for_off()
              .described("logits become c tanh(x / c)")
              .shrinks_as("no softcap")
              .v1_struct(),
          number_setting("label_smoothing", &O::label_smoothing, 0.0)
              .range(0.0, 1.0, false, true)
              .described("alpha: the target distribution's weight spread over the vocabulary")
              .shrinks_as("no label smoothing")
              .v1_struct(),
          choice_setting("smoothing_convention", &O::convention,
                         std::array{SmoothingConvention::pytorch, SmoothingConvention::megatron},
                         SmoothingConvention::pytorch)
              .described("pytorch q = (1-a)[v=l] + a/V; megatron q = (1-a)[v=l] + a/(V-1)[v!=l]")
              .shrinks_as("pytorch smoothing convention")
              .v1_struct(),
          number_setting("z_loss_weight", &O::z_loss_weight, 0.0)
              .range(0.0, kMaxZLossWeight)
              .described("w_z: loss += w_z lse^2")
              .shrinks_as("no z-loss")
              .v1_struct(),
          ignore_index.described("the label of a token that does not count").v1_struct(),
      };
    }();
    return table;
  }

  // A dump comes from foreign code, where a silent default convention turns correct Megatron-style smoothing
  // into a false alarm (or hides a convention bug).
  void require_explicit(const LossSpec& loss, const json& l, const std::string& source) const override {
    if (cross_entropy_options(loss).label_smoothing <= 0.0) return;
    if (l.is_object() && l.contains("smoothing_convention")) return;
    detail::fail_at(source, "$.loss.smoothing_convention",
                    "label_smoothing > 0 needs an explicit convention: \"pytorch\" (q = (1-a)[v=l] + a/V, as "
                    "torch.nn.functional.cross_entropy and TransformerEngine) or \"megatron\" (q = (1-a)[v=l] + "
                    "a/(V-1)[v!=l], as Megatron-LM's vocab_parallel_cross_entropy); they differ by a constant on "
                    "every non-target gradient, so a wrong guess fails correct code");
  }

  KindInputs inputs() const override { return {true, false}; }

  std::string row_sum_rule() const override { return "sum_v grad = w_t 2 w_z lse for every token"; }
  std::string row_sum_exemption(const LossSpec& loss) const override {
    return cross_entropy_options(loss).softcap != 0.0 ? "softcap changes the invariant: not applicable" : "";
  }

  std::vector<Implementation> catalogue() const override { return cross_entropy_catalogue(); }

  bool models_logit_error() const override { return true; }
  std::unique_ptr<KindReference> reference(const Case& c, const InputSource& inputs) const override {
    return make_cross_entropy_reference(c, inputs);
  }

  std::optional<DeviceRowModel> device_row_model(const Case& c) const override {
    DeviceRowModel m;
    m.softcap = cross_entropy_options(c.loss).softcap;
    m.z_loss_weight = cross_entropy_options(c.loss).z_loss_weight;
    const TargetWeights q = cross_entropy_target_weights(c);
    m.q_on = q.on;
    m.q_off = q.off;
    return m;
  }

  // full-vocab-through-tp: every rank's kernel holds the whole gathered row.
  VocabRange kernel_columns(const BugSwitches& bugs, VocabRange own, std::int64_t vocab) const override {
    return bugs.full_vocab_through_tp ? VocabRange{0, vocab} : own;
  }
  void cpu_micro_batch(const CpuMicroBatch& batch) const override { cross_entropy_cpu_micro_batch(batch); }

  std::optional<int> plugin_kind() const override { return LV_LOSS_CROSS_ENTROPY; }
  // The v1 structure's fields, for plugins built before lv_rank_inputs.settings.
  void plugin_settings(const LossSpec& spec, lv_rank_inputs& settings) const override {
    const CrossEntropyOptions& o = cross_entropy_options(spec);
    settings.loss.label_smoothing = o.label_smoothing;
    settings.loss.smoothing_convention =
        o.convention == SmoothingConvention::megatron ? LV_SMOOTHING_MEGATRON : LV_SMOOTHING_PYTORCH;
    settings.loss.z_loss_weight = o.z_loss_weight;
    settings.loss.softcap = o.softcap;
  }
};

}  // namespace

const CrossEntropyOptions& cross_entropy_options(const LossSpec& loss) { return options_of<CrossEntropyOptions>(loss); }
CrossEntropyOptions& edit_cross_entropy_options(LossSpec& loss) { return edit_options<CrossEntropyOptions>(loss); }

std::string_view to_string(SmoothingConvention c) { return c == SmoothingConvention::pytorch ? "pytorch" : "megatron"; }

std::unique_ptr<LossKind> make_cross_entropy_kind() { return std::make_unique<CrossEntropyKind>(); }

}  // namespace lossverify
